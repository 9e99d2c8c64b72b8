"""Priorities on a slow model under a low-priority flood (issue 10's priority table): requests
that cannot make their deadline are not run, aging does not merge the classes when batches last
seconds, and low batches stay short while urgent requests arrive. The live table is
bench/results/priority (bench/priority_vs_triton.py); the last test is its SIMULATED twin."""

from __future__ import annotations

import math

import numpy as np

from batchyard.bench.priority_padding import beside_every_cpu, flood
from batchyard.bench.simulator import Device, simulate
from batchyard.bench.traces import merge, poisson, with_classes
from batchyard.core import RequestCore
from batchyard.cost_model import CostCurve
from batchyard.policy import AGING_S, make_policy
from batchyard.policy_core import aging_period, class_held, class_overloads, take_batch
from batchyard.protocol import Status
from batchyard.state import ModelQueue, Request, WorkerState

# MiniLM-L6 bf16 on one core of this machine, as Batchyard learned it live (bench/results/priority).
LAUNCH_S, PER_ITEM_S, MAX_BATCH = 0.0317, 0.1139, 32


def minilm_core(policy="mcb"):
    failed = {}
    core = RequestCore(make_policy(policy), lambda req, status, msg: failed.__setitem__(req.req_id, (status, msg)))
    core.state.costs[("m", "cpu")] = CostCurve(launch_s=LAUNCH_S, per_item_s=PER_ITEM_S, samples=100)
    core.add_worker(WorkerState("amx0", "cpu", {"m": MAX_BATCH}), 0.0)
    return core, failed


def test_a_request_that_cannot_make_its_deadline_is_failed_not_run():
    core, failed = minilm_core()
    core.admit("m", 1, 2, 0.2, 0.0, req_id=1)  # one item alone takes 146 ms
    core.admit("m", 1, 2, 0.0, 0.0, req_id=2)  # the node's default timeout (seconds)
    (batch,) = core.decide(0.1)  # 100 ms later request 1 is hopeless
    assert [r.req_id for r in batch.requests] == [2]
    status, message = failed[1]
    assert status == Status.DEADLINE_EXCEEDED and "cannot finish before its deadline on any path" in message


def test_a_batch_shrinks_to_what_makes_its_deadlines():
    """Three together take 373 ms, past request 1's deadline; alone it makes it: it goes alone
    and the others wait at the head of the queue."""
    core, failed = minilm_core()
    for i, timeout in ((1, 0.2), (2, 0.0), (3, 0.0)):
        core.admit("m", 1, 2, timeout, 0.0, req_id=i)
    (batch,) = core.decide(0.0)
    assert [r.req_id for r in batch.requests] == [1] and not failed
    assert [r.req_id for r in core.state.queue("m").by_priority[2]] == [2, 3]


def test_aging_does_not_merge_the_classes_of_a_slow_model():
    core, _ = minilm_core()
    period = aging_period(core.state, "m")
    assert period == 8 * (LAUNCH_S + PER_ITEM_S * MAX_BATCH) > 100 * AGING_S
    core.state.workers["amx0"].inflight, core.state.workers["amx0"].busy_until = 1, 10.0  # busy
    # (A timeout that leaves it more than a full batch once it is due: promote_aged's lead.)
    low = core.admit("m", 1, 2, 3 * period, 0.0, req_id=1)
    core.decide(1.0)  # waited 20x AGING_S: still low
    assert low.priority == 2
    core.decide(period * 2 + 0.01)
    assert low.priority == 1


def test_a_low_flood_whose_timeout_outlasts_aging_does_not_rise_into_the_high_class():
    """Aging keeps a low flood that overloads the worker in its class: with 30 s timeouts (three
    aging periods are 2.4 s here) every low request rose into the high class, and the high
    class's p99 was 13.5 s against 56 ms alone (``priority_padding --flood``); the flood is
    still served whole."""
    for seed in (1, 3):  # 3: the flood ends before the high requests do, its backlog still queued
        r = flood(30.0, seed=seed)
        assert r["beside"][1] < 5 * r["alone"][1], (seed, r)  # 126 and 119 ms, 56 and 51 alone (13.5 and 14.1 s before)
        assert r["low_served"] == r["low_sent"]


def test_a_normal_flood_does_not_rise_into_the_high_class_either():
    """The same for the normal class: high at 5/s beside normal requests at 120/s (1.5x the
    worker) with 30 s timeouts had 47 of 150 served within their 5 s timeouts, the
    normal backlog ahead of them once it rose."""
    from batchyard.bench.priority_padding import FLOOD_DEVICES

    high = poisson(5.0, 150, seed=1)
    high.priority[:] = 0
    high.timeout[:] = 5.0
    normal = poisson(120.0, 3600, seed=101)
    normal.priority[:] = 1
    normal.timeout[:] = 30.0
    alone = np.percentile(simulate("mcb", high, FLOOD_DEVICES).latency, 99)
    res = simulate("mcb", merge(high, normal), FLOOD_DEVICES)
    ok_high = (res.status == 0) & (res.priority == 0)
    assert ok_high.sum() == len(high) and np.percentile(res.latency[ok_high], 99) < 5 * alone


def test_low_requests_the_high_class_keeps_waiting_still_rise_by_aging():
    """High work past the worker's capacity (90/s on 80): the low class's requests still rise
    and are served within seconds, not at the end of the high stream."""
    dev = [Device("sim0", "gpu", 0.020, 0.010, max_batch=8)]
    high = poisson(90.0, 2700, seed=9)
    high.priority[:] = 0
    low = poisson(5.0, 150, seed=10)
    low.priority[:] = 2
    res = simulate("mcb", merge(high, low), dev)
    low_ok = (res.status == 0) & (res.priority == 2)
    assert low_ok.sum() == 150 and np.percentile(res.latency[low_ok], 99) < 10.0


def test_aging_keeps_the_low_class_in_place_only_where_it_is_what_overloads_the_workers():
    core, _ = minilm_core()  # one worker, 32 items in 3.68 s: 8.7 items/s
    st = core.state
    for t in np.arange(0.0, 2.0, 1 / 4):  # urgent at 4/s
        st.note_arrival("m", 1, 1, t)
    assert not class_overloads(st, "m", 2, 2.0)  # no low class
    for t in np.arange(0.0, 2.0, 1 / 3):  # low at 3/s: 7/s in all, within the 8.7
        st.note_arrival("m", 2, 1, t)
    assert not class_overloads(st, "m", 2, 2.0)
    for t in np.arange(0.0, 2.0, 1 / 20):  # low at 23/s: past it, because of the low class
        st.note_arrival("m", 2, 1, t)
    assert class_overloads(st, "m", 2, 2.0)
    for t in np.arange(0.0, 2.0, 1 / 10):  # urgent at 14/s: urgent work alone takes the worker
        st.note_arrival("m", 1, 1, t)
    assert not class_overloads(st, "m", 2, 2.0)
    st = minilm_core()[0].state
    for t in np.arange(0.0, 45.0, 1 / 4):  # urgent at 4/s and low at 23/s for 45 s
        st.note_arrival("m", 1, 1, t)
    for t in np.arange(0.0, 45.0, 1 / 23):
        st.note_arrival("m", 2, 1, t)
    # Held once every look for an aging period (29.5 s here) has found the overload: not at the first.
    assert not class_held(st, "m", 2, 29.5, 1, 5.0) and not class_held(st, "m", 2, 29.5, 1, 20.0)
    assert class_held(st, "m", 2, 29.5, 1, 36.0)
    # The flood over (its rates decayed by t = 100 s), the hold lasts while the low backlog is more
    # than the spare capacity (8.7 items/s) clears in an aging period: 256 items.
    assert not class_overloads(st, "m", 2, 100.0)
    assert class_held(st, "m", 2, 29.5, 300, 100.0)
    assert not class_held(st, "m", 2, 29.5, 200, 101.0) and not class_held(st, "m", 2, 29.5, 300, 102.0)
    # Nor once the classes above alone take the worker: the low class no longer overloads it.
    st.held_classes.add(("m", 2))
    for t in np.arange(100.0, 130.0, 1 / 14):
        st.note_arrival("m", 0, 1, t)
    assert not class_held(st, "m", 2, 29.5, 300, 130.0)
    q = ModelQueue("m")
    low, normal = Request(1, "m", 1, 2, 0.0, math.inf), Request(2, "m", 1, 1, 0.0, math.inf)
    q.push(low)
    q.push(normal)
    assert q.promote_aged(3 * AGING_S, AGING_S, held=(False, False, True)) == 1 and (low.priority, normal.priority) == (2, 0)
    assert q.promote_aged(3 * AGING_S, AGING_S) == 1 and low.priority == 1


def test_the_aging_period_does_not_follow_the_learned_batch_cap():
    """Timings that make B=4 look the most efficient size (as noisy live knots did) cap the
    batches at 4; the aging period stays 8 full (max) batches, or a flood's low requests are
    promoted above the urgent ones before their timeout."""
    core, _ = minilm_core()
    curve = core.state.costs[("m", "cpu")]
    for _ in range(3):
        for b, factor in ((4, 0.9), (8, 1.0), (32, 1.0)):
            curve.observe(b, factor * (LAUNCH_S + PER_ITEM_S * b))
    assert core.state.batch_cap("m", core.state.workers["amx0"]) == 4
    assert aging_period(core.state, "m") == 8 * curve.predict(MAX_BATCH)


def test_low_batches_stay_short_while_urgent_requests_arrive():
    for urgent_seen, want in ((False, MAX_BATCH), (True, 3)):
        core, _ = minilm_core()
        for i in range(40):
            core.admit("m", 1, 2, 60.0, 0.0, req_id=i)
        if urgent_seen:
            core.state.note_arrival("m", 0, 1, 0.0)
        (batch,) = core.decide(0.5)
        # 3 items: the shortest batch within 10 % of the best time per item (124.5 vs 114.9 ms)
        assert batch.items == want, urgent_seen


def test_a_flooded_low_class_is_served_newest_first():
    """Ten old low requests 0.3 s from their deadlines (one alone takes 146 ms, the short batch
    of 3 373 ms) ahead of ten fresh ones. Oldest first, the batch was cut to the old requests
    that still make it (2 items, the least efficient sizes) and every later batch likewise;
    newest first it has the short size and fresh requests. With no old requests, FIFO."""
    for old_timeout, want in ((0.3, [19, 18, 17]), (60.0, [0, 1, 2])):
        core, failed = minilm_core()
        for i in range(20):
            core.admit("m", 1, 2, old_timeout if i < 10 else 60.0, 0.0, req_id=i)
        core.state.note_arrival("m", 0, 1, 0.0)  # urgent traffic: low batches are short (3)
        (batch,) = core.decide(0.0)
        assert [r.req_id for r in batch.requests] == want and not failed, old_timeout


def test_a_counted_batch_takes_the_flooded_low_class_newest_first_too():
    """take_batch with max_requests (escape:K's CPU share) pops the same end that ``take`` does:
    it used to ignore newest-first and take the oldest low requests."""
    q = ModelQueue("m")
    for i in range(5):
        q.push(Request(seq=i, model="m", items=1, priority=2, arrival=float(i), deadline=math.inf, req_id=i))
    assert [r.req_id for r in take_batch(q, 8, 8, max_requests=2, newest_first=1 << 2)] == [4, 3]
    assert [r.req_id for r in take_batch(q, 8, 8, max_requests=2)] == [0, 1]


def test_high_priority_under_a_flood_simulated():
    """SIMULATED, the live bench's load: high 10 %, normal 20 %, low 150 % of the core's limit with
    a 5 s timeout. Before: low completions 0/s (every low batch ran past its deadline) and high
    p99 37x its p99 alone (aged low requests ahead of it); now both stay useful. Low completions
    were 0.40 x the limit with the low class served oldest first (batches cut to the one or two
    requests that still made their deadlines), 0.54 x newest first once it is flooded."""
    cpu = Device("amx0", "cpu", LAUNCH_S, PER_ITEM_S, max_batch=MAX_BATCH)
    limit = MAX_BATCH / (LAUNCH_S + PER_ITEM_S * MAX_BATCH)
    rates = np.array([0.10, 0.20, 1.50]) * limit
    seconds = 300
    trace = with_classes(poisson(rates.sum(), int(rates.sum() * seconds), seed=4), probs=tuple(rates / rates.sum()),
                         timeouts=(math.inf, math.inf, 5.0), seed=5)
    alone = poisson(rates[0], int(rates[0] * seconds), seed=6)
    alone.priority[:] = 0
    p99_alone = np.percentile(simulate("mcb", alone, [cpu]).latency, 99)
    res = simulate("mcb", trace, [cpu])
    warm = trace.arrivals > 20.0
    served = res.status == 0
    high = warm & served & (trace.priority == 0)
    assert np.percentile(res.latency[high], 99) < 4 * p99_alone
    low_per_s = (warm & served & (trace.priority == 2)).sum() / (trace.arrivals[-1] - 20.0)
    assert low_per_s > 0.5 * limit


def test_a_light_low_stream_beside_normal_work_that_takes_every_cpu_keeps_up():
    """SIMULATED (``python -m batchyard.bench.priority_padding --beside-every-cpu``): 40 normal
    requests/s, which alone ask step 1's reservation for every CPU, and 6 low ones. The low class rode in the GPU's batches by the padding share alone (about one item a
    batch, fewer than arrived) while the reservation kept the CPUs for normal arrivals, and
    waited for aging (22.8 s to the normal class here): its p99 was 3.97-5.67 s (escape:2's
    0.72-0.98 s). Now normal batches are padded at the low class's arrival rate."""
    for seed in (1, 2):
        r = beside_every_cpu(1, seed)
        assert r["low"][1] < 2.0, (seed, r)
        assert r["normal"][1] < 1.0, (seed, r)


def test_a_light_low_stream_beside_high_work_waits_about_one_full_batch_not_for_aging():
    """Beside high work the padding keeps up with the low class once it has waited a full GPU
    batch (1.43 s here): p99 about that, not the 3.97-5.67 s it took to age."""
    for seed in (1, 2):
        r = beside_every_cpu(0, seed)
        assert r["low"][1] < 3.0, (seed, r)
        assert r["high"][1] < 1.0, (seed, r)


def test_a_low_flood_the_bound_cannot_keep_up_with_costs_the_high_class_nothing(monkeypatch):
    """A low flood a batch at most twice as long cannot keep up with (27/s, past the 25/s of one
    GPU at 0.15 s + 0.02 s an item) was padded for whenever the decaying rate estimate dipped
    below 25/s: 71-85 times in 120 s, the high class's p99 1.39-1.62 -> 1.61-1.94 s, the low class
    no better off (its p99 aging's 24 s). Now its queue's own rate counts too."""
    from batchyard import policy_mcb
    from batchyard.bench.traces import merge

    gpu = [Device("g", "gpu", 0.15, 0.02, max_batch=64)]
    capacity = 64 / (0.15 + 0.02 * 64)

    def high_p99(seed: int) -> float:
        high = poisson(0.2 * capacity, int(0.2 * capacity * 120), seed=seed)
        low = poisson(0.6 * capacity, int(0.6 * capacity * 120), seed=seed + 100)
        high.priority[:], low.priority[:] = 0, 2
        trace = merge(high, low)
        res = simulate("mcb", trace, gpu)
        return np.percentile(res.latency[(trace.priority == 0) & (res.status == 0)], 99)

    for seed in (1, 2):
        kept_up = high_p99(seed)
        with monkeypatch.context() as m:
            m.setattr(policy_mcb, "_keep_up_rate", lambda *a: 0.0)
            share_alone = high_p99(seed)
        assert kept_up <= 1.02 * share_alone, (seed, kept_up, share_alone)
