"""Crashes: workers killed mid-batch, clients killed holding shared memory, `up` stopping."""

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

from batchyard import protocol as P
from batchyard.client import Client
from batchyard.config import ModelConfig, TensorConfig, WorkerConfig
from batchyard.errors import DeadlineExceeded, Unavailable
from batchyard.shm import SHM_DIR, live_segments

from conftest import MLP_MODEL, SUM_MODEL, sim_worker, spawn_up

ROOT = Path(__file__).resolve().parents[1]


def _pid_of(status, name):
    return next(w.pid for w in status.workers if w.name == name)


@pytest.mark.parametrize("n_workers", [1, 2])
def test_worker_sigkill_mid_batch_loses_nothing_and_up_restarts_it(start_node, n_workers):
    workers = [sim_worker(f"w{i}", launch_us=400_000.0) for i in range(n_workers)]
    node = start_node(workers)
    timeout = 8.0
    with node.client() as c:
        st = c.status()
        futs = [c.submit("sum", {"x": np.full((1, 4), i, np.float32)}, timeout=timeout) for i in range(6)]
        c.status()  # every request is queued or running now
        victim = _pid_of(st, "w0")
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        outcomes = []
        for i, f in enumerate(futs):
            try:
                outcomes.append(f.result()["y"].tolist() == [[4.0 * i, 4.0 * i]])
            except (Unavailable, DeadlineExceeded) as e:  # explicit, typed, in time
                outcomes.append(type(e).__name__)
        assert time.monotonic() - t0 < timeout + 1.5, "a request waited past its deadline"
        assert all(o is True or o in ("Unavailable", "DeadlineExceeded") for o in outcomes), outcomes
        # Every request was retried once elsewhere (or on the restarted worker) and answered.
        assert outcomes.count(True) >= 1
        back = c.status(min_registrations=st.registrations + 1, wait=60)
        assert _pid_of(back, "w0") != victim
        assert c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[4.0, 4.0]]


CRASHING_CLIENT = """
import os, sys, numpy as np
from batchyard.client import Client
c = Client(sys.argv[1])
a = c.alloc_array((1024,), np.float32)
print(c.pool.segment_names()[0], flush=True)
os.kill(os.getpid(), 9)
"""


def test_segments_of_a_crashed_client_are_reaped(run_dir):
    proc = subprocess.run([sys.executable, "-c", CRASHING_CLIENT, f"ipc://{run_dir}/x"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    seg = proc.stdout.strip()
    assert seg and os.path.exists(os.path.join(SHM_DIR, seg))  # left behind by the crash...
    with Client(f"ipc://{run_dir}/x"):  # ...and removed by the next client to start (or the dispatcher's janitor)
        pass
    assert not os.path.exists(os.path.join(SHM_DIR, seg))


def test_client_close_unlinks_its_segments(run_dir):
    c = Client(f"ipc://{run_dir}/x")
    c.alloc_array((4096,), np.float32)
    names = c.pool.segment_names()
    assert names and set(names) <= set(live_segments(os.getpid()))
    c.close()
    assert not set(names) & set(live_segments())


def test_up_stops_cleanly_on_sigterm(run_dir):
    node, up = spawn_up(run_dir, [sim_worker("w0", ("sum",))], [SUM_MODEL], stdout=subprocess.PIPE, text=True)
    try:
        assert "ready" in up.stdout.readline()  # printed once every worker has registered
        with Client(node.dispatcher.frontend) as c:
            st = c.status()
            assert c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[4.0, 4.0]]
        pids = [w.pid for w in st.workers]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert sorted(os.listdir(run_dir)) == ["node.toml"]  # its ipc socket files were left behind
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_systemd_units_verify(tmp_path):
    if not shutil_which("systemd-analyze"):
        pytest.skip("systemd-analyze not installed")
    units = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
    assert units
    # Point ExecStart at a binary that exists here; verify checks that it does.
    exe = Path(sys.executable).parent / "batchyard"
    for u in units:
        text = u.read_text().replace("/opt/batchyard/venv/bin/batchyard", str(exe))
        inst = tmp_path / u.name.replace("@.", "@0.")
        inst.write_text(text)
    for inst in sorted(tmp_path.glob("*.service")):
        r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(inst)], capture_output=True, text=True)
        problems = [ln for ln in (r.stdout + r.stderr).splitlines()
                    if inst.stem.split("@")[0] in ln or "Unknown" in ln or "Invalid" in ln]
        assert r.returncode == 0 and not problems, (inst.name, r.stdout, r.stderr)


def test_systemd_units_are_hardened(tmp_path):
    """Every unit's `systemd-analyze security` exposure is "OK" (at most 3.0 of 10)."""
    if not shutil_which("systemd-analyze"):
        pytest.skip("systemd-analyze not installed")
    units = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
    assert units
    for u in units:
        r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(u)],
                           capture_output=True, text=True)
        if "--offline" in r.stderr and "unrecognized" in r.stderr:
            pytest.skip("this systemd-analyze has no --offline (systemd < 252)")
        lines = [ln for ln in r.stdout.splitlines() if "Overall exposure level" in ln]
        assert lines, (u.name, r.stdout[-2000:], r.stderr)
        score = float(lines[0].split(":", 1)[1].split()[0])
        assert score <= 3.0, (u.name, lines[0], [ln for ln in r.stdout.splitlines() if "\u2717" in ln])


def shutil_which(name):
    import shutil

    return shutil.which(name)


def test_a_restarted_worker_still_stops_on_sigterm(start_node):
    node = start_node([sim_worker("w0", ("sum",))])
    with node.client() as c:
        st = c.status()
        os.kill(_pid_of(st, "w0"), signal.SIGKILL)
        back = c.status(min_registrations=st.registrations + 1, wait=60)
        new_pid = _pid_of(back, "w0")
    t0 = time.monotonic()
    node.stop()
    assert time.monotonic() - t0 < 8.0  # not the 10 s terminate-then-kill fallback
    with pytest.raises(ProcessLookupError):
        os.kill(new_pid, 0)


def test_up_stopped_during_start_up_still_cleans_up(run_dir):
    # A worker that takes a while to come up: SIGTERM reaches `up` while it waits for readiness.
    slow = WorkerConfig(name="w0", kind="amx", models=("mlp",), threads=1, warmup_sizes=(1, 2, 4, 8, 16))
    _, up = spawn_up(run_dir, [slow], [MLP_MODEL], stderr=subprocess.PIPE, text=True)
    try:
        for line in up.stderr:  # the worker process exists once `up` logs its start
            if "started worker w0" in line:
                pid = int(line.rsplit("pid ", 1)[1].rstrip(")\n"))
                break
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        with pytest.raises(ProcessLookupError):  # stopped by `up` itself, not left to die later
            os.kill(pid, 0)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def test_an_input_that_kills_its_worker_fails_alone_and_its_batch_is_served(start_node):
    """Request 2 kills the worker that runs it. Its batch's other requests were retried with
    it, the worker died again, and they failed with it; now each retried request runs alone:
    request 2 fails UNAVAILABLE, every other one is served, and the worker is back."""
    poison = ModelConfig(name="poison", factory="tests.poison_model:model", max_batch=8,
                         inputs=(TensorConfig("x", "float32", (4,)),), outputs=(TensorConfig("y", "float32", (2,)),))
    # The dispatcher's own time window (6 items, or 1 s after the oldest) puts the six in one batch.
    node = start_node([WorkerConfig(name="w0", kind="amx", models=("poison",), threads=1, warmup_sizes=(1,))],
                      models=(poison,), policy="window:1000000,6")
    with node.client() as c:
        xs = [np.full((1, 4), i, np.float32) for i in range(6)]
        xs[2][:] = np.nan
        futs = [c.submit("poison", {"x": x}, timeout=120.0) for x in xs]
        outcomes = []
        for f in futs:
            try:
                outcomes.append(f.result()["y"].tolist())
            except Unavailable as e:
                outcomes.append(type(e).__name__)
        assert outcomes == [[[2.0 * i, 2.0 * i]] if i != 2 else "Unavailable" for i in range(6)], outcomes
        assert c.infer("poison", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[2.0, 2.0]]


# ---------------------------------------------------------------- processes that must end, and what they leave
def _worker_cli(run_dir, workers=None, name="w0", models=(SUM_MODEL,)):
    """A node config in ``run_dir`` and the argv of `batchyard worker` for ``name``."""
    from batchyard.config import DispatcherConfig, NodeConfig, to_toml

    node = NodeConfig(dispatcher=DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                      models=tuple(models), workers=tuple(workers or [sim_worker(name, ("sum",))])).validate()
    path = Path(run_dir) / "node.toml"
    path.write_text(to_toml(node))
    return node, [sys.executable, "-m", "batchyard.cli", "worker", "--config", str(path), "--name", name]


def test_a_worker_whose_registrations_go_unanswered_says_so(run_dir):
    """A second worker of a name already connected is dropped by the dispatcher's socket, unseen:
    it waited for ever, one start-up line and then nothing (under systemd, until its start
    timed out). After three unanswered registrations it now says what may be wrong."""
    import threading

    import zmq

    node, argv = _worker_cli(run_dir)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    try:
        router.setsockopt(zmq.LINGER, 0)
        router.bind(node.dispatcher.backend)  # a dispatcher that never answers, played here
        w = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        give_up = threading.Timer(60, w.kill)  # a worker that never says it ends the read below
        give_up.start()
        try:
            seen = []
            for line in w.stderr:
                seen.append(line)
                if "unanswered" in line:
                    break
            assert "worker w0: 3 registrations with the dispatcher at ipc://" in seen[-1], seen
            assert "Is another worker named 'w0' connected to it?" in seen[-1]
        finally:
            give_up.cancel()
            w.kill()
            w.wait()
    finally:
        router.close()
        ctx.term()


def test_a_dispatcher_asking_each_heartbeat_to_register_again_draws_a_beat_a_period_and_one_registration(run_dir):
    """A restarted dispatcher answers each heartbeat of a worker it does not know `reregister`.
    The answer ended the heartbeat's wait and the next beat went at once, each drawing a
    registration: 603 in 40 ms, and a warning of registrations "unanswered in 1204 s" 1.3 s
    after the restart. Here one heartbeat period (0.2 s) a beat, and the registration sent
    once, then retried on its own period (2 s)."""
    import zmq

    from batchyard import protocol as P

    node, argv = _worker_cli(run_dir)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    beats = registrations = 0
    try:
        router.setsockopt(zmq.LINGER, 0)
        router.bind(node.dispatcher.backend)  # a dispatcher played here
        w = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        try:
            first_beat = None
            while first_beat is None or time.monotonic() < first_beat + 1.0:
                assert router.poll(60_000), "the worker sent nothing"
                who, frame = router.recv_multipart()
                msg = P.worker_message_decoder.decode(frame)
                if type(msg) is P.Register:
                    registrations += 1
                    if registrations == 1:  # the first dispatcher knows it; then it "restarted"
                        router.send_multipart([who, P.encode(P.Registered(worker="w0"))])
                elif type(msg) is P.Heartbeat:
                    first_beat = first_beat or time.monotonic()
                    beats += 1
                    router.send_multipart([who, P.encode(P.Reregister(worker="w0"))])
        finally:
            w.kill()
            _, err = w.communicate(timeout=60)
    finally:
        router.close()
        ctx.term()
    assert beats <= 8 and registrations <= 2, (beats, registrations)
    assert "unanswered" not in err, err[-2000:]


@pytest.mark.parametrize("ending", ["rejected", "stopped"])
def test_a_worker_that_never_registered_exits(run_dir, ending):
    """Its heartbeat socket, opened but never started, kept ZeroMQ's context from closing: a worker
    the dispatcher rejected (exit 2 due), or one stopped before the dispatcher answered (exit 0
    due), stayed up for ever, and `up` had to kill it."""
    import zmq

    from batchyard import protocol as P

    node, argv = _worker_cli(run_dir)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(node.dispatcher.backend)  # the dispatcher's part, played here
    w = subprocess.Popen(argv, cwd=ROOT)
    try:
        assert router.poll(120_000), "the worker never asked to register"
        identity, frame = router.recv_multipart()
        assert type(P.worker_message_decoder.decode(frame)) is P.Register
        if ending == "rejected":
            router.send_multipart([identity, P.encode(P.RegisterRejected(worker="w0", message="spec differs"))])
        else:
            w.send_signal(signal.SIGTERM)
        assert w.wait(timeout=60) == (2 if ending == "rejected" else 0)
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
        router.close()
        ctx.term()


def test_a_worker_that_dies_ends_the_harness_wait_with_its_exit_code(run_dir):
    """`batchyard calibrate` drives workers through this harness: a worker killed mid-batch left
    it waiting for the answer for good, and one that died before registering for 300 s."""
    from batchyard.workers.harness import DirectWorker

    node, _ = _worker_cli(run_dir, [sim_worker("w0", ("sum",), launch_us=60e6)])
    with DirectWorker(node, "w0") as dw:
        dw.wait_registered(120)
        request = dw.zeros_request("sum", 1)
        dw.proc.kill()
        with pytest.raises(RuntimeError, match=r"worker w0 exited with -9 before it answered batch 1"):
            dw.run("sum", [request])
    node, _ = _worker_cli(run_dir, [WorkerConfig(name="w0", kind="amx", models=("sum",), cpus=(4096,))])
    with DirectWorker(node, "w0") as dw:
        with pytest.raises(RuntimeError, match=r"worker w0 exited with 78 before it registered"):
            dw.wait_registered(120)


def test_a_worker_with_cpus_and_a_numa_node_keeps_every_thread_on_its_cpus(run_dir):
    """Bound to the NUMA node after its pinning, the worker's main thread (and every thread it
    started after: ZeroMQ's, the model's) ran on the whole node. Its memory is bound to the node
    (it was only preferred: memory spilled to other nodes once the node filled)."""
    from batchyard.workers.harness import DirectWorker

    if not os.path.exists("/sys/devices/system/node/node0"):
        pytest.skip("no NUMA node 0 here")
    cpu = sorted(os.sched_getaffinity(0))[-1]
    import msgspec

    node, _ = _worker_cli(run_dir, [msgspec.structs.replace(sim_worker("w0", ("sum",)), cpus=(cpu,), numa_node=0)])
    with DirectWorker(node, "w0") as dw:
        dw.wait_registered(120)
        masks = {}
        for tid in os.listdir(f"/proc/{dw.proc.pid}/task"):
            masks[tid] = os.sched_getaffinity(int(tid))
        with open(f"/proc/{dw.proc.pid}/task/{dw.proc.pid}/numa_maps") as f:
            policies = {line.split()[1] for line in f if len(line.split()) > 1}
    assert masks and all(m == {cpu} for m in masks.values()), masks
    assert "bind:0" in policies and not {p for p in policies if p.startswith("prefer")}, policies


def _libnuma():
    import ctypes
    import ctypes.util

    try:
        numa = ctypes.CDLL(ctypes.util.find_library("numa") or "libnuma.so.1", use_errno=True)
    except OSError:
        pytest.skip("no libnuma here")
    if numa.numa_available() < 0:
        pytest.skip("no NUMA here")
    return numa


def test_a_memory_bind_inherited_with_a_mode_flag_is_kept():
    # get_mempolicy gives the mode with its flags (numactl --balancing --membind, or
    # MPOL_F_STATIC_NODES): read as no bind, the unit's bind was replaced by the worker's own.
    import ctypes

    from batchyard.workers.pinning import MASK_BITS, MPOL_BIND, _bind_memory

    numa = _libnuma()
    mask = (ctypes.c_ulong * (MASK_BITS // 64))()
    mask[0] = 1
    static_nodes = 1 << 15
    assert numa.set_mempolicy(MPOL_BIND | static_nodes, mask, MASK_BITS) == 0  # as the unit left it, on this thread
    try:
        assert _bind_memory(numa, 0) == "memory bound to nodes [0] as inherited"
        mode = ctypes.c_int()
        numa.get_mempolicy(ctypes.byref(mode), mask, MASK_BITS, None, 0)
        assert mode.value == MPOL_BIND | static_nodes
    finally:
        numa.set_mempolicy(0, None, 0)  # this thread back to the default policy


def test_a_numa_node_the_kernel_will_not_bind_memory_to_leaves_the_worker_running_unbound():
    # A node without memory (or outside the cpuset's memory nodes): set_mempolicy(MPOL_BIND) fails
    # EINVAL, and the worker exited 78 for good, where it used to run with memory unbound.
    import ctypes
    import errno

    from batchyard.workers.pinning import _bind_memory

    class NodeWithoutMemory:
        def get_mempolicy(self, mode, mask, maxnode, addr, flags):
            return 0  # the default policy

        def set_mempolicy(self, mode, mask, maxnode):
            ctypes.set_errno(errno.EINVAL)
            return -1

    said = _bind_memory(NodeWithoutMemory(), 1)
    assert said.startswith("memory NOT bound: set_mempolicy(MPOL_BIND, node 1) failed (Invalid argument"), said


def _poison_worker(run_dir, model: str, factory: str, max_batch: int):
    """A node config in ``run_dir`` of one AMX worker, w0, of a model of tests/poison_model.py
    (x float32[4] -> y float32[2]), and the argv of `batchyard worker` for it."""
    spec = ModelConfig(name=model, factory=f"tests.poison_model:{factory}", max_batch=max_batch,
                       inputs=(TensorConfig("x", "float32", (4,)),), outputs=(TensorConfig("y", "float32", (2,)),))
    return _worker_cli(run_dir, [WorkerConfig(name="w0", kind="amx", models=(model,), threads=1, warmup_sizes=(1,))],
                       models=(spec,))


def test_calibrate_stops_at_a_failed_batch_and_writes_no_profile(run_dir):
    # A failed batch reports 0 us, and was taken as a measurement: the profile, written with
    # exit 0, put T(4) at 0 ms, and the dispatcher refused the file.
    from batchyard.workers.calibrate import CalibrationFailed, calibrate

    node, _ = _poison_worker(run_dir, "small", "small_batches_only", 8)
    out = Path(run_dir) / "profile.json"
    with pytest.raises(CalibrationFailed, match=r"w0 small B=4: the batch failed: .*batch too big for this model"):
        calibrate(node, out, sizes=[1, 4], reps=2, log=lambda *_: None)
    assert not out.exists()
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", "calibrate", "--config", "x.toml", "--out", str(out),
                        "--sizes", "0,a"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--sizes" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_calibrate_writes_one_point_a_size_for_two_workers_of_one_path_and_the_node_takes_it(run_dir):
    # node0.toml's two AMX workers of one model wrote each size twice, one per worker, and the
    # dispatcher refused the profile calibrate had just written ("a batch size twice").
    from batchyard.config import DispatcherConfig, NodeConfig
    from batchyard.cost_model import load_profile
    from batchyard.workers.calibrate import calibrate

    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"), (SUM_MODEL,),
                      (sim_worker("s0", ("sum",)), sim_worker("s1", ("sum",), launch_us=5000.0))).validate()
    out = Path(run_dir) / "profile.json"
    said = []
    calibrate(node, out, sizes=[1, 4], reps=2, log=said.append)
    import json

    # Of different speeds, they share one curve all the same: said, not silently averaged.
    assert [s for s in said if s.startswith("warning: sum [") and "one cost curve a (model, path)" in s], said

    (path, curve), = json.loads(out.read_text())["models"]["sum"].items()  # both workers' path
    assert [b for b, _ in curve["points"]] == [1, 4]
    assert load_profile(str(out), {"sum"})[("sum", path)].predict(4) > 0  # refused before: a size twice


def test_calibrate_on_a_worker_that_cannot_start_says_so_in_one_line_and_exits_with_its_78(run_dir):
    # A factory typo: the worker logs why and exits 78 (EX_CONFIG); calibrate went on with a
    # traceback from its harness and exit 1.
    _poison_worker(run_dir, "m", "no_such_factory", 4)
    out = Path(run_dir) / "profile.json"
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", "calibrate", "--config", f"{run_dir}/node.toml",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 78 and "Traceback" not in r.stderr, r.stderr
    assert "cannot load model factory 'tests.poison_model:no_such_factory'" in r.stderr
    assert r.stderr.strip().splitlines()[-1] == "batchyard calibrate: worker w0 exited with 78 before it registered"
    assert not out.exists()


HARNESS_PARENT = """
import sys
from batchyard.cli import load_node
from batchyard.workers.harness import DirectWorker
dw = DirectWorker(load_node(sys.argv[1], workers=None), "w0")
dw.wait_registered(120)
print(dw.proc.pid, dw.dir, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_a_worker_the_harness_started_ends_when_the_process_driving_it_is_killed(run_dir):
    # kill -9 of `batchyard calibrate` (the OOM killer, a CI runner's hard kill) left its worker
    # running for good, its parent pid 1, holding its shared memory and a Triton worker's regions.
    import select
    import shutil

    _worker_cli(run_dir)
    parent = subprocess.Popen([sys.executable, "-c", HARNESS_PARENT, f"{run_dir}/node.toml"], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    worker, harness_dir = None, None
    try:
        pid, harness_dir = parent.stdout.readline().split()
        worker = os.pidfd_open(int(pid))
        parent.kill()
        parent.wait()
        assert select.select([worker], [], [], 30)[0], "the worker outlived the process that drove it"
    finally:
        if worker is not None:
            if not select.select([worker], [], [], 0)[0]:
                signal.pidfd_send_signal(worker, signal.SIGKILL)
            os.close(worker)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdin.close()
        parent.stdout.close()
        if harness_dir:
            shutil.rmtree(harness_dir, ignore_errors=True)


@pytest.mark.parametrize("factory, says", [
    ("returns_a_tuple", "model 'tup': forward must return a dict of tensors by output name, got tuple"),
    ("returns_arrays", "model 'tup': forward must return a dict of tensors by output name; output 'y' is ndarray"),
    # A layer that does not fit the spec: "RuntimeError: mat1 and mat2 shapes cannot be
    # multiplied", a traceback and exit 1, restarted for ever.
    ("raises_always", "RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
])
def test_a_model_that_fails_its_warm_up_stops_its_worker_in_one_line(run_dir, factory, says):
    # Its warm-up died with "AttributeError: 'tuple' object has no attribute 'items'", exit 1,
    # and up restarted it for ever: the same code fails the same way at every start.
    _, argv = _poison_worker(run_dir, "tup", factory, 2)
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 78 and "Traceback" not in r.stderr, r.stderr
    assert f"'tup': warm-up at B=1: {says}" in r.stderr, r.stderr


def test_a_worker_out_of_memory_at_its_warm_up_exits_to_be_restarted(run_dir):
    """Memory a killed predecessor held may not be free yet: exit 1, which up and systemd
    restart, not 78, which they never do (a model that always fails its warm-up is 78, above)."""
    _, argv = _poison_worker(run_dir, "oom", "out_of_memory", 2)
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode not in (0, 78) and "OutOfMemoryError" in r.stderr, r.stderr


def test_a_worker_stopped_with_a_second_batch_queued_answers_both(run_dir):
    """max_inflight 2: SIGTERM while one batch runs and the next waits in the socket. The worker
    finished the first and said goodbye holding the second, which the dispatcher then took for
    a batch it died running (its requests' retry spent, run again alone as suspects)."""
    from batchyard.workers.harness import DirectWorker

    worker = msgspec.structs.replace(sim_worker("w0", ("sum",), launch_us=1_000_000.0), max_inflight=2)
    node, _ = _worker_cli(run_dir, [worker])
    with DirectWorker(node, "w0") as dw:
        dw.wait_registered(120)
        req = dw.zeros_request("sum", 1)
        for batch_id in (1, 2):
            dw.sock.send_multipart([dw.identity, P.encode(P.Batch(batch_id=batch_id, model="sum", seqs=[0],
                                                                  n_frames=[len(req) - 1])), *req])
        dw.proc.send_signal(signal.SIGTERM)  # whether or not it has started the first: both are its
        told = []
        while ("Goodbye", None) not in told:
            assert dw.sock.poll(30_000), told
            m = P.worker_message_decoder.decode(dw.sock.recv_multipart()[1])
            if type(m) is P.Leaving:
                dw.sock.send_multipart([dw.identity, P.encode(P.LeavingNoted(worker="w0"))])
            if type(m) is not P.Heartbeat:
                told.append((type(m).__name__, getattr(m, "batch_id", None)))
        assert dw.proc.wait(30) == 0
    done = [b for kind, b in told if kind == "BatchDone"]
    assert sorted(done) == [1, 2], told


def test_a_sigterm_to_calibrate_stops_its_worker_and_leaves_no_folder_or_socket_file(run_dir):
    """It ended calibrate at once: its worker was orphaned, and its /tmp/by-direct-* folder with
    the worker's ipc socket file stayed behind (an outside review: three after three runs)."""
    import psutil

    from batchyard.config import DispatcherConfig, NodeConfig, to_toml

    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"), (SUM_MODEL,),
                      (sim_worker("s0", ("sum",), launch_us=200_000.0),)).validate()
    (Path(run_dir) / "node.toml").write_text(to_toml(node))
    p = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "calibrate", "--config", f"{run_dir}/node.toml",
                          "--out", f"{run_dir}/profile.json", "--sizes", "1,2,4,8", "--reps", "20"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "B=1" in p.stdout.readline()  # measuring: its worker runs
        [worker] = psutil.Process(p.pid).children()  # (titled batchyard::sim-worker[s0])
        # the folder of the worker's socket, which calibrate binds
        [folder] = {Path(c.laddr).parent for c in psutil.Process(p.pid).net_connections(kind="unix") if c.laddr}
        assert folder.name.startswith("by-direct-") and folder.exists()
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 128 + signal.SIGTERM
        assert not folder.exists() and not worker.is_running()
        assert not Path(f"{run_dir}/profile.json").exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
