"""Batchyard vs Triton's own dynamic batcher, same model, same CPU cores, same load generator.

``python -m batchyard.bench.vs_triton [--rates 10,30,...] [--delays-us 0,2000,10000] [--out bench/results/vs_triton]``

- Batchyard: dispatcher (policy mcb) + one single-threaded AMX worker per core, MiniLM-L6 bf16.
- Triton: tritonserver (nvidia-pytriton) serving the same MiniLM (python backend, bf16, one
  thread per instance, one instance per core) with ``dynamic_batching`` on, swept over
  ``max_queue_delay_microseconds``; the best delay at each load is what Batchyard is judged
  against.
Both are driven by ``batchyard bench`` (open-loop Poisson, tokenized sentences).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

import msgspec

from batchyard.deploy import asset
from batchyard.config import NodeConfig
from batchyard.supervisor import running_node
from batchyard.workers.triton_local import TritonLocal

from .demo import demo_config
from .harness import LoadSpec, analyse, run_load
from .report import table, write_outputs

SLO_MS = 100.0


def spec(rate: float, args) -> LoadSpec:
    return LoadSpec(rate=rate, warmup_s=args.warmup, window_s=args.window, windows=args.windows,
                    processes=1, seed=7, stability=0.25)


def batchyard_sweep(rates, args) -> list:
    cpus = sorted(os.sched_getaffinity(0))
    reports = []
    with tempfile.TemporaryDirectory(prefix="by-vs-") as d:
        base = demo_config(d, "mcb")
        amx = base.workers[0]
        workers = tuple(msgspec.structs.replace(amx, name=f"amx{c}", cpus=(c,)) for c in cpus)
        node = NodeConfig(msgspec.structs.replace(base.dispatcher, policy="mcb"), base.models,
                          workers).validate()
        with running_node(node):
            for r in rates:
                s = spec(r, args)
                rep = analyse(run_load(node.dispatcher.frontend, "minilm", s, inputs="minilm"), s, "batchyard",
                              f"batchyard mcb ({len(cpus)} AMX workers) @{r:g}")
                reports.append(rep)
                print(table([rep]), flush=True)
    return reports


def triton_repo(delay_us: int, instances: int, into: Path) -> Path:
    src = asset("triton", "cpu", "model_amx")
    dst = into / "model_amx"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = (dst / "config.pbtxt").read_text()
    cfg = cfg.replace("count: 1", f"count: {instances}")
    cfg += f"\n# bench only: Triton's own batcher, to compare with Batchyard's\ndynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
    (dst / "config.pbtxt").write_text(cfg)
    return into


def triton_sweep(rates, delay_us: int, args) -> list:
    n = len(os.sched_getaffinity(0))
    reports = []
    with tempfile.TemporaryDirectory(prefix="by-vs-tri-") as d:
        with TritonLocal(triton_repo(delay_us, n, Path(d)), models=["model_amx"]) as tl:
            for r in rates:
                s = spec(r, args)
                rep = analyse(run_load(tl.grpc_url, "model_amx", s, target="triton", inputs="minilm"), s, "triton",
                              f"triton dyn-batch {delay_us}us ({n} inst) @{r:g}")
                reports.append(rep)
                print(table([rep]), flush=True)
    return reports


def max_under_slo(reports) -> float:
    ok = [r.summary["throughput_rps"] for r in reports
          if r.summary["p99_ms"] <= SLO_MS and not r.summary["errors"]]
    return max(ok, default=0.0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="10,30,50,70,90,110")
    ap.add_argument("--delays-us", default="0,2000,10000")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--out", default="bench/results/vs_triton")
    args = ap.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",")]
    by = batchyard_sweep(rates, args)
    tri = {int(d): triton_sweep(rates, int(d), args) for d in args.delays_us.split(",")}
    lines = ["| offered/s | Batchyard p50 | p99 | tput | best Triton delay | its p50 | p99 | tput | p99 ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rates):
        b = by[i].summary
        best_d, best = min(((d, reps[i].summary) for d, reps in tri.items()), key=lambda x: x[1]["p99_ms"])
        lines.append(f"| {r:g} | {b['p50_ms']:.1f} | {b['p99_ms']:.1f} | {b['throughput_rps']:.1f} | {best_d} us | "
                     f"{best['p50_ms']:.1f} | {best['p99_ms']:.1f} | {best['throughput_rps']:.1f} | "
                     f"{b['p99_ms'] / best['p99_ms']:.2f} |")
    by_max = max_under_slo(by)
    tri_max = max(max_under_slo(reps) for reps in tri.values())
    notes = "\n".join([
        f"Same machine (2 vCPU, no AMX: avx512_bf16 kernels), same MiniLM-L6 bf16, same open-loop Poisson load from "
        f"`batchyard bench` (tokenized sentences, one generator process). Batchyard: policy mcb over one AMX worker per "
        f"core. Triton 2.51 (nvidia-pytriton): the same model in the python backend, one instance per core, dynamic "
        f"batching with max_queue_delay swept over {args.delays_us} us; each row compares with the best delay at "
        f"that load.", "", *lines, "",
        f"Max throughput with p99 <= {SLO_MS:.0f} ms and no errors: Batchyard {by_max:.1f}/s, Triton (best delay) "
        f"{tri_max:.1f}/s, ratio {by_max / tri_max if tri_max else float('nan'):.2f}x.",
        "Reproduce: `python -m batchyard.bench.vs_triton`."])
    all_reports = by + [r for reps in tri.values() for r in reps]
    write_outputs(all_reports, Path(args.out), "Batchyard vs Triton dynamic batcher — MiniLM-L6 on the same CPU cores",
                  notes)
    print(notes)


if __name__ == "__main__":
    main()
