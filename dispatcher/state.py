"""Scheduler state: what the policy sees. Pure data, no I/O, no clock.

The live dispatcher and the simulator both build this state and hand it to the same policy
objects. ``Request`` carries a few opaque I/O fields (``client``, ``frames``) that only the
live dispatcher fills; the policy never reads them.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from .cost_model import ArrivalRate, CostCurve

QUEUED, INFLIGHT, DONE = 0, 1, 2
N_PRIORITIES = 3
# A model whose curves learnt nothing for this long may admit one request they call hopeless
# (SchedulerState.probe_due).
PROBE_INTERVAL_S = 1.0


# _STEPS_FROM[c] = 1 + ... + c: a request asked at class a, now in class p, is due to leave it
# _STEPS_FROM[a] - _STEPS_FROM[p - 1] aging periods after its arrival (c periods in each class c).
_STEPS_FROM = (0, 1, 3)


class Request:
    __slots__ = ("seq", "model", "items", "priority", "asked_priority", "arrival", "deadline", "state",
                 "retries", "dispatched_at", "client", "req_id", "frames", "batch_id", "answered_in_flight",
                 "shm_files", "writes_shm", "suspect", "probe")

    def __init__(self, seq: int, model: str, items: int, priority: int, arrival: float,
                 deadline: float, client: Any = None, req_id: int = 0,
                 frames: Optional[list] = None):
        self.seq = seq
        self.model = model
        self.items = items
        self.priority = priority  # its class now: aging moves it up
        self.asked_priority = priority  # the class the client asked for, which metrics are labelled by
        self.arrival = arrival
        self.deadline = deadline
        self.state = QUEUED
        self.retries = 0
        self.dispatched_at = 0.0
        self.client = client
        self.req_id = req_id
        self.frames = frames  # [client header, *payload frames], forwarded to the worker untouched
        self.batch_id = -1
        # Failed while its batch ran: the worker may still touch its client's shared memory
        # until the batch ends, when the client gets a `release` (docs/protocol.md).
        self.answered_in_flight = False
        self.shm_files: Optional[dict] = None  # {segment: (st_dev, st_ino)} granted (shm_grants.py)
        self.writes_shm = False  # its outputs go to its client's shared memory (RequestCore.worker_lost)
        # Its batch's worker died while running it: it may be what killed it (policy_core.send).
        self.suspect = False
        # Admitted although the curves said it could not make its deadline (probe_due): it runs,
        # and what it measures corrects them; judged by its deadline alone.
        self.probe = False


class ModelQueue:
    """FIFO per priority for one model; counts queued requests and items."""

    __slots__ = ("model", "by_priority", "requests", "items", "class_items")

    def __init__(self, model: str):
        self.model = model
        self.by_priority = tuple(collections.deque() for _ in range(N_PRIORITIES))
        self.requests = 0
        self.items = 0
        self.class_items = [0] * N_PRIORITIES

    def push(self, req: Request) -> None:
        self.by_priority[req.priority].append(req)
        self.requests += 1
        self.items += req.items
        self.class_items[req.priority] += req.items

    def push_front(self, req: Request) -> None:
        """Put a request back at the head of its class (a retry after a worker died)."""
        self.by_priority[req.priority].appendleft(req)
        self.requests += 1
        self.items += req.items
        self.class_items[req.priority] += req.items

    def remove(self, req: Request) -> bool:
        try:
            self.by_priority[req.priority].remove(req)
        except ValueError:
            return False
        self.requests -= 1
        self.items -= req.items
        self.class_items[req.priority] -= req.items
        return True

    def pop_newest_below(self, priority: int) -> Optional[Request]:
        """The newest request of the lowest class below ``priority`` (a larger class number),
        out of the queue; None where every queued request is of ``priority`` or above."""
        for prio in range(N_PRIORITIES - 1, priority, -1):
            dq = self.by_priority[prio]
            if dq:
                req = dq.pop()
                self.requests -= 1
                self.items -= req.items
                self.class_items[prio] -= req.items
                return req
        return None

    def remove_many(self, reqs: list[Request]) -> None:
        """Remove ``reqs`` (all queued here): one pass over each class they are in, not a scan
        per request. A thousand requests expiring behind ten thousand patient ones of their class
        took 117 ms of the decision loop removed one by one."""
        if len(reqs) <= 4:  # the usual few, near the head: deque.remove stops early
            for req in reqs:
                self.remove(req)
            return
        gone = {id(r) for r in reqs}
        for prio in {r.priority for r in reqs}:
            dq = self.by_priority[prio]
            kept = [r for r in dq if id(r) not in gone]
            removed = [r for r in dq if id(r) in gone]
            dq.clear()
            dq.extend(kept)
            self.requests -= len(removed)
            n = sum(r.items for r in removed)
            self.items -= n
            self.class_items[prio] -= n

    def promote_aged(self, now: float, age_s: float, lead: float = 0.0, held: tuple = (False,) * N_PRIORITIES) -> int:
        """Aging: a request that waited ``age_s`` times its class in that class moves up one
        class, so a low request's wait is bounded however much high-priority work keeps arriving:
        a low one is normal after 2 ``age_s`` and high after 3, a normal one high after 1 (a class
        is looked at from its head: one behind a request not yet due waits for it, by less than
        ``age_s``). (Each step was measured from the arrival: a low request became high at its
        first look past 2 ``age_s``, with the normal class's wait spent in the low one.)

        Not a head with less than ``lead`` left before its deadline: it would cut the batch it
        goes first in to what still ends in time. Nor a request of a class its client asked for
        that ``held`` names (by class): that class is what overloads the node
        (``policy_core.class_held``), and moved up a low flood rose into the high class whole and
        every high request waited behind its backlog (SIMULATED, ``priority_padding --flood``: one worker at 20 ms + 10 ms an item,
        high at 5/s beside low at 120/s with 30 s timeouts: the high class's p99 12.4-14.1 s,
        51-59 ms alone)."""
        moved = 0
        for prio in (1, 2):
            q, up = self.by_priority[prio], self.by_priority[prio - 1]
            # The waits of the classes from the asked one down to this one, from the arrival.
            while (q and now - q[0].arrival >= age_s * (_STEPS_FROM[q[0].asked_priority] - _STEPS_FROM[prio - 1])
                   and q[0].deadline - now >= lead and not held[q[0].asked_priority]):
                req = q.popleft()
                req.priority = prio - 1
                up.append(req)
                self.class_items[prio] -= req.items
                self.class_items[prio - 1] += req.items
                moved += 1
        return moved

    def oldest_arrival(self) -> float:
        return min((q[0].arrival for q in self.by_priority if q), default=float("inf"))

    def take(self, max_items: int, newest_first: int = 0) -> list[Request]:
        """Pop up to ``max_items`` items, high priority first, FIFO within a class (newest first
        in each class whose bit ``1 << class`` is set in ``newest_first``). A request is never
        split; one bigger than what is left ends the batch."""
        out: list[Request] = []
        room = max_items
        for prio, q in enumerate(self.by_priority):
            newest = newest_first >> prio & 1
            while q and (q[-1] if newest else q[0]).items <= room:
                req = q.pop() if newest else q.popleft()
                room -= req.items
                self.class_items[prio] -= req.items
                out.append(req)
            if q:
                break  # the head of this class does not fit: keep priority order
        n = max_items - room
        self.requests -= len(out)
        self.items -= n
        return out

    def take_fitting(self, max_items: int, cap: int, max_requests: Optional[int] = None) -> list[Request]:
        """Like ``take`` (oldest first in each class), but passing over every request of more
        than ``cap`` items, which stay queued in their places: workers may register different max
        batches, and a request only a bigger worker takes must not hold up the ones behind it
        while that worker is busy and a smaller one is free. O(queue): only for that case."""
        out: list[Request] = []
        room = max_items
        limit = math.inf if max_requests is None else max_requests
        for prio, q in enumerate(self.by_priority):
            passed, full = [], False
            while q and not full:
                if q[0].items > cap:
                    passed.append(q.popleft())
                elif q[0].items <= room and len(out) < limit:
                    req = q.popleft()
                    room -= req.items
                    self.class_items[prio] -= req.items
                    out.append(req)
                else:
                    full = True  # one this worker takes is left: keep priority order
            q.extendleft(reversed(passed))
            if full:
                break
        n = max_items - room
        self.requests -= len(out)
        self.items -= n
        return out


def same_process(w, pid: int, identity: bytes, peer: str, started: str) -> bool:
    """Whether a registration comes from the process worker ``w`` (tensor or LLM; None: no
    worker of that name) registered as: its pid, routing identity, connection (``peer``) and start
    token (``Register.started``) all the same. Then it is a retry, whose batches run on; anything
    else is a restart. A restart with the old pid (pid 1 in a container) over tcp, where the peer
    is an address alone, was taken for a retry before the token."""
    return (w is not None and w.pid == pid and w.identity == identity and w.peer == peer
            and w.started == started)


@dataclass
class WorkerState:
    name: str
    path: str  # "cpu" | "gpu" (a simulated device says which one it stands in for)
    models: dict[str, int]  # model -> max batch (items) this worker accepts
    capacity: int = 1  # batches in flight at once
    inflight: int = 0
    busy_until: float = 0.0  # predicted instant its in-flight work completes
    done_at: float = 0.0  # when a batch of it last came back (its batches run one after the other)
    last_seen: float = 0.0
    pid: int = 0
    simulated: bool = False
    identity: bytes = b""
    peer: str = ""  # the kernel's credentials of the connection it registered on (transport.connection)
    started: str = ""  # its process's Register.started
    batch_bound_s: float = 0.0  # its Register.batch_bound_s: it answers a batch within this (0: no bound)

    @property
    def free(self) -> bool:
        return self.inflight < self.capacity


@dataclass
class SchedulerState:
    queues: dict[str, ModelQueue] = field(default_factory=dict)
    workers: dict[str, WorkerState] = field(default_factory=dict)
    # model -> workers serving it, in registration order (policy iteration order)
    serving: dict[str, list[WorkerState]] = field(default_factory=dict)
    # model -> the largest max batch of the workers registered for it, suspended ones included
    # (they come back): a request of more items than that can never go in a batch
    largest_batch: dict[str, int] = field(default_factory=dict)
    costs: dict[tuple[str, str], CostCurve] = field(default_factory=dict)  # (model, path) -> T(B)
    arrivals: dict[str, ArrivalRate] = field(default_factory=dict)  # model -> lambda(t)
    learned_at: dict[str, float] = field(default_factory=dict)  # model -> when a batch of it last taught a curve
    probed_at: dict[str, float] = field(default_factory=dict)  # model -> when probe_due last said yes
    size_probed_at: dict[str, float] = field(default_factory=dict)  # model -> when size_probe_due last said yes
    # model -> until when it counts as overloaded: a queued request of it expired (or was shed as
    # late) at most its own timeout ago (policy_core.congested)
    overloaded_until: dict[str, float] = field(default_factory=dict)
    # (model, class) whose requests aging keeps in place (policy_core.class_held)
    held_classes: set[tuple[str, int]] = field(default_factory=set)
    # (model, class) -> since when every look of class_overloads has said so
    overloaded_since: dict[tuple[str, int], float] = field(default_factory=dict)
    # No request is admitted any more (the dispatcher drains): no wait for an arrival pays, and a
    # policy that waited held the queue beside free workers until the drain ran out.
    closed: bool = False

    def expired(self, r: Request, now: float) -> None:
        """Queued request ``r`` ends unserved at ``now``, its deadline passed or out of reach."""
        until = now + (r.deadline - r.arrival)
        if until > self.overloaded_until.get(r.model, -math.inf):
            self.overloaded_until[r.model] = until

    def cost(self, model: str, path: str) -> CostCurve:
        c = self.costs.get((model, path))
        if c is None:
            c = self.costs[(model, path)] = CostCurve()
        return c

    def batch_cap(self, model: str, w: WorkerState, background: bool = False) -> int:
        """The most items to send ``w`` at once: its configured max batch, lowered to where the
        learned curve says bigger batches serve items more slowly (``CostCurve.efficient_batch``);
        for ``background`` work, to the shortest batch that keeps nearly all the throughput
        (``CostCurve.compact_batch``).

        While the max batch itself has no evidence yet (fewer than ``EFFICIENT_MIN_COUNT``
        batches of it) and a whole one is queued, the cap is the max: knots learned at moderate
        load stop short of it, and judged by extrapolation from a slow knot it never gets tried.
        Live on one EPYC core the cap kept a saturated MiniLM worker at B=15 with no knot at 32,
        where 32 served 47.8 items/s and 16 43.4 (bench/results/vs_triton_slo). A max batch that
        is slower per item costs a few batches once, then the knots cap it as before. Else, with
        a whole max batch queued, the cap is the curve's trial size when it names one
        (``CostCurve.trial_size``: a size the cap cannot see yet, which MCB then sends)."""
        max_b = w.models[model]
        curve = self.cost(model, w.path)
        cap = curve.efficient_batch(max_b)
        if background:
            return min(cap, curve.compact_batch(cap))
        q = self.queues.get(model)
        if q is None or q.items < max_b:
            return cap
        if cap < max_b and curve.unproven(max_b):
            return max_b
        return curve.trial_size(max_b) or cap  # saturated: learn what the cap cannot see

    def arrival(self, model: str) -> ArrivalRate:
        a = self.arrivals.get(model)
        if a is None:
            a = self.arrivals[model] = ArrivalRate()
        return a

    def note_arrival(self, model: str, priority: int, items: int, now: float) -> None:
        """Feed lambda(t): the model's total, the rate of classes above low (for reservation), the
        high class's and the low class's (for its padding, ``policy_mcb._low_padding``; and for
        aging, ``policy_core.class_held``)."""
        self.arrival(model).arrive(now, items)
        self.arrival(model + ("#urgent" if priority < 2 else "#low")).arrive(now, items)
        if priority == 0:
            self.arrival(model + "#high").arrive(now, items)

    def rate_of(self, model: str, key: str, now: float) -> float:
        """The arrival rate of ``model``'s items of a key of ``note_arrival`` ("#urgent", "#high",
        "#low"), items/s."""
        a = self.arrivals.get(model + key)
        return a.rate(now) if a is not None else 0.0

    def urgent_rate(self, model: str, now: float) -> float:
        """The rate of high and normal items that a reservation for them stands on: the arrival
        rate, capped by the silence since the latest (``ArrivalRate.rate_heard``)."""
        a = self.arrivals.get(model + "#urgent")
        return a.rate_heard(now) if a is not None else 0.0

    def low_rate(self, model: str, now: float) -> float:
        """The arrival rate of low-priority items (as asked: aging does not move them here)."""
        return self.rate_of(model, "#low", now)

    def urgent_lapse(self, model: str, target: float, now: float) -> float:
        """When, with no new high or normal arrival, ``urgent_rate`` falls to ``target``."""
        a = self.arrivals.get(model + "#urgent")
        return a.time_when_heard_rate_is(target, now) if a is not None else now

    def last_urgent(self, model: str) -> float:
        """When the latest high or normal request for ``model`` arrived (-inf: never)."""
        a = self.arrivals.get(model + "#urgent")
        return a.last if a is not None else -math.inf

    @staticmethod
    def start_time(w: WorkerState, now: float) -> float:
        """When ``w`` could start a batch sent now (after what it already has).

        A worker whose work has run past its predicted end (a curve not learned yet, a slow
        spell) is expected to run on for as long again as it has overrun so far, not to end this
        instant. Taken to end "now", it looked free at every look: at a node's start, with no
        profile, the CPU's first batch was predicted at the prior's 0.11 ms, ran 250 ms, and every
        request meanwhile waited for it beside a free GPU (`batchyard demo`: p99 207 ms, 7 ms
        past the first second). The estimate doubles the overrun at each look, so the requests
        held for such a worker go elsewhere once another is clearly sooner."""
        if w.inflight == 0:
            return now
        if w.busy_until >= now:
            return w.busy_until
        return now + (now - w.busy_until)

    def finish_time(self, w: WorkerState, model: str, items: int, now: float) -> float:
        """Predicted completion of ``items`` sent to ``w`` now (after what it already has)."""
        return self.start_time(w, now) + self.cost(model, w.path).predict(items)

    def on_dispatch(self, w: WorkerState, model: str, items: int, now: float) -> None:
        w.busy_until = self.start_time(w, now) + self.cost(model, w.path).predict(items)
        w.inflight += 1

    def on_complete(self, w: WorkerState, model: str, items: int, compute_s: Optional[float],
                    now: float) -> None:
        w.inflight -= 1
        if w.inflight == 0:
            w.busy_until = now
        if compute_s is not None:
            self.cost(model, w.path).observe(items, compute_s)
            self.learned_at[model] = now

    def probe_due(self, model: str, now: float) -> bool:
        """Whether a request of ``model`` that the curves say cannot make its deadline is admitted
        all the same, as a probe: once a PROBE_INTERVAL_S in which no batch of the model taught a
        curve. Refused on a prediction alone, nothing runs and nothing corrects the prediction: a
        slow spell learnt (a co-located job, a profile in ms read as s) refused every request with
        a shorter timeout until the dispatcher restarted. A probe that was right costs its worker
        one batch a PROBE_INTERVAL_S; the request fails DEADLINE_EXCEEDED as it would have."""
        last = max(self.learned_at.get(model, -math.inf), self.probed_at.get(model, -math.inf))
        if now - last < PROBE_INTERVAL_S:
            return False
        self.probed_at[model] = now
        return True

    def size_probe_due(self, model: str, items: int, now: float) -> bool:
        """Whether a request of ``model`` that the curves say cannot make its deadline is admitted
        all the same, as a probe, because its size was never measured: some path that takes it
        in one batch predicts it past the largest size it measured (a line through one size cannot
        tell launch from per-item time). Once a PROBE_INTERVAL_S, whatever other sizes teach the
        curves meanwhile (``probe_due`` waits for a second without learning, which steady traffic
        of small batches never leaves): with requests of one item always flowing, every request of
        64 items was refused on a line fitted at B=1 alone that predicted 197 ms against 69 ms
        (SIMULATED worker at 5 ms + 1 ms an item; an outside review). Once run, that size is
        measured, and the next request of it is judged on the measurement."""
        # (A curve with no knot at all is the default, or a line given whole, as the simulator's
        # calibration: nothing was measured live to extrapolate from, and probe_due covers it.)
        if not any(w.models[model] >= items and 0 < self.cost(model, w.path).largest_measured() < items
                   for w in self.serving.get(model, ())):
            return False
        if now - self.size_probed_at.get(model, -math.inf) < PROBE_INTERVAL_S:
            return False
        self.size_probed_at[model] = now
        return True

    def queue(self, model: str) -> ModelQueue:
        q = self.queues.get(model)
        if q is None:
            q = self.queues[model] = ModelQueue(model)
        return q

    def add_worker(self, w: WorkerState) -> None:
        self.remove_worker(w.name)
        self.workers[w.name] = w
        for m in w.models:
            self.serving.setdefault(m, []).append(w)
        self._note_largest_batch(w.models)

    def remove_worker(self, name: str) -> Optional[WorkerState]:
        w = self.workers.pop(name, None)
        if w is not None:
            for m in w.models:
                lst = self.serving.get(m, [])
                if w in lst:
                    lst.remove(w)
            self._note_largest_batch(w.models)
        return w

    def _note_largest_batch(self, models) -> None:
        for m in models:
            self.largest_batch[m] = max((x.models[m] for x in self.workers.values() if m in x.models), default=0)

    def suspend(self, w: WorkerState, models=None) -> None:
        """Out of rotation for ``models`` (None: all of its), still registered: the policy and
        admission no longer see it serve them."""
        for m in w.models if models is None else models:
            lst = self.serving.get(m, [])
            if w in lst:
                lst.remove(w)

    def resume(self, w: WorkerState, models=None) -> None:
        if self.workers.get(w.name) is w:
            for m in w.models if models is None else models:
                lst = self.serving.setdefault(m, [])
                if w not in lst:
                    lst.append(w)

    def queued_requests(self) -> int:
        return sum(q.requests for q in self.queues.values())
