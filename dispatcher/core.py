"""The request lifecycle, as one pure state machine: ``RequestCore``.

Admission, queues, deadlines, cancel, expiry, dispatch, completion, worker loss and retry,
liveness and status waiters — everything that happens to a request between its arrival and
its one reply, with no sockets and no clock: every method takes ``now``. The live dispatcher
(server.py, socket plumbing) and the simulator (bench/simulator.py, a virtual clock) drive the
same object, so what the simulator measures is what runs (the split of vLLM's EngineCore, the
state machine, from EngineCoreProc, its process and sockets).

Every request ends exactly once: either ``finish`` (its batch completed; the driver forwards
the worker's reply) or ``on_fail(request, status, message)``, the driver's callback that sends
the error reply. Nothing else removes a request.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from typing import Any, Callable, NamedTuple, Optional

from .policy import feasible
from .policy_core import LATE_MARGIN
from .protocol import Status
from .state import DONE, INFLIGHT, QUEUED, Request, SchedulerState, WorkerState


# Status long polls one connection may have held at once, and the node all connections
# together; past either, each is answered at once. Closed connections leave theirs held until
# they expire: without a node-wide cap, 3000 connections that sent 64 polls each and closed
# kept 62 MiB and made every registration look through them all (infers waited up to 97 ms).
MAX_STATUS_WAITERS = 64
MAX_STATUS_WAITERS_NODE = 4096
# The longest a status poll is held (a readiness wait is seconds; its timeout could be years).
MAX_STATUS_WAIT_S = 600.0


class Rejected(NamedTuple):
    """Admission said no: reply with this status and message, nothing was queued."""

    status: Status
    message: str


# A batch's compute time is part of the round trip the dispatcher saw; the slack covers
# clocks read at different instants (and the simulator's float sums).
COMPUTE_SLACK_S = 1e-3


class Batch:
    """One batch sent to a worker, until its completion or the worker's loss."""

    __slots__ = ("batch_id", "worker", "model", "requests", "items", "sent_at")

    def __init__(self, batch_id: int, worker: WorkerState, model: str, requests: list, sent_at: float):
        self.batch_id = batch_id
        self.worker = worker
        self.model = model
        self.requests = requests
        self.items = sum(r.items for r in requests)
        self.sent_at = sent_at


FailCallback = Callable[[Request, Status, str], None]

# A batch running this many times its curve's time (plus worker_dead_after_s) is overdue: with a
# batch behind it whose requests have all ended, its worker is taken for hung (check_liveness).
OVERDUE_FACTOR = 3.0


class RequestCore:
    def __init__(self, policy, on_fail: FailCallback, *, max_queue: int = 10_000,
                 default_timeout_s: float = 30.0, worker_dead_after_s: float = math.inf,
                 max_retries: int = 1, breaker_backoff_s: float = 0.5, breaker_backoff_max_s: float = 30.0):
        self.policy = policy
        self.on_fail = on_fail
        self.max_queue = max_queue
        self.default_timeout_s = default_timeout_s
        self.worker_dead_after_s = worker_dead_after_s
        self.max_retries = max_retries
        self.breaker_backoff_s = breaker_backoff_s
        self.breaker_backoff_max_s = breaker_backoff_max_s
        # (worker name, model) -> (back in rotation at, worker): the breaker's, per model, as a batch
        # is of one model. Per worker, a Triton worker one of whose models Triton had unloaded was
        # out of rotation for all of them: each of that model's batches took it out again, and
        # the model still loaded went from 38 requests/s to 1.8, its p50 4.6 -> 483 ms.
        self.suspended: dict[tuple[str, str], tuple[float, WorkerState]] = {}
        self.backoff: dict[tuple[str, str], float] = {}  # its next back-off (doubles while it keeps failing)
        # name -> why: workers declared lost because a batch never came back. Their main thread is
        # stuck in the model, so telling them to register again brings nothing back; they are told
        # to exit, and `up` or systemd starts them anew. Cleared when the name registers again.
        self.hung: dict[str, str] = {}
        self.leaving_workers: set[str] = set()  # said `leaving`: no new batch until they register again
        self.state = SchedulerState()
        self.requests: dict[int, Request] = {}  # seq -> request, queued or in flight
        self.by_client_id: dict[tuple[Any, int], int] = {}  # (client, request id) -> seq, for cancel
        self.batches: dict[int, Batch] = {}
        # heap of (when to look, seq), lazily pruned: a queued request's hopeless instant, else its deadline
        self.deadlines: list[tuple[float, int]] = []
        # heap of (expires, seq, min registrations, min departures, token, owner connection)
        self.status_waiters: list[tuple] = []
        self._waiters_by_owner: dict[Any, int] = {}  # connection -> its long polls held
        self._waiters_seen = (0, 0)  # (registrations, departures) when the held polls were last looked through
        self.registrations = 0  # worker registrations since start (cumulative: a long poll's cursor)
        self.departures = 0  # workers taken out of rotation since start (the same, for losses)
        self.decisions: dict[str, int] = {}  # decision reason -> count
        self.wake_at = math.inf  # the policy's last requested wake-up
        self._seq = itertools.count(1)
        # Each dispatcher run numbers its batches from a random start: a worker that outlived a
        # restart may still answer a batch of the previous run, whose number a new batch got when
        # both runs counted from 1 (another client's request then took that answer).
        self._batch_ids = itertools.count(1 + random.getrandbits(48))

    # ------------------------------------------------------------------ arrival
    def admit(self, model: str, items: int, priority: int, timeout_s: float, now: float,
              client: Any = None, req_id: int = 0, frames: Optional[list] = None):
        """Queue a request, or say why not. Returns the ``Request`` or a ``Rejected``.
        ``timeout_s`` 0 means the node's default."""
        if self.draining:
            return Rejected(Status.UNAVAILABLE, "dispatcher is shutting down")
        if items < 1:  # validation refuses them first; a policy dividing by the items must never see one
            return Rejected(Status.INVALID_ARGUMENT, f"a request of {items} items of {model!r}")
        q = self.state.queue(model)
        full = q.requests >= self.max_queue
        # A full queue takes a request of a higher class than some queued one: that one makes
        # room (the newest of the lowest class). Refused instead, high requests were OVERLOADED
        # behind a low backlog, one left by a client that was gone among them (16 of 20 high
        # requests refused behind 100 low ones; an outside review).
        if full and not any(q.by_priority[c] for c in range(priority + 1, len(q.by_priority))):
            return Rejected(Status.OVERLOADED, f"queue for {model!r} is full ({self.max_queue} requests)")
        largest = self.state.largest_batch.get(model, 0)
        if items > largest > 0:
            return Rejected(Status.INVALID_ARGUMENT, f"{items} items of {model!r} in one request: more than any of "
                            f"its workers takes in a batch ({largest})")
        timeout = timeout_s or self.default_timeout_s
        probe = False
        if not feasible(self.state, model, items, now + timeout, now):
            if not (self.state.probe_due(model, now) or self.state.size_probe_due(model, items, now)):
                return Rejected(Status.DEADLINE_EXCEEDED,
                                f"no path can finish {items} item(s) of {model!r} within "
                                f"{timeout * 1e3:.1f} ms (rejected on arrival)")
            probe = True
        # Counted after the refusals: the arrival rate says how many requests will join a batch,
        # and a refused one joins none (counted, three refused ones held the next request 117 to
        # 164 ms on an idle worker, waiting for company that would be refused too).
        if full:
            self.fail(q.pop_newest_below(priority), Status.OVERLOADED,
                      f"queue for {model!r} is full ({self.max_queue} requests): this request made room for one "
                      "of a higher priority")
        self.state.note_arrival(model, priority, items, now)
        seq = next(self._seq)
        req = Request(seq, model, items, priority, now, now + timeout, client, req_id, frames)
        req.probe = probe
        self.requests[seq] = req
        if client is not None:
            self.by_client_id[(client, req_id)] = seq
        heapq.heappush(self.deadlines, (self._hopeless_at(req), seq))
        q.push(req)
        return req

    def _expired_queued(self, req: Request, now: float, why: str) -> tuple[Status, str]:
        """A queued request's failure at (or just before) its deadline: DEADLINE_EXCEEDED, but
        UNAVAILABLE where no worker serving its model is registered, or every one is out of
        rotation by the breaker (its backend failed batches UNAVAILABLE: Triton down, say), as
        Triton answers for a model that is not available. Its client then retries elsewhere, not
        with a longer deadline; a request still queued when the only GPU worker's back-off (2, 4,
        8 s) outlived its timeout was a DEADLINE_EXCEEDED "in queue", as if the node were only
        slow."""
        if self.state.serving.get(req.model):
            return Status.DEADLINE_EXCEEDED, why
        out = [(until, name) for (name, model), (until, _) in self.suspended.items() if model == req.model]
        if out:
            until, name = min(out)
            return Status.UNAVAILABLE, (f"{why}: every worker of {req.model!r} is out of rotation, its backend "
                                        f"failing batches UNAVAILABLE ({name} back in {max(until - now, 0.0):.1f} s)")
        # None registered (starting, restarting after a crash or a hang, or none configured): as
        # Triton answers a model that is not ready. A DEADLINE_EXCEEDED "in queue" read as a slow
        # node, and clients that retry on UNAVAILABLE did not (an outside review).
        return Status.UNAVAILABLE, f"{why}: no worker serves {req.model!r} now (none is registered for it)"

    def _fastest(self, model: str, items: int) -> float:
        """The time the fastest path serving ``model`` that takes ``items`` in one batch now takes
        for them alone (0: none serves it)."""
        return min((self.state.cost(model, w.path).predict(items) for w in self.state.serving.get(model, ())
                    if w.models[model] >= items), default=0.0)

    def _hopeless_at(self, req: Request) -> float:
        """Queued, a request is hopeless before its deadline: once even the fastest path alone
        would end after it (with the policies' margin for a fast run, LATE_MARGIN); then it is
        failed at once rather than left to expire. A probe runs whatever the curves say."""
        if req.probe:
            return req.deadline
        return req.deadline - (1 - LATE_MARGIN) * self._fastest(req.model, req.items)

    def cancel(self, client: Any, req_id: int) -> bool:
        """Cancel a queued request (one already in a batch runs to completion)."""
        seq = self.by_client_id.get((client, req_id))
        req = self.requests.get(seq) if seq is not None else None
        if req is None or req.state != QUEUED:
            return False
        self.state.queue(req.model).remove(req)
        self.fail(req, Status.CANCELLED, "cancelled by the client while queued")
        return True

    # ------------------------------------------------------------------ time passes
    def expire(self, now: float) -> None:
        """Fail every request whose deadline has passed, queued or in flight."""
        heap = self.deadlines
        leaving: dict[str, list] = {}  # model -> expired queued requests, out of their queues in one pass
        while heap and heap[0][0] <= now:
            _, seq = heapq.heappop(heap)
            req = self.requests.get(seq)
            if req is None:
                continue  # finished already
            if req.deadline > now:
                if req.state == QUEUED:
                    # The instant was set on arrival; the paths may have changed since (a faster
                    # worker joined, the curves learned): judge it on the paths of now.
                    hopeless = self._hopeless_at(req)
                    if hopeless > now:
                        heapq.heappush(heap, (hopeless, seq))
                        continue
                    leaving.setdefault(req.model, []).append(req)
                    self.state.expired(req, now)
                    fastest = self._fastest(req.model, req.items)
                    self.fail(req, *self._expired_queued(
                        req, now, f"cannot finish before its deadline on any path: {(req.deadline - now) * 1e3:.1f} "
                        f"ms left after {(now - req.arrival) * 1e3:.1f} ms in queue, the fastest path takes "
                        f"{fastest * 1e3:.1f} ms"))
                else:  # in flight (or queued again later): its deadline is what counts
                    heapq.heappush(heap, (req.deadline, seq))
                continue
            if req.state == QUEUED:
                leaving.setdefault(req.model, []).append(req)
                self.state.expired(req, now)
                self.fail(req, *self._expired_queued(
                    req, now, f"deadline passed in queue after {(now - req.arrival) * 1e3:.1f} ms"))
            else:
                self.fail(req, Status.DEADLINE_EXCEEDED,
                          f"deadline passed while its batch was running after {(now - req.arrival) * 1e3:.1f} ms")
        for model, reqs in leaving.items():
            self.state.queue(model).remove_many(reqs)

    def decide(self, now: float) -> list[Batch]:
        """Expire, then run the policy: the batches to send now. Sets ``wake_at``."""
        self.expire(now)
        if self.suspended:
            self._resume_due(now)
        decision = self.policy.decide(self.state, now)
        for req, why in decision.late:
            self.fail(req, Status.DEADLINE_EXCEEDED, why)
        counts = self.decisions
        for reason, n in decision.reasons.items():
            counts[reason] = counts.get(reason, 0) + n
        out = []
        for d in decision.dispatches:
            batch = Batch(next(self._batch_ids), d.worker, d.model, d.requests, now)
            for r in d.requests:
                r.state = INFLIGHT
                r.dispatched_at = now
                r.batch_id = batch.batch_id
            self.batches[batch.batch_id] = batch
            out.append(batch)
        # A wake-up no later than this decision would only repeat it, and no timer arms it;
        # kept, it hid every deadline and long poll from next_wake().
        self.wake_at = decision.wake_at if decision.wake_at > now else math.inf
        return out

    def next_wake(self) -> float:
        """The earliest instant something happens without new input: the policy's wake-up,
        a deadline, a status long poll's expiry."""
        wake = self.wake_at
        if self.deadlines and self.deadlines[0][0] < wake:
            wake = self.deadlines[0][0]
        if self.status_waiters:
            wake = min(wake, self.status_waiters[0][0])
        if self.suspended:
            wake = min(wake, min(until for until, _ in self.suspended.values()))
        return wake

    # ------------------------------------------------------------------ completion
    def complete(self, batch_id: int, compute_s: Optional[float], now: float,
                 worker: Optional[str] = None) -> Optional[Batch]:
        """A batch finished; the worker's slot is free and the cost curve learns from it.
        ``compute_s`` None: nothing ran (nothing to learn). Returns None for a batch that is
        no longer tracked (its worker was declared lost and its requests failed over), and for
        an answer from a ``worker`` that the batch was not sent to (left tracked)."""
        batch = self.batches.get(batch_id)
        if batch is None or (worker is not None and batch.worker.name != worker):
            return None
        del self.batches[batch_id]
        w = batch.worker
        w.done_at = now
        if compute_s is not None and not 0 < compute_s <= now - batch.sent_at + COMPUTE_SLACK_S:
            # Not a time this batch could have taken (a broken or hostile worker): learnt, one
            # compute_us of 2**64-1 set the launch to 2e18 us, and every later request of the
            # model was refused on arrival, for good (nothing dispatched, nothing to correct it).
            compute_s = None
        if self.state.workers.get(w.name) is w:
            w.last_seen = now
            self.state.on_complete(w, batch.model, batch.items, compute_s, now)
        return batch

    def finish(self, req: Request, now: Optional[float] = None) -> bool:
        """``req``'s result is being delivered. False if it already ended (expired,
        cancelled, or failed over): then its result must be dropped. Given ``now``, a result
        that came back at or past the request's deadline ends it DEADLINE_EXCEEDED (False), as
        the deadline's own timer does when it runs first: the two race at the deadline, and a
        few results a run came back OK after it (by up to 4 ms, live at 120 req/s). The
        simulator, which gives no ``now``, counts such a request served, past its deadline."""
        if req.state != INFLIGHT or req.seq not in self.requests:
            return False  # ended, or queued again (retry_elsewhere): not this result's to deliver
        if now is not None and now >= req.deadline:
            self.fail(req, Status.DEADLINE_EXCEEDED,
                      f"deadline passed while its batch was running after {(now - req.arrival) * 1e3:.1f} ms",
                      batch_ended=True)
            return False
        del self.requests[req.seq]
        req.state = DONE
        req.frames = None  # its payload: the deadline index may hold the request until its deadline
        self._forget_client_id(req)
        return True

    def _forget_client_id(self, req: Request) -> None:
        # A client may reuse an id while a request of that id is still open: the entry is then the
        # newer request's, and must stay so that a cancel still reaches it.
        key = (req.client, req.req_id)
        if req.client is not None and self.by_client_id.get(key) == req.seq:
            del self.by_client_id[key]

    def fail(self, req: Request, status: Status, message: str, batch_ended: bool = False) -> None:
        """End ``req`` with an error, once (later calls are ignored). ``batch_ended``: its batch
        came back, so the answer is not one given while the worker may still touch its memory."""
        if req.state == DONE:
            return
        req.answered_in_flight = req.state == INFLIGHT and not batch_ended
        req.state = DONE
        req.frames = None  # as in finish
        self.requests.pop(req.seq, None)
        self._forget_client_id(req)
        self.on_fail(req, status, message)

    # ------------------------------------------------------------------ failing paths
    def retry_elsewhere(self, req: Request, worker: WorkerState, now: float) -> bool:
        """``worker`` answered UNAVAILABLE for ``req`` (its backend is down): queue it again
        at the head of its class, once, if its deadline allows and another worker serves the
        model. False: the caller forwards the worker's answer."""
        if (req.state != INFLIGHT or req.retries >= self.max_retries or req.deadline <= now
                or not any(w is not worker for w in self.state.serving.get(req.model, ()))):
            return False
        req.retries += 1
        req.state = QUEUED
        self.state.queue(req.model).push_front(req)
        return True

    def batch_health(self, worker: WorkerState, unavailable: bool, now: float, model: str) -> Optional[float]:
        """Circuit breaker, per (worker, model): a batch of ``model`` that came back all
        UNAVAILABLE takes ``worker`` out of rotation for that model for its back-off (returned,
        in seconds); a good batch resets the back-off."""
        key = (worker.name, model)
        if not unavailable:
            self.backoff.pop(key, None)
            return None
        if self.state.workers.get(worker.name) is not worker or key in self.suspended or \
                worker.name in self.leaving_workers:
            return None  # (a leaving worker is out for good: suspended, the breaker brought it back)
        backoff = self.backoff.get(key, self.breaker_backoff_s)
        self.backoff[key] = min(backoff * 2, self.breaker_backoff_max_s)
        self.suspended[key] = (now + backoff, worker)
        self.state.suspend(worker, (model,))
        return backoff

    def _forget_breaker(self, name: str) -> None:
        """The breaker's state of every model of worker ``name`` (gone, leaving, registering again)."""
        for table in (self.suspended, self.backoff):
            for key in [key for key in table if key[0] == name]:
                del table[key]

    def leaving(self, name: str) -> bool:
        """The worker is stopping once its batches in flight are done: no new batch goes to it
        (the breaker does not bring it back); it stays registered until its goodbye."""
        w = self.state.workers.get(name)
        if w is None:
            return False
        self._forget_breaker(name)
        self.leaving_workers.add(name)
        self.state.suspend(w)
        return True

    def _resume_due(self, now: float) -> None:
        for key, (until, w) in list(self.suspended.items()):
            if until <= now:
                del self.suspended[key]
                self.state.resume(w, [key[1]])  # half-open: its next batch of the model decides

    # ------------------------------------------------------------------ workers
    def add_worker(self, w: WorkerState, now: float, replaced: Optional[WorkerState] = None) -> None:
        """``replaced``: the process of the same name this one replaces, already taken out
        (``worker_lost(..., returning=True)``, as the server does after releasing its batches)."""
        # Too-big requests are failed only where a worker of the model registered before: a queue
        # that built up with no worker at all (starting) waits for each of them to register.
        if w.name in self.state.workers:
            # Same name registering again: the old process is gone (restart) or reconnected.
            replaced = self.worker_lost(w.name, "worker re-registered", now, returning=True)
        if replaced is not None:  # (its models too: one it no longer serves may leave requests too big)
            served = set(w.models) | set(replaced.models)
        else:
            served = {m for m in w.models if self.state.largest_batch.get(m, 0)}
        self._forget_breaker(w.name)
        self.hung.pop(w.name, None)
        self.leaving_workers.discard(w.name)
        w.last_seen = now
        self.state.add_worker(w)
        self.registrations += 1
        # A worker registering again with a smaller max batch may leave queued requests no worker
        # takes (worker_lost's check ran with none left, and passed): they waited for their deadline.
        for model in sorted(served):
            self._fail_too_big(model, f"worker {w.name} registered with a max batch of {w.models[model]}"
                               if model in w.models else f"worker {w.name} registered again without it")

    def heartbeat(self, name: str, now: float) -> bool:
        """False when the worker is unknown (declared dead): it must register again."""
        w = self.state.workers.get(name)
        if w is None:
            return False
        w.last_seen = now
        return True

    def check_liveness(self, now: float) -> list[tuple[WorkerState, str]]:
        """Declare lost the workers silent for longer than ``worker_dead_after_s``, and those
        holding a batch whose every request has ended, its last deadline that long ago. A worker
        heartbeats from a thread of its own: one whose batch never came back (a hung model, a
        bug) kept its slot for good, and every later request of the model was refused "cannot
        finish before its deadline". Lost, a silent worker is told to register again on its next
        heartbeat, a hung one to exit (``hung``)."""
        lost = []
        dead_before = now - self.worker_dead_after_s
        for w in list(self.state.workers.values()):
            if w.last_seen < dead_before:
                reason = f"no heartbeat for {now - w.last_seen:.1f} s"
                self.worker_lost(w.name, reason, now, may_run_on=True)
                lost.append((w, reason))
        # A worker runs its batches one after the other. A batch whose requests have all ended,
        # the last deadline worker_dead_after_s ago, shows its worker hung if it is the oldest out
        # (counted from when it could start), or if the oldest out is overdue itself (its curve's
        # time, OVERDUE_FACTOR times, plus worker_dead_after_s, from when it could start).
        # Judged alone, a batch whose requests expired queued in the worker behind a long one was
        # taken for hung: the healthy worker was made to exit, the long batch's requests run again
        # and failed UNAVAILABLE at its next loss. Judged only as the oldest, a worker whose first
        # batch hung holding a request of a 1-hour timeout was found an hour later.
        oldest: dict[str, Batch] = {}
        for b in self.batches.values():
            if b.worker.name not in oldest or b.sent_at < oldest[b.worker.name].sent_at:
                oldest[b.worker.name] = b
        for b in list(self.batches.values()):
            if self.batches.get(b.batch_id) is not b or any(r.state != DONE for r in b.requests):
                continue
            if b.worker.batch_bound_s and now - b.sent_at <= b.worker.batch_bound_s + self.worker_dead_after_s:
                continue  # (the worker answers it by then itself, whatever its backend does)
            last_deadline = max(r.deadline for r in b.requests)
            first = oldest[b.worker.name]
            # The oldest out could start when it was sent or when the batch ahead of it came back.
            started = max(first.sent_at, first.worker.done_at)
            if first is b:
                if max(last_deadline, started) >= dead_before:
                    continue
                since = ("its last request's deadline" if last_deadline >= started
                         else "the batch before it came back")
            else:
                curve = self.state.cost(first.model, first.worker.path)
                predicted = curve.predict(first.items)
                # (A curve that has learnt nothing yet predicts its prior: no time to be overdue by.
                # A model's first batch on a worker that hangs is then found at its own requests'
                # deadlines, as the oldest.)
                if (last_deadline >= dead_before or not curve.samples
                        or now - started <= OVERDUE_FACTOR * predicted + self.worker_dead_after_s):
                    continue
                since = (f"its last request's deadline, the batch ahead of it (predicted {predicted * 1e3:.1f} ms) "
                         f"running for {now - started:.1f} s")
            reason = (f"batch {b.batch_id} sent {now - b.sent_at:.1f} s ago never came back, "
                      f"{self.worker_dead_after_s:.1f} s past {since}")
            if self.worker_lost(b.worker.name, reason, now, may_run_on=True) is not None:
                lost.append((b.worker, reason))
                self.hung[b.worker.name] = reason
        return lost

    def undelivered(self, batch: Batch) -> None:
        """``batch`` never reached its worker: its requests go back to the head of their queues
        as they were (no retry spent, not suspect)."""
        if self.batches.pop(batch.batch_id, None) is None:
            return
        for req in reversed(batch.requests):
            if req.state == INFLIGHT:
                req.state = QUEUED
                self.state.queue(req.model).push_front(req)

    def worker_lost(self, name: str, reason: str, now: float, may_run_on: bool = False,
                    returning: bool = False) -> Optional[WorkerState]:
        """Fail over every batch the worker had: each request goes back to the head of its
        queue once if its deadline allows, otherwise it fails UNAVAILABLE. Nothing is left
        waiting on a worker that is gone. A request that goes back goes as a ``suspect``: it
        runs alone next (``policy_core.send``), so an input that kills the worker kills it once
        more alone, not the others of its batch again.

        ``may_run_on``: the worker is only silent or hung, and may still finish the batch. A
        request whose outputs go to its client's shared memory is then not run again: answered
        by another worker, its client took the region back, handed it out again, and the first
        worker, resumed, wrote its old output over the next request's result. It fails
        UNAVAILABLE in flight instead, its memory reserved (no release follows).

        ``returning``: the worker is registering again (``add_worker`` follows, and checks the
        queues against the max batches then): checked here, with it gone, a request only it could
        take (workers of different max batches) failed UNAVAILABLE as it came back, the one it was
        running too."""
        w = self.state.remove_worker(name)
        if w is None:
            return None
        self.departures += 1
        self._forget_breaker(name)
        self.leaving_workers.discard(name)
        # Newest batch and request first: each goes to the head of its queue, so the oldest ends
        # there first, in the order they came (they came back reversed).
        for b in reversed([b for b in self.batches.values() if b.worker is w]):
            del self.batches[b.batch_id]
            for req in reversed(b.requests):
                if req.state != INFLIGHT:
                    continue
                if req.retries < self.max_retries and req.deadline > now and not (may_run_on and req.writes_shm):
                    req.retries += 1
                    req.state = QUEUED
                    req.suspect = True
                    self.state.queue(req.model).push_front(req)
                else:
                    # A worker gone for sure touches no memory: answered as ended, no release to
                    # come (it was answered in flight, and the release promised never followed).
                    self.fail(req, Status.UNAVAILABLE, f"worker {name} failed while running the batch ({reason})",
                              batch_ended=not may_run_on)
        if not returning:
            for model in w.models:
                self._fail_too_big(model, f"worker {name} left ({reason})")
        return w

    def _fail_too_big(self, model: str, why: str) -> None:
        """Fail the queued requests of ``model`` more items than any worker left for it takes in a
        batch (workers may register different max batches): no batch can ever hold them."""
        largest = self.state.largest_batch.get(model, 0)
        q = self.state.queues.get(model)
        if not largest or q is None or q.items <= largest:
            return
        for req in [r for cls in q.by_priority for r in cls if r.items > largest]:
            q.remove(req)
            self.fail(req, Status.UNAVAILABLE, f"{req.items} items: more than any worker of {model!r} left takes in "
                      f"a batch ({largest}); {why}")

    # ------------------------------------------------------------------ status long polls
    def add_status_waiter(self, token: Any, min_registrations: int, expires: float, min_departures: int = 0,
                          owner: Any = None) -> bool:
        """Hold a status long poll. False (the caller answers it now) when ``owner`` (its
        connection) already holds ``MAX_STATUS_WAITERS`` of them."""
        if owner is not None:  # a poll to hold (the caller's fallback, owner None, is due at once)
            held = self._waiters_by_owner.get(owner, 0)
            if held >= MAX_STATUS_WAITERS or len(self.status_waiters) >= MAX_STATUS_WAITERS_NODE:
                return False
            self._waiters_by_owner[owner] = held + 1
        if self.registrations >= min_registrations and self.departures >= min_departures:
            expires = -math.inf  # due already
        heapq.heappush(self.status_waiters, (expires, next(self._seq), min_registrations, min_departures, token, owner))
        return True

    def due_status_waiters(self, now: float) -> list:
        """Tokens of the long polls to answer now: enough registrations and departures, or expired.
        Expiries come off a heap; the held polls are looked through only when a count moved (a
        scan at every step made every client slower under a crowd of held polls)."""
        heap = self.status_waiters
        due = []
        counts = (self.registrations, self.departures)
        if counts != self._waiters_seen:
            self._waiters_seen = counts
            keep = []
            for entry in heap:
                (due if counts[0] >= entry[2] and counts[1] >= entry[3] else keep).append(entry)
            heapq.heapify(keep)
            self.status_waiters = heap = keep
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap))
        for entry in due:
            owner = entry[5]
            if owner is not None:
                left = self._waiters_by_owner.pop(owner) - 1
                if left:
                    self._waiters_by_owner[owner] = left
        return [entry[4] for entry in due]

    # ------------------------------------------------------------------ shutdown
    @property
    def draining(self) -> bool:
        """Draining: no request is admitted any more (``SchedulerState.closed``, which the policies read)."""
        return self.state.closed

    def begin_drain(self) -> None:
        """Take no new request; those already taken are still decided on and dispatched as
        before (a retry included), as Triton serves what it accepted before it exits. Failing the
        queue at once answered 22 of 30 requests queued behind a 1 s batch UNAVAILABLE that the
        workers had time to serve. The driver ends the drain: once ``drained``, or at its
        timeout with ``fail_queued`` and ``fail_all``."""
        self.state.closed = True

    def drained(self) -> bool:
        """Nothing left to serve: no request queued or in flight, no batch out."""
        return not self.requests and not self.batches

    def unservable(self) -> bool:
        """No batch out, and no queued request that a worker (in rotation, or suspended, which
        comes back) takes whole: waiting cannot serve them. A drain whose workers were stopped
        with it (separate units, no ordering) held them until drain_timeout_s, and so did one
        request of more items than any worker's max batch. (Scans the queues: drains only.)"""
        if self.batches:
            return False
        for m, q in self.state.queues.items():
            if not q.requests:
                continue
            back = [w for (_, model), (_, w) in self.suspended.items() if model == m]
            largest = max((w.models.get(m, 0) for w in [*self.state.serving.get(m, ()), *back]), default=0)
            if any(r.items <= largest for dq in q.by_priority for r in dq):
                return False
        return True

    def fail_queued(self, status: Status, message: str) -> None:
        """Fail every request still waiting in a queue (those in a batch are left)."""
        for req in list(self.requests.values()):
            if req.state == QUEUED:
                self.state.queue(req.model).remove(req)
                self.fail(req, status, message)

    def fail_all(self, status: Status, message: str) -> None:
        for req in list(self.requests.values()):
            if req.state == QUEUED:
                self.state.queue(req.model).remove(req)
            self.fail(req, status, message)
        self.batches.clear()

    def pending_by_model(self) -> dict[str, int]:
        """Requests queued and not yet in a batch, per model: Triton's pending count, which a
        request leaves when its backend starts it (an autoscaler reads it as the backlog)."""
        return {m: q.requests for m, q in self.state.queues.items()}

    def in_flight_by_model(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.requests.values():
            if r.state == INFLIGHT:
                out[r.model] = out.get(r.model, 0) + 1
        return out
