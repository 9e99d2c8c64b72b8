"""`batchyard up`'s lifecycle: children that hang without dying, the order and bound of its
stop, its signals, and what a child killed hard leaves behind."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
import zmq

from batchyard import protocol as P, supervisor
from batchyard.client import Client
from batchyard.config import DispatcherConfig, FrontendConfig, NodeConfig, to_toml
from batchyard.sd_notify import child_env
from batchyard.shm import SHM_DIR, live_segments

from conftest import ROOT, SUM_MODEL, free_port, sim_worker


# ---------------------------------------------------------------- helpers

def _up(run_dir, workers, frontend=False, env=None, new_session=False, models=(SUM_MODEL,),
        **dkw) -> tuple[NodeConfig, subprocess.Popen]:
    """A `batchyard up` on private ipc paths (and, with ``frontend``, an HTTP-only front door),
    stderr piped for its log; returns once it said ready. ``new_session``: `up` leads a process
    group of its own, as in a terminal (a signal to the group spares the tests)."""
    dkw.setdefault("heartbeat_interval_s", 0.1)
    dkw.setdefault("worker_dead_after_s", 0.6)
    fe = FrontendConfig(grpc_port=0, http_port=free_port()) if frontend else None
    node = NodeConfig(dispatcher=DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be", **dkw),
                      models=tuple(models), workers=tuple(workers), frontend=fe).validate()
    path = Path(run_dir) / "node.toml"
    path.write_text(to_toml(node))
    up = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "up", "--config", str(path)], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=new_session)
    try:
        line = _line_with(up.stdout, b"batchyard up: ready", 180)
        assert line, f"up did not get ready: {_rest(up)}"
    except BaseException:
        _kill(up)
        raise
    return node, up


def _line_with(stream, text: bytes, timeout: float) -> bytes:
    """The first line of ``stream`` containing ``text`` within ``timeout`` s, or b"" (EOF, timeout)."""
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    try:
        buf = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return b""
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                return b""
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if text in line:
                    return line
    finally:
        sel.close()


def _rest(up: subprocess.Popen) -> str:
    _kill(up)
    return up.stderr.read().decode(errors="replace")[-3000:]


def _no_core_dump() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _children(up: subprocess.Popen, title: str) -> list[psutil.Process]:
    return [p for p in psutil.Process(up.pid).children() if title in " ".join(p.cmdline())]


def _stop(up: subprocess.Popen, timeout: float = 60) -> float:
    """SIGTERM `up`; how long it took to exit. One that does not within ``timeout`` fails the
    test with its log and, SIGABRT-ed, every thread's stack (faulthandler)."""
    t0 = time.monotonic()
    up.send_signal(signal.SIGTERM)
    try:
        up.wait(timeout)
    except subprocess.TimeoutExpired:
        up.send_signal(signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            up.wait(10)
        pytest.fail(f"up did not stop within {timeout:.0f} s of SIGTERM: {_rest(up)}")
    finally:
        _kill(up)
    return time.monotonic() - t0


def _http_infer(port: int, timeout: float = 60) -> str:
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}]}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/sum/infer", body,
                                                           {"Content-Type": "application/json"}), timeout=timeout) as r:
            return "ok" if json.loads(r.read())["outputs"][0]["data"] == [4.0, 4.0] else "wrong"
    except Exception as e:  # noqa: BLE001 -- the outcome is what the test checks
        return f"{type(e).__name__}: {e}"


def _wait_status(c: Client, ok, timeout: float = 30):
    """The dispatcher's status once ``ok(status)`` holds (each look is a round trip to it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = c.status()
        if ok(st):
            return st
    raise AssertionError(f"not within {timeout} s: {st}")


def _one_running_one_queued(node) -> tuple["_InThread", "_InThread"]:
    """Two front-door HTTP requests on threads: the first running on the node's one worker, the
    second queued behind its batch."""
    port = node.frontend.http_port
    with Client(node.dispatcher.frontend) as c:
        first = _InThread(lambda: _http_infer(port))
        _wait_status(c, lambda st: st.workers[0].inflight > 0)
        second = _InThread(lambda: _http_infer(port))
        _wait_status(c, lambda st: st.queued > 0)  # behind the first's batch
    return first, second


class _InThread:
    """``fn()`` on a thread; ``result(timeout)`` waits for it."""

    def __init__(self, fn):
        self.value, self.done = None, threading.Event()

        def run():
            try:
                self.value = fn()
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def result(self, timeout: float):
        assert self.done.wait(timeout), "the call did not end"
        return self.value


# ---------------------------------------------------------------- hung workers

def test_a_lost_worker_counts_only_once_seen_registered_and_after_its_grace():
    """A worker starting (never seen registered) is never lost, however long it takes; one the
    dispatcher dropped is lost once an answer ``grace_s`` later still lacks it; one that
    registers again is not; and without an answer since, nobody is."""
    w = supervisor.LostWorkers(client=None, grace_s=5.0, wake=lambda: None)
    w.watch({10, 11, 12})
    w.update({10, 11}, now=0.0)  # 12 is still starting
    w.update({10}, now=1.0)  # 11 out of rotation
    assert w.lost() == {}
    w.update({10}, now=5.9)
    assert w.lost() == {}
    w.update({10}, now=100.0)
    assert w.lost() == {11: 99.0}, "12 never registered: starting, not lost"
    w.update({10, 11}, now=101.0)  # 11 registered again (a late heartbeat on a starved host)
    assert w.lost() == {}
    w.update({11}, now=102.0)
    w.watch({11, 12})  # 10 restarted away: forgotten
    w.update({11}, now=200.0)
    assert w.lost() == {}


def test_up_kills_and_restarts_a_worker_that_hangs(run_dir):
    """A stopped worker (SIGSTOP; a model holding the GIL is the same to the dispatcher) sends no
    heartbeat: the dispatcher dropped it, but tells a worker to exit only in reply to a
    heartbeat, and `up` learned only of deaths. It stayed stopped, out of rotation, for good."""
    node, up = _up(run_dir, [sim_worker("w0", ("sum",))])
    victim = None
    try:
        with Client(node.dispatcher.frontend) as c:
            st = c.status()
            victim = st.workers[0].pid
            os.kill(victim, signal.SIGSTOP)
            # dropped after worker_dead_after_s (0.6 s), killed LOST_WORKER_GRACE_MIN_S later, started again
            back = c.status(min_registrations=st.registrations + 1, wait=60)
            assert back.registrations > st.registrations, "the hung worker was not started again"
            assert [w.name for w in back.workers] == ["w0"] and back.workers[0].pid != victim
            assert c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[4.0, 4.0]]
        assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
        assert _stop(up) < 30 and up.returncode == 0
        assert b"hung; killing it" in up.stderr.read()
    finally:
        if victim is not None and psutil.pid_exists(victim):
            os.kill(victim, signal.SIGKILL)
        _kill(up)


def test_a_worker_whose_factory_fails_at_a_restart_is_started_again_with_a_back_off_until_it_starts(run_dir):
    """A restart whose model factory raised (exit 78) was given up for good, the node serving on
    without the worker while systemd saw it healthy (an outside review); the config is the one
    that started it, so the cause is of the moment: restarted with the back-off, it comes back."""
    from batchyard.config import ModelConfig, TensorConfig, WorkerConfig

    flag = Path(run_dir) / "fail"
    model = ModelConfig(name="sum", factory="tests.poison_model:fails_while_flagged", max_batch=4,
                        inputs=(TensorConfig("x", "float32", (4,)),), outputs=(TensorConfig("y", "float32", (2,)),))
    worker = WorkerConfig(name="w0", kind="amx", models=("sum",), threads=1, warmup_sizes=(1,))
    node, up = _up(run_dir, [worker], models=(model,), env=os.environ | {"BATCHYARD_TEST_FAIL_FLAG": str(flag)})
    try:
        with Client(node.dispatcher.frontend) as c:
            st = c.status()
            flag.touch()
            os.kill(st.workers[0].pid, signal.SIGKILL)
            said = _line_with(up.stderr, b"cannot start as configured", 120)
            assert b"restart in" in said, said
            flag.unlink()
            back = c.status(min_registrations=st.registrations + 1, wait=120)
            assert [w.name for w in back.workers] == ["w0"] and back.workers[0].pid != st.workers[0].pid
            assert c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[2.0, 2.0]]
        assert _stop(up) < 30 and up.returncode == 0
    finally:
        _kill(up)


def test_a_child_that_keeps_dying_is_restarted_with_a_back_off_until_it_ran_a_minute():
    """Backed off only when it died within 5 s of its start, a worker that loads its model for
    longer (real ones do) and dies at its first batch was restarted at once for ever: 9 restarts
    a minute (an outside review)."""
    delays, n = [], 0
    for _ in range(7):
        delay, n = supervisor.restart_delay(n, ran_s=7.0)
        delays.append(delay)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert supervisor.restart_delay(n, ran_s=supervisor.RESTART_STABLE_S) == (0.0, 0)


def test_a_restart_that_hangs_in_its_start_is_killed_past_the_start_timeout(tmp_path):
    """A restarted worker whose factory never returned was never noticed (never registered, so
    never lost) and its model's requests waited out their deadlines (an outside review)."""
    node = NodeConfig(dispatcher=DispatcherConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"ipc://{tmp_path}/be"),
                      models=(SUM_MODEL,), workers=(sim_worker("w0", ("sum",)),)).validate()
    sup = supervisor.Supervisor(tmp_path / "node.toml", node)

    class Nobody:  # no ping, no READY=1, no registration
        alive_at: dict = {}

        @staticmethod
        def ready_among(pids):
            return set()

        @staticmethod
        def seen(pid):
            return False

        @staticmethod
        def lost():
            return {}

    sup._notifications = sup._lost = Nobody()
    stuck = subprocess.Popen(["sleep", "600"])
    try:
        sup.dispatcher = stuck  # (watched for pings: it sends none, so it is left alone)
        sup.workers["w0"] = stuck
        sup._last_start["w0"] = 0.0
        sup._starting[stuck.pid] = sup.start_timeout_s
        assert sup._end_hung(sup.start_timeout_s - 1.0)[-1] == sup.start_timeout_s  # a wake-up then
        assert stuck.poll() is None
        sup._end_hung(sup.start_timeout_s)
        assert stuck.wait(10) == -signal.SIGKILL and stuck.pid in sup._ended and not sup._starting
    finally:
        _kill(stuck)


def test_a_restarted_worker_runs_the_config_up_started_with_not_the_file_edited_since(run_dir):
    """`up` gave every child the config file's path, read again at each restart: an edit on disk
    (here a typo, as an operator preparing the next start makes one) reached the worker `up`
    restarted, which exited 78 on it and was given up for good, never registering again."""
    node, up = _up(run_dir, [sim_worker("w0", ("sum",))])
    try:
        path = Path(run_dir) / "node.toml"
        path.write_text(path.read_text().replace("[dispatcher]", "[dispatcher]\nmax_queu = 5", 1))
        with Client(node.dispatcher.frontend) as c:
            st = c.status()
            os.kill(st.workers[0].pid, signal.SIGKILL)
            back = c.status(min_registrations=st.registrations + 1, wait=60)
            assert back.registrations > st.registrations, f"the killed worker was not started again: {_rest(up)}"
            assert c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[4.0, 4.0]]
        assert _stop(up) < 30 and up.returncode == 0
    finally:
        _kill(up)


def test_a_front_door_that_cannot_run_as_configured_stops_the_node_not_silently_its_ports(run_dir):
    """A restarted front door that exits 78 was given up as a worker is, and `up` went on
    pinging the watchdog: a unit systemd saw healthy with its KServe ports dead. The config
    every child runs is `up`'s private copy; broken here, as no edit can break it any more."""
    node, up = _up(run_dir, [sim_worker("w0", ("sum",))], frontend=True)
    try:
        [front] = _children(up, "::frontend")
        [copy] = [p for p in Path(tempfile.gettempdir()).glob("by-up-*/node.toml")
                  if f"(pid {up.pid})" in p.read_text().splitlines()[0]]
        copy.write_text(copy.read_text().replace("[dispatcher]", "[dispatcher]\nmax_queu = 5", 1))
        front.kill()
        assert up.wait(60) == 78
        assert b"cannot run on this host as configured (exit 78, see its log); stopping the node" in up.stderr.read()
    finally:
        _kill(up)


# ---------------------------------------------------------------- hung dispatcher and front doors

def test_the_childrens_watchdog_period_is_ups_own_or_an_internal_one():
    assert supervisor.child_watchdog_s({}) == supervisor.CHILD_WATCHDOG_S
    assert supervisor.child_watchdog_s({"WATCHDOG_USEC": "4000000"}) == 4.0
    assert supervisor.child_watchdog_s({"WATCHDOG_USEC": "200000"}) == supervisor.CHILD_WATCHDOG_MIN_S


def _fake_systemd(run_dir):
    """A datagram socket standing in for systemd's, and the environment of an `up` under it
    with WatchdogSec=2s."""
    path = os.path.join(run_dir, "notify")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    return s, child_env() | {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"}


def test_up_ends_a_hung_dispatcher_and_exits_1(run_dir):
    """A wedged dispatcher (here stopped) under `up`: its own watchdog was off (up stripped
    WATCHDOG_USEC) and `up` pinged systemd on, so the node stayed down for good."""
    sock, env = _fake_systemd(run_dir)
    node, up = _up(run_dir, [sim_worker("w0", ("sum",))], env=env)
    try:
        [dispatcher] = _children(up, "::dispatcher")
        dispatcher.suspend()
        try:
            up.wait(60)  # watchdog 2 s, SIGABRT, SIGKILL 5 s later, then the stop
        except subprocess.TimeoutExpired:
            pytest.fail("up went on with a hung dispatcher")
        assert up.returncode == 1
        err = up.stderr.read()
        assert b"dispatcher (pid %d) sent no WATCHDOG=1" % dispatcher.pid in err, err[-3000:]
        assert not os.path.exists(f"{run_dir}/fe") and not os.path.exists(f"{run_dir}/be"), \
            "a killed dispatcher's ipc socket files were left"
    finally:
        sock.close()
        _kill(up)


def test_a_node_process_aborted_as_hung_logs_where_each_thread_was(run_dir):
    """`up` and systemd's watchdog abort a hung process (SIGABRT): its log said only that it was
    hung, not where. Now every thread's Python stack is in it."""
    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                      (SUM_MODEL,), ()).validate()
    path = Path(run_dir) / "node.toml"
    path.write_text(to_toml(node))
    proc = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "dispatcher", "--config", str(path)], cwd=run_dir,
                            stderr=subprocess.PIPE, preexec_fn=_no_core_dump)
    try:
        with Client(node.dispatcher.frontend) as c:
            c.status(timeout=60)  # serving: its loop is up
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=60)
    finally:
        _kill(proc)
    assert proc.returncode == -signal.SIGABRT
    assert b"Fatal Python error: Aborted" in err and b"most recent call first" in err, err[-3000:]
    assert b"batchyard/cli.py" in err or b"dispatcher/cli.py" in err, err[-3000:]


def test_a_node_process_raises_its_open_file_limit_to_the_hard_one(run_dir):
    """Started from a shell's soft limit (256 here, 1,024 usually), the dispatcher was aborted by
    libzmq (an assertion on accept()'s EMFILE, not an error) once a few hundred local clients
    were connected, and `up` stopped the node."""
    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                      (SUM_MODEL,), ()).validate()
    path = Path(run_dir) / "node.toml"
    path.write_text(to_toml(node))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"a hard limit of {hard} leaves nothing to raise")

    def low_soft_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    proc = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "dispatcher", "--config", str(path)], cwd=run_dir,
                            stderr=subprocess.DEVNULL, preexec_fn=low_soft_limit)
    try:
        with Client(node.dispatcher.frontend) as c:
            c.status(timeout=60)  # serving
        soft = psutil.Process(proc.pid).rlimit(psutil.RLIMIT_NOFILE)[0]
        want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        assert soft == want, (soft, hard)
    finally:
        _kill(proc)


def test_up_ends_a_hung_front_door_and_starts_another(run_dir):
    sock, env = _fake_systemd(run_dir)
    node, up = _up(run_dir, [sim_worker("w0", ("sum",))], frontend=True, env=env)
    try:
        [front] = _children(up, "::frontend")
        front.suspend()
        # watchdog 2 s, SIGABRT (pending: it is stopped), SIGKILL 5 s later, started again
        assert _line_with(up.stderr, b"(killed by up: hung)", 60), "the hung front door was not ended"
        assert _line_with(up.stderr, b"started front door frontend#0", 30), "no new front door"
        assert not front.is_running()
        # the new one serves once its ports are bound
        deadline = time.monotonic() + 60
        while (out := _http_infer(node.frontend.http_port, timeout=10)) != "ok" and time.monotonic() < deadline:
            pass
        assert out == "ok"
        assert up.poll() is None
        assert _stop(up) < 30 and up.returncode == 0
    finally:
        sock.close()
        _kill(up)


# ---------------------------------------------------------------- stop

def test_front_door_requests_in_flight_are_answered_when_up_stops(run_dir):
    """`up` stopped workers and front doors together: a request queued behind a batch lost its
    worker and waited until `up` killed the front door 10 s later (the client got a reset).
    Front doors stop first now, while the workers and the dispatcher still serve."""
    node, up = _up(run_dir, [sim_worker("w0", ("sum",), launch_us=1_000_000.0)], frontend=True,
                   worker_dead_after_s=30.0)
    try:
        first, second = _one_running_one_queued(node)
        took = _stop(up)
        assert (first.result(30), second.result(30)) == ("ok", "ok")
        assert took < 9, f"the stop took {took:.1f} s"
        assert up.returncode == 0 and b"killing it" not in up.stderr.read()
    finally:
        _kill(up)


def test_a_front_door_stops_within_its_grace_with_an_http_request_in_flight(run_dir):
    """aiohttp waited up to 60 s for a handler: an HTTP request waiting on a long batch held
    the front door's stop as long (28 s seen). Bounded by STOP_GRACE_S; the client gets an
    answer, UNAVAILABLE (503), not a connection closed without one."""
    from batchyard.frontend_main import STOP_GRACE_S

    node, up = _up(run_dir, [sim_worker("w0", ("sum",), launch_us=120e6)], frontend=True,
                   worker_dead_after_s=300.0)
    try:
        with Client(node.dispatcher.frontend) as c:
            call = _InThread(lambda: _http_infer(node.frontend.http_port, timeout=120))
            _wait_status(c, lambda st: st.workers[0].inflight > 0)
        [front] = _children(up, "::frontend")
        t0 = time.monotonic()
        front.terminate()
        front.wait(30)
        took = time.monotonic() - t0
        assert took < STOP_GRACE_S + 3, f"the front door took {took:.1f} s to stop"
        assert call.result(10) == "HTTPError: HTTP Error 503: Service Unavailable"
    finally:
        _kill(up)


def test_workers_of_a_slow_heartbeat_stop_on_their_own_after_the_dispatcher(run_dir):
    """Stopped after the dispatcher, a worker waits for an answer to its `leaving` that nobody
    is left to send: 3 heartbeats long (12 s at a 4 s heartbeat), past `up`'s 10 s stop bound,
    and `up` killed both workers."""
    node, up = _up(run_dir, [sim_worker("w0", ("sum",)), sim_worker("w1", ("sum",))],
                   heartbeat_interval_s=4.0, worker_dead_after_s=30.0)
    try:
        _stop(up)
        err = up.stderr.read()
        assert up.returncode == 0 and b"killing it" not in err, err[-3000:]
    finally:
        _kill(up)


def test_requests_queued_when_up_stops_are_served_while_the_drain_lasts_then_failed_once(run_dir):
    """`up` stopped the workers before the dispatcher, whose drain then failed every queued
    request at once: of 30 queued behind a 1 s batch, 8 were served and 22 failed UNAVAILABLE.
    Now the dispatcher stops first and serves its queue with the workers still up, for
    drain_timeout_s; what does not fit in it gets UNAVAILABLE, one reply each, and the workers,
    stopped after it, still exit well within `up`'s stop bound."""
    # Batches of 4 (fixed:4), 0.4 s each; 20 requests are 2 s of work, more than the 1.5 s drain.
    node, up = _up(run_dir, [sim_worker("w0", ("sum",), launch_us=400_000.0, per_item_us=0.0)],
                   policy="fixed:4", drain_timeout_s=1.5, worker_dead_after_s=30.0)
    x = np.ones((1, 4), np.float32).tobytes()
    n = 20
    try:
        with zmq.Context.instance().socket(zmq.DEALER) as s, Client(node.dispatcher.frontend) as c:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(node.dispatcher.frontend)
            for rid in range(1, n + 1):
                s.send_multipart([P.encode(P.InferRequest(
                    v=P.PROTOCOL_VERSION, id=rid, model="sum", timeout_us=60_000_000,
                    inputs=[P.TensorRef(name="x", dtype="float32", shape=[1, 4], frame=0)])), x])
            _wait_status(c, lambda st: st.workers[0].inflight > 0 and st.queued >= n - 4)  # (all in)
            took = _stop(up)
            replies: dict[int, list] = {}
            while sum(map(len, replies.values())) < n and s.poll(10_000):
                r = P.reply_decoder.decode(s.recv_multipart()[0])
                if type(r) is P.InferReply:
                    replies.setdefault(r.id, []).append(r)
            assert not s.poll(300)  # (the dispatcher is gone: anything more was sent before it exited)
        assert sorted(replies) == list(range(1, n + 1)) and all(len(v) == 1 for v in replies.values()), replies
        ok = [rid for rid in sorted(replies) if replies[rid][0].status == P.Status.OK]
        # Served in order: the batch running at the SIGTERM and at least the next one (0.8 s of
        # the 1.5 s); the fifth batch cannot start before 1.6 s.
        assert ok == list(range(1, len(ok) + 1)) and 8 <= len(ok) <= 16, ok
        cut = [replies[rid][0] for rid in range(len(ok) + 1, n + 1)]
        assert all(r.status == P.Status.UNAVAILABLE and "shut" in r.message for r in cut), cut
        err = up.stderr.read()
        # (nor is the dispatcher's exit, at the stop, taken for a failure)
        assert up.returncode == 0 and b"killing it" not in err and b"dispatcher exited" not in err, err[-3000:]
        assert took < 1.5 + 5, f"`up` took {took:.1f} s to stop"
    finally:
        _kill(up)


def test_up_waits_for_the_dispatchers_drain(run_dir):
    """drain_timeout_s above up's 10 s stop bound was cut by SIGKILL: the requests of a batch in
    flight got no answer, and the dispatcher's ipc socket files were left behind."""
    node, up = _up(run_dir, [sim_worker("w0", ("sum",), launch_us=600e6)], drain_timeout_s=12.0,
                   worker_dead_after_s=300.0)
    try:
        [dispatcher] = _children(up, "::dispatcher")
        with Client(node.dispatcher.frontend) as c:
            fut = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=120)
            _wait_status(c, lambda st: st.workers[0].inflight > 0)
            _stop(up, timeout=90)  # the drain: 12 s, then the worker (its 600 s batch): 10 s
            with pytest.raises(Exception, match="shut down before the batch finished"):
                fut.result(10)
        err = up.stderr.read()
        assert up.returncode == 0 and b"pid %d did not stop" % dispatcher.pid not in err, err[-3000:]
    finally:
        _kill(up)


def test_sighup_stops_up_like_sigterm(run_dir):
    """Unhandled, SIGHUP (a closed terminal) ended `up` at once: no drain, and the children
    left to their parent-death signal."""
    node, up = _up(run_dir, [sim_worker("w0", ("sum",))])
    try:
        children = psutil.Process(up.pid).children()
        up.send_signal(signal.SIGHUP)
        assert up.wait(60) == 0
        assert b"signal 1: stopping" in up.stderr.read()
        psutil.wait_procs(children, timeout=10)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)
    finally:
        _kill(up)


def test_sighup_stops_a_dispatcher_a_worker_and_a_front_door_run_on_their_own_like_sigterm(run_dir):
    """Run by hand from a terminal that then closed, each died by SIGHUP's default action: the
    dispatcher failed its queue and left its socket files, the worker died with its batch, the
    front door left its registry folder in /dev/shm."""
    from batchyard.kserve_shm import registry_dir

    fe = FrontendConfig(grpc_port=0, http_port=free_port())
    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be",
                                       heartbeat_interval_s=0.1, worker_dead_after_s=0.6),
                      (SUM_MODEL,), (sim_worker("w0", ("sum",)),), frontend=fe).validate()
    path = Path(run_dir) / "node.toml"
    path.write_text(to_toml(node))
    cli = [sys.executable, "-m", "batchyard.cli"]
    dispatcher = subprocess.Popen([*cli, "dispatcher", "--config", str(path)], cwd=run_dir, stderr=subprocess.PIPE)
    worker = subprocess.Popen([*cli, "worker", "--config", str(path), "--name", "w0"], cwd=run_dir,
                              stderr=subprocess.PIPE)
    front = subprocess.Popen([*cli, "frontend", "--config", str(path)], cwd=run_dir, stderr=subprocess.PIPE)
    try:
        with Client(node.dispatcher.frontend) as c:
            c.status(min_registrations=1, wait=120, timeout=150)
        assert _line_with(front.stderr, b"front door pid", 120), _rest(front)
        assert os.path.isdir(registry_dir(fe.host, fe.grpc_port, fe.http_port))
        front.send_signal(signal.SIGHUP)
        assert front.wait(60) == 0, _rest(front)
        assert not os.path.exists(registry_dir(fe.host, fe.grpc_port, fe.http_port)), "the registry was left"
        worker.send_signal(signal.SIGHUP)
        assert worker.wait(60) == 0, worker.stderr.read()[-3000:]
        dispatcher.send_signal(signal.SIGHUP)
        assert dispatcher.wait(60) == 0, dispatcher.stderr.read()[-3000:]
        assert not list(Path(run_dir).glob("[fb]e")), "the dispatcher's sockets were left behind"
    finally:
        for p in (front, worker, dispatcher):
            _kill(p)


def test_ctrl_c_to_ups_process_group_stops_the_node_in_order(run_dir):
    """A terminal's Ctrl-C goes to the whole foreground process group. The children were in
    `up`'s: each got SIGINT at once, and a front-door request queued behind the batch in flight
    failed (503) instead of being served by the ordered stop (as under systemd's default stop;
    KillMode=mixed in the node unit now)."""
    node, up = _up(run_dir, [sim_worker("w0", ("sum",), launch_us=1_000_000.0)], frontend=True,
                   worker_dead_after_s=30.0, new_session=True)
    try:
        first, second = _one_running_one_queued(node)
        os.killpg(up.pid, signal.SIGINT)
        assert (first.result(30), second.result(30)) == ("ok", "ok")
        assert up.wait(60) == 0
    finally:
        _kill(up)


def test_a_private_folder_of_an_owner_killed_outright_goes_at_the_next_ones_start(tmp_path, monkeypatch):
    """`up` killed with SIGKILL left its config copy in /tmp/by-up-*, triton-local its backend
    folder in /tmp/by-triton-*, one per kill: the next one's start removes those whose owner is
    gone, and only those."""
    import tempfile

    from batchyard.private_tmp import PrivateDir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    alive = PrivateDir("by-up-")
    code = ("import signal, tempfile, sys; tempfile.tempdir = sys.argv[1]; from batchyard.private_tmp import "
            "PrivateDir; print(PrivateDir('by-up-').path, flush=True); signal.pause()")
    try:
        owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, cwd=ROOT)
        try:
            killed = Path(_line_with(owner.stdout, b"by-up-", 60).decode().strip())
        finally:
            _kill(owner)
        (killed / "node.toml").write_text("# its config copy")
        no_lock = tmp_path / "by-up-older"  # made before owners held a lock, or a moment before its lock
        no_lock.mkdir()
        other = tmp_path / "by-triton-x"
        other.mkdir()
        mine = PrivateDir("by-up-")
        assert not killed.exists(), "the killed owner's folder was left"
        assert alive.path.is_dir() and no_lock.is_dir() and other.is_dir() and mine.path.is_dir()
        mine.cleanup()
        assert not mine.path.exists()
    finally:
        alive.cleanup()


def test_a_sweep_between_a_private_folders_making_and_its_locking_leaves_it(tmp_path, monkeypatch):
    """Another start's sweep that opened the lock file before its owner had locked it found it
    free and removed the live owner's folder: its config copy could not be written."""
    import tempfile

    from batchyard import private_tmp

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    flock, swept = private_tmp.fcntl.flock, []

    def flock_after_another_sweep(fd, op):
        if not swept:
            swept.append("sweeping")
            swept.append(private_tmp.sweep("by-up-"))
        return flock(fd, op)

    monkeypatch.setattr(private_tmp.fcntl, "flock", flock_after_another_sweep)
    owner = private_tmp.PrivateDir("by-up-")
    try:
        assert swept[1] == [] and owner.path.is_dir(), swept
        (owner.path / "node.toml").write_text("# its config copy")
    finally:
        owner.cleanup()


def test_the_shared_memory_of_a_child_killed_hard_is_reaped_at_the_stop(tmp_path):
    """A front door killed with SIGKILL left its 64 MiB pool in /dev/shm after the node stopped,
    and the front doors' registry folder (the last one out removes it; killed, none did): the
    stop reaps the unheld segments of its children, and only theirs, and the folder."""
    from batchyard.kserve_shm import ShmRegions, registry_dir

    code = ("import signal; from batchyard.shm import Segment; s = Segment.create(4096); "
            "print(s.name, flush=True); signal.pause()")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT)
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT)
    fe = FrontendConfig(grpc_port=0, http_port=free_port())
    node = NodeConfig(dispatcher=DispatcherConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"ipc://{tmp_path}/be"),
                      models=(SUM_MODEL,), workers=(sim_worker(models=("sum",)),), frontend=fe).validate()
    registry = registry_dir(fe.host, fe.grpc_port, fe.http_port)
    joined = ShmRegions(registry)  # a front door that joined and never left: as if killed
    os.close(joined._alive_fd)
    os.close(joined._dir_fd)
    try:
        mine = _line_with(child.stdout, b"batchyard_", 60).decode().strip()
        theirs = _line_with(other.stdout, b"batchyard_", 60).decode().strip()
        child.kill()
        child.wait()
        assert live_segments(child.pid) == [mine]
        sup = supervisor.Supervisor(tmp_path / "node.toml", node)
        sup._spawned = {child.pid, other.pid}
        sup._reap_killed()
        assert live_segments(child.pid) == [], "a dead child's segment was left"
        assert live_segments(other.pid) == [theirs], "a live process's segment was taken"
        assert not os.path.exists(registry), "the front doors' registry folder was left"
    finally:
        for p in (child, other):
            _kill(p)
        for name in live_segments(child.pid) + live_segments(other.pid):
            os.unlink(os.path.join(SHM_DIR, name))
        if os.path.isdir(registry):
            ShmRegions(registry).close()


def test_a_sigterm_right_after_the_dispatcher_says_ready_drains_it(run_dir):
    """systemd may stop the unit the moment READY=1 arrives. The handlers were added after it,
    outside the running loop, where uvloop does not hear a signal: one in that gap was lost and
    the dispatcher ran on until SIGKILL (here a SIGTERM sent from inside announce_ready is also
    before the handlers, the default action: exit -15, no drain, the sockets left)."""
    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                      (SUM_MODEL,), ()).validate()
    path = Path(run_dir) / "node.toml"
    path.write_text(to_toml(node))
    script = (
        "import os, signal, sys\n"
        "from batchyard import sd_notify\n"
        "announce = sd_notify.announce_ready\n"
        "def announce_then_stopped(*a, **k):\n"
        "    watchdog = announce(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # systemd's stop, as READY=1 lands\n"
        "    return watchdog\n"
        "sd_notify.announce_ready = announce_then_stopped\n"
        "from batchyard.cli import main\n"
        f"sys.exit(main(['dispatcher', '--config', {str(path)!r}]))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert not list(Path(run_dir).glob("[fb]e")), "the dispatcher's sockets were left behind"
