"""The frame every batching policy shares: decisions, batch taking, the per-model loop.

Pure: no I/O, no wall clock (see batchyard.policy for the policies themselves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from .state import ModelQueue, Request, SchedulerState, WorkerState

AGING_S = 0.05  # a queued request moves up one priority class per aging period * class waited
# ... where the aging period is at least this many of the model's longest full batches: aging
# bounds a low request's wait, but must not merge the classes whenever queueing lasts seconds
# (a 3.5 s MiniLM batch on one core would make every low request high after 0.15 s).
AGING_BATCHES = 8
# Requests one send() sets aside for other workers before it stops looking: bounds a decision's
# cost (every queued request set aside in turn: 39 ms at 50,000 queued) while a free worker still
# finds what it can serve behind a run of them (at 64, 70 urgent requests left a CPU idle).
SET_ASIDE_MAX = 1024
LATE_MARGIN = 0.1  # cost curves miss by about this much (see fit_deadlines)


@dataclass
class Dispatch:
    worker: WorkerState
    model: str
    requests: list[Request]


@dataclass
class Decision:
    dispatches: list[Dispatch] = field(default_factory=list)
    # Taken off the queue but not sent: they would finish after their deadline (request, why).
    late: list[tuple[Request, str]] = field(default_factory=list)
    wake_at: float = math.inf  # call decide again no later than this, even if nothing happens
    reasons: dict[str, int] = field(default_factory=dict)  # why: waited, dispatched-cpu, flushed, ...

    def count(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


def head_request(q: ModelQueue, newest_first: int = 0) -> Optional[Request]:
    """The request ``take`` would pop first (highest class, oldest; the newest of a class whose
    bit is set in ``newest_first``)."""
    for prio, dq in enumerate(q.by_priority):
        if dq:
            return dq[-1] if newest_first >> prio & 1 else dq[0]
    return None


def take_batch(q: ModelQueue, max_items: int, cap: int, max_requests: Optional[int] = None,
               newest_first: int = 0) -> list[Request]:
    """Up to ``max_items`` items (never more than ``cap``), high priority first, FIFO within a
    class (newest first in the classes ``newest_first`` names, ``congested``), at most ``max_requests``
    requests. Requests are never split, so when the head request alone is bigger than
    ``max_items`` (a planned split point fell inside it) but fits ``cap``, it goes alone: a
    batch is never empty only because of where a split fell. A head bigger than ``cap`` (a
    worker of a bigger max batch takes it) is passed over (``ModelQueue.take_fitting``)."""
    room = min(max_items, cap)
    if max_requests is None:
        out = q.take(room, newest_first)
    else:
        out, used = [], 0
        while len(out) < max_requests:
            head = head_request(q, newest_first)
            if head is None or used + head.items > room:
                break
            out += q.take(head.items, newest_first)
            used += head.items
    if not out:
        head = head_request(q, newest_first)
        if head is not None and head.items <= cap:
            out = q.take(head.items, newest_first)
        elif head is not None:  # only a worker of a bigger max batch takes the head: it waits for one
            out = q.take_fitting(room, cap, max_requests)
            if not out:
                # The first request this worker takes is past ``max_items`` but within its cap: it
                # goes alone, as such a head does (taking none stranded it beside a free worker).
                out = q.take_fitting(cap, cap, 1)
    return out


def send(state: SchedulerState, d: Decision, w: WorkerState, q: ModelQueue, max_items: int, now: float,
         reason: str = "", max_requests: Optional[int] = None, head_first: bool = False) -> list[Request]:
    """Take a batch for ``w`` (see ``take_batch``) that every request in it can finish in before
    its deadline (``fit_deadlines``), reserve the worker, record the dispatch. ``head_first``:
    from the head even when the queue is congested (a rule sending the head it looked at)."""
    newest = False if head_first else congested(state, w, q, now)
    aside: list[Request] = []  # taken, but for another worker that ends them in time (fit_deadlines)
    while True:
        reqs = taken = take_batch(q, max_items, w.models[q.model], max_requests, newest)
        if reqs and any(r.deadline < math.inf for r in reqs):
            reqs, back, elsewhere = fit_deadlines(state, d, w, q.model, reqs, now)
            for r in reversed(back):
                q.push_front(r)
            aside += elsewhere
        # Nothing taken (the head request is more items than this worker's max batch): nothing
        # to send it; taking again would spin the dispatcher forever. Past SET_ASIDE_MAX set aside,
        # this worker stops looking.
        if reqs or not taken or not q.requests or len(aside) >= SET_ASIDE_MAX:
            break  # else every request taken was hopeless or set aside: take again (the queue is shorter)
    # Back at the head, for the worker that can make their deadlines. Put back before taking
    # again, they were taken again, and this worker, free, sat idle beside requests it could serve.
    for r in reversed(aside):
        q.push_front(r)
    if any(r.suspect for r in reqs) and (len(reqs) > 1 or w.inflight):
        reqs = _isolate_suspects(q, w, reqs)
    if reqs:
        state.on_dispatch(w, q.model, sum(r.items for r in reqs), now)
        d.dispatches.append(Dispatch(w, q.model, reqs))
        d.count(reason or f"dispatched-{w.path}")
    return reqs


def _isolate_suspects(q: ModelQueue, w: WorkerState, reqs: list[Request]) -> list[Request]:
    """What of ``reqs`` may run together on ``w``; the rest back at the head of the queue.

    A worker that died running a batch may have been killed by one of its inputs (a crash in
    native code on that input; Python exceptions are caught per item by the worker). Retried
    together, that input killed the worker again and took the rest of its batch with it, out of
    retries (Triton fails every request of a batch whose backend crashed). So a suspect (a
    request whose worker died running it, ``RequestCore.worker_lost``) runs alone, on a worker
    with nothing else in flight: it takes only itself down. A suspect at the head that cannot go yet holds the
    worker until its batches in flight end (sending newer requests there could keep it busy
    for good); suspects behind the head wait for their turn at it."""
    head = reqs[0]
    if head.suspect:
        keep = [head] if w.inflight == 0 else []
    else:
        keep = [r for r in reqs if not r.suspect]
    kept = {id(r) for r in keep}
    for r in reversed(reqs):
        if id(r) not in kept:
            q.push_front(r)
    return keep


def congested(state: SchedulerState, w: WorkerState, q: ModelQueue, now: float) -> int:
    """The classes to take newest first (adaptive LIFO), as ``take``'s bits: a class whose
    ``n``-th oldest request cannot finish by its deadline in a batch of ``n`` on ``w``, where
    ``n`` is the worker's batch cap (``SchedulerState.batch_cap``) or the class's queued
    requests if fewer, while the model is overloaded (a queued request of it expired within its
    timeout: ``SchedulerState.expired``); for the low class, the short size it is kept to
    (``CostCurve.compact_batch``), in a batch of that size, at any time. Until that stops being
    so, the class is served newest first.

    Served oldest first, a class that gets more work than the workers can do (a flood, or any
    overload, with a timeout) is served just before each deadline, and ``fit_deadlines`` cuts
    every batch to the one or two requests that still make theirs: the workers run their least
    efficient size while the rest expire, and the backlog never clears. Simulated, the seeds'
    devices at 1.2x their capacity with 50 ms deadlines: 53 % of the capacity served in time
    under MCB, batches of 1.5 (greedy 49 %, escape:2 50 %); 102 % newest first. One request close
    to its deadline ahead of others that are not is no overload: it still goes in a batch of its
    own (the ``n``-th oldest decides).

    The low class, measured first: a flood of it with a timeout was served in batches of 1,
    its worker's least efficient size, while the rest expired. Simulated on MiniLM's curve of one EPYC core (10 %
    high, 20 % normal, 150 % low with a 5 s timeout): low completions 15.8/s of a 42.3/s limit,
    batches of 1.4. Newest first the batches have the short size the low class is kept to
    anyway, they serve fresh requests, and the old ones expire in the queue as they would have:
    22.7/s, batches of 2.3. One request close to its deadline ahead of others that are not is
    no flood: it still goes in a short batch of its own (the ``compact``-th oldest decides)."""
    last = len(q.by_priority) - 1
    overloaded = now < state.overloaded_until.get(q.model, -math.inf)
    if not overloaded and not q.by_priority[last]:
        return 0  # (every send asks: the common case costs one lookup)
    lifo = 0
    start, curve = state.start_time(w, now), state.cost(q.model, w.path)
    for prio, dq in enumerate(q.by_priority):
        if not dq or (prio != last and not overloaded):
            continue
        k = state.batch_cap(q.model, w, background=prio == last)
        n = min(k, len(dq))
        if dq[-1].deadline < start + curve.predict(dq[-1].items):
            # Not even the newest ends in time here alone: this worker is no measure of a flood
            # of the class (judged on a 40 ms-launch GPU beside an idle CPU, a low class of
            # 20 ms timeouts was taken newest first at any load).
            continue
        # The others: a batch of the n queued, not of a cap the queue does not hold (against a
        # full batch, a CPU worker of cap 64 at 0.08 ms an item took every class with 2 ms
        # timeouts for congested at any load); and only while the model's requests expire
        # (within a timeout of the last): a burst that is served in time, late in its
        # timeouts, is no overload, and newest first only moved its tail (SIMULATED, MCB, the
        # seeds' devices, bursts averaging 0.6x, 2 ms timeouts, every request served either
        # way: p99 1.286 -> 1.416 ms without the gate).
        if dq[n - 1].deadline < start + curve.predict(k if prio == last else n):
            lifo |= 1 << prio
    return lifo


def fit_deadlines(state: SchedulerState, d: Decision, w: WorkerState, model: str, reqs: list[Request],
                  now: float) -> tuple[list[Request], list[Request], list[Request]]:
    """The part of a taken batch worth running on ``w``, the part to put back in the queue, and
    the part set aside for another worker (below). "Ends by" in the first rule means: would end
    by that time even ``LATE_MARGIN`` faster than predicted (cost curves miss by about that much,
    and MCB flushes a batch as its slack, which keeps that margin, reaches zero: those must go);
    in the second, by the predicted end itself.

    - A request that cannot end by its deadline even alone is not run (``Decision.late``: the
      caller fails it DEADLINE_EXCEEDED now), unless it is a probe (``SchedulerState.probe_due``). Compute spent on it is lost to everyone else;
      under a flood of short-timeout work that is most of the compute. Not on ``w`` alone: if
      another worker serving the model can still end it in time (``ends_in_time_elsewhere``),
      it goes back to the queue for that one. Failed for ``w``, a slow GPU a baseline tries
      first made every request fail beside an idle CPU that would have served each in time.
    - Of the others, the batch keeps the longest prefix (oldest first) that ends by every
      deadline in it; the rest are returned, to go back to the head of the queue, where the
      next batch can still serve them (a request with a tight deadline is served in a short
      batch rather than failed for the sake of a long one).
    """
    curve = state.cost(model, w.path)
    start = state.start_time(w, now)

    def ends(items: int) -> float:
        return start + (1 - LATE_MARGIN) * curve.predict(items)

    kept, elsewhere = [], []
    for r in reqs:
        if r.deadline >= ends(r.items) or r.probe:
            kept.append(r)
        elif ends_in_time_elsewhere(state, w, model, r, now):
            elsewhere.append(r)
        else:
            # The wait for a busy worker named too: "1.2 ms for it alone, 12.9 ms were left" read
            # as a refusal of a request that fitted.
            busy = f"free in {(start - now) * 1e3:.1f} ms, then " if start > now else ""
            d.late.append((r, f"would finish after its deadline: {w.path} worker {w.name} predicted {busy}to take "
                              f"{curve.predict(r.items) * 1e3:.1f} ms for it alone, "
                              f"{(r.deadline - now) * 1e3:.1f} ms were left"))
            d.count("shed-late")
            state.expired(r, now)
    if not kept:
        return [], [], elsewhere
    # The prefix is cut at the predicted end, without the margin: a batch the curve predicts to
    # end past a deadline by under 10 % of its run went whole, and where the curve does not
    # miss, every request in it past its deadline failed (4 of 4 behind a 70 ms batch at
    # T(B) = 50 + 20 B ms, where 3 ended in time alone). The first request stays whatever the
    # cut (it ends by its deadline alone, with the margin: put back, it would only be later).
    items, tightest, fits = 0, math.inf, 1
    for i, r in enumerate(kept, 1):
        items += r.items
        if not r.probe:  # it runs to find out what the curves cannot tell: its deadline binds no batch
            tightest = min(tightest, r.deadline)
        if tightest < start + curve.predict(items):
            break  # a longer prefix only ends later, against a deadline no later
        fits = i
    # A stale knot that the fresh ones beside it show far too dear is no evidence to cut by:
    # the batch goes whole and measures its size (once: that refreshes the knot). Cut by it,
    # the knots of a slow spell (or of a profile written in ms) cut every batch of their sizes
    # for good, MCB's probes and trials of them included: live, after a 12 s spell at 20 times
    # the time, 122 of 550 requests a 5 s window failed at 83 % of the worker's capacity with
    # 0.5 s timeouts, the knots of 4 and 8 still the spell's. Had the knot been right, that one
    # batch's requests past the cut would fail late.
    if fits < len(kept) and curve.stale_and_dear(sum(r.items for r in kept)):
        fits = len(kept)
    return kept[:fits], kept[fits:], elsewhere


def ends_in_time(state: SchedulerState, x: WorkerState, model: str, r: Request, now: float) -> bool:
    """Whether ``x`` would end ``r`` alone by its deadline from when it can start, ``LATE_MARGIN``
    faster than predicted (as fit_deadlines reads it)."""
    return state.start_time(x, now) + (1 - LATE_MARGIN) * state.cost(model, x.path).predict(r.items) <= r.deadline


def ends_in_time_elsewhere(state: SchedulerState, w: WorkerState, model: str, r: Request, now: float) -> bool:
    """Whether a worker serving ``model`` other than ``w``, one that takes ``r`` whole, would end
    ``r`` alone by its deadline (``ends_in_time``)."""
    return any(x is not w and x.models[model] >= r.items and ends_in_time(state, x, model, r, now)
               for x in state.serving.get(model, ()))


def aging_period(state: SchedulerState, model: str) -> float:
    """How long a request waits in its class before it moves up one (times its class):
    ``AGING_S``, or ``AGING_BATCHES`` of the model's longest full batch if that is longer.
    A full batch is the configured max batch, not the learned efficient one: that one follows
    noisy per-size timings, and live on one EPYC core it fell from 28 to 4 between two runs of
    the priority bench, and the aging period with it to about 0.8 s: by the aging rule, a flood's
    low requests (5 s timeout) then rise into the normal class after ~1.5 s and the high class
    after ~2.3 s. In that run the high class's p99 under the flood was 3.9 s (0.4 s the run
    before)."""
    return _aging_for(longest_batch(state, model))


def _aging_for(longest: float) -> float:
    return max(AGING_S, AGING_BATCHES * longest)


def _class_load(state: SchedulerState, model: str, cls: int, now: float) -> tuple[float, float, float]:
    """(capacity, rate of the classes above ``cls``, rate of ``cls``) of ``model``, items/s, by
    the classes the clients asked for: capacity is full batches on each of its workers, as if
    each served it alone."""
    capacity = sum(w.models[model] / max(state.cost(model, w.path).predict(w.models[model]), 1e-9)
                   for w in state.serving.get(model, ()))
    urgent = state.rate_of(model, "#urgent", now)
    if cls == 2:
        return capacity, urgent, state.low_rate(model, now)
    high = state.rate_of(model, "#high", now)
    return capacity, high, max(urgent - high, 0.0)


def class_overloads(state: SchedulerState, model: str, cls: int, now: float) -> bool:
    """Whether class ``cls`` (normal or low) is what takes the model past its workers' capacity:
    the classes above it arrive at less than it, they and it at more than LOW_OVERLOAD_MARGIN
    past it. Aging then keeps that class's requests in their class (``class_held``): it bounds
    their wait where the classes above take the workers, or where the node keeps up with
    everyone; past what the workers can do because of the class itself, moving it up only
    handed its overload to the classes above."""
    return _overloads(*_class_load(state, model, cls, now))


def _overloads(capacity: float, above: float, own: float) -> bool:
    return own > 0.0 and above < capacity and above + own > (1 + LOW_OVERLOAD_MARGIN) * capacity


# How far past the workers' capacity the arrivals must be for a class to count as overloading
# them: the rate estimates swing by about this much at a steady rate, and near the capacity a
# low class held in place only made the urgent batches smaller (SIMULATED, two workers of 80
# items/s, 150/s of 10/30/60 % high/normal/low: every class's p99 up to 4x).
LOW_OVERLOAD_MARGIN = 0.25


def class_held(state: SchedulerState, model: str, cls: int, aging: float, queued: int, now: float) -> bool:
    """Whether aging keeps the model's class ``cls`` in place: from when it overloads the
    workers (``class_overloads``) until its ``queued`` items are no more than the spare capacity
    (what the classes above leave) clears in an aging period. Released on the rate alone, the
    hold lapsed whenever the estimate dipped (a flood of 1.5x the capacity read 66 of 120/s
    between arrivals) and when the flood ended, and each lapse moved the whole due backlog up at
    once: 1,400 requests of 30 s timeouts after a flood, ahead of the high requests that came
    next (SIMULATED, ``priority_padding --flood``, seeds 3, 4, 7: the high class's p99
    17.3-18.6 s)."""
    key = (model, cls)
    held = key in state.held_classes
    if not held and not queued:
        return False  # nothing of it to move up: no need to look
    capacity, above, own = _class_load(state, model, cls, now)
    if _overloads(capacity, above, own):
        # Held once every look for an aging period has said so: a single reading (a warm-up's
        # few arrivals, a dip of the classes above) latched the hold, and so did scattered ones
        # (1-3 % of the looks at a steady 1.125x the capacity, where the held low class then
        # lost half its served requests to smaller batches).
        since = state.overloaded_since.setdefault(key, now)
        if now - since >= aging:
            state.held_classes.add(key)
            return True
    else:
        state.overloaded_since.pop(key, None)
    if not held:
        return False
    # Released once the class's queue is what the spare capacity clears in an aging period, or
    # once the classes above alone take the workers: the class is no longer what overloads them
    # (held then, it waited out its timeouts while aging was to bound its wait).
    if above < capacity and queued > (capacity - above) * aging:
        return True
    state.held_classes.discard(key)
    state.overloaded_since.pop(key, None)
    return False


def longest_batch(state: SchedulerState, model: str) -> float:
    """The predicted time of the longest full batch (its max batch) of a worker serving ``model``."""
    return max((state.cost(model, w.path).predict(w.models[model]) for w in state.serving.get(model, ())),
               default=0.0)


def shortest_full_batch(state: SchedulerState, model: str) -> float:
    """The predicted time of the shortest full batch (its max batch) of a worker serving ``model``."""
    return min((state.cost(model, w.path).predict(w.models[model]) for w in state.serving.get(model, ())),
               default=0.0)


def servers_for(offered_load: float, blocking: float) -> int:
    """Fewest servers for which Erlang B(offered_load) <= blocking (at least 1)."""
    b, n = 1.0, 0
    while True:
        n += 1
        b = offered_load * b / (n + offered_load * b)
        if b <= blocking or n >= 64:
            return n


def feasible(state: SchedulerState, model: str, items: int, deadline: float, now: float) -> bool:
    """Can any path serving ``model`` finish ``items`` before ``deadline``? (admission control)"""
    ws = state.serving.get(model)
    if not ws:
        return True  # no worker yet (starting, restarting): let the request wait for one
    for w in ws:  # on the hot path (every arrival): stop at the first worker that can make it
        # (one whose max batch is below the request's items never takes it: counted, a request
        # only a slow worker could take was admitted on a fast one's speed and expired queued)
        if w.models[model] >= items and state.finish_time(w, model, items, now) <= deadline:
            return True
    return not any(w.models[model] >= items for w in ws)  # none takes it: refused elsewhere, in words


def queues_by_urgency(state: SchedulerState, now: float,
                      tightest: Optional[Callable[[str], float]] = None) -> list[tuple[str, ModelQueue, float]]:
    """The models with queued requests, each queue aged, in the order they are decided on, most
    urgent first: by the class of the queue's head (the request it gives next), then, within a
    class, the models with a deadline at stake (one that a batch of the model started later than
    one full batch of its workers from now would miss, LATE_MARGIN slower than predicted), the
    earliest latest start first, then the longest-waiting head, then the name. Models that share
    a worker take it in that order when it frees. ``tightest(model)``: the model's tightest
    deadline (MCB keeps an index); else the head's. Each with the aging period it was aged by.

    In the queues' own order (of each model's first request), the model that asked first took a
    shared worker at every completion while it had anything queued: at 27 % of the worker's
    capacity the other model's requests expired or were refused Overloaded (47 of 240 served),
    and its high-priority requests waited behind the first model's low ones. By the head's wait
    alone, an old request with no deadline took the worker from a newer one whose deadline only
    the batch sent now could meet."""
    out = []
    for model, q in state.queues.items():
        if q.requests:
            longest = longest_batch(state, model)
            aging = _aging_for(longest)  # (aging_period, with the longest batch kept for below)
            held = (False, class_held(state, model, 1, aging, q.class_items[1], now),
                    class_held(state, model, 2, aging, q.class_items[2], now))
            q.promote_aged(now, aging, (1 + LATE_MARGIN) * longest, held)
            out.append((model, q, longest, aging))
    if len(out) < 2:
        return [(model, q, aging) for model, q, _, aging in out]
    keyed = []
    for model, q, longest, aging in out:
        head = head_request(q)
        deadline = tightest(model) if tightest is not None else head.deadline
        at_stake = math.inf
        # (Past now + (2 + LATE_MARGIN) x longest it is not at stake, the head alone taking no
        # longer than a full batch: 50 models, each decision, without the curves' predictions.)
        if deadline <= now + (2 + LATE_MARGIN) * longest:
            alone = min((state.cost(model, w.path).predict(head.items) for w in state.serving.get(model, ())
                         if w.models[model] >= head.items), default=math.inf)
            latest_start = deadline - (1 + LATE_MARGIN) * alone
            if latest_start <= now + longest:
                at_stake = latest_start
        keyed.append(((head.priority, at_stake, head.arrival, model), model, q, aging))
    keyed.sort(key=lambda k: k[0])
    return [(model, q, aging) for _, model, q, aging in keyed]


class PerModelPolicy:
    """The shared frame of every policy: each model with queued work is aged, then decided on
    by ``decide_model``, which appends to the decision."""

    name = "?"

    def decide(self, state: SchedulerState, now: float) -> Decision:
        d = Decision()
        for model, q, _ in queues_by_urgency(state, now):
            self.decide_model(state, model, q, now, d)
        return d

    def decide_model(self, state: SchedulerState, model: str, q: ModelQueue, now: float, d: Decision) -> None:
        raise NotImplementedError
