"""T(B) of the Triton path, tensors through shared memory (system or CUDA) vs in gRPC message bodies.

``python -m batchyard.bench.triton_curve [--model model_amx] [--reps 5] [--shm auto,none]``

Uses the GPU worker's own executor (workers/triton_executor.py) against a local tritonserver
(nvidia-pytriton, python backend; dense_gpu runs on the GPU, the others on the CPU). Reports
median / p90 per batch size, and, from Triton's own statistics, the mean time outside the
model's compute (client time minus Triton's ``compute_infer``; what the transport choice
changes, without the model's run-to-run noise) and Triton's own share of it
(``compute_input + compute_output``).
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
from batchyard.workers.triton_regions import resolve_kind

SPECS = {
    "model_amx": ModelSpec("model_amx", (TensorSpec("input_ids", "int64", (128,)), TensorSpec("attention_mask", "int64", (128,))),
                           (TensorSpec("embedding", "float32", (384,)),), max_batch=64),
    "dense_amx": ModelSpec("dense_amx", (TensorSpec("x", "float32", (1024,)),),
                           (TensorSpec("y", "float32", (1024,)),), max_batch=64),
    "dense_gpu": ModelSpec("dense_gpu", (TensorSpec("x", "float32", (1024,)),),  # dense_amx on the GPU
                           (TensorSpec("y", "float32", (1024,)),), max_batch=64),
}
REPOSITORY = {"dense_gpu": "gpu"}  # the rest are in deploy/triton/cpu
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


def _infer_ns(ex: TritonExecutor, model: str) -> tuple[int, int, int]:
    """Triton's counters: (compute_infer count, compute_infer ns, compute_input + compute_output ns)."""
    st = ex.client.get_inference_statistics(model_name=model).model_stats[0].inference_stats
    return st.compute_infer.count, st.compute_infer.ns, st.compute_input.ns + st.compute_output.ns


def _block(ex: TritonExecutor, model: str, inp: dict, reps: int) -> tuple[float, float, float, float]:
    """(median ms, p90 ms, mean ms outside Triton's compute_infer, mean ms of Triton's own input
    and output handling) of ``reps`` calls."""
    ex.run(model, inp)  # warm this shape; by its reply the previous block's stats are in
    c0, ns0, io0 = _infer_ns(ex, model)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ex.run(model, inp)
        ts.append((time.perf_counter() - t0) * 1e3)
    c1, ns1, io1 = _infer_ns(ex, model)
    # Triton may record the last call's statistics just after replying: a mean over the calls
    # it has recorded (all at this B) is still the mean compute time.
    n = max(1, c1 - c0)
    compute, io = (ns1 - ns0) / 1e6 / n, (io1 - io0) / 1e6 / n
    return float(np.median(ts)), float(np.percentile(ts, 90)), float(np.mean(ts)) - compute, io


def curves(tl: TritonLocal, model: str, reps: int, kinds: tuple[str, ...] = ("auto", "none")) -> dict:
    """{shm kind: {B: row}}, the kinds taken in turn at each batch size so drift hits all alike.
    "auto" is CUDA shared memory on a GPU host, system shared memory elsewhere."""
    execs = {k: TritonExecutor(tl.grpc_url, inflight=1, shm=k, timeout_s=120) for k in kinds}
    rows: dict[str, dict] = {k: {} for k in kinds}
    try:
        for ex in execs.values():
            ex.load(SPECS[model])
        for b in SIZES:
            inp = inputs_for(SPECS[model], b)
            outs = {}
            for k, ex in execs.items():
                rows[k][b] = _block(ex, model, inp, reps)
                outs[k] = ex.run(model, inp)
            first = next(iter(outs.values()))
            for k, out in outs.items():  # every path hands back the same tensors
                for name, arr in first.items():
                    np.testing.assert_allclose(out[name], arr, rtol=1e-4, atol=1e-5, err_msg=f"{k}, B={b}")
        return rows
    finally:
        for ex in execs.values():
            ex.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="model_amx", choices=sorted(SPECS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shm", default="auto,none",
                    help="comma-separated: auto (CUDA with a GPU, else system), cuda, system, none (gRPC bodies)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    kinds = tuple(args.shm.split(","))
    names = {k: k if k == "none" else resolve_kind(k, 0) for k in kinds}
    root = asset("triton", REPOSITORY.get(args.model, "cpu"))
    with TritonLocal(root, models=[args.model]) as tl:
        rows = curves(tl, args.model, args.reps, kinds)
    print(f"Triton path T(B), {args.model}, ms: median / p90 of {args.reps}; mean time outside Triton's "
          f"compute_infer, and of it Triton's compute_input + compute_output; tritonserver 2.51 python backend")
    label = {k: "gRPC bodies" if names[k] == "none" else f"{names[k]} shm" for k in kinds}
    print(f"{'B':>4} " + "   ".join(f"{label[k]:>18} {'outside':>8} {'in+out':>7}" for k in kinds))
    for b in SIZES:
        print(f"{b:>4} " + "   ".join(f"{rows[k][b][0]:>9.2f} / {rows[k][b][1]:<7.2f} {rows[k][b][2]:>8.2f} "
                                      f"{rows[k][b][3]:>7.2f}" for k in kinds))
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "labels": label, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
