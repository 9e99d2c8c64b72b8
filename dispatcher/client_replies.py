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
has room for some peer, not for which, so held replies are tried again at each step of the
dispatcher and then after a wait that doubles, from HELD_RETRY_S to HELD_RETRY_MAX_S, while
none of a client's is taken. A client that took none of its held replies for HELD_GIVE_UP_S is
taken as gone, its held replies dropped: ZeroMQ may keep the queue of a client that left with
messages in flight "full" for ever, never saying it is gone (so one still there that reads
nothing for a minute loses them too; its requests' default timeout is 30 s).
"""

from __future__ import annotations

import collections
import logging
import time

import zmq

from .zmq_frames import send_parts

log = logging.getLogger("batchyard.dispatcher")

HELD_RETRY_S = 0.001
HELD_RETRY_MAX_S = 0.1
HELD_GIVE_UP_S = 60.0
# Held for one client at most: one reply per request it has open is far fewer; past this it
# sends while it never reads (each malformed message answered at once), and its replies are
# dropped as ZeroMQ dropped them, not kept in the dispatcher's memory without bound.
MAX_HELD = 100_000


class _Held:
    __slots__ = ("replies", "since", "tries")

    def __init__(self, header: bytes, now: float) -> None:
        self.replies = collections.deque((header,))
        self.since = now  # when one was last taken (or the first held)
        self.tries = 0  # flushes since then


class ClientReplies:
    def __init__(self, sock: zmq.Socket, clock=time.monotonic) -> None:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock = sock
        self.clock = clock
        self._held: dict[bytes, _Held] = {}
        self.tokens_dropped = 0  # streamed-token messages dropped to a full queue, all clients
        self.replies_dropped = 0  # past MAX_HELD, or given up

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def retry_in(self) -> float:
        """Seconds until the held replies are worth trying again (inf: none held)."""
        if not self._held:
            return float("inf")
        tries = min(held.tries for held in self._held.values())
        return min(HELD_RETRY_MAX_S, HELD_RETRY_S * (1 << min(tries, 20)))

    def send(self, identity: bytes, header: bytes) -> None:
        """``header`` to the client ``identity``: now, or once its queue has room."""
        held = self._held.get(identity)
        if held is not None:
            if len(held.replies) < MAX_HELD:
                held.replies.append(header)
            else:
                self.replies_dropped += 1
            return
        if self._try(identity, header) is _FULL:
            self._held[identity] = _Held(header, self.clock())
            log.warning("client %s reads slower than its replies come: its queue of unread messages is full; its "
                        "replies wait for room and its streamed tokens are dropped meanwhile (each generation's "
                        "reply holds them all)", identity.hex())

    def send_droppable(self, identity: bytes, header: bytes) -> None:
        """A streamed generation's tokens: sent if the client's queue has room, else dropped."""
        if identity in self._held or self._try(identity, header) is _FULL:
            self.tokens_dropped += 1

    def flush(self) -> None:
        """Send what is held, in order, for as long as each client's queue takes it."""
        now = self.clock()
        for identity, held in list(self._held.items()):
            replies, taken = held.replies, False
            while replies:
                got = self._try(identity, replies[0])
                if got is _FULL:
                    break
                if got is _GONE:
                    replies.clear()
                    break
                replies.popleft()
                taken = True
            if taken:
                held.since, held.tries = now, 0
            else:
                held.tries += 1
            if replies and now - held.since > HELD_GIVE_UP_S:
                log.warning("client %s took none of its %d held replies in %.0f s: dropped, the client taken as gone",
                            identity.hex(), len(replies), now - held.since)
                self.replies_dropped += len(replies)
                replies.clear()
            if not replies:
                del self._held[identity]

    def _try(self, identity: bytes, header: bytes) -> object:
        """_SENT, _FULL (the client's queue), or _GONE (no such client connected any more)."""
        try:
            send_parts(self.sock, [identity, header], zmq.NOBLOCK)
        except zmq.Again:
            return _FULL
        except zmq.ZMQError as e:  # EHOSTUNREACH
            log.debug("reply to vanished client dropped: %s", e)
            return _GONE
        return _SENT


_SENT, _FULL, _GONE = object(), object(), object()
