"""The frame every batching policy shares: decisions, batch taking, the per-model loop.

Pure: no I/O, no wall clock (see batchyard.policy for the policies themselves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from .state import ModelQueue, Request, SchedulerState, WorkerState

AGING_S = 0.05  # a queued request moves up one priority class per AGING_S * class waited


@dataclass
class Dispatch:
    worker: WorkerState
    model: str
    requests: list[Request]


@dataclass
class Decision:
    dispatches: list[Dispatch] = field(default_factory=list)
    wake_at: float = math.inf  # call decide again no later than this, even if nothing happens
    reasons: dict[str, int] = field(default_factory=dict)  # why: waited, dispatched-cpu, flushed, ...

    def count(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


def head_request(q: ModelQueue) -> Optional[Request]:
    """The request ``take`` would pop first (highest class, oldest)."""
    for dq in q.by_priority:
        if dq:
            return dq[0]
    return None


def take_batch(q: ModelQueue, max_items: int, cap: int, max_requests: Optional[int] = None) -> list[Request]:
    """Up to ``max_items`` items (never more than ``cap``), high priority first, FIFO within a
    class, at most ``max_requests`` requests. Requests are never split, so when the head
    request alone is bigger than ``max_items`` (a planned split point fell inside it) but fits
    ``cap``, it goes alone: a batch is never empty only because of where a split fell."""
    room = min(max_items, cap)
    if max_requests is None:
        out = q.take(room)
    else:
        out, used = [], 0
        while len(out) < max_requests:
            head = head_request(q)
            if head is None or used + head.items > room:
                break
            out += q.take(head.items)
            used += head.items
    if not out:
        head = head_request(q)
        if head is not None and head.items <= cap:
            out = q.take(head.items)
    return out


def send(state: SchedulerState, d: Decision, w: WorkerState, q: ModelQueue, max_items: int, now: float,
         reason: str = "", max_requests: Optional[int] = None) -> list[Request]:
    """Take a batch for ``w`` (see ``take_batch``), reserve the worker, record the dispatch."""
    reqs = take_batch(q, max_items, w.models[q.model], max_requests)
    if reqs:
        state.on_dispatch(w, q.model, sum(r.items for r in reqs), now)
        d.dispatches.append(Dispatch(w, q.model, reqs))
        d.count(reason or f"dispatched-{w.path}")
    return reqs


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
