"""Shared-memory tensor handoff.

Ownership story (docs/protocol.md, "Shared memory"):
- A *client* owns every segment it uses, for inputs and for outputs. Segments are created
  once, pre-faulted (MAP_POPULATE) and reused through a pool allocator, because creating a
  segment per message was slower than sending the bytes over ZeroMQ at every size measured.
- Segment names are ``batchyard_<owner pid>_<random>``: the owner is in the name.
- The client unlinks its segments on ``close()`` and at interpreter exit. When a client
  dies without that, ``reap_orphans()`` unlinks segments whose owner pid is gone; the
  dispatcher runs it on a slow timer and every new client runs it once at start.
- Workers only map segments by name (cached, LRU-bounded), read inputs without copying and
  write outputs in place. They create nothing, so a worker crash leaves nothing behind.
- The dispatcher never maps a segment and never touches tensor bytes.

We use os.open on /dev/shm + mmap rather than multiprocessing.shared_memory because on
Python < 3.13 attaching through the latter registers the segment with the resource tracker,
which unlinks it when the *attaching* process exits.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import mmap
import os
import re
import secrets
import threading
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
PREFIX = "batchyard_"
_NAME_RE = re.compile(r"^batchyard_(\d+)_[0-9a-f]+$")
ALIGN = 64  # cache-line aligned regions; also satisfies every dtype's alignment


class ShmError(Exception):
    """A shared-memory reference cannot be honoured (missing segment, out of bounds)."""


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class Segment:
    """One mapped POSIX shared-memory segment."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name = name
        self.mm = mm
        self.size = len(mm)
        self.owner = owner

    @classmethod
    def create(cls, size: int) -> "Segment":
        name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        fd = os.open(_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            # Pre-fault now so the first tensor written does not pay for page faults.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.unlink(_path(name))
            raise
        finally:
            os.close(fd)
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        try:
            fd = os.open(_path(name), os.O_RDWR)
        except FileNotFoundError:
            raise ShmError(f"shared-memory segment {name!r} does not exist") from None
        except OSError as e:
            raise ShmError(f"cannot open shared-memory segment {name!r}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ShmError(f"shared-memory segment {name!r} is empty")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            # A numpy view still points into the mapping; the OS unmaps it at exit. The
            # segment's *name* is what leaks across processes, and unlink handles that.
            pass
        if self.owner:
            try:
                os.unlink(_path(self.name))
            except FileNotFoundError:
                pass


@dataclass(frozen=True)
class Region:
    segment: str
    offset: int
    nbytes: int


class ShmPool:
    """Client-owned pool: a few large segments carved by a first-fit allocator.

    Thread-safe (a lock around alloc/free) because results returned to user code may be
    garbage-collected on any thread.
    """

    def __init__(self, segment_bytes: int = 64 << 20):
        self.segment_bytes = segment_bytes
        self._segments: dict[str, Segment] = {}
        self._free: dict[str, list[tuple[int, int]]] = {}  # sorted (offset, size) per segment
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    def alloc(self, nbytes: int) -> Region:
        size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        with self._lock:
            if self._closed:
                raise ShmError("shared-memory pool is closed")
            for name, free in self._free.items():
                for i, (off, sz) in enumerate(free):
                    if sz >= size:
                        if sz == size:
                            del free[i]
                        else:
                            free[i] = (off + size, sz - size)
                        return Region(name, off, nbytes)
            seg = Segment.create(max(self.segment_bytes, size))
            self._segments[seg.name] = seg
            self._free[seg.name] = [(size, seg.size - size)] if seg.size > size else []
            return Region(seg.name, 0, nbytes)

    def free(self, region: Region) -> None:
        size = max(ALIGN, (region.nbytes + ALIGN - 1) // ALIGN * ALIGN)
        with self._lock:
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

    def view(self, region: Region) -> memoryview:
        return memoryview(self._segments[region.segment].mm)[region.offset:region.offset + region.nbytes]

    def segment_names(self) -> list[str]:
        return list(self._segments)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for seg in self._segments.values():
                seg.close()
            self._segments.clear()
            self._free.clear()
        atexit.unregister(self.close)


class SegmentCache:
    """Worker side: segments mapped by name, least recently used evicted past ``capacity``."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self._lru: collections.OrderedDict[str, Segment] = collections.OrderedDict()

    def get(self, name: str) -> Segment:
        seg = self._lru.get(name)
        if seg is not None:
            self._lru.move_to_end(name)
            return seg
        seg = Segment.attach(name)
        self._lru[name] = seg
        while len(self._lru) > self.capacity:
            _, old = self._lru.popitem(last=False)
            old.close()
        return seg

    def buffer(self, name: str, offset: int, nbytes: int) -> memoryview:
        """A writable view of ``nbytes`` at ``offset``; ShmError if out of bounds."""
        seg = self.get(name)
        if offset + nbytes > seg.size:
            # The segment may have been replaced by one of another size: remap once.
            self.forget(name)
            seg = self.get(name)
            if offset + nbytes > seg.size:
                raise ShmError(f"shared-memory range [{offset}, {offset + nbytes}) is outside "
                               f"segment {name!r} of {seg.size} bytes")
        return memoryview(seg.mm)[offset:offset + nbytes]

    def forget(self, name: str) -> None:
        seg = self._lru.pop(name, None)
        if seg is not None:
            seg.close()

    def close(self) -> None:
        for seg in self._lru.values():
            seg.close()
        self._lru.clear()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphans(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink Batchyard segments whose owner process no longer exists. Returns their names."""
    reaped = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return reaped
    for name in names:
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(shm_dir, name))
                reaped.append(name)
            except OSError:
                pass
    return reaped


def live_segments(pid: int | None = None, shm_dir: str = SHM_DIR) -> list[str]:
    """Batchyard segments on this host, optionally only those owned by ``pid``."""
    out = []
    for name in os.listdir(shm_dir):
        m = _NAME_RE.match(name)
        if m and (pid is None or int(m.group(1)) == pid):
            out.append(name)
    return out

