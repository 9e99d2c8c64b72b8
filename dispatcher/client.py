"""Client SDK: ``Client`` (blocking, futures, shared by any number of threads) and
``AsyncClient`` (asyncio, dispatcher/client_async.py).

Both speak the protocol of docs/protocol.md over one DEALER socket and allow many requests
in flight. Tensors of at least ``shm_threshold`` bytes travel through a client-owned shared
memory pool; smaller ones ride inline in the message. Arrays made with ``alloc_array`` live
in that pool already and are sent by reference with no copy at all (the fast path for big
tensors: fill them in place). Large outputs are written by the worker straight into the
pool; the returned array is a view of it, and its region goes back to the pool when the
array is garbage-collected. An output that came inline (under ``shm_threshold``, and every one
over tcp) is a read-only view of the reply's frame, as tritonclient's ``as_numpy`` arrays are:
``np.array(out)`` (or ``out.copy()``) before writing into it in place.

``Client``'s socket is owned by one I/O thread (dispatcher/client_io.py): ``submit`` encodes
on the caller's thread, hands the frames over and returns a future at once; a thread waiting
in ``result()`` waits on its own future only, so threads sharing a Client never wait on each
other and their requests can be batched together.

Local timeouts are a backstop: the dispatcher answers DEADLINE_EXCEEDED at the request's
deadline; if nothing at all comes back within ``timeout + REPLY_GRACE_S`` (dispatcher down or
unreachable) the request fails with DeadlineExceeded on the client's side. A request's input
regions are only returned to the pool when its reply arrives, so a late-running worker never
reads memory that was handed to another request. ``close()`` fails every request still in
flight with Cancelled("client closed").
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Callable, Optional

import zmq

from . import protocol as P
from .client_async import AsyncClient
from .client_codec import (DEFAULT_SHM_THRESHOLD, DEFAULT_TIMEOUT_S, PRIORITIES, REPLY_GRACE_S,
                           ClientCodec, CodecAccess, Generation, InferResult, Pending, checked_timeout, checked_wait,
                           open_dealer, setup_step_timeout, setup_timeout_error, time_left)
from .client_io import SocketThread

log = logging.getLogger("batchyard.client")
from .errors import DeadlineExceeded, InvalidArgument

__all__ = ["Client", "AsyncClient", "InferFuture", "InferResult", "DEFAULT_TIMEOUT_S", "DEFAULT_SHM_THRESHOLD",
           "REPLY_GRACE_S", "PRIORITIES"]

# close() waits this long for the I/O thread; it only ever blocks on a user's done-callback.
CLOSE_JOIN_TIMEOUT_S = 5.0


class InferFuture(Future):
    """Result of ``Client.submit()``: a ``concurrent.futures.Future`` (works with ``wait``,
    ``as_completed``, ``add_done_callback`` and ``asyncio.wrap_future``), settled by the
    client's I/O thread. ``result(timeout)`` raises TimeoutError if it is not settled within
    ``timeout`` s; the request stays in flight. Done-callbacks run on the I/O thread: keep
    them short; a call there that would wait for a reply (``refuse_on_io_thread``) raises
    InvalidArgument."""

    def __init__(self, client: "Client", rid: int, deadline: float):
        super().__init__()
        self.set_running_or_notify_cancel()  # it is in flight from the start
        self._client = client  # keeps the client (and so its socket) alive while this is used
        self.id = rid
        self.deadline = deadline  # monotonic; the I/O thread fails it with DeadlineExceeded then
        client._io.futures.add(self)

    def _invoke_callbacks(self) -> None:
        # concurrent.futures lets a callback's BaseException through (asyncio.CancelledError is
        # one, SystemExit too): on the I/O thread it ended the client for every thread, and each
        # later call was told "client closed" (an outside review). Logged, as an Exception is.
        for callback in self._done_callbacks:
            try:
                callback(self)
            except BaseException:  # noqa: BLE001
                log.exception("done-callback %r of request %d raised", callback, self.id)

    def _settle(self, value) -> None:
        if isinstance(value, BaseException):
            self.set_exception(value)
        else:
            self.set_result(value)

    def _forked_off(self) -> None:
        """In a fork's child: a thread of the parent may have held this future's lock at the fork
        (the I/O thread settling it, a thread waking in result()), and every look at the future
        here waited for ever on it."""
        self._condition = threading.Condition()

    def result(self, timeout: Optional[float] = None):
        self._not_on_io_thread()
        return super().result(timeout)

    def exception(self, timeout: Optional[float] = None):
        self._not_on_io_thread()
        return super().exception(timeout)

    def _not_on_io_thread(self) -> None:
        if not self.done():
            refuse_on_io_thread(self._client._io)
            # In a fork's child the parent's requests are never answered: waited for there, they
            # waited for ever, a timeout of theirs included (the I/O thread that ends it is the parent's).
            self._client._io.settle_in_child()

    def cancel(self) -> bool:
        """Ask the dispatcher to drop this request if it is still queued; the future then
        raises Cancelled (a BatchyardError and a ``concurrent.futures.CancelledError``). An
        infer request already running completes normally; a generation is stopped in its engine
        too. Unlike a local Future's, True means the ask was sent, not that the call is
        cancelled: only the dispatcher knows whether it is still queued, and ``cancelled()``
        stays False (the future is settled by the reply). False if it was already done."""
        if self.done() or self._client._io.closing:  # (a closed client, or a fork's child: nothing is sent)
            return False
        self._client._io.cancel(self.id)
        return True


def refuse_on_io_thread(io: SocketThread) -> None:
    """InvalidArgument if called on the client's I/O thread (from a done-callback), where a call
    waiting for a reply would wait for ever: only that thread can settle it, and every other
    request of the client waited with it. Checked before any lock is taken: a callback's submit
    that needed a segment's grant blocked on the grant lock that another thread held while it
    waited for its own grant, which the blocked I/O thread could never deliver."""
    if io.on_io_thread():
        raise InvalidArgument("a blocking call (result(), exception(), infer, model_info, status, a submit that "
                              "needs a model's spec or a new shared-memory segment's grant) from a done-callback, "
                              "which runs on the client's I/O thread, would wait for ever: make it from another "
                              "thread")


class Client(CodecAccess):
    """Blocking client; share one among any number of threads."""

    def __init__(self, address: str, *, shm_threshold: int = DEFAULT_SHM_THRESHOLD,
                 pool_bytes: int = 64 << 20, ctx: Optional[zmq.Context] = None,
                 curve_server_key: Optional[bytes] = None, curve_keys: Optional[tuple[bytes, bytes]] = None,
                 shared_memory: Optional[bool] = None):
        self._codec = ClientCodec(address, shm_threshold=shm_threshold, pool_bytes=pool_bytes,
                                  shared_memory=shared_memory)
        self._grant_lock = threading.Lock()
        own_ctx = ctx is None
        ctx = ctx or zmq.Context()
        try:
            # here, so a bad address raises to the caller
            sock, monitor = open_dealer(ctx, address, curve_server_key, curve_keys)
        except BaseException:
            if own_ctx:
                ctx.term()
            raise
        self._io = SocketThread(self._codec, ctx, sock, monitor, own_ctx)
        # A Client dropped without close() still stops its thread and frees its memory; the
        # finalizer holds the I/O thread, never the Client, so it does not keep it alive.
        self._finalizer = weakref.finalize(self, self._io.close, CLOSE_JOIN_TIMEOUT_S)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def closed(self) -> bool:
        return self._io.closing

    def close(self) -> None:
        """Fail every request in flight with Cancelled("client closed"), stop the I/O thread
        (waiting up to CLOSE_JOIN_TIMEOUT_S) and release the shared-memory pool."""
        self._finalizer()
        # Called by another thread at the same time, the finalizer was that one's to run, and
        # this call returned with the thread and the pool still there (an outside review): it
        # waits for the same end (at once where it is over).
        self._io.close(CLOSE_JOIN_TIMEOUT_S)

    def submit(self, model: str, inputs: dict, *, priority="normal", timeout: Optional[float] = None) -> InferFuture:
        """Send a request and return its future at once (a model's first call fetches its spec
        first, and a new pool segment's first use its grant, within ``timeout``: those block the
        caller). ``timeout`` (s) is the request's
        deadline at the dispatcher (default: the node's ``default_timeout_s``, which the model's
        spec brings; DEFAULT_TIMEOUT_S from a dispatcher that does not say). The inputs are read
        before this returns (copied; ``alloc_array`` arrays excepted, sent by reference): the
        caller may refill its arrays right away."""
        if self.closed:
            raise self._io.closed_error()
        # One deadline for the call: the set-up steps (the model's spec, a new segment's grant)
        # take from it, and the request gets what is left (each step had the whole timeout,
        # and a slow dispatcher made infer(timeout=2) take 8.5 s).
        start, fetch = time.monotonic(), self._codec.needs_spec(model)
        if fetch:
            with self._codec.fetching_spec(timeout, model):
                self.model_info(model, timeout=self._codec.spec_wait(timeout))
        timeout, deadline = self._codec.call_deadline(start, timeout, fetch, model)
        rid, frames, regions, outputs, timeout, need = self._codec.encode_infer(model, inputs, priority, timeout)
        if need:
            try:
                self._register_segments(model, need, deadline)
                timeout = time_left(deadline, model)
                frames[0] = self._codec.retimed(frames[0], timeout)
            except BaseException:
                for region in (*regions, *outputs.values()):
                    self._codec.free(region)
                raise
        return self._send("infer", rid, frames, regions, outputs, timeout + REPLY_GRACE_S)

    def _register_segments(self, model: str, segments: set[str], deadline: float) -> None:
        """Prove to the dispatcher that this connection can write each segment (once per
        segment, so once per 64 MiB of pool; docs/protocol.md, "Trust model"), within the
        call's ``deadline``: waiting for another thread's registration takes from it (it waited
        with no limit: infer(timeout=1) took 10.8 s), and so does each step (each had the
        call's whole timeout again)."""
        refuse_on_io_thread(self._io)
        # two threads' first use of a new segment: one registration
        if not self._grant_lock.acquire(timeout=time_left(deadline, model)):
            raise setup_timeout_error(model)
        try:
            codec, connection = self._codec, self._codec.connection
            for seg in sorted(segments - codec.granted):
                challenge = self._grant_step(model, deadline, *codec.encode_shm_register(seg, proved=False))
                codec.answer_challenge(seg, challenge)
                self._grant_step(model, deadline, *codec.encode_shm_register(seg, proved=True))
                codec.add_grant(seg, connection)
        finally:
            self._grant_lock.release()

    def _grant_step(self, model: str, deadline: float, rid: int, frames: list) -> bytes:
        try:
            return self._send("shm", rid, frames, [], {}, setup_step_timeout(deadline, model)).result()
        except DeadlineExceeded:
            time_left(deadline, model)  # the call's own timeout ran out: said so, not "is it running?"
            raise

    def infer(self, model: str, inputs: dict, *, priority="normal", timeout: Optional[float] = None) -> InferResult:
        # No wait limit of our own: the future's deadline (timeout + grace) bounds it.
        return self.submit(model, inputs, priority=priority, timeout=timeout).result()

    def submit_generate(self, model: str, prompt, max_tokens: int = 16, *, priority="normal",
                        timeout: Optional[float] = None, route: Optional[str] = "",
                        on_tokens: Optional[Callable[[list], None]] = None,
                        ignore_eos: bool = False, sampling=None) -> InferFuture:
        """LLM mode: greedy generation after ``prompt`` (token ids); the future's result is a
        ``Generation`` (a list of token ids with ``.timing``). ``route`` forces "prefill-cpu"
        or "gpu"; empty lets the dispatcher choose. ``on_tokens``: streams the generation; it
        is called with each engine step's new token ids as they are decoded (on this client's
        I/O thread: keep it short), all but the last step's, which only the result holds (a
        list, with their ``.logprobs``). The
        result holds every token; those it has past the ones given to ``on_tokens`` are the rest.
        ``on_tokens`` returning True ends the generation there (a stop string found): it is
        stopped in its engine, and the result is the tokens given (``finish_reason`` "stop",
        no ``timing``).
        The generation ends at the model's end-of-sequence token (the result's
        ``finish_reason`` "stop", that token its last), or at ``max_tokens`` ("length");
        ``ignore_eos`` decodes ``max_tokens`` tokens whatever they are, as vLLM's parameter.
        ``sampling``: greedy when None, else a dict of vLLM's sampling parameters
        (``{"temperature": 0.8, "top_p": 0.95, "seed": 7}``; also top_k, min_p, the presence,
        frequency and repetition penalties, min_tokens, stop_token_ids, logit_bias (int token
        ids to biases in [-100, 100]), allowed_token_ids, bad_words_token_ids (token
        sequences never decoded), logprobs (0 to 20: the result's ``.logprobs`` give each
        token's log probability and that many most likely tokens' at its position) and
        prompt_logprobs (the same of the prompt's tokens, ``.prompt_logprobs``; the request then
        takes the "gpu" route, whose prefill computes them)), checked against vLLM's bounds."""
        if self.closed:
            raise self._io.closed_error()
        rid, frames, timeout = self._codec.encode_generate(model, prompt, max_tokens, priority, timeout, route,
                                                           on_tokens, ignore_eos, sampling)
        return self._send("generate", rid, frames, [], {}, timeout + REPLY_GRACE_S, on_tokens)

    def generate(self, model: str, prompt, max_tokens: int = 16, **kw) -> Generation:
        return self.submit_generate(model, prompt, max_tokens, **kw).result()

    def model_info(self, model: str, timeout: float = 10.0) -> P.ModelSpec:
        timeout = checked_timeout(timeout)
        refuse_on_io_thread(self._io)
        rid, frames = self._codec.encode_model_info(model)
        return self._send("model_info", rid, frames, [], {}, timeout).result()

    def status(self, min_registrations: int = 0, wait: float = 0.0, timeout: float = 10.0,
               min_departures: int = 0, brief: bool = False) -> P.StatusReply:
        """Dispatcher state; with ``min_registrations`` (``min_departures``) the reply waits (up
        to ``wait`` s) until that many worker registrations (workers taken out of rotation:
        stopped, silent, lost) have happened since the dispatcher started. The reply carries
        both counts: wait for the next event with the count + 1. ``brief``: workers, models and
        the counts only (no curves, arrival rates, decisions, lateness), cheap to ask often."""
        timeout, wait = checked_timeout(timeout), checked_wait(wait)
        refuse_on_io_thread(self._io)
        rid, frames = self._codec.encode_status(min_registrations, wait, min_departures, brief)
        return self._send("status", rid, frames, [], {}, wait + timeout).result()

    def _send(self, kind: str, rid: int, frames: list, regions: list, outputs: dict, timeout: float,
              on_tokens: Optional[Callable[[list], None]] = None) -> InferFuture:
        deadline = time.monotonic() + timeout
        fut = InferFuture(self, rid, deadline)
        self._io.send(Pending(kind, regions, outputs, fut._settle, on_tokens), rid, frames, deadline)
        return fut
