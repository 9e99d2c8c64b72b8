"""T(B) of the Triton path, tensors through system shared memory vs in gRPC message bodies.

``python -m batchyard.bench.triton_curve [--model model_amx] [--reps 5]``

Uses the GPU worker's own executor (workers/triton_executor.py) against a local tritonserver
(nvidia-pytriton, python backend, CPU-only here). Reports median / p90 per batch size, and,
from Triton's own statistics, the mean time outside the model's compute (client time minus
Triton's ``compute_infer``): that is what the transport choice changes, without the model's
run-to-run noise.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from batchyard.deploy import asset
from batchyard.protocol import ModelSpec, TensorSpec
from batchyard.workers.triton_executor import TritonExecutor
from batchyard.workers.triton_local import TritonLocal

SPECS = {
    "model_amx": ModelSpec("model_amx", (TensorSpec("input_ids", "int64", (128,)), TensorSpec("attention_mask", "int64", (128,))),
                           (TensorSpec("embedding", "float32", (384,)),), max_batch=64),
    "dense_amx": ModelSpec("dense_amx", (TensorSpec("x", "float32", (1024,)),),
                           (TensorSpec("y", "float32", (1024,)),), max_batch=64),
}
SIZES = (1, 2, 4, 8, 16, 32, 64)


def inputs_for(spec: ModelSpec, b: int) -> dict:
    rng = np.random.default_rng(b)
    out = {}
    for t in spec.inputs:
        if t.dtype == "int64":
            arr = rng.integers(1000, 5000, size=(b, *t.shape)).astype(np.int64)
            if t.name == "attention_mask":
                arr[:] = 1
        else:
            arr = rng.standard_normal((b, *t.shape)).astype(t.dtype)
        out[t.name] = arr
    return out


def _infer_ns(ex: TritonExecutor, model: str) -> tuple[int, int]:
    st = ex.client.get_inference_statistics(model_name=model).model_stats[0].inference_stats
    return st.compute_infer.count, st.compute_infer.ns


def _block(ex: TritonExecutor, model: str, inp: dict, reps: int) -> tuple[float, float, float]:
    """(median ms, p90 ms, mean ms outside Triton's compute_infer) of ``reps`` calls."""
    ex.run(model, inp)  # warm this shape; by its reply the previous block's stats are in
    c0, ns0 = _infer_ns(ex, model)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ex.run(model, inp)
        ts.append((time.perf_counter() - t0) * 1e3)
    c1, ns1 = _infer_ns(ex, model)
    # Triton may record the last call's statistics just after replying: a mean over the calls
    # it has recorded (all at this B) is still the mean compute time.
    compute = (ns1 - ns0) / 1e6 / max(1, c1 - c0)
    return float(np.median(ts)), float(np.percentile(ts, 90)), float(np.mean(ts)) - compute


def curves(tl: TritonLocal, model: str, reps: int) -> tuple[dict, dict]:
    """Shared memory and gRPC bodies, alternating by batch size so drift hits both alike."""
    via_shm = TritonExecutor(tl.grpc_url, inflight=1, shm="auto", timeout_s=120)  # CUDA shm on a GPU host
    via_body = TritonExecutor(tl.grpc_url, inflight=1, shm="none", timeout_s=120)
    shm_rows, body_rows = {}, {}
    try:
        for ex in (via_shm, via_body):
            ex.load(SPECS[model])
        for b in SIZES:
            inp = inputs_for(SPECS[model], b)
            shm_rows[b] = _block(via_shm, model, inp, reps)
            body_rows[b] = _block(via_body, model, inp, reps)
        return shm_rows, body_rows
    finally:
        via_shm.close()
        via_body.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="model_amx", choices=sorted(SPECS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    root = asset("triton", "cpu")
    with TritonLocal(root, models=[args.model]) as tl:
        via_shm, via_body = curves(tl, args.model, args.reps)
    print(f"Triton path T(B), {args.model}, ms: median / p90 of {args.reps}, and mean time outside Triton's "
          f"compute_infer; tritonserver 2.51 python backend, CPU")
    print(f"{'B':>4} {'shared memory':>18} {'outside':>8}   {'gRPC bodies':>18} {'outside':>8}")
    for b in SIZES:
        (m1, p1, o1), (m2, p2, o2) = via_shm[b], via_body[b]
        print(f"{b:>4} {m1:>9.2f} / {p1:<7.2f} {o1:>8.2f}   {m2:>9.2f} / {p2:<7.2f} {o2:>8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "shm": via_shm, "body": via_body}, indent=1))


if __name__ == "__main__":
    main()
