"""Triton's trace extension in the front door: timestamps of sampled requests, written in
Triton's JSON trace format (its ``qa/common/trace_summary.py`` reads them), with the settings
API of tritonclient's ``get_trace_settings`` / ``update_trace_settings``.

A trace's timestamps come from three processes on one clock (CLOCK_MONOTONIC, Triton's
steady_clock): the front door (the protocol's receive and send, REQUEST_START, REQUEST_END),
and the dispatcher's reply timing (QUEUE_START: the request reached the dispatcher;
COMPUTE_START: its batch was sent to a worker; COMPUTE_END: the worker's answer reached the
dispatcher), and the worker's (its model's run: COMPUTE_INPUT_END to COMPUTE_OUTPUT_START).
Compute therefore spans the hand-offs to the worker and back: its "input" is the hand-off and
the worker's reading of the inputs, its "output" the writing of the outputs and the hand-off
back.

The settings are the node's, not one process's: several front-door processes share the ports,
and an update one of them answers applies to all. They live in a small file of the node's
private registry directory (``kserve_shm``; wiped when a new run of the node starts), with a
generation each process checks, by a read of shared memory, before it samples a request; the
node-wide trace count, trace ids and file indices change under the file's lock, taken only
for a sampled request or an update.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import time
from dataclasses import dataclass
from typing import Optional

import grpc
import numpy as np

from .kserve_common import KServeError, invalid
from .node_files import flocked, read_small_file, replace_whole

log = logging.getLogger("batchyard.frontend")

OFF, TIMESTAMPS, TENSORS = "OFF", "TIMESTAMPS", "TENSORS"
FIELDS = ("level", "rate", "count", "log_frequency")
# Triton's names of them in the API (trace_file and trace_mode are answered, never set).
API_NAMES = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count", "log_frequency": "log_frequency"}
STATE_FILE = "trace"  # in the registry directory: the header
SETTINGS_FILE = "trace-setting.json"  # beside it, replaced whole at each change (a kill mid-write leaves the old one)
MAX_SETTING_BYTES = 1 << 20  # the node's setting file: a few hundred bytes a model
HEADER = 4  # int64s before the settings' JSON: generation, last trace id, next file index, file started
GEN, LAST_ID, NEXT_INDEX, STARTED = range(HEADER)
_INT = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")  # what C++'s std::stoi reads of a string (its prefix; ASCII only)
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass(frozen=True)
class Setting:
    level: tuple = (OFF,)
    rate: int = 1000  # one request in this many is traced
    count: int = -1  # traces left to take; -1: no limit
    log_frequency: int = 0  # 0: each trace appended to the file; N: every N traces to file.<index>

    def to_json(self) -> dict:
        return {"level": list(self.level), "rate": self.rate, "count": self.count, "log_frequency": self.log_frequency}


def _setting(d: dict) -> Setting:
    return Setting(tuple(d["level"]), int(d["rate"]), int(d["count"]), int(d["log_frequency"]))


# ------------------------------------------------------------------ parsing, as Triton's
def _stoi(name: str, text: str, low: int, high: int, sep: str = " ") -> int:
    """A value as Triton reads it (std::stoi: a leading integer, the rest ignored), with its
    errors. ``sep``: its HTTP route writes 'got:-2' for a count below -1, its gRPC one 'got: -2'."""
    m = _INT.match(text)
    if m is None:
        raise invalid(f"Unable to parse '{name}', got: {text}")
    v = int(m.group())
    if not INT32_MIN <= v <= INT32_MAX:
        raise invalid(f"Unable to parse '{name}', value is out of range [ {low}, {high} ], got: {text}")
    if name == "trace_count" and v < -1:
        raise invalid(f"Unable to parse '{name}'. Expecting value >= -1, got:{sep}{text}")
    return v


def _level(values: list) -> Optional[tuple]:
    """The levels asked for; None for no change (an empty list over HTTP, as Triton reads it).
    Triton ignores a name it does not know; a level written wrong ("TIMESTAMP") then changed
    nothing and said so to no one: refused here. TENSORS is Triton's and not Batchyard's."""
    if OFF in values:
        if len(values) != 1:
            raise invalid("Expect only one trace level 'OFF' is specified")
        return (OFF,)
    for v in values:
        if v == TENSORS:
            raise KServeError(grpc.StatusCode.UNIMPLEMENTED, "trace level TENSORS is not supported by Batchyard "
                              "(TIMESTAMPS is)")
        if v != TIMESTAMPS:
            raise invalid(f"unknown trace level '{v}': expected OFF or TIMESTAMPS")
    return (TIMESTAMPS,) if values else None


def parse_update(settings: dict, http: bool) -> dict:
    """{API name: None (clear: back to the fallback) or its values} -> {field: value or None};
    the values are a list of strings (gRPC), or over HTTP a string (a list for the level).
    A name Triton does not know is ignored, as Triton ignores it."""
    if "trace_file" in settings:
        raise KServeError(grpc.StatusCode.UNIMPLEMENTED,
                          "trace file location can not be updated through network protocol")
    out = {}
    for api, field in API_NAMES.items():
        if api not in settings:
            continue
        value = settings[api]
        if http:
            if value is None:
                out[field] = None
                continue
            if field == "level":
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise invalid("'trace_level' must be an array of strings")
                values = value
            elif not isinstance(value, str):
                raise invalid(f"'{api}' must be a string (as \"{value}\"), or null to clear it")
            else:
                values = [value]
        else:
            values = list(value)
            if not values:
                out[field] = None
                continue
            if field != "level" and len(values) > 1:
                raise invalid(f"expect only 1 value for '{api}'")
        if field == "level":
            level = _level(values)
            if level is not None:
                out[field] = level
        elif field == "count":
            out[field] = _stoi(api, values[0], -1, INT32_MAX, "" if http else " ")
        else:
            # A uint32, read by stoi and cast: "-1" is 4294967295, as Triton answers it.
            out[field] = _stoi(api, values[0], 0, (1 << 32) - 1) % (1 << 32)
    return out


# ------------------------------------------------------------------ one trace
class Trace:
    """One sampled request: its id, model, request id and timestamps, (name, ns) in the order taken."""

    __slots__ = ("id", "model", "request_id", "stamps", "log_frequency", "owner")

    def __init__(self, trace_id: int, model: str, request_id: str, log_frequency: int, owner: str):
        self.id, self.model, self.request_id = trace_id, model, request_id
        self.log_frequency, self.owner = log_frequency, owner
        self.stamps: list[tuple[str, int]] = []

    def stamp(self, name: str, ns: Optional[int] = None) -> None:
        self.stamps.append((name, time.monotonic_ns() if ns is None else ns))

    def stamp_reply(self, timing) -> None:
        """The dispatcher's three times, from a reply's timing (a reply with none adds nothing).
        Its arrival is the start of the dispatcher's step that read the request, which may
        precede the front door's send by that step's length: no earlier than REQUEST_START."""
        if timing is not None and timing.arrival_ns:
            start = next((ns for name, ns in reversed(self.stamps) if name == "REQUEST_START"), 0)
            queued = max(timing.arrival_ns, start)
            started = max(timing.dispatched_ns, queued)
            done = max(timing.done_ns, started)
            self.stamp("QUEUE_START", queued)
            self.stamp("COMPUTE_START", started)
            if timing.compute_end_ns and timing.compute_us:  # the model's run, as the worker timed it
                ran = min(max(timing.compute_end_ns, started), done)
                self.stamp("COMPUTE_INPUT_END", max(ran - timing.compute_us * 1000, started))
                self.stamp("COMPUTE_OUTPUT_START", ran)
            self.stamp("COMPUTE_END", done)

    def json(self) -> str:
        """Triton's records of it: the trace's, then one a timestamp, comma-joined."""
        head = {"id": self.id, "model_name": self.model, "model_version": 1}
        if self.request_id:  # Triton leaves an empty one out
            head["request_id"] = self.request_id
        return ",".join([json.dumps(head, separators=(",", ":")),
                         *(f'{{"id":{self.id},"timestamps":[{{"name":"{n}","ns":{ns}}}]}}' for n, ns in self.stamps)])


# ------------------------------------------------------------------ the node's tracer
class Tracer:
    """The node's trace settings, seen from one front-door process, and its traces.

    ``default``: the config's setting (the global one at the node's start, and what clearing a
    global field goes back to); ``file``: where traces are written ("" : nowhere, so no level
    but OFF can be set); ``dir_fd``: the node's registry directory, or None for this process's
    own settings (a front door whose registry is its own: its traces then go to
    ``file``.pid-<pid>, where another such process cannot overwrite them). ``node_clock``: the
    dispatcher's times are on this host's clock (an ipc endpoint); over tcp they are left out.
    """

    def __init__(self, default: Setting = Setting(), file: str = "", dir_fd: Optional[int] = None,
                 node_clock: bool = True):
        self.default, self.node_clock = default, node_clock
        self.file = f"{file}.pid-{os.getpid()}" if file and dir_fd is None else file
        self._dir_fd = dir_fd
        self._local = b""  # the settings, where the process keeps its own
        self._closed = False
        self._last_error = self._last_write_error = ""
        if dir_fd is None:
            self._fd = os.memfd_create("batchyard-trace", os.MFD_CLOEXEC)
        else:
            self._fd = os.open(STATE_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                               dir_fd=dir_fd)
        with self._locked():
            if os.fstat(self._fd).st_size < HEADER * 8:  # the node's first front door: the config's setting
                os.ftruncate(self._fd, HEADER * 8)
                self._write(self._initial())
        self._map = mmap.mmap(self._fd, HEADER * 8)
        self._header = np.ndarray(HEADER, np.int64, buffer=self._map)
        self._gen = -1
        self._state: dict = {}
        self._on = False  # any setting that samples
        self._samples: dict[str, int] = {}  # this process's requests seen, by setting (Triton's sample_)
        self._held: dict[tuple, list[str]] = {}  # traces waiting for their log_frequency, by (setting, N)

    # -------------------------------------------------------------- the shared state
    def _locked(self):
        return flocked(self._fd)

    def _initial(self) -> dict:
        return {"global": self.default.to_json(), "models": {}}

    def _read(self) -> dict:
        """Under the lock. A setting that is not there (a front door killed between making the
        header and the setting: every later request of the node failed on it), or that no front
        door wrote (another shape, a FIFO: one of another shape raised TypeError out of every
        request's sampling, and a FIFO held the loop in open), is the config's."""
        if self._dir_fd is None:
            return json.loads(self._local)
        try:
            return _checked_state(json.loads(read_small_file(SETTINGS_FILE, MAX_SETTING_BYTES, self._dir_fd,
                                                             follow_links=False)))
        except (FileNotFoundError, ValueError) as e:
            if not isinstance(e, FileNotFoundError):
                log.error("the node's trace setting %s is none a front door wrote (%s): the config's setting "
                          "replaces it", SETTINGS_FILE, e)
            state = self._initial()
            self._publish(state)  # (a new generation: the other processes drop what they had)
            return state

    def _write(self, state: dict) -> None:
        data = json.dumps(state).encode()
        if self._dir_fd is None:
            self._local = data
            return
        replace_whole(SETTINGS_FILE, data, 0o600, self._dir_fd)

    def _publish(self, state: dict) -> None:
        """Under the lock: new settings, then their generation, which tells the other processes.
        (A count taken down by a sampled trace is written without one: the processes would
        otherwise count their requests afresh at every trace.)"""
        self._write(state)
        self._header[GEN] += 1

    def _refresh(self) -> None:
        gen = int(self._header[GEN])
        if gen == self._gen:
            return
        with self._locked():
            self._state, self._gen = self._read(), int(self._header[GEN])
        # New settings: Triton makes new setting objects, which count their requests afresh and
        # write what they held (the old ones' destructor).
        self._samples.clear()
        self._write_held()
        g = self._state["global"]
        self._on = bool(self.file) and any(
            _effective(g, m)["level"] != [OFF] for m in [{}, *self._state["models"].values()])

    # -------------------------------------------------------------- settings
    def settings(self, model: str = "") -> dict:
        """Triton's answer: the model's setting (the global one's where it has none of its own)."""
        with _unreadable_as_internal():
            return self._settings(model)

    def _settings(self, model: str) -> dict:
        self._refresh()
        with self._locked():  # the counts as they are now (sampled traces take them down)
            state = self._read()
        s = _setting(_effective(state["global"], state["models"].get(model, {}) if model else {}))
        return {"trace_level": list(s.level), "trace_rate": str(s.rate), "trace_count": str(s.count),
                "log_frequency": str(s.log_frequency), "trace_file": self.file, "trace_mode": "triton"}

    def _effective(self, model: str) -> dict:
        return _effective(self._state["global"], self._state["models"].get(model, {}) if model else {})

    def update(self, model: str, new: dict) -> None:
        """Apply ``new`` ({field: value, or None to clear it}, from parse_update) to the global
        setting ("") or the model's, as Triton's UpdateTraceSetting does: a field a model does
        not set follows the global one; a global field cleared goes back to the config's; a
        model left with no field of its own follows the global setting whole. A setting that
        would trace and cannot is refused."""
        with _unreadable_as_internal():
            self._update(model, new)

    def _update(self, model: str, new: dict) -> None:
        with self._locked():
            state = self._read()
            if model:
                mine = dict(state["models"].get(model, {}))
                for k, v in new.items():
                    if v is None:
                        mine.pop(k, None)
                    else:
                        mine[k] = list(v) if k == "level" else v
                s = _setting(_effective(state["global"], mine))
            else:
                g, default = dict(state["global"]), self.default.to_json()
                for k, v in new.items():
                    g[k] = default[k] if v is None else list(v) if k == "level" else v
                s = _setting(g)
            if s.level != (OFF,) and (s.rate == 0 or not self.file or s.count == 0):
                # Triton's reasons; a spent count (0) is invalid too, with none given
                why = ("sample rate must be non-zero" if s.rate == 0 else
                       "trace file name is not given" if not self.file else "")
                raise invalid(f"Attempting to set invalid trace setting :{why}")
            if model:
                if mine:
                    state["models"][model] = mine
                else:
                    state["models"].pop(model, None)
            else:
                state["global"] = g
            self._publish(state)
        self._refresh()

    # -------------------------------------------------------------- sampling
    def sample(self, model: str, request_id: str = "") -> Optional[Trace]:
        """A trace for this request when its setting samples it (Triton's SampleTrace: every
        ``rate``-th request this process sees under the setting, while its count lasts), else
        None. Costs a shared-memory read when nothing is traced. The node's setting that cannot
        be read or written (its folder full: clients' shared-memory regions share /dev/shm) is
        logged, and the request goes untraced: it failed INTERNAL."""
        if self._closed:
            return None
        try:
            return self._sample(model, request_id)
        except (OSError, ValueError) as e:
            if str(e) != self._last_error:  # (once a kind, not once a request)
                self._last_error = str(e)
                log.error("the node's trace setting could not be read or written; requests go untraced: %s", e)
            return None

    def _sample(self, model: str, request_id: str) -> Optional[Trace]:
        if int(self._header[GEN]) != self._gen:
            self._refresh()
        if not self._on:
            return None
        owner = model if model in self._state["models"] else ""
        s = self._effective(owner)
        if s["level"] == [OFF] or s["rate"] == 0 or s["count"] == 0:
            return None
        n = self._samples.get(owner, 0) + 1
        self._samples[owner] = n
        if n % s["rate"]:
            return None
        with self._locked():
            state = self._read()
            own = "count" in state["models"].get(owner, {})  # the model's own count, else the global one
            where = state["models"][owner] if own else state["global"]
            if where["count"] == 0:  # another process took the last one
                # (so that this one's next requests need not take the lock to learn it)
                (self._state["models"][owner] if own else self._state["global"])["count"] = 0
                return None
            if where["count"] > 0:
                where["count"] -= 1
                self._write(state)
            self._header[LAST_ID] += 1
            trace_id = int(self._header[LAST_ID])
        return Trace(trace_id, model, request_id, s["log_frequency"], owner)

    # -------------------------------------------------------------- writing
    def finish(self, trace: Trace) -> None:
        """The trace is complete: appended to the trace file now, or held until its setting's
        log_frequency of them are, then written to the file's next index. A failed write is
        logged, never the request's failure. (One that ends after the front door closed this,
        a request cancelled late in its stop, is dropped.)"""
        if self._closed:
            return
        try:
            if trace.log_frequency == 0:
                self._append(trace.json())
                return
            held = self._held.setdefault((trace.owner, trace.log_frequency), [])
            held.append(trace.json())
            if len(held) >= trace.log_frequency:
                full = held[:]
                held.clear()  # (written or not: held again, a failing disk grew them without bound)
                self._write_index(full)
        except OSError as e:
            if str(e) != self._last_write_error:  # (once a kind, not once a trace)
                self._last_write_error = str(e)
                log.error("trace %d could not be written to %s (and more may not be): %s", trace.id, self.file, e)

    def _append(self, records: str) -> None:
        """Onto the trace file, kept a JSON array after every write (Triton's closes its array at
        exit); the node's first trace starts the file afresh, as a Triton server's does."""
        with self._locked():
            if not self._header[STARTED]:
                # The node's first trace: the old file replaced whole (a link there is replaced,
                # not followed), so a first write that fails leaves it as it was.
                replace_whole(self.file, f"[{records}]".encode(), 0o640)
                self._header[STARTED] = 1
                return
            # (no link followed: a link planted where the file goes had another file truncated)
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
            try:
                size = os.fstat(fd).st_size
                closed = size and os.pread(fd, 1, size - 1) == b"]"
                data = f",{records}]".encode() if closed else f"[{records}]".encode()
                at = size - 1 if closed else size
                try:
                    if os.pwrite(fd, data, at) != len(data):  # a full disk writes part of it
                        raise OSError(f"wrote part of the trace ({len(data)} bytes) only")
                except OSError:
                    # The file as it was, still a JSON array: a trace cut short left it none for good.
                    os.ftruncate(fd, size)
                    if closed:
                        os.pwrite(fd, b"]", size - 1)
                    raise
            finally:
                os.close(fd)

    def _write_index(self, held: list[str]) -> None:
        with self._locked():
            index = int(self._header[NEXT_INDEX])
            self._header[NEXT_INDEX] += 1
        fd = os.open(f"{self.file}.{index}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o640)
        with os.fdopen(fd, "w") as f:
            f.write("[" + ",".join(held) + "]")

    def _write_held(self) -> None:
        for held in self._held.values():
            if held:
                try:
                    self._write_index(held)
                except OSError as e:
                    log.error("%d traces could not be written to %s.<index>: %s", len(held), self.file, e)
        self._held.clear()

    def close(self) -> None:
        """Writes what this process holds (Triton writes a setting's traces when it ends)."""
        if self._closed:
            return
        self._closed = True
        self._write_held()
        self._header = None  # (its view of the map, which would keep the map from closing)
        with contextlib.suppress(BufferError):
            self._map.close()
        os.close(self._fd)


def trace_file_problem(path: str) -> str:
    """Why traces cannot be written to ``path`` on this host ("" when they can): a front door
    says so at its start. Not a config error: a unit's own view of the file system (PrivateTmp,
    ProtectSystem) may differ from the host's where the config is checked, and tracing must never
    stop a node from serving."""
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        return f"{path} is a folder"
    if not os.path.isdir(folder):
        return f"there is no folder {folder}"
    if not os.access(folder, os.W_OK):
        return f"the folder {folder} is not writable here (under the shipped units, use /var/log/batchyard)"
    return ""


@contextlib.contextmanager
def _unreadable_as_internal():
    """The node's setting that cannot be read or written (its folder full) is INTERNAL with the
    reason, not a traceback."""
    try:
        yield
    except (OSError, ValueError) as e:
        raise KServeError(grpc.StatusCode.INTERNAL, f"the node's trace setting could not be read or written: {e}") from None


def _checked_state(state) -> dict:
    """The node's setting as _write wrote it, or ValueError."""
    def fields(d, all_of: bool) -> bool:
        return (isinstance(d, dict) and (set(d) == set(FIELDS) if all_of else set(d) <= set(FIELDS))
                and all(isinstance(v, list) and all(isinstance(x, str) for x in v) if k == "level"
                        else type(v) is int for k, v in d.items()))

    if not (isinstance(state, dict) and set(state) == {"global", "models"} and fields(state["global"], True)
            and isinstance(state["models"], dict) and all(fields(m, False) for m in state["models"].values())):
        raise ValueError("no trace setting of this version's shape")
    return state


def _effective(g: dict, mine: dict) -> dict:
    return {k: mine.get(k, g[k]) for k in FIELDS}


async def http_traced(tracer: "Tracer", request, answer) -> object:
    """The HTTP answer ``answer(traced, received)`` makes (it appends the request's trace to
    ``traced`` once its model is known and its setting samples it; ``received``: when aiohttp had
    the headers), sent here when traced, not by aiohttp after the return, to see when it is
    done; the trace finished whatever happens."""
    received = time.monotonic_ns()
    traced: list = []
    try:
        response = await answer(traced, received)
        if traced:
            traced[0].stamp("HTTP_SEND_START")
            await response.prepare(request)
            await response.write_eof()
            traced[0].stamp("HTTP_SEND_END")
        return response
    finally:
        if traced:
            tracer.finish(traced[0])
