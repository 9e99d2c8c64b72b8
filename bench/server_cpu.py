"""CPU time per request of each server process: Batchyard's front door against Triton (issue 12).

``python -m batchyard.bench.server_cpu [--rate 35] [--server-cpu 1] [--load-cpu 0]``

On one core a server's own processes take CPU from the model. Each server (Batchyard's node
with its front door, then Triton with its default delay of 0) runs alone on ``--server-cpu``,
perf_analyzer drives MiniLM at ``--rate`` req/s from ``--load-cpu``, and the CPU time of each
process of the server's tree (psutil, user + system) over the measured windows is divided by
the requests served in them (the server's ``nv_inference_count``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from . import perf_analyzer
from . import vs_triton as V
from .harness import scrape


def measure(server: V.Server, rate: float, input_data: Path) -> dict:
    perf_analyzer.run_rate(server.url, server.model, rate, window_s=5, trials=2, stability=0.5,
                           input_data=input_data)  # warm-up: every shape the run will see
    before, m0, t0 = V.tree_cpu_s(server.pid), scrape(server.metrics_url), time.monotonic()
    pa = perf_analyzer.run_rate(server.url, server.model, rate, window_s=10, trials=3, stability=0.5,
                                input_data=input_data)
    after, m1, elapsed = V.tree_cpu_s(server.pid), scrape(server.metrics_url), time.monotonic() - t0
    n, batches = (V.counter(m1, k) - V.counter(m0, k) for k in ("nv_inference_count", "nv_inference_exec_count"))
    per = {name: s - before.get(name, 0.0) for name, s in after.items()}
    return {"requests": n, "seconds": elapsed, "mean_batch": n / batches if batches else float("nan"),
            "p99_ms": pa["summary"]["p99_ms"], "cpu_s": per}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m batchyard.bench.server_cpu", description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=35.0)
    ap.add_argument("--server-cpu", type=int, default=1)
    ap.add_argument("--load-cpu", type=int, default=0)
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {args.load_cpu})  # perf_analyzer inherits it
    with tempfile.TemporaryDirectory(prefix="by-cpu-") as d:
        data = perf_analyzer.minilm_input_data(Path(d) / "in.json")
        for name in ("batchyard", "triton"):
            cm = V.batchyard_server([args.server_cpu]) if name == "batchyard" else V.triton_server(0, [args.server_cpu])
            with cm as got:
                server = got[0] if name == "batchyard" else got
                r = measure(server, args.rate, data)
            print(f"{name}: {r['requests']:.0f} requests in {r['seconds']:.1f} s at {args.rate:g}/s offered, "
                  f"mean batch {r['mean_batch']:.2f}, p99 {r['p99_ms']:.0f} ms")
            for proc, s in sorted(r["cpu_s"].items()):
                print(f"  {proc:36s} {s / r['requests'] * 1e3:7.2f} ms/request  {s / r['seconds'] * 100:5.1f} % of the core")
            total = sum(r["cpu_s"].values())
            print(f"  {'all':36s} {total / r['requests'] * 1e3:7.2f} ms/request  {total / r['seconds'] * 100:5.1f} % of the core",
                  flush=True)


if __name__ == "__main__":
    main()
