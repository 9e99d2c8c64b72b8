"""The dispatcher's one-shot timer: every wake-up the decision asks for is armed."""

from __future__ import annotations

import itertools
import time
import types

import zmq

from batchyard import server
from batchyard.config import DispatcherConfig
from batchyard.policy_core import Decision
from batchyard.server import Dispatcher

from conftest import SUM_MODEL


def test_a_wake_up_the_step_outlasted_is_still_armed(run_dir, monkeypatch):
    """The policy asks to decide again 100 us after its decision, and the step takes longer than
    that (a busy core). The wake-up was compared with the clock read after the step, found past,
    and dropped, and with it every later one (deadlines, housekeeping): a window of 100 us became
    a wait for the next message, up to a heartbeat interval."""
    ctx = zmq.Context()
    d = Dispatcher(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                   (SUM_MODEL.spec(),), ctx=ctx)
    try:
        base, reads = time.monotonic(), itertools.count(1)
        monkeypatch.setattr(server, "_now", lambda: base + 150e-6 * next(reads))  # each read 150 us on
        decided = []

        def policy(state, now):
            decided.append(now)
            return Decision(wake_at=now + 100e-6)

        monkeypatch.setattr(d.core.policy, "decide", policy)
        d._step_once()
        assert decided and d.timer.armed_at == decided[-1] + 100e-6
    finally:
        d.close()
        ctx.term()


def test_batches_sent_to_a_gone_worker_spend_no_retry(run_dir):
    """A worker whose connection is gone, given two batches in one decision (max_inflight 2): the
    first send failed, and losing the worker failed over the second, never sent, as if it had run:
    its requests' one retry spent, and each made a suspect that runs alone."""
    from batchyard.policy import make_policy
    from batchyard.state import QUEUED, WorkerState

    ctx = zmq.Context()
    d = Dispatcher(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                   (SUM_MODEL.spec(),), ctx=ctx)
    try:
        d.core.policy = make_policy("greedy")
        d.core.add_worker(WorkerState("A", "cpu", {"sum": 2}, capacity=2, identity=b"A"), 0.0)  # never connected
        reqs = [d.core.admit("sum", 1, 1, 30.0, time.monotonic(), b"c", i, [b"header"]) for i in range(4)]
        d._step_once()
        assert "A" not in d.state.workers
        assert all(r.state == QUEUED and r.retries == 0 and not r.suspect for r in reqs)
        assert d.state.queue("sum").requests == 4
    finally:
        d.close()
        ctx.term()


def test_heartbeats_that_came_during_a_long_drain_of_the_clients_keep_their_worker(run_dir, monkeypatch):
    """A step whose drain of the clients' socket took long (one client's message of a million
    frames held it 2.2 s): the worker's heartbeats came meanwhile, unread when liveness was
    judged, and the healthy worker was taken out of rotation for "no heartbeat"."""
    from batchyard import protocol as P

    ctx = zmq.Context()
    d = Dispatcher(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be",
                                    worker_dead_after_s=1.0), (SUM_MODEL.spec(),), ctx=ctx)
    worker = ctx.socket(zmq.DEALER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.connect(f"ipc://{run_dir}/be")
    try:
        clock = [time.monotonic()]
        monkeypatch.setattr(server, "_now", lambda: clock[0])
        worker.send(P.encode(P.Register(v=P.PROTOCOL_VERSION, worker="w0", pid=4242, path="cpu",
                                        models=[SUM_MODEL.spec()])))
        assert d.backend.poll(10_000)
        d._step_once()
        assert worker.poll(10_000) and "w0" in d.state.workers
        drain_clients = d._recv_from_clients

        def a_long_drain(now):
            drain_clients(now)
            clock[0] += 3.0  # three heartbeat intervals of the worker's pass meanwhile
            worker.send(P.encode(P.Heartbeat(worker="w0")))
            assert d.backend.poll(10_000)  # come, unread

        monkeypatch.setattr(d, "_recv_from_clients", a_long_drain)
        d.loop = types.SimpleNamespace(call_soon=lambda f: None)  # (a step left input unread: run again)
        d._step_once()
        assert "w0" in d.state.workers and d.core.departures == 0
    finally:
        vars(d).pop("loop", None)
        worker.close()
        d.close()
        ctx.term()
