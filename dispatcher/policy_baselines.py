"""Baseline policies: the rules a user could write, or set in Triton, in a few lines.

Each one is a ``PerModelPolicy``; see batchyard.policy for the config names.
"""

from __future__ import annotations

import math

from .policy_core import Decision, PerModelPolicy, head_request, send
from .state import ModelQueue, SchedulerState, WorkerState

FIXED_MAX_WAIT_S = 0.1


def gpu_or_all(state: SchedulerState, model: str) -> list[WorkerState]:
    ws = state.serving.get(model, [])
    gpus = [w for w in ws if w.path == "gpu"]
    return gpus or list(ws)


def send_heads_no_gpu_takes(state: SchedulerState, model: str, q: ModelQueue, now: float, d: Decision,
                            gpu_max: int) -> None:
    """The GPU-first rules' way out for a head of more items than any GPU takes (``gpu_max``):
    alone, to a free worker that takes it. Left to the GPU, it waited beside such a worker until
    its deadline, passed over by every batch the GPU took."""
    while q.requests:
        head = head_request(q)
        # head_first: congested, the queue is taken newest first, and that sent a request the GPU
        # takes to the CPU under gpu-only, the head left waiting beside it (an outside review)
        if head.items <= gpu_max or not any(send(state, d, w, q, head.items, now, max_requests=1, head_first=True)
                                            for w in state.serving.get(model, ())
                                            if w.free and w.models[model] >= head.items):
            return


class Greedy(PerModelPolicy):
    """A free worker takes everything queued for its model, up to its max batch."""

    name = "greedy"
    gpu_only = False

    def decide_model(self, state: SchedulerState, model: str, q: ModelQueue, now: float, d: Decision) -> None:
        workers = gpu_or_all(state, model) if self.gpu_only else state.serving.get(model, ())
        for w in workers:
            while q.requests and w.free:
                if not send(state, d, w, q, w.models[model], now):
                    break
        if self.gpu_only and any(w.path == "gpu" for w in workers):
            send_heads_no_gpu_takes(state, model, q, now, d, max(w.models[model] for w in workers))


class GpuOnly(Greedy):
    name = "gpu-only"
    gpu_only = True


class Escape(PerModelPolicy):
    """A free GPU takes everything queued (up to its max batch); each free CPU worker takes at
    most K requests. The CPUs are an escape route for the few requests that arrive while the
    GPU is busy, never a home for a big batch."""

    def __init__(self, k: int):
        self.k = k
        self.name = f"escape:{k}"

    def decide_model(self, state: SchedulerState, model: str, q: ModelQueue, now: float, d: Decision) -> None:
        ws = state.serving.get(model, ())
        for w in [w for w in ws if w.path == "gpu"] + [w for w in ws if w.path != "gpu"]:
            limit = None if w.path == "gpu" else self.k
            while q.requests and w.free:
                if not send(state, d, w, q, w.models[model], now, max_requests=limit):
                    break


class TimeWindow(PerModelPolicy):
    """Triton's dynamic-batcher rule: dispatch when ``max_batch`` items (or the worker's max
    batch, if smaller) are queued or the oldest request has waited ``max_delay``, to whichever
    worker is free (as Triton feeds whichever of its KIND_CPU / KIND_GPU instances is free);
    otherwise wake when the delay runs out."""

    def __init__(self, max_delay_s: float, max_batch: int):
        self.max_delay_s = max_delay_s
        self.max_batch = max_batch
        self.name = f"window:{int(round(max_delay_s * 1e6))},{max_batch}"

    def decide_model(self, state: SchedulerState, model: str, q: ModelQueue, now: float, d: Decision) -> None:
        targets = state.serving.get(model, ())
        sent = True
        while sent:  # again while a pass sent: what it took changes what is full or due for the workers before
            sent = False
            for w in targets:
                # A full batch is at most the worker's max batch, as Triton's is the model's
                # max_batch_size: past it, a free worker waited out the delay beside full batches.
                full = min(self.max_batch, w.models[model])
                while w.free and q.requests and (q.items >= full or state.closed
                                                 or now >= q.oldest_arrival() + self.max_delay_s):
                    if not send(state, d, w, q, self.max_batch, now):
                        break
                    sent = True
        # Only a free worker makes the clock matter; otherwise a completion wakes us. So does
        # one after a delay already run out: what is left is what no free worker takes (more
        # items than its max batch), and a wake-up now would only repeat this decision.
        due = q.oldest_arrival() + self.max_delay_s if q.requests else math.inf
        if due > now and any(w.free for w in targets):
            d.wake_at = min(d.wake_at, due)


class FixedBatch(TimeWindow):
    """Wait for N items, then dispatch N to a free worker. The same rule as a time window whose
    delay is only a safety valve (FIXED_MAX_WAIT_S), so nothing waits forever."""

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


def marginal_wait_pays(state: SchedulerState, model: str, w: WorkerState, b: int, now: float,
                       alone_s: float) -> tuple[bool, float]:
    """The seeds' marginal test for a batch of ``b`` items bound for ``w`` (three-segment).

    One more request saves ``T(b) + T_alone(1) - T(b+1)`` of compute (it rides along instead of
    running on its own); waiting for it costs every queued item the expected gap to the next
    arrival, ``b / lambda``. Wait only while the saving is larger (``wait_pays``)."""
    curve = state.cost(model, w.path)
    return wait_pays(state, model, b, curve.predict(b) + alone_s - curve.predict(b + 1), now)


def wait_pays(state: SchedulerState, model: str, b: int, saving: float, now: float,
              ski_rental: bool = False, break_even_gap: float | None = None) -> tuple[bool, float]:
    """Whether waiting for one more arrival pays when it saves ``saving`` seconds and costs each
    of ``b`` queued items the expected gap ``1 / lambda``. Returns (pays, t_flip): with no new
    arrival lambda(t) decays, and the rule flips at the instant the expected gap reaches the
    break-even gap — ``saving / b`` for a saving that does not depend on the gap, else
    ``break_even_gap`` — that is when to look again.

    With ``ski_rental``, the wait also ends once it has cost the b items as much as the next
    arrival would save, at ``t_last + saving / b`` (``t_last``: the latest arrival, when the
    wait for the next one began; the ski-rental break-even). The expected gap says whether
    to wait, but the gap itself is exponential: without this bound a wait that pays in
    expectation lasts until lambda decays (a time of order tau), and the unlucky gaps become
    the p99.
    """
    gap = saving / b if break_even_gap is None else break_even_gap
    if saving <= 0 or gap <= 0 or state.closed:
        return False, now
    rate = state.arrival(model)
    lam = rate.rate(now)
    if lam <= 0 or saving <= b / lam:
        return False, now
    t_flip = rate.time_when_rate_is(1.0 / gap, now)
    if ski_rental:
        t_flip = min(t_flip, rate.last + saving / b)
    if t_flip <= now:
        # The wait is over. Woken at t_flip, rounding could still say "wait" with t_flip ==
        # now: a wake-up at the decision's own instant, which nothing arms, and the queue
        # waited for the next arrival, for good after the last one.
        return False, now
    return True, t_flip


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
            if gpus is not cpus:  # (left to the GPU segments, it waited while a GPU was busy)
                send_heads_no_gpu_takes(state, model, q, now, d, max_b)
                if not q.requests:
                    break
            b = q.items
            if b < b1 and cpus:
                free = [w for w in cpus if w.free]
                if not free:
                    break
                # The first free worker that takes anything (one of a smaller max batch than the
                # head request takes nothing; stopping there stranded the head beside another).
                if any(send(state, d, w, q, b, now, "dispatched-cpu") for w in free):
                    continue
                # No free CPU takes the head (more items than their max batch): the GPU segment
                # does. Stopped here, it waited with both workers free and no wake-up set.
            free = [w for w in gpus if w.free]
            if not free:
                break
            if b < b2:
                alone = state.cost(model, "cpu" if cpus else "gpu").predict(1)
                pays, t_flip = marginal_wait_pays(state, model, free[0], b, now, alone)
                if pays:
                    d.count("waited")
                    d.wake_at = min(d.wake_at, t_flip)
                    break
            if not any(send(state, d, w, q, b, now, "dispatched-gpu") for w in free):
                # What no free GPU took it may have set aside for a CPU that ends it in time
                # (fit_deadlines): offered there. Left to the GPU segment, a request the GPU
                # could not end in time waited beside a free CPU that could, no wake-up set,
                # until its deadline (an outside review).
                if gpus is cpus or not any(send(state, d, w, q, b, now, "dispatched-cpu") for w in cpus if w.free):
                    break
