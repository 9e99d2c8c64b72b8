"""The real CPU executor: outputs through the whole path equal running the model directly."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from batchyard.config import WorkerConfig
from batchyard.workers.models import MLP, minilm, tokenize
from batchyard.workers.precision import NATIVE_BF16, resolve, torch_dtype

from conftest import MINILM_MODEL, MLP_MODEL


def amx_worker(name, models, sizes, precision="auto"):
    return WorkerConfig(name=name, kind="amx", models=models, threads=1, warmup_sizes=sizes, precision=precision)


def test_mlp_outputs_equal_direct_run_and_batches_mix_requests(start_node):
    node = start_node([amx_worker("amx0", ("mlp",), (1, 2, 4, 8))], models=(MLP_MODEL,))
    dtype = torch_dtype("auto")  # the worker's default precision on this CPU
    ref = MLP(d_in=256, d_hidden=1024).eval().to(dtype)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((int(rng.integers(1, 3)), 256)).astype(np.float32) for _ in range(24)]
    with node.client() as c:
        futs = [c.submit("mlp", {"x": x}) for x in xs]
        results = [f.result() for f in futs]
    for x, r in zip(xs, results):
        with torch.inference_mode():
            want = ref(torch.from_numpy(x).to(dtype))["y"].float().numpy()
        # Same weights; a different batch composition may change oneDNN's blocking, so allow
        # bf16 rounding (8 bits of mantissa) rather than bit equality.
        np.testing.assert_allclose(r["y"], want, rtol=2e-2, atol=2e-2)
        assert r.timing.path == "cpu"
    assert max(r.timing.batch_size for r in results) > 1


def test_the_worker_runs_the_precision_its_config_names(start_node):
    """``precision = "fp32"`` runs fp32 weights: the outputs equal an fp32 run to float
    rounding, which bf16 weights (8 bits of mantissa) miss by orders of magnitude."""
    node = start_node([amx_worker("amx0", ("mlp",), (1,), precision="fp32")], models=(MLP_MODEL,))
    ref = MLP(d_in=256, d_hidden=1024).eval()
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    with node.client() as c:
        got = c.infer("mlp", {"x": x})["y"]
    with torch.inference_mode():
        want = ref(torch.from_numpy(x))["y"].numpy()
        want16 = MLP(d_in=256, d_hidden=1024).eval().to(torch.bfloat16)(torch.from_numpy(x).to(torch.bfloat16))["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want16.float().numpy() - want).max() > 1e-4  # the check above can tell the two apart


def test_auto_precision_is_bf16_only_where_the_cpu_multiplies_it_natively():
    """Without native bf16 (an AVX2-only EPYC) PyTorch's bf16 fallback ran MiniLM at 3.2 items/s."""
    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
    assert resolve("auto", avx2) == "fp32"
    assert resolve("auto", avx2 | {"avx512f", "avx512bw", "avx512_vnni"}) == "fp32"
    assert resolve("auto", avx2 | {"avx512f", "avx512_bf16"}) == "bf16"  # Zen 4, Cooper Lake
    assert resolve("auto", avx2 | {"avx512_bf16", "amx_bf16", "amx_tile"}) == "bf16"  # Sapphire Rapids
    assert resolve("auto", frozenset({"fp", "asimd", "bf16"})) == "bf16"  # Arm Neoverse V1
    assert resolve("bf16", avx2) == "bf16" and resolve("fp32", avx2 | NATIVE_BF16) == "fp32"  # asked: as asked


def test_minilm_embeddings_match_the_model_run_directly(start_node):
    node = start_node([amx_worker("amx0", ("minilm",), (1, 2))], models=(MINILM_MODEL,))
    texts = ["Watch p99, never the average.", "The GPU only eats batches that are already fat.",
             "Tail requests always have an escape route."]
    ids, mask = tokenize(texts)
    with node.client() as c:
        got = np.concatenate([c.infer("minilm", {"input_ids": ids[i:i + 1], "attention_mask": mask[i:i + 1]})["embedding"]
                              for i in range(len(texts))])
    model32 = minilm().eval()
    with torch.inference_mode():
        want32 = model32(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))["embedding"].numpy()
    cos = np.sum(got * want32, axis=1)  # both L2-normalised
    assert got.shape == (3, 384)
    assert np.all(cos > 0.99), f"the worker's embeddings drifted from fp32: cosine {cos}"
    model_w = model32.to(torch_dtype("auto"))  # what the worker runs: weights converted once
    with torch.inference_mode():
        want_w = model_w(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))["embedding"].float().numpy()
    np.testing.assert_allclose(got, want_w, atol=2e-2)


def test_a_request_the_model_fails_on_fails_alone_not_its_batch(run_dir):
    """An out-of-vocabulary token id makes MiniLM raise. That failed the whole batch: every client
    whose request shared it got INTERNAL. The worker now runs a failed batch's requests one by one;
    only the one the model fails on by itself fails, with the model's words, and the time of such a
    batch teaches the dispatcher nothing (compute_us 0)."""
    from batchyard.config import DispatcherConfig, NodeConfig
    from batchyard.protocol import Status
    from batchyard.workers.harness import DirectWorker

    node = NodeConfig(dispatcher=DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                      models=(MINILM_MODEL,), workers=(amx_worker("amx0", ("minilm",), (1, 2)),)).validate()
    ids, mask = tokenize(["a good request", "a bad one", "another good one"])
    bad = ids[1:2].copy()
    bad[0, 1] = 10 ** 6  # past the vocabulary
    with DirectWorker(node, "amx0") as dw:
        dw.wait_registered()
        requests = [dw.request("minilm", {"input_ids": i, "attention_mask": m})
                    for i, m in ((ids[0:1], mask[0:1]), (bad, mask[1:2]), (ids[2:3], mask[2:3]))]
        done, frames = dw.run("minilm", requests)
        alone, _ = dw.run("minilm", [requests[0]])
    assert [r.status for r in done.results] == [Status.OK, Status.INVALID_ARGUMENT, Status.OK]
    assert "failed on this request" in done.results[1].message and "IndexError" in done.results[1].message
    assert done.compute_us == 0 and alone.compute_us > 0
    assert len(frames) == 2  # one embedding frame for each good request


def test_a_model_that_writes_into_its_input_leaves_the_clients_shared_memory_alone(start_node):
    """A lone request's input in the client's (mapped) segment reached the model as a writable
    view: a model that scales its input in place wrote into the client's own buffer."""
    from batchyard.config import ModelConfig, TensorConfig

    model = ModelConfig(name="inplace", factory="tests.poison_model:scales_its_input_in_place", max_batch=2,
                        inputs=(TensorConfig("x", "float32", (4,)),), outputs=(TensorConfig("y", "float32", (2,)),))
    node = start_node([amx_worker("amx0", ("inplace",), (1,), precision="fp32")], models=(model,))
    with node.client() as c:
        x = c.alloc_array((1, 4), np.float32)  # in shared memory, sent by reference
        x[...] = [[6, 3, 3, 3]]
        got = c.infer("inplace", {"x": x})["y"]
        assert got.tolist() == [[600.0, 300.0]]
        assert x.tolist() == [[6.0, 3.0, 3.0, 3.0]]


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


class _Quits(torch.nn.Module):
    """y = 2 x[:2]; on an input holding 7 raises SystemExit(78), 8 KeyboardInterrupt, 9 an error
    whose text holds a lone surrogate (``os.fsdecode`` of a non-UTF-8 path), 10 one whose text
    cannot be read."""

    def forward(self, x):
        if (x == 7).any():
            raise SystemExit(78)
        if (x == 8).any():
            raise KeyboardInterrupt
        if (x == 9).any():
            raise FileNotFoundError(os.fsdecode(b"/models/w\xff.bin"))
        if (x == 10).any():
            raise _Unprintable()
        return {"y": x[:, :2] * 2}


def quitting_model(spec=None):
    return _Quits()


@pytest.mark.parametrize("value, raised", [(7, "SystemExit: 78"), (8, "KeyboardInterrupt"),
                                           (9, "FileNotFoundError: /models/w\\udcff.bin"),
                                           (10, "_Unprintable: (its text could not be read)")])
def test_whatever_a_model_raises_fails_its_request_not_the_worker(value, raised):
    """Caught as Exception only, SystemExit and KeyboardInterrupt ended the worker (twice: the
    batch, then the request's lone retry), the request failed UNAVAILABLE, and a model's
    sys.exit(78) left the worker marked misconfigured (exit 78), never restarted. An error whose
    text held a lone surrogate failed the reply's encoding, one whose text raised the reply's
    making: the worker died the same way. Here the worker's runtime runs batches in this process."""
    import msgspec
    import zmq

    from batchyard import protocol as P
    from batchyard.protocol import Status
    from batchyard.workers.executors import TorchCpuExecutor
    from batchyard.workers.runtime import WorkerRuntime

    spec = P.ModelSpec(name="q", max_batch=4, inputs=[P.TensorSpec("x", "float32", [4])],
                       outputs=[P.TensorSpec("y", "float32", [2])])
    ex = TorchCpuExecutor(threads=1, precision="fp32")
    ex.load(spec, f"{__name__}:quitting_model")
    rt = WorkerRuntime("w", "ipc:///nonexistent", ex, {"q": spec})

    def run(*values) -> P.BatchDone:
        frames = []
        for i, v in enumerate(values):
            frames += [zmq.Frame(P.encode(P.InferRequest(v=P.PROTOCOL_VERSION, id=i, model="q", inputs=[
                P.TensorRef(name="x", dtype="float32", shape=[1, 4], frame=0)]))),
                       zmq.Frame(np.full((1, 4), v, np.float32).tobytes())]
        batch = P.Batch(batch_id=1, model="q", seqs=list(range(len(values))), n_frames=[1] * len(values))
        try:
            reply = rt.run_batch(batch, frames)
        except BaseException as e:  # noqa: BLE001 -- escaping here, it ends the worker process
            pytest.fail(f"the model's {type(e).__name__} escaped the worker's batch")
        return msgspec.msgpack.decode(reply[0], type=P.BatchDone)

    try:
        alone = run(value)
        assert [r.status for r in alone.results] == [Status.INTERNAL]
        assert f"model 'q' raised {raised}" in alone.results[0].message
        batched = run(1, value, 3)  # as for any other exception: only the request it fails on fails
        assert [r.status for r in batched.results] == [Status.OK, Status.INVALID_ARGUMENT, Status.OK]
        assert f"failed on this request: {raised}" in batched.results[1].message
        assert [r.status for r in run(2).results] == [Status.OK]  # the worker serves on
    finally:
        rt.cache.close()
        os.close(rt._wake_r)
        os.close(rt._wake_w)
