"""The dispatcher process (``batchyard::dispatcher``): one thread, one uvloop event loop.

Event-driven, never polling: the loop sleeps in epoll on three fds — the client ROUTER, the
worker ROUTER and a one-shot timerfd — and on any wake-up runs ``_step``:

  1. recv_from_workers   completions free worker slots; replies fan out to clients
  2. recv_from_clients   decode + validate each header; enqueue, or reply with an error now
  3. expire              requests whose deadline passed (queued or in flight)
  4. decide              the pure policy picks batches for free workers
  5. send_to_workers     one message per batch, forwarding the clients' frames untouched
  6. housekeeping        dead workers (silent past worker_dead_after_s), orphaned shm sweep
  7. arm the timer       for the earliest of: policy wake-up, a deadline, housekeeping

Sockets are drained with NOBLOCK until empty (ZeroMQ's FD is edge-triggered); messages that
arrive together are decided on together, which is what lets one batch message to a worker
carry many requests. Measured on this machine: add_reader + NOBLOCK drains cost ~15 us CPU
per forwarded request, awaiting each message on zmq.asyncio ~90 us.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import os
import signal
import time
from typing import Optional

import zmq

from . import protocol as P
from .config import DispatcherConfig, NodeConfig
from .cost_model import CostCurve
from .metrics import Metrics
from .policy import Dispatch, feasible, make_policy
from .protocol import Status
from .shm import reap_orphans
from .state import DONE, INFLIGHT, QUEUED, Request, SchedulerState, WorkerState
from .timer import OneShotTimer
from .validation import RequestInvalid, validate_infer, validate_spec

log = logging.getLogger("batchyard.dispatcher")

MAX_DRAIN = 4096  # messages per socket per step, so one flood cannot starve the other socket
_now = time.monotonic
# Plain ints: pyzmq's send_multipart/recv_multipart combine enum flags per frame, and that
# enum arithmetic was ~15 % of the dispatcher's CPU under load (cProfile, bench (b)).
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)


def recv_parts(sock: zmq.Socket) -> list:
    """One multipart message as zmq.Frame objects, non-blocking (raises zmq.Again)."""
    frame = sock.recv(_NOBLOCK, copy=False)
    parts = [frame]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        parts.append(frame)
    return parts


def send_parts(sock: zmq.Socket, parts: list) -> None:
    send = sock.send
    last = len(parts) - 1
    for i, p in enumerate(parts):
        send(p, _SNDMORE if i < last else 0, copy=False)


class InflightBatch:
    __slots__ = ("batch_id", "worker", "model", "requests", "sent_at")

    def __init__(self, batch_id, worker, model, requests, sent_at):
        self.batch_id = batch_id
        self.worker = worker
        self.model = model
        self.requests = requests
        self.sent_at = sent_at


class Dispatcher:
    def __init__(self, cfg: DispatcherConfig, models: tuple = (), ctx: Optional[zmq.Context] = None,
                 profile: Optional[dict[tuple[str, str], CostCurve]] = None):
        self.cfg = cfg
        self.policy = make_policy(cfg.policy)
        self.ctx = ctx or zmq.Context.instance()
        self.state = SchedulerState()
        self.specs: dict[str, P.ModelSpec] = {m.name: m for m in models}
        for (model, path), curve in (profile or {}).items():
            self.state.costs[(model, path)] = curve
        self.requests: dict[int, Request] = {}  # seq -> request, queued or in flight
        self.by_client_id: dict[tuple[bytes, int], int] = {}  # (client, request id) -> seq, for cancel
        self.batches: dict[int, InflightBatch] = {}
        self.deadlines: list[tuple[float, int]] = []  # heap of (deadline, seq); lazily pruned
        self.status_waiters: list[tuple[float, bytes, P.StatusRequest]] = []
        self.registrations = 0
        self.decisions: dict[str, int] = {}  # decision reason -> count (waited, dispatched-cpu, ...)
        self.metrics = Metrics()
        self._seq = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._next_housekeeping = 0.0
        self._next_janitor = 0.0
        self._draining = False
        self._drain_deadline = math.inf
        self._closed = False
        self.stopped: Optional[asyncio.Future] = None

        self.frontend = self.ctx.socket(zmq.ROUTER)
        self.backend = self.ctx.socket(zmq.ROUTER)
        for s in (self.frontend, self.backend):
            s.setsockopt(zmq.LINGER, 500)
            s.setsockopt(zmq.SNDHWM, 100_000)
            s.setsockopt(zmq.RCVHWM, 100_000)
        # A send to a worker that is gone raises instead of vanishing: it is then declared dead.
        self.backend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.frontend.bind(cfg.frontend)
        self.backend.bind(cfg.backend)
        self.timer = OneShotTimer()

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.stopped = loop.create_future()
        loop.add_reader(self.frontend.getsockopt(zmq.FD), self._step)
        loop.add_reader(self.backend.getsockopt(zmq.FD), self._step)
        loop.add_reader(self.timer.fd, self._on_timer)
        loop.call_soon(self._step)

    def begin_shutdown(self) -> None:
        """Stop taking work, give in-flight batches up to drain_timeout_s, then close."""
        if self._draining:
            return
        log.info("draining: %d queued, %d batches in flight", self.state.queued_requests(), len(self.batches))
        self._draining = True
        self._drain_deadline = _now() + self.cfg.drain_timeout_s
        for req in list(self.requests.values()):
            if req.state == QUEUED:
                self._unqueue(req)
                self._reply_error(req, Status.UNAVAILABLE, "dispatcher is shutting down")
        self._step()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.is_closed():
            for fd in (self.frontend.getsockopt(zmq.FD), self.backend.getsockopt(zmq.FD), self.timer.fd):
                loop.remove_reader(fd)
        self.frontend.close(linger=500)
        self.backend.close(linger=500)
        self.timer.close()
        if self.stopped is not None and not self.stopped.done():
            self.stopped.set_result(None)

    # ------------------------------------------------------------------ the step
    def _on_timer(self) -> None:
        self.timer.clear()
        self._step()

    def _step(self) -> None:
        if self._closed:
            return
        now = _now()
        self._recv_from_workers(now)
        self._recv_from_clients(now)
        now = _now()
        self._expire(now)
        if not self._draining:
            decision = self.policy.decide(self.state, now)
            for reason, n in decision.reasons.items():
                self.decisions[reason] = self.decisions.get(reason, 0) + n
            for d in decision.dispatches:
                self._send_to_worker(d, now)
            wake = decision.wake_at
        else:
            if not self.batches or now >= self._drain_deadline:
                for req in list(self.requests.values()):
                    self._reply_error(req, Status.UNAVAILABLE, "dispatcher shut down before the batch finished")
                self.close()
                return
            wake = self._drain_deadline
        if now >= self._next_housekeeping:
            self._housekeeping(now)
        wake = min(wake, self._next_housekeeping)
        if self.deadlines:
            wake = min(wake, self.deadlines[0][0])
        if self.status_waiters:
            self._answer_status_waiters(now)
            if self.status_waiters:
                wake = min(wake, min(w[0] for w in self.status_waiters))
        self._arm(wake)
        # ZeroMQ's FD is edge-triggered and our own sends can consume the edge: if input is
        # pending now, run again rather than wait for an edge that already happened.
        if (self.frontend.getsockopt(_EVENTS) | self.backend.getsockopt(_EVENTS)) & _POLLIN:
            self.loop.call_soon(self._step)

    def _arm(self, when: float) -> None:
        # Only move the timer earlier; a spurious later wake-up is harmless and saves a syscall.
        # An instant already past would only repeat the decision just made: completions and
        # arrivals wake the loop by themselves.
        if when < self.timer.armed_at and when > _now():
            self.timer.arm(when)

    # ------------------------------------------------------------------ 1. workers
    def _recv_from_workers(self, now: float) -> None:
        sock = self.backend
        for _ in range(MAX_DRAIN):
            try:
                frames = recv_parts(sock)
            except zmq.Again:
                return
            identity = frames[0].bytes
            if len(frames) < 2:
                log.warning("dropping empty message from worker connection %r", identity)
                continue
            try:
                msg = P.worker_message_decoder.decode(frames[1].buffer)
            except P.DecodeError as e:
                log.warning("dropping malformed worker message from %r: %s", identity, e)
                continue
            if type(msg) is P.BatchDone:
                self._on_batch_done(msg, frames, now)
            elif type(msg) is P.Heartbeat:
                w = self.state.workers.get(msg.worker)
                if w is not None:
                    w.last_seen = now
                else:
                    self._send_worker(identity, P.encode(P.Reregister(worker=msg.worker)))
            elif type(msg) is P.Goodbye:
                self._worker_lost(msg.worker, "worker stopped", now)
            else:
                self._on_register(msg, identity, now)

    def _on_register(self, msg: P.Register, identity: bytes, now: float) -> None:
        for spec in msg.models:
            try:
                validate_spec(spec)
            except ValueError as e:
                self._send_worker(identity, P.encode(P.RegisterRejected(worker=msg.worker, message=str(e))))
                return
            known = self.specs.get(spec.name)
            if known is not None and (known.inputs, known.outputs) != (spec.inputs, spec.outputs):
                text = f"model {spec.name!r}: worker's spec differs from the dispatcher's"
                log.error("rejecting worker %s: %s", msg.worker, text)
                self._send_worker(identity, P.encode(P.RegisterRejected(worker=msg.worker, message=text)))
                return
        if msg.worker in self.state.workers:
            # Same name registering again: the old process is gone (restart) or reconnected.
            self._worker_lost(msg.worker, "worker re-registered", now)
        for spec in msg.models:
            self.specs.setdefault(spec.name, spec)
        w = WorkerState(name=msg.worker, path=msg.path,
                        models={s.name: s.max_batch for s in msg.models},
                        capacity=msg.max_inflight, last_seen=now, pid=msg.pid,
                        simulated=msg.simulated, identity=identity)
        self.state.add_worker(w)
        self.registrations += 1
        log.info("worker %s registered: pid %d, path %s, models %s", w.name, w.pid, w.path, list(w.models))
        self._send_worker(identity, P.encode(P.Registered(worker=msg.worker)))
        self._answer_status_waiters(now)

    def _on_batch_done(self, msg: P.BatchDone, frames: list, now: float) -> None:
        batch = self.batches.pop(msg.batch_id, None)
        if batch is None:
            return  # from a worker declared dead, or for requests already failed over
        w = self.state.workers.get(batch.worker)
        n_items = sum(r.items for r in batch.requests)
        if w is not None:
            w.last_seen = now
            # compute_us 0: nothing ran (the worker rejected every request): nothing to learn.
            self.state.on_complete(w, batch.model, n_items, msg.compute_us / 1e6 if msg.compute_us else None, now)
        path = w.path if w is not None else "?"
        simulated = w.simulated if w is not None else False
        metrics = self.metrics
        metrics.batch_done(batch.model, path)
        pos = 2
        fe = self.frontend
        for res in msg.results:
            out_frames = frames[pos:pos + res.n_frames]
            pos += res.n_frames
            req = self.requests.pop(res.seq, None)
            if req is None or req.state == DONE:
                continue
            req.state = DONE
            self.by_client_id.pop((req.client, req.req_id), None)
            timing = P.Timing(queue_us=int((req.dispatched_at - req.arrival) * 1e6),
                              compute_us=msg.compute_us,
                              total_us=int((now - req.arrival) * 1e6),
                              batch_size=n_items, path=path, worker=msg.worker, simulated=simulated)
            if res.status == Status.OK:
                metrics.request_ok(req.model, path, req.priority, req.items, timing.queue_us, timing.compute_us,
                                   timing.total_us)
            else:
                metrics.request_failed(req.model, _reason(res.status))
            header = P.encode(P.InferReply(v=P.PROTOCOL_VERSION, id=req.req_id, status=res.status,
                                           message=res.message, outputs=res.outputs, timing=timing))
            send_parts(fe, [req.client, header, *out_frames])

    # ------------------------------------------------------------------ 2. clients
    def _recv_from_clients(self, now: float) -> None:
        sock = self.frontend
        for _ in range(MAX_DRAIN):
            try:
                frames = recv_parts(sock)
            except zmq.Again:
                return
            identity = frames[0].bytes
            if len(frames) < 2:
                self._reply(identity, P.error_reply(None, Status.INVALID_ARGUMENT,
                                                    "empty message: expected a MessagePack header frame"))
                continue
            raw = frames[1].bytes
            try:
                msg = P.client_message_decoder.decode(raw)
            except P.DecodeError as e:
                self._reply(identity, P.error_reply(P.salvage_id(raw), Status.INVALID_ARGUMENT,
                                                    f"malformed header: {e}"))
                continue
            if msg.v != P.PROTOCOL_VERSION:
                self._reply(identity, P.error_reply(msg.id, Status.INVALID_ARGUMENT,
                                                    f"protocol version {msg.v} not supported; this "
                                                    f"dispatcher speaks {P.PROTOCOL_VERSION}"))
                continue
            if type(msg) is P.InferRequest:
                self._on_infer(msg, identity, raw, frames, now)
            elif type(msg) is P.CancelRequest:
                seq = self.by_client_id.get((identity, msg.id))
                req = self.requests.get(seq) if seq is not None else None
                if req is not None and req.state == QUEUED:
                    self._unqueue(req)
                    self._reply_error(req, Status.CANCELLED, "cancelled by the client while queued")
            elif type(msg) is P.ModelInfoRequest:
                spec = self.specs.get(msg.model)
                if spec is None:
                    reply = P.ModelInfoReply(v=P.PROTOCOL_VERSION, id=msg.id, status=Status.UNKNOWN_MODEL,
                                             message=self._unknown_model(msg.model))
                else:
                    reply = P.ModelInfoReply(v=P.PROTOCOL_VERSION, id=msg.id, status=Status.OK, spec=spec)
                self._reply(identity, P.encode(reply))
            else:
                # Answered after this step's decision (see _step), so a status reply tells the
                # client that everything it sent before has been queued and decided on.
                self.status_waiters.append((now + msg.wait_us / 1e6, identity, msg))

    def _unknown_model(self, model: str) -> str:
        return f"unknown model {model!r}; this dispatcher serves {sorted(self.specs)}"

    def _reject(self, identity: bytes, msg: P.InferRequest, status: Status, message: str) -> None:
        self.metrics.request_failed(msg.model, _reason(status))
        self._reply(identity, P.error_reply(msg.id, status, message))

    def _on_infer(self, msg: P.InferRequest, identity: bytes, raw: bytes, frames: list, now: float) -> None:
        if self._draining:
            self._reject(identity, msg, Status.UNAVAILABLE, "dispatcher is shutting down")
            return
        spec = self.specs.get(msg.model)
        if spec is None:
            self._reject(identity, msg, Status.UNKNOWN_MODEL, self._unknown_model(msg.model))
            return
        payload = frames[2:]
        try:
            items = validate_infer(msg, spec, [len(f) for f in payload], self.cfg.max_inline_bytes)
        except RequestInvalid as e:
            self._reject(identity, msg, Status.INVALID_ARGUMENT, str(e))
            return
        q = self.state.queue(msg.model)
        if q.requests >= self.cfg.max_queue:
            self._reject(identity, msg, Status.OVERLOADED,
                         f"queue for {msg.model!r} is full ({self.cfg.max_queue} requests)")
            return
        timeout = msg.timeout_us / 1e6 if msg.timeout_us else self.cfg.default_timeout_s
        self.state.note_arrival(msg.model, msg.priority, items, now)
        if not feasible(self.state, msg.model, items, now + timeout, now):
            self._reject(identity, msg, Status.DEADLINE_EXCEEDED,
                         f"no path can finish {items} item(s) of {msg.model!r} within "
                         f"{timeout * 1e3:.1f} ms (rejected on arrival)")
            return
        seq = next(self._seq)
        req = Request(seq, msg.model, items, msg.priority, now, now + timeout, identity, msg.id,
                      [raw, *payload])
        self.requests[seq] = req
        self.by_client_id[(identity, msg.id)] = seq
        heapq.heappush(self.deadlines, (req.deadline, seq))
        q.push(req)

    def _answer_status_waiters(self, now: float) -> None:
        keep = []
        for expires, identity, msg in self.status_waiters:
            if self.registrations >= msg.min_registrations or now >= expires:
                self._reply(identity, P.encode(self._status(msg.id)))
            else:
                keep.append((expires, identity, msg))
        self.status_waiters = keep

    def _status(self, rid: int) -> P.StatusReply:
        workers = [P.WorkerInfo(name=w.name, pid=w.pid, path=w.path, models=list(w.models),
                                inflight=w.inflight, simulated=w.simulated)
                   for w in self.state.workers.values()]
        now = _now()
        return P.StatusReply(v=P.PROTOCOL_VERSION, id=rid, status=Status.OK,
                             registrations=self.registrations, dispatcher_pid=os.getpid(), queued=self.state.queued_requests(),
                             workers=workers, models=sorted(self.specs), policy=self.policy.name,
                             curves={f"{m}/{p}": c.describe() for (m, p), c in self.state.costs.items()},
                             arrival_rate={m: round(self.state.arrival(m).rate(now), 2) for m in self.specs},
                             decisions=dict(self.decisions))

    # ------------------------------------------------------------------ 3. deadlines
    def _expire(self, now: float) -> None:
        heap = self.deadlines
        while heap and heap[0][0] <= now:
            _, seq = heapq.heappop(heap)
            req = self.requests.get(seq)
            if req is None or req.deadline > now:
                continue  # finished already, or re-pushed with a later deadline
            where = "in queue" if req.state == QUEUED else "while its batch was running"
            if req.state == QUEUED:
                self._unqueue(req)
            self._reply_error(req, Status.DEADLINE_EXCEEDED,
                              f"deadline passed {where} after {(now - req.arrival) * 1e3:.1f} ms")

    # ------------------------------------------------------------------ 5. workers out
    def _send_to_worker(self, d: Dispatch, now: float) -> None:
        batch_id = next(self._batch_ids)
        reqs = d.requests
        frames: list = [d.worker.identity, b""]
        seqs, n_frames = [], []
        for r in reqs:
            r.state = INFLIGHT
            r.dispatched_at = now
            r.batch_id = batch_id
            seqs.append(r.seq)
            n_frames.append(len(r.frames) - 1)
            frames.extend(r.frames)
        frames[1] = P.encode(P.Batch(batch_id=batch_id, model=d.model, seqs=seqs, n_frames=n_frames))
        self.batches[batch_id] = InflightBatch(batch_id, d.worker.name, d.model, reqs, now)
        try:
            send_parts(self.backend, frames)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the worker's connection is gone
            log.warning("worker %s unreachable (%s)", d.worker.name, e)
            self._worker_lost(d.worker.name, f"unreachable: {e}", now)

    def _send_worker(self, identity: bytes, header: bytes) -> None:
        try:
            send_parts(self.backend, [identity, header])
        except zmq.ZMQError:
            pass

    # ------------------------------------------------------------------ 6. housekeeping
    def _housekeeping(self, now: float) -> None:
        self._next_housekeeping = now + self.cfg.heartbeat_interval_s
        dead_before = now - self.cfg.worker_dead_after_s
        for w in list(self.state.workers.values()):
            if w.last_seen < dead_before:
                self._worker_lost(w.name, f"no heartbeat for {now - w.last_seen:.1f} s", now)
        if now >= self._next_janitor:
            self._next_janitor = now + self.cfg.janitor_interval_s
            for name in reap_orphans():
                log.info("unlinked orphaned shared memory %s (owner process is gone)", name)

    def _worker_lost(self, name: str, reason: str, now: float) -> None:
        """Fail over every batch the worker had: retry each request once elsewhere if its
        deadline allows, otherwise reply UNAVAILABLE. Nothing is left waiting."""
        w = self.state.remove_worker(name)
        if w is None:
            return
        log.log(logging.INFO if reason == "worker stopped" else logging.WARNING,
                "worker %s (pid %d) out of rotation: %s", name, w.pid, reason)
        lost = [b for b in self.batches.values() if b.worker == name]
        for b in lost:
            del self.batches[b.batch_id]
            for req in b.requests:
                if req.state != INFLIGHT:
                    continue
                if req.retries == 0 and req.deadline > now and not self._draining:
                    req.retries += 1
                    req.state = QUEUED
                    self.state.queue(req.model).push_front(req)
                else:
                    self._reply_error(req, Status.UNAVAILABLE,
                                      f"worker {name} failed while running the batch ({reason})")

    # ------------------------------------------------------------------ replies
    def _unqueue(self, req: Request) -> None:
        self.state.queue(req.model).remove(req)

    def _reply_error(self, req: Request, status: Status, message: str) -> None:
        if req.state == DONE:
            return
        req.state = DONE
        self.requests.pop(req.seq, None)
        self.by_client_id.pop((req.client, req.req_id), None)
        self.metrics.request_failed(req.model, _reason(status))
        self._reply(req.client, P.error_reply(req.req_id, status, message))

    def _reply(self, identity: bytes, header: bytes) -> None:
        try:
            send_parts(self.frontend, [identity, header])
        except zmq.ZMQError as e:
            log.debug("reply to vanished client dropped: %s", e)

    def render_metrics(self) -> str:
        now = _now()
        pending = {m: 0 for m in self.specs}
        for r in self.requests.values():
            pending[r.model] = pending.get(r.model, 0) + 1
        return self.metrics.render(pending, self.decisions,
                                   {f"{m}/{p}": c.describe() for (m, p), c in self.state.costs.items()},
                                   {m: round(self.state.arrival(m).rate(now), 3) for m in self.specs})


def _reason(status: int) -> str:
    try:
        return Status(status).name.lower()
    except ValueError:
        return f"status_{status}"


def run_dispatcher(node: NodeConfig) -> None:
    """Entry point of the dispatcher process. Returns after SIGTERM/SIGINT and a bounded drain."""
    import uvloop

    from .proctitle import set_title

    set_title("batchyard::dispatcher")
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    profile = None
    if node.dispatcher.profile:
        from .cost_model import load_profile

        profile = load_profile(node.dispatcher.profile)
        log.info("cost curves from %s: %s", node.dispatcher.profile,
                 {f"{m}/{p}": c.describe() for (m, p), c in profile.items()})
    d = Dispatcher(node.dispatcher, tuple(m.spec() for m in node.models), profile=profile)
    d.start(loop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, d.begin_shutdown)
    log.info("dispatcher pid %d: clients at %s, workers at %s, policy %s",
             os.getpid(), node.dispatcher.frontend, node.dispatcher.backend, d.policy.name)
    metrics_server = None
    if node.dispatcher.metrics_port:
        from .metrics import serve_metrics

        metrics_server = loop.run_until_complete(
            serve_metrics(loop, node.dispatcher.metrics_host, node.dispatcher.metrics_port, d.render_metrics))
        log.info("metrics at http://%s:%d/metrics", node.dispatcher.metrics_host, node.dispatcher.metrics_port)
    try:
        loop.run_until_complete(d.stopped)
    finally:
        if metrics_server is not None:
            metrics_server.close()
            loop.run_until_complete(metrics_server.wait_closed())
        d.close()
        loop.close()
