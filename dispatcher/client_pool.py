"""Client-owned shared-memory pool: a few large segments carved by a first-fit allocator.

See dispatcher/shm.py for the ownership story. Thread-safe (a lock around alloc/free) because
arrays returned to user code may be garbage-collected on any thread of the client process.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import contextlib
import threading
from dataclasses import dataclass

from .errors import Cancelled
from .shm import ALIGN, Segment


@dataclass(frozen=True)
class Region:
    segment: str
    offset: int
    nbytes: int


# Oversize segments kept wholly free for reuse: a request's big input and its big output.
SPARE_OVERSIZE = 2


class ShmPool:
    """Segments carved into regions. The first ALIGN bytes of every segment are its header,
    never handed out: the dispatcher's ownership challenge is written there (shm_grants.py)."""

    def __init__(self, segment_bytes: int = 64 << 20, on_removed=None):
        self.segment_bytes = segment_bytes
        self._on_removed = on_removed  # called with a removed segment's name (the codec's grants)
        self._segments: dict[str, Segment] = {}
        self._free: dict[str, list[tuple[int, int]]] = {}  # sorted (offset, size) per segment
        self._lock = threading.Lock()
        self._holder = None  # the thread holding _lock
        self._deferred: collections.deque = collections.deque()  # frees that came while it held it
        self._closed = False
        atexit.register(self.close)

    @contextlib.contextmanager
    def _held(self):
        """The lock, and at its release the frees deferred meanwhile (``free``)."""
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                while self._deferred:
                    self._free_locked(self._deferred.popleft())
                self._holder = None

    def alloc(self, nbytes: int) -> Region:
        size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        with self._held():
            if self._closed:  # the client's: its alloc_array and requests after close() get its error
                raise Cancelled("client closed")
            for name, free in self._free.items():
                for i, (off, sz) in enumerate(free):
                    if sz >= size:
                        if sz == size:
                            del free[i]
                        else:
                            free[i] = (off + size, sz - size)
                        return Region(name, off, nbytes)
            seg = Segment.create(max(self.segment_bytes, size + ALIGN))
            self._segments[seg.name] = seg
            end = ALIGN + size
            self._free[seg.name] = [(end, seg.size - end)] if seg.size > end else []
            return Region(seg.name, ALIGN, nbytes)

    def free(self, region: Region) -> None:
        if self._holder == threading.get_ident():
            # A result array's finalizer, run by a garbage collection that started inside this
            # thread's own alloc or free: waiting for the lock, the thread waited on itself for
            # ever (an outside review; on the I/O thread it would have stopped every request).
            # Freed when that alloc or free lets the lock go.
            self._deferred.append(region)
            return
        with self._held():
            self._free_locked(region)

    def _free_locked(self, region: Region) -> None:
        size = max(ALIGN, (region.nbytes + ALIGN - 1) // ALIGN * ALIGN)
        free = self._free.get(region.segment)
        if free is None:
            return
        i = bisect.bisect_left(free, (region.offset, 0))
        free.insert(i, (region.offset, size))
        # Coalesce with the right, then the left neighbour.
        if i + 1 < len(free) and free[i][0] + free[i][1] == free[i + 1][0]:
            free[i] = (free[i][0], free[i][1] + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]
        seg = self._segments[region.segment]
        if seg.size > self.segment_bytes and free == [(ALIGN, seg.size - ALIGN)]:
            self._keep_largest_spares()

    def _keep_largest_spares(self) -> None:
        """A segment made for one request bigger than segment_bytes is free again: of those wholly
        free, the SPARE_OVERSIZE largest are kept for the next such requests, the others removed. Kept all, each
        larger request made one more (none fits the next size up): growing sizes left 20 segments,
        112 MiB of /dev/shm, for 6 MiB in use. Kept none, every large request made, pre-faulted and
        registered a segment of its own (same-size 4 MiB requests: 1.6 -> 11.7 ms)."""
        spare = [n for n, seg in self._segments.items()
                 if seg.size > self.segment_bytes and self._free[n] == [(ALIGN, seg.size - ALIGN)]]
        spare.sort(key=lambda n: self._segments[n].size, reverse=True)
        for n in spare[SPARE_OVERSIZE:]:
            self._remove(n)

    def _remove(self, name: str) -> None:
        seg = self._segments.pop(name)
        del self._free[name]
        seg.close()
        if self._on_removed is not None:
            self._on_removed(name)

    def view(self, region: Region) -> memoryview:
        return memoryview(self._segments[region.segment].mm)[region.offset:region.offset + region.nbytes]

    def write_header(self, segment: str, data: bytes) -> None:
        """Write ``data`` (at most ALIGN bytes) at offset 0 of one of this pool's segments."""
        assert len(data) <= ALIGN
        self._segments[segment].mm[:len(data)] = data

    def segment_names(self) -> list[str]:
        return list(self._segments)

    def forked_off(self) -> None:
        """In a forked child (see ClientCodec.forked_off): closed, its memory left to the parent."""
        self._lock = threading.Lock()
        self._holder = None
        self._deferred.clear()
        self._closed = True

    def close(self) -> None:
        with self._held():
            if self._closed:
                return
            self._closed = True
            for seg in self._segments.values():
                seg.close()
            self._segments.clear()
            self._free.clear()
        atexit.unregister(self.close)
