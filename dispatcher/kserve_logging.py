"""Triton's logging extension: ``get_log_settings`` / ``update_log_settings`` turn the front door's
info, warning and error records on and off, its verbose records (per-request lines, Triton's
``--log-verbose``) up and down, and its timestamps to ISO 8601, with Triton 2.51's rules and words.

The setting is the node's: every front-door process on the ports follows it. It is a small JSON
file in the node's registry folder, replaced whole at each change under a lock; a process reads
it again when its name points at a new file, at each settings call it answers and at its next
registry sweep (within SWEEP_S), so a change made through one process reaches the others within
a second. A front door whose registry is its own keeps a setting of its own.

The dispatcher and the workers are other processes: their logs keep the level they started with.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Optional

import grpc

from .kserve_common import KServeError
from .node_files import flocked, read_small_file, replace_whole

SETTINGS_FILE = "log-setting.json"  # in the registry folder, replaced whole at each change
LOCK_FILE = "log-setting.lock"  # held while a change is read, made and written
FORMATS = ("default", "ISO8601")
ISO8601 = "%Y-%m-%dT%H:%M:%SZ"
_BOOLS = ("log_info", "log_warning", "log_error")
FILE_REFUSED = "log file location can not be updated through network protocol"

log = logging.getLogger("batchyard.frontend")


def setting_of_level(level: int) -> dict:
    """The setting the front door starts with: what its log level (``--log-level``) writes."""
    return {"log_info": level <= logging.INFO, "log_warning": level <= logging.WARNING,
            "log_error": level <= logging.ERROR, "log_verbose_level": 1 if level <= logging.DEBUG else 0,
            "log_format": "default"}


def _verbose(value: int) -> int:
    """What Triton 2.51 makes of a verbose level: the low 32 bits, read as an int32, and 0 where
    that is negative (2**32 + 3 is 3; 2**31 + 5 and 2**64 - 1 are 0)."""
    value &= 0xFFFFFFFF
    return 0 if value >= 1 << 31 else value


def parse_http_update(body) -> dict:
    """The changes a POST /v2/logging body asks for, or Triton 2.51's error. Unknown keys and
    null values change nothing; JSON that is no object changes nothing (as Triton's)."""
    if not isinstance(body, dict):
        return {}
    changes: dict = {}
    if body.get("log_file") is not None:
        raise KServeError(grpc.StatusCode.UNIMPLEMENTED, FILE_REFUSED)
    for key in _BOOLS:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, bool):
                raise KServeError(grpc.StatusCode.INTERNAL, "attempt to access JSON non-boolean as boolean")
            changes[key] = value
    value = body.get("log_verbose_level")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
            raise KServeError(grpc.StatusCode.INTERNAL,
                              "attempt to access JSON non-unsigned-integer as unsigned-integer")
        changes["log_verbose_level"] = _verbose(value)
    value = body.get("log_format")
    if value is not None:
        if not isinstance(value, str):
            raise KServeError(grpc.StatusCode.INTERNAL, "attempt to access JSON non-string as string")
        if value not in FORMATS:
            raise KServeError(grpc.StatusCode.UNAVAILABLE, f"invalid argument for --log_format, got: {value}")
        changes["log_format"] = value
    return changes


def parse_grpc_update(settings) -> dict:
    """The changes a LogSettingsRequest's ``settings`` ask for, or Triton 2.51's error."""
    if "log_file" in settings:
        raise KServeError(grpc.StatusCode.UNIMPLEMENTED, FILE_REFUSED)
    changes: dict = {}
    for key, kind, word in [(k, "bool_param", "boolean") for k in _BOOLS] + [
            ("log_verbose_level", "uint32_param", "int32"), ("log_format", "string_param", "string")]:
        if key not in settings:
            continue
        value = settings[key]
        if value.WhichOneof("parameter_choice") != kind:
            raise KServeError(grpc.StatusCode.INVALID_ARGUMENT, f"expect {word} for '{key}'")
        got = getattr(value, kind)
        if key == "log_format" and got not in FORMATS:
            raise KServeError(grpc.StatusCode.INVALID_ARGUMENT, f"invalid argument for log_format, got: {got}")
        changes[key] = _verbose(got) if key == "log_verbose_level" else got
    return changes


class LogSettings:
    """The node's log setting, seen from one front-door process, and applied to its logging.

    ``default``: the setting at the node's start (setting_of_level); ``dir_fd``: the node's
    registry folder, or None for this process's own setting."""

    def __init__(self, default: dict, dir_fd: Optional[int] = None):
        self._dir_fd = dir_fd
        self._default = dict(default)
        self._setting = dict(default)
        self._seen: Optional[tuple] = None  # (inode, mtime) of the file the setting was read from
        self._last_error = ""  # the last failure follow() logged
        self._switch = _LevelSwitch()
        self._formatters: dict = {}  # each handler's formatter at the start ("default")
        for handler in logging.getLogger().handlers:
            self._formatters[handler] = handler.formatter
            handler.addFilter(self._switch)
        self._level = logging.getLogger("batchyard").level  # (restored at close)
        self._lock_fd = None
        if dir_fd is not None:
            self._lock_fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                    dir_fd=dir_fd)
        self._apply()
        with contextlib.suppress(OSError, ValueError):  # (a file that cannot be read: the start setting)
            self.refresh()

    def close(self) -> None:
        """This process's logging back as it was (what is logged after the front door closed)."""
        for handler, formatter in self._formatters.items():
            handler.removeFilter(self._switch)
            handler.setFormatter(formatter)
        self._formatters.clear()
        logging.getLogger("batchyard").setLevel(self._level)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -------------------------------------------------------------- the node's file
    def _stat(self) -> Optional[tuple]:
        try:
            st = os.stat(SETTINGS_FILE, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def refresh(self) -> None:
        """Reads the node's setting again where its file changed, and applies it: a file gone is
        the start setting again (every process then agrees). OSError or ValueError where the file
        cannot be read, or is no setting this module wrote; the setting in force stays."""
        if self._dir_fd is None or (seen := self._stat()) == self._seen:
            return
        if seen is None:
            self._setting, self._seen = dict(self._default), None
            self._apply()
            return
        self._setting = _checked(json.loads(read_small_file(SETTINGS_FILE, 1 << 16, self._dir_fd, follow_links=False)))
        self._seen = seen
        self._apply()

    def follow(self) -> None:
        """refresh(), its failure logged (once a kind, not at every sweep) rather than raised."""
        try:
            self.refresh()
            self._last_error = ""
        except (OSError, ValueError) as e:
            if str(e) != self._last_error:
                log.error("the node's log setting cannot be read: %s", e)
            self._last_error = str(e)

    # -------------------------------------------------------------- the calls
    def settings(self) -> dict:
        """Triton's answer."""
        try:
            self.refresh()
        except (OSError, ValueError) as e:
            raise KServeError(grpc.StatusCode.INTERNAL, f"the node's log setting cannot be read: {e}") from None
        s = self._setting
        return {"log_file": "", **{k: s[k] for k in _BOOLS},
                "log_verbose_level": s["log_verbose_level"], "log_format": s["log_format"]}

    def update(self, changes: dict) -> None:
        """Applies ``changes`` (from parse_http_update / parse_grpc_update) to the node's setting:
        all of them, or none where the setting cannot be written."""
        if not changes:
            return
        try:
            with flocked(self._lock_fd):
                try:
                    self.refresh()
                except (OSError, ValueError):  # a file that cannot be read (a link, a FIFO): replaced
                    pass
                setting = {**self._setting, **changes}
                if self._dir_fd is not None:
                    replace_whole(SETTINGS_FILE, json.dumps(setting).encode(), 0o600, self._dir_fd)
                    self._seen = self._stat()
        except (OSError, ValueError) as e:
            raise KServeError(grpc.StatusCode.INTERNAL, f"the node's log setting cannot be written: {e}") from None
        self._setting = setting
        self._apply()

    # -------------------------------------------------------------- this process's logging
    def _apply(self) -> None:
        s = self._setting
        self._switch.on = {logging.INFO: s["log_info"], logging.WARNING: s["log_warning"],
                           logging.ERROR: s["log_error"]}
        self._switch.verbose = s["log_verbose_level"] > 0
        # The front door's own loggers let their records reach the switch; other libraries'
        # keep the level the process started with.
        logging.getLogger("batchyard").setLevel(logging.DEBUG if self._switch.verbose else logging.INFO)
        for handler, formatter in self._formatters.items():
            if s["log_format"] == "ISO8601":
                iso = logging.Formatter(formatter._fmt if formatter is not None else None, datefmt=ISO8601)
                iso.converter = time.gmtime
                handler.setFormatter(iso)
            else:
                handler.setFormatter(formatter)


def _checked(setting) -> dict:
    """``setting`` as read from the node's file, or ValueError where it is no setting of this
    module's shape (the file is the node's user's to edit; one of another shape stopped every
    front door's sweep, and a restarted front door at its start)."""
    if (not isinstance(setting, dict) or set(setting) != {*_BOOLS, "log_verbose_level", "log_format"}
            or not all(isinstance(setting[k], bool) for k in _BOOLS)
            or type(setting["log_verbose_level"]) is not int or not 0 <= setting["log_verbose_level"] < 1 << 31
            or setting["log_format"] not in FORMATS):
        raise ValueError(f"{SETTINGS_FILE} holds no log setting")
    return setting


class _LevelSwitch(logging.Filter):
    """Passes a record while its level is on: INFO, WARNING and ERROR each switched apart, as
    Triton's; DEBUG while the verbose level is above 0; CRITICAL always (Triton has no such
    level, and a front door started at --log-level CRITICAL writes those)."""

    def __init__(self):
        super().__init__()
        self.on: dict = {}
        self.verbose = False

    def filter(self, record: logging.LogRecord) -> bool:
        level = record.levelno
        if level >= logging.CRITICAL:
            return True
        if level >= logging.ERROR:
            return self.on.get(logging.ERROR, True)
        if level >= logging.WARNING:
            return self.on.get(logging.WARNING, True)
        if level >= logging.INFO:
            return self.on.get(logging.INFO, True)
        return self.verbose
