"""The baselines a user could configure, and the deadline index, on crafted states."""

from __future__ import annotations

import math

import pytest

from batchyard.cost_model import CostCurve
from batchyard.deadline_index import DeadlineIndex
from batchyard.policy import make_policy
from batchyard.state import Request, SchedulerState, WorkerState


def state(n_queued, gpu_free=True, n_cpu=2, items=1):
    st = SchedulerState()
    st.costs[("m", "gpu")] = CostCurve(launch_s=0.15e-3, per_item_s=0.02e-3)
    st.costs[("m", "cpu")] = CostCurve(launch_s=0.0, per_item_s=0.08e-3)
    g = WorkerState("gpu0", "gpu", {"m": 64})
    if not gpu_free:
        g.inflight, g.busy_until = 1, 1.001
    st.add_worker(g)
    for i in range(n_cpu):
        st.add_worker(WorkerState(f"cpu{i}", "cpu", {"m": 64}))
    for i in range(n_queued):
        st.queue("m").push(Request(i, "m", items, 1, 0.999, math.inf))
    return st


def sizes(d):
    return [(x.worker.name, len(x.requests)) for x in d.dispatches]


def test_escape_free_gpu_takes_everything():
    assert sizes(make_policy("escape:2").decide(state(10), 1.0)) == [("gpu0", 10)]


def test_escape_free_cpus_take_at_most_k_requests_while_the_gpu_is_busy():
    st = state(10, gpu_free=False)
    assert sizes(make_policy("escape:2").decide(st, 1.0)) == [("cpu0", 2), ("cpu1", 2)]
    assert st.queue("m").requests == 6


def test_escape_counts_requests_not_items():
    st = state(3, gpu_free=False, items=3)
    assert sizes(make_policy("escape:1").decide(st, 1.0)) == [("cpu0", 1), ("cpu1", 1)]


@pytest.mark.parametrize("spec", ["window:5000,4", "fixed:4"])
def test_window_and_fixed_feed_every_free_worker(spec):
    st = state(10)
    d = make_policy(spec).decide(st, 1.0)
    assert sizes(d) == [("gpu0", 4), ("cpu0", 4)]  # 2 left: fewer than N, within the delay
    assert st.queue("m").requests == 2


@pytest.mark.parametrize("spec", ["window:500000,100", "window:300000,16", "fixed:100", "fixed:16"])
def test_window_and_fixed_send_a_full_batch_of_a_worker_whose_max_batch_is_below_n(spec):
    """A full batch is the worker's max batch where that is below N, as Triton's dynamic batcher
    sends at the model's max_batch_size: with N past it, an idle worker beside 3 full batches
    waited out the whole window (100 to 500 ms, live; an outside review)."""
    st = SchedulerState()
    st.costs[("m", "cpu")] = CostCurve(launch_s=1e-3, per_item_s=1e-3)
    st.add_worker(WorkerState("cpu0", "cpu", {"m": 4}))
    for i in range(12):
        st.queue("m").push(Request(i, "m", 1, 1, 1.0, math.inf))
    d = make_policy(spec).decide(st, 1.0)
    assert sizes(d) == [("cpu0", 4)] and st.queue("m").requests == 8


def test_window_sends_to_a_worker_it_passed_when_a_later_ones_batch_leaves_a_due_request():
    """Workers of max batch 1 sent their full batches after a worker of max batch 3 had been
    looked at and found nothing full or due; what they left, a request past its delay, then sat
    beside that free worker with no wake-up (the property test's state, found by hypothesis)."""
    st = SchedulerState()
    st.costs[("m", "gpu")] = CostCurve(launch_s=0.0, per_item_s=0.125e-3)
    for name, max_batch in (("w0", 1), ("w1", 1), ("w2", 3), ("w3", 3), ("w4", 1)):
        st.add_worker(WorkerState(name, "gpu", {"m": max_batch}))
    for seq, arrival in ((0, 1.0), (1, 1.0), (2, 1.0), (3, 0.999)):
        st.queue("m").push(Request(seq, "m", 1, 0, arrival, math.inf))
    d = make_policy("window:200,16").decide(st, 1.0)
    assert sorted((x.worker.name, [r.seq for r in x.requests]) for x in d.dispatches) == [
        ("w0", [0]), ("w1", [1]), ("w2", [3]), ("w4", [2])]


def test_make_policy_knows_escape():
    assert make_policy("escape:3").name == "escape:3"
    with pytest.raises(ValueError, match="escape:<K>"):
        make_policy("escape:0")


def test_deadline_index_follows_pushes_retries_and_dispatches():
    st = state(0)
    q = st.queue("m")
    idx = DeadlineIndex(q)
    a, b, c = (Request(i, "m", 1, 1, 0.0, dl) for i, dl in enumerate((5.0, 3.0, math.inf)))
    for r in (a, b, c):
        q.push(r)
    idx.sync()
    assert idx.tightest(1.0) == 3.0
    taken = q.take(2)  # a and b leave with a batch
    idx.discard(taken)
    assert idx.tightest(1.0) == math.inf
    retry = Request(9, "m", 1, 1, 0.0, 2.0)
    q.push_front(retry)  # a retry goes back to the head of its class
    idx.sync()
    assert idx.tightest(1.0) == 2.0 and idx.tightest(2.5) == math.inf  # passed deadlines drop out


def test_deadline_index_forgets_expired_requests_while_the_queue_never_empties():
    """Under sustained overload the queue never empties: every request that expired or was
    cancelled out of it stayed in the index for good, with the payload its frames hold."""
    st = state(0)
    q = st.queue("m")
    idx = DeadlineIndex(q)
    keep = Request(0, "m", 1, 1, 0.0, math.inf)  # the queue is never empty
    q.push(keep)
    for i in range(1, 1001):
        r = Request(i, "m", 1, 1, float(i), i + 0.5)
        q.push(r)
        idx.sync()
        assert idx.tightest(float(i)) == i + 0.5
        q.remove(r)  # it expires (or is cancelled) out of the queue: not dispatched
        assert idx.tightest(i + 0.6) == math.inf
    assert len(idx._known) <= 2


def _replay(policy: str, gpu: tuple, cpu: tuple, arrivals: list) -> list:
    """A RequestCore under ``policy`` on a virtual clock, each batch taking what its curve says:
    [(time, worker, [(seq, items)])] of every dispatch. ``gpu``/``cpu``: (max batch, per-item s);
    ``arrivals``: (time, items, timeout s)."""
    import heapq

    from batchyard.core import RequestCore

    core = RequestCore(make_policy(policy), lambda r, status, message: None)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": gpu[0]}), 0.0)
    core.add_worker(WorkerState("cpu0", "cpu", {"m": cpu[0]}), 0.0)
    st = core.state
    for path, per_item in (("gpu", gpu[1]), ("cpu", cpu[1])):
        st.costs[("m", path)] = CostCurve(launch_s=0.0, per_item_s=per_item)
        st.costs[("m", path)].samples = 100
    sent, ends, i, wake, n = [], [], 0, math.inf, 0
    while i < len(arrivals) or ends or wake < math.inf:
        now = min(arrivals[i][0] if i < len(arrivals) else math.inf, ends[0][0] if ends else math.inf, wake)
        while ends and ends[0][0] <= now:
            done, _, bid = heapq.heappop(ends)
            for r in core.complete(bid, None, done).requests:
                core.finish(r)
        while i < len(arrivals) and arrivals[i][0] <= now:
            at, items, timeout = arrivals[i]
            core.admit("m", items, 0, timeout, at)
            i += 1
        for b in core.decide(now):
            n += 1
            heapq.heappush(ends, (now + st.cost("m", b.worker.path).predict(b.items), n, b.batch_id))
            sent.append((now, b.worker.name, [(r.seq, r.items) for r in b.requests]))
        wake = core.next_wake()
        wake = math.inf if wake <= now else wake
    return sent


def test_three_segment_sends_a_request_the_gpu_cannot_end_in_time_to_the_free_cpu_that_can():
    """The GPU segment set it aside for the CPU (fit_deadlines), which the rule never offered it:
    it waited beside both free workers, no wake-up set, until its deadline (an outside review)."""
    sent = _replay("three-segment", gpu=(3, 0.05), cpu=(8, 0.005), arrivals=[(0.0, 3, 0.1)])
    assert sent == [(0.0, "cpu0", [(1, 3)])]


def test_gpu_only_gives_the_cpu_only_a_head_no_gpu_takes_however_congested():
    """Congested, the queue is taken newest first: the CPU was sent the newest 1-item request
    in place of the 4-item head the GPU cannot take, which then waited beside the idle CPU."""
    arrivals = [(0.0, 1, 0.12)] * 6 + [(0.05, 4, 5.0)] + [(0.051, 1, 0.3)] * 8
    sent = _replay("gpu-only", gpu=(3, 0.1), cpu=(8, 0.05), arrivals=arrivals)
    on_cpu = [reqs for _, worker, reqs in sent if worker == "cpu0"]
    assert on_cpu == [[(7, 4)]], sent
