"""One live run per policy, side by side with the simulator on the same curves and load.

``python -m batchyard.bench.live_policies [--rate R] [--duration S]``

Live node: the real dispatcher, a real AMX worker running MiniLM-L6 (bf16 weights, 1 thread)
and a *simulated* GPU worker (launch 40 ms + 0.5 ms*B, max batch 32: slow enough that the CPU
is the better path for lone requests on this 2-core machine, so the policies differ). The
AMX curve is calibrated first (`batchyard calibrate`), then the same curves drive the
simulator at the same Poisson rate. Live numbers include ZeroMQ, codec and process wake-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import numpy as np

from batchyard.workers.calibrate import calibrate
from batchyard.config import DispatcherConfig, NodeConfig, SimConfig, WorkerConfig
from batchyard.supervisor import running_node

from .demo import SENTENCES, demo_config
from .loadgen import poisson_load
from .simulator import Device, simulate
from .traces import poisson

GPU_SIM = SimConfig(launch_us=40_000.0, per_item_us=500.0, jitter=0.02)
POLICIES = ("mcb", "three-segment", "gpu-only", "window:5000,32", "fixed:8")


def node_for(run_dir: str, policy: str, profile: str = "") -> NodeConfig:
    base = demo_config(run_dir, policy)
    amx = base.workers[0]
    gpu = WorkerConfig(name="gpu-sim0", kind="sim", models=("minilm",), sim=GPU_SIM)
    d = DispatcherConfig(**{**base.dispatcher.__dict__, "policy": policy, "profile": profile})
    return NodeConfig(dispatcher=d, models=base.models, workers=(amx, gpu)).validate()


def live_run(policy: str, rate: float, duration: float, profile: str) -> dict:
    from batchyard.workers.models import tokenize

    ids, mask = tokenize(SENTENCES)
    with tempfile.TemporaryDirectory(prefix="by-live-") as run_dir:
        node = node_for(run_dir, policy, profile)
        with running_node(node):
            make = lambda i: {"input_ids": ids[i % 8:i % 8 + 1], "attention_mask": mask[i % 8:i % 8 + 1]}
            recs = asyncio.run(poisson_load(node.dispatcher.frontend, "minilm", make, rate, duration, seed=5))
    ok = [r for r in recs if r.status == "OK"]
    lat = np.array([r.latency_s for r in ok]) * 1e3
    return {"policy": policy, "sent": len(recs), "served": len(ok),
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "throughput_rps": len(ok) / duration, "mean_batch": float(np.mean([r.batch_size for r in ok])),
            "cpu_share": float(np.mean([r.path == "cpu" for r in ok]))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=25.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--out", default="bench/results/live_policies.json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="by-cal-") as d:
        prof_path = str(Path(d) / "profile.json")
        calibrate(node_for(d, "mcb"), prof_path, sizes=[1, 2, 4, 8, 16, 32], reps=3, log=lambda *_: None)
        profile = json.loads(Path(prof_path).read_text())
        keep = "bench/results/live_profile.json"
        Path(keep).write_text(json.dumps(profile, indent=1))
        rows = []
        for pol in POLICIES:
            live = live_run(pol, args.rate, args.duration, keep)
            cpu = profile["models"]["minilm"]["cpu"]
            devs = [Device("amx0", "cpu", cpu["launch_us"] * 1e-6, cpu["per_item_us"] * 1e-6, 32,
                           points=tuple(tuple(p) for p in cpu["points"])),
                    Device("gpu-sim0", "gpu", GPU_SIM.launch_us * 1e-6, GPU_SIM.per_item_us * 1e-6, 32, GPU_SIM.jitter)]
            if pol in ("gpu-only",) or pol.startswith(("window", "fixed")):
                devs = devs[1:]
            sim = simulate(pol, poisson(args.rate, int(args.rate * args.duration), seed=5), devs).summary()
            rows.append({"live": live, "sim": sim})
            print(f"{pol:<16} live p50 {live['p50_ms']:7.1f} p99 {live['p99_ms']:7.1f} ms {live['throughput_rps']:6.1f}/s "
                  f"cpu {live['cpu_share']:.2f} B {live['mean_batch']:.1f} | sim p50 {sim['p50_ms']:7.1f} "
                  f"p99 {sim['p99_ms']:7.1f} ms cpu {1 - sim['gpu_share']:.2f} B {sim['mean_batch']:.1f}", flush=True)
    Path(args.out).write_text(json.dumps({"rate": args.rate, "duration": args.duration, "cpu_curve": profile,
                                          "gpu_sim": GPU_SIM.__dict__, "rows": rows}, indent=1, default=float))


if __name__ == "__main__":
    main()
