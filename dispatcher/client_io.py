"""The one thread that owns a ``Client``'s ZeroMQ socket.

pyzmq sockets are not thread-safe, so no submitting thread touches the socket: each hands its
encoded request to this thread through a deque and wakes it through an eventfd that the thread
polls together with the DEALER socket in one ``zmq.Poller``. The thread sends, receives every
reply, resolves the waiting futures and fires local deadlines (the poll's timeout is the next
deadline, nothing else). A thread waiting for one reply therefore never holds up another
thread's request.
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
import os
import threading
import time
import weakref
from typing import Callable

import zmq

from .client_codec import (LOST_GRACE_S, ClientCodec, Pending, close_connection, closed_error, connection_lost,
                           forked_error, lost_error, no_reply_error)
from .errors import Cancelled, Unavailable
from .zmq_frames import waiting

log = logging.getLogger("batchyard.client")

_SEND, _CANCEL, _STOP = 0, 1, 2

POLL_MAX_MS = 3_600_000  # an hour: far below a C int of milliseconds


class _Wakeup:
    """An eventfd: any thread may set it; the I/O thread polls and clears it."""

    def __init__(self):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def set(self) -> None:
        os.eventfd_write(self.fd, 1)

    def clear(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)


# Every client's I/O thread, and every AsyncClient: each has ``_forked_off``, run in a fork's child.
_OPEN: weakref.WeakSet = weakref.WeakSet()


def _forked_off_all() -> None:
    for t in list(_OPEN):
        t._forked_off()


def watch_forks(t) -> None:
    global _fork_hook
    if not _fork_hook:  # at the first client, not at import
        os.register_at_fork(after_in_child=_forked_off_all)
        _fork_hook = True
    _OPEN.add(t)


_fork_hook = False


class SocketThread:
    """Owns ``sock`` (and ``ctx`` when ``own_ctx``) from start to close; see the module doc."""

    def __init__(self, codec: ClientCodec, ctx: zmq.Context, sock: zmq.Socket, monitor: zmq.Socket, own_ctx: bool):
        self._codec = codec
        self._ctx = ctx
        self._sock = sock
        self._monitor = monitor
        self._own_ctx = own_ctx
        self._inbox: collections.deque = collections.deque()
        # This client's futures still referenced, settled or not: in a fork's child each gets a
        # fresh lock, and those not settled fail (one the parent's thread was settling at the
        # fork is in no other list).
        self.futures: weakref.WeakSet = weakref.WeakSet()
        # (request id or None, frames) the socket refused for now (over the high-water mark). A
        # request failed or expired meanwhile is not sent any more.
        self._outbox: collections.deque = collections.deque()
        self._deadlines: list[tuple[float, int]] = []  # heap of (monotonic deadline, request id)
        self._lost: list[tuple[float, str, set]] = []  # (fail at, why, request ids) per lost connection
        # Held only around "still open?" + append + wake, so nothing is queued behind the stop
        # marker and nobody writes to the eventfd after the thread closed it.
        self._lock = threading.Lock()
        self._posting = None  # the thread in _post, holding _lock
        self._closing = False
        self._forked = False
        self._wakeup = _Wakeup()
        # True from a set() until the I/O thread takes the inbox: the requests submitted in
        # between ride on that one wake-up instead of a system call each.
        self._wake_armed = False
        # A daemon: a Client nobody closed must not keep the interpreter from exiting.
        self._thread = threading.Thread(target=self._run, name=f"batchyard-client {codec.address}", daemon=True)
        self._thread.start()  # also the memory barrier that hands the socket to the new thread
        watch_forks(self)

    # ---------------------------------------------------------------- any thread
    @property
    def closing(self) -> bool:
        return self._closing

    def on_io_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _forked_off(self) -> None:
        """In the child of a fork: the I/O thread did not come along, and nothing would ever
        answer (a call waited for ever, its timeout included). The client is closed there;
        its socket and memory stay the parent's."""
        self._lock = threading.Lock()  # a thread of the parent may have held it at the fork
        self._closing = self._forked = True
        self._codec.forked_off()
        for future in list(self.futures):
            future._forked_off()

    def settle_in_child(self) -> None:
        """In a fork's child: the requests in flight at the fork fail (Cancelled, the fork's
        words), when waited on or at close(), not in the fork hook: their done-callbacks are
        the user's, to run where the user acts. One the parent's thread was settling at the
        fork is failed here unless it got there. Every request's future is in ``futures`` (its
        Pending holds it), queued, sent or being settled alike."""
        if self._forked:
            for future in list(self.futures):
                if not future.done():
                    future._settle(self.closed_error())

    def send(self, pend: Pending, rid: int, frames: list, deadline: float) -> None:
        """Queue a request; raises Cancelled("client closed") if the client is closed."""
        if not self._post((_SEND, rid, pend, frames, deadline)):
            if not self._forked:
                for region in (*pend.regions, *pend.outputs.values()):
                    self._codec.free(region)
            raise self.closed_error()

    def closed_error(self) -> Cancelled:
        return forked_error() if self._forked else closed_error()

    def cancel(self, rid: int) -> None:
        self._post((_CANCEL, rid, None, None, None))

    def _post(self, item: tuple) -> bool:
        if self._posting == threading.get_ident():
            # A signal handler that interrupted this thread's own _post (a submit from it): the
            # lock is held below, by this thread, so no other can be in here; taken again, the
            # thread waited on itself for ever.
            return self._queue(item)
        with self._lock:
            self._posting = threading.get_ident()
            try:
                return self._queue(item)
            finally:
                self._posting = None

    def _queue_stop(self) -> None:
        """With _lock held (or by this thread, below a signal handler)."""
        if not self._closing:
            self._closing = True
            self._inbox.append((_STOP, None, None, None, None))
            self._wakeup.set()  # unconditionally: the stop must not wait for anything

    def _queue(self, item: tuple) -> bool:
        if self._closing:
            return False
        self._inbox.append(item)
        if not self._wake_armed:
            self._wake_armed = True
            self._wakeup.set()
        return True

    def close(self, timeout: float) -> None:
        """Stop the thread (every request in flight gets Cancelled("client closed")) and wait
        up to ``timeout`` s for it; from the thread itself (a done-callback), do not wait; from
        a signal handler that interrupted this thread's own ``_post`` (a graceful stop's
        handler, as gunicorn's and uvicorn's workers have, while the thread submits), neither
        take the lock that ``_post`` holds below it nor wait: it waited on itself for ever (an
        outside review). The stop is queued (the I/O thread cannot close the wake-up while
        that lock is held) and the thread ends once the handler returns."""
        if self._posting == threading.get_ident():
            self._queue_stop()
            return
        with self._lock:
            self._queue_stop()
        if self._forked:
            self.settle_in_child()
            return
        if threading.current_thread() is self._thread:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("client I/O thread for %s did not stop within %.1f s "
                        "(a done-callback blocking it?)", self._codec.address, timeout)

    # ---------------------------------------------------------------- the I/O thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        failure: Callable[[], BaseException] = closed_error
        try:
            while True:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._wakeup.fd in events:
                    self._wakeup.clear()
                    self._wake_armed = False  # before taking the inbox: a later post wakes us again
                if not self._take_inbox():
                    return
                self._flush()
                if events.get(self._sock, 0) & zmq.POLLIN:
                    self._drain()
                if self._monitor in events:
                    why = connection_lost(self._monitor, self._codec)
                    if why:
                        self._lost.append((time.monotonic() + LOST_GRACE_S, why, self._codec.lost_connection()))
                self._expire()
                self._fail_lost()
                poller.register(self._sock, zmq.POLLIN | (zmq.POLLOUT if self._outbox else 0))
        except BaseException as e:  # a bug here must not leave callers waiting forever
            log.exception("client I/O thread for %s failed", self._codec.address)
            why = f"client I/O thread failed: {e!r}"
            failure = lambda: Unavailable(why)  # noqa: E731
        finally:
            self._shut_down(failure)

    def _take_inbox(self) -> bool:
        """Register and queue what the submitting threads handed over; False at the stop marker."""
        codec = self._codec
        while self._inbox:
            op, rid, pend, frames, deadline = self._inbox.popleft()
            if op == _SEND:
                codec.pending[rid] = pend  # before it is sent: the reply must find it
                heapq.heappush(self._deadlines, (deadline, rid))
                if codec.refused:
                    self._lost.append((time.monotonic(), codec.refused, {rid}))
                else:
                    self._outbox.append((rid, frames))
            elif op == _CANCEL:
                if rid in codec.pending:
                    self._outbox.append((None, [codec.encode_cancel(rid)]))
            else:
                return False
        return True

    def _flush(self) -> None:
        self._codec.flush(self._outbox, self._send_nowait)

    def _send_nowait(self, frames: list) -> None:
        self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)

    def _drain(self) -> None:
        # Receive everything first, then settle: the threads woken by settling then do not
        # compete with the rest of the drain for the GIL, and they send their next requests
        # close together, which is what lets the dispatcher batch them.
        replies = []
        while waiting(self._sock):  # not a zmq.Again per drain (zmq_frames.waiting)
            replies.append(self._sock.recv_multipart(zmq.NOBLOCK))
        for frames in replies:
            self._codec.on_reply(frames)
        while self._codec.finishing:
            self._outbox.append((None, [self._codec.finishing.pop(0)]))

    def _fail_lost(self) -> None:
        now = time.monotonic()
        while self._lost and self._lost[0][0] <= now:
            _, why, rids = self._lost.pop(0)
            self._codec.fail_lost(rids, lambda: lost_error(self._codec.address, why))

    def _poll_timeout_ms(self):
        heap, pending = self._deadlines, self._codec.pending
        while heap and heap[0][1] not in pending:  # answered already: no need to wake for it
            heapq.heappop(heap)
        when = min(heap[0][0] if heap else math.inf, self._lost[0][0] if self._lost else math.inf)
        if when == math.inf:
            return None
        # zmq_poll takes a C int: a deadline past ~24.8 days (a timeout up to MAX_TIMEOUT_S is
        # valid) raised OverflowError on this thread and closed the client for good. Woken early,
        # the loop only looks again.
        return max(0, min(POLL_MAX_MS, math.ceil((when - time.monotonic()) * 1000)))

    def _expire(self) -> None:
        heap, now = self._deadlines, time.monotonic()
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            pend = self._codec.expire_local(rid)
            if pend is not None:
                pend.resolve(no_reply_error(self._codec.address))

    def _shut_down(self, failure: Callable[[], BaseException]) -> None:
        with self._lock:
            self._closing = True
            queued = [item for item in self._inbox if item[0] == _SEND]
            self._inbox.clear()
            self._wakeup.close()
        for _, rid, pend, _, _ in queued:  # handed over but never sent
            self._codec.pending[rid] = pend
        close_connection(self._codec, self._sock, self._monitor, self._ctx if self._own_ctx else None, failure)
