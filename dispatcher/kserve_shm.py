"""Triton's system shared-memory extension for the front door: the regions clients register,
one registry for every front-door process of a node.

Several front-door processes share the node's ports (SO_REUSEPORT), and the kernel spreads
connections over them: a client that registers a region on one connection and infers on
another (tritonclient.http with concurrency > 1, perf_analyzer's workers, a second client
process) reaches another process. Triton's registry is server-wide, so this one is too: each
registration is a small file in a directory private to the front door's user, created with
``link`` (atomic, so two processes cannot register one name twice); each process maps a region
on first use and checks, with one ``stat`` per request, that the entry it mapped is still the
registered one. The directory is wiped when the first front-door process of the node starts
(no live one holds the shared ``flock`` on its ``.alive`` file): a restarted server starts with
no regions, as Triton does.

Requests name regions, never segments: an infer can read or write only memory a client
registered here, and tensors reach the dispatcher as copies. A region is its registering user's
(the SDK's rule): the segment must belong to the client's uid (tcp_peer.py: a client on this
host; root may name any), and only clients of that uid see, use or unregister the region. Any
client could otherwise register any segment the front door can open, another user's tensors,
and read it back through a model or write outputs over it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import stat
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import grpc
import numpy as np

from .kserve_common import KServeError, byte_view, check_byte_size, check_declared_input, invalid
from .node_files import flocked

# Region keys Batchyard itself creates (client pools, the Triton worker's regions with its local
# tritonserver): other clients' tensors live there, so a KServe client may not name them (the
# SDK's rule: reference only your own memory).
_OWN_SEGMENTS = re.compile(r"batchyard_|by_triton_")
_SHM_KEY = re.compile(r"/?([A-Za-z0-9_][A-Za-z0-9_.-]{0,199})")  # fullmatch: "$" let a trailing newline in
SHM_DIR = "/dev/shm"
# Each region holds an open file in every front-door process that used it: one client registering
# without end ran the processes out of descriptors (every client's registrations then failed).
MAX_REGIONS_PER_USER = 1024


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int = -1  # the segment, open (read and written with pread/pwrite, never mapped)
    entry_ino: int = 0  # the registry entry this region was opened from
    uid: int = 0  # the user who registered it: only that user's clients (or root's) use it
    # The segment's (st_dev, st_ino) when registered: another process of the node opens the key
    # again by name, and must find that file, not one made under its name since (root's clients
    # may name any user's segment, so the owner check alone let root's outputs go into a file
    # another user put there after root's segment was unlinked).
    file: tuple = ()


@dataclass
class OutputRegion:
    """Where one request's output goes: its region as registered when the request was read, held
    (a duplicate of the segment's fd) until the reply is written, then ``close``d. Looked up by
    name after the inference instead, an output whose region was unregistered meanwhile was lost,
    and one whose name another client had registered since went into that client's memory.
    Triton too holds a request's regions while it runs (2.53 and later defer an unregister until
    they finish)."""

    name: str
    offset: int  # within the region, as the request gave it (the reply says it back)
    byte_size: int
    fd: int
    start: int  # in the segment

    def write(self, arr: np.ndarray, tensor: str) -> None:
        if arr.nbytes > self.byte_size:
            raise _too_small(tensor, self.byte_size, arr.nbytes)
        size = os.fstat(self.fd).st_size
        if self.start + arr.nbytes > size:  # shrunk since: a write would grow the client's file
            raise _shrunk(self.name, self.start, arr.nbytes, size)
        # From the array's own bytes (the worker's output in the front door's pool): tobytes()
        # first copied the whole output once more, into fresh memory.
        data = byte_view(arr)
        done = 0
        while done < len(data):  # one pwrite moves at most ~2 GiB
            done += os.pwrite(self.fd, data[done:], self.start + done)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def close_outputs(regions) -> None:
    """Close the output regions of a request's (name, ..., region or None) list."""
    for entry in regions:
        if entry[-1] is not None:
            entry[-1].close()


log = logging.getLogger("batchyard.frontend")


def network_namespace() -> int:
    """This process's network namespace (its inode), 0 where it cannot be read. Ports are the
    namespace's: two nodes in containers that share /dev/shm (--ipc=host) but not the network
    each have their own port 8001."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


def registry_dir(host: str, grpc_port: int, http_port: int) -> str:
    """The registry of the front doors serving these ports: one per node and user (and network
    namespace). It lives in /dev/shm, which every front-door unit shares (each unit's /tmp is
    private)."""
    tag = re.sub(r"[^A-Za-z0-9.]", "_", host)
    return os.path.join(SHM_DIR, f"batchyard-kserve-{os.getuid()}-{tag}-{grpc_port}-{http_port}-{network_namespace()}")


def _open_private_dir(path: str) -> int:
    """The registry directory as an fd, created 0700 if absent; refused if it is a link or not
    this user's (another user could otherwise plant registrations)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise PermissionError(f"{path}: not a private directory of uid {os.getuid()}")
    return fd


def _entry(name: str) -> str:
    # A digest, not the name itself: a region's name is any string the client chose (a long one
    # made a file name past NAME_MAX, a lone surrogate one no file name at all); the entry keeps
    # the name.
    return "r-" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest() + ".json"


def _owned_by(uid: Optional[int], region_uid: int) -> bool:
    return uid is not None and (uid == 0 or uid == region_uid)


def _open_segment(name: str, key: str, offset: int, byte_size: int, uid: Optional[int] = 0) -> int:
    """The region's segment as an open fd. Not mapped: a client that shrank its segment made the
    next access to a mapping past the new end a SIGBUS, which killed the front door (and its
    restart dropped every client's registrations); pread and pwrite cannot fault."""
    m = _SHM_KEY.fullmatch(key)
    if m is None or _OWN_SEGMENTS.match(m[1]):
        raise invalid(f"failed to register shared memory region '{name}': key '{key}' is not a POSIX "
                      f"shared-memory name this front door may open")
    try:
        # Non-blocking: opening a FIFO would wait for a writer, on the front door's event loop.
        fd = os.open(os.path.join(SHM_DIR, m[1]), os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        raise KServeError(grpc.StatusCode.INTERNAL, f"Unable to open shared memory region: '{key}'") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KServeError(grpc.StatusCode.INTERNAL, f"Unable to open shared memory region: '{key}'")
        if uid is None:
            raise invalid(f"failed to register shared memory region '{name}': system shared memory is for "
                          f"clients on this host (their user decides which segments they may name)")
        if not _owned_by(uid, st.st_uid):
            raise invalid(f"failed to register shared memory region '{name}': segment '{key}' belongs to uid "
                          f"{st.st_uid}, not to this client's uid {uid}")
        size = st.st_size
        # A region of no bytes serves nothing. Triton 2.51 refuses both as the client's fault,
        # INVALID_ARGUMENT (HTTP 400), in these words (the 0-byte one in mmap's); they were
        # INTERNAL (500), a server fault a client may retry.
        if byte_size <= 0:
            raise invalid(f"failed to register shared memory region '{name}': unable to process address space: "
                          f"Invalid argument (a region of {byte_size} bytes)")
        if offset < 0 or offset + byte_size > size:
            raise invalid(f"failed to register shared memory region '{name}': invalid args (offset {offset} + "
                          f"{byte_size} bytes, the segment '{key}' has {size})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _shrunk(name: str, start: int, nbytes: int, size: int) -> KServeError:
    return invalid(f"Invalid offset + byte size for shared memory region: '{name}' (bytes {start} to "
                   f"{start + nbytes} of a segment now {size} bytes long)")


def _too_small(tensor: str, byte_size: int, nbytes: int) -> KServeError:
    return KServeError(grpc.StatusCode.INTERNAL,
                       f"shared memory size specified with the request for output '{tensor}' ({byte_size} bytes) "
                       f"should be at least {nbytes} bytes to hold the results")


def open_registry(directory: str, node_instance: str = "") -> "ShmRegions":
    """The node's shared registry; this process's own when ``directory`` is not a private folder
    of this user (anyone may create it first in /dev/shm: the front door then refused to start,
    restarted for ever). Its regions and statistics then cover the connections it answers.
    ``node_instance``: see ShmRegions."""
    try:
        return ShmRegions(directory, node_instance)
    except OSError as e:
        # Another user's folder (PermissionError), or a file or symlink made there in its place
        # (NotADirectoryError, ELOOP): not ours to use, and no reason for the node not to start
        # (a plain file planted under the predictable name stopped every front door).
        log.error("%s: shared-memory regions and statistics are this front-door process's own", e)
        return ShmRegions(None)


# `up` names its run of the node to its front doors here (supervisor.Supervisor.instance).
NODE_INSTANCE_ENV = "BATCHYARD_NODE_INSTANCE"
NODE_FILE = ".node"  # the run of the node whose front doors filled the registry


class ShmRegions:
    """The registry, seen from one front-door process. ``directory=None``: this process only.

    ``node_instance`` names the run of the node this front door belongs to (`up` gives its
    children one). The first front door to join a registry no other one holds starts it afresh
    (regions and statistics) unless the registry is its own node's run: the only front door,
    killed or hung and restarted by `up`, found every client's regions gone (NOT_FOUND on the
    next infer) and the node's statistics back at zero, where with two processes both
    survived. With no name (a front door started on its own, as a separate systemd unit), a
    restart starts afresh, as a restarted Triton server does."""

    def __init__(self, directory: Optional[str] = None, node_instance: str = ""):
        self.dir = directory
        self.local: dict[str, Region] = {}  # regions this process has mapped
        self._dir_fd = self._alive_fd = -1
        if directory is not None:
            self._dir_fd = _open_private_dir(directory)
            self._join(node_instance)

    # ------------------------------------------------------------ the shared directory
    def _join(self, node_instance: str) -> None:
        self._alive_fd = os.open(".alive", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=self._dir_fd)
        try:
            fcntl.flock(self._alive_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # another front door of this node is serving: keep its registrations
        else:
            if not node_instance or self._node_instance() != node_instance:
                self._wipe()  # a previous node's leftovers (its front doors killed, none left it)
                self._write_node_instance(node_instance)
        fcntl.flock(self._alive_fd, fcntl.LOCK_SH)

    def _node_instance(self) -> str:
        try:
            fd = os.open(NODE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return ""
        with os.fdopen(fd, "rb") as f:
            return f.read(256).decode(errors="replace")

    def _write_node_instance(self, node_instance: str) -> None:
        if node_instance:
            fd = os.open(NODE_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self._dir_fd)
            with os.fdopen(fd, "wb") as f:
                f.write(node_instance.encode())

    @property
    def dir_fd(self) -> Optional[int]:
        """The node's shared directory, which also holds its statistics (kserve_stats); None
        when this process keeps its own."""
        return self._dir_fd if self._dir_fd >= 0 else None

    def _wipe(self) -> None:
        """Everything the node's front doors left here (regions, statistics), but the lock."""
        for n in os.listdir(self._dir_fd):
            if n != ".alive":
                self._unlink(n)

    def _entries(self) -> list[str]:
        return [n for n in os.listdir(self._dir_fd) if n.startswith("r-") and n.endswith(".json")]

    def _unlink(self, entry: str) -> None:
        try:
            os.unlink(entry, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass

    def _read(self, entry: str) -> Optional[Region]:
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            ino = os.fstat(f.fileno()).st_ino
            d = json.loads(f.read())
        file = d.get("file")
        return Region(d["name"], d["key"], int(d["offset"]), int(d["byte_size"]), None, ino, int(d.get("uid", 0)),
                      tuple(file) if isinstance(file, list) else ())

    def _publish(self, r: Region) -> None:
        tmp = f".new-{os.getpid()}-{_entry(r.name)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600, dir_fd=self._dir_fd)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps({"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size,
                                "uid": r.uid, "file": list(r.file)}).encode())
        try:
            os.link(tmp, _entry(r.name), src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except FileExistsError:
            raise KServeError(grpc.StatusCode.ALREADY_EXISTS,
                              f"shared memory region '{r.name}' already in manager") from None
        finally:
            self._unlink(tmp)
        r.entry_ino = os.stat(_entry(r.name), dir_fd=self._dir_fd).st_ino

    def _registered(self) -> list[Region]:
        if self.dir is None:
            return list(self.local.values())
        return [r for r in map(self._read, self._entries()) if r is not None]

    def _drop_local(self, name: str) -> None:
        r = self.local.pop(name, None)
        if r is not None and r.fd >= 0:
            os.close(r.fd)
            r.fd = -1

    def sweep(self) -> None:
        """Close the segments of regions unregistered (or registered anew) through another
        process of the node: until then this process's fd kept the client's memory allocated after
        the client unlinked it. Run at every registry call and from the front door's timer."""
        if self.dir is None:
            return
        for name, r in list(self.local.items()):
            if self._entry_ino(name) != r.entry_ino:
                self._drop_local(name)

    def _entry_ino(self, name: str) -> int:
        """The inode of the registry entry of region ``name``; 0 when it is not registered."""
        try:
            return os.stat(_entry(name), dir_fd=self._dir_fd, follow_symlinks=False).st_ino
        except FileNotFoundError:
            return 0

    # ------------------------------------------------------------ the extension's calls
    def register(self, name: str, key: str, offset: int, byte_size: int, uid: Optional[int] = 0) -> None:
        """``uid``: the client's (tcp_peer), None for one not on this host; 0, root, names any segment."""
        self.sweep()
        if any(r.name == name for r in self._registered()):
            raise KServeError(grpc.StatusCode.ALREADY_EXISTS, f"shared memory region '{name}' already in manager")
        fd = _open_segment(name, key, offset, byte_size, uid)
        st = os.fstat(fd)
        region = Region(name, key, offset, byte_size, fd, uid=uid, file=(st.st_dev, st.st_ino))
        try:
            with self._registering():
                # Counted under the registry's lock: registrations racing through several
                # front-door processes each passed a count taken before it and published (1026
                # regions of a user with 4 processes, past MAX_REGIONS_PER_USER).
                if sum(r.uid == uid for r in self._registered()) >= MAX_REGIONS_PER_USER:
                    raise invalid(f"failed to register shared memory region '{name}': this user has "
                                  f"{MAX_REGIONS_PER_USER} regions registered already")
                if self.dir is not None:
                    self._publish(region)
        except BaseException:
            os.close(region.fd)
            raise
        self._drop_local(name)
        self.local[name] = region

    def _registering(self):
        """The registry's lock, across the node's front-door processes, for a count and the
        publish it allows (a registration is a few file operations: held that long); none without
        a registry (one process)."""
        return flocked(self._dir_fd if self._dir_fd >= 0 else None)

    def unregister(self, name: str = "", uid: Optional[int] = 0) -> None:
        """One region, or all when ``name`` is empty: of the regions ``uid`` may use; an unknown
        name is not an error (Triton)."""
        self.sweep()
        mine = [r.name for r in self._registered() if _owned_by(uid, r.uid)]
        names = ([name] if name in mine else []) if name else mine + [n for n, r in self.local.items()
                                                                       if _owned_by(uid, r.uid)]
        for n in names:
            if self.dir is not None:
                self._take_if_owned(n, uid)
            self._drop_local(n)

    def _take_if_owned(self, name: str, uid: Optional[int]) -> None:
        """Remove region ``name``'s entry if it is ``uid``'s, judged on the entry removed: it is moved
        aside first (a rename, atomic), read there, and put back if another user's. Unlinked by name
        after a read of the whole registry, it could be another user's by then (unregistered
        meanwhile through another front-door process, and registered again by that user): one
        user's unregister took another's region."""
        entry = _entry(name)
        aside = f".gone-{os.getpid()}-{entry}"
        try:
            os.rename(entry, aside, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except FileNotFoundError:
            return
        try:
            r = self._read(aside)
            if r is not None and not _owned_by(uid, r.uid):
                try:
                    os.link(aside, entry, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
                except FileExistsError:  # the name was registered again meanwhile: that one stays
                    log.warning("shared memory region %r of uid %d was replaced while it was checked", name, r.uid)
        finally:
            self._unlink(aside)

    def status(self, name: str = "", uid: Optional[int] = 0) -> list[Region]:
        self.sweep()
        regions = [r for r in self._registered() if _owned_by(uid, r.uid)]
        if not name:
            return regions
        found = [r for r in regions if r.name == name]
        if not found:
            raise KServeError(grpc.StatusCode.NOT_FOUND, f"Unable to find system shared memory region: '{name}'")
        return found

    def _lookup(self, name: str) -> Optional[Region]:
        """The mapped region, if it is still the registered one; mapped now if registered by
        another process of this node."""
        r = self.local.get(name)
        if self.dir is None:
            return r
        ino = self._entry_ino(name)
        if not ino:
            self._drop_local(name)
            return None
        if r is not None and r.entry_ino == ino:
            return r
        self._drop_local(name)
        entry = self._read(_entry(name))
        if entry is None:
            return None
        fd = _open_segment(name, entry.key, entry.offset, entry.byte_size, entry.uid)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != entry.file:
            os.close(fd)
            raise KServeError(grpc.StatusCode.INTERNAL, f"Unable to open shared memory region: '{entry.key}' (region "
                              f"'{name}': the segment registered is gone, another file has its name now)")
        entry.fd = fd
        self.local[name] = entry
        return entry

    def _range(self, name: str, offset: int, nbytes: int, uid: Optional[int]) -> tuple[Region, int]:
        r = self._lookup(name)
        if r is None or not _owned_by(uid, r.uid):  # another user's region is not there for this client
            raise KServeError(grpc.StatusCode.NOT_FOUND, f"Unable to find shared memory region: '{name}'")
        if offset < 0 or nbytes < 0 or offset + nbytes > r.byte_size:
            raise invalid(f"Invalid offset + byte size for shared memory region: '{name}' "
                          f"(offset {offset} + {nbytes} bytes > its {r.byte_size} bytes)")
        return r, r.offset + offset

    def output(self, name: str, offset: int, byte_size: int, tensor: str, nbytes: Optional[int],
               uid: Optional[int] = 0) -> OutputRegion:
        """The region an output goes to, held from now until ``close``; fails now, before the
        inference runs, if it is not usable or cannot hold the ``nbytes`` of the output (None:
        not known yet). Too small a region is Triton's INTERNAL with its message (its allocator
        finds out after the run; here the run is spared); one of no bytes at all (over HTTP, no
        ``shared_memory_byte_size``) is the request's fault, as Triton answers it: INVALID_ARGUMENT."""
        if byte_size <= 0:
            raise invalid(f"Invalid offset + byte size for shared memory region: '{name}'")
        if nbytes is not None and nbytes > byte_size:
            raise _too_small(tensor, byte_size, nbytes)
        r, start = self._range(name, offset, byte_size, uid)
        return OutputRegion(name, offset, byte_size, os.dup(r.fd), start)

    def read(self, name: str, offset: int, byte_size: int, datatype: str, shape: list[int], tensor: str,
             spec, uid: Optional[int] = 0, empty: Callable = np.empty) -> np.ndarray:
        """A copy of the tensor in the region: the client may reuse its memory as soon as the
        reply comes, and the region may be unregistered while the request is queued. The
        declaration is checked against the model ``spec`` and ``byte_size`` against it first, so
        that no more is read than one batch of the model takes. ``empty(shape, dtype)`` makes the
        array read into (the front door's: one in its Batchyard pool, sent on without a copy)."""
        check_declared_input(spec, tensor, datatype, shape)
        dt = check_byte_size(tensor, datatype, shape, byte_size)
        r, start = self._range(name, offset, byte_size, uid)
        arr = empty(shape, dt)
        buf = byte_view(arr)
        done = 0
        while done < byte_size:  # one read moves at most ~2 GiB
            got = os.preadv(r.fd, [buf[done:]], start + done)
            if got == 0:
                raise _shrunk(name, start, byte_size, os.fstat(r.fd).st_size)
            done += got
        return arr

    def close(self) -> None:
        """Unmap this process's regions. The registrations stay while another front door of the
        node serves; the last one out removes the registry (a front door starting during that
        instant may find its directory gone from under it: its regions then live in a removed
        directory until it restarts)."""
        for n in list(self.local):
            self._drop_local(n)
        if self._alive_fd >= 0:
            try:
                fcntl.flock(self._alive_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                self._wipe()
                self._unlink(".alive")
                try:
                    os.rmdir(self.dir)
                except OSError:
                    pass  # a registration being written: the next first front door wipes it
        for fd in (self._alive_fd, self._dir_fd):
            if fd >= 0:
                os.close(fd)
        self._alive_fd = self._dir_fd = -1


# ------------------------------------------------------------------ the node's claim on its ports
# Hosts that take every address: a node on one of them shares a port with a node on any address.
_ANY_HOST = ("", "0.0.0.0", "::", "*")


class PortsTaken(OSError):
    """A port of this front door is served by another Batchyard node's front doors."""


def ports_dir() -> str:
    """Where the front doors of this user's nodes claim their ports: in /dev/shm, which every
    front-door unit shares (each unit's /tmp is private)."""
    return os.path.join(SHM_DIR, f"batchyard-ports-{os.getuid()}")


def _claim_file(host: str, port: int, netns: int) -> str:
    # A digest of the host: two hosts written alike once sanitised ("a:b", "a_b") are two claims.
    # And of the network namespace: another's node on the same host and port has a file of its own.
    return f"{port}-{hashlib.sha256(f'{host} {netns}'.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


def _addresses(host: str) -> list:
    """The addresses a front door on ``host`` listens on, as gRPC and aiohttp bind a name (every
    address it resolves to); ["*"] for every address. By the name as written, "localhost" and
    "127.0.0.1" were two hosts, and two nodes served one port."""
    if host in _ANY_HOST:
        return ["*"]
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except (OSError, UnicodeError):
        return [host]


def _hosts_overlap(a: list, b: list) -> bool:
    return "*" in a or "*" in b or not set(a).isdisjoint(b)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: there, all the same
        return True
    return True


def _read_claim(fd: int) -> dict:
    """A claim file's record; {} for one not written whole. Its first line only: a record is
    written over a longer one before the file is cut to it."""
    try:
        d = json.loads(os.pread(fd, 65536, 0).split(b"\n", 1)[0])
    except ValueError:
        return {}
    return d if isinstance(d, dict) else {}


def _write_claim(fd: int, record: dict) -> None:
    data = (json.dumps(record) + "\n").encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


class PortClaim:
    """This front-door process's claim on its node's ports: a file a host and port in
    ``ports_dir()``, naming the node (its dispatcher's endpoint, which every front door of one
    node is given) and its front doors' pids, on which each of them holds a shared ``flock`` for
    as long as it serves; the kernel lets go of a dead process's, so a dead node's claim is taken
    over. SO_REUSEPORT, which lets a node's front-door processes share their ports, let any other
    process of this user bind them too: a second node started on a running node's ports served
    beside it, the kernel splitting new connections between the two, and both used the one
    shared-memory registry of those ports (statistics mixed). A port claimed for another node is
    refused (``PortsTaken``), as Triton refuses a second server on a bound port; so is one on an
    overlapping address (any address, 0.0.0.0, and one of its own). The claims are read and
    changed one process at a time (an exclusive ``flock`` on the folder); the last one out of the
    last claim removes the folder."""

    def __init__(self, node: str, host: str, ports: Iterable[tuple[str, int]], directory: Optional[str] = None):
        self.node = node
        self.host = host.strip("[]")
        self.addresses = _addresses(self.host)
        self.netns = network_namespace()
        self.dir = directory or ports_dir()
        self._held: list[tuple[str, int]] = []  # (claim file, its fd holding the shared flock)
        with self._folder() as dir_fd:
            try:
                for what, port in ports:
                    if port:
                        self._claim(dir_fd, what, port)
            except BaseException:
                self._give_back(dir_fd)
                raise

    @contextlib.contextmanager
    def _folder(self):
        """The claims folder, opened and locked (created if absent)."""
        while True:
            try:
                fd = _open_private_dir(self.dir)
            except FileNotFoundError:
                if os.path.isdir(os.path.dirname(self.dir)):
                    continue  # removed by another node's last one out since the mkdir
                raise  # no /dev/shm: claim_ports says so, and the front door serves unchecked
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink:  # not removed by the last one out while this one waited
                break
            os.close(fd)
        try:
            yield fd
        finally:
            os.close(fd)  # and its lock

    def _holder(self, dir_fd: int, name: str) -> Optional[dict]:
        """The record of claim ``name`` while some process holds it; a claim nobody holds (its
        node is gone) is removed, and None."""
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_claim(fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
            return None
        finally:
            os.close(fd)

    def _claim(self, dir_fd: int, what: str, port: int) -> None:
        for name in os.listdir(dir_fd):
            held = self._holder(dir_fd, name)
            if held is None or not name.startswith(f"{port}-") or held.get("netns", self.netns) != self.netns:
                continue  # (a node in another network namespace has ports of its own)
            theirs = held.get("addresses")
            if not isinstance(theirs, list):  # a claim of a release that wrote its host only
                theirs = _addresses(str(held.get("host", "")))
            if held.get("node") != self.node and _hosts_overlap(theirs, self.addresses):
                pids = ", ".join(str(p) for p in dict.fromkeys(held.get("pids", ())) if _alive(p)) or "unknown"
                raise PortsTaken(f"cannot bind {what} to {self.host}:{port}: address already in use: another "
                                 f"Batchyard node (front door pid {pids}, dispatcher {held.get('node')}) serves it")
        name = _claim_file(self.host, port, self.netns)
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        self._held.append((name, fd))
        pids = [p for p in _read_claim(fd).get("pids", ()) if _alive(p)]
        if not pids:
            _refuse_if_listened_on(what, self.host, port)
        _write_claim(fd, {"node": self.node, "host": self.host, "addresses": self.addresses, "netns": self.netns,
                          "pids": [*pids, os.getpid()]})
        fcntl.flock(fd, fcntl.LOCK_SH)

    def _give_back(self, dir_fd: int) -> None:
        for name, fd in self._held:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # failing, it lets go of this one's shared lock
            except BlockingIOError:  # other front doors of the node serve on
                record = _read_claim(fd)
                record["pids"] = [p for p in record.get("pids", ()) if p != os.getpid()]
                _write_claim(fd, record)
            else:
                os.unlink(name, dir_fd=dir_fd)
            os.close(fd)
        self._held.clear()
        if not os.listdir(dir_fd):
            with contextlib.suppress(OSError):
                os.rmdir(self.dir)

    def close(self) -> None:
        """Give the claims back; the last front door of the node removes them. (A process that
        ends without it loses them all the same: the next claim of the port removes them.)"""
        if not self._held:
            return
        try:
            with self._folder() as dir_fd:
                self._give_back(dir_fd)
        except OSError as e:
            log.warning("the front door's port claims in %s were not given back: %s", self.dir, e)


def _refuse_if_listened_on(what: str, host: str, port: int) -> None:
    """PortsTaken if anything listens on ``host:port``: the node's first front door on the port
    binds it once as tritonserver does, without SO_REUSEPORT (the front doors' own binds set it,
    to share the port with each other). A server of the same user that set it too (grpcio does by
    default) was not refused: the kernel split new connections between it and the front door,
    and a tritonclient user's calls were answered by the other server."""
    try:
        places = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return  # the front door's own bind says what is wrong with the host
    for family, kind, proto, _, address in places:
        probe = socket.socket(family, kind, proto)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a closed socket's TIME_WAIT is no one)
            if family == socket.AF_INET6:
                # As the front door's servers bind "::": an IPv4 listener on the port is no one's in
                # the way (probed dual-stack, a front door on "::" beside one was refused).
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortsTaken(f"cannot bind {what} to {host}:{port}: address already in use (by a process that "
                                 "is no Batchyard front door of this node)") from None
        finally:
            probe.close()


def claim_ports(node: str, host: str, ports: Iterable[tuple[str, int]]) -> Optional[PortClaim]:
    """This front door's ``PortClaim``, or ``PortsTaken``; None when the claims folder is not
    usable (another user's, or a file in its place): the front door serves, unchecked, rather
    than not at all."""
    try:
        return PortClaim(node, host, ports)
    except PortsTaken:
        raise
    except OSError as e:
        log.error("%s: this front door cannot check that no other Batchyard node serves its ports", e)
        return None
