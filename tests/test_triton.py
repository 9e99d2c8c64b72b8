"""The GPU worker against a real Triton server (nvidia-pytriton's tritonserver, python backend,
CPU-only here: Triton stands in for the GPU's speed)."""

from __future__ import annotations

import collections
import importlib.util
import mmap
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
import zlib

import numpy as np
import pytest

if importlib.util.find_spec("pytriton") is None:  # found, not imported: tritonserver is all we use of it
    pytest.skip("needs nvidia-pytriton's tritonserver", allow_module_level=True)
grpcclient = pytest.importorskip("tritonclient.grpc")

from batchyard.config import ModelConfig, TensorConfig, TritonConfig, WorkerConfig  # noqa: E402
from batchyard.errors import InvalidArgument, Unavailable  # noqa: E402
from batchyard.workers.runtime import ExecutorUnavailable  # noqa: E402
from batchyard.workers.triton_executor import TritonExecutor  # noqa: E402
from batchyard.workers.triton_local import ServerExited, TritonLocal, _free_port  # noqa: E402
from batchyard.workers.triton_regions import cuda_device_count, resolve_kind  # noqa: E402

from conftest import ROOT, TRITON_DENSE_MODEL as TRI, serve_beside, sim_worker, spawn_up, worker_message  # noqa: E402

REPO = ROOT / "deploy" / "triton" / "cpu"


TEST_MODELS = ROOT / "tests" / "triton_models"


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    (repo / "dense_amx").symlink_to(REPO / "dense_amx")
    (repo / "misbehaving").symlink_to(TEST_MODELS / "misbehaving")
    (repo / "scalar_item").symlink_to(TEST_MODELS / "scalar_item")
    tl = TritonLocal(repo, models=["dense_amx", "misbehaving", "scalar_item"]).start(ready_timeout_s=120)
    yield tl
    tl.close()


def test_triton_local_listens_on_loopback_only(triton):
    """Triton binds every interface by default, and its shared-memory API answers anyone who
    reaches it: from another host a node's regions were listed and unregistered (the docs said
    127.0.0.1)."""
    import ipaddress

    import psutil

    def v4(ip: str):  # gRPC's listener reads ::ffff:127.0.0.1
        a = ipaddress.ip_address(ip)
        return getattr(a, "ipv4_mapped", None) or a

    ports = {triton.grpc_port, triton.http_port, triton.metrics_port}
    listening = {(v4(c.laddr.ip), c.laddr.port) for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}
    assert {port for _, port in listening} == ports, listening
    assert {str(ip) for ip, _ in listening} == {"127.0.0.1"}, listening


@pytest.mark.parametrize("host, dialled", [("192.0.2.2", "192.0.2.2"), ("0.0.0.0", "127.0.0.1")])
def test_triton_local_dials_the_address_it_binds(host, dialled):
    """With --host one address, its readiness wait dialled 127.0.0.1, where nothing listened:
    "not ready within 120 s", exit 1, while Triton served on the address asked."""
    tl = TritonLocal(REPO, host=host)
    try:
        assert tl.grpc_url == f"{dialled}:{tl.grpc_port}"
    finally:
        tl.close()


def gpu_worker(tl, warmup=(1, 8), **kw):
    return WorkerConfig(name="gpu0", kind="triton", models=("tri",), warmup_sizes=warmup,
                        triton=TritonConfig(url=tl.grpc_url, models={"tri": "dense_amx"}, **kw))


def direct(tl, x):
    c = grpcclient.InferenceServerClient(tl.grpc_url)
    try:
        inp = grpcclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return c.infer("dense_amx", [inp]).as_numpy("y")
    finally:
        c.close()


def test_same_outputs_as_calling_triton_directly(start_node, triton):
    node = start_node([gpu_worker(triton)], models=(TRI,))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((int(rng.integers(1, 5)), 1024)).astype(np.float32) for _ in range(20)]
    with node.client() as c:
        futs = [c.submit("tri", {"x": x}) for x in xs]
        res = [f.result() for f in futs]
    for x, r in zip(xs, res):
        np.testing.assert_allclose(r["y"], direct(triton, x), rtol=1e-4, atol=1e-5)  # fp32; batch composition changes matmul blocking
        assert r.timing.path == "gpu" and not r.timing.simulated
    assert max(r.timing.batch_size for r in res) > 1


def test_the_front_doors_classification_is_tritons(triton):
    """tritonclient's class_count through Batchyard's KServe front door (a node whose Triton
    worker serves dense_amx) gets what Triton answers to the same request, string for string, over
    gRPC and HTTP: the top 5; 2000 classes of 1024 (all, ranked); 2**32 + 1, which Triton keeps as
    its low 32 bits (1); over HTTP, 2**32 (0: none asked, the plain tensor)."""
    import tritonclient.http as httpclient
    from test_kserve import _node_with_front_door

    x = np.random.default_rng(7).standard_normal((3, 1024)).astype(np.float32)

    def both(url_grpc, url_http, model, classes):
        g, h = grpcclient.InferenceServerClient(url_grpc), httpclient.InferenceServerClient(url_http)
        try:
            gi, hi = grpcclient.InferInput("x", [3, 1024], "FP32"), httpclient.InferInput("x", [3, 1024], "FP32")
            gi.set_data_from_numpy(x)
            hi.set_data_from_numpy(x)
            got = [g.infer(model, [gi], outputs=[grpcclient.InferRequestedOutput("y", class_count=classes)])]
            for binary in (True, False):
                got.append(h.infer(model, [hi], outputs=[
                    httpclient.InferRequestedOutput("y", binary_data=binary, class_count=classes)]))
            return [(r.get_output("y").datatype if i == 0 else r.get_output("y")["datatype"], r.as_numpy("y"))
                    for i, r in enumerate(got)]
        finally:
            g.close()
            h.close()

    with _node_with_front_door(models=(TRI,), workers=(gpu_worker(triton),)) as fd:
        for classes in (5, 2000, 2**32 + 1):
            tri = both(triton.grpc_url, f"127.0.0.1:{triton.http_port}", "dense_amx", classes)
            ours = both(fd.grpc_url, fd.http_url, "tri", classes)
            for (tri_type, tri_y), (our_type, our_y) in zip(tri, ours):
                assert our_type == tri_type == "BYTES"
                np.testing.assert_array_equal(our_y, tri_y)
            assert tri[0][1].shape == (3, min(classes % 2**32, 1024))
        h = httpclient.InferenceServerClient(fd.http_url)
        hi = httpclient.InferInput("x", [3, 1024], "FP32")
        hi.set_data_from_numpy(x)
        plain = h.infer("tri", [hi], outputs=[httpclient.InferRequestedOutput("y", class_count=2**32)])
        assert plain.get_output("y")["datatype"] == "FP32"
        np.testing.assert_allclose(plain.as_numpy("y"), direct(triton, x), rtol=1e-4, atol=1e-5)


def test_two_executors_in_one_process_keep_their_regions_apart(triton):
    # Each load() clears the regions registered under its prefix (a killed predecessor's): with
    # one prefix per process the second executor took the first one's names, and the first read
    # zeros where its outputs should have been.
    a = TritonExecutor(triton.grpc_url, {"tri": "dense_amx"}, inflight=1, shm="system")
    b = TritonExecutor(triton.grpc_url, {"tri": "dense_amx"}, inflight=1, shm="system")
    try:
        a.load(TRI.spec())
        b.load(TRI.spec())
        x = np.random.default_rng(6).standard_normal((2, 1024)).astype(np.float32)
        want = direct(triton, x)
        for ex in (a, b, a):
            np.testing.assert_allclose(ex.run("tri", {"x": x})["y"], want, rtol=1e-4, atol=1e-5)
    finally:
        a.close()
        b.close()


RENAMED = ModelConfig(name="tri", factory="", max_batch=64, inputs=(TensorConfig("features", "float32", (1024,)),),
                      outputs=(TensorConfig("embedding", "float32", (1024,)),))


def test_spec_tensor_names_map_onto_tritons(start_node, triton):
    names = {"tri": {"features": "x", "embedding": "y"}}
    node = start_node([gpu_worker(triton, warmup=(1,), tensor_names=names)], models=(RENAMED,))
    x = np.random.default_rng(3).standard_normal((2, 1024)).astype(np.float32)
    with node.client() as c:
        r = c.infer("tri", {"features": x})
    np.testing.assert_allclose(r["embedding"], direct(triton, x), rtol=1e-4, atol=1e-5)


SCALAR = ModelConfig(name="sc", factory="", max_batch=64, inputs=(TensorConfig("x", "float32", ()),),
                     outputs=(TensorConfig("y", "float32", ()),))


@pytest.mark.parametrize("shm", ["auto", "none"])
def test_a_model_of_one_value_an_item_is_served_through_tritons_reshape(start_node, triton, shm):
    """Triton's batching models declare one value an item as dims [1] with reshape [] and take
    it only in dims' shape: the check refused such a model for a spec of shape (), so no Triton
    model could serve one."""
    worker = WorkerConfig(name="gpu0", kind="triton", models=("sc",), warmup_sizes=(1, 8),
                          triton=TritonConfig(url=triton.grpc_url, models={"sc": "scalar_item"}, shm=shm))
    node = start_node([worker], models=(SCALAR,))
    xs = [np.arange(n, dtype=np.float32) + n for n in (1, 3, 7, 1, 5)]
    with node.client() as c:
        res = [f.result() for f in [c.submit("sc", {"x": x}) for x in xs]]
    for x, r in zip(xs, res):
        assert r["y"].shape == x.shape
        np.testing.assert_array_equal(r["y"], 2 * x)
        assert r.timing.path == "gpu"


def test_large_batches_travel_by_shared_memory_not_grpc_bodies(start_node, triton):
    # The worker's gRPC channel refuses any message over 16 KiB; a 32-item batch is 128 KiB of
    # input and 128 KiB of output, so it can only go through if no tensor byte is in a body.
    node = start_node([gpu_worker(triton, max_grpc_message_bytes=16 << 10)], models=(TRI,))
    x = np.random.default_rng(1).standard_normal((32, 1024)).astype(np.float32)
    with node.client() as c:
        r = c.infer("tri", {"x": x})
    np.testing.assert_allclose(r["y"], direct(triton, x), rtol=1e-4, atol=1e-5)  # fp32; batch composition changes matmul blocking
    assert r.timing.batch_size == 32


def test_without_shm_the_same_limit_refuses_the_batch(start_node, triton):
    # (warm up at B=1 only: 4 KiB fits in a body, B=8 would not)
    node = start_node([gpu_worker(triton, warmup=(1,), max_grpc_message_bytes=16 << 10, shm="none")], models=(TRI,))
    with node.client() as c:
        with pytest.raises(Unavailable, match="larger than max|RESOURCE_EXHAUSTED|Received message larger"):
            c.infer("tri", {"x": np.zeros((32, 1024), np.float32)})


def test_triton_killed_mid_load_gives_explicit_errors_then_recovers(start_node):
    tl = TritonLocal(REPO, models=["dense_amx"]).start(ready_timeout_s=120)
    try:
        node = start_node([gpu_worker(tl)], models=(TRI,))
        x = np.ones((1, 1024), np.float32)
        with node.client() as c:
            c.infer("tri", {"x": x})
            load = [c.submit("tri", {"x": np.full((8, 1024), i, np.float32)}, timeout=10) for i in range(40)]
            tl.kill()  # mid-load: some batches are at Triton, some queued in the dispatcher
            outcomes = []
            for f in load:  # each one answered, with its result or an explicit UNAVAILABLE
                try:
                    f.result()
                    outcomes.append("ok")
                except Unavailable:
                    outcomes.append("unavailable")
            assert len(outcomes) == 40
            t0 = time.monotonic()
            with pytest.raises(Unavailable, match="Triton at"):
                c.infer("tri", {"x": x}, timeout=10)
            assert time.monotonic() - t0 < 10  # an explicit error, not a hang until the deadline
            tl2 = TritonLocal(REPO, grpc_port=tl.grpc_port, http_port=tl.http_port,
                              metrics_port=tl.metrics_port, models=["dense_amx"]).start(ready_timeout_s=120)
            try:
                deadline = time.monotonic() + 30
                while True:  # each attempt is answered at once; the worker's back-off is <= 5 s
                    try:
                        r = c.infer("tri", {"x": x}, timeout=10)
                        break
                    except Unavailable:
                        assert time.monotonic() < deadline, "the worker never reconnected"
                np.testing.assert_allclose(r["y"], direct(tl2, x), rtol=1e-4, atol=1e-5)  # fp32; batch composition changes matmul blocking
                node.stop()
                # The worker unregistered its regions on the way out; nothing stays registered.
                cl = grpcclient.InferenceServerClient(tl2.grpc_url)
                assert list(cl.get_system_shared_memory_status().regions) == []
                cl.close()
            finally:
                tl2.close()
    finally:
        tl.close()


def _regions(tl) -> set[str]:
    """The regions registered with Triton, of the kind these tests' workers use (shm = "auto")."""
    cl = grpcclient.InferenceServerClient(tl.grpc_url)
    try:
        if resolve_kind("auto", 0) == "cuda":
            return set(cl.get_cuda_shared_memory_status().regions)
        return set(cl.get_system_shared_memory_status().regions)
    finally:
        cl.close()


def test_a_restarted_worker_clears_what_its_killed_predecessor_registered(start_node, triton):
    before = _regions(triton)
    node = start_node([gpu_worker(triton, warmup=(1,))], models=(TRI,))
    prefix = f"batchyard-{zlib.crc32(node.cfg.dispatcher.backend.encode()):08x}-gpu0-"
    mine = {f"{prefix}{k}-{d}" for k in range(2) for d in ("in", "out")}  # inflight = 2 slots
    x = np.random.default_rng(2).standard_normal((3, 1024)).astype(np.float32)
    with node.client() as c:
        st = c.status()
        assert _regions(triton) - before == mine
        os.kill(next(w.pid for w in st.workers if w.name == "gpu0"), signal.SIGKILL)
        # Its regions stay registered in Triton; the restarted worker (same names) must clear
        # them first or its own registration is refused and it never comes back.
        c.status(min_registrations=st.registrations + 1, wait=60)
        np.testing.assert_allclose(c.infer("tri", {"x": x})["y"], direct(triton, x), rtol=1e-4, atol=1e-5)
        assert _regions(triton) - before == mine
    node.stop()
    assert _regions(triton) - before == set()


def _up_until_it_exits(run_dir, worker) -> tuple[int, str]:
    _, up = spawn_up(run_dir, [worker[0]], [worker[1]], stderr=subprocess.PIPE, text=True)
    try:
        _, err = up.communicate(timeout=120)  # start-up waits up to 300 s for workers: this is "at once"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    return up.returncode, err


MISNAMED = ModelConfig(name="tri", factory="", max_batch=64, inputs=TRI.inputs,
                       outputs=(TensorConfig("z", "float32", (1024,)),))


@pytest.mark.parametrize("case", ["cuda shm without a GPU", "model without the spec's tensor",
                                  "model Triton does not have"])
def test_a_worker_that_cannot_run_here_stops_up_at_once_with_the_reason(run_dir, triton, case):
    if case == "cuda shm without a GPU":
        if cuda_device_count() > 0:
            pytest.skip("this host has a GPU")
        worker, expect = (gpu_worker(triton, shm="cuda"), TRI), r"cuda-python|no GPU 0 is visible"
    elif case == "model Triton does not have":
        worker = (WorkerConfig(name="gpu0", kind="triton", models=("tri",),
                               triton=TritonConfig(url=triton.grpc_url, models={"tri": "nope"})), TRI)
        expect = r"Triton at \S+ has no model 'nope' \(for 'tri'\); it has dense_amx \(READY\)"
    else:
        worker, expect = (gpu_worker(triton), MISNAMED), r"lacks output 'z' of spec 'tri'"
    before = _regions(triton)
    rc, err = _up_until_it_exits(run_dir, worker)
    assert rc == 78  # EX_CONFIG, as the worker said: systemd does not restart it (RestartPreventExitStatus)
    assert "worker gpu0 cannot run on this host as configured during start-up" in err
    assert re.search(expect, err), err[-2000:]
    assert "Traceback" not in err
    assert _regions(triton) == before  # nothing left registered by the refused worker


def test_a_triton_that_stays_unreachable_at_start_is_retried_then_exits_69(run_dir):
    # 69 (EX_UNAVAILABLE), not 78: Triton may come back, so systemd and `up` may restart the worker.
    closed = f"127.0.0.1:{_closed_port()}"
    worker = WorkerConfig(name="gpu0", kind="triton", models=("tri",),
                          triton=TritonConfig(url=closed, models={"tri": "dense_amx"}, start_timeout_s=2.0))
    rc, err = _up_until_it_exits(run_dir, (worker, TRI))
    assert rc == 1
    assert "worker gpu0 exited with 69 during start-up" in err, err[-2000:]
    assert f"Triton at {closed} unreachable (attempt 2, UNAVAILABLE)" in err
    assert f"Triton at {closed} still unreachable after" in err
    assert "Traceback" not in err


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- shared-memory slots (finding 5a)
class _Answer:
    """An InferResult as the executor reads it with outputs in shared memory: what Triton says
    each output is (dense_amx's y, [n, 1024] FP32)."""

    def __init__(self, n: int):
        self.n = n

    def get_output(self, name):
        return types.SimpleNamespace(datatype="FP32", shape=[self.n, 1024])


class _ThreadedTriton:
    """A Triton client stand-in whose async_infer answers on another thread, as gRPC does."""

    def __init__(self, answer: bool = True):
        self.answer = answer
        self.pending: list = []
        self.threads: list[threading.Thread] = []

    def register_system_shared_memory(self, *a, **kw):
        pass

    unregister_system_shared_memory = register_system_shared_memory

    def async_infer(self, name, inputs, callback, outputs=None, client_timeout=None):
        if not self.answer:
            self.pending.append(callback)
            return
        t = threading.Thread(target=callback, args=(_Answer(inputs[0].shape()[0]), None))
        self.threads.append(t)
        t.start()

    def close(self):
        pass


def _fake_executor(client, inflight: int) -> TritonExecutor:
    ex = TritonExecutor("127.0.0.1:1", {"tri": "dense_amx"}, inflight=inflight, shm="system")
    ex.client, ex.specs["tri"] = client, TRI.spec()
    ex._make_slots(64 * 4096, 64 * 4096)
    return ex


def test_a_completion_returns_its_slot_before_it_reports_the_batch_done():
    # As the worker runtime does: each completion lets the dispatcher send the next batch, which
    # may reach submit() before the gRPC thread that reported it runs another line.
    client, chain = _ThreadedTriton(), 50
    ex = _fake_executor(client, inflight=1)
    seen, finished = [], threading.Event()

    def done(outcome, us):
        seen.append((outcome, len(ex._free)))
        if len(seen) < chain:
            ex.submit("tri", {"x": np.ones((64, 1024), np.float32)}, done)  # the next batch, at once
        else:
            finished.set()

    try:
        ex.submit("tri", {"x": np.ones((64, 1024), np.float32)}, done)
        assert finished.wait(30)
        for t in list(client.threads):
            t.join()
        assert all(isinstance(o, dict) for o, _ in seen), [o for o, _ in seen if not isinstance(o, dict)][:1]
        assert [free for _, free in seen] == [1] * chain  # the reporting batch's slot was back already
    finally:
        ex.close()


def test_more_batches_than_slots_fail_that_batch_unavailable_not_the_worker():
    client = _ThreadedTriton(answer=False)
    ex = _fake_executor(client, inflight=1)
    outcomes = []
    try:
        ex.submit("tri", {"x": np.ones((2, 1024), np.float32)}, lambda o, us: outcomes.append(o))
        ex.submit("tri", {"x": np.ones((2, 1024), np.float32)}, lambda o, us: outcomes.append(o))  # no raise
        assert len(outcomes) == 1 and isinstance(outcomes[0], ExecutorUnavailable)
        assert "shared-memory slots of this worker are in use" in str(outcomes[0])
        client.pending[0](_Answer(2), None)
        assert isinstance(outcomes[1], dict) and len(ex._free) == 1
    finally:
        ex.close()


class _TritonThatHoldsOn:
    """A Triton client stand-in whose every batch runs until the test ends it, as in a slow model:
    Triton holds the batch's regions until then (it refuses to unregister them, as 2.51 does), and
    ending the batch writes its output, y = 2x, into its output region, whether or not the
    client's call timed out meanwhile."""

    def __init__(self):
        self.segments: dict[str, mmap.mmap] = {}  # region -> the shared memory it was registered with
        self.in_use: collections.Counter = collections.Counter()
        self.batches: list[dict] = []

    def register_system_shared_memory(self, name, key, byte_size, client_timeout=None):
        with open(f"/dev/shm{key}", "r+b") as f:
            self.segments[name] = mmap.mmap(f.fileno(), byte_size)

    def unregister_system_shared_memory(self, name, client_timeout=None):
        from tritonclient.utils import InferenceServerException

        if self.in_use[name]:
            raise InferenceServerException(f"Cannot unregister shared memory region '{name}', it is currently "
                                           f"in use.", status="StatusCode.INTERNAL")
        if name in self.segments:
            self.segments.pop(name).close()

    def get_system_shared_memory_status(self, client_timeout=None):
        return types.SimpleNamespace(regions={name: None for name in self.segments})

    def async_infer(self, name, inputs, callback, outputs=None, client_timeout=None):
        def where(tensor):
            p = tensor._get_tensor().parameters
            return (p["shared_memory_region"].string_param, p["shared_memory_offset"].int64_param,
                    p["shared_memory_byte_size"].int64_param)

        b = {"callback": callback, "n": inputs[0].shape()[0], "in": where(inputs[0]), "out": where(outputs[0])}
        self.in_use.update([b["in"][0], b["out"][0]])
        self.batches.append(b)

    def compute(self, i: int) -> None:
        """Batch ``i`` writes its output (its regions still held)."""
        b = self.batches[i]
        (region, offset, size), (out, out_offset, _) = b["in"], b["out"]
        x = np.frombuffer(self.segments[region], np.float32, size // 4, offset)
        np.frombuffer(self.segments[out], np.float32, size // 4, out_offset)[:] = 2 * x

    def release(self, i: int) -> None:
        b = self.batches[i]
        self.in_use.subtract([b["in"][0], b["out"][0]])

    def close(self):
        pass


def _executor_on(triton) -> TritonExecutor:
    """A Triton executor of 2 slots whose client is ``triton`` (a stand-in), connected."""
    ex = TritonExecutor("127.0.0.1:1", {"tri": "dense_amx"}, inflight=2, shm="system", backoff_s=(0.0, 0.0))
    ex.grpc = types.SimpleNamespace(InferenceServerClient=lambda *a, **kw: triton, InferInput=grpcclient.InferInput,
                                    InferRequestedOutput=grpcclient.InferRequestedOutput)
    ex._connect()
    ex.specs["tri"] = TRI.spec()
    ex._make_slots(64 * 4096, 64 * 4096)
    return ex


def test_a_batch_past_its_timeout_in_triton_fails_alone_and_its_late_output_lands_in_no_other_batch(monkeypatch):
    # A batch still running in Triton past the executor's timeout: the reconnect after it tried to
    # unregister and register again every region, Triton refused ("in use") and every batch failed
    # UNAVAILABLE until that batch ended (for good with a hung model). And its slot must stay out of
    # use until then: Triton writes the late output into it when the batch ends.
    from batchyard.workers import triton_executor
    from tritonclient.utils import InferenceServerException

    monkeypatch.setattr(triton_executor, "HELD_PROBE_S", 0.0)  # a held slot is asked back at each batch
    triton = _TritonThatHoldsOn()
    ex = _executor_on(triton)
    outcomes: dict[str, object] = {}

    def submit(key: str, value: float) -> None:
        ex.submit("tri", {"x": np.full((2, 1024), value, np.float32)}, lambda o, us: outcomes.__setitem__(key, o))

    def answer(i: int) -> None:
        triton.release(i)
        triton.batches[i]["callback"](_Answer(triton.batches[i]["n"]), None)

    try:
        submit("slow", 7.0)
        triton.batches[0]["callback"](None, InferenceServerException("Deadline Exceeded",
                                                                      status="StatusCode.DEADLINE_EXCEEDED"))
        assert isinstance(outcomes["slow"], ExecutorUnavailable)
        submit("next", 1.0)  # after the back-off (none here): a fresh channel
        assert "next" not in outcomes, outcomes.get("next")  # at Triton, not failed at once
        # The timed-out batch's slot is not handed out: the third batch waits for the slot of the
        # one running (it failed UNAVAILABLE, and the dispatcher's breaker took the worker out).
        waiting = _watch_slot_waits(ex)
        third = threading.Thread(target=submit, args=("third", 2.0))
        third.start()
        assert waiting.wait(30)  # for a slot
        triton.compute(1)
        triton.compute(0)  # the slow batch ends in Triton: its output lands in its own slot
        answer(1)
        third.join(30)
        assert outcomes["next"]["y"].tolist() == np.full((2, 1024), 2.0).tolist()
        assert len(triton.batches) == 3 and "third" not in outcomes  # at Triton, in the next one's slot
        triton.compute(2)
        answer(2)
        assert outcomes["third"]["y"].tolist() == np.full((2, 1024), 4.0).tolist()
        triton.release(0)  # Triton lets go of the slow batch's slot: both slots serve again
        submit("a", 3.0)
        submit("b", 4.0)
        assert len(triton.batches) == 5  # both slots in use again
        for i in (3, 4):
            triton.compute(i)
            answer(i)
        assert outcomes["a"]["y"].tolist() == np.full((2, 1024), 6.0).tolist()
        assert outcomes["b"]["y"].tolist() == np.full((2, 1024), 8.0).tolist()
    finally:
        ex.close()


def _watch_slot_waits(ex: TritonExecutor, slices: int = 1) -> threading.Event:
    """Set once a batch has waited ``slices`` times for a slot in ``ex``."""
    waiting, waits = threading.Event(), []

    class Watched(threading.Condition):
        def wait(self, timeout=None):
            waits.append(timeout)
            if len(waits) >= slices:
                waiting.set()
            return super().wait(timeout)

    ex._slot_back = Watched(ex._lock)
    return waiting


def test_a_batch_waits_for_a_running_ones_slot_past_many_slices(monkeypatch):
    # A wait capped at 1 s failed the batch behind a healthy batch of 1.5 s (UNAVAILABLE, and the
    # breaker took the worker out); it lasts to the running call's timeout. 200 slices of 1 ms
    # here stand for the seconds a long batch takes.
    from tritonclient.utils import InferenceServerException

    from batchyard.workers import triton_executor

    monkeypatch.setattr(triton_executor, "SLOT_WAIT_SLICE_S", 0.001)
    triton = _TritonThatHoldsOn()
    ex = _executor_on(triton)
    outcomes: dict[str, object] = {}

    def submit(key: str, value: float) -> None:
        ex.submit("tri", {"x": np.full((2, 1024), value, np.float32)}, lambda o, us: outcomes.__setitem__(key, o))

    try:
        submit("slow", 7.0)
        triton.batches[0]["callback"](None, InferenceServerException("Deadline Exceeded",
                                                                      status="StatusCode.DEADLINE_EXCEEDED"))
        submit("long", 1.0)
        waited = _watch_slot_waits(ex, slices=200)
        third = threading.Thread(target=submit, args=("third", 2.0))
        third.start()
        assert waited.wait(30), outcomes.get("third")  # still waiting after 200 slices
        triton.compute(1)
        triton.release(1)
        triton.batches[1]["callback"](_Answer(triton.batches[1]["n"]), None)
        third.join(30)
        assert len(triton.batches) == 3 and "third" not in outcomes, outcomes.get("third")  # at Triton
    finally:
        ex.close()


def test_a_batch_waiting_for_a_running_ones_slot_stops_waiting_when_the_worker_stops():
    # The wait runs on the worker's main thread: until the running call's timeout (30 s) a SIGTERM
    # meanwhile ended in the stop grace's hard exit, with no leaving and no goodbye.
    import time as clock

    from tritonclient.utils import InferenceServerException

    triton = _TritonThatHoldsOn()
    ex = _executor_on(triton)
    outcomes: dict[str, object] = {}
    stop = threading.Event()
    ex.stopping = stop.is_set

    def submit(key: str) -> None:
        ex.submit("tri", {"x": np.ones((2, 1024), np.float32)}, lambda o, us: outcomes.__setitem__(key, o))

    try:
        submit("slow")
        triton.batches[0]["callback"](None, InferenceServerException("Deadline Exceeded",
                                                                      status="StatusCode.DEADLINE_EXCEEDED"))
        submit("running")  # never answered
        waiting = _watch_slot_waits(ex)
        third = threading.Thread(target=submit, args=("third",))
        third.start()
        assert waiting.wait(30)  # it waits for a slot ...
        t0 = clock.monotonic()
        stop.set()  # ... until the worker is told to stop
        third.join(30)
        assert clock.monotonic() - t0 < 10.0  # ex.timeout_s is 30 s
        assert "held for batches Triton has not ended" in str(outcomes["third"])
    finally:
        ex.close()


def test_the_worker_runtime_tells_its_executor_when_it_stops(run_dir, monkeypatch):
    # What ends the wait above, in a worker: its stop (SIGTERM's handler, request_stop).
    from batchyard.workers import runtime

    monkeypatch.setattr(runtime, "exit_after_grace", lambda: None)  # no hard exit of the test process
    _, router, rt = _gpu0_beside_a_fake_dispatcher(run_dir)
    try:
        assert not rt.executor.stopping()
        rt.request_stop()
        assert rt.executor.stopping()
    finally:
        router.close()
        rt.executor.close()
        os.close(rt._wake_r)
        os.close(rt._wake_w)


def _gpu0_beside_a_fake_dispatcher(run_dir):
    """A Triton worker runtime "gpu0" of 2 slots on a stand-in client that holds every batch until
    the test answers it, and the ROUTER a test plays the dispatcher on: (client, router, runtime)."""
    import zmq

    from batchyard.workers import runtime

    client = _ThreadedTriton(answer=False)
    backend = f"ipc://{run_dir}/be"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(backend)
    rt = runtime.WorkerRuntime("gpu0", backend, _fake_executor(client, inflight=2), {"tri": TRI.spec()},
                               heartbeat_interval_s=0.1, max_inflight=2)
    return client, router, rt


def _to_gpu0(router, msg, *frames) -> None:
    """A fake dispatcher's message to worker gpu0."""
    from batchyard import protocol as P

    router.send_multipart([b"gpu0", P.encode(msg), *frames])


def _batch_to_gpu0(router, batch_id: int, model: str = "tri") -> None:
    """A batch of one [1, 1024] request of ones to worker gpu0."""
    from batchyard import protocol as P

    head = P.encode(P.InferRequest(v=P.PROTOCOL_VERSION, id=batch_id, model=model, inputs=[
        P.TensorRef(name="x", dtype="float32", shape=[1, 1024], frame=0)]))
    _to_gpu0(router, P.Batch(batch_id=batch_id, model=model, seqs=[0], n_frames=[1]), head,
             np.ones((1, 1024), np.float32).tobytes())


def test_a_worker_asked_to_register_again_registers_once_the_batches_at_triton_are_done(run_dir, monkeypatch):
    # A dispatcher restarted while both slots of a Triton worker held batches: the worker registered
    # again at once with its whole capacity, and the new dispatcher's batches failed UNAVAILABLE
    # "all 2 shared-memory slots of this worker are in use" (its breaker took the healthy worker out
    # of rotation), though the slots freed seconds later. The test plays both dispatchers.
    from batchyard import protocol as P
    from batchyard.workers import runtime

    monkeypatch.setattr(runtime, "exit_after_grace", lambda: None)  # no hard exit of the test process
    client, router, rt = _gpu0_beside_a_fake_dispatcher(run_dir)  # the client holds every batch until answered
    statuses: dict[int, int] = {}

    def recv():
        return worker_message(router, b"gpu0")

    def send(msg, *frames):
        _to_gpu0(router, msg, *frames)

    def batch(batch_id: int, model: str = "tri"):
        _batch_to_gpu0(router, batch_id, model)

    def answer(m):
        """The new dispatcher: it sends a batch for each slot of a worker once it registers."""
        if type(m) is P.Register:
            send(P.Registered(worker="gpu0"))
            batch(3)
            batch(4)
        elif type(m) is P.BatchDone:
            statuses[m.batch_id] = m.results[0].status

    def dispatchers():
        try:
            assert type(recv()) is P.Register
            send(P.Registered(worker="gpu0"))
            batch(1)
            batch(2)
            deadline = time.monotonic() + 30
            while len(client.pending) < 2:  # both slots hold a batch at Triton
                assert time.monotonic() < deadline
            send(P.Reregister(worker="gpu0"))  # from a new dispatcher, which knows of neither batch
            # Answered at once (no such model), after the worker has chosen whether to register.
            batch(99, model="nope")
            while 99 not in statuses:
                answer(recv())
            client.answer = True
            for old in list(client.pending):  # the old batches end at Triton
                old(_Answer(1), None)
            while not {3, 4} <= statuses.keys():
                answer(recv())
        finally:
            rt.request_stop()
            os.write(rt._wake_w, b"x")
            while type(m := recv()) is not P.Goodbye:
                if type(m) is P.Leaving:
                    send(P.LeavingNoted(worker="gpu0"))

    try:
        assert serve_beside(rt, dispatchers, router) == 0
    finally:
        for th in client.threads:
            th.join()
    assert (statuses[3], statuses[4]) == (P.Status.OK, P.Status.OK), statuses


def test_a_worker_stopped_while_it_holds_its_registration_back_still_says_leaving_and_goodbye(run_dir, monkeypatch):
    # A `reregister` that answers a heartbeat sent before the registration reaches a worker the
    # dispatcher knows, while Triton holds its batches: the worker holds its registration back
    # for them. Stopped then, it told the dispatcher nothing (leaving and goodbye waited on the
    # registration), which kept it in rotation until worker_dead_after_s.
    from batchyard import protocol as P
    from batchyard.workers import runtime

    monkeypatch.setattr(runtime, "exit_after_grace", lambda: None)  # no hard exit of the test process
    client, router, rt = _gpu0_beside_a_fake_dispatcher(run_dir)  # the client holds every batch until answered
    after_stop: list[str] = []

    def send(msg, *frames):
        _to_gpu0(router, msg, *frames)

    def batch(batch_id: int, model: str = "tri"):
        _batch_to_gpu0(router, batch_id, model)

    def dispatcher():
        try:
            assert type(worker_message(router, b"gpu0")) is P.Register
            send(P.Registered(worker="gpu0"))
            batch(1)
            batch(2)
            deadline = time.monotonic() + 30
            while len(client.pending) < 2:
                assert time.monotonic() < deadline
            send(P.Reregister(worker="gpu0"))  # stale: this dispatcher knows the worker
            batch(99, model="nope")  # answered at once, after the worker has read the reregister
            while not (type(m := worker_message(router, b"gpu0")) is P.BatchDone and m.batch_id == 99):
                pass
        finally:
            rt.request_stop()
            os.write(rt._wake_w, b"x")
        while type(m := worker_message(router, b"gpu0")) is not P.Goodbye:
            after_stop.append(type(m).__name__)
            if type(m) is P.Leaving:
                send(P.LeavingNoted(worker="gpu0"))
                client.answer = True
                for old in list(client.pending):  # the batches at Triton end
                    old(_Answer(1), None)
        after_stop.append("Goodbye")

    try:
        assert serve_beside(rt, dispatcher, router) == 0
    finally:
        for th in client.threads:
            th.join()
    assert after_stop[0] == "Leaving" and after_stop[-1] == "Goodbye", after_stop
    assert after_stop.count("BatchDone") == 2, after_stop  # both batches answered before the goodbye


def test_sustained_max_size_batches_never_restart_the_worker(start_node, triton):
    """Max-size batches back to back, two in flight, fill both of the worker's Triton slots. Each
    request is a max batch itself: built of 16-item requests, whether a batch reached 64 items
    depended on the load beside the test (the queue at each free slot, the learned cost-aware
    cap), and one run of the suite beside other tests had none above 48."""
    node = start_node([gpu_worker(triton, warmup=(1, 64), inflight=2)], models=(TRI,))
    x = np.random.default_rng(4).standard_normal((64, 1024)).astype(np.float32)
    with node.client() as c:
        st = c.status()
        pid = next(w.pid for w in st.workers if w.name == "gpu0")
        futs = [c.submit("tri", {"x": x}, timeout=120) for _ in range(150)]
        res = [f.result() for f in futs]  # every one OK: an UNAVAILABLE or a lost worker raises here
        after = c.status()
    assert {r.timing.batch_size for r in res} == {64}
    assert next(w.pid for w in after.workers if w.name == "gpu0") == pid
    assert after.registrations == st.registrations
    np.testing.assert_allclose(res[-1]["y"], direct(triton, x), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- outages (5b, 5e)
def _restart(tl: TritonLocal) -> TritonLocal:
    """A new tritonserver on the same ports. Under heavy load tritonserver 2.51 has aborted at
    start (SIGABRT, "epoll_wait error: Bad file descriptor" in its gRPC event engine); that is
    Triton's start, not what these tests are about, so one more try is allowed."""
    for attempt in (1, 2):
        t = TritonLocal(REPO, grpc_port=tl.grpc_port, http_port=tl.http_port, metrics_port=tl.metrics_port,
                        models=["dense_amx"])
        try:
            return t.start(ready_timeout_s=120)
        except ServerExited:
            t.close()
            if attempt == 2:
                raise


@pytest.mark.parametrize("calls_in_the_outage", [3, 0])
def test_the_first_call_after_triton_is_back_succeeds(calls_in_the_outage):
    # No back-off of the executor's own here: what is measured is gRPC's reconnect back-off,
    # which kept the old channel refusing calls for 3-11 s after Triton was ready again. With no
    # call in the outage, gRPC reconnected by itself and the new Triton knew none of the
    # worker's regions: every batch failed "Unable to find shared memory region", taken as
    # the model's error, for good. Now the first call finds Triton down and the next one works.
    tl = TritonLocal(REPO, models=["dense_amx"]).start(ready_timeout_s=120)
    tl2 = None
    ex = TritonExecutor(tl.grpc_url, {"tri": "dense_amx"}, shm="system", backoff_s=(0.0, 0.0))
    try:
        ex.load(TRI.spec())
        x = np.ones((2, 1024), np.float32)
        ex.run("tri", {"x": x})
        tl.kill()
        for _ in range(calls_in_the_outage):  # the outage as a worker sees it: each call fails at once
            with pytest.raises(ExecutorUnavailable, match="Triton at"):
                ex.run("tri", {"x": x})
        tl2 = _restart(tl)
        # (with none, this call found its regions unknown to the new Triton: it registers them
        # again and sends the batch once more; it failed UNAVAILABLE)
        np.testing.assert_allclose(ex.run("tri", {"x": x})["y"], direct(tl2, x), rtol=1e-4, atol=1e-5)
    finally:
        ex.close()
        if tl2 is not None:
            tl2.close()
        tl.close()


def test_the_first_batch_after_triton_restarted_while_the_worker_was_idle_is_served(start_node):
    """The new Triton knows none of the worker's regions and refuses the batch before running it:
    the worker registers them again and sends it once more. It failed UNAVAILABLE, every batch of
    a burst with it (an outside review: 50 of 50), with no other worker to take them."""
    tl = TritonLocal(REPO, models=["dense_amx"]).start(ready_timeout_s=120)
    tl2 = None
    try:
        node = start_node([gpu_worker(tl)], models=(TRI,))
        with node.client() as c:
            c.infer("tri", {"x": np.ones((1, 1024), np.float32)})
            tl.kill()
            tl2 = _restart(tl)
            xs = [np.full((1 + i % 3, 1024), i, np.float32) for i in range(12)]
            burst = [c.submit("tri", {"x": x}, timeout=60) for x in xs]
            for x, f in zip(xs, burst):
                np.testing.assert_allclose(f.result()["y"], direct(tl2, x), rtol=1e-4, atol=1e-5)
    finally:
        if tl2 is not None:
            tl2.close()
        tl.close()


def test_during_a_triton_outage_requests_go_to_the_cpu_worker_and_the_gpu_comes_back(start_node):
    tl = TritonLocal(REPO, models=["dense_amx"]).start(ready_timeout_s=120)
    tl2 = None
    try:
        cpu = sim_worker("cpu0", models=("tri",), launch_us=20000, per_item_us=500)  # slower than Triton
        node = start_node([gpu_worker(tl), cpu], models=(TRI,), breaker_backoff_max_s=2.0)
        with node.client() as c:
            def wave():  # every request answered OK: an UNAVAILABLE raises here
                futs = [c.submit("tri", {"x": np.full((8, 1024), i, np.float32)}, timeout=30) for i in range(40)]
                return [f.result().timing.worker for f in futs]

            assert "gpu0" in wave()
            tl.kill()
            during = [w for _ in range(5) for w in wave()]
            assert set(during[-40:]) == {"cpu0"}
            tl2 = _restart(tl)
            deadline = time.monotonic() + 60  # breaker (<= 2 s) + the worker's back-off (<= 5 s)
            while "gpu0" not in wave():
                assert time.monotonic() < deadline, "the GPU worker never came back into rotation"
    finally:
        if tl2 is not None:
            tl2.close()
        tl.close()


# ---------------------------------------------------------------- `batchyard triton-local` (5c)
def _triton_local_cmd(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "dense_amx").symlink_to(REPO / "dense_amx")
    ports = [str(_free_port()) for _ in range(3)]
    return [sys.executable, "-m", "batchyard.cli", "triton-local", "--model-repository", str(repo),
            "--grpc-port", ports[0], "--http-port", ports[1], "--metrics-port", ports[2]]


def _wait_line(stream, pattern: str) -> re.Match:
    for line in stream:  # a process that never writes it is caught by the suite's timeout
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r} before the stream closed")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture
def triton_local_proc(tmp_path):
    procs = []

    def spawn():
        p = subprocess.Popen(_triton_local_cmd(tmp_path), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, bufsize=1)
        procs.append(p)
        return p

    yield spawn
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(60)
        p.stdout.close()
        p.stderr.close()


def test_triton_local_exits_with_its_crashed_server_and_leaves_nothing_of_it(triton_local_proc):
    other = f"/dev/shm/triton_python_backend_shm_region_other-{os.getpid()}"  # another Triton's region
    proc = triton_local_proc()
    server = int(_wait_line(proc.stderr, r"tritonserver pid (\d+) starting").group(1))
    _wait_line(proc.stdout, r"tritonserver ready")
    ours = [n for n in os.listdir("/dev/shm") if n.startswith(f"by_triton_{proc.pid}_")]
    assert ours  # the python backend's region, under this instance's prefix
    open(other, "wb").close()
    try:
        os.kill(server, signal.SIGKILL)  # a crash of the server alone
        assert proc.wait(timeout=60) == 128 + signal.SIGKILL
        assert not _group_alive(server)  # no python-backend stub left behind
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"by_triton_{proc.pid}_")]
        assert os.path.exists(other)
    finally:
        os.unlink(other)


def test_sigterm_during_start_up_stops_the_server(triton_local_proc):
    proc = triton_local_proc()
    server = int(_wait_line(proc.stderr, r"tritonserver pid (\d+) starting").group(1))
    proc.send_signal(signal.SIGTERM)  # model loading takes seconds: the server is not ready yet
    assert proc.wait(timeout=60) == 0
    assert not _group_alive(server)


def test_no_tensor_byte_lands_in_the_first_bytes_of_a_region():
    """A client proves a segment is its own by writing the dispatcher's challenge at offset 0
    (shm_grants): a tensor copied to offset 0 of the worker's region (or an output there) made
    that proof for the worker's region, for any client whose tensor it was."""
    from batchyard.workers.triton_executor import REGION_GUARD

    ex = _fake_executor(_ThreadedTriton(answer=False), inflight=1)
    try:
        slot = ex._free[0]
        _, inputs, outputs, layout, _ = ex._prepare("tri", {"x": np.full((64, 1024), 7.0, np.float32)}, slot)
        assert bytes(slot.inp.seg.mm[:REGION_GUARD]) == bytes(REGION_GUARD)
        assert np.frombuffer(slot.inp.seg.mm, np.float32, 4, REGION_GUARD).tolist() == [7.0] * 4
        assert min(off for _, _, off, _ in layout) >= REGION_GUARD
    finally:
        ex.close()


@pytest.mark.parametrize("shm", ["system", "none"])
def test_a_batch_triton_fails_fails_alone_and_a_short_output_is_never_read_as_whole(triton, shm):
    # Every error of Triton's counted as an outage: one bad input took the worker out of rotation
    # for its back-off, failing the good batches after it UNAVAILABLE. And an output shorter
    # than the spec, read from shared memory, came back OK with the previous batch's bytes.
    spec = ModelConfig(name="m", factory="", max_batch=8, inputs=(TensorConfig("x", "float32", (16,)),),
                       outputs=(TensorConfig("y", "float32", (16,)),)).spec()
    ex = TritonExecutor(triton.grpc_url, {"m": "misbehaving"}, inflight=2, shm=shm)
    try:
        ex.load(spec)
        good = np.arange(32, dtype=np.float32).reshape(2, 16)
        np.testing.assert_array_equal(ex.run("m", {"x": good})["y"], good * 2)
        with pytest.raises(RuntimeError, match="negative input") as e:
            ex.run("m", {"x": -np.ones((2, 16), np.float32)})
        assert not isinstance(e.value, ExecutorUnavailable)
        np.testing.assert_array_equal(ex.run("m", {"x": good + 1})["y"], (good + 1) * 2)
        short = np.full((2, 16), 999.0, np.float32)
        with pytest.raises(RuntimeError, match=r"'y' is FP32 \[2, 8\]; the spec says FP32 \[2, 16\]"):
            ex.run("m", {"x": short})
        # A model that raises: the exception's text reaches the client, its stack (the server's
        # file paths and lines, which Triton appends after "At:") does not.
        with pytest.raises(RuntimeError, match="ValueError: seven hundred and seventy-seven") as e:
            ex.run("m", {"x": np.full((2, 16), 777.0, np.float32)})
        assert "model.py" not in str(e.value) and "At:" not in str(e.value), str(e.value)
        np.testing.assert_array_equal(ex.run("m", {"x": good})["y"], good * 2)
    finally:
        ex.close()


SMALL = ModelConfig(name="m", factory="", max_batch=8, inputs=(TensorConfig("x", "float32", (16,)),),
                    outputs=(TensorConfig("y", "float32", (16,)),))


def misbehaving_worker(tl, **kw):
    return WorkerConfig(name="gpu0", kind="triton", models=("m",), warmup_sizes=(1,),
                        triton=TritonConfig(url=tl.grpc_url, models={"m": "misbehaving"}, **kw))


def test_while_triton_reloads_a_model_its_requests_go_to_another_worker(start_node, triton):
    # Triton answers NOT_FOUND ("has no available versions") for a model it is unloading or
    # reloading: taken as the model's error, those requests failed INTERNAL, never retried on
    # the CPU worker serving the same model.
    cpu = sim_worker("cpu0", models=("m",), launch_us=20000, per_item_us=500)  # slower than Triton
    node = start_node([misbehaving_worker(triton), cpu], models=(SMALL,), breaker_backoff_max_s=1.0)
    ctl = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        with node.client() as c:
            def wave():  # every request answered OK: an INTERNAL raises here
                futs = [c.submit("m", {"x": np.full((2, 16), i, np.float32)}, timeout=30) for i in range(20)]
                return {f.result().timing.worker for f in futs}

            assert "gpu0" in wave()
            ctl.unload_model("misbehaving")
            while ctl.is_model_ready("misbehaving"):  # unloading ends on Triton's own threads
                pass
            try:
                assert wave() == {"cpu0"}
            finally:
                ctl.load_model("misbehaving")
            deadline = time.monotonic() + 30  # the breaker's back-off (<= 1 s) only: Triton was never down
            while "gpu0" not in wave():
                assert time.monotonic() < deadline, "the GPU worker never came back into rotation"
    finally:
        ctl.close()


def test_one_request_triton_refuses_fails_alone_not_the_requests_batched_with_it(start_node, triton):
    # The dispatcher's own time window (4 items, or 1 s after the oldest) puts the four in one batch.
    node = start_node([misbehaving_worker(triton)], models=(SMALL,), policy="window:1000000,4")
    xs = [np.full((1, 16), i + 1, np.float32) for i in range(4)]
    xs[2] = -xs[2]  # misbehaving refuses a negative input
    with node.client() as c:
        futs = [c.submit("m", {"x": x}, timeout=30) for x in xs]
        with pytest.raises(InvalidArgument, match="negative input"):
            futs[2].result()
        for i in (0, 1, 3):
            r = futs[i].result()
            np.testing.assert_array_equal(r["y"], xs[i] * 2)
            assert r.timing.batch_size == 4


OTHER_DTYPE_MODEL = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):  # y = 2x, as float64 when x starts with 64, as int32 with 32
        out = []
        for req in requests:
            x = pb_utils.get_input_tensor_by_name(req, "x").as_numpy()
            y = (x * 2).astype({64: np.float64, 32: np.int32}.get(int(x[0, 0]), np.float32))
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", y)]))
        return out
"""
OTHER_DTYPE_CONFIG = """name: "other_dtype"
backend: "python"
max_batch_size: 8
input [ { name: "x", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "y", data_type: TYPE_FP32, dims: [ 16 ] } ]
instance_group [ { kind: KIND_CPU, count: 1 } ]
"""


@pytest.fixture(scope="module")
def other_dtype(triton):
    """A model of the shared Triton whose output is not always the FP32 its config says."""
    model = triton.repo / "other_dtype"
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "1" / "model.py").write_text(OTHER_DTYPE_MODEL)
    (model / "config.pbtxt").write_text(OTHER_DTYPE_CONFIG)
    ctl = grpcclient.InferenceServerClient(triton.grpc_url)
    ctl.load_model("other_dtype")
    yield "other_dtype"
    ctl.unload_model("other_dtype")
    ctl.close()


@pytest.mark.parametrize("shm", ["system", "none"])
def test_an_output_of_another_type_than_the_spec_fails_the_batch(triton, other_dtype, shm):
    # Without shared memory, such an output was cast to the spec's type and returned OK.
    ex = TritonExecutor(triton.grpc_url, {"m": other_dtype}, inflight=1, shm=shm)
    try:
        ex.load(SMALL.spec())
        x = np.full((2, 16), 0.5, np.float32)
        np.testing.assert_array_equal(ex.run("m", {"x": x})["y"], x * 2)
        for first, told in ((64, "FP64"), (32, "INT32")):
            x[0, 0] = first
            # (In shared memory, Triton refuses the larger FP64 itself: "... for output 'y' (128 bytes)
            # should be at least 256 bytes".)
            unlike_the_spec = rf"output 'y' (is {told} \[2, 16\]; the spec says FP32|\(128 bytes)"
            with pytest.raises(RuntimeError, match=unlike_the_spec):
                ex.run("m", {"x": x})
    finally:
        ex.close()


# ---------------------------------------------------------------- a model Triton is (re)loading
GATED_MODEL = """import os
import select

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):  # loading lasts until the test opens the gate (60 s at most)
        # The gate is a FIFO: readable once the test has written to it (no writer yet: select
        # waits), whether that came before this opened it or after.
        gate = os.open(os.path.join(os.path.dirname(__file__), "gate"), os.O_RDONLY | os.O_NONBLOCK)
        select.select([gate], [], [], 60)
        os.close(gate)

    def execute(self, requests):
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
            "y", (pb_utils.get_input_tensor_by_name(r, "x").as_numpy() * 2).astype(np.float32))]) for r in requests]
"""


@pytest.fixture
def gated(triton):
    """A model in the shared Triton's repository, not loaded; its load lasts until ``release()``."""
    model = triton.repo / "gated"
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "1" / "model.py").write_text(GATED_MODEL)
    (model / "config.pbtxt").write_text(OTHER_DTYPE_CONFIG.replace('"other_dtype"', '"gated"'))
    gate = model / "1" / "gate"
    gate.unlink(missing_ok=True)
    os.mkfifo(gate)
    opened: list[int] = []

    def release() -> None:
        # Read and write, so it never waits for a reader; the byte stays in the FIFO, for a load
        # that opens it later too, while this end is open (to the fixture's end).
        if not opened:
            opened.append(os.open(gate, os.O_RDWR))
            os.write(opened[0], b"go")

    loads: list[threading.Thread] = []
    yield types.SimpleNamespace(name="gated", release=release, loads=loads)
    release()  # a load still waiting ends now
    try:
        for t in loads:
            t.join(60)
        ctl = grpcclient.InferenceServerClient(triton.grpc_url)
        try:
            ctl.unload_model("gated")
        finally:
            ctl.close()
        t0 = time.monotonic()
        while "UNLOADING" in _states(triton, "gated"):  # the next test sees it not loaded
            assert time.monotonic() - t0 < 60
    finally:
        os.close(opened[0])


def _states(tl, name: str) -> list[str]:
    ctl = grpcclient.InferenceServerClient(tl.grpc_url)
    try:
        return [m.state for m in ctl.get_model_repository_index().models if m.name == name]
    finally:
        ctl.close()


def test_a_worker_started_while_triton_loads_its_model_waits_for_it(triton, gated, caplog):
    # It exited 78 ("has no model 'gated'; it has gated (LOADING)"), a configuration error that
    # neither `up` nor systemd restarts: the node lost its GPU worker for good once the model was READY.
    def load():
        c = grpcclient.InferenceServerClient(triton.grpc_url)
        try:
            c.load_model(gated.name)
        finally:
            c.close()

    gated.loads.append(threading.Thread(target=load))
    gated.loads[0].start()
    while _states(triton, gated.name) != ["LOADING"]:
        assert gated.loads[0].is_alive(), "the model loaded without waiting for its gate"
    ex = TritonExecutor(triton.grpc_url, {"m": gated.name}, inflight=1, shm="system", start_timeout_s=60)
    outcome: list = []

    def start():
        try:
            ex.load(SMALL.spec())
            outcome.append("loaded")
        except BaseException as e:  # noqa: BLE001 -- what the worker would exit with
            outcome.append(e)

    starting = threading.Thread(target=start)
    starting.start()
    try:
        while starting.is_alive() and "not ready (attempt 1, LOADING)" not in caplog.text:
            pass
        gated.release()  # the load ends: the model is READY
        starting.join(60)
        assert outcome == ["loaded"], outcome
        x = np.full((2, 16), 3.0, np.float32)
        np.testing.assert_array_equal(ex.run("m", {"x": x})["y"], x * 2)
    finally:
        gated.release()
        starting.join(60)
        ex.close()


def test_a_model_triton_lists_but_never_loads_is_retried_then_unavailable_not_a_config_error(triton, gated):
    # Exit 69 (restarted: someone may load it), not 78; a model Triton does not list at all stays 78
    # (above). Not loaded yet, or unloaded by the test before.
    ex = TritonExecutor(triton.grpc_url, {"m": gated.name}, inflight=1, shm="system", start_timeout_s=1.0)
    try:
        with pytest.raises(ExecutorUnavailable, match=r"still has model 'gated' \(for 'm'\) not ready after "
                                                       r"\d+ attempts in 1 s \((not loaded|UNAVAILABLE)\)"):
            ex.load(SMALL.spec())
    finally:
        ex.close()


# ---------------------------------------------------------------- a batch that outlives its worker
HELD_MODEL = """import os
import select

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):  # y = 2x; a batch starting with 777 runs until the test opens the gate
        here, out = os.path.dirname(__file__), []
        for req in requests:
            x = pb_utils.get_input_tensor_by_name(req, "x").as_numpy()
            if x[0, 0] == 777:
                # The gate is a FIFO, its reading end open before "running" says so: the test's
                # write to it wakes this select (no writer yet: select waits, 60 s at most).
                gate = os.open(os.path.join(here, "gate"), os.O_RDONLY | os.O_NONBLOCK)
                open(os.path.join(here, "running"), "w").close()
                select.select([gate], [], [], 60)
                os.close(gate)
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", (x * 2).astype(np.float32))]))
        return out
"""


@pytest.fixture(scope="module")
def held_model(triton):
    """A model of the shared Triton (two instances) that holds a batch starting with 777 until told."""
    model = triton.repo / "held"
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "1" / "model.py").write_text(HELD_MODEL)
    config = OTHER_DTYPE_CONFIG.replace('"other_dtype"', '"held"').replace("count: 1", "count: 2")
    (model / "config.pbtxt").write_text(config)
    gate = model / "1" / "gate"
    gate.unlink(missing_ok=True)
    os.mkfifo(gate)
    ctl = grpcclient.InferenceServerClient(triton.grpc_url)
    ctl.load_model("held")
    yield model / "1"
    _open_gate(gate)
    ctl.unload_model("held")
    ctl.close()


def _open_gate(gate) -> None:
    """Ends the held model's batch waiting at ``gate`` (a FIFO); none waiting: nothing."""
    try:
        fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no batch has it open for reading
        return
    try:
        os.write(fd, b"go")
    finally:
        os.close(fd)


@pytest.fixture
def held(held_model):
    running = held_model / "running"
    running.unlink(missing_ok=True)
    yield types.SimpleNamespace(release=lambda: _open_gate(held_model / "gate"), running=running)
    _open_gate(held_model / "gate")  # a batch still held ends now


def _system_regions(tl, prefix: str) -> set[str]:
    cl = grpcclient.InferenceServerClient(tl.grpc_url)
    try:
        return {name for name in cl.get_system_shared_memory_status().regions if name.startswith(prefix)}
    finally:
        cl.close()


def test_a_worker_restarted_while_triton_runs_its_killed_predecessors_batch_starts_and_clears_it_later(
        triton, held, monkeypatch):
    # A Triton worker killed (or declared hung and restarted) mid-batch: its successor's start
    # unregisters what it left, and Triton refuses while the batch runs ("in use"). The successor
    # died with a traceback, exit 1, and so did every restart until Triton ended that batch.
    from batchyard.workers import triton_executor

    monkeypatch.setattr(triton_executor, "HELD_PROBE_S", 0.0)  # each batch asks for the old regions
    prefix = f"batchyard-test-{os.getpid()}-gpu0-"  # one worker's, stable across its restarts
    old = TritonExecutor(triton.grpc_url, {"m": "held"}, inflight=2, shm="system", region_prefix=prefix)
    old.load(SMALL.spec())
    old.submit("m", {"x": np.full((1, 16), 777, np.float32)}, lambda outcome, us: None)
    t0 = time.monotonic()
    while not held.running.exists():
        assert time.monotonic() - t0 < 30, "the batch never reached the model"
    old.client.close()  # killed: nothing unregistered (no client to ask), its batch runs on in Triton
    old.client = None
    old.close()
    new = TritonExecutor(triton.grpc_url, {"m": "held"}, inflight=2, shm="system", region_prefix=prefix)
    try:
        new.load(SMALL.spec())
        x = np.arange(32, dtype=np.float32).reshape(2, 16)
        for _ in range(3):  # both of its slots serve, beside the region Triton still holds
            np.testing.assert_array_equal(new.run("m", {"x": x})["y"], x * 2)
        held_by_triton = {f"{prefix}1-in", f"{prefix}1-out"}  # the old slot its batch took
        assert held_by_triton <= _system_regions(triton, prefix)
        held.release()  # the batch ends
        t0 = time.monotonic()
        while held_by_triton & _system_regions(triton, prefix):  # unregistered once Triton lets go
            np.testing.assert_array_equal(new.run("m", {"x": x})["y"], x * 2)
            assert time.monotonic() - t0 < 30, "the old regions stayed registered"
    finally:
        new.close()
    assert _system_regions(triton, prefix) == set()


def test_tritons_invalid_argument_is_a_refusal_its_other_answers_may_pass():
    """The status Triton answers decides what the warm-up makes of it (below): INVALID_ARGUMENT
    is the batch not fitting the model, a restart meets it again; INTERNAL may pass."""
    from batchyard.workers.triton_executor import TritonAnswerError, TritonExecutor, TritonRefusedInput

    ex = TritonExecutor.__new__(TritonExecutor)
    ex.url, ex.region_prefix = "127.0.0.1:1", "by_triton_test"

    def answered(status: str):
        return types.SimpleNamespace(status=lambda: status, message=lambda: "as Triton says")

    refused, internal = ex._failure(answered("StatusCode.INVALID_ARGUMENT"), 0), ex._failure(answered("StatusCode.INTERNAL"), 0)
    assert type(refused) is TritonRefusedInput and not refused.restart_may_help
    assert type(internal) is TritonAnswerError and internal.restart_may_help


def test_a_worker_stopped_after_triton_was_taken_for_down_unregisters_its_regions(triton):
    """Taken for down (a call past its timeout), the executor forgot its regions were registered:
    a clean stop then left all four registered in Triton, their memory pinned there (an outside
    review)."""
    ex = TritonExecutor(triton.grpc_url, {"tri": "dense_amx"}, shm="system")
    try:
        ex.load(TRI.spec())
        names = {r.name for s in ex._slots for r in s.regions}
        assert names and names <= _regions(triton)
        ex._mark_down(RuntimeError("Deadline Exceeded"), ex._gen)
    finally:
        ex.close()
    assert not names & _regions(triton)


def test_slots_that_do_not_fit_in_dev_shm_are_a_reason_not_to_start_not_a_traceback(triton, monkeypatch):
    """/dev/shm of 64 MiB (Docker's default) and slots of 37 MiB: ShmError escaped load(), a
    traceback and exit 1, restarted for ever. Now CannotStart (exit 78) naming what to change."""
    from batchyard.shm import ShmError
    from batchyard.workers import triton_executor
    from batchyard.workers.runtime import CannotStart

    def no_room(kind, name, size, device):
        raise ShmError(f"cannot allocate {size} bytes of shared memory in /dev/shm: No space left on device")

    monkeypatch.setattr(triton_executor, "make_region", no_room)
    ex = TritonExecutor(triton.grpc_url, {"tri": "dense_amx"}, shm="system")
    try:
        with pytest.raises(CannotStart, match="cannot allocate .* lower \\[\\[models\\]\\] max_batch"):
            ex.load(TRI.spec())
    finally:
        ex.close()


def test_a_call_cut_by_the_workers_own_reconnect_is_sent_again_not_failed():
    """After a restart of Triton, the first of two batches in flight reconnected the worker,
    which cut the second's call ("Channel closed!", CANCELLED on the old channel): it failed
    UNAVAILABLE (5 of a burst of 50). Sent again now; a call Triton itself failed is an outage."""
    import threading

    from batchyard.workers.runtime import SendAgain
    from batchyard.workers.triton_executor import TritonExecutor

    ex = TritonExecutor.__new__(TritonExecutor)
    ex.url, ex.region_prefix, ex._gen, ex._stale = "127.0.0.1:1", "by_triton_test-", 2, False
    ex._backoff, ex.backoff_max_s, ex._lock = 0.5, 5.0, threading.Lock()
    cut = types.SimpleNamespace(status=lambda: "StatusCode.CANCELLED", message=lambda: "Channel closed!")
    assert type(ex._failure(cut, 1)) is SendAgain and not ex._stale
    lost = types.SimpleNamespace(status=lambda: "StatusCode.NOT_FOUND", message=lambda: (
        "Unable to find shared memory region: 'by_triton_test-0-in'"))
    assert type(ex._failure(lost, 2)) is SendAgain and ex._stale  # (reconnect at the next call)
    ex._stale = False
    down = types.SimpleNamespace(status=lambda: "StatusCode.UNAVAILABLE", message=lambda: "Connection refused")
    assert type(ex._failure(down, 2)) is not SendAgain and ex._stale


class _FakeTritonClient:
    """One gRPC channel to a Triton that is up: calls end when the test answers them; close()
    cuts the calls still in flight CANCELLED, each on a thread of its own, as gRPC does."""

    def __init__(self, *args, **kwargs):
        self.calls, self.regions, self.closed, self.cut = [], set(), False, []

    def register_system_shared_memory(self, name, key, size, client_timeout=None):
        self.regions.add(name)

    def unregister_system_shared_memory(self, name, client_timeout=None):
        self.regions.discard(name)

    def get_system_shared_memory_status(self, client_timeout=None):
        return types.SimpleNamespace(regions={r: None for r in self.regions})

    def async_infer(self, name, inputs, callback, outputs=None, client_timeout=None):
        self.calls.append({"callback": callback, "n": inputs[0].shape()[0], "done": False})

    def answer(self, i, error=None):
        call = self.calls[i]
        call["done"] = True
        told = types.SimpleNamespace(get_output=lambda name: types.SimpleNamespace(datatype="FP32",
                                                                                   shape=[call["n"], 8]))
        call["callback"](None if error else told, error)

    def close(self):
        from tritonclient.utils import InferenceServerException

        self.closed = True
        for call in (c for c in self.calls if not c["done"]):
            call["done"] = True
            t = threading.Thread(target=call["callback"], args=(
                None, InferenceServerException("Channel closed!", status="StatusCode.CANCELLED")))
            self.cut.append(t)
            t.start()


def _fake_triton_executor(inflight: int, backoff_s=(0.0, 0.0)) -> TritonExecutor:
    spec = ModelConfig(name="tri", factory="", max_batch=4, inputs=(TensorConfig("x", "float32", (8,)),),
                       outputs=(TensorConfig("y", "float32", (8,)),)).spec()
    ex = TritonExecutor("127.0.0.1:1", {"tri": "m"}, inflight=inflight, shm="system", backoff_s=backoff_s)
    ex.grpc = types.SimpleNamespace(InferenceServerClient=_FakeTritonClient, InferInput=grpcclient.InferInput,
                                    InferRequestedOutput=grpcclient.InferRequestedOutput)
    ex._connect()
    ex.specs["tri"] = spec
    ex._make_slots(4 * 32, 4 * 32)
    return ex


def test_a_reconnect_lets_the_old_channels_healthy_calls_end_instead_of_cutting_them():
    """A reconnect closed the old channel at once: a batch running well in Triton was cut
    (CANCELLED), its slot held until Triton ended it, and after one call timed out the next
    batches found every slot held and failed UNAVAILABLE with Triton up (an outside review). The
    old client now stays open until its calls end; closed by the next call after that."""
    from tritonclient.utils import InferenceServerException

    ex = _fake_triton_executor(inflight=3)
    try:
        out = {}
        x = {"x": np.ones((2, 8), np.float32)}
        for name in ("timed-out", "healthy"):
            ex.submit("tri", x, lambda o, us, name=name: out.__setitem__(name, o))
        old = ex.client
        old.answer(0, InferenceServerException("Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED"))
        assert isinstance(out["timed-out"], ExecutorUnavailable) and ex._stale
        ex.submit("tri", x, lambda o, us: out.__setitem__("next", o))  # reconnects (back-off 0 here)
        assert ex.client is not old and not old.closed and "healthy" not in out
        old.answer(1)  # Triton ends the healthy batch on the old channel
        assert out["healthy"]["y"].shape == (2, 8)
        ex.client.answer(0)
        assert out["next"]["y"].shape == (2, 8)
        ex.submit("tri", x, lambda o, us: out.__setitem__("last", o))
        assert old.closed and not old.cut  # closed once nothing ran on it, cutting nothing
    finally:
        ex.close()


def test_a_failure_marks_triton_down_and_starts_the_back_off_as_one_step():
    """A callback's _mark_down set the stale flag, then the back-off: a reconnect on the
    runtime's thread between the two went ahead at once, and the back-off then landed on the new,
    healthy client (its batches failed UNAVAILABLE for the back-off, up to 5 s). Both now change
    under the executor's lock, which the runtime's check takes too."""
    from tritonclient.utils import InferenceServerException

    from batchyard.workers import triton_executor as te

    ex = _fake_triton_executor(inflight=2, backoff_s=(30.0, 60.0))
    parked, go, seen = threading.Event(), threading.Event(), []
    real = time.monotonic

    def monotonic():  # the callback's first clock read inside _mark_down: park it there
        if threading.current_thread().name == "grpc-callback" and not go.is_set():
            seen.append(ex._lock.locked())
            parked.set()
            go.wait()
        return real()

    try:
        out = {}
        ex.submit("tri", {"x": np.ones((1, 8), np.float32)}, lambda o, us: out.__setitem__("a", o))
        te.time, saved = types.SimpleNamespace(monotonic=monotonic, perf_counter=time.perf_counter), te.time
        try:
            cb = threading.Thread(name="grpc-callback", target=ex.client.answer, args=(
                0, InferenceServerException("Socket closed", status="StatusCode.UNAVAILABLE")))
            cb.start()
            parked.wait()
            assert seen == [True]  # the runtime's _ensure_up cannot read the state half-changed
            go.set()
            cb.join()
        finally:
            te.time = saved
        ex.submit("tri", {"x": np.ones((1, 8), np.float32)}, lambda o, us: out.__setitem__("b", o))
        assert "retrying in" in str(out["b"]) and ex._gen == 1  # in back-off, no reconnect
    finally:
        go.set()
        ex.close()


def test_a_lone_run_cut_by_a_reconnect_is_sent_again_and_an_outage_meanwhile_is_unavailable(monkeypatch):
    """A batch Triton failed runs its requests alone; a lone run cut by the executor's own
    reconnect (SendAgain) was not sent again, and the batch got its first error, INTERNAL for
    every request (good ones too), where an outage should be UNAVAILABLE (the dispatcher queues
    those again). An outside review."""
    from batchyard.workers import runtime
    from batchyard.workers.runtime import SendAgain, WorkerRuntime
    from batchyard.workers.triton_executor import TritonRefusedInput

    monkeypatch.setattr(runtime, "assemble", lambda items, spec, cache: {"x": items[0].value})
    monkeypatch.setattr(runtime, "check_outputs", lambda raw, spec, n: raw)

    class Executor:
        path, simulated, timeout_s = "gpu", False, 30.0

        def __init__(self):
            self.sent = []

        def submit(self, model, inputs, done):
            self.sent.append((inputs["x"], done))

    def outcome(answers) -> object:
        ex = Executor()
        rt = WorkerRuntime("w", "inproc://unused", ex, {})
        got = []
        rt._finish = lambda msg, items, spec, raw, *rest: got.append(raw)
        items = [types.SimpleNamespace(error=None, items=1, value=v) for v in (1, 2, 3)]
        refused = TritonRefusedInput("Triton failed the batch (INVALID_ARGUMENT): token out of range")
        spec = types.SimpleNamespace(outputs=[types.SimpleNamespace(name="y")])
        rt._submitted_done(types.SimpleNamespace(model="tri", batch_id=1), items, spec, False, 0, True, refused, 0)
        for answer in answers:
            value, done = ex.sent.pop(0)
            done(answer(value), 0)
            rt._send_completed(types.SimpleNamespace(send_multipart=lambda *a, **k: None))
        assert not ex.sent
        return got[0]

    def ok(value):
        return {"y": np.array([value])}

    # The first lone run cut once, then served; the other two served: every request's output.
    cut = iter([SendAgain("the call was cut by a reconnect: Channel closed!")])
    got = outcome([lambda v: next(cut), ok, ok, ok])
    assert list(got["y"]) == [1, 2, 3]
    # Triton down during the lone runs: UNAVAILABLE for the batch, not the model's INTERNAL.
    got = outcome([ok, lambda v: ExecutorUnavailable("Triton at 127.0.0.1:1 is unavailable: Socket closed")])
    assert type(got) is ExecutorUnavailable


@pytest.mark.parametrize("error, exits", [
    ("answer", "restarted"),  # Triton's error status: a crashed python-backend stub, say
    ("contract", "not restarted"),  # an output unlike the spec: the same at every start
    # Triton refuses the spec's zeros (an input it needs that the spec lacks): as 69 it was
    # restarted for ever
    ("refused", "not restarted")])
def test_a_triton_error_at_warm_up_is_restarted_only_where_triton_may_change(error, exits):
    """A Triton model whose stub crashed answers INTERNAL "Stub process ... is not healthy";
    the worker's next start met it at warm-up and exited 78, never restarted, Triton fixed or
    not (the warm-up's rule: the same code on the same zeros fails the same way, 78). That code
    runs in Triton's process: Triton's answers exit 69, restarted."""
    from batchyard.workers import runtime
    from batchyard.workers.triton_executor import TritonAnswerError, TritonModelError, TritonRefusedInput

    def run(model, inputs):
        if error == "answer":
            raise TritonAnswerError("Triton failed the batch (INTERNAL): Stub process 'dense_amx_0_0' is not healthy.")
        if error == "refused":
            raise TritonRefusedInput("Triton failed the batch (INVALID_ARGUMENT): [request id: <id_unknown>] expected "
                                     "2 inputs but got 1 inputs for model 'extra_in'")
        raise TritonModelError("Triton's output 'y' is FP16 [1, 384]; the spec says FP32 [1, 384]")

    rt = runtime.WorkerRuntime("gpu0", "ipc:///nonexistent", types.SimpleNamespace(run=run, simulated=False),
                               {"tri": TRI.spec()})
    want = runtime.ExecutorUnavailable if exits == "restarted" else runtime.CannotStart
    with pytest.raises(want, match="'tri': warm-up at B=1: "):
        rt.warmup({"tri": (1,)})
