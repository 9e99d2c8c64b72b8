"""`batchyard up` on a busy machine, and systemd's notification protocol (sd_notify).

A starved host must not look like dead workers: `up` learns of a death from the kernel, its
readiness wait survives a dispatcher that answers late, a worker keeps heartbeating while its
model runs, and readiness/watchdog messages reach systemd.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from batchyard import sd_notify, supervisor
from batchyard.client import Client
from batchyard.config import DispatcherConfig, NodeConfig, WorkerConfig, to_toml
from batchyard.errors import DeadlineExceeded
from batchyard.supervisor import NodeNotReady, Supervisor

from conftest import ROOT, SUM_MODEL, sim_worker, spawn_up

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


# ---------------------------------------------------------------- readiness wait

class LateDispatcher:
    """A client whose first ``failures`` status polls time out, as a starved dispatcher's do."""

    def __init__(self, failures: int, registrations: int):
        self.failures = failures
        self.registrations = registrations
        self.polls = 0

    def status(self, min_registrations=0, wait=0.0, timeout=10.0):
        self.polls += 1
        if self.polls <= self.failures:
            raise DeadlineExceeded(f"status poll {self.polls}: no reply in time")
        return SimpleNamespace(registrations=self.registrations, models=[],
                               workers=[SimpleNamespace(name=f"w{i}", pid=0) for i in range(self.registrations)])


def _supervisor(n_workers: int) -> Supervisor:
    node = NodeConfig(dispatcher=DispatcherConfig(frontend="ipc:///tmp/by-unused-fe", backend="ipc:///tmp/by-unused-be"),
                      models=(SUM_MODEL,), workers=tuple(sim_worker(f"w{i}", ("sum",)) for i in range(n_workers)))
    return Supervisor("unused.toml", node.validate())


def test_readiness_wait_retries_polls_that_time_out():
    client = LateDispatcher(failures=3, registrations=2)
    st = _supervisor(2).wait_ready(timeout=60, client=client)
    assert st.registrations == 2 and client.polls == 4


def test_readiness_wait_gives_up_at_its_timeout_naming_the_last_failure():
    with pytest.raises(NodeNotReady, match=r"not ready within 0 s: .*DeadlineExceeded"):
        _supervisor(1).wait_ready(timeout=0.3, client=LateDispatcher(failures=10**9, registrations=1))


def test_readiness_waits_for_every_worker_by_name_not_for_a_count_of_registrations():
    """w0 dropped out and registered again while w1 had not registered yet: two registrations,
    and `up` said ready with w1 missing. It waits for the next registration instead."""
    asked = []

    class Reregistered:
        def status(self, min_registrations=0, wait=0.0, timeout=10.0):
            asked.append(min_registrations)
            names = ["w0"] if len(asked) == 1 else ["w0", "w1"]
            return SimpleNamespace(registrations=len(asked) + 1, models=[],
                                   workers=[SimpleNamespace(name=n, pid=0) for n in names])

    st = _supervisor(2).wait_ready(timeout=60, client=Reregistered())
    assert [w.name for w in st.workers] == ["w0", "w1"] and asked == [2, 3]


def _blocked_signals(tid: str) -> set[int]:
    """The signals thread ``tid`` of this process blocks (SigBlk: a hex mask, bit n-1 for n)."""
    with open(f"/proc/self/task/{tid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def test_no_thread_of_the_readiness_wait_can_take_a_stop_signal():
    """The readiness poll's client I/O thread took the stop signals: a SIGTERM sent as `up`
    said ready, let in by that thread while it was still exiting, only flagged Python's handler
    for the main thread, which may sit in sigwaitinfo by then (and does not look at the flag):
    the likeliest cause of a CI run where `up` did not stop within 60 s. Every thread `up`
    starts blocks them."""
    sup = _supervisor(1)
    exposed = []
    make_client = sup._client

    def client():
        before = set(os.listdir("/proc/self/task"))
        c = make_client()
        for tid in set(os.listdir("/proc/self/task")) - before:
            if not supervisor.STOP_SIGNALS <= _blocked_signals(tid):
                exposed.append(tid)
        return c

    sup._client = client
    with pytest.raises(NodeNotReady):  # nobody serves its address
        sup.wait_ready(timeout=0.3)
    assert not exposed, f"threads {exposed} of the readiness wait take SIGTERM/SIGINT/SIGHUP"


def test_child_notifications_are_read_while_up_waits_on_the_dispatcher():
    """During start-up `up` waits on the dispatcher up to a second at a time, and the socket
    queues 10 datagrams (net.unix.max_dgram_qlen): five front doors' READY=1 and WATCHDOG=1
    overflowed it, and a dropped READY=1 is never sent again. Read on a thread of its own, 30
    datagrams in a row get through without `up`'s main thread reading any; a WATCHDOG=1 counts
    as ready too (a front door sends it once it serves)."""
    notes = supervisor.ChildNotifications()
    notes.read_in_background()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK) as s:
            for _ in range(30):
                deadline = time.monotonic() + 10
                while True:  # a full queue is EAGAIN at once: sent again until the reader makes room
                    try:
                        s.sendto(b"WATCHDOG=1", "\0" + notes.address[1:])
                        break
                    except BlockingIOError:
                        assert time.monotonic() < deadline, "nobody reads the notifications"
        deadline = time.monotonic() + 10
        while notes.ready_among({os.getpid()}) != {os.getpid()}:
            notes.wait(1.0)
            assert time.monotonic() < deadline
    finally:
        notes.close()
    assert notes._reader is None


def test_up_that_cannot_get_ready_logs_one_line_and_exits_1(monkeypatch, caplog):
    # The whole `up` path, with its children and readiness client replaced: no traceback
    # escapes, one error line says why, and the exit code is non-zero.
    monkeypatch.setattr(Supervisor, "start", lambda self: None)
    monkeypatch.setattr(Supervisor, "stop", lambda self: None)
    monkeypatch.setattr("batchyard.client.Client", lambda address: _Closing(LateDispatcher(10**9, 0)))
    monkeypatch.setattr("batchyard.proctitle.set_title", lambda title: None)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with caplog.at_level(logging.ERROR, logger="batchyard.up"):
            rc = supervisor.run_up("unused.toml", _supervisor(1).node, ready_timeout_s=0.3)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    assert rc == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    assert errors[0].getMessage().startswith("node did not start: not ready within 0 s")


@pytest.mark.parametrize("who", ["dispatcher", "worker"])
def test_up_exits_78_when_a_child_says_the_config_cannot_run_here(run_dir, who):
    """A child on a cpu outside `up`'s mask (systemd's CPUAffinity, taskset) exits 78, which
    systemd does not restart (RestartPreventExitStatus=78); `up` said 1 for it, and was
    restarted every 2 s for good."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two cpus")
    worker = sim_worker(models=("sum",))
    if who == "worker":
        worker = WorkerConfig(name=worker.name, kind="sim", models=worker.models, sim=worker.sim, cpus=(mine[1],))
    _, up = spawn_up(run_dir, [worker], [SUM_MODEL], {"cpus": (mine[1],)} if who == "dispatcher" else {},
                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                     preexec_fn=lambda: os.sched_setaffinity(0, {mine[0]}))
    _, err = _ended(up)
    assert up.returncode == 78, err.decode()[-2000:]
    assert b"not available to this process" in err and b"Traceback" not in err


def test_pinning_a_node_process_that_the_kernel_refuses_is_a_config_error(monkeypatch, caplog):
    """A seccomp filter or a container's policy refusing sched_setaffinity was a traceback and
    exit 1 (restarted for good), not a line and exit 78."""
    from batchyard.affinity import pin_node_process

    def refuse(*_a):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setaffinity", refuse)
    assert pin_node_process((sorted(os.sched_getaffinity(0))[0],), "dispatcher", logging.getLogger("t")) is None
    assert "[dispatcher] cpus: pinning to" in caplog.text and "Operation not permitted" in caplog.text


@pytest.mark.parametrize("unit", ["dispatcher", "frontend", "node", "worker"])
def test_no_unit_denies_the_scheduling_calls_zeromq_makes_at_start(unit):
    """ZeroMQ's I/O thread calls sched_setscheduler as it starts and aborts when that fails
    (libzmq src/thread.cpp): the dispatcher and front-door units, which denied @resources
    (sched_setscheduler, sched_setaffinity), aborted on every start."""
    text = (Path(ROOT) / "deploy" / "systemd" / f"batchyard-{unit}@.service").read_text()
    denied = [line for line in text.splitlines() if line.startswith("SystemCallFilter=~")]
    assert denied and not any("@resources" in line or "sched_set" in line for line in denied)


def _ended(proc: subprocess.Popen) -> tuple[bytes, bytes]:
    """``proc``'s output once it has exited by itself (killed if it has not within 120 s)."""
    try:
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class _Closing:
    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        return self.inner

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- deaths and heartbeats

def test_up_restarts_a_killed_worker_long_before_a_heartbeat_could_tell(start_node):
    # Heartbeats would need 60 s to call this worker dead: `up` sees the death itself
    # (SIGCHLD), restarts it, and the new process's registration fails the batch over.
    node = start_node([sim_worker("w0", ("sum",), launch_us=300_000.0)],
                      heartbeat_interval_s=0.5, worker_dead_after_s=60.0)
    with node.client() as c:
        st = c.status()
        fut = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=50.0)
        c.status()  # the request is queued or running now
        t0 = time.monotonic()
        os.kill(st.workers[0].pid, signal.SIGKILL)
        assert fut.result()["y"].tolist() == [[4.0, 4.0]]
        back = c.status(min_registrations=st.registrations + 1, wait=50)
    assert back.workers[0].pid != st.workers[0].pid
    assert time.monotonic() - t0 < 30.0  # restart + Python start-up, far below the 60 s


def test_heartbeats_go_on_while_the_model_computes():
    # torch releases the GIL inside an op, so the heartbeat thread is not starved by a batch.
    torch = pytest.importorskip("torch")
    from batchyard.workers.runtime import Heartbeat

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    hb = Heartbeat(ctx, f"tcp://127.0.0.1:{port}", "w0", interval_s=0.02)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hb.start()
        assert router.poll(10_000), "no first heartbeat"
        while router.poll(0):
            router.recv_multipart()
        a = torch.randn(2000, 2000) / 50
        t0 = time.perf_counter()
        b = a
        while time.perf_counter() - t0 < 1.0:  # the "batch": torch ops for at least a second
            b = torch.tanh(b @ a)
        busy_s = time.perf_counter() - t0
        beats = 0
        while router.poll(0):
            router.recv_multipart()
            beats += 1
        # Starved of the GIL it would send about one beat per op (each ~0.3-1 s here);
        # with the GIL free during ops, about one per 20 ms.
        assert beats >= busy_s / 0.02 / 4, (beats, busy_s)
    finally:
        torch.set_num_threads(threads)
        hb.end(5)
        router.close(0)
        ctx.term()


def test_a_heartbeat_thread_ends_when_asked_not_at_the_end_of_its_interval(run_dir):
    """A worker's stop joined its heartbeat thread, which noticed the stop only once its wait on
    the socket (one heartbeat interval, 0.2 s by default) was over."""
    from batchyard.workers.runtime import Heartbeat

    ctx = zmq.Context()
    endpoint = f"ipc://{run_dir}/be"
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    hb = Heartbeat(ctx, endpoint, "w0", interval_s=600.0)
    try:
        hb.start()
        assert router.poll(10_000), "no first heartbeat"  # the thread now waits out its 600 s
        hb.end(timeout=60)
        assert not hb.is_alive(), "the heartbeat thread went on waiting out its interval"
    finally:
        hb.end(5)
        router.close(0)
        ctx.term()


def test_heartbeats_resume_after_the_dispatcher_was_away(run_dir):
    from batchyard.workers.runtime import HEARTBEAT_QUEUE, Heartbeat

    ctx = zmq.Context()
    endpoint = f"ipc://{run_dir}/be"
    hb = Heartbeat(ctx, endpoint, "w0", interval_s=0.01)
    router = ctx.socket(zmq.ROUTER)
    try:
        hb.start()
        # Nobody is listening: the beats' queue fills (HEARTBEAT_QUEUE), later sends meet a
        # full queue. The dispatcher's absence lasts ~30 beats.
        hb.stop.wait(0.3)
        assert hb.is_alive()
        router.bind(endpoint)
        for _ in range(HEARTBEAT_QUEUE + 5):  # more than were queued: the thread still beats
            assert router.poll(5000), "heartbeats stopped after the dispatcher was away"
            router.recv_multipart()
    finally:
        hb.end(5)
        router.close(0)
        ctx.term()


# ---------------------------------------------------------------- sd_notify

@pytest.fixture
def notify_socket(run_dir):
    """A unix datagram socket standing in for systemd's; yields (path, recv) where recv()
    returns (sender pid, message) or raises socket.timeout."""
    path = os.path.join(run_dir, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # the sender's pid, as systemd sees it

    def recv(timeout: float):
        s.settimeout(timeout)
        data, anc, _flags, _addr = s.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
        pid = next((_UCRED.unpack(d[:_UCRED.size])[0] for lvl, typ, d in anc
                    if lvl == socket.SOL_SOCKET and typ == socket.SCM_CREDENTIALS), None)
        return pid, data.decode()

    yield path, recv
    s.close()


def test_notify_reaches_an_abstract_socket():
    name = f"batchyard-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        assert sd_notify.notify("READY=1", {"NOTIFY_SOCKET": "@" + name})
        assert s.recv(64) == b"READY=1"


def test_notify_never_blocks_on_a_receiver_that_does_not_read():
    """`up` gives its children's event loops a socket of its own to ping: a full queue there
    (10 datagrams by default) blocked sendto, and froze the loop."""
    name = f"batchyard-test-full-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        sent = []
        t = threading.Thread(target=lambda: sent.extend(sd_notify.notify("WATCHDOG=1", {"NOTIFY_SOCKET": "@" + name})
                                                         for _ in range(1000)), daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "notify blocked on a full socket"
        assert sent[0] and not sent[-1]


def test_notify_outside_systemd_does_nothing():
    assert not sd_notify.notify("READY=1", {})
    assert sd_notify.watchdog_interval_s({}) is None


def test_watchdog_interval_is_half_the_timeout_and_only_for_its_pid():
    assert sd_notify.watchdog_interval_s({"WATCHDOG_USEC": "2000000"}) == 1.0
    assert sd_notify.watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}) == 1.0
    assert sd_notify.watchdog_interval_s({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None


def test_the_event_loop_pings_the_watchdog_until_closed(notify_socket):
    path, recv = notify_socket
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"}
    loop = asyncio.new_event_loop()
    try:
        watchdog = sd_notify.announce_ready(loop, env)
        assert recv(5)[1] == "READY=1"
        pings = loop.run_until_complete(loop.run_in_executor(None, lambda: [recv(5)[1] for _ in range(3)]))
        assert pings == ["WATCHDOG=1"] * 3
        watchdog.close()
    finally:
        loop.close()


def test_front_door_readiness_names_the_sender_the_kernel_saw():
    """`up` counts a front door ready by the pid the kernel stamps on its READY=1, so another
    process that finds the abstract socket cannot speak for a front door."""
    ready = supervisor.ChildNotifications()
    try:
        assert sd_notify.notify("STATUS=starting", {"NOTIFY_SOCKET": ready.address})
        assert sd_notify.notify("READY=1\nMAINPID=1", {"NOTIFY_SOCKET": ready.address})
        ready.wait(10)
        assert set(ready.alive_at) == {os.getpid()}
    finally:
        ready.close()


def _spawn_env(path: str, watchdog_usec: int) -> dict:
    env = sd_notify.child_env()
    env.update(NOTIFY_SOCKET=path, WATCHDOG_USEC=str(watchdog_usec))
    return env


def test_up_tells_systemd_it_is_ready_and_alive(run_dir, notify_socket):
    path, recv = notify_socket
    _, up = spawn_up(run_dir, [sim_worker("w0", ("sum",))], [SUM_MODEL], env=_spawn_env(path, 200_000),
                     stdout=subprocess.DEVNULL)
    try:
        pid, msg = recv(180)
        assert (pid, msg.splitlines()[0]) == (up.pid, "READY=1"), msg  # not a worker's READY=1
        assert recv(10) == (up.pid, "WATCHDOG=1")
        up.send_signal(signal.SIGTERM)
        after = recv(10)
        while after == (up.pid, "WATCHDOG=1"):  # pings sent before the signal arrived
            after = recv(10)
        assert after == (up.pid, "STOPPING=1")
        assert up.wait(timeout=30) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_up_whose_stdout_nobody_reads_serves_on(run_dir, notify_socket):
    """`batchyard up ... | head -c 0`: the ready line's write failed (EPIPE), and `up` stopped the
    node with a traceback instead of telling systemd it was ready (an outside review)."""
    path, recv = notify_socket
    node, up = spawn_up(run_dir, [sim_worker("w0", ("sum",))], [SUM_MODEL], env=_spawn_env(path, 200_000),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        up.stdout.close()  # nobody reads it
        pid, msg = recv(180)
        assert (pid, msg.splitlines()[0]) == (up.pid, "READY=1"), (msg, up.stderr.read() if up.poll() else "")
        with Client(node.dispatcher.frontend) as c:
            assert c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[4.0, 4.0]]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        log = up.stderr.read()
        assert b"cannot write the ready line" in log and b"Traceback" not in log, log
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_dispatcher_tells_systemd_it_is_ready_and_alive(run_dir, notify_socket):
    path, recv = notify_socket
    node = NodeConfig(dispatcher=DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                      models=(SUM_MODEL,)).validate()
    with open(f"{run_dir}/node.toml", "w") as f:
        f.write(to_toml(node))
    disp = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "dispatcher", "--config", f"{run_dir}/node.toml"],
                            cwd=ROOT, env=_spawn_env(path, 200_000), stdout=subprocess.DEVNULL)
    try:
        assert recv(20) == (disp.pid, "READY=1")
        assert recv(10) == (disp.pid, "WATCHDOG=1")
    finally:
        disp.terminate()
        disp.wait(30)


def test_a_worker_whose_batch_never_comes_back_is_started_again(start_node):
    # A model stuck in a batch (here a simulated one that takes 10 minutes): its heartbeat
    # thread goes on, so the worker stayed registered-but-useless; declared lost, it was told to
    # register again, which its stuck main thread never did. The node served nothing more of it.
    node = start_node([sim_worker("w0", ("sum",), launch_us=600e6)],
                      heartbeat_interval_s=0.1, worker_dead_after_s=1.0)
    with node.client() as c:
        st = c.status()
        with pytest.raises(DeadlineExceeded):
            c.infer("sum", {"x": np.ones((1, 4), np.float32)}, timeout=0.3)
        back = c.status(min_registrations=st.registrations + 1, wait=30)
    assert back.registrations > st.registrations, "the hung worker was not started again"
    assert [w.name for w in back.workers] == ["w0"] and back.workers[0].pid != st.workers[0].pid


def test_a_worker_runs_every_thread_at_its_configured_niceness(start_node):
    """[[workers]] nice: the worker's threads (the executor's and ZeroMQ's, started after it is
    set) run at that niceness, so a dispatcher sharing its core takes arrivals before the
    model's timeslice ends; the dispatcher stays at the niceness it inherited."""
    import psutil

    nice_worker = WorkerConfig(name="sim0", kind="sim", models=("sum",), nice=7)
    node = start_node([nice_worker], models=(SUM_MODEL,))
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    procs = {" ".join(p.cmdline()): p for p in psutil.Process(node.up.pid).children(recursive=True)}
    worker = next(p for title, p in procs.items() if "sim-worker" in title)
    dispatcher = next(p for title, p in procs.items() if "::dispatcher" in title)
    threads = [os.getpriority(os.PRIO_PROCESS, t.id) for t in worker.threads()]
    assert len(threads) >= 2 and set(threads) == {max(7, mine)}
    assert {os.getpriority(os.PRIO_PROCESS, t.id) for t in dispatcher.threads()} == {mine}
    with Client(node.address) as c:  # and it serves
        assert c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].shape == (1, 2)


def test_a_numa_node_binding_keeps_the_worker_within_the_cpus_it_was_given():
    """numa_run_on_node set the mask to every cpu of the node: a worker under systemd's
    CPUAffinity (or taskset) with a numa_node ran on all of them."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two cpus")
    code = ("import os; from batchyard.workers.pinning import bind_numa_node; note = bind_numa_node(0); "
            "print(sorted(os.sched_getaffinity(0)), note)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: os.sched_setaffinity(0, {mine[0]}))
    assert r.returncode == 0, r.stderr
    if "skipped" in r.stdout:
        pytest.skip(r.stdout)
    assert r.stdout.startswith(f"[{mine[0]}] numa: running on"), r.stdout


def test_a_second_up_on_a_running_nodes_config_refuses_and_leaves_the_first_serving(start_node, run_dir):
    """The second node's dispatcher bound over the first's ipc socket files (libzmq unlinks
    them), its `up` took the first's readiness answer for its own and said ready, clients then
    reached a dispatcher with no workers, and when it stopped it removed the files: the first
    node, still running, was unreachable."""
    first = start_node([sim_worker()])
    node, second = spawn_up(run_dir, [sim_worker()], first.cfg.models, {"heartbeat_interval_s": 0.1,
                                                                       "worker_dead_after_s": 0.6},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = _ended(second)
    assert second.returncode != 0 and b"ready" not in out, (out, err[-2000:])
    assert b"not this node's dispatcher" in err or b"is served by another process" in err, err[-2000:]
    # A second dispatcher alone (systemd's unit, say) refuses the endpoint in one line
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", "dispatcher", "--config", f"{run_dir}/node.toml"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "is served by another process" in r.stderr and "Traceback" not in r.stderr, r.stderr
    with first.client() as c:
        assert c.status().dispatcher_pid == first_pid(first)
        np.testing.assert_array_equal(c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"], [[4.0, 4.0]])


def first_pid(node) -> int:
    import psutil

    [d] = [p for p in psutil.Process(node.up.pid).children() if "dispatcher" in " ".join(p.cmdline())]
    return d.pid


def test_a_worker_asked_to_stop_exits_even_when_its_batch_never_ends():
    """The stop (SIGTERM, or the parent-death signal when `up` was killed hard) was only read
    between batches: a worker stuck in one lived on, reparented to pid 1, holding its memory."""
    code = ("import os, signal, threading\n"
            "from batchyard.workers import runtime\n"
            "runtime.STOP_GRACE_S = 0.2\n"
            "rt = runtime.WorkerRuntime('w', 'ipc:///nonexistent', None, {})\n"
            "signal.signal(signal.SIGTERM, rt.request_stop)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "threading.Event().wait()  # a batch that never ends\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr


def test_a_childs_ping_wakes_ups_loop_at_once():
    """up's notification socket holds net.unix.max_dgram_qlen datagrams (10 by default) and was
    read only when its loop woke for its own reasons: the pings of 11 or more children (front
    doors and the dispatcher) overflowed it between wakes, were dropped, and up aborted healthy
    front doors as hung, again every watchdog period. Each datagram now raises SIGIO, which the
    loop waits on with the other signals, at the loop's own thread: one started earlier, which
    does not block SIGIO, must not take it (raised at the process, it went there in the full
    test suite, and the loop waited in vain)."""
    import signal
    import socket as so

    from batchyard.supervisor import ChildNotifications

    notes = ChildNotifications()
    before = signal.signal(signal.SIGIO, lambda *_: None)
    other_done = threading.Event()
    other = threading.Thread(target=other_done.wait)  # started before the mask: takes SIGIO
    other.start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGIO})
    try:
        notes.raise_sigio(True)
        # owned by this thread (F_GETOWN_EX: type F_OWNER_TID, its tid), not by the process
        import fcntl

        owner = struct.unpack("ii", fcntl.fcntl(notes.sock, 16, bytes(8)))
        assert owner == (0, threading.get_native_id())
        with so.socket(so.AF_UNIX, so.SOCK_DGRAM) as child:
            child.sendto(b"READY=1", "\0" + notes.address[1:])
            info = signal.sigtimedwait({signal.SIGIO}, 10)
        assert info is not None and info.si_signo == signal.SIGIO
        notes.receive()
        assert os.getpid() in notes.alive_at
        notes.raise_sigio(False)
    finally:
        other_done.set()
        other.join()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGIO})
        signal.signal(signal.SIGIO, before)
        notes.close()
