"""``AsyncClient``: the asyncio SDK. Its DEALER socket lives on the event loop (a reader on the
socket's FD) rather than on an I/O thread, as only the loop's thread touches it; encoding,
decoding and the shared-memory pool are the ones ``Client`` uses (dispatcher/client_codec.py).
"""

from __future__ import annotations

import asyncio
import collections
import collections.abc
import time
import weakref
from typing import Callable, Optional

import zmq

from . import protocol as P
from .client_codec import (DEFAULT_SHM_THRESHOLD, LOST_GRACE_S, REPLY_GRACE_S, ClientCodec, CodecAccess,
                           EncodedInputs, Generation, InferResult, Pending, checked_model, checked_priority,
                           checked_timeout, checked_wait, close_connection, closed_error, connection_lost, forked_error, lost_error,
                           no_reply_error, open_dealer, setup_step_timeout, setup_timeout_error, time_left)
from .client_io import watch_forks
from .errors import DeadlineExceeded
from .zmq_frames import NOBLOCK, send_parts


class _Closed(collections.abc.Coroutine):
    """What ``AsyncClient.close`` returns: a coroutine with nothing left to do (no event loop
    needed, so it may be awaited in any loop, given to ``asyncio.run`` as tritonclient's aio
    ``close()`` is, or dropped without a never-awaited warning: it is no native coroutine)."""

    __slots__ = ()

    def __await__(self):
        return
        yield  # (a generator: awaiting it finishes at once with None)

    def send(self, value):
        raise StopIteration

    def throw(self, typ, val=None, tb=None):
        raise (typ() if isinstance(typ, type) else typ) if val is None else val

    def close(self):
        pass


_CLOSED = _Closed()


def _weakly(method):
    """A loop callback that calls ``method`` while its client lives: the loop's readers held the
    client itself, so one dropped without close() was never collected (200 such clients left
    1,807 file descriptors open)."""
    ref = weakref.WeakMethod(method)

    def call():
        m = ref()
        if m is not None:
            m()
    return call


def _release(loop: asyncio.AbstractEventLoop, fds: tuple, codec: ClientCodec, sock: zmq.Socket,
             monitor: zmq.Socket, ctx: Optional[zmq.Context]) -> None:
    """An AsyncClient's close, holding nothing of the client (its finalizer's)."""
    for fd in fds:
        try:
            loop.remove_reader(fd)
        except RuntimeError:  # the loop is closed: it watches nothing
            pass
    close_connection(codec, sock, monitor, ctx, closed_error)


class AsyncClient(CodecAccess):
    """asyncio client: ``await client.infer(...)``; any number in flight from one task or many."""

    def __init__(self, address: str, *, shm_threshold: int = DEFAULT_SHM_THRESHOLD,
                 pool_bytes: int = 64 << 20, ctx: Optional[zmq.Context] = None,
                 curve_server_key: Optional[bytes] = None, curve_keys: Optional[tuple[bytes, bytes]] = None,
                 shared_memory: Optional[bool] = None):
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:  # asyncio's own words name no way out
            raise RuntimeError("AsyncClient needs a running event loop: create it inside a coroutine "
                               "(e.g. under asyncio.run), or use batchyard.client.Client outside asyncio") from None
        self._codec = ClientCodec(address, shm_threshold=shm_threshold, pool_bytes=pool_bytes,
                                  shared_memory=shared_memory)
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        try:
            self.sock, self._monitor = open_dealer(self.ctx, address, curve_server_key, curve_keys)
        except BaseException:
            if self._own_ctx:
                self.ctx.term()
            raise
        self._timers: dict[int, asyncio.TimerHandle] = {}
        # (request id or None, frames) the socket's send queue had no room for (its high-water
        # mark reached while the dispatcher is away): sent in order as room comes.
        self._outbox: collections.deque = collections.deque()
        self._grant_lock = asyncio.Lock()
        self.closed = self._forked = False
        fds = (self.sock.getsockopt(zmq.FD), self._monitor.getsockopt(zmq.FD))
        self.loop.add_reader(fds[0], _weakly(self._drain))
        self.loop.add_reader(fds[1], _weakly(self._on_monitor))
        # Dropped without close(), it is closed when collected (a pending request's timer holds it
        # until then); not at the interpreter's exit, after its loop is gone.
        self._finalizer = weakref.finalize(self, _release, self.loop, fds, self._codec, self.sock, self._monitor,
                                           self.ctx if self._own_ctx else None)
        self._finalizer.atexit = False
        # A ZeroMQ socket's FD signals new messages only once a read has found none: until then
        # the monitor never woke the loop, and requests in flight on a lost connection waited
        # out their timeout instead of failing UNAVAILABLE (Client's poller reads ZMQ_EVENTS).
        self._on_monitor()
        watch_forks(self)

    def _forked_off(self) -> None:
        """In the child of a fork: closed there, its socket, loop and memory left to the parent.
        Not closed, a child's alloc_array handed out the parent's live memory, and the parent's
        next array was the same region, the child's data in it (Client did this already)."""
        self.closed = self._forked = True
        self._finalizer.detach()  # the socket, loop and memory are the parent's
        self._codec.forked_off()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()

    def close(self) -> _Closed:
        """Fail every request in flight with Cancelled("client closed") and release the socket
        and the shared-memory pool, at once; ``await client.close()`` works as well (as
        tritonclient's aio clients are closed), the awaitable returned being already done. An
        ``async def`` would close nothing when called without ``await``, as callers call it."""
        if not self.closed:
            self._close_now()
        elif self._forked:  # in a fork's child: the parent's requests are never answered here
            self._codec.fail_all_forked(forked_error)
        return _CLOSED

    def _close_now(self) -> None:
        self.closed = True
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()
        self._outbox.clear()  # (their requests fail with the others still pending)
        self._finalizer()

    def _on_monitor(self) -> None:
        why = connection_lost(self._monitor, self._codec) if not self.closed else ""
        if why:
            rids = self._codec.lost_connection()
            self.loop.call_later(LOST_GRACE_S, self._fail_lost, rids, why)

    def _fail_lost(self, rids: set, why: str) -> None:
        if not self.closed:
            self._drain()
            self._codec.fail_lost(rids, lambda: lost_error(self.address, why))

    def _drain(self) -> None:
        """The socket's FD woke the loop: receive what came, and send what waits for room. Asking
        ZMQ_EVENTS consumes the FD's edge, so the loop ends only once neither is possible (not a
        zmq.Again per drain: zmq_frames.waiting)."""
        while not self.closed:
            events = self.sock.getsockopt(zmq.EVENTS)
            if events & zmq.POLLIN:
                self._codec.on_reply(self.sock.recv_multipart(NOBLOCK))
                while self._codec.finishing:
                    self._send_frames([self._codec.finishing.pop(0)])
            elif not (events & zmq.POLLOUT and self._outbox and self._flush()):
                return

    def _flush(self) -> bool:
        return self._codec.flush(self._outbox, self._send_nowait)

    def _send_nowait(self, frames: list) -> None:
        send_parts(self.sock, frames, NOBLOCK)

    def _in_another_loop(self) -> bool:
        """Called from a running event loop other than its own (another thread's asyncio.run):
        the request went out on this loop's socket from that thread (sockets are not
        thread-safe), and its caller got asyncio's "attached to a different loop"."""
        try:
            return asyncio.get_running_loop() is not self.loop
        except RuntimeError:  # no running loop: submit's task, or a call from this loop's own code
            return False

    def _refuse_if_unusable(self) -> None:
        if self.closed:
            # (in a fork's child, the parent's client: said so, as the blocking Client says it)
            raise forked_error() if self._forked else closed_error()
        if self.loop.is_closed():
            # Used again after its loop ended (a second asyncio.run): each call left its request
            # pending and its memory taken before the loop's own error.
            raise RuntimeError("this AsyncClient's event loop is closed: an AsyncClient serves the loop it was "
                               "made in; make one in this loop")
        if self._in_another_loop():
            raise RuntimeError("this AsyncClient belongs to another event loop: an AsyncClient serves the loop it "
                               "was made in; make one in this loop")

    def _send(self, kind: str, rid: int, frames: list, regions: list, outputs: dict, timeout: float,
              on_tokens: Optional[Callable[[list], None]] = None) -> asyncio.Future:
        if self.closed or self.loop.is_closed() or self._in_another_loop():
            if not self._forked:  # (a fork's child frees nothing of the parent's pool)
                for region in (*regions, *outputs.values()):
                    self._codec.free(region)
            self._refuse_if_unusable()
        fut = self.loop.create_future()

        def resolve(value, fut=fut, rid=rid):
            h = self._timers.pop(rid, None)
            if h is not None:
                h.cancel()
            if fut.done():  # cancelled by the caller meanwhile
                return
            if isinstance(value, BaseException):
                fut.set_exception(value)
            else:
                fut.set_result(value)

        self._codec.pending[rid] = Pending(kind, regions, outputs, resolve, on_tokens)
        self._timers[rid] = self.loop.call_later(timeout, self._on_local_timeout, rid)
        if self._codec.refused:
            self.loop.call_soon(self._fail_lost, {rid}, self._codec.refused)
        else:
            self._send_frames(frames, rid)
        return fut

    def _send_frames(self, frames: list, rid: Optional[int] = None) -> None:
        """Every send goes through here, without blocking: where the socket's queue is full (the
        dispatcher away, 100,000 messages sent meanwhile) the frames wait in the outbox, behind
        any already there. A blocking send stopped the event loop until a dispatcher came back:
        every task and timer, local timeouts included (requests with 2 s timeouts settled at
        38 s), and a front door's every route. Sending can consume the FD's edge: drain soon if
        replies are already waiting or the outbox can go on (asking EVENTS costs one poll; an
        unconditional drain cost that plus a zmq.Again per request). A send without this check
        (a cancellation's) left a reply that had just arrived unread until the next request, and
        an idle front door has none: the request it belonged to was answered only by its local
        timeout."""
        self._outbox.append((rid, frames))  # behind any already waiting, and sent now if they went
        self._flush()
        if self.sock.getsockopt(zmq.EVENTS) & (zmq.POLLIN | (zmq.POLLOUT if self._outbox else 0)):
            self.loop.call_soon(self._drain)

    def _on_local_timeout(self, rid: int) -> None:
        self._timers.pop(rid, None)
        pend = self._codec.expire_local(rid)
        if pend is not None:
            pend.resolve(no_reply_error(self.address))

    async def infer(self, model: str, inputs: dict, *, priority="normal",
                    timeout: Optional[float] = None) -> InferResult:
        return await self._infer(model, inputs, priority, timeout, time.monotonic())

    def submit(self, model: str, inputs: dict, *, priority="normal", timeout: Optional[float] = None) -> asyncio.Task:
        """``infer`` as a Task, started at once. The inputs are read before this returns (as
        Client.submit's are): the caller may refill its arrays right away; a bad argument raises
        here. (The Task read them only when it first ran, and a buffer refilled after submit()
        was what every request sent.)"""
        self._refuse_if_unusable()
        checked_model(model)
        priority = checked_priority(priority)
        self._codec.call_timeout(timeout)  # (checked here, not in the Task)
        start = time.monotonic()  # one deadline for the call, from here: see Client.submit
        encoded = self._codec.encode_inputs(inputs)
        try:
            task = self.loop.create_task(self._infer(model, encoded, priority, timeout, start))
        except BaseException:
            self._codec.release_inputs(encoded)
            raise
        # A Task cancelled before it first runs never runs its coroutine's clean-up: its inputs'
        # pool regions go back here (a no-op once the request took them).
        task.add_done_callback(lambda _: self._codec.release_inputs(encoded))
        return task

    async def _infer(self, model: str, inputs, priority, timeout: Optional[float], start: float) -> InferResult:
        """``inputs``: a dict (infer), or read already (submit: EncodedInputs). ``timeout``: the
        call's as asked (None: the node's default, which the model's spec brings); its deadline
        counts from ``start``."""
        try:
            fetch = self._codec.needs_spec(model)
            if fetch:
                with self._codec.fetching_spec(timeout, model):
                    await self.model_info(model, timeout=self._codec.spec_wait(timeout))
            timeout, deadline = self._codec.call_deadline(start, timeout, fetch, model)
        except BaseException:
            if type(inputs) is EncodedInputs:
                self._codec.release_inputs(inputs)
            raise
        rid, frames, regions, outputs, timeout, need = self._codec.encode_infer(model, inputs, priority, timeout)
        if need:
            try:
                await self._register_segments(model, need, deadline)
                timeout = time_left(deadline, model)
                frames[0] = self._codec.retimed(frames[0], timeout)
            except BaseException:
                for region in (*regions, *outputs.values()):
                    self._codec.free(region)
                raise
        fut = self._send("infer", rid, frames, regions, outputs, timeout + REPLY_GRACE_S)
        try:
            return await fut
        except asyncio.CancelledError:
            # The caller gave up: withdraw it if still queued (the late reply frees its regions).
            self._withdraw(rid)
            raise
        finally:
            # The future holds the error, whose traceback holds this frame: a cycle that kept the
            # inputs (the front door's pool memory) until the cycle collector ran.
            del fut

    def _withdraw(self, rid: int) -> None:
        """A request its caller cancelled: its local timeout goes (left, it lived for the whole
        timeout: up to 10^9 s as a Triton client may ask), and the dispatcher is told."""
        h = self._timers.pop(rid, None)
        if h is not None:
            h.cancel()
        if not self.closed:
            self._codec.expire_local(rid)
            self._send_frames([self._codec.encode_cancel(rid)])

    async def _register_segments(self, model: str, segments: set[str], deadline: float) -> None:
        """See Client._register_segments."""
        # What is left first: a deadline already passed raised while the acquire() coroutine was
        # made and never awaited (a RuntimeWarning on the user's stderr).
        left = time_left(deadline, model)
        try:
            # Not wait_for: Python 3.11's swallows a cancellation that comes after the lock was
            # handed over and before this task ran again, and the cancelled request went on.
            async with asyncio.timeout(left):
                await self._grant_lock.acquire()
        except TimeoutError:
            raise setup_timeout_error(model) from None
        try:
            codec, connection = self._codec, self._codec.connection
            for seg in sorted(segments - codec.granted):
                challenge = await self._grant_step(model, deadline, *codec.encode_shm_register(seg, proved=False))
                codec.answer_challenge(seg, challenge)
                await self._grant_step(model, deadline, *codec.encode_shm_register(seg, proved=True))
                codec.add_grant(seg, connection)
        finally:
            self._grant_lock.release()

    async def _grant_step(self, model: str, deadline: float, rid: int, frames: list) -> bytes:
        try:
            return await self._send("shm", rid, frames, [], {}, setup_step_timeout(deadline, model))
        except DeadlineExceeded:
            time_left(deadline, model)  # see Client._grant_step
            raise

    async def generate(self, model: str, prompt, max_tokens: int = 16, *, priority="normal",
                       timeout: Optional[float] = None, route: str = "",
                       on_tokens: Optional[Callable[[list], None]] = None, ignore_eos: bool = False,
                       sampling=None) -> Generation:
        """See Client.submit_generate. ``on_tokens`` is called on this client's event loop."""
        rid, frames, timeout = self._codec.encode_generate(model, prompt, max_tokens, priority, timeout, route,
                                                           on_tokens, ignore_eos, sampling)
        fut = self._send("generate", rid, frames, [], {}, timeout + REPLY_GRACE_S, on_tokens)
        try:
            return await fut
        except asyncio.CancelledError:
            # As infer's: withdrawn from the dispatcher too, which stops it in its engine. Only
            # forgotten here, it decoded to its max_tokens for nobody (an HTTP client that hung up).
            self._withdraw(rid)
            raise
        finally:
            del fut  # (as infer's)

    async def model_info(self, model: str, timeout: float = 10.0) -> P.ModelSpec:
        timeout = checked_timeout(timeout)
        rid, frames = self._codec.encode_model_info(model)
        return await self._send("model_info", rid, frames, [], {}, timeout)

    async def status(self, min_registrations: int = 0, wait: float = 0.0, timeout: float = 10.0,
                     min_departures: int = 0, brief: bool = False) -> P.StatusReply:
        timeout = checked_timeout(timeout)
        wait = checked_wait(wait)
        rid, frames = self._codec.encode_status(min_registrations, wait, min_departures, brief)
        return await self._send("status", rid, frames, [], {}, wait + timeout)
