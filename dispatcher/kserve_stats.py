"""Triton's per-model statistics for the whole node, with several front-door processes.

Each front-door process counts the requests it carries in a small file of its own in the node's
private registry directory (``kserve_shm``, whose owner clears them with it), written only by
that process: ``s-<digest of the model's name>-<pid>``, nine int64 counters, memory-mapped,
then the model's name. (A file named by the model's name itself passed the 255-byte limit at a
125-character name, and every infer of that model failed.) A statistics request sums every
process's file, so any process answers for the node, as Triton's one server does
(perf_analyzer takes the model's counts before and after a window and fails when they did not
move: with per-process counts a window whose two requests landed on different processes
failed). Counts are monotone and aligned, so a reader sees each one whole; a file outlives its
process (counts are cumulative for the node's lifetime) and the first front door of a node
starts them from zero.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from typing import Optional

import numpy as np

FIELDS = ("success", "success_ns", "fail", "fail_ns", "queue_ns", "compute_ns", "items", "last_ms", "exec_ppm")
SUCCESS, SUCCESS_NS, FAIL, FAIL_NS, QUEUE_NS, COMPUTE_NS, ITEMS, LAST_MS, EXEC_PPM = range(len(FIELDS))
# EXEC_PPM: executions (batches) in millionths. A request of k items in a batch of B items adds
# k/B of that batch, so the requests of one batch add up to one execution whichever front-door
# process carried each of them.
PPM = 1_000_000
SIZE = 8 * len(FIELDS)
PREFIX = "s-"


def _file(model: str, pid: int) -> str:
    return f"{PREFIX}{hashlib.sha256(model.encode()).hexdigest()[:32]}-{pid}"


class NodeStats:
    """This process's counters (``counters``) and the node's sums (``totals``). ``dir_fd=None``:
    this process only."""

    def __init__(self, dir_fd: Optional[int] = None):
        self.dir_fd = dir_fd
        self._mine: dict[str, np.ndarray] = {}
        self._maps: list[mmap.mmap] = []

    def counters(self, model: str) -> np.ndarray:
        c = self._mine.get(model)
        if c is None:
            if self.dir_fd is None:
                c = np.zeros(len(FIELDS), np.int64)
            else:
                fd = os.open(_file(model, os.getpid()), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600,
                             dir_fd=self.dir_fd)
                try:
                    os.pwrite(fd, model.encode(), SIZE)  # the counters before it read zero
                    mm = mmap.mmap(fd, SIZE)
                finally:
                    os.close(fd)
                self._maps.append(mm)
                c = np.ndarray(len(FIELDS), np.int64, buffer=mm)
            c = self._mine[model] = c
        return c

    def _read(self, name: str) -> Optional[tuple[str, np.ndarray]]:
        """(model, counters) of one process's file, or None for another kind of file."""
        if not name.startswith(PREFIX):
            return None
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        try:
            model = data[SIZE:].decode()
        except UnicodeDecodeError:
            return None
        return (model, np.frombuffer(data[:SIZE], np.int64)) if model else None

    def totals(self) -> dict[str, np.ndarray]:
        """model -> its counters summed over the node's processes (LAST_MS: the latest)."""
        if self.dir_fd is None:
            return {m: c.copy() for m, c in self._mine.items()}
        out: dict[str, np.ndarray] = {}
        for model, c in filter(None, map(self._read, os.listdir(self.dir_fd))):
            total = out.setdefault(model, np.zeros(len(FIELDS), np.int64))
            latest = max(total[LAST_MS], c[LAST_MS])
            total += c
            total[LAST_MS] = latest
        return out

    def close(self) -> None:
        self._mine.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a caller still holds a view: the map goes with the process
                pass
        self._maps.clear()
