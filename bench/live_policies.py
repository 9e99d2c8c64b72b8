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
import json
import tempfile
from pathlib import Path

import msgspec
from batchyard.workers.calibrate import calibrate
from batchyard.config import NodeConfig, SimConfig, WorkerConfig
from batchyard.supervisor import running_node

from .demo import demo_config
from .harness import LoadSpec, analyse, run_load
from .simulator import Device, simulate
from .traces import poisson

GPU_SIM = SimConfig(launch_us=40_000.0, per_item_us=500.0, jitter=0.02)
POLICIES = ("mcb", "three-segment", "gpu-only", "window:5000,32", "fixed:8")


def node_for(run_dir: str, policy: str, profile: str = "") -> NodeConfig:
    base = demo_config(run_dir, policy)
    amx = base.workers[0]
    gpu = WorkerConfig(name="gpu-sim0", kind="sim", models=("minilm",), sim=GPU_SIM)
    d = msgspec.structs.replace(base.dispatcher, policy=policy, profile=profile)
    return NodeConfig(dispatcher=d, models=base.models, workers=(amx, gpu)).validate()


def live_run(policy: str, rate: float, duration: float, profile: str) -> dict:
    # The harness draws its arrivals from traces.poisson with seed 5, as the simulator run in main() does.
    spec = LoadSpec(rate=rate, warmup_s=0.0, window_s=duration, windows=1, stable_windows=1, processes=1, seed=5)
    with tempfile.TemporaryDirectory(prefix="by-live-") as run_dir:
        node = node_for(run_dir, policy, profile)
        with running_node(node):
            rows = run_load(node.dispatcher.frontend, "minilm", spec, inputs="minilm")
    s = analyse(rows, spec, "batchyard", policy).summary
    paths = [s[k] for k in ("path_cpu", "path_gpu") if k in s]
    served = max(s["served"], 1)
    return {"policy": policy, "sent": len(rows), "served": s["served"], "p50_ms": s["p50_ms"], "p99_ms": s["p99_ms"],
            "throughput_rps": s["throughput_rps"],
            "mean_batch": sum(p["mean_batch"] * p["served"] for p in paths) / served,
            "cpu_share": s.get("path_cpu", {"served": 0})["served"] / served}


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
                                          "gpu_sim": msgspec.structs.asdict(GPU_SIM), "rows": rows}, indent=1, default=float))


if __name__ == "__main__":
    main()
