"""Marginal Cost Batching (MCB): the default policy. The rule, step by step, is in
docs/policy.md ("MCB"); the numbered comments below are those steps.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from typing import Optional

from .deadline_index import DeadlineIndex
from .policy_baselines import wait_pays
from .policy_core import (LATE_MARGIN, SET_ASIDE_MAX, Decision, PerModelPolicy, ends_in_time, head_request,
                          queues_by_urgency, send, servers_for, shortest_full_batch)
from .state import ModelQueue, Request, SchedulerState, WorkerState

URGENT_RATE = 20.0  # req/s of high+normal traffic above which low-only batches leave workers free
RESERVE_BLOCKING = 0.01
# A reserved worker takes a deadline at stake while urgent and low arrivals together would keep it
# busy at most this share of the time (MarginalCost._lendable): far from a flood.
LEND_LOAD = 0.5
AMORTISES = 0.01  # T(1) above the next item's added time by more than this: a launch to amortise
# A launch-heavy batch whose launch is at most this share of its time has amortised it: see plan().
AMORTISED_SHARE = 0.05
# A queue (with its expected arrivals) above this many times the workers' max batches is a
# backlog: there, batches grow until full, for throughput (plan()).
BACKLOG_BATCHES = 2
FUTURE_ROUNDS = 4  # fixed-point steps for the arrivals expected while the plan runs
# Share of the lambda*H arrivals expected over the plan's horizon H that the plan counts beside
# the queue (step 3 in docs/policy.md says why it lies between 1/2 and 1, and how 0.6 was chosen).
FUTURE_SHARE = 0.6


class _Memo(dict):
    """T(B) of one curve by size, each size predicted once per plan (the plan asks for the same
    few). A dict whose ``__missing__`` predicts: a hit is a plain subscript, where a method call
    that looked the size up made a 64-item plan ~1.4x slower."""

    __slots__ = ("curve",)

    def __init__(self, curve):
        super().__init__()
        self.curve = curve

    def __missing__(self, b: int) -> float:
        t = self[b] = self.curve.predict(b)
        return t


def amortises_launch(curve, k: int = 1) -> bool:
    """Whether a batch of ``k`` on this curve has a launch worth amortising: ``T(1)`` above
    the next item's added time ``T(k+1) - T(k)`` by more than AMORTISES (the GPU; not a CPU
    whose time is linear through 0)."""
    return curve.predict(1) > (curve.predict(k + 1) - curve.predict(k)) * (1 + AMORTISES)


def added_item_cost(state: SchedulerState, model: str, w: WorkerState) -> float:
    """What one more item adds to a batch on ``w``: ``T(2) - T(1)``."""
    c = state.cost(model, w.path)
    return c.predict(2) - c.predict(1)


def adds_items_dearer(state: SchedulerState, model: str, w: WorkerState, batching: list[WorkerState]) -> bool:
    """Whether another of ``batching`` (the workers that amortise a launch) adds an item to its
    batch more cheaply than ``w`` does, ``T(2) - T(1)`` beyond AMORTISES (a CPU with a launch
    beside a GPU). Step 6b sizes such a worker's batch (``_share_before_next_launch``): the
    arrivals it leaves alone join the other's next batch. A worker with no launch (a CPU at T
    linear through 0) has no batch for them to join, so it is no peer: beside such CPUs, cheaper
    per added item than the GPU, sizing the GPU by them left it idle while a burst queued for the
    CPUs (SIMULATED, held-out seed 6, scenario 7 at 90 %: MCB's p50 0.294 ms against escape:1's 0.077)."""
    mine = added_item_cost(state, model, w)
    return any(mine > added_item_cost(state, model, x) * (1 + AMORTISES) for x in batching if x is not w)


def plan(state: SchedulerState, model: str, ws: list[WorkerState], n: int, now: float,
         background: bool = False) -> tuple[list, float]:
    """Plan ``n`` queued items over ``ws`` — free workers from now, busy ones from their
    predicted free time, each as a sequence of batches — to minimise the summed completion
    time of the items; return each worker's FIRST batch: [(finish, worker, items)], earliest
    finish first, workers given nothing left out.

    Greedy by marginal cost. Worker w's plan is batches back to back; its last batch holds k
    items and starts at s, so it finishes at ``F = s + T_w(k)``. One more item can
    - join that batch (if below max batch): the sum rises by ``(k+1)*(s + T_w(k+1)) - k*F``, or
    - open a new batch after it, where batches amortise nothing (``T_w(1) <=
      T_w(k+1) - T_w(k)``, within AMORTISES), or where the batch has amortised its launch
      already (at most AMORTISED_SHARE of ``T_w(k)``) and no backlog is planned (``n`` at most
      BACKLOG_BATCHES times the workers' max batches): the sum rises by ``F + T_w(1)``.
    Each item goes to the cheapest (worker, option). A worker with no launch cost (T linear
    through 0) thus serves one request at a time, back to back — a batch would only make its
    first request wait for its last — while a launch-heavy one gets one batch, grown while it
    is the cheapest place for the next item (a second batch behind it would be joined by new
    arrivals before it starts). A small launch (a CPU's 13 us beside 84 us an item) is
    amortised by a few items: past them, growing the batch only makes its first items wait for
    its last, as on a CPU without one; under a backlog, the launches saved are throughput the
    queue needs. At most ``sum of max batches`` items are planned.
    Also returns the plan's end: when every worker is done with its planned (or current) work.
    """
    return Planner(state, model, ws, now, background).plan(n)


class Planner:
    """``plan()`` of one state, worker list, instant and ``background``, for several ``n``: a
    decision pass plans the queue, then the queue with the arrivals expected before the GPU's
    next launch (step 6b), then with those expected over the plan's horizon (step 3, up to
    FUTURE_ROUNDS times, each more), and the state does not change between them. The greedy
    gives items one at a time, and what it offers a worker next depends on what that worker
    was given only, so the plan of ``n + e`` items is the plan of ``n`` continued for ``e``
    more: each call goes on from the last one. The one exception is ``backlog``, which depends
    on ``n``: a call on the other side of it, or for fewer items than planned already, starts
    over. Simulated at 50 % and 80 % of the seeds' load, 46 % and 64 % of the items a pass
    planned had been planned by an earlier call of the pass."""

    def __init__(self, state: SchedulerState, model: str, ws: list[WorkerState], now: float,
                 background: bool = False):
        self.state, self.model, self.ws, self.now, self.background = state, model, ws, now, background
        self.backlog: Optional[bool] = None  # (no plan yet)
        self._room: Optional[int] = None  # (the curves and caps are read at the first question: a
        # pass whose workers are all busy mostly asks none)

    def _read_state(self) -> None:
        state, model, ws = self.state, self.model, self.ws
        self.curve = [_Memo(state.cost(model, w.path)) for w in ws]
        self.cap = [state.batch_cap(model, w, self.background) for w in ws]
        self._room = sum(self.cap)
        self.start0 = [state.start_time(w, self.now) for w in ws]

    @property
    def room(self) -> int:
        """The most items a plan holds: the sum of the workers' batch caps."""
        if self._room is None:
            self._read_state()
        return self._room

    def _start(self, backlog: bool) -> None:
        m, now = len(self.ws), self.now
        self.backlog = backlog
        self.s = s = [t - now for t in self.start0]  # start of the last planned batch
        self.k = k = [0] * m  # items in the last planned batch
        self.fin = fin = list(s)  # its finish (== start while empty)
        self.first = [0] * m  # items in the first batch (frozen once a second one opens)
        self.opened = [False] * m
        self.given = 0
        curve, cap = self.curve, self.cap

        # A closure over the lists (changed in place, never replaced, until the next start): the
        # plan's inner loop, where a method reading them as attributes made it slower.
        def best(i: int) -> tuple[float, int, bool]:
            """The next item's cost on worker ``i``, ``i``, and whether it opens a batch there."""
            t, ki = curve[i], k[i]
            if ki == 0:
                return s[i] + t[1], i, False
            grow = t[ki + 1] - t[ki]
            new = fin[i] + t[1]
            if ki >= cap[i]:
                # Full: the next item's place here is the batch after it (a slow worker must not
                # look free of competition to a full GPU batch's overflow).
                return new, i, True
            join = (ki + 1) * (s[i] + t[ki + 1]) - ki * fin[i]
            # The batch behind may open where that is cheaper once this one has nothing left to
            # amortise: at once on a worker with no launch; for a launch, once it is at most
            # AMORTISED_SHARE of the batch's time, and not in a backlog. Before that, one batch,
            # grown (a second one would be joined by arrivals before it starts).
            # amortises_launch(curve[i], k[i]), inline: this is the plan's inner loop, and the call
            # alone made a 100-item plan 5 % slower (142 -> 150 us).
            launch = t[1] - grow
            opens = launch <= grow * AMORTISES or (
                not backlog and launch * (1 - AMORTISED_SHARE) <= AMORTISED_SHARE * grow * ki)
            return (new, i, True) if opens and new < join else (join, i, False)

        self.best = best
        self.heap = [best(i) for i in range(m) if cap[i] > 0]
        heapq.heapify(self.heap)
        self.top = heapq.heappop(self.heap) if self.heap else None

    def plan(self, n: int) -> tuple[list, float]:
        """``plan()`` of ``n`` items."""
        backlog = n > BACKLOG_BATCHES * self.room
        if backlog is not self.backlog or n < self.given:
            self._start(backlog)
        # Each worker has one entry, (cost, index, opens): ties in cost go to the lower index,
        # never to ``opens``. The entry popped is the one pushed: a worker's cost changes only
        # when it is given an item. heappushpop hands back the worker just given one, without
        # touching the heap, while it is still the cheapest: a CPU's run of single-item batches.
        top, heap, s, k, fin, first, opened, curve = (self.top, self.heap, self.s, self.k, self.fin, self.first,
                                                      self.opened, self.curve)
        best = self.best
        given = self.given
        for _ in range(min(n, self.room) - given):
            cost, i, opens = top
            if cost == math.inf:
                break
            if opens:
                opened[i] = True
                s[i], k[i] = fin[i], 0
            k[i] += 1
            fin[i] = s[i] + curve[i][k[i]]
            if not opened[i]:
                first[i] = k[i]
            top = heapq.heappushpop(heap, best(i))
            given += 1
        self.top, self.given = top, given
        start0, ws = self.start0, self.ws
        chunks = [(start0[i] + curve[i][first[i]], ws[i], first[i]) for i in range(len(ws)) if first[i]]
        chunks.sort(key=lambda c: c[0])
        return chunks, self.now + max(fin, default=0.0)


def send_behind(state: SchedulerState, d: Decision, w: WorkerState, q: ModelQueue, items: int, held: int,
                now: float) -> list:
    """``send`` the ``items`` queued behind the first ``held`` ones, which stay at the head."""
    kept = q.take(held) if held else []
    try:
        return send(state, d, w, q, items, now)
    finally:
        for r in reversed(kept):
            q.push_front(r)


def wait_saving(state: SchedulerState, model: str, w: WorkerState, ws: list[WorkerState], chunks: list, q: int,
                lam: float, now: float) -> tuple[float, float]:
    """What waiting for the next arrival saves in summed latency, against sending ``w`` its ``q``
    items now, and the break-even gap: the expected gap to that arrival below which the saving
    exceeds the wait's cost, ``q`` times the gap. Returns (saving, break-even gap).

    The arrival is expected at ``a = now + g``, ``g = 1/lambda``. Waiting, the ``q`` items and it
    leave together at ``a + T(q+1)``: the arrival's latency is ``T(q+1)``, and each item finishes
    ``T(q+1) - T(q)`` later for the batch's growth (beside the wait itself). Sent now, the
    arrival takes its best other route x: the worker that, free at ``F_x`` (its first batch of the
    plan ``chunks`` done, else its start time), finishes it alone soonest, ``max(F_x - a, 0) +
    T_x(1)`` — ``w`` itself after this batch among them. The saving is that route's latency minus
    ``T(q+1)`` minus the items' growth. So a free GPU does not hold a lone request for company while
    a CPU frees soon after the next arrival (or is free by then: that route costs only its T(1));
    with no other route it waits while the arrival would otherwise queue behind this batch and
    run alone.

    The saving shrinks as ``g`` grows (routes busy past ``a`` come closer), so the break-even gap
    is the smallest over routes of the root of ``max(D_x - g, 0) + T_x(1) - K = q·g``
    (``D_x = F_x - now``, ``K`` = ``T(q+1)`` + the growth): exact, where ``saving / q`` would
    overstate it and wake the dispatcher late."""
    if lam <= 0:
        return 0.0, 0.0  # no arrival expected: nothing to wait for
    curve = state.cost(model, w.path)
    tq, tq1 = curve.predict(q), curve.predict(q + 1)
    k = tq1 + q * (tq1 - tq)
    g = 1.0 / lam
    routes = [(tq, curve.predict(1))]  # (D_x, T_x(1)); w itself is free again after the batch sent now
    planned = {id(x): finish for finish, x, _ in chunks}
    routes += [(planned.get(id(x), state.start_time(x, now)) - now, state.cost(model, x.path).predict(1))
               for x in ws if x is not w]
    saving = min(max(d - g, 0.0) + t1 for d, t1 in routes) - k
    gap = min((d + t1 - k) / (q + 1) if d + t1 - k <= (q + 1) * d else (t1 - k) / q for d, t1 in routes)
    return saving, gap


def _share_before_next_launch(state: SchedulerState, model: str, planner: Planner, batching: list[WorkerState],
                              b: int, chunks: list, lam: float, now: float) -> dict:
    """Each worker's first batch (by id) in a plan of the ``b`` queued items plus the
    arrivals expected before the worker of ``batching`` that adds items most cheaply (the GPU)
    can start its next batch: ``lambda * (its start - now)``, none while it is free. ``chunks``
    is the plan of the queue alone, reused when no arrival is expected; ``planner`` plans over
    the pass's workers. (Step 6b.)"""
    cheapest = min(batching, key=lambda x: added_item_cost(state, model, x))
    joining = int(lam * (state.start_time(cheapest, now) - now))
    if joining > 0:
        chunks, _ = planner.plan(b + joining)
    return {id(w): items for _, w, items in chunks}


def _served_by_the_others(state: SchedulerState, model: str, ws: list[WorkerState], w: WorkerState,
                          head_items: int, until: float, now: float) -> int:
    """How many queued items the busy eligible workers other than ``w`` (those sent a batch
    this pass among them) end by ``until``, taking them FIFO from their predicted free time in
    batches of their cap, a worker with no launch one request after another: what a
    launch-heavy worker's batch leaves at the head (steps 6a and 7). A free worker is not
    counted: the pass may send it nothing (6b sizes some to none), and the head left for it
    waited beside it; nor is one whose max batch is below the head request's items."""
    n = 0
    for x in ws:
        if x is w or x.free or x.models[model] < head_items:
            continue
        t = until - state.start_time(x, now)
        if t <= 0:
            continue
        curve = state.cost(model, x.path)
        cap = state.batch_cap(model, x)
        if not amortises_launch(curve):
            n += int(t / curve.predict(1))
            continue
        full = curve.predict(cap)
        n += cap * int(t / full)
        # and the largest batch that still ends in the time left
        n += bisect.bisect_right(range(1, cap + 1), t - full * int(t / full), key=curve.predict)
    return n


def _head_items(q: ModelQueue) -> int:
    """The head request's items (1 for an empty queue: requests shed as late leave this pass's
    count above what is queued)."""
    head = head_request(q)
    return head.items if head else 1


def _beyond_the_others(state: SchedulerState, model: str, ws: list[WorkerState], w: WorkerState, items: int,
                       head_items: int, cap: int, now: float) -> int:
    """The largest batch ``q`` of ``w`` (at most ``cap`` and ``items``) such that the other
    eligible workers, serving the head of the ``items`` queued in order, have not reached the
    ``q`` at the back when it ends (step 6a): ``q`` + what they end by ``now + T_w(q)`` ≤ ``items``."""
    curve = state.cost(model, w.path)
    return bisect.bisect_right(
        range(1, min(cap, items) + 1), items,
        key=lambda q: q + _served_by_the_others(state, model, ws, w, head_items, now + curve.predict(q), now))


def _due(state: SchedulerState, model: str, w: WorkerState, items: int, now: float) -> float:
    """When to look again at items waiting for busy ``w``: when it is expected to free (for an
    overdue worker, once its overrun has doubled: ``SchedulerState.start_time``), else after the
    time their batch would take (never ``now``: that would spin the live timer)."""
    t = state.start_time(w, now)
    return t if t > now else now + state.cost(model, w.path).predict(items)


# Low items may pad an urgent batch by this share of its time (step 2): on the seeds' GPU
# (0.15 ms + 0.02 ms an item) one low item joins three urgent ones, on a CPU without a launch
# none; the priority flood's high class moved by 0.03 % (SIMULATED, sim_report).
PAD_SHARE = 0.1

# A slack below this is none: at the wake-up set for it to run out, rounding left ~1e-16 s of it
# and the pass waited again, for a wake-up at that same instant.
SLACK_RESOLUTION_S = 1e-6


def _low_padding(state: SchedulerState, model: str, q: ModelQueue, ws: list[WorkerState], urgent: int, low: int,
                 now: float) -> int:
    """How many of the ``low`` queued low items may join ``urgent`` urgent items' batch on the
    free workers of ``ws``: as many as keep that batch within PAD_SHARE of its time without
    them on each (the fewest any free worker allows: the plan may put them on any of them; by
    the most, a free GPU's launch allowed 30 low items that went in a CPU's batch beside a high
    request, 3 times its time). On a launch-heavy worker they ride almost free;
    kept apart, its launches went to urgent-only batches and the low class waited for aging
    (SIMULATED, one worker at 20 ms + 1 ms an item, 120 req/s of 20/60/20 % high/normal/low:
    low p50 194 ms, p99 492 ms; greedy's 35 / 51 ms, the urgent classes' the same in both).

    Where the low class must be kept up with (``_keep_up_rate``), at least as many as arrive
    while the batch runs: the fewest ``k`` with ``k >= lambda_low * T(u + k)``, if the worker
    has such a ``k`` within its cap at most KEEP_UP_SHARE above the batch's time without them.
    The share alone served fewer low items than arrived whenever urgent work kept every worker
    busy, and the low class waited for aging. A low stream kept up with only by batches more
    than KEEP_UP_SHARE longer (a flood) keeps the share alone: the urgent batch comes first."""
    keep_up = _keep_up_rate(state, model, q, now)
    fewest = None
    for w in ws:
        if not w.free:
            continue
        curve, cap = state.cost(model, w.path), w.models[model]
        u = min(urgent, cap)
        limit = (1 + PAD_SHARE) * curve.predict(u)
        k = 0
        while k < low and u + k < cap and curve.predict(u + k + 1) <= limit:
            k += 1
        if keep_up > 0 and k < keep_up * curve.predict(u + k):
            n, bound = k, (1 + KEEP_UP_SHARE) * curve.predict(u)
            while n < cap - u and n < keep_up * curve.predict(u + n) and curve.predict(u + n + 1) <= bound:
                n += 1
            if n >= keep_up * curve.predict(u + n):  # a fixed point within the bounds: it keeps up
                k = min(n, low)
        fewest = k if fewest is None else min(fewest, k)
    return fewest or 0


# The low class is kept up with (_low_padding) at a cost to an urgent batch of at most this share of its time.
KEEP_UP_SHARE = 1.0


def _keep_up_rate(state: SchedulerState, model: str, q: ModelQueue, now: float) -> float:
    """The rate of low arrivals an urgent batch's padding keeps up with (0: the share alone).
    Beside normal work, while any is queued, the low class's arrival rate, or the rate its queue
    shows (its items over its head's wait) where that is higher. Beside high work
    (latency-critical by its name), only once the low class falls behind: its oldest queued
    request has waited longer than the shortest full batch of a worker of the model, longer
    than any batching delay explains. Normal work padded by the share alone starved a light
    low stream: SIMULATED (``priority_padding --beside-every-cpu``), the seeds' curves x 1000,
    40 normal requests/s and 6 low, the urgent stream taking every CPU (step 1): low p99
    3.97-5.67 s, the aging period being 11.4 s (8 full GPU batches), escape:2's 0.72-0.98 s. High work is padded no more where the low class keeps
    up otherwise (idle workers between high arrivals): SIMULATED, the report's devices, high at
    30 % of the GPU's capacity beside low at 20 % of the node's, padded at the low rate the
    high class's p99 rose from 0.235 to 0.260 ms."""
    low = q.by_priority[2]
    if not low:
        return 0.0
    waited = now - low[0].arrival
    if q.class_items[0] and waited <= shortest_full_batch(state, model):
        return 0.0
    # The rate the queue itself shows, where it is higher: the low items queued came within the
    # head's wait. The decaying estimate alone dips now and then below a flood's rate: where the
    # bound keeps up with 25/s, a 27/s flood beside high work was padded 71-85 times in 120 s,
    # at estimates up to 24.7/s, the high class's p99 1.39-1.62 -> 1.61-1.94 s for nothing (its
    # low p99 stayed 24 s, aging's) (SIMULATED, one GPU 0.15 s + 0.02 s an item).
    return max(state.low_rate(model, now), q.class_items[2] / waited if waited > 0 else 0.0)


class MarginalCost(PerModelPolicy):
    """Marginal Cost Batching: plan the queue over every worker at once, send the free
    workers' shares now unless waiting for one more arrival pays, flush before a deadline."""

    name = "mcb"

    def __init__(self):
        self._deadlines: dict[str, DeadlineIndex] = {}

    def decide(self, state: SchedulerState, now: float) -> Decision:
        d = Decision()
        for model, q in state.queues.items():
            idx = self._deadlines.get(model)
            if q.requests:
                if idx is None or idx.queue is not q:
                    idx = self._deadlines[model] = DeadlineIndex(q)
                idx.sync()  # before aging moves requests between classes
            elif idx is not None and idx.queue is q:
                idx.sync()  # empty: forgets every request it held (and their payloads)
        for model, q, aging in queues_by_urgency(state, now, lambda m: self._deadlines[m].tightest(now)):
            self.decide_model(state, model, q, now, d, aging)
        return d

    def decide_model(self, state: SchedulerState, model: str, q: ModelQueue, now: float, d: Decision,
                     aging: float) -> None:
        """``q`` aged already, by ``aging`` (``queues_by_urgency``)."""
        all_ws = state.serving.get(model)
        if not all_ws:
            return
        idx = self._deadlines[model]
        waited = False
        while q.requests:
            # 1. Eligible workers (reservation for urgent traffic).
            ws = self._eligible(state, model, q, all_ws, now, d)
            # 2. Urgent items go out on their own: padding their batch with low items would
            #    make them wait for the low items' compute — but for the low items that cost
            #    them at most PAD_SHARE of their batch's time (a launch-heavy worker's).
            urgent = q.class_items[0] + q.class_items[1]
            b = q.items
            if 0 < urgent < q.items:
                b = urgent + _low_padding(state, model, q, ws, urgent, q.items - urgent, now)
            # 2b. Low-only work is background while urgent requests have arrived within the aging
            #     period (the horizon over which classes are kept apart at all): its batches are
            #     kept short (compact_batch), since an urgent arrival waits for the one running.
            background = urgent == 0 and now - state.last_urgent(model) <= aging
            planner = Planner(state, model, ws, now, background)  # the plans of this pass over ws
            if not any(w.free for w in ws) and not self._deadline_may_borrow(state, model, q, all_ws, ws, b, idx,
                                                                             now, d, background, planner):
                # Nothing can be sent; the queue waits for a completion, which decides again
                # (the plan would only say which busy worker each item waits for). No wake-up:
                # one at a busy worker's predicted end found it still busy, and so did the ones
                # its doubling overrun set after it (SchedulerState.start_time): live on one
                # core at 70 req/s, the dispatcher woke 2.3 times a request and re-armed its
                # timer 1.4 times; without them, 1.5 and 0.07. A worker that never answers is
                # the heartbeats' to find, a suspended one's return and a deadline are
                # RequestCore.next_wake's, and a reservation's lapse is _eligible's wake-up.
                return
            # 3. Plan the b items over free and busy workers, together with the requests
            #    expected to arrive (rate lambda) before the planned work is done: they will
            #    need the same workers, so the plan must not spend every worker's next slots
            #    on the queue alone. The plan treats its items as present from now, while the
            #    lambda*H arrivals of the horizon H = plan end - now come spread over it (on
            #    average over H, half of them have arrived): counting all of them gives them
            #    the queue's claim on the first slots, counting half leaves the queue's head
            #    waiting for busy CPUs about to free while a free GPU could take it. The plan
            #    counts FUTURE_SHARE * lambda*H. H and the count feed each other; a few rounds
            #    reach the fixed point (or stop when it stops growing).
            chunks, end = planner.plan(b)
            own_finish = max(c[0] for c in chunks) if chunks else now
            lam = 0.0 if state.closed else state.arrival(model).rate(now)  # a drain admits none
            # The workers that amortise a launch (steps 6a and 6b); the free ones 6b sizes, and
            # their shares, planned before anything is sent (a send makes the GPU busy) and only
            # where such a worker is free.
            batching = [w for w in ws if amortises_launch(state.cost(model, w.path))]
            sized = {id(w) for w in batching if w.free and adds_items_dearer(state, model, w, batching)}
            share = _share_before_next_launch(state, model, planner, batching, b, chunks, lam, now) if sized else {}
            extra = 0
            room = planner.room  # a plan never holds more than this
            for _ in range(FUTURE_ROUNDS):
                expected = int(FUTURE_SHARE * lam * (end - now))
                if expected <= extra or b + extra >= room:
                    break
                extra = expected
                chunks, end = planner.plan(b + extra)
            # 4. Deadlines: if the plan of the queue alone would finish after the tightest
            #    deadline, flush: plan over the free workers only and send without waiting.
            # The finish is a prediction and a batch runs up to LATE_MARGIN longer than its curve
            # says: the slack keeps that share of the plan's time. A wait that spent the whole
            # slack sent its batch predicted to end at the deadline itself, and it ended just
            # after it (live: a lone 400 ms request with a 500 ms timeout, the idle worker
            # waiting for arrivals that would share its launch, failed DEADLINE_EXCEEDED at
            # 500.1 ms, where sent at once it was served in 400 ms).
            slack = idx.tightest(now) - own_finish - LATE_MARGIN * (own_finish - now)
            flush = slack <= SLACK_RESOLUTION_S
            if flush:
                d.count("flushed")
                # A deadline at stake may borrow a worker step 1 keeps free for urgent arrivals
                # where that costs them what the reservation allows anyway (_lendable): low
                # requests planned on the other workers alone were failed late beside the
                # reserved worker, idle, that would have served them.
                ws = ws + self._lendable(state, model, q, all_ws, ws, b, now, background, idx.tightest_request(now))
                chunks, _ = plan(state, model, [w for w in ws if w.free], b, now, background)
                if sized:
                    share = {id(w): items for _, w, items in chunks}
            sent = False
            left = b  # this pass sends the b items only: the plan's shares include expected arrivals
            held = 0  # head items planned for busy workers that finish them before this one
            takers = chunks  # the plan's workers this pass may send to (8b)
            for finish, w, items in chunks:  # earliest finish first: it gets the FIFO head
                if not w.free:
                    # 5. Items planned for a busy worker wait for it; its completion (or, if
                    #    it is overdue, a look after its batch time) decides again. They are
                    #    the oldest ones: its batch finishes before the free workers' below.
                    d.wake_at = min(d.wake_at, _due(state, model, w, items, now))
                    held += items
                    continue
                queued = min(items, left)
                cap = state.batch_cap(model, w, background)
                behind_the_others = False  # step 6a's worker: step 7 takes its items from behind theirs
                if id(w) in sized:
                    # 6b. A launch-heavy worker that is not the cheapest place for added
                    #     items (a CPU with a launch beside a GPU) takes at most its first
                    #     batch in a plan of the queue and the arrivals expected before the
                    #     cheapest worker (the GPU) can start its next batch: those join
                    #     that batch, so the CPU leaves them the room they take there.
                    #     Arrivals after it starts find the CPU free again: counting them
                    #     too (step 3's plan) makes this batch, which leaves now, wait for
                    #     compute planned for requests that will not share it; counting
                    #     none leaves the CPU taking too little while the GPU is busy.
                    queued = min(queued, share.get(id(w), 0))
                    if queued <= 0:
                        takers = [c for c in takers if c[1] is not w]
                        continue
                elif w in batching:
                    # 6a. A launch-heavy worker also takes the items the other workers will
                    #     not have reached, serving the head in order, by the time its batch
                    #     ends (up to its cap): those would otherwise wait for a later
                    #     decision, and under a burst its next launch is the bottleneck. The
                    #     items the others end first are theirs: taken too (all that no other
                    #     worker's first batch held, as before 2026-12-02), they made its batch
                    #     long while later arrivals were served before them.
                    queued = max(queued, _beyond_the_others(state, model, ws, w, left, _head_items(q), cap, now))
                    behind_the_others = True
                if queued <= 0:
                    break
                if not flush and queued < cap:
                    # 6. The marginal rule: wait while one more arrival saves more than the
                    #    wait costs the queued items w would take.
                    saving, gap = wait_saving(state, model, w, ws, chunks, queued, lam, now)
                    pays, t_flip = wait_pays(state, model, queued, saving, now, ski_rental=True, break_even_gap=gap)
                    if pays:
                        if not waited:
                            d.count("waited")
                            waited = True
                        d.wake_at = min(d.wake_at, t_flip, now + slack)
                        continue
                # 7a. With a backlog (a max batch of w's queued beyond this pass's held head),
                #     send a size the curve must measure, whatever the plan's own predictions
                #     say: one the batch cap cannot see yet (CostCurve.trial_size, which
                #     batch_cap already made the cap), or, for a fit fed by one batch size alone
                #     for STALE_SAMPLES (its slope rests on stale knots), one of those sizes.
                if left - held >= w.models[model]:
                    curve = state.cost(model, w.path)
                    trial = 0 if background else min(curve.trial_size(w.models[model]), cap)
                    queued = max(queued, trial or curve.probe_size(min(cap, left - held)))
                # 7. Send now, past the held head.
                keep = min(held, left - queued)
                if behind_the_others:
                    # A launch-heavy worker's batch ends after the others have served the
                    # queue's head one by one: it takes the items they will not have reached
                    # by then, and leaves them the ones they end first. Taken from behind the
                    # held head only, its oldest items waited for its batch while later
                    # arrivals were served before them by the others; which items go where
                    # leaves every finish time, and so the mean, as it was, and the order
                    # serves the tail. The items lifted off are at most SET_ASIDE_MAX, which
                    # bounds the decision's cost under a deep backlog.
                    ends = now + state.cost(model, w.path).predict(queued)
                    ahead = _served_by_the_others(state, model, ws, w, _head_items(q), ends, now)
                    reqs = send_behind(state, d, w, q, queued, max(keep, min(left - queued, ahead, SET_ASIDE_MAX)), now)
                    if not reqs:
                        # Nothing behind them it could take (too big, or shed as late): the
                        # head is not left to the others on that account.
                        reqs = send_behind(state, d, w, q, queued, keep, now)
                else:
                    reqs = send_behind(state, d, w, q, queued, keep, now)
                left -= sum(r.items for r in reqs)
                idx.discard(reqs)
                idx.discard([r for r, _ in d.late])
                sent = sent or bool(reqs)
            if not sent and not self._send_head_alone(state, model, q, ws, takers, idx, now, d, background):
                return  # 8. what is left waits: on a busy worker or on the marginal rule

    @staticmethod
    def _send_head_alone(state: SchedulerState, model: str, q: ModelQueue, ws: list[WorkerState], chunks: list,
                         idx: DeadlineIndex, now: float, d: Decision, background: bool = False) -> bool:
        """8b. The plan splits items freely; requests are whole. A head request of more items than
        the max batch of every worker the plan gave work to (a GPU of max batch 2 beside a CPU of 8,
        and 3 items) is taken by none of them: it goes alone to the free worker that takes it and
        finishes it soonest (it waited beside that worker until its deadline). False if none is
        free, or the plan has a worker for it: ``chunks`` are the plan's workers the pass may
        send to (a GPU step 6b left no share is none: counted, a head only the GPUs take waited
        beside them, idle, with no wake-up, until its deadline). A plan's worker that takes the
        head but does not end it by its deadline (as fit_deadlines reads it) counts as none: the
        plan's items split where the request cannot (two lone items in time on a CPU whose T(2)
        is more than 2 T(1)), the CPU's send set the whole request aside for the GPU that ends
        it in time, the plan gave the GPU nothing, and the request waited beside it, idle, with
        no wake-up, until it failed (an outside review's fuzzing)."""
        head = head_request(q)
        if head is None or any(x.models[model] >= head.items and ends_in_time(state, x, model, head, now)
                               for _, x, _ in chunks):
            return False
        fits = [x for x in ws if x.free and x.models[model] >= head.items]
        if not fits:
            return MarginalCost._send_past_the_head(state, model, q, ws, idx, now, d, background)
        x = min(fits, key=lambda x: state.start_time(x, now) + state.cost(model, x.path).predict(head.items))
        return MarginalCost._send_to(state, model, q, x, head.items, idx, now, d)

    @staticmethod
    def _send_to(state: SchedulerState, model: str, q: ModelQueue, x: WorkerState, items: int,
                 idx: DeadlineIndex, now: float, d: Decision) -> bool:
        late = len(d.late)
        reqs = send(state, d, x, q, items, now)
        idx.discard(reqs)
        idx.discard([r for r, _ in d.late])
        return bool(reqs) or len(d.late) > late  # else the pass would plan the same again

    @staticmethod
    def _send_past_the_head(state: SchedulerState, model: str, q: ModelQueue, ws: list[WorkerState],
                            idx: DeadlineIndex, now: float, d: Decision, background: bool) -> bool:
        """8c. A head no free worker takes (only a busy one does, or one out of rotation: leaving,
        suspended) does not hold back the requests behind it that a free one takes: set aside, the
        first of those goes, with what follows it that fits, to the free worker that takes it and
        finishes it soonest, in a batch of at most that worker's cap, and of urgent requests alone
        while any is queued (step 2). Behind a 3-item head only a leaving worker took, a 2-item
        request waited its whole timeout beside a free GPU of max batch 2 (the plan gave every item
        to a free CPU of max batch 1, which took neither); greedy and escape:K sent it at once.
        The first such request is found by a scan that moves nothing (at most SET_ASIDE_MAX
        requests): moving a thousand big heads aside and back at every decision, only to find
        none behind them, cost ~0.4 ms a decision."""
        free = [x for x in ws if x.free]
        biggest = max((x.models[model] for x in free), default=0)
        in_order = itertools.islice(itertools.chain.from_iterable(q.by_priority), SET_ASIDE_MAX + 1)
        ahead, r = next(((i, r) for i, r in enumerate(in_order) if r.items <= biggest), (0, None))
        if r is None:
            return False  # what is queued waits for a busy worker, whose completion decides again
        aside = []
        try:
            for _ in range(ahead):
                big = head_request(q)
                q.remove(big)
                aside.append(big)
            x = min((x for x in free if x.models[model] >= r.items),
                    key=lambda x: state.start_time(x, now) + state.cost(model, x.path).predict(r.items))
            items = min(state.batch_cap(model, x, background), x.models[model])
            urgent = q.class_items[0] + q.class_items[1]
            if 0 < urgent < q.items:
                items = min(items, urgent)  # urgent work is never padded with low work (step 2)
            return MarginalCost._send_to(state, model, q, x, max(items, r.items), idx, now, d)
        finally:
            for big in reversed(aside):
                q.push_front(big)

    @staticmethod
    def _deadline_may_borrow(state: SchedulerState, model: str, q: ModelQueue, all_ws: list[WorkerState],
                             ws: list[WorkerState], b: int, idx: DeadlineIndex, now: float, d: Decision,
                             background: bool, planner: Planner) -> bool:
        """With every eligible worker busy: whether the tightest deadline is at stake beside a free
        worker the reservation keeps that step 4 may borrow (``_lendable``), so the pass goes on to
        flush. Not yet at stake: a wake-up when it will be. (The pass used to end here, before step
        4: low requests with a deadline failed late beside the idle reserved worker whenever the
        GPU was busy.) ``planner``: the pass's, over ``ws``."""
        if not MarginalCost._lendable(state, model, q, all_ws, ws, b, now, background, idx.tightest_request(now)):
            return False  # (at once where nothing is reserved)
        tightest = idx.tightest(now)
        if tightest == math.inf:
            return False
        # Far off (after every busy worker's start plus a full batch's time, which bounds any
        # first batch of the plan): a wake-up then, before which it cannot come to be at stake,
        # without the plan (with a big queue, it made such a decision cost 15 times as much).
        longest = max(state.cost(model, w.path).predict(state.batch_cap(model, w, background)) for w in ws)
        if tightest > max(state.start_time(w, now) for w in ws) + longest:
            d.wake_at = min(d.wake_at, tightest - longest)
            return False
        chunks, _ = planner.plan(b)
        if not chunks:
            return False
        if tightest <= max(c[0] for c in chunks):
            return True
        # The busy workers' plan ends in time; it stops doing so once they are still busy when
        # its longest first batch must start to end by the deadline (> now: that batch starts
        # at now at the earliest, and ends before the deadline).
        d.wake_at = min(d.wake_at, tightest - max(f - state.start_time(w, now) for f, w, _ in chunks))
        return False

    @staticmethod
    def _lendable(state: SchedulerState, model: str, q: ModelQueue, all_ws: list[WorkerState],
                  ws: list[WorkerState], b: int, now: float, background: bool,
                  tightest: Optional[Request] = None) -> list[WorkerState]:
        """Of the free workers ``_eligible`` keeps for urgent arrivals, those a batch of up to ``b``
        items holds for so short a time that an urgent arrival meets it with probability at most
        RESERVE_BLOCKING (urgent rate x its batch time): what the reservation already accepts. A
        flood's low work (its batches on a CPU meet 16 % of a 2,000/s urgent stream) still leaves
        them alone; 60 urgent requests/s beside 0.1 ms batches (0.6 %) lend them. The batch is
        judged at least as big as the head request, which step 8b sends whole past a smaller cap
        (a 3-item request went where one item was judged).

        And, whatever the blocking, where a deadline is at stake (the callers' to judge), the ones
        that can still end ``tightest`` (the request of the queue's tightest deadline) in time,
        where no eligible worker could have ended it had it started at its arrival, or while they
        are lightly loaded: the urgent and the low arrivals together would keep one busy at most
        LEND_LOAD of the time (as if all of them went there). That request fails unless one of
        them takes it. Kept for urgent arrivals, 167 of 168 low requests
        of 15 ms timeouts failed beside a CPU (6 ms a request) busy 20 % of the time, the GPU left
        to them taking 20 ms; and 77 of 201 of 25 ms, waiting for the GPU (SIMULATED devices; an
        outside review). A flood's low requests still leave the reserved ones alone: lent to
        those about to expire, the flood took the high class's p99 from 1.00 to 2.14 times its
        own (sim_report)."""
        if len(ws) == len(all_ws):
            return []
        lam_u = state.urgent_rate(model, now)
        head = head_request(q)
        least = head.items if head is not None else 1
        arriving = lam_u + state.low_rate(model, now)
        # No eligible worker could have ended it had it started at its arrival: its timeout is
        # shorter than their time for it, and these are its only way out, however loaded.
        only_way = tightest is not None and all(
            tightest.arrival + state.cost(model, w.path).predict(tightest.items) > tightest.deadline for w in ws)

        def escape(w: WorkerState) -> bool:
            return (tightest is not None and w.models[model] >= tightest.items
                    and now + state.cost(model, w.path).predict(tightest.items) <= tightest.deadline
                    and (only_way or arriving * state.cost(model, w.path).predict(1) <= LEND_LOAD))

        return [w for w in all_ws if w.free and w not in ws and (
            lam_u * state.cost(model, w.path).predict(max(least, min(b, state.batch_cap(model, w, background))))
            <= RESERVE_BLOCKING or escape(w))]

    @staticmethod
    def _eligible(state: SchedulerState, model: str, q: ModelQueue, all_ws: list[WorkerState], now: float,
                  d: Decision) -> list[WorkerState]:
        urgent = q.class_items[0] + q.class_items[1]
        lam_u = state.urgent_rate(model, now) if not urgent and len(all_ws) > 1 and not state.closed else 0.0
        if lam_u <= URGENT_RATE:
            return all_ws
        # Batches are not preemptible: low-only batches leave the workers best placed for lone
        # urgent requests alone — as many as it takes for an urgent arrival to find all of them
        # busy with probability <= RESERVE_BLOCKING (Erlang B). The reservation lapses when
        # the urgent rate decays below URGENT_RATE: look again then.
        lapse = state.urgent_lapse(model, URGENT_RATE, now)
        if lapse <= now:
            # A rate a rounding error above URGENT_RATE lapses now: kept, the reservation set a
            # wake-up at this instant, which the core drops, and its lapse then woke nothing (a
            # low request waited beside free workers for the next arrival, or its deadline).
            return all_ws
        ranked = sorted(all_ws, key=lambda w: state.cost(model, w.path).predict(1))
        offered = lam_u * state.cost(model, ranked[0].path).predict(1)
        d.wake_at = min(d.wake_at, lapse)
        return ranked[min(len(all_ws) - 1, servers_for(offered, RESERVE_BLOCKING)):]
