"""The classes' latency on a launch-heavy worker, where low items may pad an urgent batch
(SIMULATED: docs/policy.md, step 2). ``python -m batchyard.bench.priority_padding``

One worker at 20 ms + 1 ms an item, max batch 8; 6,000 Poisson arrivals, 20/60/20 % high,
normal and low, no deadlines, at 60, 120 and 200 req/s (the worker serves ~290 req/s in full
batches). Printed per policy: each class's p50 and p99 (ms).
"""

from __future__ import annotations

import argparse

import numpy as np

from .simulator import Device, simulate
from .traces import poisson, with_classes

DEVICES = [Device("w0", "cpu", 20e-3, 1e-3, max_batch=8)]
CLASSES = ("high", "normal", "low")


def run(rate: float, policy: str, n: int = 6000, seed: int = 1) -> dict[str, tuple[float, float]]:
    """Per class: (p50 ms, p99 ms) of the requests served."""
    tr = with_classes(poisson(rate, n, seed=seed), probs=(0.2, 0.6, 0.2), seed=seed + 1)
    res = simulate(policy, tr, DEVICES)
    out = {}
    for c, name in enumerate(CLASSES):
        ms = res.latency[(res.priority == c) & (res.status == 0)] * 1e3
        out[name] = (float(np.percentile(ms, 50)), float(np.percentile(ms, 99)))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[60.0, 120.0, 200.0])
    ap.add_argument("--policies", nargs="+", default=["mcb", "greedy"])
    args = ap.parse_args(argv)
    for rate in args.rates:
        for policy in args.policies:
            r = run(rate, policy)
            print(f"{rate:5.0f} req/s {policy:8s} " + " | ".join(f"{c} p50 {p50:6.1f} p99 {p99:6.1f}"
                                                           for c, (p50, p99) in r.items()))


if __name__ == "__main__":
    main()
