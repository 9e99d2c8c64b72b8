"""RequestCore, the request lifecycle shared by the live dispatcher and the simulator: every
admitted request ends exactly once, whatever happens in between."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from batchyard.core import Rejected, RequestCore
from batchyard.policy import make_policy
from batchyard.protocol import Status
from batchyard.state import QUEUED, WorkerState


class Ends:
    """Records how each request ended (the driver's side of the core)."""

    def __init__(self):
        self.failed: dict[int, Status] = {}
        self.finished: set[int] = set()
        self.twice: list[int] = []

    def on_fail(self, req, status, message):
        assert message
        if req.req_id in self.failed or req.req_id in self.finished:
            self.twice.append(req.req_id)
        self.failed[req.req_id] = status

    def finish(self, core, req):
        if core.finish(req):
            if req.req_id in self.failed or req.req_id in self.finished:
                self.twice.append(req.req_id)
            self.finished.add(req.req_id)


def make_core(ends, **kw):
    core = RequestCore(make_policy("greedy"), ends.on_fail, **kw)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), 0.0)
    return core


def test_a_request_whose_deadline_passes_in_flight_is_answered_once_and_its_late_result_dropped():
    ends = Ends()
    core = make_core(ends)
    req = core.admit("m", 1, 1, 0.010, 0.0, client=b"c", req_id=1)
    (batch,) = core.decide(0.0)
    core.decide(0.011)  # expiry runs first
    assert ends.failed == {1: Status.DEADLINE_EXCEEDED}
    assert core.complete(batch.batch_id, 0.012, 0.012) is batch
    assert core.finish(req) is False  # the worker's late result must not be forwarded
    assert not core.requests and not core.by_client_id
    assert core.state.workers["gpu0"].free  # the slot came back all the same


def test_a_result_that_comes_back_past_the_deadline_before_its_expiry_ran_is_deadline_exceeded():
    """The deadline's timer and the batch's return race: a batch back at 10.5 ms of a 10 ms
    timeout, read before the expiry ran, was answered OK past its deadline (live, 2-5 of ~800
    a run, by up to 4 ms). It ends as the timer would have ended it, its batch over (no release
    to wait for)."""
    ends = Ends()
    core = make_core(ends)
    req = core.admit("m", 1, 1, 0.010, 0.0, client=b"c", req_id=1)
    in_time = core.admit("m", 1, 1, 1.0, 0.0, client=b"c", req_id=2)
    (batch,) = core.decide(0.0)
    assert batch.requests == [req, in_time]
    assert core.complete(batch.batch_id, 0.0105, 0.0105) is batch
    assert core.finish(req, 0.0105) is False and core.finish(in_time, 0.0105) is True
    assert ends.failed == {1: Status.DEADLINE_EXCEEDED} and not req.answered_in_flight
    assert not core.requests and not core.by_client_id
    core.decide(0.011)  # the expiry, when it runs, finds it ended: one answer
    assert ends.failed == {1: Status.DEADLINE_EXCEEDED} and not ends.twice


def test_worker_loss_retries_once_then_fails_unavailable():
    """Failed because its worker is gone for sure, the request is answered as ended: answered in
    flight, its client kept the memory reserved for a release that never came."""
    ends = Ends()
    core = make_core(ends)
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 8}), 0.0)
    req = core.admit("m", 1, 1, 1.0, 0.0, req_id=1)
    (b1,) = core.decide(0.0)
    core.worker_lost(b1.worker.name, "gone", 0.001)
    assert req.retries == 1 and not ends.failed  # back in the queue
    (b2,) = core.decide(0.001)
    assert b2.worker is not b1.worker
    core.worker_lost(b2.worker.name, "gone too", 0.002)
    assert ends.failed == {1: Status.UNAVAILABLE} and not req.answered_in_flight
    assert core.complete(b1.batch_id, 0.1, 0.003) is None  # a dead worker's late completion


def test_an_input_that_kills_its_worker_takes_only_itself_down_the_second_time():
    """Request 2 kills any worker that runs it. Before, its batch of four was retried as one
    batch, the worker died again, and all four failed, out of retries (as Triton fails every
    request of a crashed backend's batch). Now each retried request runs alone, on a worker
    with nothing else in flight: 2 fails, 1, 3 and 4 are served, and a request that came after
    the crash is batched as usual once they are through."""
    ends = Ends()
    core = make_core(ends)
    reqs = [core.admit("m", 1, 1, 10.0, 0.0, req_id=i) for i in (1, 2, 3, 4)]
    (batch,) = core.decide(0.0)
    assert len(batch.requests) == 4
    now = 0.001
    core.worker_lost("gpu0", "killed by request 2", now)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), now)  # restarted
    core.admit("m", 1, 1, 10.0, now, req_id=5)
    core.admit("m", 1, 1, 10.0, now, req_id=6)
    sizes = []
    while core.requests:
        now += 0.001
        (batch,) = core.decide(now)
        sizes.append([r.req_id for r in batch.requests])
        if 2 in sizes[-1]:
            core.worker_lost("gpu0", "killed by request 2 again", now)
            core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), now)
        else:
            for r in core.complete(batch.batch_id, 0.001, now).requests:
                ends.finish(core, r)
    assert ends.failed == {2: Status.UNAVAILABLE} and ends.finished == {1, 3, 4, 5, 6} and not ends.twice
    assert sorted(sizes[:4]) == [[1], [2], [3], [4]] and sizes[4:] == [[5, 6]], sizes
    assert all(r.retries == 1 for r in reqs)


def test_a_suspect_waits_for_its_worker_to_drain_and_holds_it_meanwhile():
    """A worker running two batches at once (capacity 2): a suspect at the head of the queue is
    not sent beside a batch in flight (it could kill that batch too), nor is anything behind it
    (newer work could keep the worker busy for good and the suspect waiting); once the batch
    ends it goes alone, and what is no suspect may run beside it."""
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}, capacity=2), 0.0)
    core.admit("m", 1, 1, 10.0, 0.0, req_id=1)
    core.admit("m", 1, 1, 10.0, 0.0, req_id=2)
    ((first),) = core.decide(0.0)
    assert [r.req_id for r in first.requests] == [1, 2]
    core.worker_lost("gpu0", "gone", 0.001)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}, capacity=2), 0.001)
    core.admit("m", 1, 1, 10.0, 0.001, req_id=3)
    sent = core.decide(0.001)
    assert [[r.req_id for r in b.requests] for b in sent] == [[1]]  # 2 and 3 wait: the worker is not idle
    assert core.decide(0.002) == [] and core.state.workers["gpu0"].free
    core.complete(sent[0].batch_id, 0.001, 0.003)
    assert [[r.req_id for r in b.requests] for b in core.decide(0.003)] == [[2], [3]]


def test_cancel_only_withdraws_queued_requests():
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail)  # no worker: requests stay queued
    core.admit("m", 1, 1, 1.0, 0.0, client=b"a", req_id=5)
    assert core.cancel(b"b", 5) is False  # another client's id
    assert core.cancel(b"a", 5) is True
    assert ends.failed == {5: Status.CANCELLED}
    assert core.state.queue("m").requests == 0


def test_admission_bounds_the_queue_and_refuses_impossible_deadlines():
    ends = Ends()
    core = make_core(ends, max_queue=2)
    core.state.cost("m", "gpu").launch_s = 0.05
    core.state.learned_at["m"] = 0.0  # as just measured: no probe due (see the probe's test)
    got = core.admit("m", 1, 1, 0.010, 0.0, req_id=1)
    assert type(got) is Rejected and got.status == Status.DEADLINE_EXCEEDED
    core.state.cost("m", "gpu").launch_s = 0.0
    core.state.workers["gpu0"].capacity = 0  # busy: requests queue
    assert type(core.admit("m", 1, 1, 1.0, 0.0, req_id=2)) is not Rejected
    assert type(core.admit("m", 1, 1, 1.0, 0.0, req_id=3)) is not Rejected
    got = core.admit("m", 1, 1, 1.0, 0.0, req_id=4)
    assert type(got) is Rejected and got.status == Status.OVERLOADED


def test_a_full_queue_takes_a_higher_priority_request_in_place_of_its_newest_lowest_one():
    """High requests were OVERLOADED behind a queue full of low ones (one a departed client left
    among them: 16 of 20 high requests refused behind 100 low; an outside review). Now the newest
    request of the lowest class below the arrival's makes room, answered OVERLOADED; a request of
    the lowest class queued (or of a class no queued request is below) is still refused."""
    high, normal, low = 0, 1, 2
    ends = Ends()
    core = make_core(ends, max_queue=3)
    core.state.workers["gpu0"].capacity = 0  # busy: requests queue
    for rid in (1, 2, 3):
        assert type(core.admit("m", 1, low, 1.0, 0.0, client=b"a", req_id=rid)) is not Rejected
    assert type(core.admit("m", 1, high, 1.0, 0.0, client=b"b", req_id=4)) is not Rejected
    assert ends.failed == {3: Status.OVERLOADED}  # the newest low one
    got = core.admit("m", 1, low, 1.0, 0.0, client=b"a", req_id=5)
    assert type(got) is Rejected and got.status == Status.OVERLOADED
    assert type(core.admit("m", 1, normal, 1.0, 0.0, client=b"b", req_id=6)) is not Rejected
    assert ends.failed == {3: Status.OVERLOADED, 2: Status.OVERLOADED}
    got = core.admit("m", 1, low, 1.0, 0.0, client=b"a", req_id=7)
    assert type(got) is Rejected and got.status == Status.OVERLOADED
    assert type(core.admit("m", 1, high, 1.0, 0.0, client=b"b", req_id=8)) is not Rejected  # past the last low
    assert ends.failed == {3: Status.OVERLOADED, 2: Status.OVERLOADED, 1: Status.OVERLOADED}
    got = core.admit("m", 1, normal, 1.0, 0.0, client=b"b", req_id=9)  # nothing below normal is left
    assert type(got) is Rejected and got.status == Status.OVERLOADED
    q = core.state.queue("m")
    assert q.requests == 3 and q.items == 3 and [len(c) for c in q.by_priority] == [2, 1, 0]
    core.state.workers["gpu0"].capacity = 1
    while core.state.queue("m").requests:
        for batch in core.decide(0.5):
            core.complete(batch.batch_id, 0.001, 0.5)
            for r in batch.requests:
                ends.finish(core, r)
    assert ends.finished == {4, 6, 8} and not ends.twice


def test_status_long_poll_is_due_on_registration_or_expiry():
    core = RequestCore(make_policy("greedy"), lambda *a: None)
    core.add_status_waiter("a", 1, 5.0)
    core.add_status_waiter("b", 9, 2.0)
    assert core.next_wake() == 2.0
    assert core.due_status_waiters(1.0) == []
    core.add_worker(WorkerState("w", "cpu", {"m": 1}), 1.5)
    assert core.due_status_waiters(1.5) == ["a"]
    assert core.due_status_waiters(2.0) == ["b"]


def test_status_long_poll_can_wait_for_a_worker_to_leave_rotation():
    core = RequestCore(make_policy("greedy"), lambda *a: None)
    core.add_worker(WorkerState("w", "cpu", {"m": 1}), 0.0)
    core.add_status_waiter("gone", 0, 60.0, min_departures=1)
    assert core.due_status_waiters(1.0) == []
    core.add_worker(WorkerState("w", "cpu", {"m": 1}), 1.5)  # the same name again: the old one left
    assert core.departures == 1 and core.due_status_waiters(1.5) == ["gone"]
    core.add_status_waiter("next", 0, 60.0, min_departures=2)
    assert core.worker_lost("nobody", "unknown", 2.0) is None and core.due_status_waiters(2.0) == []
    core.worker_lost("w", "no heartbeat", 2.5)
    assert core.departures == 2 and core.due_status_waiters(2.5) == ["next"]


def test_a_drain_refuses_new_requests_and_still_dispatches_the_queued_ones():
    """SIGTERM failed every queued request at once (UNAVAILABLE) beside a worker that would
    have served it; as Triton, a drain refuses only what comes after it."""
    ends = Ends()
    core = make_core(ends, max_retries=1)
    core.state.workers["gpu0"].models["m"] = 1  # one request a batch: the second waits in the queue
    running = core.admit("m", 1, 1, 5.0, 0.0, client=b"c", req_id=1)
    queued = core.admit("m", 1, 1, 5.0, 0.0, client=b"c", req_id=2)
    core.admit("m", 1, 1, 5.0, 0.0, client=b"c", req_id=3)  # cancelled below, during the drain
    (first,) = core.decide(0.0)
    core.begin_drain()
    late = core.admit("m", 1, 1, 5.0, 0.1, client=b"c", req_id=4)
    assert late == Rejected(Status.UNAVAILABLE, "dispatcher is shutting down")
    assert core.cancel(b"c", 3) and ends.failed == {3: Status.CANCELLED}  # cancel still works
    assert core.decide(0.1) == [] and queued.state == QUEUED and not core.drained()
    core.complete(first.batch_id, 0.2, 0.2)
    ends.finish(core, running)
    (second,) = core.decide(0.2)  # the worker is free again: the queued request goes to it
    assert second.requests == [queued]
    core.complete(second.batch_id, 0.2, 0.4)
    ends.finish(core, queued)
    assert ends.finished == {1, 2} and ends.failed == {3: Status.CANCELLED} and core.drained()


def test_what_a_drain_could_not_serve_fails_once_when_it_runs_out():
    ends = Ends()
    core = make_core(ends)
    core.state.workers["gpu0"].models["m"] = 1
    running = core.admit("m", 1, 1, 5.0, 0.0, client=b"c", req_id=1)
    core.admit("m", 1, 1, 5.0, 0.0, client=b"c", req_id=2)
    (batch,) = core.decide(0.0)
    core.begin_drain()
    core.fail_queued(Status.UNAVAILABLE, "drain ran out")  # the driver, at drain_timeout_s
    assert ends.failed == {2: Status.UNAVAILABLE} and running.state != QUEUED
    core.fail_all(Status.UNAVAILABLE, "batch cut")
    assert ends.failed == {1: Status.UNAVAILABLE, 2: Status.UNAVAILABLE} and not ends.twice
    assert core.complete(batch.batch_id, 0.1, 0.1) is None and core.drained()


OPS = st.lists(st.tuples(st.sampled_from(["admit", "decide", "complete", "lose", "cancel", "register", "drain"]),
                         st.integers(0, 7), st.floats(0.0, 0.02)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_every_admitted_request_ends_exactly_once(ops):
    ends = Ends()
    core = RequestCore(make_policy("mcb"), ends.on_fail, max_queue=20)
    admitted, now, names = [], 0.0, ["gpu0", "cpu0"]
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 4}), 0.0)
    for op, k, dt in ops:
        now += dt
        if op == "admit":
            got = core.admit("m", 1 + k % 3, k % 3, 0.005 + 0.01 * k, now, client=b"c", req_id=len(admitted))
            if type(got) is not Rejected:
                admitted.append(got.req_id)
        elif op == "decide":
            core.decide(now)
        elif op == "complete" and core.batches:
            batch = core.complete(sorted(core.batches)[k % len(core.batches)], 0.001, now)
            for r in batch.requests:
                ends.finish(core, r)
        elif op == "lose":
            core.worker_lost(names[k % 2], "test", now)
        elif op == "cancel" and admitted:
            core.cancel(b"c", admitted[k % len(admitted)])
        elif op == "register":
            core.add_worker(WorkerState(names[k % 2], "gpu" if k % 2 == 0 else "cpu", {"m": 4}), now)
        elif op == "drain":
            core.begin_drain()
        assert all(r.state != 2 for r in core.requests.values())  # nothing DONE is still tracked
    core.fail_all(Status.UNAVAILABLE, "end of test")
    assert not ends.twice
    assert set(admitted) == set(ends.failed) | ends.finished
    assert not core.requests and not core.by_client_id and not core.batches
    assert math.isinf(core.next_wake()) or core.deadlines


def test_circuit_breaker_backs_off_doubling_and_resets_on_success():
    ends = Ends()
    core = make_core(ends, breaker_backoff_s=0.5, breaker_backoff_max_s=1.5)
    gpu = core.state.workers["gpu0"]
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 8}), 0.0)
    assert core.batch_health(gpu, True, 0.0, "m") == 0.5
    assert gpu not in core.state.serving["m"] and core.next_wake() == 0.5
    req = core.admit("m", 1, 1, 5.0, 0.1, req_id=1)
    (batch,) = core.decide(0.1)
    assert batch.worker.name == "cpu0"  # the suspended GPU is not offered work
    core.decide(0.5)
    assert gpu in core.state.serving["m"]  # back, half-open
    assert core.batch_health(gpu, True, 0.6, "m") == 1.0  # failed again: doubled
    core.decide(1.6)
    assert core.batch_health(gpu, True, 1.7, "m") == 1.5  # capped
    core.decide(3.2)
    core.batch_health(gpu, False, 3.3, "m")  # a good batch
    assert core.batch_health(gpu, True, 3.4, "m") == 0.5  # back to the first back-off
    assert req.state == 1  # untouched by all this


def test_the_breaker_takes_a_worker_out_of_rotation_for_the_failing_model_only():
    """Per worker, a Triton worker one of whose models Triton had unloaded (its batches UNAVAILABLE,
    NOT_FOUND) was out of rotation for every model: each of that model's batches took it out
    again, and the model still loaded went from 38 requests/s to 1.8 (p50 4.6 -> 483 ms)."""
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail, breaker_backoff_s=0.5)
    gpu = WorkerState("gpu0", "gpu", {"loaded": 8, "unloaded": 8})
    core.add_worker(gpu, 0.0)
    assert core.batch_health(gpu, True, 0.0, "unloaded") == 0.5
    assert gpu not in core.state.serving["unloaded"] and gpu in core.state.serving["loaded"]
    req = core.admit("loaded", 1, 1, 5.0, 0.1, req_id=1)
    (batch,) = core.decide(0.1)
    assert batch.worker is gpu and batch.requests == [req]
    core.complete(batch.batch_id, None, 0.2)
    core.batch_health(gpu, False, 0.2, "loaded")  # its good batch does not bring the other model back
    assert gpu not in core.state.serving["unloaded"]
    core.decide(0.5)
    assert gpu in core.state.serving["unloaded"]  # back after its back-off, half-open
    assert core.batch_health(gpu, True, 0.6, "unloaded") == 1.0  # failed again: doubled, for that model


def test_a_request_that_outlives_its_models_only_worker_out_of_rotation_is_unavailable():
    """The breaker took the model's only worker out of rotation (its backend failing batches,
    Triton killed) for longer than a queued request's timeout: it failed DEADLINE_EXCEEDED "in
    queue", as if the node were only slow; Triton answers UNAVAILABLE for a model that is not
    available, and a client retries elsewhere on it. With another worker in rotation, a late
    request is still DEADLINE_EXCEEDED."""
    ends = Ends()
    core = make_core(ends, breaker_backoff_s=8.0)
    core.batch_health(core.state.workers["gpu0"], True, 0.0, "m")
    core.admit("m", 1, 1, 1.0, 0.0, req_id=1)
    core.decide(1.5)
    assert ends.failed == {1: Status.UNAVAILABLE}
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 8}), 2.0)
    core.state.workers["cpu0"].inflight, core.state.workers["cpu0"].busy_until = 1, 10.0  # busy, in rotation
    core.admit("m", 1, 1, 1.0, 2.0, req_id=2)
    core.decide(3.5)
    assert ends.failed[2] == Status.DEADLINE_EXCEEDED


def test_a_request_that_outlives_a_time_with_no_worker_of_its_model_registered_is_unavailable():
    """No worker of the model registered (its only one restarting after a crash or a hang, or
    Triton down at its start) until a queued request's timeout: DEADLINE_EXCEEDED "in queue",
    as if the node were only slow (an outside review); UNAVAILABLE, as Triton answers a model
    that is not ready."""
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail)
    core.admit("m", 1, 1, 1.0, 0.0, req_id=1)
    core.decide(1.5)
    assert ends.failed == {1: Status.UNAVAILABLE}


def test_unavailable_requests_are_retried_on_another_worker_once():
    ends = Ends()
    core = make_core(ends)
    gpu = core.state.workers["gpu0"]
    cpu = WorkerState("cpu0", "cpu", {"m": 8})
    core.add_worker(cpu, 0.0)
    core.state.cost("m", "cpu").launch_s = 1.0  # the GPU is the clear first choice
    req = core.admit("m", 1, 1, 5.0, 0.0, req_id=1)
    (batch,) = core.decide(0.0)
    assert batch.worker is gpu
    core.complete(batch.batch_id, None, 0.01)
    core.batch_health(gpu, True, 0.01, "m")
    assert core.retry_elsewhere(req, gpu, 0.01) is True
    (again,) = core.decide(0.01)
    assert again.worker is cpu and again.requests == [req]
    core.complete(again.batch_id, None, 0.02)
    assert core.retry_elsewhere(req, cpu, 0.02) is False  # one retry only
    core.add_worker(WorkerState("solo", "cpu", {"other": 1}), 0.0)
    lone = core.admit("other", 1, 1, 5.0, 0.03, req_id=2)
    (b,) = core.decide(0.03)
    core.complete(b.batch_id, None, 0.04)
    assert core.retry_elsewhere(lone, b.worker, 0.04) is False  # nobody else serves "other"


class _Spinning(Exception):
    pass


def _decide_within(core, now, seconds=5.0):
    """core.decide(now), failing the test instead of hanging it if decide never returns."""
    import signal

    def alarm(*_):
        raise _Spinning("decide() did not return")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return core.decide(now)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_workers_of_different_max_batches_never_spin_the_dispatcher():
    """Workers may register different max batches. A 9-item request with a max-8 worker in the
    plan made send() take nothing and try again forever: the dispatcher's one thread spun, nobody
    got a reply. It goes to the worker it fits; once no worker left takes it, it fails; a new one
    is refused on arrival."""
    ends = Ends()
    core = RequestCore(make_policy("mcb"), ends.on_fail)
    core.add_worker(WorkerState("big", "gpu", {"m": 32}), 0.0)
    core.add_worker(WorkerState("small", "cpu", {"m": 8}), 0.0)
    core.admit("m", 9, 1, 1.0, 0.0, req_id=1)
    (batch,) = _decide_within(core, 0.0)
    assert batch.worker.name == "big" and batch.items == 9
    core.admit("m", 9, 1, 1.0, 0.0, req_id=2)  # waits for big (busy)
    assert _decide_within(core, 0.001) == [] and not ends.failed
    core.worker_lost("big", "gone", 0.002)  # its batch's request 1 goes back to the queue too
    assert ends.failed == {1: Status.UNAVAILABLE, 2: Status.UNAVAILABLE}
    assert not core.state.queue("m").requests
    refused = core.admit("m", 9, 1, 1.0, 0.003, req_id=3)
    assert isinstance(refused, Rejected) and refused.status == Status.INVALID_ARGUMENT
    assert _decide_within(core, 0.003) == []


def test_an_answer_from_a_worker_the_batch_was_not_sent_to_is_dropped():
    """After a dispatcher restart a worker that outlived it may answer a batch of the previous
    run; its number was reused, and the answer went to another client's request. The batch stays
    with its own worker, and each run numbers its batches from its own start."""
    ends = Ends()
    core = make_core(ends)
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 8}), 0.0)
    core.admit("m", 1, 1, 1.0, 0.0, req_id=1)
    (batch,) = core.decide(0.0)
    other = "cpu0" if batch.worker.name == "gpu0" else "gpu0"
    assert core.complete(batch.batch_id, 0.001, 0.001, worker=other) is None
    assert core.complete(batch.batch_id, 0.001, 0.001, worker=batch.worker.name) is batch
    firsts = set()
    for _ in range(3):
        c = make_core(Ends())
        c.admit("m", 1, 1, 1.0, 0.0, req_id=1)
        firsts.add(c.decide(0.0)[0].batch_id)
    assert len(firsts) == 3


def test_a_suspended_worker_still_counts_for_the_largest_batch():
    """A worker out of rotation for a while (the circuit breaker) comes back: a request only it
    can take is queued for it, not refused."""
    ends = Ends()
    core = RequestCore(make_policy("mcb"), ends.on_fail)
    big = WorkerState("big", "gpu", {"m": 32})
    core.add_worker(big, 0.0)
    core.add_worker(WorkerState("small", "cpu", {"m": 8}), 0.0)
    core.state.suspend(big)
    req = core.admit("m", 9, 1, 1.0, 0.0, req_id=1)
    assert not isinstance(req, Rejected) and not ends.failed
    assert _decide_within(core, 0.0) == []
    core.state.resume(big)
    (batch,) = _decide_within(core, 0.001)
    assert batch.worker is big and batch.items == 9


def test_a_queued_request_is_judged_hopeless_on_the_paths_it_has_now():
    """The instant a queued request becomes hopeless was fixed on arrival, from the paths then: a
    faster worker that registered since failed it all the same, "90 ms left, the fastest path
    takes 1 ms". It is judged on the paths of the moment, and the new worker serves it."""
    from batchyard.cost_model import CostCurve

    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail)
    core.state.costs[("m", "cpu")] = CostCurve(launch_s=0.0, per_item_s=0.1, samples=100)
    core.state.costs[("m", "gpu")] = CostCurve(launch_s=0.001, per_item_s=0.0, samples=100)
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 8}), 0.0)
    core.admit("m", 1, 1, 10.0, 0.0, req_id=1)
    (busy,) = core.decide(0.0)  # cpu0 is busy for 100 ms
    core.admit("m", 1, 1, 0.25, 0.0, req_id=2)  # cpu0 alone: hopeless from 160 ms on
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), 0.01)
    core.state.workers["gpu0"].inflight = 1  # busy too, so the request stays queued
    core.decide(0.17)
    assert not ends.failed
    core.state.workers["gpu0"].inflight = 0
    (batch,) = core.decide(0.18)
    assert batch.worker.name == "gpu0" and [r.req_id for r in batch.requests] == [2]
    core.worker_lost("gpu0", "gone", 0.19)  # its batch's request goes back to the queue once
    core.complete(busy.batch_id, 0.1, 0.19)
    core.decide(0.19)  # cpu0, the only path left, cannot make the 60 ms left
    assert ends.failed == {2: Status.DEADLINE_EXCEEDED}


def test_a_request_only_a_busy_bigger_worker_takes_does_not_hold_up_the_ones_behind_it():
    """Workers of different max batches: a 9-item request at the head waits for the max-32 worker,
    busy; the 1-item requests behind it went nowhere although the max-8 worker was free."""
    for policy in ("mcb", "greedy", "escape:2"):
        ends = Ends()
        core = RequestCore(make_policy(policy), ends.on_fail)
        core.add_worker(WorkerState("big", "gpu", {"m": 32}), 0.0)
        core.add_worker(WorkerState("small", "cpu", {"m": 8}), 0.0)
        core.state.workers["big"].inflight = 1
        core.state.workers["big"].busy_until = 0.01
        for i, items in enumerate((9, 1, 1), 1):
            core.admit("m", items, 1, 1.0, 0.0, req_id=i)
        (batch,) = _decide_within(core, 0.0)
        assert batch.worker.name == "small", policy
        assert [r.req_id for r in batch.requests] == [2, 3], policy
        assert core.state.queue("m").by_priority[1][0].req_id == 1 and not ends.failed


def test_a_reused_request_id_still_cancels_the_request_queued_under_it():
    """A client sent id 8 twice; when the first finished it removed the id's entry, which by then
    was the second's, and a cancel of 8 no longer reached the queued second."""
    ends = Ends()
    core = make_core(ends)
    first = core.admit("m", 1, 1, 1.0, 0.0, client=b"c", req_id=8)
    (batch,) = core.decide(0.0)
    core.admit("m", 1, 1, 1.0, 0.0, client=b"c", req_id=8)  # queued: the only worker is busy
    core.complete(batch.batch_id, 0.001, 0.001)
    assert core.finish(first)
    assert core.cancel(b"c", 8) and ends.failed == {8: Status.CANCELLED}


def test_one_connection_holds_a_bounded_number_of_status_long_polls():
    """One connection held 100,000 long polls, each scanned at every step: every other client's
    round trip went from 0.8 to 36 ms. Past its share a poll is answered at once."""
    from batchyard.core import MAX_STATUS_WAITERS

    core = make_core(Ends())
    for i in range(MAX_STATUS_WAITERS):
        assert core.add_status_waiter(("c", i), 10**6, 100.0, owner="c")
    assert not core.add_status_waiter(("c", -1), 10**6, 100.0, owner="c")
    assert core.add_status_waiter(("d", 0), 10**6, 50.0, owner="d")  # another connection has its own share
    assert core.next_wake() == 50.0 and core.due_status_waiters(1.0) == []
    assert core.due_status_waiters(50.0) == [("d", 0)]
    assert len(core.due_status_waiters(100.0)) == MAX_STATUS_WAITERS and not core.status_waiters
    assert core.add_status_waiter(("c", 99), 10**6, 200.0, owner="c")  # answered ones free the share


def test_the_node_holds_a_bounded_number_of_status_long_polls_across_connections():
    """Connections that sent their share of polls and closed left them held for as long as the
    poll asked (up to years): 3000 of them kept 62 MiB, and every registration looked through
    them all. Past the node's cap a poll is answered at once."""
    from batchyard.core import MAX_STATUS_WAITERS, MAX_STATUS_WAITERS_NODE

    core = make_core(Ends())
    owners = MAX_STATUS_WAITERS_NODE // MAX_STATUS_WAITERS
    for o in range(owners):
        for i in range(MAX_STATUS_WAITERS):
            assert core.add_status_waiter((o, i), 10**6, 1e9, owner=o)
    assert not core.add_status_waiter(("new", 0), 10**6, 1e9, owner="new")
    # ... and the caller's answer-now fallback still is answered (it was refused too: no status
    # request, readiness probes included, was answered until the held polls expired)
    assert core.add_status_waiter(("new", 0), 0, 0.0)
    assert core.due_status_waiters(0.0) == [("new", 0)]


def test_a_batch_queued_in_its_worker_behind_a_long_one_is_not_taken_for_hung():
    """max_inflight 2: a batch whose request expired while it waited in the worker behind a long
    batch was judged alone, worker_dead_after_s past its deadline: the healthy worker was made
    to exit, and the long batch's request, run again, failed UNAVAILABLE at the next such loss.
    It is judged once the batch ahead of it is back, from then on."""
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail, worker_dead_after_s=1.0)
    core.add_worker(WorkerState("w0", "cpu", {"m": 8}, capacity=2), 0.0)
    core.state.cost("m", "cpu").observe(1, 4.0)  # the long batch takes what it took before: 4 s
    core.admit("m", 1, 1, 30.0, 0.0, client=b"c", req_id=1)
    (long_batch,) = core.decide(0.0)
    core.admit("m", 1, 1, 0.5, 0.1, client=b"c", req_id=2)
    (behind,) = core.decide(0.1)
    for t in (0.6, 1.6, 3.0, 4.0):
        core.heartbeat("w0", t)
        core.decide(t)
        assert core.check_liveness(t) == [], t
    assert ends.failed == {2: Status.DEADLINE_EXCEEDED}
    assert core.complete(long_batch.batch_id, 4.0, 4.0, worker="w0") is long_batch
    core.heartbeat("w0", 4.9)
    assert core.check_liveness(4.9) == []  # it may have started at 4.0
    core.heartbeat("w0", 5.1)
    (lost,) = core.check_liveness(5.1)
    assert lost[0].name == "w0" and "1.0 s past the batch before it came back" in lost[1]
    assert 1 not in ends.failed


def test_a_worker_that_bounds_its_batches_is_not_taken_for_hung_within_its_bound():
    """A Triton worker's call to a slow Triton model (15 s a batch, 2 s deadlines) ends within its
    own timeout: judged at the last deadline plus worker_dead_after_s, the healthy worker was made
    to exit and restarted, its other models' requests failed meanwhile (an outside review). It
    declares its bound (Register.batch_bound_s); past it and worker_dead_after_s, it is hung."""
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail, worker_dead_after_s=10.0)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}, capacity=2, batch_bound_s=62.0), 0.0)
    core.admit("m", 1, 1, 2.0, 0.0, client=b"c", req_id=1)
    core.decide(0.0)
    for t in (2.5, 12.5, 40.0, 71.9):
        core.heartbeat("gpu0", t)
        core.decide(t)
        assert core.check_liveness(t) == [], t
    core.heartbeat("gpu0", 72.1)
    (lost,) = core.check_liveness(72.1)
    assert lost[0].name == "gpu0" and "never came back" in lost[1]


def test_a_batch_that_never_comes_back_does_not_hold_its_worker_for_good():
    """A worker heartbeats from a thread of its own: one whose batch never came back kept its
    slot, and every later request was refused "cannot finish before its deadline on any path"."""
    ends = Ends()
    core = make_core(ends, worker_dead_after_s=10.0)
    core.admit("m", 1, 1, 1.0, 0.0, client=b"c", req_id=1)
    (batch,) = core.decide(0.0)
    for t in (0.5, 1.5, 6.0, 10.9):
        core.heartbeat("gpu0", t)
        core.decide(t)
        assert core.check_liveness(t) == []
    assert ends.failed == {1: Status.DEADLINE_EXCEEDED} and not core.state.workers["gpu0"].free
    core.heartbeat("gpu0", 11.1)
    (lost,) = core.check_liveness(11.1)
    assert lost[0].name == "gpu0" and "never came back" in lost[1]
    assert core.heartbeat("gpu0", 11.2) is False  # unknown now
    assert "never came back" in core.hung["gpu0"]  # so told to exit and be started again
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), 11.3)
    assert core.hung == {}
    core.admit("m", 1, 1, 1.0, 11.3, client=b"c", req_id=2)
    (again,) = core.decide(11.3)
    assert again.worker.name == "gpu0"
    assert core.complete(batch.batch_id, 0.01, 11.4, worker="gpu0") is None  # the old answer, if it comes


# ---------------------------------------------------------------- workers of different max batches
# Workers may register different max batches; a request only some of them take must go to one
# of those (or wait for one that is busy), never sit beside a free one until its deadline.

def _sent(core, now):
    return [(b.worker.name, [r.req_id for r in b.requests]) for b in core.decide(now)]


def test_mcb_sends_a_request_its_plan_gave_to_a_worker_too_small_for_it_to_one_that_takes_it():
    """A lone 3-item request, a free GPU of max batch 2 (the plan's cheaper place for its items)
    and a free CPU of 8: nothing was sent and no wake-up set, at every decision until its deadline."""
    from batchyard.cost_model import CostCurve

    ends = Ends()
    core = RequestCore(make_policy("mcb"), ends.on_fail)
    gpu = CostCurve(launch_s=0.0, per_item_s=1e-5)
    gpu.samples = 100
    core.state.costs[("m", "gpu")] = gpu
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 8}), 0.0)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 2}), 0.0)
    core.admit("m", 3, 1, 0.1, 0.0, client=b"c", req_id=1)
    assert _sent(core, 0.0) == [("cpu0", [1])]


def test_a_worker_passing_over_a_head_too_big_for_it_takes_the_next_request_alone():
    """take_batch: the head (3 items) is past this worker's max batch of 2; the next request (2
    items) is past the 1 item the policy asked for, but within the max batch: it goes alone, as
    such a head does (nothing was taken, and under MCB it waited for its deadline)."""
    from batchyard.policy_core import take_batch
    from batchyard.state import ModelQueue, Request

    q = ModelQueue("m")
    q.push(Request(1, "m", 3, 1, 0.0, 1.0))
    q.push(Request(2, "m", 2, 1, 0.0, 1.0))
    assert [r.seq for r in take_batch(q, 1, 2)] == [2]
    assert [r.seq for cls in q.by_priority for r in cls] == [1]


def test_a_worker_back_with_a_smaller_max_batch_fails_the_requests_no_worker_takes_now():
    """A worker restarts with max batch 4 while a 5-item request waits: no worker can take it.
    It is failed then, as it would be had the worker left, instead of waiting for its deadline;
    a request that fits is served."""
    for policy in ("greedy", "mcb"):
        ends = Ends()
        core = RequestCore(make_policy(policy), ends.on_fail)
        core.add_worker(WorkerState("cpu0", "cpu", {"m": 8}), 0.0)
        core.admit("m", 1, 1, 30.0, 0.0, client=b"c", req_id=1)
        core.decide(0.0)  # cpu0 busy with request 1
        core.admit("m", 5, 1, 30.0, 0.0, client=b"c", req_id=2)
        core.add_worker(WorkerState("cpu0", "cpu", {"m": 4}), 0.001)  # restarted: request 1 queued again
        assert ends.failed.get(2) == Status.UNAVAILABLE, policy
        core.admit("m", 2, 1, 30.0, 0.001, client=b"c", req_id=3)
        (first,) = core.decide(0.001)  # request 1, back from the lost worker, runs alone
        assert [r.req_id for r in first.requests] == [1], policy
        core.complete(first.batch_id, 1e-3, 0.002)
        assert _sent(core, 0.002) == [("cpu0", [3])], policy


@pytest.mark.parametrize("path", ["core", "server"])
def test_a_bigger_worker_that_restarts_keeps_the_requests_only_it_takes(path):
    """gpu0 (max batch 8) restarts beside cpu0 (2) with a 4-item request running and another
    queued: its loss was checked against cpu0 alone, before it registered again in the same
    call, and both failed UNAVAILABLE "more than any worker left takes" (an outside review).
    "server": as the dispatcher does it, the old process taken out first (its batches'
    memory released), then the new one added."""
    for policy in ("greedy", "mcb"):
        ends = Ends()
        core = RequestCore(make_policy(policy), ends.on_fail)
        core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}, pid=100), 0.0)
        core.add_worker(WorkerState("cpu0", "cpu", {"m": 2}, pid=200), 0.0)
        core.admit("m", 4, 1, 5.0, 0.0, client=b"c", req_id=1)
        assert _sent(core, 0.0) == [("gpu0", [1])], policy
        core.admit("m", 4, 1, 5.0, 0.001, client=b"c", req_id=2)
        back = WorkerState("gpu0", "gpu", {"m": 8}, pid=101)
        if path == "core":
            core.add_worker(back, 0.05)
        else:
            core.add_worker(back, 0.05, core.worker_lost("gpu0", "worker re-registered", 0.05, returning=True))
        assert not ends.failed, (policy, ends.failed)
        (first,) = core.decide(0.05)  # request 1, back from the lost worker, runs alone
        assert (first.worker.name, [r.req_id for r in first.requests]) == ("gpu0", [1]), policy
        core.complete(first.batch_id, 1e-3, 0.06)
        assert _sent(core, 0.06) == [("gpu0", [2])], policy


def test_requests_queued_before_any_worker_wait_for_every_worker_to_register():
    """Queued while no worker was up (starting): a smaller worker registering first must not fail
    what a bigger one registering next takes."""
    ends = Ends()
    core = RequestCore(make_policy("mcb"), ends.on_fail)
    core.admit("m", 5, 1, 30.0, 0.0, client=b"c", req_id=1)
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 2}), 0.001)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), 0.002)
    assert not ends.failed
    assert _sent(core, 0.002) == [("gpu0", [1])]


def test_three_segment_tries_every_free_worker_of_its_path():
    """Only the first free GPU was tried: one of max batch 2 could not take a 5-item request, and
    a free one of 16 beside it was left idle with no wake-up."""
    ends = Ends()
    core = RequestCore(make_policy("three-segment"), ends.on_fail)
    core.add_worker(WorkerState("gpu-small", "gpu", {"m": 2}), 0.0)
    core.add_worker(WorkerState("gpu-big", "gpu", {"m": 16}), 0.0)
    core.admit("m", 5, 1, 1.0, 0.0, client=b"c", req_id=1)
    assert _sent(core, 0.0) == [("gpu-big", [1])]


def test_a_result_for_a_request_already_queued_again_is_not_delivered():
    """A broken worker answers one request twice, UNAVAILABLE then OK: the first result queues
    it again for another worker; the second must not deliver it (the client got OK, then the
    request ran again and was answered a second time)."""
    ends = Ends()
    core = make_core(ends)
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 8}), 0.0)
    req = core.admit("m", 1, 1, 1.0, 0.0, client=b"c", req_id=1)
    (batch,) = core.decide(0.0)
    core.complete(batch.batch_id, 1e-3, 0.001)
    assert core.retry_elsewhere(req, batch.worker, 0.001)
    assert core.finish(req) is False
    (again,) = core.decide(0.001)
    assert again.requests == [req]
    core.complete(again.batch_id, 1e-3, 0.002)
    ends.finish(core, req)
    assert ends.finished == {1} and not ends.twice


def test_a_batch_that_never_reached_its_worker_spends_no_retry():
    """A send that failed (the worker's connection gone) was failed over as a batch that ran:
    with two such workers, a request that reached neither was answered UNAVAILABLE beside a
    free, healthy worker."""
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail)
    for name in ("cpu0", "cpu1"):
        core.add_worker(WorkerState(name, "cpu", {"m": 8}), 0.0)
    req = core.admit("m", 1, 1, 1.0, 0.0, req_id=1)
    for _ in range(2):  # as the dispatcher's send loop: both sends fail
        (batch,) = core.decide(0.0)
        core.undelivered(batch)
        core.worker_lost(batch.worker.name, "unreachable", 0.0)
    assert req.retries == 0 and not req.suspect and not ends.failed
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), 0.0)
    (batch,) = core.decide(0.0)
    assert core.complete(batch.batch_id, 0.001, 0.001) is batch
    ends.finish(core, req)
    assert ends.finished == {1}


def test_three_segment_woken_at_its_break_even_instant_sends_rather_than_waits_again():
    """Woken at t_flip, rounding still said "wait" with the wake-up at the decision's own
    instant, which no timer arms: the queue stayed beside an idle worker until its deadline."""
    ends = Ends()
    core = RequestCore(make_policy("three-segment"), ends.on_fail)
    core.add_worker(WorkerState("w0", "cpu", {"m": 1}), 0.0)
    core.add_worker(WorkerState("w1", "cpu", {"m": 3}), 0.0)
    inflight, now = {}, 0.0
    for i in range(3):
        core.admit("m", 1, 0, 0.0, now, client=b"c", req_id=i)
        for b in core.decide(now):
            inflight[b.batch_id] = now + 1e-7
    served = 0
    while True:  # the simulator's and the live loop's: completions, then the core's next wake-up
        wake = core.next_wake()
        t = min([*inflight.values(), wake if wake > now else math.inf])
        assert t < 1.0, f"{core.state.queue('m').requests} queued, nothing due before the deadline"
        now = t
        for bid in [b for b, t_done in inflight.items() if t_done <= now]:
            del inflight[bid]
            for r in core.complete(bid, None, now).requests:
                served += core.finish(r)
        for b in core.decide(now):
            inflight[b.batch_id] = now + 1e-7
        assert core.wake_at > now  # never a wake-up at the decision's own instant
        if served == 3:
            break
    assert ends.failed == {}


@pytest.mark.parametrize("policy", ["three-segment", "gpu-only"])
def test_a_head_no_gpu_takes_goes_to_a_free_worker_that_does_whatever_the_gpu_does(policy):
    # More items than the GPU's max batch: it waited beside the idle CPU until its deadline,
    # not looked at while the GPU was busy, and passed over by every batch the GPU took.
    ends = Ends()
    core = RequestCore(make_policy(policy), ends.on_fail)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), 0.0)
    core.add_worker(WorkerState("amx0", "cpu", {"m": 32}), 0.0)
    gpu = core.state.workers["gpu0"]
    gpu.inflight, gpu.busy_until = 1, 1.0  # busy
    core.admit("m", 16, 1, 1.0, 0.0, client=b"c", req_id=1)
    [batch] = core.decide(0.0)
    assert (batch.worker.name, [r.req_id for r in batch.requests]) == ("amx0", [1])
    core.complete(batch.batch_id, 0.001, 0.001)
    gpu.inflight = 0  # free again
    core.admit("m", 1, 1, 1.0, 0.001, client=b"c", req_id=2)
    core.admit("m", 16, 1, 1.0, 0.001, client=b"c", req_id=3)
    assert sorted(_sent(core, 0.001)) == [("amx0", [3]), ("gpu0", [2])]
def test_a_request_of_no_items_is_refused_not_queued():
    core = RequestCore(make_policy("three-segment"), Ends().on_fail)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), 0.0)
    got = core.admit("m", 0, 1, 1.0, 0.0, client=b"c", req_id=1)
    assert type(got) is Rejected and got.status == Status.INVALID_ARGUMENT
    assert core.decide(0.0) == []


def test_a_policys_wake_up_at_the_decisions_instant_hides_no_deadline():
    """Such a wake-up repeats the decision and no timer arms it; kept as the core's, it was the
    earliest instant next_wake() gave, and the deadlines behind it were never armed."""
    from batchyard.policy_core import Decision

    class WakesAtOnce:
        name = "wakes-at-once"

        def decide(self, state, now):
            return Decision(wake_at=now)

    core = RequestCore(WakesAtOnce(), Ends().on_fail)
    core.admit("m", 1, 1, 0.5, 0.0, client=b"c", req_id=1)
    core.decide(0.1)
    assert 0.1 < core.next_wake() <= 0.5


def test_many_requests_expiring_behind_patient_ones_leave_the_queue_in_order():
    # They leave in one pass over their class (removed one by one, 1,000 behind 10,000 took
    # 171 ms of the loop here): the rest keep their order and the counts stay right.
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail, max_queue=10**6)
    core.add_worker(WorkerState("g0", "gpu", {"m": 8}), 0.0)
    w = core.state.workers["g0"]
    w.inflight, w.busy_until = 1, 0.0  # busy: nothing is dispatched
    for i in range(60):
        core.admit("m", 1 + i % 3, 1, 0.5 if i % 4 == 0 else 100.0, 0.0, client=b"c", req_id=i)
    core.decide(1.0)
    assert sorted(ends.failed) == list(range(0, 60, 4)) and not ends.twice
    q = core.state.queue("m")
    left = [r.req_id for dq in q.by_priority for r in dq]  # (aged into the high class meanwhile, in order)
    assert left == [i for i in range(60) if i % 4]
    assert q.requests == 45 and q.items == sum(1 + i % 3 for i in range(60) if i % 4) == sum(q.class_items)


def test_a_leaving_worker_gets_no_new_batch_and_its_batch_in_flight_completes():
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail)
    core.add_worker(WorkerState("w0", "gpu", {"m": 8}, capacity=2), 0.0)
    core.admit("m", 1, 1, 1.0, 0.0, client=b"c", req_id=1)
    [batch] = core.decide(0.0)
    assert core.leaving("w0") and not core.leaving("nobody")
    core.admit("m", 1, 1, 10.0, 0.0, client=b"c", req_id=2)
    assert core.decide(0.001) == []  # a free slot, but it is stopping
    done = core.complete(batch.batch_id, 0.001, 0.002)
    assert [r.req_id for r in done.requests] == [1]
    # its batch came back all UNAVAILABLE: the breaker's back-off must not bring it back after
    assert core.batch_health(done.worker, True, 0.002, "m") is None
    assert core.decide(5.0) == []
    core.add_worker(WorkerState("w1", "gpu", {"m": 8}), 5.0)
    assert _sent(core, 5.0) == [("w1", [2])]


def test_a_model_its_curves_call_too_slow_for_every_timeout_is_probed_once_a_second_and_recovers():
    """Refused on a prediction alone, nothing runs, so nothing corrects the prediction: after a
    slow spell (or with a profile in ms read as s) every request of a shorter timeout was refused
    on arrival until the dispatcher restarted. Once a second without a batch to learn from, one
    such request is admitted and run, whatever the curves say."""
    ends = Ends()
    core = make_core(ends)
    curve = core.state.cost("m", "gpu")
    for _ in range(20):
        curve.observe(1, 0.150)  # what the spell taught
    assert core.admit("m", 1, 1, 0.100, 0.0, req_id=1).probe  # nothing learnt yet: a probe
    (batch,) = core.decide(0.0)
    core.complete(batch.batch_id, 0.150, 0.150)  # still slow: learnt, and its request is late
    now, served = 0.2, []
    for i in range(2, 400):
        now += 0.01
        got = core.admit("m", 1, 1, 0.100, now, req_id=i)
        if type(got) is Rejected:
            assert got.status == Status.DEADLINE_EXCEEDED
            continue
        (batch,) = core.decide(now)
        assert batch.requests == [got]  # run, not shed as late
        core.complete(batch.batch_id, 0.001, now + 0.001)  # the spell is over
        ends.finish(core, got)
        served.append(now)
    # One probe a second until the curve has seen the spell end (three fast batches), then all.
    assert 1.0 <= served[0] - 0.15 < 1.02 and all(1.0 <= b - a < 1.02 for a, b in zip(served, served[1:3]))
    assert len(served) == 3 + round((now - served[2]) / 0.01)
    assert not ends.twice


def test_a_request_of_a_size_never_measured_is_probed_though_other_sizes_keep_teaching_the_curve():
    """A line fitted at B=1 alone cannot tell launch from per-item time: with one-item requests
    always flowing (so the model's once-a-second probe never came due), every 64-item request was
    refused on arrival on a prediction of 197 ms against a true 69 ms (live, SIMULATED worker at
    5 ms + 1 ms an item; an outside review). One such request a second is now run as a probe, and
    once its size is measured the next is judged on the measurement."""
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail)
    core.add_worker(WorkerState("w", "cpu", {"m": 64}), 0.0)
    curve = core.state.cost("m", "cpu")
    curve.launch_s, curve.per_item_s = 0.003, 0.003  # as the review's dispatcher had split T(1)
    for _ in range(50):
        curve.observe(1, 0.006)
    assert curve.predict(64) > 0.15
    now = 0.0
    core.state.learned_at["m"] = now  # a one-item batch just taught the curve: no model probe due
    big = core.admit("m", 64, 1, 0.1035, now, req_id=1)
    assert type(big) is not Rejected and big.probe
    second = core.admit("m", 64, 1, 0.1035, now + 0.001, req_id=2)  # within the second: refused
    assert type(second) is Rejected and second.status == Status.DEADLINE_EXCEEDED
    (batch,) = core.decide(now + 0.001)
    assert batch.requests == [big]  # run, not shed as late
    core.complete(batch.batch_id, 0.069, now + 0.070)
    ends.finish(core, big)
    assert curve.largest_measured() == 64
    core.state.learned_at["m"] = now + 0.9
    for rid in range(3, 13):  # measured now: admitted on the curve itself, as no probe
        got = core.admit("m", 64, 1, 0.1035, now + 0.9 + rid * 1e-3, req_id=rid)
        assert type(got) is not Rejected and not got.probe, got
    assert ends.finished == {1} and not ends.twice


@pytest.mark.parametrize("ending", ["served", "cancelled"])
def test_a_request_that_ended_holds_no_payload_however_long_its_deadline(ending):
    """MCB's deadline index held every request until its deadline passed and reached the top of
    its heap, and each request its payload frames: with 1-hour timeouts (or cancelled requests)
    the dispatcher held a MiB for each 1 MiB request answered, 1 GiB after 400 cancels."""
    import weakref

    class Payload(bytearray):
        pass

    ends = Ends()
    core = RequestCore(make_policy("mcb"), ends.on_fail)
    core.add_worker(WorkerState("w", "cpu", {"m": 4}), 0.0)
    alive, now, rid = [], 0.0, 0
    for _ in range(500):
        now += 0.01
        for timeout in (30.0, 3600.0, 30.0):  # the shorter ones keep a nearer deadline on top
            rid += 1
            frames = [b"header", Payload(1024)]
            alive.append(weakref.ref(frames[1]))
            core.admit("m", 1, 1, timeout, now, client=b"c", req_id=rid, frames=frames)
            del frames
        if ending == "cancelled":
            assert core.cancel(b"c", rid - 1)
        for b in core.decide(now):
            for r in core.complete(b.batch_id, 0.005, now + 0.005, "w").requests:
                ends.finish(core, r)
    import gc

    gc.collect()
    open_payloads = sum(1 for r in core.requests.values() if r.frames is not None)
    assert sum(ref() is not None for ref in alive) == open_payloads < 10


def test_a_silent_workers_request_that_writes_client_memory_is_not_run_again_elsewhere():
    """A worker silent past worker_dead_after_s may only be stalled. Its request retried on
    another worker was answered normally, its client reused the output region, and the stalled
    worker, resumed, wrote its old output over the next request's result. A request whose
    outputs go to shared memory now fails UNAVAILABLE in flight (its memory stays reserved);
    one with inline outputs is still retried."""
    ends = Ends()
    core = make_core(ends, worker_dead_after_s=0.6)
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 8}), 0.0)
    shm = core.admit("m", 1, 1, 30.0, 0.0, client=b"c", req_id=1)
    shm.writes_shm = True
    inline = core.admit("m", 1, 1, 30.0, 0.0, client=b"c", req_id=2)
    (batch, *_) = core.decide(0.0)
    assert {r.req_id for r in batch.requests} == {1, 2}
    core.heartbeat("cpu0", 1.0)
    (lost,) = core.check_liveness(1.0)  # gpu0 silent since 0.0
    assert lost[0].name == "gpu0"
    assert ends.failed == {1: Status.UNAVAILABLE} and shm.answered_in_flight
    assert inline.state == QUEUED and core.state.queue("m").requests == 1  # queued again for cpu0


@pytest.mark.parametrize("policy", ["window:3000000,8", "fixed:4", "mcb", "three-segment"])
def test_a_drain_sends_the_queue_to_a_free_worker_at_once_whatever_the_policy_waits_for(policy):
    """A drain admits nothing more, so no wait for an arrival pays: window:3000000,8 held a lone
    request beside the free worker for the whole drain, then it failed UNAVAILABLE."""
    ends = Ends()
    core = RequestCore(make_policy(policy), ends.on_fail)
    core.add_worker(WorkerState("gpu0", "gpu", {"m": 8}), 0.0)
    core.add_worker(WorkerState("cpu0", "cpu", {"m": 8}), 0.0)
    for i in range(40):  # steady traffic: a rate at which the batching rules wait for company
        core.admit("m", 1, 1, 60.0, i * 1e-4, client=b"c", req_id=100 + i)
        for b in core.decide(i * 1e-4):
            core.complete(b.batch_id, 1e-5, i * 1e-4 + 1e-5)
            for r in b.requests:
                core.finish(r)
    core.admit("m", 1, 1, 60.0, 0.005, client=b"c", req_id=1)
    core.begin_drain()
    sent = [r.req_id for b in core.decide(0.005) for r in b.requests]
    assert 1 in sent and not [r.req_id for r in core.requests.values() if r.state == QUEUED]


def test_a_drain_with_no_worker_left_for_its_queue_has_nothing_to_wait_for():
    """Workers stopped with the dispatcher (separate units, no ordering) left its queue to
    nobody, and the drain held it until drain_timeout_s."""
    ends = Ends()
    core = make_core(ends)
    core.state.workers["gpu0"].models["m"] = 1
    core.admit("m", 1, 1, 60.0, 0.0, client=b"c", req_id=1)
    core.admit("m", 1, 1, 60.0, 0.0, client=b"c", req_id=2)
    (b,) = core.decide(0.0)
    core.begin_drain()
    assert not core.unservable()  # a batch is out, and its worker serves the queue after it
    core.complete(b.batch_id, 0.1, 0.1)
    for r in b.requests:
        core.finish(r)
    core.leaving("gpu0")
    assert core.unservable() and not core.drained()


def test_a_drain_whose_queue_holds_only_requests_too_big_for_every_worker_has_nothing_to_wait_for():
    """A 16-item request queued before a worker of max batch 8 registered (a first registration
    keeps the queue) held the drain until drain_timeout_s."""
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail)
    core.add_worker(WorkerState("w0", "cpu", {"m": 16}), 0.0)
    core.leaving("w0")
    core.admit("m", 16, 1, 60.0, 0.0, client=b"c", req_id=1)
    core.add_worker(WorkerState("w1", "cpu", {"m": 8}), 0.1)
    core.begin_drain()
    assert core.decide(0.2) == [] and not ends.failed and core.state.queue("m").items == 16
    assert core.unservable()
    core.admit("m", 4, 1, 60.0, 0.2, client=b"c", req_id=2)  # (refused: the drain admits nothing)
    assert core.unservable()


def test_requests_refused_on_arrival_do_not_count_in_the_arrival_rate():
    """The arrival rate tells MCB how many requests will join a batch if it waits; a request
    refused on arrival joins none. Counted, three refused ones held the next request 117-164 ms
    on an idle worker (T(1) = 400 ms), waiting for company that never came."""
    ends = Ends()
    core = make_core(ends)
    core.state.cost("m", "gpu").observe(1, 0.4)
    core.state.learned_at["m"] = 0.0  # just learned: no probe due
    for i in range(3):
        assert isinstance(core.admit("m", 1, 1, 0.1, 0.001 * i, client=b"c", req_id=i), Rejected)
    assert core.state.arrival("m").rate(0.003) == 0.0
    for i in (8, 9):  # (the rate is known from the second arrival on)
        core.admit("m", 1, 1, 5.0, 0.001 * i, client=b"c", req_id=i)
    assert core.state.arrival("m").rate(0.009) > 0.0


def test_a_worker_whose_first_batch_hangs_is_found_by_the_batch_behind_it():
    """max_inflight 2, the first batch (a request of a 1-hour timeout) hangs, heartbeats still
    coming: judged only as the oldest, it was found an hour later, both slots taken meanwhile.
    The batch behind it, its request expired, shows it once the first is overdue (its curve's
    time, OVERDUE_FACTOR times, plus worker_dead_after_s)."""
    ends = Ends()
    core = RequestCore(make_policy("greedy"), ends.on_fail, worker_dead_after_s=1.0)
    core.add_worker(WorkerState("w0", "cpu", {"m": 8}, capacity=2), 0.0)
    core.state.cost("m", "cpu").observe(1, 0.010)  # a batch of 1 takes 10 ms
    core.admit("m", 1, 1, 3600.0, 0.0, client=b"c", req_id=1)
    core.decide(0.0)
    core.admit("m", 1, 1, 0.5, 0.1, client=b"c", req_id=2)
    core.decide(0.1)
    for t in (0.6, 1.0):
        core.heartbeat("w0", t)
        core.decide(t)
        assert core.check_liveness(t) == [], t
    core.heartbeat("w0", 1.7)
    (lost,) = core.check_liveness(1.7)
    assert lost[0].name == "w0" and "running for 1.7 s" in lost[1], lost[1]
