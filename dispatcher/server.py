"""The dispatcher process (``batchyard::dispatcher``): one thread, one uvloop event loop.

Socket plumbing around ``RequestCore`` (core.py), which owns the request lifecycle. The loop
sleeps in epoll on three fds — the client ROUTER, the worker ROUTER and a one-shot timerfd —
and on any wake-up runs ``_step``:

  1. recv_from_workers   completions free worker slots; replies fan out to clients
  2. recv_from_clients   decode + validate each header; admit, or reply with an error now
  3. decide              the core expires what is late and asks the pure policy for batches
  4. send_to_workers     one message per batch, forwarding the clients' frames untouched
  5. housekeeping        dead workers (silent past worker_dead_after_s), a slice of the orphaned
                         shm sweep and of the grant sweep
  6. arm the timer       for the core's next wake-up (policy, deadline, long poll) or housekeeping

Sockets are drained with NOBLOCK until empty (ZeroMQ's FD is edge-triggered); messages that
arrive together are decided on together, which is what lets one batch message to a worker
carry many requests. Measured on this machine: add_reader + NOBLOCK drains cost ~15 us CPU
per forwarded request, awaiting each message on zmq.asyncio ~90 us. The process around it
(signals, uvloop, metrics endpoint, exit code) is dispatcher_main.py.

Each message is handled in isolation: one whose handling raises gets its own reply (INTERNAL)
and the loop goes on. An exception outside a single message's handling means the core's state
can no longer be trusted: every open request is answered UNAVAILABLE and the process exits
non-zero (``up``/systemd restart it), rather than serve on half-applied state.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from typing import Optional

import msgspec
import zmq

from . import protocol as P
from . import status_report, transport
from .client_replies import ClientReplies
from .config import DispatcherConfig
from .core import MAX_STATUS_WAIT_S, Batch, Rejected, RequestCore
from .cost_model import CostCurve
from .lateness import Lateness
from .llm_server import LlmDesk
from .metrics import Metrics
from .policy import make_policy
from .protocol import Status
from .shm import reaping
from .shm_grants import ShmGrants, peer_uid
from .state import QUEUED, Request, WorkerState, same_process
from .timer import OneShotTimer
from .validation import RequestInvalid, registration_problem, validate_infer
from .zmq_frames import NOBLOCK, Truncated, recv_parts, send_parts, waiting

log = logging.getLogger("batchyard.dispatcher")

MAX_DRAIN = 4096  # messages per socket per step, so one flood cannot starve the other socket
# A client message's parts kept: its routing identity, its header and 4096 payload frames (one per
# input tensor); the rest are read and dropped, and the message refused.
MAX_CLIENT_PARTS = 2 + 4096
EXIT_BROKEN_INVARIANT = 70  # sysexits.h EX_SOFTWARE: restartable, unlike EX_CONFIG
_now = time.monotonic


_STATUSES = frozenset(int(s) for s in Status)


def malformed_result(res: P.ItemResult, frames_left: int) -> str:
    """What is wrong with a worker's result for one request ("" when nothing): its frame count
    against the frames left in the message, its status, its outputs' frame indices."""
    if not 0 <= res.n_frames <= frames_left:
        return f"n_frames {res.n_frames} with {frames_left} frames left"
    if res.status not in _STATUSES:
        return f"unknown status {res.status}"
    for ref in res.outputs:
        if ref.shm is None and (ref.frame is None or ref.frame >= res.n_frames):
            return f"output {ref.name!r} names frame {ref.frame} of {res.n_frames}"
    return ""


QUEUE_HWM = 100_000  # messages queued to or from one client or worker connection (ZeroMQ's high-water marks)

# /dev/shm entries the orphan sweep looks at per housekeeping tick (~6 us each where it opens and
# locks one: ~3 ms at most). Any local user may make 200,000 `batchyard_*` names there: swept at
# once, no client was answered for 3.5 s every janitor_interval_s.
REAP_ENTRIES_PER_TICK = 512


class Dispatcher:
    def __init__(self, cfg: DispatcherConfig, models: tuple = (), ctx: Optional[zmq.Context] = None,
                 profile: Optional[dict[tuple[str, str], CostCurve]] = None, llm_models: tuple[str, ...] = ()):
        self.cfg = cfg
        self.core = RequestCore(make_policy(cfg.policy), self._on_fail, max_queue=cfg.max_queue,
                                default_timeout_s=cfg.default_timeout_s,
                                worker_dead_after_s=cfg.worker_dead_after_s,
                                breaker_backoff_s=cfg.breaker_backoff_s,
                                breaker_backoff_max_s=cfg.breaker_backoff_max_s)
        self.state = self.core.state
        self.ctx = ctx or zmq.Context.instance()
        self.specs: dict[str, P.ModelSpec] = {m.name: m for m in models}
        for (model, path), curve in (profile or {}).items():
            self.state.costs[(model, path)] = curve
        simulated = sorted(f"{m}/{p}" for (m, p), c in (profile or {}).items() if c.simulated)
        if simulated:  # a profile from a simulated node, copied to a real one, would steer it by made-up times
            log.warning("profile entries %s were measured on a simulated device: their curves are not real "
                        "hardware's (for a real node, run `batchyard calibrate` on it)", ", ".join(simulated))
        self.metrics = Metrics()
        for name in (*self.specs, *llm_models):  # (an LLM model's route series come at its engine's registration)
            self.metrics.model_served(name)
        self.lateness = Lateness()
        self._timer_due = 0.0  # the armed instant that woke this step (0: not the timer)
        self._first_arrival = 0.0  # when the first client message of this step was read
        self.exit_code = 0
        self._next_housekeeping = 0.0
        self._next_janitor = 0.0
        self._reaping = None  # the orphaned-segment sweep under way (shm.reaping), None between sweeps
        self._drain_deadline = math.inf
        self._closed = False
        self.stopped: Optional[asyncio.Future] = None

        transport.seed_routing_ids()  # before the ROUTERs: each draws its first peer id at creation
        self.frontend = self.ctx.socket(zmq.ROUTER)
        self.backend = self.ctx.socket(zmq.ROUTER)
        for s in (self.frontend, self.backend):
            s.setsockopt(zmq.LINGER, 500)
            s.setsockopt(zmq.SNDHWM, QUEUE_HWM)
            s.setsockopt(zmq.RCVHWM, QUEUE_HWM)
        # A send to a worker that is gone raises instead of vanishing: it is then declared dead.
        self.backend.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.replies = ClientReplies(self.frontend)  # (a client's full queue holds its replies)
        # The ZAP handler first: a CURVE handshake that raced a missing handler would pass.
        # (It runs on the event loop that run_dispatcher set; nothing runs before loop start.)
        self.authenticator = transport.start_authenticator(self.ctx, cfg)
        self._socket_files: list = []  # the ipc endpoints' files, removed at close
        try:
            self._socket_files.append(transport.bind(self.frontend, cfg.frontend, cfg, frontend=True))
            self._socket_files.append(transport.bind(self.backend, cfg.backend, cfg, frontend=False))
        except BaseException:
            # The backend served by another process: the frontend's socket file, bound already,
            # was left behind (no close() runs for an object never made).
            for s in (self.frontend, self.backend):
                s.close(linger=0)
            for bound in self._socket_files:
                transport.remove_socket_file(bound)
            if self.authenticator is not None:
                self.authenticator.stop()
            raise
        self.shm_allowed = cfg.allow_shm_over_tcp or not transport.is_tcp(cfg.frontend)
        self.workers_on_host = self._workers_on_host(cfg)
        self.grants = ShmGrants()
        self.timer = OneShotTimer()
        self.llm = LlmDesk(self._send_worker, self._reply, cfg.default_timeout_s, cfg.llm_interference_weight,
                           cfg.worker_dead_after_s, self.metrics, models=llm_models, max_queue=cfg.max_queue,
                           stream=self.replies.send_droppable)

    @property
    def policy(self):
        return self.core.policy

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.stopped = loop.create_future()
        loop.add_reader(self.frontend.getsockopt(zmq.FD), self._step)
        loop.add_reader(self.backend.getsockopt(zmq.FD), self._step)
        loop.add_reader(self.timer.fd, self._on_timer)
        loop.call_soon(self._step)

    def begin_shutdown(self) -> None:
        """Refuse new requests; serve those already taken, queued or in a batch, for up to
        drain_timeout_s (the workers still up: `up` stops them after the dispatcher); then
        answer what is left UNAVAILABLE and close. Status and cancel messages are answered
        throughout, and workers register and leave as usual."""
        if self.core.draining:
            return
        log.info("draining: %d queued, %d batches in flight, %d LLM requests; up to %.1f s",
                 self.state.queued_requests(), len(self.core.batches), len(self.llm.core.requests),
                 self.cfg.drain_timeout_s)
        self._drain_deadline = _now() + self.cfg.drain_timeout_s
        self.core.begin_drain()
        self.llm.core.begin_drain()
        self._step()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # Every message gets one reply: a status long poll still waiting gets the status as of
            # now (as if its wait had run out), sent before the sockets close (they linger for it).
            self._answer_status_waiters(math.inf)
            self.replies.flush(force=True)  # (what a full queue held and takes now; the sockets linger for it)
        except Exception:
            log.exception("pending status requests could not be answered at shutdown")
        if getattr(self, "_reaping", None) is not None:
            self._reaping.close()  # its /dev/shm listing's fd
        loop = getattr(self, "loop", None)
        if loop is not None and not loop.is_closed():
            for fd in (self.frontend.getsockopt(zmq.FD), self.backend.getsockopt(zmq.FD), self.timer.fd):
                loop.remove_reader(fd)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.frontend.close(linger=500)
        self.backend.close(linger=500)
        for bound in self._socket_files:  # a clean stop leaves no socket files behind
            transport.remove_socket_file(bound)
        self.timer.close()
        if self.stopped is not None and not self.stopped.done():
            self.stopped.set_result(None)

    @staticmethod
    def _workers_on_host(cfg) -> bool:
        """Whether the workers' clocks are this host's (an ipc endpoint): their compute_end_ns is
        passed on in replies' timing only then (the front door's traces place it beside its own)."""
        return not transport.is_tcp(cfg.backend)

    # ------------------------------------------------------------------ the step
    def _on_timer(self) -> None:
        self._timer_due = self.timer.armed_at
        self.timer.clear()
        self._step()

    def _step(self) -> None:
        if self._closed:
            return
        try:
            self._step_once()
        except Exception:
            # Not one message's fault (those are caught per message): the state is suspect.
            log.critical("dispatcher invariant broken; failing every open request and exiting", exc_info=True)
            self.fail_fast()

    def fail_fast(self) -> None:
        try:
            self.core.fail_all(Status.UNAVAILABLE, "dispatcher failed internally and is restarting")
            self.llm.fail_all(Status.UNAVAILABLE, "dispatcher failed internally and is restarting", _now())
        finally:
            self.exit_code = EXIT_BROKEN_INVARIANT
            self.close()

    def _step_once(self) -> None:
        now = _now()
        self._recv_from_workers(now)
        self._recv_from_clients(now)
        now = _now()
        if self._timer_due:
            self.lateness.record("timer", now - self._timer_due)
            self._timer_due = 0.0
        if self._first_arrival:
            self.lateness.record("arrival", now - self._first_arrival)
            self._first_arrival = 0.0
        if now >= self._next_housekeeping:
            # The workers' messages read again first: after a long drain of the clients' (one
            # client's message of a million frames held it 2.2 s) the heartbeats are waiting
            # unread, and a healthy worker was taken out of rotation for "no heartbeat", its
            # batch run again or failed. Before the decision, which then sees what it freed.
            self._recv_from_workers(now)
            self._housekeeping(now)
        core = self.core
        batches = core.decide(now)
        while batches:
            lost = False
            for i, b in enumerate(batches):
                if b.batch_id not in core.batches:  # given back at an earlier failed send to its worker
                    continue
                why = self._send_to_worker(b)
                if why:
                    # It never reached the worker, nor did this round's later batches for it: their
                    # requests go back as they were. Failed over as batches that ran, they spent
                    # their one retry (and became suspects): with two workers gone, a request that
                    # reached neither was answered UNAVAILABLE beside a free healthy worker.
                    for later in (b, *batches[i + 1:]):
                        if later.worker is b.worker:
                            core.undelivered(later)
                    self._worker_lost(b.worker.name, f"unreachable: {why}", now)
                    lost = True
            # Their requests are queued again and their workers gone: decide again, now, on
            # the workers left (each round loses a worker, so this ends).
            batches = core.decide(now) if lost else []
        self.core.departures += self.llm.decide(now)  # the long poll's cursor counts every worker
        if core.draining and (self._drained() or now >= self._drain_deadline):
            self._end_drain()
            return
        if core.status_waiters:
            self._answer_status_waiters(now)
        wake = min(core.next_wake(), self.llm.core.next_wake(), self._next_housekeeping)
        if self.replies.holding:
            self.replies.flush(now)
            wake = min(wake, self.replies.next_try())
        self._arm(min(wake, self._drain_deadline) if core.draining else wake, now)
        # ZeroMQ's FD is edge-triggered and our own sends can consume the edge: if input is
        # pending now, run again rather than wait for an edge that already happened.
        if waiting(self.frontend) or waiting(self.backend):
            self.loop.call_soon(self._step)

    def _drained(self) -> bool:
        """Nothing left that the drain can still serve (LLM requests included)."""
        return ((self.core.drained() or self.core.unservable()) and not self.llm.core.requests
                and not self.llm.busy() and not self.replies.holding)  # (and every reply sent)

    def _end_drain(self) -> None:
        """Every request still open gets its one reply, UNAVAILABLE, then the sockets close."""
        if not self._drained():
            log.warning("drain_timeout_s (%.1f s) ran out: %d queued, %d batches in flight, %d LLM requests "
                        "answered UNAVAILABLE", self.cfg.drain_timeout_s, self.state.queued_requests(),
                        len(self.core.batches), len(self.llm.core.requests))
            why = f"drain_timeout_s {self.cfg.drain_timeout_s:g} s ran out"
        else:  # ended early: nothing queued that a worker left could take (they stopped beside it, or
            # every one left has a smaller max batch)
            why = "no worker left that can take it"
        self.core.fail_queued(Status.UNAVAILABLE, f"dispatcher shut down before the request reached a worker ({why})")
        self.core.fail_all(Status.UNAVAILABLE, "dispatcher shut down before the batch finished")
        self.llm.fail_all(Status.UNAVAILABLE, "dispatcher shut down before the request finished", _now())
        # Its workers outlive it (`up` stops them next). Each is told that nobody will answer its
        # `leaving` (it waited 1 s for that answer, LEAVING_NOTED_WAIT_S, and its goodbye lingered
        # 0.5 s in a socket nobody read: `up` took 2 s to stop a node of idle workers). Not told to
        # register again: one left running (separate units) sent `register` to nobody every 2 s,
        # and after ~1,000 of them its sends blocked; heartbeats, whose queue is bounded, find the
        # next dispatcher, which asks. (The backend socket lingers for these on close.)
        for w in self.state.workers.values():
            self._send_worker(w.identity, P.encode(P.Closing(worker=w.name)))
        self.close()

    def _arm(self, when: float, decided_at: float) -> None:
        # Only move the timer earlier; a spurious later wake-up is harmless and saves a syscall.
        # An instant no later than the decision's would only repeat it: completions and arrivals
        # wake the loop by themselves. One after it is armed even if the step has outlasted it
        # (the timerfd then fires at once): compared with the clock read after the step, a wait
        # of 100 us that a 120 us step had passed was dropped, and with it every other wake-up
        # (deadlines, long polls, housekeeping), until some message came.
        if decided_at < when < self.timer.armed_at:
            self.timer.arm(when)

    # ------------------------------------------------------------------ 1. workers
    def _recv_from_workers(self, now: float) -> None:
        sock = self.backend
        for _ in range(MAX_DRAIN):
            frames = recv_parts(sock)
            if frames is None:
                return
            try:
                self._on_worker_message(frames, now)
            except Exception:
                log.exception("worker message from %r could not be handled; dropped", frames[0].bytes)

    def _on_worker_message(self, frames: list, now: float) -> None:
        identity = frames[0].bytes
        if len(frames) < 2:
            log.warning("dropping empty message from worker connection %r", identity)
            return
        try:
            msg = P.worker_message_decoder.decode(frames[1].buffer)
        except P.DecodeError as e:
            log.warning("dropping malformed worker message from %r: %s", identity, e)
            self._answer_malformed(frames[1].buffer, identity, str(e), now)
            return
        if type(msg) in (P.BatchDone, P.Heartbeat, P.LlmDone, P.LlmTokens, P.Goodbye, P.Leaving) and not self._sent_by(
                msg.worker, identity, frames):
            # A worker is its connection, not the name a message gives: anything on the workers'
            # socket could answer another worker's batch (its client got the forged output, the
            # real one was dropped) or say goodbye for it.
            log.warning("dropping %s naming worker %r from connection %r, not that worker's",
                        type(msg).__name__, msg.worker, identity)
            return
        if type(msg) is P.BatchDone:
            self._on_batch_done(msg, frames, now)
        elif type(msg) is P.Heartbeat:
            if not self.core.heartbeat(msg.worker, now) and not self.llm.heartbeat(msg.worker, now):
                hung = self.core.hung.get(msg.worker) or self.llm.core.hung.get(msg.worker)
                self._send_worker(identity, P.encode(P.Reregister(worker=msg.worker) if hung is None
                                                     else P.Restart(worker=msg.worker, reason=hung)))
        elif type(msg) is P.LlmDone:
            self.llm.on_done(msg, now)
        elif type(msg) is P.LlmTokens:
            self.llm.on_tokens(msg)
        elif type(msg) is P.Leaving:
            if self.core.leaving(msg.worker):
                log.info("worker %s is stopping: no new batch goes to it", msg.worker)
            self._send_worker(identity, P.encode(P.LeavingNoted(worker=msg.worker)))
        elif type(msg) is P.Goodbye:
            if self.llm.lost(msg.worker, "worker stopped", now):
                self.core.departures += 1  # the long poll's cursor counts every worker
            else:
                self._worker_lost(msg.worker, "worker stopped", now)
        elif not self._may_register(msg, frames):
            return
        elif msg.llm is not None:
            self.llm.on_register(msg, identity, now, transport.connection(frames)[1])
            self.core.registrations += 1  # the long poll's cursor counts every worker
            self._answer_status_waiters(now)
        else:
            self._on_register(msg, identity, transport.connection(frames)[1], now)

    def _answer_malformed(self, raw, identity: bytes, why: str, now: float) -> None:
        """A batch_done that fails its schema (an output dimension past 2**31, say) still names
        its batch: its requests are answered INTERNAL now. Dropped whole, they waited for their
        deadlines, and the worker's slot stayed taken until it was declared hung. A registration
        that fails it is refused in words."""
        try:
            head = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            return
        if isinstance(head, dict) and head.get("type") == "register" and type(head.get("worker")) is str:
            # Answered, as a registration the dispatcher refuses: unanswered, the worker retried
            # in silence for good (a max_batch of 0, say).
            self._send_worker(identity, P.encode(P.RegisterRejected(
                worker=head["worker"][:200], message=f"registration does not decode: {why}"[:1000])))
            return
        batch_id = head.get("batch_id") if isinstance(head, dict) and head.get("type") == "batch_done" else None
        batch = self.core.batches.get(batch_id) if type(batch_id) is int else None
        if batch is not None and batch.worker.identity == identity:
            why = f"worker {batch.worker.name} sent a malformed result (it does not decode)"
            self._on_batch_done(P.BatchDone(batch_id=batch_id, worker=batch.worker.name, compute_us=0, results=[
                P.ItemResult(seq=r.seq, status=Status.INTERNAL, message=why) for r in batch.requests]), [identity, raw], now)

    def _may_register(self, msg: P.Register, frames: list) -> bool:
        """A worker on an ipc backend runs as the node's user (or root): the backend's socket file
        shares the clients' group (ipc_group), and a client that registered as a worker took other
        clients' batches (their tensors) and answered them. Refused in words otherwise."""
        uid = peer_uid(transport.connection(frames)[1])
        if uid is None or uid in (0, os.getuid()):
            return True
        log.warning("refusing worker %r from uid %d: workers run as the node's user", msg.worker, uid)
        self._send_worker(frames[0].bytes, P.encode(P.RegisterRejected(
            worker=msg.worker, message=f"a worker connects as the node's user (uid {os.getuid()}), not uid {uid}")))
        return False

    def _sent_by(self, name: str, identity: bytes, frames: list) -> bool:
        """Whether a message naming worker ``name`` came over its own connection (or its
        heartbeat thread's, ``<identity>#hb``), from the process that registered it (the
        kernel's credentials, on ipc); True for a name not registered. By routing id alone, a
        process that connected under a dead worker's name (its routing id, free again) kept its
        registration alive with heartbeats, took its batches (other clients' tensors), and
        answered them; ZeroMQ then refused the restarted worker that id."""
        w = self.state.workers.get(name) or self.llm.core.workers.get(name)
        if w is None:
            return True
        # (the plain comparison first: results, on the hot path, come over the worker's own)
        return (identity == w.identity or identity == w.identity + b"#hb") and transport.connection(frames)[1] == w.peer

    def _on_register(self, msg: P.Register, identity: bytes, peer: str, now: float) -> None:
        text = registration_problem(msg.models, self.specs)
        if text:
            log.error("rejecting worker %s: %s", msg.worker, text)
            self._send_worker(identity, P.encode(P.RegisterRejected(worker=msg.worker, message=text)))
            return
        known = self.state.workers.get(msg.worker)
        if same_process(known, msg.pid, identity, peer, msg.started):
            # The same process registering again is no restart: its batches are still running.
            # After a dispatcher restart a worker's heartbeats, sent before its registration was
            # answered, each draw a Reregister; one that lands after the answer made it register
            # twice, and the second registration failed the batch it had just been given.
            self.core.heartbeat(msg.worker, now)
            self._send_worker(identity, P.encode(P.Registered(worker=msg.worker)))
            return
        replaced = self._worker_lost(msg.worker, "worker re-registered", now, returning=True) if known is not None else None
        for spec in msg.models:
            self.specs.setdefault(spec.name, spec)
        # A worker's max batch is capped at the model's (the node's config, else the first
        # worker's), which clients are told: one started from another config was sent batches
        # of 32 of a model whose max batch is 8.
        caps = {s.name: min(s.max_batch, self.specs[s.name].max_batch) for s in msg.models}
        for s in msg.models:
            if caps[s.name] < s.max_batch:
                log.warning("worker %s registers max_batch %d for model %r, whose max_batch is %d: its batches "
                            "of it are capped at %d", msg.worker, s.max_batch, s.name, caps[s.name], caps[s.name])
        w = WorkerState(name=msg.worker, path=msg.path, models=caps,
                        capacity=msg.max_inflight, pid=msg.pid, simulated=msg.simulated, identity=identity, peer=peer,
                        started=msg.started, batch_bound_s=msg.batch_bound_s)
        self.core.add_worker(w, now, replaced)
        for model in w.models:
            self.metrics.model_served(model, w.path)
        log.info("worker %s registered: pid %d, path %s, models %s", w.name, w.pid, w.path, list(w.models))
        self._send_worker(identity, P.encode(P.Registered(worker=msg.worker)))
        self._answer_status_waiters(now)

    def _on_batch_done(self, msg: P.BatchDone, frames: list, now: float) -> None:
        # compute_us 0: nothing ran (the worker rejected every request): nothing to learn; nor
        # from a size's first run in a worker (kernels built): one such cold batch learnt by a
        # curve with no profile locked it into batches of 1, p99 5x, for good (SIMULATED).
        learn = msg.compute_us and not msg.first_of_size
        batch = self.core.complete(msg.batch_id, msg.compute_us / 1e6 if learn else None, now, msg.worker)
        if batch is None:
            return  # from a worker declared dead, for requests already failed over, or not this batch's worker
        w = batch.worker
        path, simulated = w.path, w.simulated
        metrics = self.metrics
        served = False
        by_seq = {r.seq: r for r in batch.requests}
        finish = self.core.finish
        pos = 2
        unavailable = bool(msg.results) and all(r.status == Status.UNAVAILABLE for r in msg.results)
        if unavailable:
            backoff = self.core.batch_health(w, True, now, batch.model)
            if backoff is not None:
                log.warning("worker %s out of rotation for model %r for %.1f s: its batch failed UNAVAILABLE (%s)",
                            w.name, batch.model, backoff, msg.results[0].message)
        malformed = ""
        for res in msg.results:
            # A result whose frames do not add up is answered INTERNAL, not forwarded: the client
            # would index frames that are not there (the SDK's I/O thread died of it). Once one is
            # wrong, the positions of the ones after it are unknown too.
            malformed = malformed or malformed_result(res, len(frames) - pos)
            if malformed:
                status, message, outputs, out_frames = (Status.INTERNAL, f"worker {msg.worker} sent a malformed "
                                                        f"result: {malformed}", [], [])
            else:
                status, message, outputs = res.status, res.message, res.outputs
                out_frames = frames[pos:pos + res.n_frames]
                pos += res.n_frames
            req = by_seq.pop(res.seq, None)  # a second result for one request (a broken worker) is dropped
            if req is None:
                continue
            if status == Status.UNAVAILABLE and self.core.retry_elsewhere(req, w, now):
                continue
            if not finish(req, now):
                continue
            timing = P.Timing(queue_us=int((req.dispatched_at - req.arrival) * 1e6), compute_us=msg.compute_us,
                              total_us=int((now - req.arrival) * 1e6), batch_size=batch.items, path=path,
                              worker=msg.worker, simulated=simulated, arrival_ns=int(req.arrival * 1e9),
                              dispatched_ns=int(req.dispatched_at * 1e9), done_ns=int(now * 1e9),
                              compute_end_ns=msg.compute_end_ns if self.workers_on_host else 0)
            if status == Status.OK:
                served = True
                metrics.request_ok(req.model, path, req.asked_priority, req.items, timing.queue_us, timing.compute_us,
                                   timing.total_us)
            else:
                metrics.request_failed(req.model, status, req.asked_priority)
            header = P.encode(P.InferReply(v=P.PROTOCOL_VERSION, id=req.req_id, status=status,
                                           message=message, outputs=outputs, timing=timing))
            self.replies.send(req.client, header, *out_frames)
        if served:
            # As Triton's backends report a batch (nv_inference_exec_count) unless every response
            # in it failed, so that count / exec_count is the mean batch and the front door's
            # execution_count agrees (batches that failed whole, or UNAVAILABLE and retried
            # elsewhere, were counted).
            metrics.batch_done(batch.model, path)
        if not unavailable:
            self.core.batch_health(w, False, now, batch.model)
        # A result the worker did not send (a broken worker) must not strand its request. Its
        # batch has ended: no "in flight" flag, and no release to follow.
        for req in batch.requests:
            if req.state != QUEUED:  # not the ones just queued again for another worker
                self.core.fail(req, Status.INTERNAL, f"worker {msg.worker} returned no result for this request",
                               batch_ended=True)
        self._release(batch.requests)

    # ------------------------------------------------------------------ 2. clients
    def _recv_from_clients(self, now: float) -> None:
        sock = self.frontend
        for _ in range(MAX_DRAIN):
            frames = recv_parts(sock, MAX_CLIENT_PARTS)
            if frames is None:
                return
            if not self._first_arrival:
                self._first_arrival = _now()
            try:
                self._on_client_message(frames, now)
            except Exception:
                identity = frames[0].bytes
                raw = frames[1].bytes if len(frames) > 1 else b""
                log.exception("client message from %r raised; answered INTERNAL", identity)
                self._reply(identity, P.error_reply(P.salvage_id(raw), Status.INTERNAL,
                                                    "the dispatcher failed to handle this message"))

    def _on_client_message(self, frames: list, now: float) -> None:
        identity = frames[0].bytes
        if len(frames) < 2:
            self._reply(identity, P.error_reply(None, Status.INVALID_ARGUMENT,
                                                "empty message: expected a MessagePack header frame"))
            return
        raw = frames[1].bytes
        if isinstance(frames, Truncated):
            self._reply(identity, P.error_reply(P.salvage_id(raw), Status.INVALID_ARGUMENT,
                                                f"message has {frames.parts - 2} payload frames, more than "
                                                f"{MAX_CLIENT_PARTS - 2} (one per input tensor)"))
            return
        try:
            msg = P.client_message_decoder.decode(raw)
        except P.DecodeError as e:
            self._reply(identity, P.error_reply(P.salvage_id(raw), Status.INVALID_ARGUMENT, f"malformed header: {e}"))
            return
        if msg.v != P.PROTOCOL_VERSION:
            # A cancel's id is the request it names (salvage_id): answered under it, that request
            # got a second result.
            rid = None if type(msg) is P.CancelRequest else msg.id
            self._reply(identity, P.error_reply(rid, Status.INVALID_ARGUMENT,
                                                f"protocol version {msg.v} not supported; this "
                                                f"dispatcher speaks {P.PROTOCOL_VERSION}"))
            return
        if type(msg) is P.InferRequest:
            self._on_infer(msg, identity, raw, frames, now)
        elif type(msg) is P.GenerateRequest:
            self.llm.on_generate(msg, identity, now, self._unknown_llm_model)
        elif type(msg) is P.CancelRequest:
            if not self.core.cancel(identity, msg.id):
                self.llm.cancel(identity, msg.id, msg.finished, now)
        elif type(msg) is P.ShmRegisterRequest or type(msg) is P.ShmUnregisterRequest:
            self._on_shm_register(msg, identity, transport.connection(frames))
        elif type(msg) is P.ModelInfoRequest:
            spec = self.specs.get(msg.model)
            if spec is None:
                # The SDK and the front door ask this before an inference: theirs for a model not
                # served end here, and are counted here (an LLM model is served, to `generate`).
                if msg.model not in self.llm.core.models():
                    self.metrics.unknown_model()
                reply = P.ModelInfoReply(v=P.PROTOCOL_VERSION, id=msg.id, status=Status.UNKNOWN_MODEL,
                                         message=self._unknown_model(msg.model))
            else:
                reply = P.ModelInfoReply(v=P.PROTOCOL_VERSION, id=msg.id, status=Status.OK, spec=spec,
                                         max_inline_bytes=self.cfg.max_inline_bytes,
                                         default_timeout_us=round(self.cfg.default_timeout_s * 1e6))
            self._reply(identity, P.encode(reply))
        else:
            # Answered after this step's decision (see _step), so a status reply tells the
            # client that everything it sent before has been queued and decided on.
            # A wait is at most a request's longest timeout; a connection past its share of held
            # polls has this one answered now (still after this step's decision).
            token = (identity, msg.id, msg.brief)
            if not self.core.add_status_waiter(token, msg.min_registrations,
                                               now + min(msg.wait_us / 1e6, MAX_STATUS_WAIT_S), msg.min_departures,
                                               owner=identity):
                self.core.add_status_waiter(token, 0, now)

    def _on_shm_register(self, msg, identity: bytes, conn: tuple) -> None:
        self._reply(identity, P.encode(self.grants.answer(msg, conn, self.shm_allowed)))

    def _unknown_model(self, model: str) -> str:
        """UNKNOWN_MODEL's message for ``infer`` or ``model_info``: a model this dispatcher serves
        for ``generate`` is named as one (its list named the very model it said was unknown)."""
        llm = sorted(self.llm.core.models())
        if model in llm:
            return f"{model!r} is an LLM model: send it `generate`, not `infer` (tensor models: {sorted(self.specs)})"
        return f"unknown model {model!r}; this dispatcher serves {sorted(self.specs) + llm}"

    def _unknown_llm_model(self, model: str) -> str:
        """UNKNOWN_MODEL's message for ``generate``; a tensor model is named as one."""
        if model in self.specs:
            return (f"{model!r} is a tensor model: send it `infer`, not `generate` "
                    f"(LLM models: {sorted(self.llm.core.models())})")
        return self._unknown_model(model)

    def _reject(self, identity: bytes, msg: P.InferRequest, status: Status, message: str) -> None:
        self.metrics.request_failed(msg.model, status, msg.priority)
        self._reply(identity, P.error_reply(msg.id, status, message))

    def _on_infer(self, msg: P.InferRequest, identity: bytes, raw: bytes, frames: list, now: float) -> None:
        spec = self.specs.get(msg.model)
        if spec is None:
            # Not counted under the name asked for: as in Triton, a model it does not serve has no
            # series, and any client could otherwise add series without end (each scrape renders
            # them all on this thread). An LLM model is served, to `generate`: not counted.
            if msg.model not in self.llm.core.models():
                self.metrics.unknown_model()
            self._reply(identity, P.error_reply(msg.id, Status.UNKNOWN_MODEL, self._unknown_model(msg.model)))
            return
        files = None
        if msg.outputs or any(ref.shm is not None for ref in msg.inputs):
            files, denied = self.grants.files(msg, transport.connection(frames), self.shm_allowed)
            if denied:
                self._reject(identity, msg, Status.PERMISSION_DENIED, denied)
                return
        payload = frames[2:]
        try:
            items = validate_infer(msg, spec, [len(f) for f in payload], self.cfg.max_inline_bytes,
                                   self.shm_allowed)
        except RequestInvalid as e:
            self._reject(identity, msg, Status.INVALID_ARGUMENT, str(e))
            return
        got = self.core.admit(msg.model, items, msg.priority, msg.timeout_us / 1e6, now, identity, msg.id,
                              [raw, *payload])
        if type(got) is Rejected:
            self._reject(identity, msg, got.status, got.message)
        else:
            got.shm_files = files
            got.writes_shm = bool(msg.outputs)

    def _answer_status_waiters(self, now: float) -> None:
        for identity, rid, brief in self.core.due_status_waiters(now):
            self._reply(identity, P.encode(status_report.status_reply(self, rid, brief)))

    # ------------------------------------------------------------------ 4. workers out
    def _send_to_worker(self, batch: Batch) -> str:
        """Send ``batch``; "" when sent, else why not (the worker's connection is gone)."""
        reqs = batch.requests
        frames: list = [batch.worker.identity, b""]
        seqs, n_frames, files = [], [], {}
        for r in reqs:
            seqs.append(r.seq)
            n_frames.append(len(r.frames) - 1)
            frames.extend(r.frames)
            if r.shm_files:
                files[r.seq] = r.shm_files
        frames[1] = P.encode(P.Batch(batch_id=batch.batch_id, model=batch.model, seqs=seqs, n_frames=n_frames,
                                     files=files))
        try:
            send_parts(self.backend, frames, NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the connection is gone; EAGAIN: it reads nothing
            log.warning("worker %s unreachable (%s)", batch.worker.name, e)
            return str(e) or "unreachable"
        return ""

    def _send_worker(self, identity: bytes, header: bytes) -> bool:
        """False when the worker's connection is gone (ROUTER_MANDATORY) or its queue is full.
        Never blocks: with ROUTER_MANDATORY a send to a peer whose queue is full waits, and a peer
        on the workers' socket that sent heartbeats and never read the answers held the
        dispatcher's one thread for good (no client answered, SIGTERM unheard)."""
        try:
            send_parts(self.backend, [identity, header], NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    # ------------------------------------------------------------------ 5. housekeeping
    def _housekeeping(self, now: float) -> None:
        self._next_housekeeping = now + self.cfg.heartbeat_interval_s
        for w, reason in self.core.check_liveness(now):
            log.warning("worker %s (pid %d) out of rotation: %s", w.name, w.pid, reason)
        self.core.departures += self.llm.housekeeping(now)
        if now >= self._next_janitor:
            self._next_janitor = now + self.cfg.janitor_interval_s
            if self._reaping is None:
                self._reaping = reaping()
            self.grants.begin_sweep()
        if self._reaping is not None:
            self._reap_slice()
        if self.grants.sweeping:
            self.grants.sweep()  # a slice each tick: one stalled every client for all the grants at once

    def _reap_slice(self) -> None:
        """The orphaned-segment sweep's next REAP_ENTRIES_PER_TICK entries of /dev/shm."""
        steps = 0
        for name in self._reaping:
            if name:
                log.info("unlinked orphaned shared memory %s (owner process is gone)", name)
            steps += 1
            if steps >= REAP_ENTRIES_PER_TICK:
                return
        self._reaping = None

    def _release(self, requests) -> None:
        """Their batch has ended: tell the clients answered while it ran that their shared
        memory is no longer touched."""
        for req in requests:
            if req.answered_in_flight:
                req.answered_in_flight = False
                self._reply(req.client, P.encode(P.Release(v=P.PROTOCOL_VERSION, id=req.req_id)))

    def _worker_lost(self, name: str, reason: str, now: float, returning: bool = False) -> Optional[WorkerState]:
        # Gone for sure (stopped, restarted, connection closed): it touches no memory any more.
        # (A worker only silent past worker_dead_after_s may be alive: no release then; the
        # clients keep those regions reserved.)
        for b in list(self.core.batches.values()):
            if b.worker.name == name:
                self._release(b.requests)
        w = self.core.worker_lost(name, reason, now, returning=returning)
        if w is not None:
            log.log(logging.INFO if reason == "worker stopped" else logging.WARNING,
                    "worker %s (pid %d) out of rotation: %s", name, w.pid, reason)
        return w

    # ------------------------------------------------------------------ replies
    def _on_fail(self, req: Request, status: Status, message: str) -> None:
        self.metrics.request_failed(req.model, status, req.asked_priority)
        self._reply(req.client, P.error_reply(req.req_id, status, message, req.answered_in_flight))

    def _reply(self, identity: bytes, header: bytes) -> None:
        self.replies.send(identity, header)

    def render_metrics(self) -> str:
        return status_report.render_metrics(self)

