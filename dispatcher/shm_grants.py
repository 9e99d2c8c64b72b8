"""Which client connection may reference which shared-memory segment (capabilities, not names).

A client references a segment only after registering it on its own connection, and the
registration proves it can *write* the segment: the dispatcher hands out a random challenge,
the client writes it at offset 0 of the segment, and the dispatcher reads those bytes back
(a 16-byte pread on /dev/shm/<name>; it still never maps a segment or touches tensor bytes).
A process that cannot write another's segment cannot obtain a grant for it, so it cannot make
a worker read or overwrite that memory on its behalf.

Grants belong to a connection: its routing identity, only one ZeroMQ assigned (starting with a
zero byte), together with the peer's credentials the kernel gives for an ipc connection
(ZeroMQ's "Peer-Address" of the message: uid, gid and pid, SO_PEERCRED). A peer may choose a
routing id of that form (libzmq does not stop it), so the identity alone did not say who holds
the grant: a process that took a closed connection's id inherited its grants. The credentials
are the kernel's, so another process cannot present them.

A grant is for the file proved, not its name: its (st_dev, st_ino) go to the worker with every
batch that references it, and the worker maps only that file (``shm.SegmentCache``). Granted by
name, a segment replaced after the proof by a symlink to another user's segment, or unlinked and
created again by someone else, was mapped all the same.

Grants are counted against their holder, the connection's uid (a tcp peer, which has none: its
address), and a holder has at most GRANTS_PER_UID. Nothing tells the dispatcher that a
connection closed, so a closed connection's grants stay until the sweep finds their files gone:
unbounded, one client made 200,000 (hard links of its own 64 files), and every sweep then held
the dispatcher's one thread for all of them (777 ms). The sweep also works in slices.

A process holds a segment on one connection at a time: registered on a new connection of the
same process (same uid and pid, the kernel's credentials), the grant moves there from the older
one. An SDK client registers its segments again on each reconnect (heartbeat timeout, restart),
and its old connections' grants, their files still there, stayed and filled the uid's cap: every
client of that user was refused shared memory until those processes exited. Moving only takes a
grant away from a connection of the same process, so no process gains a segment it did not prove.
Over tcp (allow_shm_over_tcp) a peer tells no pid, and nothing tells one process's reconnection
from another process of the same host: grants stay with their connections there (moved between a
host's connections, the grant of one local process went to another that registered the same
segment, and the first one's requests were refused), until the sweep finds their files gone.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
from typing import Optional

from . import protocol as P
from .protocol import Status

TCP_REFUSAL = ("shared-memory references are refused on a tcp endpoint (they name files on the dispatcher's "
               "host); send tensors inline, or set [dispatcher] allow_shm_over_tcp on a trusted network")

SHM_DIR = "/dev/shm"
CHALLENGE_BYTES = 16


PENDING_PER_CONNECTION = 64  # challenges one connection may have outstanding (registrations half-way)
PENDING_CONNECTIONS = 4096  # connections with challenges outstanding, node-wide
# Of them, one holder's (its uid's, a tcp peer's): past it, its own oldest is forgotten. Forgetting
# the node's oldest, whoever's, let one user's many connections (step 1, a failed step 2, again)
# evict every other user's registration half-way: each failed "no challenge outstanding".
PENDING_CONNECTIONS_PER_HOLDER = 1024
# Grants one uid may hold over all its connections, open or closed (a closed one's stay until the
# sweep finds their files unlinked). An SDK client (a front-door process is one) registers each
# segment of its pool once: one per 64 MiB of its peak tensors in flight, plus at most
# SPARE_OVERSIZE bigger ones. 4096 is ~1,000 client processes of one user at 4 segments each, or
# 256 GiB of pool, past any /dev/shm. Workers register their regions with Triton, not here.
GRANTS_PER_UID = 4096
SWEEP_STATS_PER_CALL = 512  # names the sweep looks at per housekeeping tick (~2 ms)


def file_id(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


def holder(conn: tuple) -> tuple:
    """Whom a connection's grants count against: its uid, or a peer without one (tcp) its address,
    every loopback address as one: a local client connects from any of 127/8 as it likes, and
    counted apart, each address had a cap of its own."""
    uid = peer_uid(conn[1])
    if uid is not None:
        return ("uid", uid)
    try:
        ip = ipaddress.ip_address(conn[1])
        loopback = ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)
    except ValueError:
        loopback = False
    return ("address", "loopback" if loopback else conn[1])


def over_cap_message(conn: tuple) -> str:
    uid = peer_uid(conn[1])
    who = f"uid {uid}" if uid is not None else f"peer {conn[1] or 'without an address'}"
    return (f"{who} holds {GRANTS_PER_UID} shared-memory grants, the most one user (or tcp peer) may hold: "
            f"unregister segments no longer used (shm_unregister) or close clients that are done (a grant also "
            f"goes once its segment is unlinked, at the dispatcher's next sweep, janitor_interval_s)")


def peer_credentials(peer: str) -> Optional[tuple[int, int]]:
    """(uid, pid) in ZeroMQ's "Peer-Address" of an ipc connection ("host:uid:gid:pid", from
    SO_PEERCRED); None for a peer without credentials (tcp, inproc)."""
    parts = peer.split(":")
    return (int(parts[1]), int(parts[3])) if len(parts) == 4 and all(p.isdigit() for p in parts[1:]) else None


def peer_uid(peer: str) -> Optional[int]:
    """The uid of an ipc connection's peer; None for a peer without credentials."""
    creds = peer_credentials(peer)
    return creds[0] if creds is not None else None


def peer_process(conn: tuple) -> Optional[tuple[int, int]]:
    """Whose connections a grant moves between (see above): a process, by its (uid, pid); None
    for a peer without credentials (tcp, inproc), or whose pid reads 0: it is outside the
    dispatcher's pid namespace (a containerised dispatcher on a shared socket), every process of
    a uid alike, and their grants stay with their connections as over tcp (moved, one process
    took another's segment)."""
    creds = peer_credentials(conn[1])
    return creds if creds is not None and creds[1] != 0 else None


class ShmGrants:
    """Connections are keyed by ``conn``: (routing identity, peer credentials), see above."""

    def __init__(self, shm_dir: str = SHM_DIR):
        self.shm_dir = shm_dir
        self.granted: dict[tuple, dict[str, tuple[int, int]]] = {}  # conn -> segment -> the file proved
        self.pending: dict[tuple, dict[str, bytes]] = {}  # conn -> segment -> challenge
        self.pending_of: dict[tuple, dict[tuple, None]] = {}  # holder -> its conns in ``pending``, oldest first
        self.held: dict[tuple, int] = {}  # holder(conn) -> grants, over all its connections
        self.holding: dict[tuple, dict[str, tuple]] = {}  # (uid, pid) -> segment -> the conn granted it
        self._unswept: Optional[list[tuple[tuple, str]]] = None  # (conn, segment) left in this sweep

    def _full(self, conn: tuple, segment: str) -> bool:
        """Whether granting ``segment`` would take ``conn``'s holder past its cap (one granted on
        this connection already is granted again, not counted again; nor is one that moves here
        from another connection of the same process)."""
        if segment in self.granted.get(conn, ()) or self._holding_conn(conn, segment) is not None:
            return False
        if self.held.get(holder(conn), 0) < GRANTS_PER_UID:
            return False
        self.begin_sweep()  # grants of files since unlinked may be what fills it
        return True

    def _holding_conn(self, conn: tuple, segment: str) -> Optional[tuple]:
        """The other connection of ``conn``'s process that holds ``segment``, if one does."""
        process = peer_process(conn)
        other = self.holding.get(process, {}).get(segment) if process is not None else None
        return other if other != conn else None

    def _grant(self, conn: tuple, segment: str, file: tuple[int, int]) -> None:
        older = self._holding_conn(conn, segment)
        if older is not None:  # the same process on a new connection (a reconnect): moved, not added
            self._drop(older, segment)
        process = peer_process(conn)
        if process is not None:
            self.holding.setdefault(process, {})[segment] = conn
        segs = self.granted.setdefault(conn, {})
        if segment not in segs:
            key = holder(conn)
            self.held[key] = self.held.get(key, 0) + 1
        segs[segment] = file

    def _drop(self, conn: tuple, segment: str) -> None:
        segs = self.granted.get(conn)
        if segs is None or segs.pop(segment, None) is None:
            return
        if not segs:
            del self.granted[conn]
        self._forget_holding(conn, segment)
        key = holder(conn)
        left = self.held.get(key, 0) - 1
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)

    def _forget_holding(self, conn: tuple, segment: str) -> None:
        process = peer_process(conn)
        mine = self.holding.get(process) if process is not None else None
        if mine is not None and mine.get(segment) == conn:
            del mine[segment]
            if not mine:
                del self.holding[process]

    def _forget_pending(self, conn: tuple) -> None:
        del self.pending[conn]
        key = holder(conn)
        conns = self.pending_of[key]
        del conns[conn]
        if not conns:
            del self.pending_of[key]

    def challenge(self, conn: tuple, segment: str) -> tuple[Optional[bytes], str]:
        """(challenge, "") or (None, why not)."""
        if not conn[0].startswith(b"\0"):
            return None, "this connection chose its own routing id; shared memory needs one the dispatcher assigned"
        if self._full(conn, segment):
            return None, over_cap_message(conn)
        mine = self.pending.get(conn)
        if mine is None:
            # Abandoned half-way: forget the holder's own oldest; node-wide, the oldest of the
            # holder with the most (never another holder's while this one has as many).
            key = holder(conn)
            own = self.pending_of.get(key, {})
            if len(own) >= PENDING_CONNECTIONS_PER_HOLDER:
                self._forget_pending(next(iter(own)))
            elif len(self.pending) >= PENDING_CONNECTIONS:
                most = max(self.pending_of.values(), key=len)
                self._forget_pending(next(iter(own if own and len(own) >= len(most) else most)))
            mine = self.pending[conn] = {}
            self.pending_of.setdefault(key, {})[conn] = None
        elif len(mine) >= PENDING_PER_CONNECTION:  # one connection evicts only its own
            mine.pop(next(iter(mine)))
        c = mine[segment] = secrets.token_bytes(CHALLENGE_BYTES)
        return c, ""

    def prove(self, conn: tuple, segment: str) -> str:
        """Empty when the segment holds this connection's challenge (it is granted), else why not."""
        mine = self.pending.get(conn)
        want = mine.pop(segment, None) if mine is not None else None
        if mine is not None and not mine:
            self._forget_pending(conn)
        if want is None:
            return f"no challenge outstanding for segment {segment!r} on this connection"
        try:
            # Non-blocking: opening a FIFO waits for a writer, and this is the dispatcher's one thread.
            fd = os.open(os.path.join(self.shm_dir, segment),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            return f"cannot open segment {segment!r}: {e.strerror}"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return f"segment {segment!r} is not a regular file"
            uid = peer_uid(conn[1])
            if uid is not None and st.st_uid != uid:
                # The challenge at offset 0 proves only that *someone* wrote it there: a worker of
                # the node copying this client's tensor into its own region did, for a client of
                # another uid that could not open that region (and read other clients' batches
                # through the grant). A client references its own user's memory only.
                return f"segment {segment!r} belongs to uid {st.st_uid}, not to this connection's uid {uid}"
            got = os.pread(fd, CHALLENGE_BYTES, 0)
        except OSError as e:
            return f"cannot read segment {segment!r}: {e.strerror}"
        finally:
            os.close(fd)
        if not secrets.compare_digest(got, want):
            return f"segment {segment!r} does not hold this connection's challenge at offset 0"
        if self._full(conn, segment):  # its other connections' grants since the challenge
            return over_cap_message(conn)
        self._grant(conn, segment, file_id(st))
        return ""

    def revoke(self, conn: tuple, segment: str) -> None:
        self._drop(conn, segment)

    def answer(self, msg, conn: tuple, shm_allowed: bool) -> P.ShmReply:
        """The reply to a ``shm_register`` (either step) or ``shm_unregister``."""
        why, challenge = "", b""
        if not shm_allowed:
            why = TCP_REFUSAL
        elif type(msg) is P.ShmUnregisterRequest:
            self.revoke(conn, msg.segment)
        elif msg.proved:
            why = self.prove(conn, msg.segment)
        else:
            c, why = self.challenge(conn, msg.segment)
            challenge = c or b""
        return P.ShmReply(v=P.PROTOCOL_VERSION, id=msg.id, status=Status.PERMISSION_DENIED if why else Status.OK,
                          message=why, challenge=challenge)

    def files(self, msg: P.InferRequest, conn: tuple, shm_allowed: bool) -> tuple[dict, str]:
        """The files ``msg``'s shared memory may be mapped from, {segment: (st_dev, st_ino)}, and
        "" — or ({}, why not)."""
        if not shm_allowed:
            return {}, TCP_REFUSAL
        segs = self.granted.get(conn, {})
        out = {}
        for ref in msg.inputs:
            if ref.shm is not None:
                f = segs.get(ref.shm.segment)
                if f is None:
                    return {}, f"input {ref.name!r}: segment {ref.shm.segment!r} is not registered on this connection"
                out[ref.shm.segment] = f
        for name, ref in msg.outputs.items():
            f = segs.get(ref.segment)
            if f is None:
                return {}, f"output {name!r}: segment {ref.segment!r} is not registered on this connection"
            out[ref.segment] = f
        return out, ""

    @property
    def sweeping(self) -> bool:
        return self._unswept is not None

    def begin_sweep(self) -> None:
        """Start a sweep (``sweep``) over every grant held now, unless one is under way."""
        if self._unswept is None:
            self._unswept = [(conn, s) for conn, segs in self.granted.items() for s in segs]

    def sweep(self, max_stats: int = SWEEP_STATS_PER_CALL) -> bool:
        """Forget grants for files that no longer exist under their names (their owner unlinked
        them, or something else took the name since): the next slice of the sweep under way (one
        begun if none is), at most ``max_stats`` names looked at. True when the sweep is done."""
        self.begin_sweep()
        todo = self._unswept
        now_at: dict = {}  # segment -> its file now (None: gone): one stat a name, however many
        while todo and len(now_at) < max_stats:  # connections hold it (100,000 grants took 375 ms)
            conn, s = todo.pop()
            f = self.granted.get(conn, {}).get(s)
            if f is None:  # revoked since the sweep began
                continue
            if s not in now_at:
                try:
                    now_at[s] = file_id(os.stat(os.path.join(self.shm_dir, s), follow_symlinks=False))
                except OSError:
                    now_at[s] = None
            if now_at[s] != f:
                self._drop(conn, s)
        if todo:
            return False
        self._unswept = None
        return True
