"""Batching policies: ``decide(state, now) -> Decision``. Pure: no I/O, no wall clock.

The live dispatcher calls ``decide`` after every drain of its sockets and arms its one-shot
timer for ``Decision.wake_at``; the simulator (bench/simulator.py) calls the same objects on
a virtual clock. ``decide`` takes requests off the queues and reserves worker slots in the
state (``state.on_dispatch``); the caller sends the batches.

Policies, by config/CLI name:
- ``mcb``                 Marginal Cost Batching (the default; see MarginalCost)
- ``three-segment``       the seeds' literal rule, B1/B2 derived from the learned curves
- ``gpu-only``            the GPU path alone, greedy: a free GPU takes all queued, up to max batch
- ``greedy``              any free worker takes all queued, up to its max batch
- ``fixed:N``             wait for N items (or ``FIXED_MAX_WAIT_S``), then the GPU path
- ``window:US,N``         Triton's dynamic batcher: N items or US microseconds, GPU path
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .state import ModelQueue, Request, SchedulerState, WorkerState

AGING_S = 0.05  # a queued request moves up one priority class per AGING_S * class waited
URGENT_RATE = 20.0  # req/s of high+normal traffic above which low-only batches leave workers free
RESERVE_BLOCKING = 0.01
FIXED_MAX_WAIT_S = 0.1


@dataclass
class Dispatch:
    worker: WorkerState
    model: str
    requests: list[Request]


@dataclass
class Decision:
    dispatches: list[Dispatch] = field(default_factory=list)
    wake_at: float = math.inf  # call decide again no later than this, even if nothing happens
    reasons: dict[str, int] = field(default_factory=dict)  # why: waited, dispatched-cpu, split, ...

    def count(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


def _send(state: SchedulerState, d: Decision, w: WorkerState, q: ModelQueue, max_items: int, now: float,
          reason: str = "") -> int:
    reqs = q.take(min(max_items, w.models[q.model]))
    if not reqs:
        return 0
    items = sum(r.items for r in reqs)
    state.on_dispatch(w, q.model, items, now)
    d.dispatches.append(Dispatch(w, q.model, reqs))
    d.count(reason or f"dispatched-{w.path}")
    return items


def _gpu_or_all(state: SchedulerState, model: str) -> list[WorkerState]:
    ws = state.serving.get(model, [])
    gpus = [w for w in ws if w.path == "gpu"]
    return gpus or list(ws)


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
        if state.finish_time(w, model, items, now) <= deadline:
            return True
    return False


class PerModelPolicy:
    """The shared frame of every policy: each model with queued work is aged, then decided on
    by ``decide_model``, which appends to the decision."""

    name = "?"

    def decide(self, state: SchedulerState, now: float) -> Decision:
        d = Decision()
        for model, q in state.queues.items():
            if q.requests:
                q.promote_aged(now, AGING_S)
                self.decide_model(state, model, q, now, d)
        return d

    def decide_model(self, state: SchedulerState, model: str, q: ModelQueue, now: float, d: Decision) -> None:
        raise NotImplementedError


class Greedy(PerModelPolicy):
    """A free worker takes everything queued for its model, up to its max batch."""

    name = "greedy"
    gpu_only = False

    def decide_model(self, state: SchedulerState, model: str, q: ModelQueue, now: float, d: Decision) -> None:
        workers = _gpu_or_all(state, model) if self.gpu_only else state.serving.get(model, ())
        for w in workers:
            while q.requests and w.free:
                if not _send(state, d, w, q, w.models[model], now):
                    break


class GpuOnly(Greedy):
    name = "gpu-only"
    gpu_only = True


class TimeWindow(PerModelPolicy):
    """Triton's dynamic-batcher rule on the GPU path: dispatch when ``max_batch`` items are
    queued or the oldest request has waited ``max_delay``; otherwise wake when that runs out."""

    def __init__(self, max_delay_s: float, max_batch: int):
        self.max_delay_s = max_delay_s
        self.max_batch = max_batch
        self.name = f"window:{int(round(max_delay_s * 1e6))},{max_batch}"

    def decide_model(self, state: SchedulerState, model: str, q: ModelQueue, now: float, d: Decision) -> None:
        targets = _gpu_or_all(state, model)
        for w in targets:
            while w.free and q.requests and (q.items >= self.max_batch
                                             or now >= q.oldest_arrival() + self.max_delay_s):
                if not _send(state, d, w, q, self.max_batch, now):
                    break
        # Only a free worker makes the clock matter; otherwise a completion wakes us.
        if q.requests and any(w.free for w in targets):
            d.wake_at = min(d.wake_at, max(now, q.oldest_arrival() + self.max_delay_s))


class FixedBatch(TimeWindow):
    """Wait for N items, then dispatch N to the GPU path. The same rule as a time window
    whose delay is only a safety valve (FIXED_MAX_WAIT_S), so nothing waits forever."""

    def __init__(self, n: int, max_wait_s: float = FIXED_MAX_WAIT_S):
        super().__init__(max_wait_s, n)
        self.name = f"fixed:{n}"


def crossover_sizes(state: SchedulerState, model: str, max_batch: int) -> tuple[int, int]:
    """(B1, B2) from the learned curves. B1: the smallest batch the GPU finishes no later than
    the CPU (the CPU/GPU crossover). B2: the smallest batch whose GPU time is at least three
    times the launch cost (launch amortised to a third or less)."""
    gpu, cpu = state.cost(model, "gpu"), state.cost(model, "cpu")
    b1 = next((b for b in range(1, max_batch + 1) if gpu.predict(b) <= cpu.predict(b)), max_batch)
    launch = max(gpu.predict(1) - max(gpu.per_item_s, 0.0), 0.0)
    b2 = next((b for b in range(1, max_batch + 1) if gpu.predict(b) >= 3 * launch), max_batch)
    return b1, max(b1, b2)


def _marginal_wait_pays(state: SchedulerState, model: str, w: WorkerState, b: int, now: float,
                        alone_s: float) -> tuple[bool, float]:
    """Marginal Cost Batching's test for a batch of ``b`` items bound for ``w``.

    One more request saves ``T(b) + T_alone(1) - T(b+1)`` of compute (it rides along instead of
    running on its own); waiting for it costs every queued item the expected gap to the next
    arrival, ``b / lambda``. Wait only while the saving is larger. Returns (pays, t_flip): with
    no new arrival lambda(t) decays, and the rule flips at the instant lambda falls to
    ``b / saving`` — that is when to look again.
    """
    curve = state.cost(model, w.path)
    saving = curve.predict(b) + alone_s - curve.predict(b + 1)
    if saving <= 0:
        return False, now
    rate = state.arrival(model)
    lam = rate.rate(now)
    if lam <= 0 or saving <= b / lam:
        return False, now
    return True, rate.time_when_rate_is(b / saving, now)


class ThreeSegment(PerModelPolicy):
    """The seeds' rule: B < B1 -> CPU now; B1 <= B < B2 -> wait while the marginal gain beats
    the marginal wait cost, then GPU; B >= B2 -> GPU now. Static segments, no look at when a
    busy path frees up, no splitting, no deadlines."""

    name = "three-segment"

    def decide_model(self, state: SchedulerState, model: str, q: ModelQueue, now: float, d: Decision) -> None:
        ws = state.serving.get(model, [])
        cpus = [w for w in ws if w.path == "cpu"]
        gpus = [w for w in ws if w.path == "gpu"] or cpus
        max_b = max((w.models[model] for w in gpus), default=1)
        b1, b2 = crossover_sizes(state, model, max_b)
        while q.requests:
            b = q.items
            if b < b1 and cpus:
                free = [w for w in cpus if w.free]
                if not free:
                    break
                if not _send(state, d, free[0], q, b, now, "dispatched-cpu"):
                    break
                continue
            free = [w for w in gpus if w.free]
            if not free:
                break
            if b < b2:
                alone = state.cost(model, "cpu" if cpus else "gpu").predict(1)
                pays, t_flip = _marginal_wait_pays(state, model, free[0], b, now, alone)
                if pays:
                    d.count("waited")
                    d.wake_at = min(d.wake_at, t_flip)
                    break
            if not _send(state, d, free[0], q, b, now, "dispatched-gpu"):
                break


class MarginalCost(PerModelPolicy):
    """Marginal Cost Batching (MCB). For each model with work queued:

    1. Choose where a batch of everything queued would finish first, counting when each
       worker frees up (``busy_until``). If that is a busy worker, keep waiting: the batch
       grows for free while it finishes.
    2. For the best free worker, apply the marginal rule (``_marginal_wait_pays``): wait while
       one more request saves more compute than the wait costs everything queued.
    3. Flush regardless when the tightest deadline's slack runs out.
    4. Dispatch; if another path is free too, split the queue when that lowers the summed
       latency (the CPU takes the head it can finish before the GPU would reach it).
    """

    name = "mcb"

    def decide_model(self, state: SchedulerState, model: str, q: ModelQueue, now: float, d: Decision) -> None:
        all_ws = state.serving.get(model)
        if not all_ws:
            return
        while q.requests:
            ws = all_ws
            urgent = q.class_items[0] + q.class_items[1]
            lam_u = state.urgent_rate(model, now) if not urgent and len(all_ws) > 1 else 0.0
            if lam_u > URGENT_RATE:
                # Batches are not preemptible: low-only batches leave the workers best placed
                # for lone urgent requests alone — as many as it takes for an urgent arrival to
                # find all of them busy with probability <= RESERVE_BLOCKING (Erlang B).
                ranked = sorted(all_ws, key=lambda w: state.cost(model, w.path).predict(1))
                offered = lam_u * state.cost(model, ranked[0].path).predict(1)
                ws = ranked[min(len(all_ws) - 1, servers_for(offered, RESERVE_BLOCKING)):]
            # Urgent items go out on their own: padding their batch with low items would make
            # them wait for the low items' compute.
            b = urgent if 0 < urgent < q.items else q.items
            best_w, best_t = None, math.inf
            best_free, best_free_t = None, math.inf
            for w in ws:
                t = state.finish_time(w, model, min(b, w.models[model]), now)
                if t < best_t:
                    best_w, best_t = w, t
                if w.free and t < best_free_t:
                    best_free, best_free_t = w, t
            if best_free is None:
                return  # everyone is busy: the queue grows for free until a completion
            slack = self._slack(q, best_free_t)
            if best_w is not best_free and not best_w.free and slack > 0:
                d.count("waited")
                d.wake_at = min(d.wake_at, now + slack)
                return
            cap = best_free.models[model]
            if b < cap and slack > 0:
                alone = min(state.cost(model, w.path).predict(1) for w in ws)
                pays, t_flip = _marginal_wait_pays(state, model, best_free, b, now, alone)
                if pays:
                    d.count("waited")
                    d.wake_at = min(d.wake_at, t_flip, now + slack)
                    return
            if slack <= 0:
                d.count("flushed")
            if not self._dispatch_split(state, model, q, b, best_free, ws, now, d):
                return

    @staticmethod
    def _slack(q: ModelQueue, finish: float) -> float:
        """Time left before dispatching at ``finish``-time cost would miss the tightest deadline."""
        tightest = min((r.deadline for dq in q.by_priority for r in dq), default=math.inf)
        return tightest - finish

    @staticmethod
    def _dispatch_split(state: SchedulerState, model: str, q: ModelQueue, b: int, main: WorkerState,
                        ws: list[WorkerState], now: float, d: Decision) -> int:
        others = [w for w in ws if w.free and w is not main]
        if others and b > 1:
            o = others[0]
            c_main, c_o = state.cost(model, main.path), state.cost(model, o.path)
            best_k, best_sum = 0, b * c_main.predict(min(b, main.models[model]))
            for k in range(1, min(b, o.models[model]) + 1):
                rest = b - k
                total = k * c_o.predict(k) + (rest * c_main.predict(rest) if rest else 0.0)
                if total < best_sum:
                    best_k, best_sum = k, total
            if 0 < best_k < b:
                return _send(state, d, o, q, best_k, now, "split") + \
                    _send(state, d, main, q, b - best_k, now, f"dispatched-{main.path}")
            if best_k == b:
                main = o
        return _send(state, d, main, q, b, now)


def make_policy(spec: str):
    """Build a policy from its config/CLI name (see the module docstring)."""
    name, _, args = spec.partition(":")
    simple = {"greedy": Greedy, "gpu-only": GpuOnly, "mcb": MarginalCost, "three-segment": ThreeSegment}
    if name in simple and not args:
        return simple[name]()
    try:
        if name == "window":
            delay_us, max_batch = (int(x) for x in args.split(","))
            if delay_us < 0 or max_batch < 1:
                raise ValueError
            return TimeWindow(delay_us / 1e6, max_batch)
        if name == "fixed":
            n = int(args)
            if n < 1:
                raise ValueError
            return FixedBatch(n)
    except ValueError:
        raise ValueError(f"{spec!r}: expected window:<max_delay_us>,<max_batch> or fixed:<N>") from None
    raise ValueError(f"unknown policy {spec!r}; expected one of {sorted(simple)}, "
                     f"'window:<max_delay_us>,<max_batch>' or 'fixed:<N>'")
