"""GPU-worker executor that drives a Triton Inference Server over gRPC with shared memory.

- Inputs and outputs never ride in gRPC message bodies: each in-flight slot owns one input and
  one output region, registered with Triton once and reused; ``close()`` unregisters and frees
  them. Regions are CUDA shared memory when the worker sees the GPU, system (POSIX) shared
  memory otherwise (``workers/triton_regions.py``).
- Region names are ``<prefix><k>-in|out`` with a prefix stable across restarts of the same
  worker, so a restarted worker first unregisters what a killed predecessor left registered,
  and never touches regions of other Triton users. Triton refuses to unregister a region while
  a request holds it (a predecessor's batch still running): the new process then numbers its
  slots past those names, and unregisters them once Triton lets go.
- Up to ``inflight`` batches at once (``async_infer``) to hide the gRPC round trip; the worker
  runtime gets completions through its wake-up pipe.
- Triton's own dynamic batching must be OFF for models we dispatch to (it would re-batch our
  batches and add its queue delay): checked at start from the model config, with a warning.
- Start: Triton unreachable, or its model listed but not ready (loading, reloading), is retried
  with back-off until ``start_timeout_s`` (it may be starting too), then ExecutorUnavailable; a
  model Triton does not list at all is CannotStart (EX_CONFIG).
- Outage: a failed call marks the connection down; calls during back-off fail at once with
  ExecutorUnavailable (the requests get UNAVAILABLE), the next call after it opens a fresh gRPC
  channel and registers the regions Triton does not list (all of them, after its restart). A
  fresh channel, because an old one keeps failing for seconds after Triton is back: gRPC's own
  reconnect back-off (1 s growing by 1.6x) outlasts ours.
- A batch whose call timed out or was cut may still run in Triton, which writes its outputs
  into the slot when it ends: the slot is held out of use until Triton lets go of its regions
  (it unregisters them then), never handed to the next batch.
- A completion hands its slot back *before* it reports the batch done: the report lets the
  dispatcher send the next batch at once, and that batch needs the slot.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from typing import Callable

import numpy as np

from batchyard.protocol import ModelSpec
from batchyard.shm import ShmError
from batchyard.validation import item_nbytes

from .runtime import CannotStart, ExecutorUnavailable, SendAgain
from .triton_model_check import TRITON_DTYPE, check_model_config
from .triton_regions import make_region, resolve_kind

log = logging.getLogger("batchyard.worker")

BACKOFF_MIN_S, BACKOFF_MAX_S = 0.2, 5.0
START_RETRY_MIN_S, START_RETRY_MAX_S = 0.5, 5.0
# Statuses that mean "Triton is not there (yet)", not "Triton said no".
UNREACHABLE = ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
# What says that Triton, not the batch, failed: unreachable, or a call cut by a channel that was
# closed (CANCELLED) or broke (UNKNOWN). An error of any other status is Triton's answer about
# this batch (the model raised, an output did not fit): that batch fails, and only that batch.
DOWN = (*UNREACHABLE, "StatusCode.CANCELLED", "StatusCode.UNKNOWN", None)
# What Triton (2.51) says when asked to unregister a region a request still holds.
IN_USE = "currently in use"
# What it answers a request naming a region it does not know (it checks before it runs any of it).
LOST_REGION = "Unable to find shared memory region"
# A slot held for a batch Triton may still run is asked back at most this often (one call per
# region), and each such call waits this long at most: it runs on the worker's main thread.
HELD_PROBE_S, PROBE_TIMEOUT_S = 1.0, 5.0
# How often a batch waiting for a running one's slot (while another is held) looks whether the
# worker is stopping (see _take_slot).
SLOT_WAIT_SLICE_S = 0.1
SLOT_WAIT_MARGIN_S = 1.0  # past the call timeout a running batch's slot is waited for
# gRPC's reconnect back-off must not add to ours (see the module docstring); a channel of its own
# (no shared subchannel) so that a fresh client really opens a fresh connection.
RECONNECT_ARGS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                  ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.use_local_subchannel_pool", 1))


def _channel_args(extra=None) -> list[tuple]:
    """tritonclient uses its defaults only when given no args at all: keep its message limits."""
    from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE

    args = dict([("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
                 ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE), *RECONNECT_ARGS])
    args.update(extra or ())
    return list(args.items())


# The first bytes of every region the executor registers stay unwritten. A client proves it may
# reference a segment by writing the dispatcher's challenge at offset 0 (shm_grants); tensors
# copied there from its request (or echoed to an output there by the model) let a client of the
# node's uid obtain a grant for this worker's region, and read other clients' batches through it.
REGION_GUARD = 64


class TritonModelError(RuntimeError):
    """Triton answered a batch with an error of the model's (or an output unlike the spec): the
    batch's requests fail INTERNAL with its message; Triton is not down."""


class TritonAnswerError(TritonModelError):
    """Triton answered the call with an error status (INTERNAL "Stub process ... is not
    healthy", say). The model runs in Triton's process, not this one, and Triton's state may
    change: at warm-up a restart may find it well (``restart_may_help``), where an output
    unlike the spec (TritonModelError) fails the same way at every start."""

    restart_may_help = True


class TritonRefusedInput(TritonAnswerError):
    """Triton answered INVALID_ARGUMENT: the batch does not fit its model (an input it needs and
    the spec lacks, two spec tensors renamed onto one). At warm-up (zeros of the spec's shapes) a
    restart meets it again: 78, where as a passing error (69) the worker restarted for ever."""

    restart_may_help = False


def _may_still_run(err) -> bool:
    """Whether the batch whose call failed with ``err`` may still be running in Triton: its call
    timed out, or was cut or never answered; not when Triton answered with an error."""
    status = err.status() if callable(getattr(err, "status", None)) else None
    return status in DOWN


class _Slot:
    """One in-flight batch's input and output regions (registered with Triton)."""

    def __init__(self, kind: str, tag: str, in_bytes: int, out_bytes: int, device: int):
        self.inp = make_region(kind, f"{tag}-in", in_bytes, device)
        try:
            self.out = make_region(kind, f"{tag}-out", out_bytes, device)
        except BaseException:
            self.inp.close()
            raise

    @property
    def regions(self):
        return (self.inp, self.out)


class TritonExecutor:
    path = "gpu"
    simulated = False

    def __init__(self, url: str, model_names: dict[str, str] | None = None, inflight: int = 2,
                 timeout_s: float = 30.0, shm: str = "auto", device: int = 0, region_prefix: str = "",
                 tensor_names: dict[str, dict[str, str]] | None = None, channel_args=None,
                 start_timeout_s: float = 60.0, backoff_s: tuple[float, float] = (BACKOFF_MIN_S, BACKOFF_MAX_S)):
        """``shm``: "auto" (CUDA if this worker sees GPU ``device``, else system), "cuda",
        "system", or "none" (tensors in gRPC bodies, for comparison). Raises RegionError when
        "cuda" cannot work on this host. ``start_timeout_s``: how long ``load`` waits for an
        unreachable Triton; ``backoff_s``: the outage back-off, first and longest."""
        import tritonclient.grpc as grpcclient

        self.grpc = grpcclient
        self.url = url
        self.model_names = model_names or {}
        self.tensor_names = tensor_names or {}  # model -> {spec tensor: Triton tensor} where they differ
        self.wire_dims: dict[str, dict[str, tuple[int, ...]]] = {}  # model -> {spec tensor: Triton's dims}, reshaped ones
        self.inflight = inflight
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.backoff_min_s, self.backoff_max_s = backoff_s
        self.shm_kind = "none" if shm == "none" else resolve_kind(shm, device)
        self.device = device
        # Without a given prefix (the worker gives a stable one), one of this executor's own:
        # load() unregisters every region under the prefix, another executor's too if shared.
        self.region_prefix = region_prefix or f"batchyard-{os.getpid()}-{secrets.token_hex(4)}-"
        self.channel_args = _channel_args(channel_args)
        self.specs: dict[str, ModelSpec] = {}
        self.client = None
        self._gen = 0  # which client: a failure seen on an older one says nothing about the current
        self._calls: dict[int, int] = {}  # generation -> its calls in flight
        # Clients a reconnect replaced while calls of theirs were in flight: closed once those end.
        self._retired: dict[int, object] = {}
        self._stale = False  # the current client saw Triton fail: the next attempt opens a fresh one
        self._slots: list[_Slot] = []
        self._free: list[_Slot] = []
        self._held: list[_Slot] = []  # their batch's call failed, but Triton may still run it
        self._leftover: set[str] = set()  # a predecessor's regions Triton would not let go yet
        self._next_probe = 0.0
        self._lock = threading.Lock()
        self._slot_back = threading.Condition(self._lock)  # a slot given back to the free ones
        self.stopping: Callable[[], bool] = lambda: False  # the worker runtime's stop, once it is set
        self._down_until = 0.0
        self._backoff = self.backoff_min_s

    @property
    def use_shm(self) -> bool:
        return self.shm_kind != "none"

    # ------------------------------------------------------------------ setup
    @property
    def batch_bound_s(self) -> float:
        """The longest this worker holds one batch (Register.batch_bound_s): a wait for a slot
        held by a timed-out call (_take_slot), then its own call, each ``timeout_s`` at most.
        The dispatcher takes the worker for hung only past it: a slow Triton model (15 s a batch,
        2 s deadlines) got the healthy worker killed and restarted, its other models' requests
        failed meanwhile."""
        return (self.timeout_s + SLOT_WAIT_MARGIN_S) + self.timeout_s + 1.0  # (and a second for the answer's way)

    def _connect(self) -> None:
        new = self.grpc.InferenceServerClient(self.url, channel_args=self.channel_args)
        with self._lock:
            # The generation moves on before the old client is let go: a callback of its calls
            # that still read the old generation took its batch for an outage (UNAVAILABLE, not
            # sent again).
            if self.client is not None:
                # Closed once its calls in flight end, not now: closed, the channel cut them
                # (CANCELLED), and a healthy batch running in Triton was failed and its slot held
                # until Triton ended it; after one call timed out, the next batches found both
                # slots held and failed UNAVAILABLE. A dead Triton ends them within timeout_s anyway.
                self._retired[self._gen] = self.client
            self._gen += 1
            self.client, self._stale = new, False
        self._close_retired()

    @staticmethod
    def _close_client(client) -> None:
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    def _call_started(self, gen: int) -> None:
        with self._lock:
            self._calls[gen] = self._calls.get(gen, 0) + 1

    def _call_ended(self, gen: int) -> None:
        with self._lock:
            left = self._calls.get(gen, 1) - 1
            if left > 0:
                self._calls[gen] = left
            else:
                self._calls.pop(gen, None)

    def _close_retired(self) -> None:
        """Close the replaced clients whose calls have all ended. On the runtime's thread (not in
        a gRPC callback of the very channel being closed)."""
        with self._lock:
            done = [g for g in self._retired if not self._calls.get(g)]
            clients = [self._retired.pop(g) for g in done]
        for c in clients:
            self._close_client(c)

    def load(self, spec: ModelSpec, factory: str = "") -> None:
        self.specs[spec.name] = spec
        first = self.client is None
        if first:
            self._connect()
        name = self.model_names.get(spec.name, spec.name)
        cfg = self._model_config(name, spec.name)
        if first and self.use_shm:
            self._at_start("clearing what this worker's previous process registered", self._clear_predecessor)
        check = check_model_config(cfg, spec, self.tensor_names.get(spec.name))
        for w in check.warnings:
            log.warning("%s", w)
        if check.problems:
            raise CannotStart("; ".join(check.problems))
        self.wire_dims[spec.name] = check.wire_dims
        if self.use_shm:
            in_b = max(sum(item_nbytes(t) for t in s.inputs) * s.max_batch for s in self.specs.values())
            out_b = max(sum(item_nbytes(t) for t in s.outputs) * s.max_batch for s in self.specs.values())
            try:
                self._at_start("registering shared memory", self._make_slots, in_b, out_b)
            except ShmError as e:  # (a traceback and exit 1, restarted for ever: /dev/shm too small for the slots)
                raise CannotStart(f"the shared-memory slots for batches to Triton cannot be made: {e} (each slot "
                                  f"holds a batch of the largest max_batch; lower [[models]] max_batch or "
                                  f"triton.inflight, give /dev/shm more room, or set triton.shm = \"none\")") from None

    def _at_start(self, what: str, call, *args) -> None:
        """``call`` during load: a refusal of Triton's is ExecutorUnavailable (one line, exit 69, the
        worker restarted), not a traceback and exit 1."""
        from tritonclient.utils import InferenceServerException

        try:
            call(*args)
        except InferenceServerException as e:
            raise ExecutorUnavailable(f"Triton at {self.url} failed {what}: {e.message()}") from None

    def _model_config(self, name: str, spec_name: str):
        """The Triton model's config. An unreachable Triton may be starting too (or restarting),
        and a model Triton lists but has not ready may be loading (or reloading, unloading):
        both are retried with back-off for ``start_timeout_s``, then ExecutorUnavailable (the
        worker exits and is restarted). Only a model Triton does not list at all is a
        configuration error: CannotStart. (Any NOT_FOUND was one, and a worker restarted while
        Triton reloaded its model exited 78, never restarted once the model was READY again.)"""
        from tritonclient.utils import InferenceServerException

        deadline = time.monotonic() + self.start_timeout_s
        delay, attempt = START_RETRY_MIN_S, 1
        while True:
            try:
                return self.client.get_model_config(name, client_timeout=self.timeout_s).config
            except InferenceServerException as e:
                if e.status() in UNREACHABLE:
                    why, detail = "unreachable", e.status().removeprefix("StatusCode.")
                elif e.status() == "StatusCode.NOT_FOUND":
                    index = self._index()
                    states = [state for m, state in index or () if m == name]
                    if index is not None and not states:
                        raise CannotStart(f"Triton at {self.url} has no model {name!r} (for {spec_name!r}); "
                                          f"it has {self._listing(index)}. Fix `triton.models` or load the model "
                                          f"in Triton") from None
                    if states:  # loading, unloading (a reload), or not loaded yet
                        why, detail = f"has model {name!r} (for {spec_name!r}) not ready", ", ".join(states)
                    else:  # cannot tell: one restart too many beats a worker never restarted
                        why = f"did not find model {name!r} (for {spec_name!r}) nor list its models"
                        detail = "NOT_FOUND"
                else:
                    raise CannotStart(f"Triton at {self.url} refused the config of model {name!r}: "
                                      f"{e.message()}") from None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ExecutorUnavailable(f"Triton at {self.url} still {why} after {attempt} attempts in "
                                              f"{self.start_timeout_s:.0f} s ({detail}): {e.message()}") from None
                wait = min(delay, left)
                log.warning("Triton at %s %s (attempt %d, %s); again in %.1f s", self.url, why, attempt, detail, wait)
                time.sleep(wait)  # a back-off between attempts, not synchronisation
                delay, attempt = min(delay * 2, START_RETRY_MAX_S), attempt + 1
                if why == "unreachable":
                    self._connect()  # a fresh channel: no gRPC back-off of its own between ours

    def _index(self) -> list[tuple[str, str]] | None:
        """(name, state) of each model (version) in Triton's repository, "not loaded" for one Triton
        gives no state; None when Triton did not list it."""
        try:
            models = self.client.get_model_repository_index(client_timeout=self.timeout_s).models
        except Exception:
            return None
        return [(m.name, m.state or "not loaded") for m in models]

    @staticmethod
    def _listing(index: list[tuple[str, str]]) -> str:
        return ", ".join(f"{m} ({state})" for m, state in index) or "no models"

    def _make_slots(self, in_bytes: int, out_bytes: int) -> None:
        """Slots for a batch of ``in_bytes`` of inputs and ``out_bytes`` of outputs (each region
        REGION_GUARD bytes more)."""
        in_bytes, out_bytes = REGION_GUARD + in_bytes, REGION_GUARD + out_bytes
        if self._slots and self._slots[0].inp.size >= in_bytes and self._slots[0].out.size >= out_bytes:
            return
        self._drop_slots()
        for tag in self._slot_tags(self.inflight):
            self._slots.append(_Slot(self.shm_kind, tag, in_bytes, out_bytes, self.device))
        self._free = list(self._slots)
        self._register_slots()
        log.info("%d %s shared-memory slots registered with Triton (%d + %d bytes each)",
                 len(self._slots), self.shm_kind, self._slots[0].inp.size, self._slots[0].out.size)

    def _slot_tags(self, n: int) -> list[str]:
        """``n`` slot tags ``<prefix><k>``, k from 0 up, past the names of regions a predecessor's
        batch still holds in Triton (registered under that name, they cannot be ours too)."""
        tags, k = [], 0
        while len(tags) < n:
            tag = f"{self.region_prefix}{k}"
            if not {f"{tag}-in", f"{tag}-out"} & self._leftover:
                tags.append(tag)
            k += 1
        return tags

    def _register_slots(self) -> None:
        for s in self._slots:
            for r in s.regions:
                r.register(self.client, self.timeout_s)

    def _ours(self, name: str) -> bool:
        """Whether region ``name`` is this worker's, or a predecessor's of the same prefix; not that of
        a worker whose name only starts like this one's ('gpu0-1' beside 'gpu0')."""
        return re.fullmatch(re.escape(self.region_prefix) + r"\d+-(in|out)", name) is not None

    def _registered_names(self) -> list[str]:
        c, t = self.client, self.timeout_s
        status = (c.get_cuda_shared_memory_status(client_timeout=t) if self.shm_kind == "cuda"
                  else c.get_system_shared_memory_status(client_timeout=t))
        return [name for name in status.regions if self._ours(name)]

    def _let_go(self, name: str) -> bool:
        """Unregister region ``name`` (a name Triton does not know is no error); False while a
        request in Triton still holds it."""
        from tritonclient.utils import InferenceServerException

        unreg = (self.client.unregister_cuda_shared_memory if self.shm_kind == "cuda"
                 else self.client.unregister_system_shared_memory)
        try:
            unreg(name, client_timeout=min(self.timeout_s, PROBE_TIMEOUT_S))
        except InferenceServerException as e:
            if IN_USE in (e.message() or ""):
                return False
            raise
        return True

    def _clear_predecessor(self) -> None:
        """Unregister every region a killed predecessor of this worker left (called while we hold
        none). One its batch still holds in Triton is left for later (_release_held): refused as
        "in use", it made every restart exit 1 until Triton finished that batch."""
        for name in self._registered_names():
            if self._let_go(name):
                log.info("unregistered Triton region %r left from before", name)
            else:
                self._leftover.add(name)
                log.warning("Triton still runs a batch of this worker's previous process in region %r: "
                            "this process's slots take other names", name)

    def _register_missing(self) -> None:
        """After a reconnect: register each slot region Triton does not list (every one, after a
        restart of Triton's). One it lists stays as it is: unregistered and registered again, a
        region a timed-out batch still held was refused ("in use"), marking Triton down again at
        every reconnect until that batch ended."""
        listed = set(self._registered_names())
        for s in self._slots:
            for r in s.regions:
                if r.name not in listed:
                    r.register(self.client, self.timeout_s)

    def _let_go_of_leftovers(self) -> None:
        """Unregister the predecessor's regions Triton has let go of since."""
        for name in list(self._leftover):
            if self._let_go(name):
                self._leftover.discard(name)
                log.info("unregistered Triton region %r left from before, Triton done with it", name)

    def _release_held(self) -> None:
        """Slots held for batches Triton may still run come back once Triton lets go of their
        regions (unregistered then, and registered again); a predecessor's names are unregistered
        then too."""
        self._next_probe = time.monotonic() + HELD_PROBE_S
        self._let_go_of_leftovers()
        with self._lock:
            held, self._held = self._held, []
        for i, slot in enumerate(held):
            try:
                released = all([self._let_go(r.name) for r in slot.regions])  # a list: ask for both
                if released:
                    for r in slot.regions:
                        r.register(self.client, min(self.timeout_s, PROBE_TIMEOUT_S))
            except BaseException:
                with self._lock:
                    self._held.extend(held[i:])
                raise
            with self._lock:
                (self._free if released else self._held).append(slot)
            if released:
                log.info("shared-memory slot %r back in use: Triton ended the batch that held it", slot.inp.name)

    def _ensure_up(self) -> None:
        """Fail fast during back-off; after it, reconnect on a fresh channel and re-register."""
        now = time.monotonic()
        with self._lock:  # (both as one _mark_down left them)
            down_until, stale = self._down_until, self._stale
        if now < down_until:
            raise ExecutorUnavailable(f"Triton at {self.url} is unreachable; retrying in "
                                      f"{down_until - now:.1f} s")
        if self._retired:
            self._close_retired()
        if stale:
            try:
                self._connect()
                if self._slots:
                    self._register_missing()
                log.info("reconnected to Triton at %s", self.url)
            except Exception as e:
                raise self._mark_down(e, self._gen) from None
        if (self._held or self._leftover) and time.monotonic() >= self._next_probe:
            try:
                self._release_held()
            except Exception as e:
                raise self._mark_down(e, self._gen) from None

    def _failure(self, err, gen: int) -> Exception:
        """What a batch whose call to Triton failed with ``err`` gets: a model error when Triton
        answered with one; otherwise Triton counts as down. Every error counted as an outage, one
        bad input took the worker out of rotation for its back-off (the dispatcher's breaker too),
        and the reconnect after it cancelled the healthy batches in flight."""
        status = err.status() if callable(getattr(err, "status", None)) else None
        msg = err.message() if callable(getattr(err, "message", None)) else str(err)
        # Triton's python backend appends the model's stack ("At:", then the server's file paths
        # and lines) to an exception's message; the client gets the exception, not the server's
        # layout.
        msg = msg.split("\nAt:\n", 1)[0].rstrip()
        if status not in DOWN and LOST_REGION in msg and self.region_prefix in msg:
            # A Triton that lost our regions (restarted while this worker was idle, gRPC
            # reconnected by itself) answers every batch so, before it runs any of it: the next
            # call reconnects and registers them again (no back-off: Triton answers), and the
            # runtime sends this batch once more. As a model error, the worker failed every
            # batch for good; as an outage, the first batch after the restart failed UNAVAILABLE.
            self._mark_down(err, gen, backoff=False)
            return SendAgain(f"Triton at {self.url} had lost this worker's regions (restarted): {msg}")
        if status in DOWN and gen != self._gen:
            # Cut by this worker's own reconnect since it was sent (the old channel's calls end
            # CANCELLED, "Channel closed!"), not by Triton: it goes again on the new one. After a
            # restart of Triton, the second of two batches in flight failed UNAVAILABLE so.
            return SendAgain(f"Triton at {self.url}: the call was cut by a reconnect: {msg}")
        if status in DOWN or self.region_prefix in msg:
            return self._mark_down(err, gen)
        if status == "StatusCode.RESOURCE_EXHAUSTED":
            # Past the gRPC message limit: this batch cannot go to this worker, another (a CPU
            # worker, no such limit) may take it; Triton itself is fine.
            return ExecutorUnavailable(f"Triton at {self.url} refused the batch: {msg}")
        if status == "StatusCode.NOT_FOUND":
            # The model is unloaded or reloading in Triton ("has no available versions"): another
            # worker serving it may take the batch (as INTERNAL, none did, and the dispatcher's
            # breaker never reacted). Triton itself answers: not marked down, which failed this
            # worker's batches of its other models for the back-off, and whose reconnect
            # cancelled those in flight.
            return ExecutorUnavailable(f"Triton at {self.url} does not serve the model now: {msg}")
        error = TritonRefusedInput if status == "StatusCode.INVALID_ARGUMENT" else TritonAnswerError
        return error(f"Triton failed the batch ({status.removeprefix('StatusCode.')}): {msg}")

    def _mark_down(self, err, gen: int, backoff: bool = True) -> ExecutorUnavailable:
        """Record a failure of client ``gen`` (``backoff``: the next call waits out the back-off;
        else it reconnects at once); returns the error the batch gets."""
        msg = err.message() if hasattr(err, "message") and callable(err.message) else str(err)
        # Under the lock: callbacks on gRPC threads and the runtime's reconnect meet here. Unlocked,
        # a reconnect between this check and the back-off's write left the new, healthy client in
        # back-off (every batch failed UNAVAILABLE for up to backoff_max_s), and two failures of one
        # client both doubled the back-off.
        with self._lock:
            fresh = gen == self._gen and not self._stale
            if fresh:
                self._stale = True
                if backoff:
                    self._down_until = time.monotonic() + self._backoff
                    waited, self._backoff = self._backoff, min(self.backoff_max_s, self._backoff * 2)
        if fresh and backoff:
            log.warning("Triton at %s failed (%s); backing off %.1f s", self.url, msg, waited)
        elif fresh:
            log.warning("Triton at %s lost this worker's regions (%s): reconnecting", self.url, msg)
        return ExecutorUnavailable(f"Triton at {self.url} is unavailable: {msg}")

    # ------------------------------------------------------------------ running
    def _prepare(self, model: str, inputs: dict[str, np.ndarray], slot: _Slot | None):
        spec = self.specs[model]
        rename = self.tensor_names.get(model, {})
        wire = self.wire_dims.get(model, {})
        n = next(iter(inputs.values())).shape[0]
        g = self.grpc
        t_inputs, t_outputs, out_layout = [], [], []
        off = REGION_GUARD
        for t in spec.inputs:
            arr = np.ascontiguousarray(inputs[t.name])
            if t.name in wire:  # the same bytes in the shape Triton takes (its dims; the model sees its reshape)
                arr = arr.reshape((n, *wire[t.name]))
            inp = g.InferInput(rename.get(t.name, t.name), list(arr.shape), TRITON_DTYPE[t.dtype])
            if slot is not None:
                slot.inp.write(off, arr)
                inp.set_shared_memory(slot.inp.name, arr.nbytes, off)
                off += arr.nbytes
            else:
                inp.set_data_from_numpy(arr)
            t_inputs.append(inp)
        off = REGION_GUARD
        for t in spec.outputs:
            nbytes = n * item_nbytes(t)
            tname = rename.get(t.name, t.name)
            out = g.InferRequestedOutput(tname)
            if slot is not None:
                out.set_shared_memory(slot.out.name, nbytes, off)
            t_outputs.append(out)
            out_layout.append((t, tname, off, wire.get(t.name, t.shape)))
            off += nbytes
        return self.model_names.get(model, model), t_inputs, t_outputs, out_layout, n

    def _read(self, result, out_layout, n: int, slot: _Slot | None) -> dict[str, np.ndarray]:
        out = {}
        for t, tname, off, wire_shape in out_layout:
            # With outputs in shared memory, the region holds the data (not result.as_numpy), as
            # many bytes as the spec's shape: an output Triton says is of another shape or type
            # left the rest of them the previous batch's, another client's output. In gRPC bodies
            # such an output was cast to the spec's type further on and returned OK.
            told = result.get_output(tname)
            got = (told.datatype, list(told.shape)) if told is not None else ("missing", [])
            want = (TRITON_DTYPE[t.dtype], [n, *wire_shape])
            if got != want:
                raise TritonModelError(f"Triton's output {tname!r} is {got[0]} {got[1]}; the spec says "
                                       f"{want[0]} {want[1]}")
            if slot is not None:
                out[t.name] = slot.out.read(off, t.dtype, (n, *t.shape))
            else:
                out[t.name] = result.as_numpy(tname).reshape((n, *t.shape))
        return out

    def run(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Synchronous path (warm-up, calibration)."""
        self._ensure_up()
        slot = self._take_slot()
        err = None
        try:
            name, ti, to, layout, n = self._prepare(model, inputs, slot)
            for again in (True, False):  # a SendAgain goes once more, as the runtime sends a submitted one
                gen = self._gen
                try:
                    res = self.client.infer(name, ti, outputs=to, client_timeout=self.timeout_s)
                    break
                except Exception as e:
                    failure = self._failure(e, gen)
                    if not (again and isinstance(failure, SendAgain)):
                        err = e
                        raise failure from None
                self._ensure_up()  # (reconnects and registers the regions again: the slot's too)
            self._backoff = self.backoff_min_s
            return self._read(res, layout, n, slot)
        finally:
            self._give_slot(slot, err)

    def submit(self, model: str, inputs: dict[str, np.ndarray], done) -> None:
        """Asynchronous path: ``done(outputs_or_exception, compute_us)`` runs on a gRPC thread
        (or on this one, for a batch that fails before it leaves). Never raises."""
        try:
            self._ensure_up()
            slot = self._take_slot()
        except ExecutorUnavailable as e:
            done(e, 0)
            return
        try:
            name, ti, to, layout, n = self._prepare(model, inputs, slot)
        except Exception as e:
            self._give_slot(slot)
            done(e, 0)
            return
        gen = self._gen
        t0 = time.perf_counter()

        def callback(result, error):
            us = int((time.perf_counter() - t0) * 1e6)
            self._call_ended(gen)
            try:
                if error is not None:
                    outcome, us = self._failure(error, gen), 0
                else:
                    self._backoff = self.backoff_min_s
                    outcome = self._read(result, layout, n, slot)  # a copy: the slot is free after it
            except Exception as e:  # never let an exception die silently on a gRPC thread
                outcome, us = e, 0
            finally:
                # Back before done(): done() lets the runtime answer the dispatcher, whose next
                # batch may reach submit() before this thread runs again, and needs this slot.
                self._give_slot(slot, error)
            done(outcome, us)

        self._call_started(gen)
        try:
            self.client.async_infer(name, ti, callback, outputs=to, client_timeout=self.timeout_s)
        except Exception as e:
            self._call_ended(gen)
            self._give_slot(slot)
            done(self._failure(e, gen), 0)

    def _take_slot(self) -> _Slot | None:
        if not self.use_shm:
            return None
        with self._lock:
            # A slot held for a timed-out batch is capacity the dispatcher still counts: its next
            # batch waits for one running now (each call ends within timeout_s) rather than fail
            # UNAVAILABLE, which took the worker out of rotation again and again while a model
            # hung (half of a 10 s load, 27 requests failed with no other worker). In slices: this
            # is the worker's main thread, and a stop meanwhile (a SIGTERM) must not wait for the
            # call's timeout (the stop grace's hard exit came first, with no leaving or goodbye).
            until = time.monotonic() + self.timeout_s + SLOT_WAIT_MARGIN_S
            while (not self._free and self._held and len(self._held) < len(self._slots) and not self.stopping()
                   and time.monotonic() < until):
                self._slot_back.wait(min(SLOT_WAIT_SLICE_S, max(0.0, until - time.monotonic())))
            if not self._free:
                # The dispatcher sends at most `inflight` batches; more (a dispatcher that lost
                # count, e.g. after its restart) fails this batch, never the worker.
                held = f" ({len(self._held)} held for batches Triton has not ended)" if self._held else ""
                raise ExecutorUnavailable(f"all {len(self._slots)} shared-memory slots of this worker are in use{held}")
            return self._free.pop()

    def _give_slot(self, slot: _Slot | None, error=None) -> None:
        """A slot back after its batch's call ended with ``error`` (None: Triton answered). A call
        that timed out or was cut leaves the batch running in Triton, which writes its outputs into
        the slot when it ends: held until Triton lets go of it (_release_held), or those outputs
        landed in the next batch's."""
        if slot is not None:
            with self._lock:
                (self._held if error is not None and _may_still_run(error) else self._free).append(slot)
                self._slot_back.notify()

    # ------------------------------------------------------------------ shutdown
    def _drop_slots(self) -> None:
        # Asked whether or not Triton was taken for down: its regions stay registered there (a
        # flag cleared then left all four registered after a call past its timeout and a clean
        # stop, their memory pinned in Triton). One Triton does not know is no error.
        if self.client is not None and self._slots:
            try:  # one Triton still uses is left to this worker's next process
                self._let_go_of_leftovers()
            except Exception:
                pass  # Triton gone: nothing registered any more
            for r in (r for s in self._slots for r in s.regions):
                try:
                    r.unregister(self.client, 5.0)
                except Exception as e:
                    if _may_still_run(e):
                        break  # no answer: Triton gone or hung, the rest would wait as long
        for s in self._slots:
            for r in s.regions:
                r.close()
        self._slots, self._free, self._held = [], [], []

    def close(self) -> None:
        self._drop_slots()
        with self._lock:
            clients, self._retired = [self.client, *self._retired.values()], {}
            self.client = None
        for c in clients:
            self._close_client(c)
