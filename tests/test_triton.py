"""The GPU worker against a real Triton server (nvidia-pytriton's tritonserver, python backend,
CPU-only here: Triton stands in for the GPU's speed)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import zlib

import numpy as np
import pytest

pytest.importorskip("pytriton")
grpcclient = pytest.importorskip("tritonclient.grpc")

from batchyard.config import ModelConfig, TensorConfig, TritonConfig, WorkerConfig  # noqa: E402
from batchyard.errors import Unavailable  # noqa: E402
from batchyard.workers.triton_local import TritonLocal  # noqa: E402
from batchyard.workers.triton_regions import cuda_device_count  # noqa: E402

from conftest import ROOT, spawn_up  # noqa: E402

REPO = ROOT / "deploy" / "triton" / "cpu"
TRI = ModelConfig(name="tri", factory="", max_batch=64,
                  inputs=(TensorConfig("x", "float32", (1024,)),), outputs=(TensorConfig("y", "float32", (1024,)),))


@pytest.fixture(scope="module")
def triton():
    tl = TritonLocal(REPO, models=["dense_amx"]).start(ready_timeout_s=120)
    yield tl
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


RENAMED = ModelConfig(name="tri", factory="", max_batch=64, inputs=(TensorConfig("features", "float32", (1024,)),),
                      outputs=(TensorConfig("embedding", "float32", (1024,)),))


def test_spec_tensor_names_map_onto_tritons(start_node, triton):
    names = {"tri": {"features": "x", "embedding": "y"}}
    node = start_node([gpu_worker(triton, warmup=(1,), tensor_names=names)], models=(RENAMED,))
    x = np.random.default_rng(3).standard_normal((2, 1024)).astype(np.float32)
    with node.client() as c:
        r = c.infer("tri", {"features": x})
    np.testing.assert_allclose(r["embedding"], direct(triton, x), rtol=1e-4, atol=1e-5)


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
    cl = grpcclient.InferenceServerClient(tl.grpc_url)
    try:
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


@pytest.mark.parametrize("case", ["cuda shm without a GPU", "model without the spec's tensor"])
def test_a_worker_that_cannot_run_here_stops_up_at_once_with_the_reason(run_dir, triton, case):
    if case == "cuda shm without a GPU":
        if cuda_device_count() > 0:
            pytest.skip("this host has a GPU")
        worker, expect = (gpu_worker(triton, shm="cuda"), TRI), r"cuda-python|no GPU 0 is visible"
    else:
        worker, expect = (gpu_worker(triton), MISNAMED), r"lacks output 'z' of spec 'tri'"
    before = _regions(triton)
    rc, err = _up_until_it_exits(run_dir, worker)
    assert rc == 1
    assert "worker gpu0 cannot run on this host as configured during start-up" in err
    assert re.search(expect, err), err[-2000:]
    assert _regions(triton) == before  # nothing left registered by the refused worker
