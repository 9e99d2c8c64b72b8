"""The classes' latency where low items may pad an urgent batch (SIMULATED: docs/policy.md,
step 2). ``python -m batchyard.bench.priority_padding [--beside-every-cpu | --flood]``

One worker at 20 ms + 1 ms an item, max batch 8; 6,000 Poisson arrivals, 20/60/20 % high,
normal and low, no deadlines, at 60, 120 and 200 req/s (the worker serves ~290 req/s in full
batches). Printed per policy: each class's p50 and p99 (ms).

``--flood``: high requests at 5/s for 30 s beside a low flood at 120/s (1.5x one worker of 20 ms
+ 10 ms an item, max batch 8) whose timeout is 1, 2, 5 or 30 s; trace seeds 1-3 (--seeds).
Printed per policy: the high class's p50 and p99 (ms) alone and beside the flood, and the low
requests served (docs/policy.md, step 0: aging).

``--beside-every-cpu``: the seeds' GPU (0.15 s + 0.02 s an item, max batch 64) and two CPUs (0.08 s
an item), x1000; 60 s of 40 urgent (normal, then high) requests/s, which alone ask step 1's
reservation for every CPU, beside 6 low ones/s; trace seeds 1-3. Printed per policy (mcb,
escape:2): each class's p50 and p99 (s).
"""

from __future__ import annotations

import argparse

import numpy as np

from .simulator import Device, simulate
from .traces import merge, poisson, with_classes

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


def beside_every_cpu(urgent_class: int, seed: int, policy: str = "mcb", seconds: float = 60.0,
                     urgent_rate: float = 40.0, low_rate: float = 6.0) -> dict[str, tuple[float, float]]:
    """Per class (the urgent one, then "low"): (p50 s, p99 s) of a light low stream beside an
    urgent stream that alone takes every CPU (module docstring)."""
    from .live_vs_sim import scaled_devices

    urgent = poisson(urgent_rate, int(urgent_rate * seconds), seed=seed)
    low = poisson(low_rate, int(low_rate * seconds), seed=seed + 100)
    urgent.priority[:], low.priority[:] = urgent_class, 2
    trace = merge(urgent, low)
    res = simulate(policy, trace, scaled_devices(1000.0, "seeds"))
    out = {}
    for c in (urgent_class, 2):
        s = res.latency[(trace.priority == c) & (res.status == 0)]
        out[CLASSES[c]] = (float(np.percentile(s, 50)), float(np.percentile(s, 99)))
    return out


FLOOD_DEVICES = [Device("sim0", "gpu", 0.020, 0.010, max_batch=8)]


def flood(low_timeout_s: float, seed: int, policy: str = "mcb", low_rate: float = 120.0,
          seconds: float = 30.0) -> dict:
    """High at 5/s beside a low flood (module docstring): the high class's p50/p99 (ms) alone and
    beside it, and the low requests served of those sent."""
    high = poisson(5.0, int(5 * seconds), seed=seed)
    high.priority[:] = 0
    low = poisson(low_rate, int(low_rate * seconds), seed=seed + 100)
    low.priority[:] = 2
    low.timeout[:] = low_timeout_s
    alone = simulate(policy, high, FLOOD_DEVICES).latency * 1e3
    res = simulate(policy, merge(high, low), FLOOD_DEVICES)
    ok = res.status == 0
    beside = res.latency[ok & (res.priority == 0)] * 1e3
    return {"alone": (float(np.percentile(alone, 50)), float(np.percentile(alone, 99))),
            "beside": (float(np.percentile(beside, 50)), float(np.percentile(beside, 99))),
            "low_served": int((ok & (res.priority == 2)).sum()), "low_sent": len(low)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[60.0, 120.0, 200.0])
    ap.add_argument("--policies", nargs="+", default=["mcb", "greedy"])
    ap.add_argument("--beside-every-cpu", action="store_true",
                    help="a light low stream beside an urgent one that takes every CPU (module docstring)")
    ap.add_argument("--flood", action="store_true", help="high work beside a low flood of long timeouts (docstring)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="trace seeds of --flood")
    args = ap.parse_args(argv)
    if args.flood:
        for seed in args.seeds:
            for timeout in (1.0, 2.0, 5.0, 30.0):
                for policy in ("mcb", "escape:2"):
                    r = flood(timeout, seed, policy)
                    print(f"seed {seed} low timeout {timeout:4.0f} s {policy:8s} high alone p50/p99 "
                          f"{r['alone'][0]:5.0f}/{r['alone'][1]:5.0f} ms, beside the flood {r['beside'][0]:6.0f}/"
                          f"{r['beside'][1]:6.0f} ms | low served {r['low_served']} of {r['low_sent']}")
        return
    if args.beside_every_cpu:
        for urgent_class in (1, 0):
            for seed in (1, 2, 3):
                for policy in ("mcb", "escape:2"):
                    r = beside_every_cpu(urgent_class, seed, policy)
                    print(f"seed {seed} {policy:8s} " + " | ".join(f"{c} p50 {p50:5.2f} s p99 {p99:5.2f} s"
                                                                  for c, (p50, p99) in r.items()))
        return
    for rate in args.rates:
        for policy in args.policies:
            r = run(rate, policy)
            print(f"{rate:5.0f} req/s {policy:8s} " + " | ".join(f"{c} p50 {p50:6.1f} p99 {p99:6.1f}"
                                                           for c, (p50, p99) in r.items()))


if __name__ == "__main__":
    main()
