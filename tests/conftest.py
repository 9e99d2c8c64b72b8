"""Fixtures: real nodes (dispatcher + worker processes) on private ipc paths, always torn down.

Every test gets fresh ipc endpoints in its own temp dir, a supervisor whose children die with
it (PR_SET_PDEATHSIG), and a check that no Batchyard shared-memory segment it created is left
in /dev/shm afterwards.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

# This process imports grpc (tritonclient, the front door's tests) and then starts nodes with
# subprocess.Popen: grpc's fork handlers restart its poller in the child, which can die of SIGABRT
# before exec ("Epoll1Poller ... epoll_wait error: Bad file descriptor", grpc/grpc#43055; seen
# once here as a worker "exited with -6 during start-up"). The tests never use grpc across a fork.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from batchyard.client import Client
from batchyard.config import (DispatcherConfig, ModelConfig, NodeConfig, SimConfig, TensorConfig,
                               WorkerConfig, to_toml)
from batchyard.shm import live_segments, reap_orphans

ROOT = Path(__file__).resolve().parents[1]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Captured output and logs with a lone surrogate (tests feed the workers undecodable text on
    # purpose) could not be sent from an xdist worker: the whole run stopped with INTERNALERROR.
    report = (yield).get_result()
    report.sections = [(title, text.encode("utf-8", "backslashreplace").decode("utf-8"))
                       for title, text in report.sections]


SUM_MODEL = ModelConfig(name="sum", factory="batchyard.workers.models:mlp", max_batch=16,
                        inputs=(TensorConfig("x", "float32", (4,)),),
                        outputs=(TensorConfig("y", "float32", (2,)),))
BIG_MODEL = ModelConfig(name="big", factory="batchyard.workers.models:mlp", max_batch=4,
                        inputs=(TensorConfig("x", "float32", (256, 1024)),),
                        outputs=(TensorConfig("y", "float32", (256, 1024)),))
MINILM_MODEL = ModelConfig(name="minilm", factory="batchyard.workers.models:minilm", max_batch=4,
                           inputs=(TensorConfig("input_ids", "int64", (128,)),
                                   TensorConfig("attention_mask", "int64", (128,))),
                           outputs=(TensorConfig("embedding", "float32", (384,)),))
MLP_MODEL = ModelConfig(name="mlp", factory="batchyard.workers.models:mlp", max_batch=16,
                        inputs=(TensorConfig("x", "float32", (256,)),),
                        outputs=(TensorConfig("y", "float32", (256,)),))
# Served by Triton's test models deploy/triton/cpu/dense_amx and gpu/dense_gpu (no factory: only
# Triton workers serve it).
TRITON_DENSE_MODEL = ModelConfig(name="tri", factory="", max_batch=64,
                                 inputs=(TensorConfig("x", "float32", (1024,)),),
                                 outputs=(TensorConfig("y", "float32", (1024,)),))


def free_port() -> int:
    """A TCP port free at the time of the call, none handed out before (batchyard.addresses)."""
    from batchyard.addresses import free_port as free

    return free()


def sim_worker(name="sim0", models=("sum", "big"), **sim):
    return WorkerConfig(name=name, kind="sim", models=models,
                        sim=SimConfig(launch_us=sim.get("launch_us", 100.0),
                                      per_item_us=sim.get("per_item_us", 10.0)))


class Node:
    """A node run by a real `batchyard up` process (so worker restarts are real too)."""

    def __init__(self, node: NodeConfig, up: subprocess.Popen, run_dir: str):
        self.cfg = node
        self.up = up
        self.run_dir = run_dir
        self.address = node.dispatcher.frontend

    def stop(self) -> None:
        if self.up.poll() is None:
            self.up.send_signal(signal.SIGTERM)
            try:
                self.up.wait(timeout=30)
            except subprocess.TimeoutExpired:  # children die with it (PR_SET_PDEATHSIG)
                self.up.kill()
                self.up.wait()

    def client(self, **kw) -> Client:
        return Client(self.address, **kw)


def worker_message(router, identity: bytes):
    """The next message of the worker at ``identity`` on a fake dispatcher's ROUTER (not one of its
    heartbeat socket's)."""
    from batchyard import protocol as P

    while True:
        assert router.poll(30_000)
        who, *frames = router.recv_multipart()
        if who == identity:
            return P.worker_message_decoder.decode(frames[0])


def serve_beside(runtime, fake_dispatcher, router) -> int:
    """``runtime.serve()``'s exit code, run here while ``fake_dispatcher`` plays the dispatcher on
    ``router`` from a thread (joined, and ``router`` closed, after)."""
    t = threading.Thread(target=fake_dispatcher)
    t.start()
    try:
        return runtime.serve()
    finally:
        t.join(timeout=60)
        router.close()


def spawn_up(run_dir, workers, models, dispatcher=None, **popen_kw) -> tuple[NodeConfig, subprocess.Popen]:
    """A node config on ipc endpoints in ``run_dir`` (``dispatcher``: DispatcherConfig overrides),
    written there, and a `batchyard up` running it; the caller owns the process."""
    node = NodeConfig(
        dispatcher=DispatcherConfig(**{"frontend": f"ipc://{run_dir}/fe", "backend": f"ipc://{run_dir}/be",
                                       **(dispatcher or {})}),
        models=tuple(models), workers=tuple(workers)).validate()
    path = Path(run_dir) / "node.toml"
    path.write_text(to_toml(node))
    up = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "up", "--config", str(path)], cwd=ROOT, **popen_kw)
    return node, up


def ready_notify_socket(run_dir) -> tuple[socket.socket, dict]:
    """A datagram socket in ``run_dir`` on which `up` and `frontend` say READY=1 the systemd way,
    and the environment that names it to them; the caller closes the socket."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(f"{run_dir}/notify")
    return notify, os.environ | {"NOTIFY_SOCKET": f"{run_dir}/notify"}


def said_ready(notify: socket.socket, proc: subprocess.Popen, limit_s: float = 180.0) -> bool:
    """Whether ``proc`` said READY=1 on ``notify`` before it exited (or ``limit_s`` passed). Where
    a test waited instead for a gRPC channel to the front door, gRPC's reconnect backoff (1 s after
    a connection refused before the port was bound) added about a second to each node's start."""
    exited = os.pidfd_open(proc.pid)
    try:
        readable, _, _ = select.select([notify, exited], [], [], limit_s)
    finally:
        os.close(exited)
    return notify in readable and b"READY=1" in notify.recv(4096).split(b"\n")


def registered_while_up(address: str, up: subprocess.Popen, count: int, limit_s: float = 180.0):
    """The dispatcher's status once ``count`` workers registered (a long poll, answered when they
    have), asked again every few seconds while ``up`` lives: a node that cannot start (its
    dispatcher fails to import, its config is refused) fails the test when ``up`` exits, not
    after the whole wait, which made every node test of a broken build wait 180 s."""
    from batchyard.errors import DeadlineExceeded

    end = time.monotonic() + limit_s
    with Client(address) as c:
        while True:
            if up.poll() is not None:
                pytest.fail(f"batchyard up exited with {up.returncode} before {count} worker(s) registered "
                            "(its log is in the test's captured stderr)")
            left = end - time.monotonic()
            try:
                st = c.status(min_registrations=count, wait=min(5.0, max(0.0, left)), timeout=5.0)
            except DeadlineExceeded:  # no dispatcher bound yet to answer
                st = None
            if st is not None and (st.registrations >= count or left <= 0):
                return st
            if left <= 0:
                pytest.fail(f"no dispatcher answered at {address} within {limit_s:.0f} s")


@pytest.fixture
def run_dir():
    # ipc paths must stay under ~100 characters, so not pytest's long tmp_path.
    d = tempfile.mkdtemp(prefix="by-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_node(run_dir):
    """start_node(workers=[...], models=[...], **dispatcher_overrides) -> Node, ready."""
    started: list[Node] = []

    def start(workers, models=(SUM_MODEL, BIG_MODEL), **dkw):
        dkw.setdefault("heartbeat_interval_s", 0.1)
        dkw.setdefault("worker_dead_after_s", 0.6)
        node, up = spawn_up(run_dir, workers, models, dkw, stdout=subprocess.DEVNULL)
        n = Node(node, up, run_dir)
        started.append(n)
        st = registered_while_up(n.address, up, len(workers))
        assert st.registrations >= len(workers), f"node did not come up: {st}"
        return n

    yield start
    for n in started:
        n.stop()


@pytest.fixture
def bare_dispatcher(run_dir):
    """bare_dispatcher(**Dispatcher kwargs) -> a Dispatcher of no models on private ipc paths,
    driven by calling it (no worker process, no event loop); closed after the test."""
    import zmq

    from batchyard.server import Dispatcher

    ctx = zmq.Context()
    made = []

    def make(**kw):
        d = Dispatcher(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"), (), ctx=ctx,
                       **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()
    ctx.term()


@pytest.fixture(autouse=True)
def no_leaked_shm():
    # This process's segments only: other test runs on the machine create and free their own.
    before = set(live_segments(os.getpid()))
    yield
    # The test's child processes are gone: their unlocked segments go. Not a segment still being
    # created (".new", unlocked for an instant), which may be another pytest process's (xdist):
    # with no grace for those, this sweep removed one in that instant (87 of 94,594 creations
    # beside a sweeping loop, a review's run), and its creator failed.
    reap_orphans()
    leaked = set(live_segments(os.getpid())) - before
    for name in leaked:  # clean up so one failure does not cascade, then fail
        os.unlink(os.path.join("/dev/shm", name))
    assert not leaked, f"shared-memory segments left behind: {sorted(leaked)}"


def perf_analyzer_ran(args: list[str]) -> str:
    """Triton's perf_analyzer run with ``args`` (skips the test where the binary is missing): its
    output, after asserting the run ended 0 with no request failed and some served."""
    import re

    from batchyard.bench import perf_analyzer

    try:
        cmd, env = perf_analyzer.command(args)
    except perf_analyzer.PerfAnalyzerMissing as e:
        pytest.skip(str(e))
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Unable to" not in out and "had error" not in out and "Failed" not in out, out
    assert int(re.search(r"Successful request count: (\d+)", r.stdout).group(1)) > 0, out
    return r.stdout
