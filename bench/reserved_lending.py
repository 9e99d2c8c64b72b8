"""Low requests with a deadline beside the worker MCB keeps free for urgent arrivals (SIMULATED:
docs/policy.md, step 4). ``python -m batchyard.bench.reserved_lending``

The devices of step 4: a GPU of 10 ms launch and 1 us an item, and a CPU at 0.1 ms an item, which
high-priority traffic above URGENT_RATE makes MCB reserve. Two traces per seed:

- *step 4*: 60/s high (no deadline) and 240/s low with a 5 ms timeout, 3,000 arrivals;
- *mixed*: 60/s high (no deadline), 120/s low without and 120/s low with a 5 ms timeout.

Printed: how many of the low requests with a deadline failed, and the high class's p99.
"""

from __future__ import annotations

import argparse

import numpy as np

from .simulator import Device, simulate
from .traces import Trace, merge, poisson

DEVICES = [Device("gpu0", "gpu", 10e-3, 1e-6), Device("cpu0", "cpu", 0.0, 0.1e-3)]


def classed(t: Trace, priority: int, timeout_s: float) -> Trace:
    return Trace(t.name, t.arrivals, np.full(len(t), priority, np.int8), np.full(len(t), timeout_s))


def traces(seed: int) -> dict[str, Trace]:
    return {"step 4": merge(classed(poisson(60, 600, seed=seed), 0, np.inf),
                            classed(poisson(240, 2400, seed=1000 + seed), 2, 5e-3)),
            "mixed": merge(classed(poisson(60, 600, seed=10 + seed), 0, np.inf),
                           classed(poisson(120, 1200, seed=20 + seed), 2, np.inf),
                           classed(poisson(120, 1200, seed=30 + seed), 2, 5e-3))}


def run(seed: int, policy: str = "mcb") -> dict[str, tuple[int, int, float]]:
    """Per trace: (low requests with a deadline failed, of how many, the high class's p99 ms)."""
    out = {}
    for name, tr in traces(seed).items():
        r = simulate(policy, tr, DEVICES)
        timed = np.isfinite(tr.timeout)
        failed = int((((r.status != 0) | ~r.met_deadline) & timed).sum())
        high = (tr.priority == 0) & (r.status == 0)
        out[name] = (failed, int(timed.sum()), float(np.percentile(r.latency[high] * 1e3, 99)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=6, help="trace seeds 0..N-1")
    ap.add_argument("--policy", default="mcb")
    args = ap.parse_args(argv)
    for seed in range(args.seeds):
        cells = [f"{name}: {f} of {n} failed, high p99 {p99:.3f} ms" for name, (f, n, p99) in run(seed, args.policy).items()]
        print(f"seed {seed}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
