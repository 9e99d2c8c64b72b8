"""The GPU worker against a real Triton server (nvidia-pytriton's tritonserver, python backend,
CPU-only here: Triton stands in for the GPU's speed)."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("pytriton")
grpcclient = pytest.importorskip("tritonclient.grpc")

from dispatcher.config import ModelConfig, TensorConfig, TritonConfig, WorkerConfig  # noqa: E402
from dispatcher.errors import Unavailable  # noqa: E402
from workers.triton_local import TritonLocal  # noqa: E402

from conftest import ROOT  # noqa: E402

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
    node = start_node([gpu_worker(triton, warmup=(1,), max_grpc_message_bytes=16 << 10, shm=False)], models=(TRI,))
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
            tl.kill()
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
