"""Triton's per-model statistics for the whole node, with several front-door processes.

Each front-door process counts the requests it carries in a small file of its own in the node's
private registry directory (``kserve_shm``): ``s-<model, hex>-<pid>``, eight int64 counters,
memory-mapped, written only by that process. A statistics request sums every process's file, so
any process answers for the node, as Triton's one server does (perf_analyzer takes the model's
counts before and after a window and fails when they did not move: with per-process counts a
window whose two requests landed on different processes failed). Counts are monotone and
aligned, so a reader sees each one whole; a file outlives its process (counts are cumulative for
the node's lifetime) and the first front door of a node starts them from zero.
"""

from __future__ import annotations

import mmap
import os
from typing import Optional

import numpy as np

FIELDS = ("success", "success_ns", "fail", "fail_ns", "queue_ns", "compute_ns", "items", "last_ms")
SUCCESS, SUCCESS_NS, FAIL, FAIL_NS, QUEUE_NS, COMPUTE_NS, ITEMS, LAST_MS = range(len(FIELDS))
SIZE = 8 * len(FIELDS)
PREFIX = "s-"


def _file(model: str, pid: int) -> str:
    return f"{PREFIX}{model.encode().hex()}-{pid}"


class NodeStats:
    """This process's counters (``counters``) and the node's sums (``totals``). ``dir_fd=None``:
    this process only."""

    def __init__(self, dir_fd: Optional[int] = None):
        self.dir_fd = dir_fd
        self._mine: dict[str, np.ndarray] = {}
        self._maps: list[mmap.mmap] = []

    @staticmethod
    def wipe(dir_fd: int) -> None:
        """A node's first front door: counts start at zero, as a restarted Triton's do."""
        for n in os.listdir(dir_fd):
            if n.startswith(PREFIX):
                os.unlink(n, dir_fd=dir_fd)

    def counters(self, model: str) -> np.ndarray:
        c = self._mine.get(model)
        if c is None:
            if self.dir_fd is None:
                c = np.zeros(len(FIELDS), np.int64)
            else:
                fd = os.open(_file(model, os.getpid()), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600,
                             dir_fd=self.dir_fd)
                try:
                    os.ftruncate(fd, SIZE)
                    mm = mmap.mmap(fd, SIZE)
                finally:
                    os.close(fd)
                self._maps.append(mm)
                c = np.ndarray(len(FIELDS), np.int64, buffer=mm)
            c = self._mine[model] = c
        return c

    def _files(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for n in os.listdir(self.dir_fd):
            if n.startswith(PREFIX):
                model_hex, _, _ = n[len(PREFIX):].rpartition("-")
                try:
                    out.setdefault(bytes.fromhex(model_hex).decode(), []).append(n)
                except ValueError:
                    continue
        return out

    def models(self) -> set[str]:
        return set(self._mine) if self.dir_fd is None else set(self._files())

    def totals(self, model: str) -> np.ndarray:
        if self.dir_fd is None:
            return self._mine.get(model, np.zeros(len(FIELDS), np.int64)).copy()
        total = np.zeros(len(FIELDS), np.int64)
        latest = 0
        for n in self._files().get(model, []):
            try:
                fd = os.open(n, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
            except FileNotFoundError:
                continue
            with os.fdopen(fd, "rb") as f:
                data = f.read(SIZE)
            if len(data) == SIZE:
                c = np.frombuffer(data, np.int64)
                total += c
                latest = max(latest, int(c[LAST_MS]))
        total[LAST_MS] = latest  # the latest inference, not a sum
        return total

    def close(self) -> None:
        self._mine.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a caller still holds a view: the map goes with the process
                pass
        self._maps.clear()
