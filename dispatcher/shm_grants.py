"""Which client connection may reference which shared-memory segment (capabilities, not names).

A client references a segment only after registering it on its own connection, and the
registration proves it can *write* the segment: the dispatcher hands out a random challenge,
the client writes it at offset 0 of the segment, and the dispatcher reads those bytes back
(a 16-byte pread on /dev/shm/<name>; it still never maps a segment or touches tensor bytes).
A process that cannot write another's segment cannot obtain a grant for it, so it cannot make
a worker read or overwrite that memory on its behalf.

Grants belong to a connection's routing identity, and only to identities ZeroMQ assigned
(they start with a zero byte, which a peer may not choose), so a client cannot take over
another client's identity and inherit its grants.
"""

from __future__ import annotations

import os
import secrets
from typing import Optional

from . import protocol as P
from .protocol import Status

TCP_REFUSAL = ("shared-memory references are refused on a tcp endpoint (they name files on the dispatcher's "
               "host); send tensors inline, or set [dispatcher] allow_shm_over_tcp on a trusted network")

SHM_DIR = "/dev/shm"
CHALLENGE_BYTES = 16


class ShmGrants:
    def __init__(self, shm_dir: str = SHM_DIR):
        self.shm_dir = shm_dir
        self.granted: dict[bytes, set[str]] = {}  # connection identity -> segments
        self.pending: dict[tuple[bytes, str], bytes] = {}  # (identity, segment) -> challenge

    def challenge(self, identity: bytes, segment: str) -> tuple[Optional[bytes], str]:
        """(challenge, "") or (None, why not)."""
        if not identity.startswith(b"\0"):
            return None, "this connection chose its own routing id; shared memory needs one the dispatcher assigned"
        if len(self.pending) > 4096:  # registrations abandoned half-way: forget the oldest
            self.pending.pop(next(iter(self.pending)))
        c = secrets.token_bytes(CHALLENGE_BYTES)
        self.pending[(identity, segment)] = c
        return c, ""

    def prove(self, identity: bytes, segment: str) -> str:
        """"" when the segment holds this connection's challenge (granted), else why not."""
        want = self.pending.pop((identity, segment), None)
        if want is None:
            return f"no challenge outstanding for segment {segment!r} on this connection"
        try:
            fd = os.open(os.path.join(self.shm_dir, segment), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            return f"cannot open segment {segment!r}: {e.strerror}"
        try:
            got = os.pread(fd, CHALLENGE_BYTES, 0)
        finally:
            os.close(fd)
        if not secrets.compare_digest(got, want):
            return f"segment {segment!r} does not hold this connection's challenge at offset 0"
        self.granted.setdefault(identity, set()).add(segment)
        return ""

    def revoke(self, identity: bytes, segment: str) -> None:
        segs = self.granted.get(identity)
        if segs is not None:
            segs.discard(segment)
            if not segs:
                del self.granted[identity]

    def allows(self, identity: bytes, segment: str) -> bool:
        segs = self.granted.get(identity)
        return segs is not None and segment in segs

    def answer(self, msg, identity: bytes, shm_allowed: bool) -> P.ShmReply:
        """The reply to a ``shm_register`` (either step) or ``shm_unregister``."""
        why, challenge = "", b""
        if not shm_allowed:
            why = TCP_REFUSAL
        elif type(msg) is P.ShmUnregisterRequest:
            self.revoke(identity, msg.segment)
        elif msg.proved:
            why = self.prove(identity, msg.segment)
        else:
            c, why = self.challenge(identity, msg.segment)
            challenge = c or b""
        return P.ShmReply(v=P.PROTOCOL_VERSION, id=msg.id, status=Status.PERMISSION_DENIED if why else Status.OK,
                          message=why, challenge=challenge)

    def denied(self, msg: P.InferRequest, identity: bytes, shm_allowed: bool) -> str:
        """Why ``msg`` may not use the shared memory it names ("" when it may)."""
        if not shm_allowed:
            return TCP_REFUSAL
        for ref in msg.inputs:
            if ref.shm is not None and not self.allows(identity, ref.shm.segment):
                return f"input {ref.name!r}: segment {ref.shm.segment!r} is not registered on this connection"
        for name, ref in msg.outputs.items():
            if not self.allows(identity, ref.segment):
                return f"output {name!r}: segment {ref.segment!r} is not registered on this connection"
        return ""

    def sweep(self) -> None:
        """Forget grants for segments that no longer exist (their owner unlinked them)."""
        for identity in list(self.granted):
            segs = self.granted[identity]
            for s in [s for s in segs if not os.path.exists(os.path.join(self.shm_dir, s))]:
                segs.discard(s)
            if not segs:
                del self.granted[identity]
