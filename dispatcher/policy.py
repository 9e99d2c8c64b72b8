"""Batching policies: ``decide(state, now) -> Decision``. Pure: no I/O, no wall clock.

The live dispatcher calls ``decide`` after every drain of its sockets and arms its one-shot
timer for ``Decision.wake_at``; the simulator calls the same objects on a virtual clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .state import ModelQueue, Request, SchedulerState, WorkerState


@dataclass
class Dispatch:
    worker: WorkerState
    model: str
    requests: list[Request]


@dataclass
class Decision:
    dispatches: list[Dispatch] = field(default_factory=list)
    wake_at: float = math.inf  # call decide again no later than this, even if nothing happens


def _fill_free_workers(queue: ModelQueue, workers: list[WorkerState], out: list[Dispatch],
                       max_batch: int | None = None) -> None:
    for w in workers:
        while queue.requests and w.free:
            limit = w.models[queue.model] if max_batch is None else min(max_batch, w.models[queue.model])
            reqs = queue.take(limit)
            if not reqs:
                return
            w.inflight += 1  # the dispatcher's accounting; reverted only by a completion
            out.append(Dispatch(w, queue.model, reqs))


class Greedy:
    """A free worker takes everything queued for its model, up to its max batch."""

    name = "greedy"

    def decide(self, state: SchedulerState, now: float) -> Decision:
        d = Decision()
        for model, q in state.queues.items():
            if q.requests:
                _fill_free_workers(q, state.serving.get(model, ()), d.dispatches)
        return d


class TimeWindow:
    """Triton's dynamic-batcher rule: dispatch when ``max_batch`` items are queued or the
    oldest request has waited ``max_delay``; otherwise wake when that delay runs out."""

    def __init__(self, max_delay_s: float, max_batch: int):
        self.max_delay_s = max_delay_s
        self.max_batch = max_batch
        self.name = f"window:{int(max_delay_s * 1e6)},{max_batch}"

    def decide(self, state: SchedulerState, now: float) -> Decision:
        d = Decision()
        for model, q in state.queues.items():
            if not q.requests:
                continue
            oldest = q.oldest_arrival()
            if q.items >= self.max_batch or now >= oldest + self.max_delay_s:
                _fill_free_workers(q, state.serving.get(model, ()), d.dispatches, self.max_batch)
            if q.requests:
                oldest = q.oldest_arrival()
                d.wake_at = min(d.wake_at, max(now, oldest + self.max_delay_s))
        return d


def make_policy(spec: str):
    """Build a policy from its config/CLI name: ``greedy`` or ``window:<max_delay_us>,<max_batch>``."""
    name, _, args = spec.partition(":")
    if name == "greedy" and not args:
        return Greedy()
    if name == "window":
        try:
            delay_us, max_batch = (int(x) for x in args.split(","))
        except ValueError:
            raise ValueError(f"{spec!r}: expected window:<max_delay_us>,<max_batch>") from None
        if delay_us < 0 or max_batch < 1:
            raise ValueError(f"{spec!r}: max_delay_us >= 0 and max_batch >= 1")
        return TimeWindow(delay_us / 1e6, max_batch)
    raise ValueError(f"unknown policy {spec!r}; expected 'greedy' or 'window:<max_delay_us>,<max_batch>'")
