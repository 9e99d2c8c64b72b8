"""The real CPU executor: outputs through the whole path equal running the model directly."""

from __future__ import annotations

import numpy as np
import torch

from batchyard.config import WorkerConfig
from batchyard.workers.models import MLP, minilm, tokenize

from conftest import MINILM_MODEL, MLP_MODEL


def amx_worker(name, models, sizes):
    return WorkerConfig(name=name, kind="amx", models=models, threads=1, warmup_sizes=sizes)


def test_mlp_outputs_equal_direct_bf16_run_and_batches_mix_requests(start_node):
    node = start_node([amx_worker("amx0", ("mlp",), (1, 2, 4, 8))], models=(MLP_MODEL,))
    ref = MLP(d_in=256, d_hidden=1024).eval().to(torch.bfloat16)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((int(rng.integers(1, 3)), 256)).astype(np.float32) for _ in range(24)]
    with node.client() as c:
        futs = [c.submit("mlp", {"x": x}) for x in xs]
        results = [f.result() for f in futs]
    for x, r in zip(xs, results):
        with torch.inference_mode():
            want = ref(torch.from_numpy(x).to(torch.bfloat16))["y"].float().numpy()
        # Same bf16 weights; a different batch composition may change oneDNN's blocking,
        # so allow bf16 rounding (8 bits of mantissa) rather than bit equality.
        np.testing.assert_allclose(r["y"], want, rtol=2e-2, atol=2e-2)
        assert r.timing.path == "cpu"
    assert max(r.timing.batch_size for r in results) > 1


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
    assert np.all(cos > 0.99), f"bf16 embeddings drifted from fp32: cosine {cos}"
    model16 = model32.to(torch.bfloat16)  # what the worker runs: weights converted once
    with torch.inference_mode():
        want16 = model16(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))["embedding"].numpy()
    np.testing.assert_allclose(got, want16, atol=2e-2)


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
