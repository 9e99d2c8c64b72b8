"""A client whose dispatcher dies learns it within seconds (UNAVAILABLE, not its full timeout),
and the same client works again once a dispatcher is back on the address."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from batchyard.client import Client
from batchyard.config import DispatcherConfig, NodeConfig, to_toml
from batchyard.errors import Unavailable

from conftest import BIG_MODEL, ROOT, SUM_MODEL, sim_worker


@pytest.fixture
def processes():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def start(procs, config: Path, *args) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "--log-level", "WARNING", *args, "--config",
                          str(config)], cwd=ROOT, stdout=subprocess.DEVNULL)
    procs.append(p)
    return p


def dispatcher_alone(procs, run_dir, **dispatcher) -> NodeConfig:
    """A dispatcher of the `sum` model and no worker, on ipc endpoints in ``run_dir``, started."""
    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be", **dispatcher),
                      (SUM_MODEL,), ()).validate()
    config = Path(run_dir) / "node.toml"
    config.write_text(to_toml(node))
    start(procs, config, "dispatcher")
    return node


def bare_worker(node: NodeConfig, identity: bytes = b""):
    """A DEALER on the backend that the test drives as a worker, message by message."""
    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    if identity:
        s.setsockopt(zmq.IDENTITY, identity)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(node.dispatcher.backend)
    return s


def recv_as_worker(worker, kind):
    """The next message the dispatcher sends ``worker`` (a bare one), which must be a ``kind``:
    (the message, its frames)."""
    from batchyard import protocol as P

    assert worker.poll(30_000), f"no {kind.__name__} from the dispatcher"
    frames = worker.recv_multipart()
    msg = P.to_worker_decoder.decode(frames[0])
    assert type(msg) is kind, msg
    return msg, frames


def registered_worker(node: NodeConfig, name: str = "w0"):
    """A bare worker that has registered (a cpu worker of `sum`) and been answered."""
    from batchyard import protocol as P

    s = bare_worker(node)
    s.send(P.encode(P.Register(v=P.PROTOCOL_VERSION, worker=name, pid=4242, path="cpu", models=[SUM_MODEL.spec()])))
    assert s.poll(30_000)
    assert type(P.to_worker_decoder.decode(s.recv_multipart()[0])) is P.Registered
    return s


def test_a_dead_dispatcher_fails_requests_in_flight_fast_and_the_client_reconnects(run_dir, processes):
    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be",
                                       heartbeat_interval_s=0.1, worker_dead_after_s=2.0),
                      (SUM_MODEL, BIG_MODEL), (sim_worker("slow", launch_us=3_000_000.0),)).validate()
    config = Path(run_dir) / "node.toml"
    config.write_text(to_toml(node))
    dispatcher = start(processes, config, "dispatcher")
    start(processes, config, "worker", "--name", "slow")
    with Client(node.dispatcher.frontend) as c:
        assert c.status(min_registrations=1, wait=120).registrations == 1
        big = np.ones((1, 256, 1024), np.float32)  # through shared memory: needs the connection's grant
        assert c.infer("big", {"x": big}, timeout=30)["y"].shape == (1, 256, 1024)
        fut = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=60)
        c.status()  # the request has reached the dispatcher (status replies follow it)
        t0 = time.monotonic()
        os.kill(dispatcher.pid, signal.SIGKILL)
        with pytest.raises(Unavailable, match="lost the connection"):
            fut.result(timeout=30)
        assert time.monotonic() - t0 < 5.0  # not the request's 60 s
        start(processes, config, "dispatcher")  # a new dispatcher on the same address
        assert c.status(min_registrations=1, wait=60, timeout=30).registrations >= 1  # worker re-registered
        assert c.infer("sum", {"x": np.full((1, 4), 2, np.float32)}, timeout=30)["y"].tolist() == [[8.0, 8.0]]
        # The new dispatcher knows no grants: the client registers its segments again by itself.
        assert c.infer("big", {"x": big}, timeout=30)["y"].shape == (1, 256, 1024)


def test_a_worker_registering_twice_keeps_the_batch_it_was_given(run_dir, processes):
    """After a dispatcher restart, a worker's heartbeats sent before its registration was
    answered each draw a Reregister; one that lands late makes the same process register
    again. That is no restart: the batch it holds must not be failed over (it was, as "worker
    re-registered": CI's test_a_dead_dispatcher_fails_requests_in_flight_fast got UNAVAILABLE
    from it). A worker here is a bare socket, so the second registration comes exactly mid-batch."""
    from batchyard import protocol as P

    node = dispatcher_alone(processes, run_dir)
    spec = SUM_MODEL.spec()
    register = P.encode(P.Register(v=P.PROTOCOL_VERSION, worker="w0", pid=4242, path="cpu", models=[spec]))
    worker = bare_worker(node, b"w0")

    def recv(kind):
        return recv_as_worker(worker, kind)

    try:
        worker.send(register)
        recv(P.Registered)
        with Client(node.dispatcher.frontend) as c:
            fut = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=30)
            batch, _ = recv(P.Batch)
            worker.send(register)  # the same process (pid, connection) registers again
            recv(P.Registered)
            out = P.ItemResult(seq=batch.seqs[0], status=0, n_frames=1,
                               outputs=[P.TensorRef(name="y", dtype="float32", shape=[1, 2], frame=0)])
            worker.send_multipart([P.encode(P.BatchDone(batch_id=batch.batch_id, worker="w0", compute_us=100,
                                                        results=[out])), np.full((1, 2), 7, np.float32)])
            assert fut.result(timeout=30)["y"].tolist() == [[7.0, 7.0]]
            assert c.status().registrations == 1  # counted once
            # A restart with the same pid on the same connection (pid 1 in a container, over tcp):
            # its start token differs, and its batch is failed over, not kept for ever.
            fut = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=30)
            first, _ = recv(P.Batch)
            worker.send(P.encode(P.Register(v=P.PROTOCOL_VERSION, worker="w0", pid=4242, path="cpu", models=[spec],
                                            started="after-a-restart")))
            recv(P.Registered)
            again, _ = recv(P.Batch)  # the request, sent again to the restarted worker
            assert again.batch_id != first.batch_id and c.status().registrations == 2
            out.seq = again.seqs[0]
            worker.send_multipart([P.encode(P.BatchDone(batch_id=again.batch_id, worker="w0", compute_us=100,
                                                        results=[out])), np.full((1, 2), 7, np.float32)])
            assert fut.result(timeout=30)["y"].tolist() == [[7.0, 7.0]]
    finally:
        worker.close()


def test_a_worker_registering_a_max_batch_above_the_models_gets_batches_of_at_most_the_models(run_dir, processes):
    """A worker started from another config registered max_batch 64 for `sum` (16 in the node's
    config, which clients are told) and was sent batches of 32 items."""
    import msgspec

    from batchyard import protocol as P

    node = dispatcher_alone(processes, run_dir, policy="greedy")
    spec = msgspec.structs.replace(SUM_MODEL.spec(), max_batch=64)
    worker = bare_worker(node, b"w0")

    def recv(kind):
        return recv_as_worker(worker, kind)[0]

    try:
        worker.send(P.encode(P.Register(v=P.PROTOCOL_VERSION, worker="w0", pid=4242, path="cpu", models=[spec])))
        recv(P.Registered)
        with Client(node.dispatcher.frontend) as c:
            first = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=30)
            batch = recv(P.Batch)
            full = [c.submit("sum", {"x": np.ones((16, 4), np.float32)}, timeout=30) for _ in range(2)]
            c.status()  # both are queued behind the batch out (status replies follow them)
            out = P.ItemResult(seq=batch.seqs[0], status=0, n_frames=1,
                               outputs=[P.TensorRef(name="y", dtype="float32", shape=[1, 2], frame=0)])
            worker.send_multipart([P.encode(P.BatchDone(batch_id=batch.batch_id, worker="w0", compute_us=100,
                                                        results=[out])), np.full((1, 2), 7, np.float32)])
            assert first.result(timeout=30)["y"].tolist() == [[7.0, 7.0]]
            assert len(recv(P.Batch).seqs) == 1, "one request of 16 items: the model's max batch"
            for f in full:
                f.cancel()
    finally:
        worker.close()


def test_a_worker_result_whose_frames_do_not_add_up_is_internal_not_forwarded(run_dir, processes):
    """A worker's result that names a frame it did not send was forwarded as OK: the SDK's I/O
    thread died indexing it, and the caller's infer(timeout=...) never returned."""
    from batchyard import protocol as P
    from batchyard.errors import InternalError

    node = dispatcher_alone(processes, run_dir)
    register = P.encode(P.Register(v=P.PROTOCOL_VERSION, worker="w0", pid=4242, path="cpu", models=[SUM_MODEL.spec()]))
    worker = bare_worker(node)
    y = [P.TensorRef(name="y", dtype="float32", shape=[1, 2], frame=0)]
    try:
        worker.send(register)
        assert worker.poll(30_000)
        worker.recv_multipart()  # registered
        with Client(node.dispatcher.frontend) as c:
            for bad, why in ((P.ItemResult(seq=0, status=0, n_frames=0, outputs=y), "names frame 0 of 0"),
                             (P.ItemResult(seq=0, status=0, n_frames=3, outputs=y), "n_frames 3 with 0 frames left"),
                             (P.ItemResult(seq=0, status=0, n_frames=-1, outputs=y), "n_frames -1"),
                             (P.ItemResult(seq=0, status=999, n_frames=0), "unknown status 999"),
                             # past its schema (a dimension over 2**31): the message does not decode
                             # (the client was told "n_frames 0 with -2 frames left")
                             (P.ItemResult(seq=0, status=0, n_frames=1, outputs=[
                                 P.TensorRef(name="y", dtype="float32", shape=[2**40, 2], frame=0)]),
                              r"\(it does not decode\)$")):
                fut = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=30)
                assert worker.poll(30_000)
                frames = worker.recv_multipart()
                batch = P.to_worker_decoder.decode(frames[0])
                bad.seq = batch.seqs[0]
                worker.send_multipart([P.encode(P.BatchDone(batch_id=batch.batch_id, worker="w0", compute_us=100,
                                                            results=[bad]))])
                with pytest.raises(InternalError, match=why):
                    fut.result(timeout=30)
            fut = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=30)  # the client still works
            assert worker.poll(30_000)
            batch = P.to_worker_decoder.decode(worker.recv_multipart()[0])
            good = P.ItemResult(seq=batch.seqs[0], status=0, n_frames=1, outputs=y)
            worker.send_multipart([P.encode(P.BatchDone(batch_id=batch.batch_id, worker="w0", compute_us=100,
                                                        results=[good])), np.full((1, 2), 7, np.float32)])
            assert fut.result(timeout=30)["y"].tolist() == [[7.0, 7.0]]
    finally:
        worker.close()


def test_a_request_a_worker_returned_no_result_for_is_failed_as_ended_not_in_flight(run_dir, processes):
    """Its batch came back without its result: it was answered INTERNAL with in_flight set (the
    client keeps its memory reserved) and then a release, as if its batch still ran."""
    import zmq

    from batchyard import protocol as P

    node = dispatcher_alone(processes, run_dir)
    register = P.encode(P.Register(v=P.PROTOCOL_VERSION, worker="w0", pid=4242, path="cpu", models=[SUM_MODEL.spec()]))
    worker = bare_worker(node)
    client = zmq.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(node.dispatcher.frontend)
    try:
        worker.send(register)
        assert worker.poll(30_000)
        worker.recv_multipart()  # registered
        infer = {"type": "infer", "v": 1, "id": 5, "model": "sum",
                 "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4], "frame": 0}]}
        client.send_multipart([msgspec.msgpack.encode(infer), np.ones((1, 4), np.float32)])
        assert worker.poll(30_000)
        batch = P.to_worker_decoder.decode(worker.recv_multipart()[0])
        worker.send_multipart([P.encode(P.BatchDone(batch_id=batch.batch_id, worker="w0", compute_us=100, results=[]))])
        assert client.poll(30_000)
        reply = msgspec.msgpack.decode(client.recv_multipart()[0])
        assert (reply["id"], reply["status"], reply.get("in_flight", False)) == (5, P.Status.INTERNAL, False), reply
        assert "returned no result" in reply["message"]
        assert not client.poll(500)  # no release follows
    finally:
        client.close()
        worker.close()


def test_the_dispatcher_learns_only_from_batch_times_it_can_trust(run_dir, processes):
    """A size's first run in a worker builds kernels (up to 10x its time); learnt, one such batch
    could lock a curve with no profile into batches of 1 (workers/runtime.py marks it)."""
    from batchyard import protocol as P

    node = dispatcher_alone(processes, run_dir)
    worker = registered_worker(node)
    y = [P.TensorRef(name="y", dtype="float32", shape=[1, 2], frame=0)]
    try:
        with Client(node.dispatcher.frontend) as c:
            # A time longer than the round trip the dispatcher saw is no batch's either: one
            # compute_us of 2**62 made every later request of the model refused on arrival.
            for compute_us, first, learnt in ((100, True, 0), (2**62, False, 0), (100, False, 1)):
                fut = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=30)
                assert worker.poll(30_000)
                batch = P.to_worker_decoder.decode(worker.recv_multipart()[0])
                done = P.BatchDone(batch_id=batch.batch_id, worker="w0", compute_us=compute_us, first_of_size=first,
                                   results=[P.ItemResult(seq=batch.seqs[0], status=0, n_frames=1, outputs=y)])
                worker.send_multipart([P.encode(done), np.full((1, 2), 7, np.float32)])
                assert fut.result(timeout=30)["y"].tolist() == [[7.0, 7.0]]
                assert c.status().curves["sum/cpu"]["samples"] == learnt
    finally:
        worker.close()


def test_a_result_or_goodbye_naming_another_worker_is_dropped(run_dir, processes):
    """Results and goodbyes were taken by the worker name they carry: anything on the workers'
    socket could answer another worker's batch (its client got the forged output and the real
    one was dropped) or take it out of rotation."""
    from batchyard import protocol as P

    node = dispatcher_alone(processes, run_dir)
    socks = worker, intruder = registered_worker(node), bare_worker(node)
    y = [P.TensorRef(name="y", dtype="float32", shape=[1, 2], frame=0)]
    try:
        with Client(node.dispatcher.frontend) as c:
            fut = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=30)
            assert worker.poll(30_000)
            batch = P.to_worker_decoder.decode(worker.recv_multipart()[0])

            def done(value):
                return [P.encode(P.BatchDone(batch_id=batch.batch_id, worker="w0", compute_us=100, results=[
                    P.ItemResult(seq=batch.seqs[0], status=0, n_frames=1, outputs=y)])),
                    np.full((1, 2), value, np.float32)]

            intruder.send_multipart(done(666))
            intruder.send(P.encode(P.Goodbye(worker="w0")))
            worker.send_multipart(done(7))
            assert fut.result(timeout=30)["y"].tolist() == [[7.0, 7.0]]
            assert [w.name for w in c.status().workers] == ["w0"]  # still in rotation
    finally:
        for s in socks:
            s.close()


def test_a_registration_that_does_not_decode_is_refused_in_words(run_dir, processes):
    """A register with a max batch of 0 failed its schema and was dropped unanswered: the worker
    retried in silence, for good."""
    from batchyard import protocol as P

    node = dispatcher_alone(processes, run_dir)
    worker = bare_worker(node)
    try:
        import msgspec

        bad = msgspec.structs.replace(SUM_MODEL.spec(), max_batch=0)
        worker.send(P.encode(P.Register(v=P.PROTOCOL_VERSION, worker="w0", pid=4242, path="cpu", models=[bad])))
        assert worker.poll(30_000), "no answer to the registration"
        msg = P.to_worker_decoder.decode(worker.recv_multipart()[0])
        assert type(msg) is P.RegisterRejected and msg.worker == "w0" and "max_batch" in msg.message, msg
    finally:
        worker.close()


def test_a_worker_of_another_user_is_refused(run_dir, processes):
    """The backend's socket file shared the clients' mode and group (ipc_group): a client that
    registered as a worker was given other clients' batches, their tensors, and answered them;
    one that took a dead worker's routing id kept its registration alive. The backend is the
    node user's alone now, whatever ipc_mode says; a registration of another uid (root's
    connections pass any mode) is refused in words."""
    import shutil
    import stat

    node = dispatcher_alone(processes, run_dir, ipc_mode="0666")
    with Client(node.dispatcher.frontend) as c:
        c.status()  # bound
    backend = node.dispatcher.backend[len("ipc://"):]
    assert stat.S_IMODE(os.stat(backend).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(node.dispatcher.frontend[len("ipc://"):]).st_mode) == 0o666
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        return  # (running as another user needs root)
    os.chmod(run_dir, 0o755)
    code = ("import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            f"    s.connect({backend!r})\n"
            "except PermissionError:\n"
            "    print('refused')\n")
    r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-S", "-c",
                        code], capture_output=True, text=True, timeout=60, cwd="/")
    assert r.stdout.strip() == "refused", (r.stdout, r.stderr[-2000:])


def test_a_result_from_another_process_under_a_workers_routing_id_is_dropped(run_dir, processes):
    """A worker was its routing id alone: any process on the backend that took one a worker uses
    (its heartbeat thread's ``<name>#hb``, or a dead worker's name) answered that worker's batch,
    and the client got the forged output. Messages count only from the process that registered."""
    import zmq

    from batchyard import protocol as P
    from batchyard.errors import DeadlineExceeded

    node = dispatcher_alone(processes, run_dir)
    worker = zmq.Context.instance().socket(zmq.DEALER)
    worker.setsockopt(zmq.LINGER, 0)
    worker.setsockopt(zmq.ROUTING_ID, b"w0")
    worker.connect(node.dispatcher.backend)
    try:
        worker.send(P.encode(P.Register(v=P.PROTOCOL_VERSION, worker="w0", pid=os.getpid(), path="cpu",
                                        models=[SUM_MODEL.spec()])))
        assert worker.poll(30_000)
        assert type(P.to_worker_decoder.decode(worker.recv_multipart()[0])) is P.Registered
        with Client(node.dispatcher.frontend) as c:
            pending = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=3)
            assert worker.poll(30_000)
            batch = P.to_worker_decoder.decode(worker.recv_multipart()[0])
            forge = ("import numpy as np, zmq\n"
                     "from batchyard import protocol as P\n"
                     "s = zmq.Context.instance().socket(zmq.DEALER)\n"
                     "s.setsockopt(zmq.ROUTING_ID, b'w0#hb')\n"
                     f"s.connect({node.dispatcher.backend!r})\n"
                     "y = [P.TensorRef(name='y', dtype='float32', shape=[1, 2], frame=0)]\n"
                     f"s.send_multipart([P.encode(P.BatchDone(batch_id={batch.batch_id}, worker='w0', compute_us=100, "
                     f"results=[P.ItemResult(seq={batch.seqs[0]}, status=0, n_frames=1, outputs=y)])), "
                     "np.full((1, 2), 666, np.float32)])\n"
                     "s.close(linger=10000)\n")
            subprocess.run([sys.executable, "-c", forge], check=True, timeout=60, cwd=ROOT)
            with pytest.raises(DeadlineExceeded):  # the real worker never answered
                pending.result(timeout=30)
    finally:
        worker.close()


def test_a_leaving_worker_is_answered_and_gets_no_new_batch_while_another_serves(run_dir, processes):
    # Stopping with batches in flight, a worker drained them and left a batch sent meanwhile
    # unread (retried, its retry spent): the dispatcher now stops sending and says when.
    from batchyard import protocol as P

    node = dispatcher_alone(processes, run_dir)
    leaving = registered_worker(node, "w0")
    y = [P.TensorRef(name="y", dtype="float32", shape=[1, 2], frame=0)]

    def done(sock, b, name):
        sock.send_multipart([P.encode(P.BatchDone(batch_id=b.batch_id, worker=name, compute_us=100, results=[
            P.ItemResult(seq=b.seqs[0], status=0, n_frames=1, outputs=y)])), np.ones((1, 2), np.float32)])

    try:
        with Client(node.dispatcher.frontend) as c:
            first = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=30)
            assert leaving.poll(30_000)
            batch = P.to_worker_decoder.decode(leaving.recv_multipart()[0])
            leaving.send(P.encode(P.Leaving(worker="w0")))
            assert leaving.poll(30_000)
            assert type(P.to_worker_decoder.decode(leaving.recv_multipart()[0])) is P.LeavingNoted
            done(leaving, batch, "w0")
            assert first.result(timeout=30)["y"].shape == (1, 2)  # its batch in flight still counts
            other = registered_worker(node, "w1")  # after w0: w0, free, would be tried first
            second = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=30)
            assert other.poll(30_000)
            done(other, P.to_worker_decoder.decode(other.recv_multipart()[0]), "w1")
            assert second.result(timeout=30)["y"].shape == (1, 2)
            assert not leaving.poll(0)
            other.close()
    finally:
        leaving.close()


def test_a_dispatcher_ending_its_drain_tells_each_registered_worker_it_is_closing(run_dir, processes):
    # `up` stops the workers after the dispatcher: each sent `leaving` to nobody and waited 1 s
    # for the answer. Told `closing`, it owes the dispatcher nothing (workers/runtime.py).
    from batchyard import protocol as P

    node = dispatcher_alone(processes, run_dir)
    workers = [registered_worker(node, name) for name in ("w0", "w1")]
    try:
        with Client(node.dispatcher.frontend) as c:
            os.kill(c.status().dispatcher_pid, signal.SIGTERM)
        for name, w in zip(("w0", "w1"), workers):
            assert w.poll(30_000), f"{name} was not told"
            assert P.to_worker_decoder.decode(w.recv_multipart()[0]) == P.Closing(worker=name)
    finally:
        for w in workers:
            w.close()


def test_a_drain_with_no_worker_for_its_queue_fails_it_at_once(run_dir, processes):
    """Workers stopped with the dispatcher (separate units with no ordering) left its queue to
    nobody, and the drain held it for the whole drain_timeout_s (60 s here) before failing it."""
    node = dispatcher_alone(processes, run_dir, drain_timeout_s=60.0)
    with Client(node.dispatcher.frontend) as c:
        queued = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=120)
        st = c.status()  # `queued` waits: no worker serves `sum`
        assert st.queued == 1
        os.kill(st.dispatcher_pid, signal.SIGTERM)
        with pytest.raises(Unavailable, match=r"shut down before the request reached a worker \(no worker left that can take it\)"):
            queued.result(timeout=20)
