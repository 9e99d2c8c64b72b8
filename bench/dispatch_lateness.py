"""Decision lateness under open-loop load (issue 9): how late the dispatcher's decisions run.

For each policy and each fraction of the dispatcher's routed capacity (measured by
dispatch_bench (b)), a fresh node (so its lateness ring holds only that load) takes Poisson
arrivals from ``harness.run_load``; then the status reply's ``decision_lateness`` is read:
``timer`` = a wake-up the core asked for -> the decision running, ``arrival`` = the first
message read in a step -> its decision (dispatcher/lateness.py).
"""

from __future__ import annotations

import numpy as np

from batchyard.client import Client
from batchyard.config import SimConfig

from .harness import LoadSpec, analyse, run_load
from .noop_paths import NodeRun

POLICIES = ("mcb", "window:200,64")
FRACTIONS = (0.5, 0.9)
# A GPU-like simulated device: a launch cost gives MCB a reason to wait, so both policies
# keep the timer path busy. Far faster than the routed capacity at any batch size above 1.
SIM = SimConfig(launch_us=200.0, per_item_us=2.0)
TRIGGERS = ("timer", "arrival")


def lateness_at(policy: str, rate: float, seconds: float, sim: SimConfig = SIM) -> dict:
    """One fresh node, ``seconds`` of Poisson load at ``rate``; its lateness quantiles and the
    load actually delivered."""
    spec = LoadSpec(rate=rate, processes=2, warmup_s=1.0, window_s=seconds, windows=1, stable_windows=1)
    with NodeRun(policy=policy, sim=sim) as r:
        rows = run_load(r.address, "noop", spec)
        with Client(r.address) as c:
            late = c.status().decision_lateness
    rep = analyse(rows, spec, "batchyard", policy)
    return {"lateness": {k: dict(v) for k, v in late.items()},
            "planned_rps": rep.summary["planned_rps"], "sent_rps": rep.summary["sent_rps"],
            "served_rps": rep.summary["throughput_rps"], "schedule_kept": rep.schedule_kept,
            "p99_ms": rep.summary["p99_ms"]}


def bench_lateness(capacity: float, runs: int = 3, seconds: float = 4.0) -> dict:
    print(f"(e) decision lateness, open-loop Poisson at a fraction of the routed capacity {capacity:.0f} req/s, "
          f"sim worker {SIM.launch_us:.0f} us + {SIM.per_item_us:.0f} us/item, {runs} runs x {seconds:.0f} s, "
          f"median of runs (us)")
    print(f"    {'policy':<14} {'load':>5} {'sent/s':>7} {'timer n':>8} {'p50':>6} {'p99':>6} {'max':>7}"
          f" {'arrival n':>10} {'p50':>6} {'p99':>6} {'max':>7}")
    out = {"capacity_rps": capacity, "sim": {"launch_us": SIM.launch_us, "per_item_us": SIM.per_item_us},
           "seconds": seconds, "rows": []}
    for policy in POLICIES:
        for frac in FRACTIONS:
            per_run = [lateness_at(policy, frac * capacity, seconds) for _ in range(runs)]
            row = {"policy": policy, "fraction": frac, "rate_rps": frac * capacity, "runs": per_run,
                   "sent_rps": float(np.median([r["sent_rps"] for r in per_run])),
                   "schedule_kept": all(r["schedule_kept"] for r in per_run)}
            line = f"    {policy:<14} {frac:>4.0%} {row['sent_rps']:>7.0f}"
            for trig in TRIGGERS:
                got = [r["lateness"][trig] for r in per_run if trig in r["lateness"]]
                med = {k: float(np.median([g[k] for g in got])) if got else float("nan")
                       for k in ("n", "p50_us", "p99_us", "max_us")}
                row[trig] = med
                line += f" {med['n']:>{8 if trig == 'timer' else 10}.0f} {med['p50_us']:>6.0f} {med['p99_us']:>6.0f}" \
                        f" {med['max_us']:>7.0f}"
            if not row["schedule_kept"]:
                line += "  (generator fell behind its schedule)"
            print(line)
            out["rows"].append(row)
    return out
