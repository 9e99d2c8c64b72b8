"""Where the dispatcher and the front door run, live: MiniLM's AMX worker on ``--worker-cpu``;
the dispatcher and the front door on the same cpu ("same") or on ``--control-cpu`` ("split",
through ``[dispatcher] cpus`` and ``[frontend] cpus``); the load generator (``batchyard bench``'s
tritonclient gRPC aio, Poisson) on ``--load-cpu``. The offered loads are fractions of the worker
core's limit, measured directly first; placements alternate within each round.

    python -m batchyard.bench.control_cpus --worker-cpu 1 --control-cpu 2 --load-cpu 0 --fractions 0.8 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

from . import vs_triton as V


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker-cpu", type=int, default=1)
    ap.add_argument("--control-cpu", type=int, default=2)
    ap.add_argument("--load-cpu", type=int, default=0)
    ap.add_argument("--fractions", default="0.8", help="offered loads, fractions of the measured limit")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="runs per batch size of the limit measurement")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    plan = V.Plan(loads=[], load_fractions=[], saturate=0, saturate_fraction=1.5, delays_us=[0], slo_ms=1000,
                  warmup_s=5.0, window_s=a.window_s, windows=a.windows, stability=0.25, reps=a.reps)
    with V.on_cpus({a.worker_cpu, a.load_cpu}):
        limit = V.physical_limit(a.worker_cpu, a.reps)
    print(f"limit {limit['limit_items_per_s']:.1f} items/s at B={limit['best_b']}", flush=True)
    os.sched_setaffinity(0, {a.load_cpu})  # the load generator, and what it starts
    rows = []
    for r in range(a.rounds):
        for frac in [float(x) for x in a.fractions.split(",")]:
            rate = round(frac * limit["limit_items_per_s"], 1)
            for label, control in (("same", set()), ("split", {a.control_cpu})):
                with contextlib.ExitStack() as stack:
                    with V.on_cpus({a.worker_cpu, a.control_cpu, a.load_cpu}):  # `up` starts from here
                        srv, _ = stack.enter_context(V.batchyard_server([a.worker_cpu], control))
                    res = V.measure(srv, rate, plan, label, None)
                s = res["report"].summary
                rows.append({"round": r, "fraction": frac, "rate": rate, "placement": label, "pinning": srv.pinning,
                             "stable": res["report"].stable,
                             **{k: s.get(k) for k in ("p50_ms", "p99_ms", "throughput_rps", "mean_batch")}})
                print("ROW", json.dumps(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"limit": limit, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
