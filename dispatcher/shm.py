"""Shared-memory tensor handoff.

Ownership story (docs/protocol.md, "Shared memory"):
- A *client* owns every segment it uses, for inputs and for outputs. Segments are created
  once, pre-faulted (MAP_POPULATE) and reused through a pool allocator (client_pool.py),
  because creating a segment per message was slower than sending the bytes over ZeroMQ at
  every size measured.
- Segment names are ``batchyard_<owner pid>_<random>`` (the pid is for people reading
  /dev/shm; nothing trusts it).
- The owner holds a shared ``flock`` on each of its segments for as long as it lives. The client
  unlinks its segments on ``close()`` and at interpreter exit. When a client dies without that,
  the kernel drops its locks, and ``reap_orphans()`` unlinks a segment only if it can take an
  exclusive lock on it: a live owner in another PID namespace (a sidecar container sharing
  /dev/shm) still holds its lock, whatever pids this process can see. A segment is created
  under a temporary name, locked, and only then renamed to its final name, so no live segment
  is ever visible unlocked. The dispatcher runs the reaper on a slow timer, in slices between
  its decisions, and every new client runs it once at start, over a bounded number of names.
- Workers open client segments by name (cached, LRU-bounded). A segment that only the worker's
  own user can shrink (``SegmentCache.maps``) is mapped: inputs are read without copying and
  outputs written in place. Any other is never mapped: inputs are read with ``preadv`` straight
  into the batch's arrays (the one copy a batch of several requests needs anyway) and outputs
  written with ``pwrite``. Under a mapping, a client that shrank its file made the worker's
  next access a SIGBUS, which killed it, and no check before the access closes that race; a
  read or write by offset past the end just comes up short. A client that can shrink a file
  only the worker's user may write could kill the worker outright, so mapping costs nothing
  there. A Triton-backed GPU worker also owns the segments it registers with
  Triton; they carry its pid, so the reaper below removes them if it dies.
- The dispatcher never maps a segment and never touches tensor bytes.

We use os.open on /dev/shm + mmap rather than multiprocessing.shared_memory because on
Python < 3.13 attaching through the latter registers the segment with the resource tracker,
which unlinks it when the *attaching* process exits.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import mmap
import os
import re
import secrets
import stat
import time

SHM_DIR = "/dev/shm"
PREFIX = "batchyard_"
_NAME_RE = re.compile(r"^batchyard_(\d+)_[0-9a-f]+$")
_NEW_SUFFIX = ".new"  # a segment being created: not yet locked, so not yet under its final name
ALIGN = 64  # cache-line aligned regions; also satisfies every dtype's alignment
# A half-created segment (temporary name) younger than this is left alone: its creator may be
# between open and flock. One older than this was left by a crash during creation.
REAP_GRACE_S = 60.0
# Directory entries a new client's reaper looks at (~6 us each when each is a segment to open and
# lock: ~25 ms at most), however many names anyone has made in /dev/shm (200,000 took seconds).
# A host has a few segments per live client; orphans past this many go at the dispatcher's janitor.
CLIENT_REAP_ENTRIES = 4096


class ShmError(Exception):
    """A shared-memory reference cannot be honoured (missing segment, out of bounds)."""


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


class Segment:
    """One POSIX shared-memory segment: a client's own (created and mapped), or one a worker opened."""

    def __init__(self, name: str, mm: mmap.mmap | None, owner: bool, lock_fd: int = -1, fd: int = -1,
                 file_id: tuple = ()):
        self.name = name
        self.mm = mm  # None for a segment a worker reads and writes by offset (SegmentCache.maps)
        self.size = len(mm) if mm is not None else 0  # of the mapping
        self.owner = owner
        self.lock_fd = lock_fd  # the owner's open fd, holding its shared flock
        self.fd = fd  # an attached segment's open fd
        self.file_id = file_id  # (st_dev, st_ino) of the file mapped
        self.pid = os.getpid()  # the owner's process: a forked child's exit must not unlink it

    @classmethod
    def create(cls, size: int) -> "Segment":
        name = f"{PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
        tmp = _path(name + _NEW_SUFFIX)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # "alive": held until close() or this process ends
            # Allocated now, not on first touch: a sparse segment of a full /dev/shm (Docker's is
            # 64 MiB, the default pool) made the worker writing an output into it die of SIGBUS.
            # ENOSPC here is this client's error instead.
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise ShmError(f"cannot allocate {size} bytes of shared memory in {SHM_DIR}: {e.strerror}") from None
            # Pre-fault now so the first tensor written does not pay for page faults.
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            os.rename(tmp, _path(name))  # the lock is on the inode: it comes along
        except BaseException:
            os.unlink(tmp)
            os.close(fd)
            raise
        return cls(name, mm, owner=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str, file_id: tuple = ()) -> "Segment":
        """Open the segment ``name``: a regular file, reached without following a symlink, and
        when ``file_id`` is given, that very file (the one its client proved it owns). Mapped
        only when this process's user alone may write it (``SegmentCache.maps``)."""
        try:
            fd = os.open(_path(name), os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ShmError(f"shared-memory segment {name!r} does not exist") from None
        except OSError as e:
            raise ShmError(f"cannot open shared-memory segment {name!r}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ShmError(f"shared-memory segment {name!r} is not a regular file")
            if file_id and (st.st_dev, st.st_ino) != file_id:
                raise ShmError(f"shared-memory segment {name!r} is not the file registered under that name "
                               f"(replaced since; register it again)")
            mm = None
            if SegmentCache.maps(st) and st.st_size:
                try:
                    mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED)
                except (ValueError, OSError) as e:
                    # Shrunk by its client since the fstat ("mmap length is greater than file
                    # size"), or too large to map: the request's fault, not the worker's end (a
                    # client shrinking and growing its segment in a loop took a worker down 3
                    # times in 2 runs with this ValueError; an outside review).
                    raise ShmError(f"cannot map shared-memory segment {name!r}: {e}") from None
        except BaseException:
            os.close(fd)
            raise
        return cls(name, mm, owner=False, fd=fd, file_id=(st.st_dev, st.st_ino))

    def close(self) -> None:
        try:
            if self.mm is not None:
                self.mm.close()
        except BufferError:
            # A numpy view still points into the mapping; the OS unmaps it at exit. The
            # segment's *name* is what leaks across processes, and unlink handles that.
            pass
        if self.owner and os.getpid() == self.pid:
            try:
                os.unlink(_path(self.name))
            except FileNotFoundError:
                pass
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SegmentCache:
    """Worker side: segments opened by name, least recently used closed past ``capacity``;
    mapped, or read and written by offset (``maps``, module docstring)."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self._lru: collections.OrderedDict[str, Segment] = collections.OrderedDict()

    def get(self, name: str, file_id: tuple = ()) -> Segment:
        return self._get(name, file_id)[0]

    def _get(self, name: str, file_id: tuple = ()) -> tuple[Segment, os.stat_result]:
        """The segment and its file's fstat (one per use: ``view`` reads the size from it)."""
        seg = self._lru.get(name)
        if seg is not None:
            # An open file unlinked since (nlink 0) is no longer the one under the name: opened
            # afresh, it is refused as replaced (or gone). Kept, a segment made again under its
            # name after a batch had used it was served from the old, deleted file, OK, while
            # the file the client now had under that name was never read or written.
            st = os.fstat(seg.fd)
            if (not file_id or seg.file_id == file_id) and st.st_nlink:
                self._lru.move_to_end(name)
                return seg, st
            self.forget(name)  # the name now stands for another file (its owner made it again)
        else:
            self.drop_unlinked()  # a new client's segment: room made first by the ones gone
        seg = Segment.attach(name, file_id)
        self._lru[name] = seg
        while len(self._lru) > self.capacity:
            _, old = self._lru.popitem(last=False)
            old.close()
        return seg, os.fstat(seg.fd)

    @staticmethod
    def maps(st: os.stat_result) -> bool:
        """Whether a segment is mapped: owned by this process's user and writable by no one else,
        so no one but that user (who could as well kill the worker) can shrink it under the
        mapping. Any other is read and written by offset. (A POSIX ACL that lets anyone else
        write the file shows in the group bits, which then hold the ACL's mask.)"""
        return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)

    def view(self, name: str, offset: int, nbytes: int, file_id: tuple = ()) -> memoryview | None:
        """A writable view of ``nbytes`` at ``offset`` of a mapped segment (of the file ``file_id``,
        when given), None for one read and written by offset (``maps``); ShmError unless the
        range lies inside the file as it is now (an fstat per use, about a microsecond)."""
        seg, st = self._get(name, file_id)
        end = offset + nbytes
        size = st.st_size
        if end > size:
            raise ShmError(f"shared-memory range [{offset}, {end}) is outside "
                           f"segment {name!r} of {size} bytes")
        if seg.mm is None:
            return None
        if end > seg.size:  # the file grew past the mapping: map it again
            self.forget(name)
            return self.view(name, offset, nbytes, file_id)
        return memoryview(seg.mm)[offset:end]

    def read_into(self, name: str, offset: int, out, file_id: tuple = ()) -> None:
        """Fill ``out`` (a writable 1-D byte buffer) from ``offset`` of the segment; ShmError if the file ends first."""
        fd = self.get(name, file_id).fd
        want, done = len(out), 0
        while done < want:
            try:
                n = os.preadv(fd, [out[done:]], offset + done)
            except OSError as e:
                raise ShmError(f"cannot read segment {name!r}: {e.strerror}") from None
            if n == 0:
                size = os.fstat(fd).st_size
                raise ShmError(f"shared-memory range [{offset}, {offset + want}) is outside "
                               f"segment {name!r} of {size} bytes")
            done += n

    def write(self, name: str, offset: int, data, file_id: tuple = ()) -> None:
        """Write ``data`` (a 1-D byte buffer) at ``offset`` of the segment; ShmError if it does not fit in the
        file as it is (a write past the end would grow the client's file instead)."""
        view = self.view(name, offset, len(data), file_id)
        if view is not None:
            view[:] = data
            return
        fd = self.get(name, file_id).fd
        done = 0
        while done < len(data):
            try:
                done += os.pwrite(fd, data[done:], offset + done)
            except OSError as e:  # ENOSPC: a client's sparse file in a full /dev/shm
                raise ShmError(f"cannot write segment {name!r}: {e.strerror}") from None

    def forget(self, name: str) -> None:
        seg = self._lru.pop(name, None)
        if seg is not None:
            seg.close()

    def drop_unlinked(self) -> int:
        """Close the segments their clients have unlinked (closed or gone): held open here, each
        kept its memory allocated until 32 newer ones pushed it out (2 GiB of /dev/shm per
        worker at the 64 MiB pool). Returns how many."""
        gone = [name for name, seg in self._lru.items() if seg.fd >= 0 and os.fstat(seg.fd).st_nlink == 0]
        for name in gone:
            self.forget(name)
        return len(gone)

    def close(self) -> None:
        for seg in self._lru.values():
            seg.close()
        self._lru.clear()


def _orphaned(path: str, now: float, grace_s: float) -> bool:
    """True when nobody holds the segment's owner lock (and it is past its grace period)."""
    try:
        # Non-blocking: opening a FIFO (anyone may make one in /dev/shm, or put one under a name
        # after the listing) waits for a writer, and this runs in every new client and on the
        # dispatcher's one thread.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        if grace_s and now - st.st_ctime < grace_s:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner is alive, in whatever PID namespace
        return True
    finally:
        os.close(fd)  # releases our lock at once


def _others_unlinkable(shm_dir: str) -> bool:
    """Whether this process may unlink another user's files in ``shm_dir``: root may, anyone may
    in a directory without the sticky bit; /dev/shm (1777) is sticky."""
    if os.geteuid() == 0:
        return True
    try:
        return not os.stat(shm_dir).st_mode & stat.S_ISVTX
    except OSError:
        return True


def _never_reapable(entry: os.DirEntry, euid: int, others_too: bool) -> bool:
    """Ruled out without opening it: not a regular file (the directory entry's type, no system
    call), or another user's file where this process could not unlink it anyway (one lstat).
    Opened, locked and refused (EACCES, or EPERM at the unlink), 200,000 names another user
    planted took a non-root node 1.1-2.8 s each sweep."""
    try:
        if not entry.is_file(follow_symlinks=False):
            return True
        return not others_too and entry.stat(follow_symlinks=False).st_uid != euid
    except OSError:  # gone since the listing
        return True


def reaping(shm_dir: str = SHM_DIR, grace_s: float = REAP_GRACE_S, pids: set[int] | None = None):
    """Unlink Batchyard segments no live owner holds a lock on (only those named after one of
    ``pids``, when given), one directory entry per step: yields the name unlinked, or None. A
    caller that must not wait on however many names anyone made in /dev/shm takes a bounded
    number of steps at a time (the dispatcher, a slice per housekeeping tick; a new client, its
    first CLIENT_REAP_ENTRIES: the listing is newest first on tmpfs)."""
    try:
        entries = os.scandir(shm_dir)
    except OSError:
        return
    now, euid, others_too = time.time(), os.geteuid(), _others_unlinkable(shm_dir)
    with entries:
        for entry in entries:
            name = entry.name
            if name.endswith(_NEW_SUFFIX):
                final, grace = name[:-len(_NEW_SUFFIX)], grace_s
            else:
                final, grace = name, 0.0  # locked before it got this name: unlocked means orphaned
            m = _NAME_RE.match(final)
            reaped = None
            if (m and (pids is None or int(m.group(1)) in pids) and not _never_reapable(entry, euid, others_too)
                    and _orphaned(entry.path, now, grace)):
                try:
                    os.unlink(entry.path)
                    reaped = name
                except OSError:
                    pass
            yield reaped


def reap_orphans(shm_dir: str = SHM_DIR, grace_s: float = REAP_GRACE_S,
                 pids: set[int] | None = None, max_entries: int | None = None) -> list[str]:
    """``reaping`` to its end, or over ``max_entries`` directory entries at most: the names unlinked."""
    return [name for name in itertools.islice(reaping(shm_dir, grace_s, pids), max_entries) if name]


def live_segments(pid: int | None = None, shm_dir: str = SHM_DIR) -> list[str]:
    """Batchyard segments on this host, optionally only those owned by ``pid``."""
    out = []
    for name in os.listdir(shm_dir):
        m = _NAME_RE.match(name)
        if m and (pid is None or int(m.group(1)) == pid):
            out.append(name)
    return out

