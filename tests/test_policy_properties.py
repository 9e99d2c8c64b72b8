"""Properties of decide() over random states (hypothesis): no queued request is stranded."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st_

from batchyard.cost_model import ArrivalRate, CostCurve
from batchyard.policy import make_policy
from batchyard.policy_core import LATE_MARGIN
from batchyard.state import Request, SchedulerState, WorkerState

MS = 1e-3
NOW = 1.0
# (three-segment is left out: below its B1 it waits for a busy CPU beside free GPUs, by its rule;
# tests/test_policy.py has its stranding case.)
POLICIES = ["mcb", "greedy", "escape:1", "escape:3", "window:200,16", "fixed:8", "gpu-only"]


@st_.composite
def states(draw):
    st = SchedulerState()
    for path in ("gpu", "cpu"):
        # Negative launches too: the online fit learns them (a line through T(1) <= 0 made MCB
        # hold the queue for a worker whose batch "took no time", with no wake-up).
        c = CostCurve(launch_s=draw(st_.floats(-0.3, 0.5)) * MS, per_item_s=draw(st_.floats(0.001, 0.2)) * MS)
        c.samples = 100
        st.costs[("m", path)] = c
    n_workers = draw(st_.integers(1, 5))
    for i in range(n_workers):
        # Max batches as small as 1 beside requests of up to 8 items: workers may register
        # different max batches, and a request only some of them take must not be stranded.
        w = WorkerState(f"w{i}", draw(st_.sampled_from(["gpu", "cpu"])),
                        {"m": draw(st_.one_of(st_.integers(1, 4), st_.integers(2, 64)))})
        if draw(st_.booleans()):
            w.inflight, w.busy_until = 1, NOW + draw(st_.floats(-0.1, 2.0)) * MS
        st.add_worker(w)
    largest = max(w.models["m"] for w in st.workers.values())  # admission refuses larger requests
    if n_workers > 1 and draw(st_.booleans()):
        # Out of rotation (leaving, or suspended by the breaker), with requests queued that only it
        # takes: those wait for it, and must not hold back the ones behind them that a free worker
        # takes (a 2-item request waited its timeout beside a free GPU of max batch 2).
        st.suspend(st.workers[f"w{draw(st_.integers(0, n_workers - 1))}"])
    st.arrivals["m"] = ArrivalRate(tau_s=0.25, initial=draw(st_.floats(0, 100_000)))
    st.arrivals["m"]._t = NOW
    q = st.queue("m")
    for seq in range(draw(st_.integers(1, 40))):
        deadline = NOW + draw(st_.floats(0.05, 10.0)) * MS if draw(st_.booleans()) else math.inf
        q.push(Request(seq, "m", min(draw(st_.integers(1, 8)), largest), draw(st_.integers(0, 2)),
                       NOW - draw(st_.floats(0, 1.0)) * MS, deadline))
    return st


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=150, deadline=None)
@given(state=states())
def test_no_request_is_stranded(policy, state):
    """After decide(), what is still queued is covered by a finite wake-up, or waits only
    because every worker that can serve it is busy (its completion triggers the next decide)."""
    d = make_policy(policy).decide(state, NOW)
    q = state.queue("m")
    if q.requests == 0:
        return
    free = [w for w in state.serving["m"] if w.free]
    if policy == "gpu-only" and any(w.path == "gpu" for w in state.serving["m"]):
        free = [w for w in free if w.path == "gpu"]  # its workers: the GPUs (the CPUs where none is)
    # A request a free worker takes but cannot end by its deadline may wait for a busy one that
    # can (policy_core.fit_deadlines): it is not stranded there.
    def in_time(w, r) -> bool:
        ends = state.start_time(w, NOW) + (1 - LATE_MARGIN) * state.cost("m", w.path).predict(r.items)
        return ends <= r.deadline

    takers = [(r.seq, r.items, [w.name for w in free if w.models["m"] >= r.items and in_time(w, r)])
              for cls in q.by_priority for r in cls]
    assert d.wake_at < math.inf or not any(names for _, _, names in takers), (
        f"queued (seq, items, free workers that take it): {takers}, no wake-up; "
        f"dispatched {[(x.worker.name, len(x.requests)) for x in d.dispatches]}")
    assert d.wake_at > NOW  # a wake-up at or before now would spin the live dispatcher's timer


@settings(max_examples=300, deadline=None)
@given(state=states(), background=st_.booleans(), data=st_.data())
def test_a_plan_continued_for_more_items_is_the_plan_made_afresh(state, background, data):
    """A pass asks its Planner for plans of several sizes (the queue, then with the arrivals it
    expects), and each goes on from the last where it can: every answer must be the plan a fresh
    ``plan()`` of that size makes, across the backlog bound (2 x the max batches) and back."""
    from batchyard.policy_mcb import BACKLOG_BATCHES, Planner, plan

    ws = state.serving["m"]
    for path in ("gpu", "cpu"):
        if data.draw(st_.booleans()):
            # A launch of a few items' time, amortised within a max batch: where the plan opens
            # a second batch depends on whether it is in a backlog.
            c = state.costs[("m", path)]
            c.launch_s = c.per_item_s * data.draw(st_.floats(0.02, 2.0))
    planner = Planner(state, "m", ws, NOW, background)
    bound = BACKLOG_BATCHES * planner.room
    size = st_.one_of(st_.integers(0, bound + planner.room), st_.sampled_from([planner.room, bound, bound + 1]))
    sizes = data.draw(st_.lists(size, min_size=2, max_size=6))
    for n in sizes:
        assert planner.plan(n) == plan(state, "m", ws, n, NOW, background), (n, sizes)
