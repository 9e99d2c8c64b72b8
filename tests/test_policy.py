"""decide() on crafted states with a virtual clock, seeds' curves: GPU 0.15 ms + 0.02 ms*B, AMX 0.08 ms*B."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from batchyard.bench.sim_report import AMX4_MINILM, H200_MINILM  # measured: bench/results/gpu_h200.md
from batchyard.cost_model import OUTLIER_FACTOR, ArrivalRate, CostCurve
from batchyard.policy import AGING_S, MarginalCost, ThreeSegment, crossover_sizes, feasible, make_policy, plan
from batchyard.policy_mcb import amortises_launch
from batchyard.state import QUEUED, Request, SchedulerState, WorkerState

MS = 1e-3


def seeds_state(n_queued=0, lam_per_s=0.0, gpu_busy_until=None, cpu=True, deadline=math.inf, now=1.0):
    st = SchedulerState()
    st.costs[("m", "gpu")] = CostCurve(launch_s=0.15 * MS, per_item_s=0.02 * MS)
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.0, per_item_s=0.08 * MS)
    st.costs[("m", "gpu")].samples = st.costs[("m", "cpu")].samples = 100
    g = WorkerState("gpu0", "gpu", {"m": 64})
    if gpu_busy_until is not None:
        g.inflight, g.busy_until = 1, gpu_busy_until
    st.add_worker(g)
    if cpu:
        st.add_worker(WorkerState("cpu0", "cpu", {"m": 64}))
    st.arrivals["m"] = ArrivalRate(tau_s=0.25, initial=lam_per_s)
    st.arrivals["m"]._t = now
    q = st.queue("m")
    for i in range(n_queued):
        q.push(Request(i, "m", 1, 1, now - 1e-5 * (n_queued - i), deadline))
    return st


def paths(decision):
    return [(d.worker.path, len(d.requests)) for d in decision.dispatches]


def test_a_worker_running_past_its_prediction_is_not_waited_for_as_if_it_ended_now():
    # A node's start with no profile (`batchyard demo`): both curves are the prior's (0.11 ms for
    # one item). The CPU's first request, sent at 18 ms, runs MiniLM for 250 ms; the GPU's first
    # batch has come back (1.6 ms). At 32 ms a request arrives. Taken to end "now", the overdue
    # CPU looked free and 15x faster than the GPU: the request was held for it, and so was every
    # one until its batch ended (demo: p99 207 ms; 7 ms past the first second).
    st = SchedulerState()
    cpu, gpu = WorkerState("cpu0", "cpu", {"m": 32}), WorkerState("gpu0", "gpu", {"m": 32})
    st.add_worker(cpu)
    st.add_worker(gpu)
    st.cost("m", "gpu").observe(1, 1.6 * MS)
    st.on_dispatch(cpu, "m", 1, 0.018)
    st.arrivals["m"] = ArrivalRate(tau_s=0.25, initial=60.0)
    st.queue("m").push(Request(0, "m", 1, 1, 0.032, math.inf))
    d = MarginalCost().decide(st, 0.032)
    assert paths(d) == [("gpu", 1)]
    # Its expected end moves out as it overruns: as long again as the overrun so far.
    assert st.start_time(cpu, 0.032) == pytest.approx(0.032 + (0.032 - cpu.busy_until))


def test_small_queue_goes_to_cpu_at_once():
    st = seeds_state(n_queued=1, lam_per_s=2000)
    d = MarginalCost().decide(st, 1.0)
    assert paths(d) == [("cpu", 1)] and d.wake_at == math.inf


def test_middle_queue_waits_until_the_wait_has_cost_what_the_next_arrival_saves():
    # GPU only (no escape route), one request queued, lambda = 30k/s (next arrival in 33.3 us).
    # Sent now it finishes at 0.17 ms, and the next arrival queues behind it and runs alone:
    # latency 0.17 - 0.0333 + 0.17 = 0.3067 ms. Waiting, both leave at 0.0333 + T(2) = 0.223 ms:
    # the arrival's latency is 0.19 ms and the request's batch grows by 0.02 ms, so the wait
    # saves 0.3067 - 0.19 - 0.02 = 0.0967 ms and costs the request the gap, 0.0333 ms: it pays.
    # The gap is exponential: the wait stops once it has cost what the arrival would save
    # (ski rental), 0.0967 ms after the latest arrival — not when lambda has decayed, 0.17 s later.
    st = seeds_state(n_queued=1, lam_per_s=30_000, cpu=False)
    pol = MarginalCost()
    d = pol.decide(st, 1.0)
    assert d.dispatches == [] and d.reasons == {"waited": 1}
    flip = 1.0 + (0.17 + 0.17 - 0.19 - 0.02) * MS - 1 / 30_000
    assert d.wake_at == pytest.approx(flip, abs=1e-12)
    assert pol.decide(st, d.wake_at - 1e-7).dispatches == []
    assert paths(pol.decide(st, d.wake_at)) == [("gpu", 1)]


def test_middle_queue_waits_exactly_until_the_marginal_rule_flips():
    # The wait pays while the expected gap g is below the break-even one: 0.34 - g - 0.21 ms
    # saved > g, i.e. g < 0.065 ms, lambda > 15,384.6/s. Just above it, lambda's decay ends
    # the wait first: at tau * ln(lambda / 15,384.6), before the ski-rental bound (~65 us).
    lam = 15_386.0
    st = seeds_state(n_queued=1, lam_per_s=lam, cpu=False)
    pol = MarginalCost()
    d = pol.decide(st, 1.0)
    assert d.dispatches == [] and d.reasons == {"waited": 1}
    flip = 1.0 + 0.25 * math.log(lam * 0.065 * MS)
    assert flip < 1.0 + (0.13 * MS - 1 / lam)
    assert d.wake_at == pytest.approx(flip, abs=1e-9)
    assert pol.decide(st, flip - 1e-7).dispatches == []
    assert paths(pol.decide(st, flip + 1e-9)) == [("gpu", 1)]


def test_large_queue_goes_to_gpu_at_once():
    st = seeds_state(n_queued=40, lam_per_s=30_000)
    d = MarginalCost().decide(st, 1.0)
    assert sum(n for _, n in paths(d)) == 40
    assert ("gpu", 40) in paths(d) or paths(d)[-1][0] == "gpu"


def test_busy_gpu_gets_the_tail_and_the_free_cpu_the_head():
    # The old rule sent the whole batch to the busy GPU (0.65 ms for all 20) and left the CPU
    # idle. Now the free CPU serves the head at once, one request after another (a CPU batch
    # amortises nothing: it would only make its first request wait for its last), and the
    # rest waits for the GPU, which frees at 0.1 ms.
    st = seeds_state(n_queued=20, lam_per_s=5_000, gpu_busy_until=1.0 + 0.1 * MS)
    d = MarginalCost().decide(st, 1.0)
    assert paths(d) == [("cpu", 1)] and d.dispatches[0].requests[0].seq == 0
    # The items held for the GPU are looked at again when it should be free; the CPU's end
    # needs no wake-up of its own: its completion decides again.
    assert st.queue("m").requests == 19 and d.wake_at == pytest.approx(1.0 + 0.1 * MS)


def test_a_free_gpu_takes_the_items_the_busy_cpus_will_not_reach_before_its_batch_ends():
    # Two CPUs at 0.08 ms an item, busy for 0.01 ms more; a free GPU of max batch 8 (0.15 ms +
    # 0.02 ms an item); 20 queued. The GPU's batch of 8 ends at 0.31 ms, by when the CPUs have
    # served 6 items one by one. Taken from behind the 2 items held for the CPUs (2..9), its
    # oldest waited for it while the CPUs served 10..13 before it ended: newer requests done
    # before older ones, the tail longer for the same finish times. It takes 6..13; taking the
    # newest (12..19) would leave 6..11 waiting past its end for the CPUs.
    st = seeds_state(n_queued=20, lam_per_s=5_000, cpu=False)
    st.workers["gpu0"].models["m"] = 8
    for name in ("cpu0", "cpu1"):
        cpu = WorkerState(name, "cpu", {"m": 64})
        st.add_worker(cpu)
        cpu.inflight, cpu.busy_until = 1, 1.0 + 0.01 * MS
    d = MarginalCost().decide(st, 1.0)
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == [("gpu0", list(range(6, 14)))]
    assert [r.seq for r in st.queue("m").by_priority[1]] == list(range(6)) + list(range(14, 20))


def test_a_burst_beside_fast_cpus_gives_a_launch_heavy_gpu_only_what_they_cannot_end_before_it():
    # Held-out seed 16's scenario 6: a GPU of 0.579 ms + 0.0267 ms an item beside three CPUs at
    # 0.046 ms an item, busy for 0.01 ms more; a burst has queued 45. The GPU used to take every
    # item no CPU's first batch held, 42 of them, in a batch ending at 1.70 ms, while the CPUs,
    # done with the 3 they held by 0.06 ms, served the arrivals after them: the burst's oldest
    # requests were its slowest (SIMULATED there at 60 % load: p99 1.64 ms, 1.42x window:0,8's).
    # The CPUs end 41 of them by 0.69 ms; the GPU takes the 4 they would reach last, ending then.
    st = SchedulerState()
    st.costs[("m", "gpu")] = CostCurve(launch_s=0.579 * MS, per_item_s=0.0267 * MS)
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.0, per_item_s=0.046 * MS)
    st.costs[("m", "gpu")].samples = st.costs[("m", "cpu")].samples = 100
    st.add_worker(WorkerState("gpu0", "gpu", {"m": 64}))
    for name in ("cpu0", "cpu1", "cpu2"):
        cpu = WorkerState(name, "cpu", {"m": 64})
        st.add_worker(cpu)
        cpu.inflight, cpu.busy_until = 1, 1.0 + 0.01 * MS
    st.arrivals["m"] = ArrivalRate(tau_s=0.25, initial=16_800)
    st.arrivals["m"]._t = 1.0
    for i in range(45):
        st.queue("m").push(Request(i, "m", 1, 1, 1.0 - 1e-6 * (45 - i), math.inf))
    d = MarginalCost().decide(st, 1.0)
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == [("gpu0", [41, 42, 43, 44])]
    assert st.queue("m").requests == 41 and d.wake_at == pytest.approx(1.0 + 0.01 * MS)  # the CPUs' ends


def test_a_queue_waiting_on_busy_workers_only_sets_no_wake_up():
    # Every worker busy, one of them past its predicted end: nothing can be sent before a
    # completion, which decides again. A wake-up at a busy worker's predicted end (and, once it
    # is overdue, at its doubling overrun) only found it still busy: live at 70 req/s on one
    # core the dispatcher woke 2.3 times a request (1.5 without them).
    st = seeds_state(n_queued=5, lam_per_s=5_000, gpu_busy_until=1.0 + 0.1 * MS)
    cpu = st.workers["cpu0"]
    cpu.inflight, cpu.busy_until = 1, 1.0 - 0.01 * MS  # overdue
    for now in (1.0, 1.0 + 0.2 * MS):  # the GPU overdue too
        d = MarginalCost().decide(st, now)
        assert d.dispatches == [] and d.wake_at == math.inf
    assert st.queue("m").requests == 5


def test_free_cpus_take_their_share_while_the_gpu_finishes():
    # Issue 10's state: GPU busy until 0.250 ms, now 0.196 ms, 8 queued, both CPUs free. The
    # old rule sent nothing and set no wake-up; now both CPUs start at once and the rest waits
    # for the GPU (it frees first, at 0.250 ms: that is the wake-up).
    now = 0.196 * MS
    st = seeds_state(n_queued=8, lam_per_s=35_000, gpu_busy_until=0.250 * MS, now=now)
    st.add_worker(WorkerState("cpu1", "cpu", {"m": 64}))
    d = MarginalCost().decide(st, now)
    assert paths(d) == [("cpu", 1), ("cpu", 1)]
    assert st.queue("m").requests == 6 and d.wake_at == pytest.approx(0.250 * MS)


def test_oldest_request_waits_for_the_busy_worker_that_finishes_it_first():
    # The CPU frees in 0.02 ms and serves one request in 0.08 ms (done at 0.10 ms); the free
    # GPU's batch takes at least 0.17 ms. The plan gives the head to the CPU, so the GPU's
    # batch is taken from behind it. Before, the free GPU took the FIFO head and the oldest
    # request finished later than the plan said it could: the whole of MCB's p99 tail. By the
    # end of the GPU's batch of 4 (0.23 ms) the CPU has served two (0.10 and 0.18 ms): the GPU
    # takes the 4 behind them (step 6a; until 2026-12-02 it took 1..5 and ended at 0.25 ms).
    st = seeds_state(n_queued=6, lam_per_s=1000)
    cpu = st.workers["cpu0"]
    cpu.inflight, cpu.busy_until = 1, 1.0 + 0.02 * MS
    d = MarginalCost().decide(st, 1.0)
    assert [x.worker.name for x in d.dispatches] == ["gpu0"]
    sent = [r.seq for r in d.dispatches[0].requests]
    assert sent == [2, 3, 4, 5]
    q = st.queue("m")
    assert [r.seq for r in q.by_priority[1]] == [0, 1]
    assert d.wake_at == pytest.approx(cpu.busy_until)


def test_expected_arrivals_do_not_take_the_head_from_a_cpu_about_to_free():
    # 3 queued at 16k req/s, the CPU frees in 5 us, the GPU is free. The plan counts a share
    # of the arrivals of its horizon (FUTURE_SHARE of lambda*H): the head waits 5 us for the
    # CPU (done at 0.085 ms) and the GPU takes the other two. Counting all lambda*H as present
    # from now gave them the CPU's next slots and sent all three to the GPU (0.21 ms).
    st = seeds_state(n_queued=3, lam_per_s=16_000)
    cpu = st.workers["cpu0"]
    cpu.inflight, cpu.busy_until = 1, 1.0 + 0.005 * MS
    d = MarginalCost().decide(st, 1.0)
    assert paths(d) == [("gpu", 2)] and [r.seq for r in d.dispatches[0].requests] == [1, 2]
    assert st.queue("m").by_priority[1][0].seq == 0
    assert d.wake_at == pytest.approx(cpu.busy_until)


def lone_request_with_busy_cpus(lam_per_s: float, cpu_ms_per_item: float, busy_ms: tuple) -> SchedulerState:
    """One request queued at 1.0 s, the seeds' GPU free, two CPUs at ``cpu_ms_per_item`` ms an
    item, busy for ``busy_ms`` from now."""
    st = seeds_state(n_queued=1, lam_per_s=lam_per_s)
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.0, per_item_s=cpu_ms_per_item * MS)
    st.costs[("m", "cpu")].samples = 100
    st.add_worker(WorkerState("cpu1", "cpu", {"m": 64}))
    for name, ms in zip(("cpu0", "cpu1"), busy_ms):
        w = st.workers[name]
        w.inflight, w.busy_until = 1, 1.0 + ms * MS
    return st


def test_no_wait_for_a_second_arrival_that_another_worker_will_be_free_for():
    # CPUs 2x slower than the seeds' (0.16 ms an item), both busy, the GPU free, one request
    # queued at 13.3k req/s. The marginal rule alone waits for a second arrival (it saves the
    # 0.16 ms that arrival would cost alone); but cpu0 is free again before that arrival is
    # due (75 us), so it would be served at once there and the wait only delays this request.
    st = lone_request_with_busy_cpus(13_300, 0.16, busy_ms=(0.0275, 0.0745))
    d = MarginalCost().decide(st, 1.0)
    assert paths(d) == [("gpu", 1)] and "waited" not in d.reasons


def test_a_free_gpu_sends_a_lone_request_when_a_cpu_would_serve_the_next_arrival_sooner():
    # CPUs 1.75x slower than the seeds' (0.14 ms an item), busy until 0.07 and 0.10 ms; the GPU
    # is free; one request queued at 20k req/s (next arrival in 0.05 ms). The compute rule
    # (one more request saves the 0.14 ms it would cost alone, > 0.05 ms of waiting) held the
    # request for a GPU batch of two. But sent now, the next arrival goes to cpu0 as it frees
    # and is done 0.16 ms after arriving; joining the GPU batch it would take T(2) = 0.19 ms, and
    # the held request 0.05 + 0.02 ms more. Simulated, CPUs 0.14 ms, 45 % load: p50 1.15x
    # escape:1's with the wait, 1.00x without.
    st = lone_request_with_busy_cpus(20_000, 0.14, busy_ms=(0.07, 0.10))
    d = MarginalCost().decide(st, 1.0)
    assert paths(d) == [("gpu", 1)] and "waited" not in d.reasons


def test_plan_spreads_a_queue_over_every_free_worker():
    st = seeds_state(n_queued=64, lam_per_s=1000)
    for i in (1, 2):
        st.add_worker(WorkerState(f"cpu{i}", "cpu", {"m": 64}))
    chunks, end = plan(st, "m", st.serving["m"], 64, 1.0)
    first = {w.name: n for _, w, n in chunks}
    # Every worker starts now; the GPU gets one big batch, each CPU one request now and the
    # next ones back to back; everything planned is done by the plan's end.
    assert first.keys() == {"cpu0", "cpu1", "cpu2", "gpu0"}
    assert first["cpu0"] == first["cpu1"] == first["cpu2"] == 1 and first["gpu0"] > 20
    cpu_share = 64 - first["gpu0"]
    assert end == pytest.approx(1.0 + max(0.15 * MS + 0.02 * MS * first["gpu0"], 0.08 * MS * -(-cpu_share // 3)))
    # Alone, the GPU gets one batch of everything up to its max batch.
    chunks, _ = plan(st, "m", [st.workers["gpu0"]], 100, 1.0)
    assert [(w.name, n) for _, w, n in chunks] == [("gpu0", 64)]


def test_the_overflow_of_a_full_gpu_batch_waits_for_the_next_one_not_a_slow_cpu():
    # 100 queued at 40k req/s, the GPU busy for 1 ms more, a CPU free but 20x slower. The GPU's
    # next batch is full at 64; the rest are done soonest in the GPU batch after it (~3 ms),
    # not on the CPU (~50 ms for a batch of 16). The plan used to give a full GPU no more
    # items, so the CPU looked free of competition and took 16 (simulated at 90 % of the seeds'
    # GPU capacity on these curves: p99 49.7 ms against gpu-only's 1.9 ms).
    st = seeds_state(n_queued=100, lam_per_s=40_000, gpu_busy_until=1.0 + 1 * MS)
    st.costs[("m", "gpu")] = CostCurve.from_points(list(H200_MINILM))
    st.costs[("m", "cpu")] = CostCurve.from_points(list(AMX4_MINILM))
    for c in st.costs.values():
        c.samples = 100
    chunks, _ = plan(st, "m", st.serving["m"], 100, 1.0)
    assert [(w.name, n) for _, w, n in chunks] == [("gpu0", 64)]
    d = MarginalCost().decide(st, 1.0)
    assert d.dispatches == [] and d.wake_at == pytest.approx(1.0 + 1 * MS)  # all wait for the GPU
    assert st.queue("m").items == 100


def launch_cpus_state(n_queued: int, gpu_busy_ms: float) -> SchedulerState:
    """The seeds' GPU, busy for ``gpu_busy_ms``, and two free CPUs with a launch (0.04 + 0.12 ms·B),
    at 40k req/s (90 % of that GPU's capacity)."""
    st = seeds_state(n_queued=n_queued, lam_per_s=40_000, gpu_busy_until=1.0 + gpu_busy_ms * MS, cpu=False)
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.04 * MS, per_item_s=0.12 * MS)
    st.costs[("m", "cpu")].samples = 100
    for i in range(2):
        st.add_worker(WorkerState(f"cpu{i}", "cpu", {"m": 64}))
    return st


def test_free_cpus_with_a_launch_take_their_share_of_the_queue_and_the_arrivals_due_before_the_gpu_starts():
    # 4 queued, the GPU busy for 0.3 ms, 20k req/s: 6 arrivals are expected before the GPU can
    # start; the plan of 10 gives the CPUs 2 and 3 and the GPU 5, so the 4 go 2 + 2 (done at
    # 0.28 ms, sooner than the GPU). Counting
    # every arrival of the plan's horizon (step 3's plan) grew a CPU's share until the first
    # CPU took all 4 (done at 0.52 ms) and the second stayed idle: simulated (2 such CPUs, 90 %
    # load, 20k arrivals), CPU batches of 4-8 made MCB's p99 1.23x escape:3's.
    st = launch_cpus_state(4, 0.3)
    st.arrivals["m"] = ArrivalRate(tau_s=0.25, initial=20_000)
    st.arrivals["m"]._t = 1.0
    d = MarginalCost().decide(st, 1.0)
    assert sorted((x.worker.name, len(x.requests)) for x in d.dispatches) == [("cpu0", 2), ("cpu1", 2)]
    # At 40k req/s, 12 arrive before the GPU starts: they will join its batch, so the CPUs' shares
    # of the 16 (3 each; the GPU 10) leave now. Sized by the queue alone (2 each), the CPUs' p99
    # was up to 1.067x the best baseline's on held-out scenarios (docs/policy.md, step 6b).
    st = launch_cpus_state(4, 0.3)
    d = MarginalCost().decide(st, 1.0)
    assert sorted((x.worker.name, len(x.requests)) for x in d.dispatches) == [("cpu0", 3), ("cpu1", 1)]
    # 12 queued, the GPU free in 0.1 ms (4 arrivals before it): each CPU takes at most its share
    # (3), the rest wait for the GPU.
    st = launch_cpus_state(12, 0.1)
    d = MarginalCost().decide(st, 1.0)
    assert sorted((x.worker.name, len(x.requests)) for x in d.dispatches) == [("cpu0", 3), ("cpu1", 2)]
    assert d.wake_at == pytest.approx(1.0 + 0.1 * MS) and st.queue("m").items == 7


def small_launch_cpu_state(n_queued: int) -> SchedulerState:
    """Held-out seed 7, scenario 17 (SIMULATED): a GPU of 0.332 + 0.0304 ms*B, busy for 0.3 ms,
    and one free CPU with a small launch, 0.013 + 0.084 ms*B, at 25k req/s (90 % load)."""
    st = seeds_state(n_queued=n_queued, lam_per_s=25_000, gpu_busy_until=1.0 + 0.3 * MS)
    st.costs[("m", "gpu")] = CostCurve(launch_s=0.332 * MS, per_item_s=0.0304 * MS)
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.013 * MS, per_item_s=0.084 * MS)
    for c in st.costs.values():
        c.samples = 100
    return st


def test_a_cpu_with_a_small_launch_takes_the_batch_that_amortises_it_not_the_queue():
    # 3 items make the 13 us launch under 5 % of the batch (AMORTISED_SHARE); a fourth would
    # only wait for the others. Planned as one batch grown while it was the cheapest place for
    # the next item, the CPU took 7 of 8 (done at 0.60 ms, the first of them too); at 90 % load
    # its batches averaged 4.4 and MCB's p50 was 1.15x escape:3's, its mean 0.720 ms against
    # 0.644. Now 3 leave (done at 0.265 ms) and the rest go in the batches after them.
    st = small_launch_cpu_state(8)
    chunks, _ = plan(st, "m", st.serving["m"], 8, 1.0)
    assert [(w.name, n) for _, w, n in chunks] == [("cpu0", 3), ("gpu0", 1)]
    d = MarginalCost().decide(small_launch_cpu_state(8), 1.0)
    assert paths(d) == [("cpu", 3)]
    # A backlog (over twice the workers' max batches) keeps the batches that save launches.
    d = MarginalCost().decide(small_launch_cpu_state(300), 1.0)
    assert paths(d) == [("cpu", 30)]


def test_a_gpu_beside_cpus_cheaper_per_item_is_not_sized_as_if_they_batched():
    # Held-out seed 6, scenario 7 (SIMULATED): a GPU of 0.181 + 0.0321 ms*B beside two linear CPUs
    # at 0.031 ms*B, so each CPU adds an item more cheaply than the GPU. Step 6b sized the free
    # GPU as if the arrivals it left would join a CPU's next batch; a linear CPU has none, so the
    # GPU took only its share of the queue alone (none of 10) and idled while a burst queued for
    # the CPUs: at 90 % load MCB's p50 was 0.294 ms against escape:1's 0.077, its mean 0.307 against
    # 0.174. The GPU takes its share of the plan with the burst's expected arrivals, 3 items: the
    # newest, since the CPUs (free at 10 and 20 us) end the other 7 by 0.13 ms, before its batch
    # (0.28 ms). Until 2026-12-02 step 6a gave it all 8 their first slots did not hold, ending at
    # 0.44 ms, while the CPUs served newer arrivals before it.
    now = 1.0
    st = SchedulerState()
    st.costs[("m", "gpu")] = CostCurve(launch_s=0.181 * MS, per_item_s=0.0321 * MS)
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.0, per_item_s=0.031 * MS)
    st.costs[("m", "gpu")].samples = st.costs[("m", "cpu")].samples = 100
    st.add_worker(WorkerState("gpu0", "gpu", {"m": 64}))
    for i, busy_s in enumerate((0.02 * MS, 0.01 * MS)):
        cpu = WorkerState(f"cpu{i}", "cpu", {"m": 64})
        cpu.inflight, cpu.busy_until = 1, now + busy_s
        st.add_worker(cpu)
    st.arrivals["m"] = ArrivalRate(tau_s=0.25, initial=79_000)  # a burst at 3x the mean rate
    st.arrivals["m"]._t = now
    for i in range(10):
        st.queue("m").push(Request(i, "m", 1, 1, now - 1e-6 * (10 - i), math.inf))
    d = MarginalCost().decide(st, now)
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == [("gpu0", [7, 8, 9])]
    assert st.queue("m").items == 7
    assert d.wake_at == pytest.approx(now + 0.01 * MS)  # the first CPU's end looks at the 7 again


def test_expiring_deadline_flushes_instead_of_waiting():
    now = 1.0
    # Waiting would pay (lambda high, GPU only) but the tightest deadline is 0.02 ms after the
    # batch's predicted finish (the wait would otherwise end 0.0967 ms after the latest arrival),
    # of which the slack keeps LATE_MARGIN of the batch's 0.17 ms.
    from batchyard.policy_core import LATE_MARGIN

    st = seeds_state(n_queued=1, lam_per_s=30_000, cpu=False, deadline=now + 0.17 * MS + 0.02 * MS)
    d = MarginalCost().decide(st, now)
    flush_at = now + 0.02 * MS - LATE_MARGIN * 0.17 * MS
    assert d.dispatches == [] and d.wake_at == pytest.approx(flush_at, abs=1e-9)
    d = MarginalCost().decide(st, flush_at)
    assert paths(d) == [("gpu", 1)] and d.reasons == {"flushed": 1, "dispatched-gpu": 1}


def test_infeasible_deadline_is_rejected_on_arrival():
    st = seeds_state(gpu_busy_until=1.0 + 5 * MS, cpu=False)
    assert not feasible(st, "m", 1, deadline=1.0 + 1 * MS, now=1.0)
    assert feasible(st, "m", 1, deadline=1.0 + 6 * MS, now=1.0)


def test_aging_promotes_a_starved_low_request():
    """A low request is normal after two aging periods and high after three (docs/policy.md, step
    0); it was high at its first look past two, the normal class's period spent in the low one."""
    st = seeds_state()
    q = st.queue("m")
    low = Request(1, "m", 1, 2, 0.0, math.inf)
    normal = Request(3, "m", 1, 1, 2.5 * AGING_S, math.inf)
    q.push(low)
    q.push(Request(2, "m", 1, 0, 2 * AGING_S, math.inf))
    assert q.promote_aged(2 * AGING_S + 1e-9, AGING_S) == 1 and low.priority == 1
    q.push(normal)
    assert q.promote_aged(2.5 * AGING_S, AGING_S) == 0 and low.priority == 1
    assert q.promote_aged(3 * AGING_S + 1e-9, AGING_S) == 1 and low.priority == 0 and normal.priority == 1
    assert q.promote_aged(3.5 * AGING_S + 1e-9, AGING_S) == 1 and normal.priority == 0
    assert [r.seq for r in q.take(3)] == [2, 1, 3]


def test_three_segment_derives_b1_b2_from_the_curves():
    st = seeds_state()
    b1, b2 = crossover_sizes(st, "m", 64)
    assert (b1, b2) == (3, 15)  # 0.08B >= 0.15+0.02B from B=2.5; 0.15+0.02B >= 0.45 from B=15
    d = ThreeSegment().decide(seeds_state(n_queued=2, lam_per_s=1000), 1.0)
    assert paths(d) == [("cpu", 2)]
    d = ThreeSegment().decide(seeds_state(n_queued=20, lam_per_s=1000), 1.0)
    assert paths(d) == [("gpu", 20)]


def test_cost_curve_learns_online_and_ignores_outliers():
    c = CostCurve()
    for _ in range(50):
        for b in (1, 4, 16, 64):
            c.observe(b, 0.15e-3 + 0.02e-3 * b)
    assert c.launch_s == pytest.approx(0.15e-3, rel=0.05)
    assert c.per_item_s == pytest.approx(0.02e-3, rel=0.05)
    assert not c.observe(4, 0.1)  # a 100 ms GC pause is not the curve
    assert c.outliers == 1 and c.predict(4) == pytest.approx(0.23e-3, rel=0.05)


def test_piecewise_fit_where_a_line_is_poor():
    # The MLP on AMX: flat to B=16, then rising (MEASUREMENTS.md, 1 thread).
    pts = [(1, 3.4e-3), (4, 3.2e-3), (16, 3.6e-3), (64, 6.9e-3)]
    c = CostCurve.from_points(pts)
    assert c.mode == "piecewise"
    assert c.predict(4) == pytest.approx(3.2e-3) and c.predict(40) == pytest.approx(5.25e-3)


def test_arrival_rate_tracks_a_step_within_a_second():
    r = ArrivalRate(tau_s=0.25)
    t = 0.0
    for _ in range(1000):  # 1000/s for 1 s
        t += 1e-3
        r.arrive(t)
    assert r.rate(t) == pytest.approx(1000, rel=0.1)
    for _ in range(5000):  # step to 5000/s
        t += 2e-4
        r.arrive(t)
        if t >= 1.5:
            break
    assert r.rate(t) == pytest.approx(5000 * (1 - math.exp(-0.5 / 0.25)) + 1000 * math.exp(-0.5 / 0.25), rel=0.05)


def test_arrival_rate_is_right_from_the_second_arrival():
    # 1000/s from a start at t = 5 s: after 50 ms the estimate is 1000/s, not the 18 % of it an
    # uncorrected decaying count shows 50 ms in (the next request believed 5x further away).
    r = ArrivalRate(tau_s=0.25)
    assert r.rate(0.0) == 0.0
    t = 5.0
    r.arrive(t)
    assert r.rate(t) == 0.0  # one arrival says nothing of a rate
    for _ in range(50):
        t += 1e-3
        r.arrive(t)
    assert r.rate(t) == pytest.approx(1000, rel=0.05)
    # The flip time of the decaying estimate stays exact while the correction still moves.
    when = r.time_when_rate_is(100.0, t)
    assert when > t and r.rate(when) == pytest.approx(100.0, rel=1e-9)


def test_arrivals_in_the_same_instant_give_a_finite_rate():
    # Three requests admitted at t = 0 (a client's burst): the rate is high, not infinite, and
    # the policy can still be asked (it raised ZeroDivisionError).
    r = ArrivalRate(tau_s=0.25)
    for _ in range(3):
        r.arrive(0.0)
    assert 0 < r.rate(0.0) < math.inf
    assert math.isfinite(r.time_when_rate_is(10.0, 0.0))


def test_the_arrival_rates_window_holds_enough_arrivals_at_a_low_rate_and_is_0_25_s_at_a_high_one():
    """A fixed 0.25 s window held ~5 arrivals at 22 req/s: an estimate +-45 %, on which MCB
    waited for company it did not get (below). The window now lasts TAU_ARRIVALS arrivals where
    0.25 s holds fewer; at the simulator's rates it is 0.25 s to the last bit."""
    from batchyard.cost_model import TAU_ARRIVALS, TAU_S

    rng = np.random.default_rng(1)
    slow, t, errors = ArrivalRate(), 0.0, []
    for i in range(2000):  # Poisson at 20/s
        t += rng.exponential(1 / 20)
        slow.arrive(t)
        if i >= 200:
            errors.append(abs(slow.rate(t) / 20 - 1))
    assert slow.tau == pytest.approx(TAU_ARRIVALS / 20, rel=0.3)
    assert np.percentile(errors, 90) < 0.25
    # the stream stops: the long window does not keep the next request near for seconds
    assert slow.rate(t + 1.0) <= 3.0 and slow.time_when_rate_is(3.0, t) <= t + 1.0
    # After a quiet spell (0.2/s for a minute, a 10 s window) a stream starts at 100/s: sized by
    # its own estimate, the window took ~2 s to reach half of it (11/s after 1 s), and MCB's
    # reservation for urgent requests at 40/s came 4.3 s late; it follows the last 0.25 s now.
    quiet, t = ArrivalRate(), 0.0
    while t < 60:
        t += rng.exponential(1 / 0.2)
        quiet.arrive(t)
    assert quiet.tau == 10.0
    start = t
    while t < start + 0.5:
        t += rng.exponential(1 / 100)
        quiet.arrive(t)
    assert quiet.rate(t) >= 50
    fast, fixed, t = ArrivalRate(), ArrivalRate(tau_s=TAU_S), 0.0
    for _ in range(20_000):  # Poisson at 5,000/s
        t += rng.exponential(1 / 5000)
        fast.arrive(t)
        fixed.arrive(t)
        assert fast.rate(t) == fixed.rate(t) and fast.rate(t + 1e-4) == fixed.rate(t + 1e-4)
    assert fast.tau == TAU_S and fast.time_when_rate_is(100.0, t) == fixed.time_when_rate_is(100.0, t)


def test_mcb_waits_for_company_on_a_rate_it_can_trust_at_tens_of_requests_a_second():
    """The seeds' curves scaled to milliseconds (GPU 150 ms + 20 ms an item, two CPUs at 80 ms
    an item), Poisson at 50 % of the GPU's capacity, 22 req/s: on the 0.25 s window MCB's p99
    was 1.068 times escape:2's (1.04-1.11 on eight traces), SIMULATED."""
    from batchyard.bench import live_vs_sim as L

    devices = L.scaled_devices(1000.0, "seeds")
    rate = 0.5 * L.gpu_capacity(devices)
    trace = L.trace_for(L.load_spec(rate, 3000 / rate, 1))
    mcb, escape = L.sim_summary("mcb", trace, devices), L.sim_summary("escape:2", trace, devices)
    assert mcb["served"] == escape["served"] == len(trace)
    assert mcb["p99_ms"] < escape["p99_ms"] and mcb["p50_ms"] < escape["p50_ms"]


def test_multi_item_request_is_never_stranded_with_workers_idle():
    # The split point can fall inside a multi-item request (issue 10, item 3): a 3-item
    # request and two idle workers must not end with nothing sent and no wake-up.
    st = seeds_state(lam_per_s=1000)
    st.add_worker(WorkerState("cpu1", "cpu", {"m": 64}))
    st.queue("m").push(Request(7, "m", 3, 1, 1.0 - 1e-5, math.inf))
    d = MarginalCost().decide(st, 1.0)
    assert [len(x.requests) for x in d.dispatches] == [1]
    assert st.queue("m").requests == 0


def test_a_size_that_takes_what_its_knot_says_is_learnt_though_the_line_says_less():
    # Live on one AMX core past saturation (MiniLM): the backlog's big batches (their knots
    # below, measured there) fitted a line with a negative launch, T(1) = 1.9 ms, so the plan
    # sent one request at a time; each took the 16 ms size 1 had always taken, and each was
    # rejected as an outlier of the line: the curve never moved again (batches of 1 for good).
    c = CostCurve()
    for _ in range(10):
        c.observe(1, 16e-3)
    for _ in range(200):
        for b, t in ((14, 117.3e-3), (18, 163.8e-3), (32, 290.3e-3)):
            c.observe(b, t)
    c.mode = "linear"  # as it was live (the knots now turn such a curve piecewise: next test)
    assert c.predict(1) * OUTLIER_FACTOR < 16e-3  # the line of the lock
    for _ in range(20):
        assert c.observe(1, 16e-3)
    assert c.outliers == 0
    assert c.predict(1) == pytest.approx(16e-3, rel=0.1)
    assert amortises_launch(c)  # batches pay again: the plan grows them


def test_a_curve_learnt_online_predicts_from_its_knots_where_the_line_misses_them():
    # MiniLM on one AMX core, measured alone: batching saves much up to B=8-16, and B=32 is
    # slower per item. The least-squares line through those points puts B=1 at 9.5 ms (35 %
    # short) and B=16 11 % long; the knots are what the curve predicts from then on.
    pts = {1: 14.6e-3, 2: 20.1e-3, 4: 31.1e-3, 8: 54.2e-3, 16: 102.9e-3, 32: 232.5e-3}
    c = CostCurve()
    for _ in range(20):
        for b, t in pts.items():
            c.observe(b, t)
    assert c.mode == "piecewise"
    for b, t in pts.items():
        assert c.predict(b) == pytest.approx(t, rel=0.01)
    # A device whose times a line does fit, with 10 % noise, keeps its line.
    rng = random.Random(1)
    c = CostCurve()
    for _ in range(200):
        for b in (1, 2, 4, 8, 16, 32):
            c.observe(b, (1e-3 + 0.5e-3 * b) * (1 + 0.1 * rng.gauss(0, 1)))
    assert c.mode == "linear"


def test_a_device_that_turns_several_times_slower_is_learnt():
    # Rejected one by one, a device 4x slower than its curve would never be learnt: every
    # sample it sends is an outlier. Slow batches in a row are the device, not GC pauses.
    c = CostCurve()
    for _ in range(50):
        for b in (1, 8):
            c.observe(b, 1e-3 + 1e-4 * b)
    assert not c.observe(1, 4 * 1.1e-3) and not c.observe(8, 4 * 1.8e-3)
    for _ in range(40):
        for b in (1, 8):
            c.observe(b, 4 * (1e-3 + 1e-4 * b))
    assert c.predict(1) == pytest.approx(4.4e-3, rel=0.1)
    assert c.predict(8) == pytest.approx(7.2e-3, rel=0.1)
    assert not c.observe(8, 0.5)  # a lone GC pause is still one


def test_a_slow_spell_learnt_is_unlearnt_within_a_few_batches_once_it_is_over():
    # A co-located job made batches 40x slower for 20 batches, so the knot learnt them (a run
    # is the device, not GC). Faster samples then moved it 1.25 % a batch through the clipped
    # running mean: 3 ms batches were predicted at 118 ms hundreds of batches later, and
    # admission refused every request of a 100 ms timeout meanwhile.
    c = CostCurve()
    for _ in range(400):
        c.observe(1, 3e-3)
    for _ in range(20):
        c.observe(1, 120e-3)
    assert c.predict(1) > 100e-3
    for _ in range(3):
        c.observe(1, 3e-3)
    assert c.predict(1) == pytest.approx(3e-3, rel=0.1)
    for _ in range(20):
        c.observe(1, 3e-3)
    c.observe(1, 0.5e-3)  # one fast batch alone (a partial failure) moves it little
    assert c.predict(1) == pytest.approx(3e-3, rel=0.1)


def test_a_model_of_two_batch_times_is_predicted_at_their_mean_not_flipped_to_the_fast_one():
    # Half its batches 1 ms, half 10 ms (short and long inputs): the knot, an average of both,
    # was restarted at 1 ms by every three fast batches in a row, and predicted so 49 % of the
    # time (admitting work the worker could not do in time).
    rng = random.Random(0)
    c = CostCurve()
    below = 0
    for i in range(3000):
        for b in (1, 8):
            c.observe(b, (0.001 if rng.random() < 0.5 else 0.010) * (1 + 0.1 * (b - 1)))
        below += i >= 300 and c.predict(1) < 0.0055 / 2
    assert below < 0.01 * 2700


def test_a_calibrated_curve_rejects_an_outlier_from_its_first_online_sample():
    """A profile has fewer points than the samples an online curve waits for before it judges:
    one 30x batch right after a six-point calibration moved T(1) from 1.5 to 30.5 ms."""
    c = CostCurve.from_points([(b, 1e-3 + 0.5e-3 * b) for b in (1, 2, 4, 8, 16, 32)])
    assert not c.observe(3, 30 * c.predict(3))
    assert c.predict(1) == pytest.approx(1.5e-3)


def test_batches_of_one_size_never_teach_a_negative_time_per_item():
    # One size cannot tell launch from per-item time, and RLS split each error between them:
    # batches of 1 from a device faster than the prior drove the per-item time negative, T(B)
    # read 0 for B >= 4, and 8 items were admitted within 30 us on a device that needs 120.
    c = CostCurve()
    for _ in range(200):
        c.observe(1, 50e-6)
    assert c.per_item_s > 0
    assert c.predict(1) == pytest.approx(50e-6, rel=0.05)
    assert all(c.predict(b + 1) > c.predict(b) for b in range(1, 64))


@pytest.mark.parametrize("seed", [1, 4])
def test_batches_of_many_sizes_keep_the_least_squares_averaging(seed):
    # The one-size rule (a line scaled onto the sample) fired on any sample of a device whose
    # time barely grows with B, snapping the line onto each noisy sample: T(4) off by 7 %
    # on average, against 0.4 % with RLS's own averaging.
    import random

    rnd, c, errs = random.Random(seed), CostCurve(), []
    for i in range(1000):
        c.observe(rnd.randint(1, 8), 2e-3 * (1 + rnd.gauss(0, 0.10)))
        if i >= 300:
            errs.append(abs(c.predict(4) - 2e-3) / 2e-3)
    assert sum(errs) / len(errs) < 0.015


# ---------------------------------------------------------------- deadlines beside other workers

def _slow_gpu_fast_cpu(cpu_max_batch: int = 8) -> SchedulerState:
    st = SchedulerState()
    st.add_worker(WorkerState("gpu0", "gpu", {"m": 64}))
    st.add_worker(WorkerState("cpu0", "cpu", {"m": cpu_max_batch}))
    st.costs[("m", "gpu")] = CostCurve(launch_s=10e-3, per_item_s=1e-6)
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.0, per_item_s=0.1e-3)
    return st


@pytest.mark.parametrize("policy", ["greedy", "escape:1", "window:200,16", "mcb"])
def test_a_request_another_free_worker_serves_in_time_is_not_failed_for_the_first_one(policy):
    """A GPU with a 10 ms launch tried first (greedy, window: registration order; escape: the
    GPU first), a 5 ms timeout: fit_deadlines failed every request for that GPU, beside an idle
    CPU that ends each in 0.1 ms (SIMULATED, 2,000 requests at 200/s: 0 served)."""
    from batchyard.policy import make_policy

    st = _slow_gpu_fast_cpu()
    st.queue("m").push(Request(1, "m", 1, 1, 0.0, 5e-3))
    d = make_policy(policy).decide(st, 1e-3)  # (the window's 200 us have run out)
    assert not d.late
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == [("cpu0", [1])]


@pytest.mark.parametrize("policy", ["greedy", "escape:1", "window:0,8", "mcb"])
def test_a_batch_predicted_to_end_past_a_deadline_keeps_the_prefix_that_ends_in_time(policy):
    """T(B) = 50 + 20 B ms, 4 requests due in 125 ms: 4 end at 130 ms, 3 at 110. The prefix was
    judged as if it ran 10 % faster (117 ms): all 4 went, and on a curve that does not miss all 4
    were late (the review's run, live: 0 of 4 served). Now 3 go and the 4th waits at the head."""
    from batchyard.policy import make_policy

    st = SchedulerState()
    st.add_worker(WorkerState("w0", "gpu", {"m": 8}))
    st.costs[("m", "gpu")] = CostCurve(launch_s=50 * MS, per_item_s=20 * MS)
    for seq in range(1, 5):
        st.queue("m").push(Request(seq, "m", 1, 1, 0.0, 125 * MS))
    d = make_policy(policy).decide(st, 0.0)
    assert not d.late
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == [("w0", [1, 2, 3])]
    assert [r.seq for r in st.queue("m").by_priority[1]] == [4]


def _cpu_reserved_for_urgent_arrivals(gpu_busy_s: float) -> SchedulerState:
    """The slow GPU (busy for ``gpu_busy_s``) and the fast CPU, which 60 urgent requests/s (above
    URGENT_RATE) make MCB keep free for them."""
    from batchyard.policy_mcb import URGENT_RATE

    st = _slow_gpu_fast_cpu()
    st.arrivals["m#urgent"] = ArrivalRate(tau_s=0.25, initial=3 * URGENT_RATE)
    st.arrivals["m#urgent"]._t = 0.0
    if gpu_busy_s:
        gpu = st.workers["gpu0"]
        gpu.inflight, gpu.busy_until = 1, gpu_busy_s
    return st


@pytest.mark.parametrize("gpu_busy_s", [0.0, 8e-3])
def test_a_deadline_at_stake_may_use_the_worker_mcb_reserves_for_urgent_arrivals(gpu_busy_s):
    """High-priority traffic above URGENT_RATE: MCB keeps the CPU free for it and plans low work
    on the GPU alone. A low request the GPU cannot end in time was failed late, the reserved CPU
    idle (SIMULATED: 2,371 of 2,373 low requests failed, CPU 0.6 % busy). Lent where an urgent
    arrival meets the low batch at most as often as the reservation allows (60/s x 0.1 ms) — also
    while the GPU is busy, where the pass ended before its deadline step and the request waited
    for the reservation's lapse (274 ms) past its 5 ms timeout."""
    st = _cpu_reserved_for_urgent_arrivals(gpu_busy_s)
    st.queue("m").push(Request(1, "m", 1, 2, 0.0, 5e-3))  # low, 5 ms
    d = MarginalCost().decide(st, 0.0)
    assert not d.late
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == [("cpu0", [1])]


@pytest.mark.parametrize("gpu_busy_s", [0.0, 8e-3])
def test_a_reserved_worker_is_the_escape_route_of_a_request_no_eligible_worker_could_end_in_time(gpu_busy_s):
    """60 urgent requests/s allow the reserved CPU batches of one item (60/s x 0.1 ms); a 3-item
    low request due in 5 ms is more than that, but the GPU (10 ms) could not have ended it had it
    started at its arrival: the CPU is its only way out, and takes it. Kept for urgent arrivals,
    such requests failed beside the idle CPU (live, SIMULATED devices: 167 of 168 low requests of
    15 ms timeouts, the CPU busy 20 % of the time; an outside review)."""
    from batchyard.policy_mcb import RESERVE_BLOCKING

    st = _cpu_reserved_for_urgent_arrivals(gpu_busy_s)
    st.queue("m").push(Request(1, "m", 3, 2, 0.0, 5e-3))  # low, 3 items, 5 ms
    lam_u = st.urgent_rate("m", 0.0)
    assert lam_u * st.cost("m", "cpu").predict(3) > RESERVE_BLOCKING  # (what the reservation alone refuses)
    d = MarginalCost().decide(st, 0.0)
    assert not d.late
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == [("cpu0", [1])]


@pytest.mark.parametrize("low_per_s, lent", [(100.0, True), (10_000.0, False)])
def test_a_reserved_worker_takes_a_deadline_at_stake_far_from_a_flood_only(low_per_s, lent):
    """600 urgent requests/s keep the CPU (6 % of its time for lone urgent arrivals, past the
    reservation's 1 %). A low request due in 12 ms that the GPU could have ended in time, at
    stake because the GPU is busy until 8 ms: lent the CPU while urgent and low arrivals together
    would keep it busy at most LEND_LOAD of the time (7 % at 100 low/s; failed, 77 of 201 low
    requests of 25 ms timeouts waited for the GPU beside the CPU, live, SIMULATED; an outside
    review), not under a flood (106 %), whose lent batches took the high class's p99 from 1.00 to
    2.14 times its own (sim_report)."""
    from batchyard.policy_mcb import URGENT_RATE

    st = _slow_gpu_fast_cpu()
    st.arrivals["m#urgent"] = ArrivalRate(tau_s=0.25, initial=30 * URGENT_RATE)
    st.arrivals["m#urgent"]._t = 0.0
    st.arrivals["m#low"] = ArrivalRate(tau_s=0.25, initial=low_per_s)
    st.arrivals["m#low"]._t = 0.0
    gpu = st.workers["gpu0"]
    gpu.inflight, gpu.busy_until = 1, 8e-3
    st.queue("m").push(Request(1, "m", 1, 2, 0.0, 12e-3))  # low, 12 ms: the GPU's plan ends at ~18 ms
    d = MarginalCost().decide(st, 0.0)
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == ([("cpu0", [1])] if lent else [])


@pytest.mark.parametrize("quiet_s, lent", [(5e-3, False), (0.2, True)])
def test_the_reservation_for_urgent_arrivals_lapses_once_their_stream_has_gone_quiet(quiet_s, lent):
    """A burst of 170 normal requests in half a second, then none: the decaying arrival count
    still said ~150/s 0.2 s later, MCB kept the fast CPU for urgent arrivals that had stopped, and
    low requests with deadlines only the CPU meets expired beside it (live, sim workers: 115 of
    2,406 low requests with 20 ms timeouts, all in the half second after the burst). Three
    arrivals' worth of silence caps the rate the reservation stands on; 5 ms into the quiet of
    a 340/s stream, the reservation holds."""
    st = _slow_gpu_fast_cpu()
    for i in range(170):
        st.note_arrival("m", 1, 1, i * 0.5 / 170)
    now = 169 * 0.5 / 170 + quiet_s
    # A low flood beside, and a GPU busy for 8 ms more: a low request due in 15 ms, which the GPU
    # alone could have ended in time (10 ms), is at stake, and the held CPU is not lent to it
    # (MarginalCost._lendable); one the GPU could not have ended is, held or not.
    st.arrivals["m#low"] = ArrivalRate(tau_s=0.25, initial=10_000.0)
    st.arrivals["m#low"]._t = now
    gpu = st.workers["gpu0"]
    gpu.inflight, gpu.busy_until = 1, now + 8e-3
    st.queue("m").push(Request(1, "m", 1, 2, now, now + 15e-3))
    d = MarginalCost().decide(st, now)
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == ([("cpu0", [1])] if lent else [])


def test_a_deadline_not_yet_at_stake_beside_a_reserved_worker_sets_a_wake_up_for_when_it_is():
    """Every eligible worker busy, a reserved one free: the pass wakes when the tightest deadline
    comes to be at stake (a GPU still busy then ends its batch after it), and then borrows the CPU."""
    st = _cpu_reserved_for_urgent_arrivals(8e-3)
    st.queue("m").push(Request(1, "m", 1, 2, 0.0, 30e-3))  # low, 30 ms: the GPU's plan ends at ~18 ms
    policy = MarginalCost()
    d = policy.decide(st, 0.0)
    t_gpu = st.cost("m", "gpu").predict(1)
    assert d.dispatches == [] and 8e-3 < d.wake_at <= 30e-3 - t_gpu  # the GPU overruns by then
    d = policy.decide(st, d.wake_at)
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == [("cpu0", [1])]


def test_three_segment_sends_a_head_no_free_cpu_takes_to_the_gpu():
    """3 items below B1, and a free CPU of max batch 1: the head went nowhere, no wake-up, both
    workers free, until more arrivals or its deadline."""
    st = _slow_gpu_fast_cpu(cpu_max_batch=1)
    st.costs[("m", "gpu")] = CostCurve(launch_s=0.7e-3, per_item_s=0.0)  # B1 = 8
    st.queue("m").push(Request(1, "m", 3, 1, 0.0, math.inf))
    d = ThreeSegment().decide(st, 0.001)
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == [("gpu0", [1])] or d.wake_at < math.inf


def test_admission_counts_only_the_workers_that_take_the_request_whole():
    """4 items, a 5 ms timeout: the fast CPU takes 1 item a batch, the GPU that takes 4 is busy
    for 20 ms. Counted on the CPU's speed, the request was admitted and expired queued."""
    st = _slow_gpu_fast_cpu(cpu_max_batch=1)
    gpu = st.workers["gpu0"]
    gpu.inflight, gpu.busy_until = 1, 0.020
    assert not feasible(st, "m", 4, 5e-3, 0.0)
    assert feasible(st, "m", 1, 5e-3, 0.0)


def test_a_profile_whose_line_is_below_zero_at_one_item_predicts_time_there():
    """Points at B=2, 12 and 22 on a line through -1 ms: the fit predicted 0 s for one item, and
    MCB asked to decide again at once."""
    c = CostCurve.from_points([(2, 1e-3), (12, 11e-3), (22, 21e-3)])
    assert c.launch_s >= 0 and c.predict(1) > 0


def test_a_worker_takes_what_it_can_serve_behind_requests_set_aside_for_another():
    """The head can end in time only on the busy CPU, so it is set aside for it; put back at once,
    it was taken again, and the free GPU stayed idle beside a request it could serve."""
    from batchyard.policy import make_policy

    st = _slow_gpu_fast_cpu()
    st.workers["gpu0"].models["m"] = 1  # one request a batch: the head alone is taken first
    cpu = st.workers["cpu0"]
    cpu.inflight, cpu.busy_until = 1, 1e-3  # frees in 1 ms
    st.queue("m").push(Request(1, "m", 1, 1, 0.0, 5e-3))  # the GPU's 10 ms would miss it; the CPU's not
    st.queue("m").push(Request(2, "m", 1, 1, 0.0, math.inf))
    d = make_policy("greedy").decide(st, 0.0)
    assert not d.late
    assert [(x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches] == [("gpu0", [2])]
    assert [r.seq for r in st.queue("m").by_priority[1]] == [1]  # still at the head, for the CPU


def test_a_free_worker_finds_what_it_can_serve_behind_a_long_run_of_requests_set_aside():
    """70 urgent requests only the GPU (busy) can end in time, then low ones with loose deadlines:
    with the set-aside bound at 64 the free CPU took nothing."""
    from batchyard.policy_core import Decision, send

    st = SchedulerState()
    st.add_worker(WorkerState("gpu0", "gpu", {"m": 64}))
    st.add_worker(WorkerState("cpu0", "cpu", {"m": 4}))
    st.costs[("m", "gpu")] = CostCurve(launch_s=1e-3, per_item_s=1e-6)
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.0, per_item_s=30e-3)  # 30 ms an item: too slow for 20 ms
    gpu = st.workers["gpu0"]
    gpu.inflight, gpu.busy_until = 1, 5e-3
    q = st.queue("m")
    for seq in range(70):
        q.push(Request(seq, "m", 1, 0, 0.0, 20e-3))
    for seq in range(70, 74):
        q.push(Request(seq, "m", 1, 2, 0.0, 60.0))
    d = Decision()
    reqs = send(st, d, st.workers["cpu0"], q, 4, 0.0)
    assert reqs and all(r.seq >= 70 for r in reqs) and not d.late


def test_an_urgent_reservation_lapsing_now_does_not_ask_for_a_wake_up_now(monkeypatch):
    """The urgent rate a rounding error above URGENT_RATE: the reservation's lapse is this very
    instant, and MCB asked to be woken then; the core drops a wake-up at or before now, and the
    lapse woke nothing: a low request waited beside free workers until the next event."""
    from batchyard.policy_mcb import URGENT_RATE

    st = SchedulerState()
    for name in ("cpu0", "cpu1"):
        st.add_worker(WorkerState(name, "cpu", {"m": 8}))
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.0, per_item_s=0.1e-3)
    now = 10.0
    st.arrivals["m#urgent"] = urgent = ArrivalRate(tau_s=0.25, initial=URGENT_RATE * (1 + 2e-14))
    urgent._t = now
    # As the rounding fell in a random run (rate 20.0000000000004, its decay to 20 solved at now):
    monkeypatch.setattr(ArrivalRate, "time_when_rate_is", lambda self, target, at: at)
    st.queue("m").push(Request(1, "m", 1, 2, now, math.inf))
    d = MarginalCost().decide(st, now)
    assert d.wake_at > now or d.wake_at == math.inf
    assert d.dispatches or d.wake_at < math.inf  # and the request is not left with nothing to wake it


def test_a_head_only_the_idle_gpus_take_is_sent_though_step_6b_gave_them_no_share():
    """Two GPUs of max batch 26, a CPU with a small launch, cheaper per item, of max batch 14
    (workers may register different max batches), steady traffic, a 23-item request. Step 6b
    sized the GPUs' shares to nothing (the CPU takes the arrivals due before their next launch),
    the CPU took nothing (23 items are past its max batch), and step 8b, counting the GPUs the
    plan named, did not send the head alone: it waited beside two idle GPUs, no wake-up set,
    until its deadline."""
    st = SchedulerState()
    st.costs[("m", "gpu")] = CostCurve(launch_s=2.0 * MS, per_item_s=0.4 * MS)
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.01 * MS, per_item_s=0.04 * MS)
    st.costs[("m", "gpu")].samples = st.costs[("m", "cpu")].samples = 100
    for w in (WorkerState("gpu0", "gpu", {"m": 26}), WorkerState("gpu1", "gpu", {"m": 26}),
              WorkerState("cpu0", "cpu", {"m": 14})):
        st.add_worker(w)
    now = 1.0
    st.arrivals["m"] = ArrivalRate(tau_s=0.25, initial=40_000.0)
    st.arrivals["m"]._t = now
    st.queue("m").push(Request(0, "m", 23, 1, now, now + 30.0))
    d = MarginalCost().decide(st, now)
    assert [(x.worker.path, sum(r.items for r in x.requests)) for x in d.dispatches] == [("gpu", 23)]


@pytest.mark.parametrize("out_of_rotation", ["leaving", "suspended"])
def test_a_request_behind_a_head_only_an_absent_worker_takes_goes_to_a_free_worker_that_takes_it(out_of_rotation):
    """A 3-item head only cpu_big takes (max batch 8), cpu_big out of rotation (it said it is
    leaving, or the circuit breaker suspended it), and a 2-item request behind it: the plan gave
    every item to the free CPU of max batch 1, which took neither request, step 8b found no free
    worker for the head, and the 2-item request waited beside the free GPU of max batch 2 until
    its deadline (30 s) or the breaker's back-off. It goes to the GPU at once; the head waits."""
    from batchyard.core import RequestCore

    failed = []
    core = RequestCore(MarginalCost(), lambda r, s, m: failed.append(r), default_timeout_s=30.0, breaker_backoff_s=8.0)
    for path, launch in (("cpu", 0.0), ("gpu", 0.3 * MS)):
        core.state.costs[("m", path)] = CostCurve(launch_s=launch, per_item_s=0.1 * MS)
        core.state.costs[("m", path)].samples = 100
    for name, path, max_batch in (("cpu_small", "cpu", 1), ("gpu", "gpu", 2), ("cpu_big", "cpu", 8)):
        core.add_worker(WorkerState(name, path, {"m": max_batch}), 0.0)
    if out_of_rotation == "leaving":
        core.leaving("cpu_big")
    else:
        core.batch_health(core.state.workers["cpu_big"], True, 1.0, "m")
    head = core.admit("m", 3, 1, 0.0, 1.0)
    behind = core.admit("m", 2, 1, 0.0, 1.0)
    sent = [(b.worker.name, [r.seq for r in b.requests]) for b in core.decide(1.0)]
    assert sent == [("gpu", [behind.seq])]
    assert core.state.queue("m").requests == 1 and head.state == QUEUED and not failed


def test_past_a_head_no_free_worker_takes_an_urgent_request_still_goes_without_low_padding():
    """Step 8c sent the free GPU its max batch from behind the head: the 2-item high request
    with the 2-item low one (step 2: urgent work is never padded with low work)."""
    from batchyard.core import RequestCore

    core = RequestCore(MarginalCost(), lambda r, s, m: None, default_timeout_s=30.0)
    for path, launch in (("cpu", 0.0), ("gpu", 50 * MS)):
        core.state.costs[("m", path)] = CostCurve(launch_s=launch, per_item_s=0.1 * MS)
        core.state.costs[("m", path)].samples = 100
    for name, path, max_batch in (("cpu_small", "cpu", 1), ("gpu", "gpu", 4), ("cpu_big", "cpu", 8)):
        core.add_worker(WorkerState(name, path, {"m": max_batch}), 0.0)
    core.leaving("cpu_big")
    core.admit("m", 5, 0, 0.0, 1.0)  # high, only cpu_big takes it
    high = core.admit("m", 2, 0, 0.0, 1.0)
    core.admit("m", 2, 2, 0.0, 1.0)  # low
    assert [(b.worker.name, [r.seq for r in b.requests]) for b in core.decide(1.0)] == [("gpu", [high.seq])]


def test_a_closed_queue_is_not_held_for_arrivals_that_a_drain_refuses():
    """A draining dispatcher admits nothing more: MCB's marginal rule and three-segment's waited
    for the next arrival all the same, beside a free worker."""
    st = seeds_state(n_queued=1, lam_per_s=30_000, cpu=False)
    assert MarginalCost().decide(st, 1.0).dispatches == []  # waits for the next arrival
    st.closed = True
    assert paths(MarginalCost().decide(st, 1.0)) == [("gpu", 1)]
    st = seeds_state(n_queued=3, lam_per_s=100_000)
    assert ThreeSegment().decide(st, 1.0).dispatches == []  # B1 <= 3 < B2: waits for company
    st.closed = True
    assert paths(ThreeSegment().decide(st, 1.0)) == [("gpu", 3)]


def test_a_curve_whose_line_reads_no_time_at_all_does_not_hold_the_queue_without_a_wake_up():
    # The online fit can learn a negative launch: a CPU's line of -0.2 ms + 0.1 ms·B read T(1) = 0,
    # MCB held the queue for that CPU ("done at once") with a wake-up at now, which the core
    # drops, and two requests waited beside a free GPU until the CPU's batch really ended.
    from batchyard.core import RequestCore
    from batchyard.policy import make_policy

    core = RequestCore(make_policy("mcb"), lambda r, status, message: None)
    gpu_curve, cpu_curve = CostCurve(launch_s=0.1e-3, per_item_s=0.025e-3), CostCurve(launch_s=-0.2e-3, per_item_s=0.1e-3)
    gpu_curve.samples = cpu_curve.samples = 100
    core.state.costs[("m", "gpu")], core.state.costs[("m", "cpu")] = gpu_curve, cpu_curve
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 1}), 0.0)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), 0.0)
    now = 1.0
    for _ in range(3):
        core.admit("m", 1, 1, 5.0, now)
    sent = sum(len(b.requests) for b in core.decide(now))
    assert sent == 3 or core.next_wake() - now < 1e-3, (sent, core.next_wake() - now)


def _one_worker_two_models(heads: dict) -> SchedulerState:
    """One CPU worker serving models "a" and "b"; ``heads``: model -> [(class, arrival)] queued,
    "a"'s queue made first (its first request came first, since served)."""
    st = SchedulerState()
    for m in "ab":
        st.costs[(m, "cpu")] = CostCurve(launch_s=0.0, per_item_s=1 * MS)
        st.costs[(m, "cpu")].samples = 100
        st.arrivals[m] = ArrivalRate(tau_s=0.25, initial=50.0)
    st.add_worker(WorkerState("cpu0", "cpu", {"a": 8, "b": 8}))
    seq = 0
    for m in "ab":
        q = st.queue(m)
        for prio, arrival, *deadline in heads.get(m, ()):
            q.push(Request(seq, m, 1, prio, arrival, deadline[0] if deadline else math.inf))
            seq += 1
    return st


@pytest.mark.parametrize("policy", ["mcb", "greedy", "escape:2", "window:1000,8", "fixed:1", "three-segment"])
@pytest.mark.parametrize("heads, first", [
    ({"a": [(1, 0.010), (1, 0.011)], "b": [(1, 0.005)]}, "b"),  # one class: the longer wait
    ({"a": [(2, 0.001)], "b": [(0, 0.010)]}, "b"),  # a higher class, however new
    ({"a": [(1, 0.004)], "b": [(1, 0.006)]}, "a"),
    # b's deadline: only a batch started by 20.4 ms meets it (1 ms alone, 10 % slower than predicted)
    ({"a": [(1, 0.001)], "b": [(1, 0.010, 0.0215)]}, "b"),
    ({"a": [(1, 0.001, 0.030)], "b": [(1, 0.010, 0.0215)]}, "b"),
    ({"a": [(1, 0.001, 5.0)], "b": [(1, 0.010, 5.0)]}, "a"),  # both far off: the longer wait
], ids=["older-head", "higher-class", "first-asked-and-older", "deadline-at-stake", "earlier-latest-start",
        "deadlines-far-off"])
def test_a_worker_two_models_share_goes_to_the_more_urgent_head_not_the_first_model_to_ask(policy, heads, first):
    """Decided in the order of each model's first request, the model that asked first took the
    shared worker at every completion while it had anything queued: live, at 27 % of the
    worker's capacity, the other model had 47 of 240 requests served, and its high-priority
    requests waited behind the first one's low ones. A deadline only the batch sent now meets
    goes before an older head with none."""
    st = _one_worker_two_models(heads)
    d = make_policy(policy).decide(st, 0.020)
    assert [b.requests[0].model for b in d.dispatches][:1] == [first]


def test_a_wait_for_company_leaves_the_margin_a_batch_may_overrun():
    """A lone request with a 500 ms timeout on an idle worker of T(B) = 300 + 100 B ms, arrivals
    expected (50/s) that would share its launch: MCB may wait for them, but it sends the request
    while its batch, LATE_MARGIN slower than predicted, still ends by the deadline. The wait
    used to spend the whole slack: the batch went predicted to end at the deadline itself, and
    live it ended 0.1 ms after it (DEADLINE_EXCEEDED, where sent at once it was served)."""
    from batchyard.policy_core import LATE_MARGIN

    st = SchedulerState()
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.3, per_item_s=0.1)
    st.costs[("m", "cpu")].samples = 100
    st.add_worker(WorkerState("w0", "cpu", {"m": 4}))
    st.arrivals["m"] = ArrivalRate(tau_s=0.25, initial=50.0)
    st.arrivals["m"]._t = 1.0
    deadline = 1.5
    st.queue("m").push(Request(0, "m", 1, 1, 1.0, deadline))
    pol, now = MarginalCost(), 1.0
    d = pol.decide(st, now)
    assert d.reasons.get("waited") and not d.dispatches, "the case: MCB waits for company"
    for _ in range(20):
        if d.dispatches:
            break
        assert now < d.wake_at < math.inf
        now = d.wake_at
        d = pol.decide(st, now)
    assert paths(d) == [("cpu", 1)]
    assert now + (1 + LATE_MARGIN) * 0.4 <= deadline + 1e-9, f"sent at {now}: ends late if {LATE_MARGIN:.0%} slow"


@pytest.mark.parametrize("launch_ms, per_item_ms, batch", [(20.0, 1.0, 3), (0.15, 0.02, 1)],
                         ids=["launch-heavy: two lows ride along", "item-heavy: the urgent one alone"])
def test_low_items_pad_an_urgent_batch_only_where_they_cost_it_little(launch_ms, per_item_ms, batch):
    """Urgent items went out on their own whatever the worker: on one at 20 ms + 1 ms an item, the
    launches went to urgent-only batches and the low class waited for aging (SIMULATED, 120
    req/s of 20/60/20 % high/normal/low: low p50 194 ms against greedy's 35, the urgent classes
    the same under both). Low items join while the batch stays within PAD_SHARE of its time."""
    st = SchedulerState()
    st.costs[("m", "cpu")] = CostCurve(launch_s=launch_ms * MS, per_item_s=per_item_ms * MS)
    st.costs[("m", "cpu")].samples = 100
    st.add_worker(WorkerState("w0", "cpu", {"m": 8}))
    st.arrivals["m"] = ArrivalRate(tau_s=0.25, initial=0.0)
    q = st.queue("m")
    # (Queued 0.1 ms ago: within a full batch's time of either worker, the low class is not
    # behind, and the share alone decides; past it, beside high work, it is kept up with.)
    q.push(Request(0, "m", 1, 0, 0.9999, math.inf))
    for i in range(1, 6):
        q.push(Request(i, "m", 1, 2, 0.9999, math.inf))
    d = MarginalCost().decide(st, 1.0)
    assert [[r.priority for r in b.requests] for b in d.dispatches][:1] == [[0] + [2] * (batch - 1)]


def _after_a_slow_spell(fresh: dict, slow: dict, n: int = 300) -> CostCurve:
    """A curve that learnt ``slow`` {B: s} in a slow spell, then ``n`` rounds of ``fresh`` {B: s}."""
    c = CostCurve()
    for _ in range(5):
        for b, t in slow.items():
            c.observe(b, t)
    for _ in range(n):
        for b, t in fresh.items():
            c.observe(b, t)
    c.mode = "piecewise"
    return c


def test_a_batch_of_a_size_only_a_stale_slow_knot_calls_dear_runs_whole_and_measures_it():
    """After a slow spell (T(B) 400 + 100 B ms) at its true 20 + 5 B ms again, batches of 1 only:
    the knot of 4 still said 800 ms, so fit_deadlines cut every batch of 4 at 2 (0.5 s timeouts)
    for good, MCB's probes of that size included, and it was never measured again (live: 122 of
    550 requests a 5 s window failed at 83 % of the worker's capacity)."""
    from batchyard.policy_core import fit_deadlines
    from batchyard.policy import Decision

    st = SchedulerState()
    st.costs[("m", "cpu")] = c = _after_a_slow_spell({1: 0.025}, {4: 0.8})
    assert c.stale(4) and c.predict(3) > 0.5  # the knot of the spell, which the prefix cut reads
    w = WorkerState("w0", "cpu", {"m": 8})
    st.add_worker(w)
    reqs = [Request(i, "m", 1, 1, 1.0, 1.5) for i in range(4)]
    kept, back, elsewhere = fit_deadlines(st, Decision(), w, "m", reqs, 1.0)
    assert (len(kept), back, elsewhere) == (4, [], [])
    # A stale knot the fresh ones do not contradict still cuts: it is all the evidence there is.
    st.costs[("m", "cpu")] = _after_a_slow_spell({1: 0.3}, {4: 0.8})
    kept, back, _ = fit_deadlines(st, Decision(), w, "m", [Request(i, "m", 1, 1, 1.0, 1.5) for i in range(4)], 1.0)
    assert len(kept) < 4 and back


def test_a_stale_slow_knot_between_fresh_ones_is_forgotten():
    """Between fresh knots of 4 and 8 (40 and 60 ms), the slow spell's knot of 6 (1,000 ms) made
    batches of 5 to 7 look too dear to send, and none was, so it stayed (live, after the spell)."""
    c = _after_a_slow_spell({2: 0.030, 4: 0.040, 8: 0.060}, {6: 1.0})
    assert 6 not in c.describe()["knots_us"]
    assert c.predict(6) == pytest.approx(0.050)
    # One beyond the fresh sizes stays (MCB probes it; the fresh knots cannot tell what it takes).
    c = _after_a_slow_spell({1: 0.025}, {4: 0.8})
    assert "4" in c.describe()["knots_us"]


def _gpu_and_cpu(gpu_launch_ms: float, cpu_ms: float, cpu_launch_ms: float = 0.0):
    st = SchedulerState()
    st.costs[("m", "gpu")] = CostCurve(launch_s=gpu_launch_ms * MS, per_item_s=0.001 * MS)
    st.costs[("m", "cpu")] = CostCurve(launch_s=cpu_launch_ms * MS, per_item_s=cpu_ms * MS)
    st.costs[("m", "gpu")].samples = st.costs[("m", "cpu")].samples = 100
    gpu, cpu = WorkerState("gpu0", "gpu", {"m": 64}), WorkerState("cpu0", "cpu", {"m": 64})
    st.add_worker(gpu)
    st.add_worker(cpu)
    st.arrivals["m"] = ArrivalRate(tau_s=0.25, initial=0.0)
    return st, gpu, cpu


def test_low_items_pad_an_urgent_batch_only_as_far_as_every_free_worker_allows():
    """The padding was the most any free worker allowed: a free GPU's 30 ms launch allowed 30 low
    items, and the plan put them in the CPU's batch beside the high request (3 to 5 times its
    time alone, live)."""
    st, _, _ = _gpu_and_cpu(30.0, 1.0, cpu_launch_ms=0.5)
    q = st.queue("m")
    q.push(Request(0, "m", 1, 0, 0.999, math.inf))
    for i in range(1, 6):
        q.push(Request(i, "m", 1, 2, 0.999, math.inf))
    d = MarginalCost().decide(st, 1.0)
    assert d.dispatches and all(len({r.priority for r in b.requests}) == 1 for b in d.dispatches), \
        [(b.worker.name, [r.priority for r in b.requests]) for b in d.dispatches]


def test_a_worker_that_meets_no_deadline_of_the_low_class_does_not_make_it_newest_first():
    """A 40 ms-launch GPU beside an idle CPU, low requests of 20 ms timeouts: judged on the GPU,
    where none ends in time, the low class counted as flooded at any load and was taken newest
    first; the oldest waited until hopeless (live: 115 of 2,406 expired queued, none as normal)."""
    from batchyard.policy_core import congested

    st, gpu, cpu = _gpu_and_cpu(40.0, 0.05)
    q = st.queue("m")
    for i in range(3):
        q.push(Request(i, "m", 1, 2, 1.0 + i * 1e-3, 1.0 + i * 1e-3 + 0.020))
    assert congested(st, gpu, q, 1.003) == 0
    assert congested(st, cpu, q, 1.003) == 0


def test_a_request_failed_late_behind_a_busy_worker_is_told_the_wait_too():
    """The message named the compute alone: "1.2 ms for it alone, 12.9 ms were left" read as a
    refusal of a request that fitted (an outside review, a worker busy with another model)."""
    from batchyard.policy_core import Decision, fit_deadlines

    st = SchedulerState()
    cpu = WorkerState("cpu0", "cpu", {"m": 8})
    st.add_worker(cpu)
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.0, per_item_s=1.2 * MS)
    st.costs[("m", "cpu")].samples = 100
    cpu.inflight, cpu.busy_until = 1, 1.020
    r = Request(0, "m", 1, 1, 1.0, 1.0129)
    d = Decision()
    kept, _, _ = fit_deadlines(st, d, cpu, "m", [r], 1.0)
    assert not kept and [why for _, why in d.late] == [
        "would finish after its deadline: cpu worker cpu0 predicted free in 20.0 ms, then to take 1.2 ms for it "
        "alone, 12.9 ms were left"]


def test_a_request_the_plan_splits_where_it_cannot_goes_whole_to_the_worker_that_ends_it_in_time():
    """A CPU whose T(2) is more than 2 T(1) (1.0 and 2.6 ms: a calibrated curve's cache spill, or a
    fit with a negative launch) beside a GPU of 2.0 ms + 0.1 ms an item, both free: the plan gave a
    2-item request's items to the CPU one at a time (in time), the CPU's send set the whole request
    aside for the GPU (it ends it in time, the CPU whole does not), and the GPU, given nothing by
    the plan, stayed idle with no wake-up until the request failed DEADLINE_EXCEEDED (an outside
    review's fuzzing of the dispatcher's core)."""
    from batchyard.core import RequestCore

    failed = []
    core = RequestCore(make_policy("mcb"), lambda r, s, m: failed.append((r.req_id, s.name)))
    core.state.costs[("m", "cpu")] = CostCurve.from_points([(1, 1.0 * MS), (2, 2.6 * MS)])
    core.state.costs[("m", "gpu")] = CostCurve.from_points([(1, 2.1 * MS), (2, 2.2 * MS)])
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), 0.0)
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 2}), 0.0)
    core.admit("m", 2, 1, 2.3 * MS, 10.0, client=b"c", req_id=1)
    sent = core.decide(10.0)
    assert [(b.worker.name, [r.req_id for r in b.requests]) for b in sent] == [("gpu0", [1])] and not failed
