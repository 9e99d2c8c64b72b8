"""Client SDK: ``Client`` (blocking, futures) and ``AsyncClient`` (asyncio).

Both speak the protocol of docs/protocol.md over one DEALER socket and allow many requests
in flight. Tensors of at least ``shm_threshold`` bytes travel through a client-owned shared
memory pool; smaller ones ride inline in the message. Arrays made with ``alloc_array`` live
in that pool already and are sent by reference with no copy at all (the fast path for big
tensors: fill them in place). Large outputs are written by the worker straight into the
pool; the returned array is a view of it, and its region goes back to the pool when the
array is garbage-collected.

Local timeouts are a backstop: the dispatcher answers DEADLINE_EXCEEDED at the request's
deadline; if nothing at all comes back within ``timeout + REPLY_GRACE_S`` (dispatcher down or
unreachable) the call raises DeadlineExceeded itself. A request's input regions are only
returned to the pool when its reply arrives, so a late-running worker never reads memory
that was handed to another request.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from typing import Optional

import numpy as np
import zmq

from . import protocol as P
from .errors import DeadlineExceeded, InvalidArgument, error_for
from .protocol import Status
from .client_pool import Region, ShmPool
from .shm import reap_orphans
from .validation import item_nbytes

DEFAULT_TIMEOUT_S = 30.0
REPLY_GRACE_S = 1.0
# Tensors from this size on go through shared memory. Measured (bench/handoff.py, this
# machine): inline ZeroMQ and a pool copy cost about the same up to ~16 KiB; from 64 KiB on
# the pool wins and the gap grows with size (see docs/protocol.md).
DEFAULT_SHM_THRESHOLD = 64 << 10

PRIORITIES = {"high": P.PRIORITY_HIGH, "normal": P.PRIORITY_NORMAL, "low": P.PRIORITY_LOW}


class _Pending:
    __slots__ = ("kind", "regions", "outputs", "resolve")

    def __init__(self, kind, regions, outputs, resolve):
        self.kind = kind  # "infer" | "model_info" | "status"
        self.regions = regions  # input regions to free when the reply arrives
        self.outputs = outputs  # name -> Region the worker writes into
        self.resolve = resolve  # callable(result or exception)


class _ClientCore:
    """Encoding, decoding and the shared-memory pool; no waiting (the subclasses wait)."""

    def __init__(self, address: str, *, shm_threshold: int = DEFAULT_SHM_THRESHOLD,
                 pool_bytes: int = 64 << 20, ctx: Optional[zmq.Context] = None):
        reap_orphans()  # a crashed client's segments go as soon as anyone starts
        self.address = address
        self.shm_threshold = shm_threshold
        self._pool_bytes = pool_bytes
        self._pool: Optional[ShmPool] = None
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.setsockopt(zmq.RCVHWM, 100_000)
        self.sock.connect(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._late: dict[int, list[Region]] = {}  # timed out locally; free regions on late reply
        self._array_regions: dict[int, Region] = {}  # data address -> region, for alloc_array
        self.specs: dict[str, P.ModelSpec] = {}
        self.closed = False

    # ---------------------------------------------------------------- shared memory
    @property
    def pool(self) -> ShmPool:
        if self._pool is None:
            self._pool = ShmPool(self._pool_bytes)
        return self._pool

    def alloc_array(self, shape, dtype) -> np.ndarray:
        """A numpy array living in this client's shared memory. Fill it in place and pass it
        to infer(): it is sent by reference, with no copy."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        region = self.pool.alloc(nbytes)
        arr = np.frombuffer(self.pool.view(region), dtype=dtype).reshape(shape)
        addr = arr.__array_interface__["data"][0]
        self._array_regions[addr] = region
        weakref.finalize(arr, self._release_array, addr, region)
        return arr

    def _release_array(self, addr: int, region: Region) -> None:
        self._array_regions.pop(addr, None)
        if self._pool is not None:
            self._pool.free(region)

    # ---------------------------------------------------------------- encode
    def _encode_infer(self, model: str, inputs: dict, priority, timeout: Optional[float]):
        if isinstance(priority, str):
            if priority not in PRIORITIES:
                raise InvalidArgument(f"priority {priority!r} not one of {list(PRIORITIES)}")
            priority = PRIORITIES[priority]
        timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
        if timeout <= 0:
            raise InvalidArgument(f"timeout must be > 0 seconds, got {timeout}")
        rid = next(self._ids)
        refs, frames, regions = [], [], []
        n_items = 0
        for name, value in inputs.items():
            arr = np.asarray(value)
            n_items = arr.shape[0] if arr.ndim else 0
            dtype = arr.dtype.name
            region = self._array_regions.get(arr.__array_interface__["data"][0]) if arr.nbytes else None
            if region is not None and region.nbytes == arr.nbytes and arr.flags.c_contiguous:
                refs.append(P.TensorRef(name=name, dtype=dtype, shape=list(arr.shape),
                                        shm=P.ShmRef(region.segment, region.offset, region.nbytes)))
            elif arr.nbytes >= self.shm_threshold:
                region = self.pool.alloc(arr.nbytes)
                regions.append(region)
                np.frombuffer(self.pool.view(region), dtype=arr.dtype).reshape(arr.shape)[...] = arr
                refs.append(P.TensorRef(name=name, dtype=dtype, shape=list(arr.shape),
                                        shm=P.ShmRef(region.segment, region.offset, region.nbytes)))
            else:
                refs.append(P.TensorRef(name=name, dtype=dtype, shape=list(arr.shape), frame=len(frames)))
                frames.append(np.ascontiguousarray(arr))
        outputs, out_refs = {}, {}
        spec = self.specs.get(model)
        if spec is not None and n_items:
            for t in spec.outputs:
                nbytes = n_items * item_nbytes(t)
                if nbytes >= self.shm_threshold:
                    region = self.pool.alloc(nbytes)
                    outputs[t.name] = region
                    out_refs[t.name] = P.ShmRef(region.segment, region.offset, region.nbytes)
        header = P.encode(P.InferRequest(v=P.PROTOCOL_VERSION, id=rid, model=model, inputs=refs,
                                         priority=priority, timeout_us=int(timeout * 1e6),
                                         outputs=out_refs))
        return rid, [header, *frames], regions, outputs, timeout

    def _needs_spec(self, model: str) -> bool:
        """The spec (fetched once per model) says which outputs are big enough for shm."""
        return model not in self.specs

    # ---------------------------------------------------------------- decode
    def _on_reply(self, frames: list) -> None:
        try:
            msg = P.reply_decoder.decode(frames[0])
        except P.DecodeError:
            return  # not ours to crash over; the request will time out with a clear message
        pend = self._pending.pop(msg.id, None) if msg.id is not None else None
        if pend is None:
            late = self._late.pop(msg.id, None)
            for region in late or ():
                self._free(region)
            return
        for region in pend.regions:
            self._free(region)
        if msg.status != Status.OK:
            for region in pend.outputs.values():
                self._free(region)
            pend.resolve(error_for(msg.status, msg.message))
            return
        if pend.kind == "model_info":
            self.specs[msg.spec.name] = msg.spec
            pend.resolve(msg.spec)
        elif pend.kind == "status":
            pend.resolve(msg)
        else:
            pend.resolve(self._outputs(msg, frames[1:], pend.outputs))

    def _outputs(self, msg: P.InferReply, frames: list, regions: dict) -> "InferResult":
        out = {}
        for ref in msg.outputs:
            if ref.shm is not None:
                region = regions.pop(ref.name)
                arr = np.frombuffer(self.pool.view(region), dtype=ref.dtype, count=int(np.prod(ref.shape)))
                arr = arr.reshape(ref.shape)
                weakref.finalize(arr, self._free, region)
            else:
                arr = np.frombuffer(frames[ref.frame], dtype=ref.dtype).reshape(ref.shape)
            out[ref.name] = arr
        for region in regions.values():  # reserved but not used
            self._free(region)
        return InferResult(out, msg.timing)

    def _free(self, region: Region) -> None:
        if self._pool is not None:
            self._pool.free(region)

    def _expire_local(self, rid: int) -> Optional[_Pending]:
        pend = self._pending.pop(rid, None)
        if pend is not None and (pend.regions or pend.outputs):
            self._late[rid] = [*pend.regions, *pend.outputs.values()]
        return pend

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()
        if self._pool is not None:
            self._pool.close()


class InferResult(dict):
    """The outputs by name (a dict), plus ``timing`` from the dispatcher (queue/compute/total
    microseconds, batch size, path and worker)."""

    def __init__(self, outputs: dict, timing: Optional[P.Timing]):
        super().__init__(outputs)
        self.timing = timing


class InferFuture:
    """Result of Client.submit(). ``result()`` drives the client's socket until this reply
    (or its deadline) arrives, settling other requests' futures on the way."""

    def __init__(self, client: "Client", rid: int, deadline: float):
        self._client = client
        self.id = rid
        self.deadline = deadline
        self._done = False
        self._value = None
        self._error: Optional[BaseException] = None

    def _resolve(self, value) -> None:
        if self._done:
            return
        self._done = True
        if isinstance(value, BaseException):
            self._error = value
        else:
            self._value = value

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Ask the dispatcher to drop this request if it is still queued. The future then
        raises Cancelled; a request already running completes normally."""
        if not self._done:
            self._client._send_cancel(self.id)

    def result(self, timeout: Optional[float] = None):
        if not self._done:
            self._client._wait_for(self, timeout)
        if self._error is not None:
            raise self._error
        return self._value


class Client(_ClientCore):
    """Blocking client. Safe to share between threads (one thread drives the socket at a time)."""

    def __init__(self, address: str, **kw):
        super().__init__(address, **kw)
        self._lock = threading.RLock()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _send(self, kind, rid, frames, regions, outputs, deadline) -> InferFuture:
        fut = InferFuture(self, rid, deadline)
        self._pending[rid] = _Pending(kind, regions, outputs, fut._resolve)
        self.sock.send_multipart(frames, copy=False)
        return fut

    def _send_cancel(self, rid: int) -> None:
        with self._lock:
            self.sock.send(P.encode(P.CancelRequest(v=P.PROTOCOL_VERSION, id=rid)))

    def submit(self, model: str, inputs: dict, *, priority="normal", timeout: Optional[float] = None) -> InferFuture:
        with self._lock:
            if self._needs_spec(model):
                self.model_info(model)
            rid, frames, regions, outputs, timeout = self._encode_infer(model, inputs, priority, timeout)
            return self._send("infer", rid, frames, regions, outputs, time.monotonic() + timeout + REPLY_GRACE_S)

    def infer(self, model: str, inputs: dict, *, priority="normal", timeout: Optional[float] = None) -> InferResult:
        return self.submit(model, inputs, priority=priority, timeout=timeout).result()

    def model_info(self, model: str, timeout: float = 10.0) -> P.ModelSpec:
        with self._lock:
            rid = next(self._ids)
            frames = [P.encode(P.ModelInfoRequest(v=P.PROTOCOL_VERSION, id=rid, model=model))]
            return self._send("model_info", rid, frames, [], {}, time.monotonic() + timeout).result()

    def status(self, min_registrations: int = 0, wait: float = 0.0, timeout: float = 10.0) -> P.StatusReply:
        """Dispatcher state; with ``min_registrations`` the reply waits (up to ``wait`` s) until
        that many worker registrations have happened."""
        with self._lock:
            rid = next(self._ids)
            frames = [P.encode(P.StatusRequest(v=P.PROTOCOL_VERSION, id=rid, min_registrations=min_registrations,
                                               wait_us=int(wait * 1e6)))]
            return self._send("status", rid, frames, [], {}, time.monotonic() + wait + timeout).result()

    def _wait_for(self, fut: InferFuture, timeout: Optional[float]) -> None:
        limit = fut.deadline if timeout is None else min(fut.deadline, time.monotonic() + timeout)
        with self._lock:
            while not fut.done():
                remaining = limit - time.monotonic()
                if remaining <= 0:
                    if time.monotonic() >= fut.deadline:
                        self._expire_local(fut.id)
                        fut._resolve(DeadlineExceeded(
                            f"no reply from the dispatcher at {self.address} before the deadline "
                            f"(is it running?)"))
                        return
                    raise TimeoutError("result() timed out; the request is still in flight")
                if self.sock.poll(max(1, int(remaining * 1000))):
                    while True:
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_reply(frames)


class AsyncClient(_ClientCore):
    """asyncio client: ``await client.infer(...)``; any number in flight from one task or many."""

    def __init__(self, address: str, **kw):
        super().__init__(address, **kw)
        self.loop = asyncio.get_running_loop()
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self.loop.add_reader(self.sock.getsockopt(zmq.FD), self._drain)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.loop.remove_reader(self.sock.getsockopt(zmq.FD))
            for h in self._timers.values():
                h.cancel()
            for rid, pend in list(self._pending.items()):
                pend.resolve(error_for(Status.CANCELLED, "client closed"))
            self._pending.clear()
            self._close()

    def _drain(self) -> None:
        while not self.closed:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_reply(frames)

    def _send(self, kind, rid, frames, regions, outputs, timeout) -> asyncio.Future:
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

        self._pending[rid] = _Pending(kind, regions, outputs, resolve)
        self._timers[rid] = self.loop.call_later(timeout, self._on_local_timeout, rid)
        self.sock.send_multipart(frames, copy=False)
        # Sending can consume the FD's edge: drain now in case replies are already waiting.
        self.loop.call_soon(self._drain)
        return fut

    def _on_local_timeout(self, rid: int) -> None:
        self._timers.pop(rid, None)
        pend = self._expire_local(rid)
        if pend is not None:
            pend.resolve(DeadlineExceeded(f"no reply from the dispatcher at {self.address} before the "
                                          f"deadline (is it running?)"))

    async def infer(self, model: str, inputs: dict, *, priority="normal",
                    timeout: Optional[float] = None) -> InferResult:
        if self._needs_spec(model):
            await self.model_info(model)
        rid, frames, regions, outputs, timeout = self._encode_infer(model, inputs, priority, timeout)
        fut = self._send("infer", rid, frames, regions, outputs, timeout + REPLY_GRACE_S)
        try:
            return await fut
        except asyncio.CancelledError:
            # The caller gave up: withdraw it if still queued (the late reply frees its regions).
            if not self.closed:
                self._expire_local(rid)
                self.sock.send(P.encode(P.CancelRequest(v=P.PROTOCOL_VERSION, id=rid)))
            raise

    def submit(self, model: str, inputs: dict, **kw) -> asyncio.Task:
        return self.loop.create_task(self.infer(model, inputs, **kw))

    async def model_info(self, model: str, timeout: float = 10.0) -> P.ModelSpec:
        rid = next(self._ids)
        frames = [P.encode(P.ModelInfoRequest(v=P.PROTOCOL_VERSION, id=rid, model=model))]
        return await self._send("model_info", rid, frames, [], {}, timeout)

    async def status(self, min_registrations: int = 0, wait: float = 0.0, timeout: float = 10.0) -> P.StatusReply:
        rid = next(self._ids)
        frames = [P.encode(P.StatusRequest(v=P.PROTOCOL_VERSION, id=rid, min_registrations=min_registrations,
                                           wait_us=int(wait * 1e6)))]
        return await self._send("status", rid, frames, [], {}, wait + timeout)
