"""T(B) of the Triton path, tensors through system shared memory vs in gRPC message bodies.

``python -m bench.triton_curve [--model model_amx] [--reps 5]``

Uses the GPU worker's own executor (workers/triton_executor.py) against a local tritonserver
(nvidia-pytriton, python backend, CPU-only here). Reports median / p90 per batch size.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from dispatcher.protocol import ModelSpec, TensorSpec
from workers.triton_executor import TritonExecutor
from workers.triton_local import TritonLocal

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


def curve(tl: TritonLocal, model: str, shm: str, reps: int) -> dict:
    ex = TritonExecutor(tl.grpc_url, inflight=1, shm=shm, timeout_s=120)
    try:
        ex.load(SPECS[model])
        rows = {}
        for b in SIZES:
            inp = inputs_for(SPECS[model], b)
            ex.run(model, inp)  # warm this shape
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                ex.run(model, inp)
                ts.append((time.perf_counter() - t0) * 1e3)
            rows[b] = (float(np.median(ts)), float(np.percentile(ts, 90)))
        return rows
    finally:
        ex.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="model_amx", choices=sorted(SPECS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parents[1] / "deploy" / "triton" / "cpu"
    with TritonLocal(root, models=[args.model]) as tl:
        via_shm = curve(tl, args.model, "auto", args.reps)  # CUDA shm on a GPU host, system shm here
        via_body = curve(tl, args.model, "none", args.reps)
    print(f"Triton path T(B), {args.model}, ms (median / p90 of {args.reps}); tritonserver 2.51 python backend, CPU")
    print(f"{'B':>4} {'shared memory':>18} {'gRPC bodies':>18}")
    for b in SIZES:
        print(f"{b:>4} {via_shm[b][0]:>9.2f} / {via_shm[b][1]:<7.2f} {via_body[b][0]:>9.2f} / {via_body[b][1]:<7.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "shm": via_shm, "body": via_body}, indent=1))


if __name__ == "__main__":
    main()
