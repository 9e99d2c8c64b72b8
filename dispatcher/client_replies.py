"""Replies to clients on the dispatcher's client ROUTER, never lost to a full queue.

ZeroMQ queues at most SNDHWM messages a client (plus its own RCVHWM) and a ROUTER drops what
comes past that, silently. A streamed generation sends a message an engine step: a client that
read slower than its streams came (a slow ``on_tokens`` callback, a front door's stalled loop)
filled its queue, and a generation's one ``generated`` reply was dropped like its tokens; the
client waited out its timeout and was told the dispatcher did not answer.

So the socket is ROUTER_MANDATORY and every send NOBLOCK: a full queue raises instead of
dropping (and never blocks the dispatcher's one thread). Streamed tokens are then dropped, as
docs/protocol.md allows (the client finds the gap and takes them from the reply), and every
other message is held, in order, until the client's queue has room. ZeroMQ says when a ROUTER
has room for some peer, not for which, so held replies are tried again after a wait that
doubles, from HELD_RETRY_S to HELD_RETRY_MAX_S, while none is taken. A client that took none of
its held replies for HELD_GIVE_UP_S is taken as gone, its held replies dropped: ZeroMQ may keep
the queue of a client that left with messages in flight "full" for ever, never saying it is
gone (so one still there that reads nothing for a minute loses them too; its requests' default
timeout is 30 s).
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Optional

import zmq

from .zmq_frames import NOBLOCK, send_parts

log = logging.getLogger("batchyard.dispatcher")

HELD_RETRY_S = 0.001
HELD_RETRY_MAX_S = 0.1
HELD_GIVE_UP_S = 60.0
# Held for one client at most: one reply per request it has open is far fewer; past this it
# sends while it never reads (each malformed message answered at once), and its replies are
# dropped as ZeroMQ dropped them, not kept in the dispatcher's memory without bound.
MAX_HELD = 100_000


class _Held:
    __slots__ = ("messages", "since")

    def __init__(self, parts: tuple, now: float) -> None:
        self.messages = collections.deque((parts,))
        self.since = now  # when one was last taken (or the first held)


class ClientReplies:
    def __init__(self, sock: zmq.Socket, clock=time.monotonic) -> None:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock = sock
        self.clock = clock
        self._held: dict[bytes, _Held] = {}
        self._tries = 0  # flushes since one took a held message (all clients: one backoff)
        self._next_try = 0.0
        self.tokens_dropped = 0  # streamed-token messages dropped to a full queue, all clients
        self.replies_dropped = 0  # past MAX_HELD, or given up

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def next_try(self) -> float:
        """When the held messages are worth trying again (inf: none held)."""
        return self._next_try if self._held else math.inf

    def send(self, identity: bytes, *parts) -> None:
        """The message ``parts`` (a header, then any frames) to the client ``identity``: now, or
        once its queue has room."""
        if self._held:  # (the common case, none held, costs one test)
            held = self._held.get(identity)
            if held is not None:
                if len(held.messages) < MAX_HELD:
                    held.messages.append(parts)
                else:
                    self.replies_dropped += 1
                return
        if self._try(identity, parts) is not _FULL:
            return
        now = self.clock()
        if not self._held:
            self._tries, self._next_try = 0, now + HELD_RETRY_S
        self._held[identity] = _Held(parts, now)
        log.warning("client %s reads slower than its replies come: its queue of unread messages is full; its "
                    "replies wait for room and its streamed tokens are dropped meanwhile (each generation's "
                    "reply holds them all)", identity.hex())

    def send_droppable(self, identity: bytes, header: bytes) -> None:
        """A streamed generation's tokens: sent if the client's queue has room, else dropped."""
        if identity in self._held or self._try(identity, (header,)) is _FULL:
            self.tokens_dropped += 1

    def flush(self, now: Optional[float] = None, force: bool = False) -> None:
        """Send what is held, in order, for as long as each client's queue takes it; not before
        next_try unless ``force`` (each failed try costs a send: tried at every step, 100 held
        clients cost each step ~1 ms)."""
        now = self.clock() if now is None else now
        if not self._held or (now < self._next_try and not force):
            return
        progress = False
        for identity, held in list(self._held.items()):
            messages, taken = held.messages, False
            while messages:
                got = self._try(identity, messages[0])
                if got is _FULL:
                    break
                if got is _GONE:
                    messages.clear()
                    break
                messages.popleft()
                taken = True
            if taken:
                held.since, progress = now, True
            if messages and now - held.since > HELD_GIVE_UP_S:
                log.warning("client %s took none of its %d held replies in %.0f s: dropped, the client taken as gone",
                            identity.hex(), len(messages), now - held.since)
                self.replies_dropped += len(messages)
                messages.clear()
            if not messages:
                del self._held[identity]
        self._tries = 0 if progress else self._tries + 1
        self._next_try = now + min(HELD_RETRY_MAX_S, HELD_RETRY_S * (1 << min(self._tries, 20)))

    def _try(self, identity: bytes, parts: tuple) -> object:
        """_SENT, _FULL (the client's queue), or _GONE (no such client connected any more)."""
        try:
            send_parts(self.sock, [identity, *parts], NOBLOCK)
        except zmq.Again:
            return _FULL
        except zmq.ZMQError as e:  # EHOSTUNREACH
            log.debug("reply to vanished client dropped: %s", e)
            return _GONE
        return _SENT


_SENT, _FULL, _GONE = object(), object(), object()
