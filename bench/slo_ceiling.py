"""How far can any batching rule go under a p99 SLO on one measured curve? (issue 12)

``python -m batchyard.bench.slo_ceiling [--report bench/results/vs_triton_perf_analyzer/report.json]``

Everything here is SIMULATED: one worker whose T(B) follows the core's directly measured curve
(the vs_triton report's physical-limit table, before and after its runs), Poisson arrivals. For
MCB, greedy and a grid of Triton dynamic-batcher settings (``window:delay_us,max_batch``), the
largest offered rate whose p99 stays within the SLO (bisection, median p99 of several traces).
The best of them estimates what scheduling alone can reach on that core (the best of this
grid, not a proof that no rule does better); set beside Triton's own settings on the same
curve, it says whether a goal of "1.2 x Triton's" is within reach of a better scheduler.
"""

from __future__ import annotations

import argparse
import json
from multiprocessing import Pool
from pathlib import Path

import numpy as np

from .simulator import Device, simulate
from .traces import poisson

GRID = [f"window:{d},{b}" for d in (0, 50_000, 200_000) for b in (2, 4, 8, 16, 32)]
STEPS = 9  # bisection steps: the rate interval shrinks 512-fold


def p99_at(policy: str, points: tuple, rate: float, n: int, seeds: int) -> float:
    dev = [Device("amx0", "cpu", 0.0, 0.0, max_batch=max(b for b, _ in points), points=points)]
    return float(np.median([simulate(policy, poisson(rate, n, seed=s), dev).summary()["p99_ms"]
                            for s in range(seeds)]))


def max_rate(args) -> tuple[str, str, float]:
    """Largest rate (req/s) with median p99 <= slo, between B=1's and the best B's throughput."""
    label, policy, points, slo_ms, n, seeds = args
    lo = 0.5 * points[0][0] / points[0][1]  # half of B=1 throughput (tables start at B=1)
    hi = max(b / t for b, t in points)
    if p99_at(policy, points, lo, n, seeds) > slo_ms:
        return label, policy, float("nan")
    for _ in range(STEPS):
        mid = (lo + hi) / 2
        if p99_at(policy, points, mid, n, seeds) <= slo_ms:
            lo = mid
        else:
            hi = mid
    return label, policy, lo


def live_lines(live: dict, live_slo_ms, slo_ms: float, best_rate: float) -> list[str]:
    """The report's line on the live figures (the vs_triton report's max throughput under its
    SLO), set beside the best simulated rate only when they were measured under this SLO: under
    another one they were said to be "under the same SLO" and divided all the same."""
    if not live:
        return []
    by, tri = live.get("batchyard", float("nan")), live.get("triton", float("nan"))
    if live_slo_ms != slo_ms:
        under = f"p99 ≤ {live_slo_ms:g} ms" if live_slo_ms is not None else "an SLO the report does not record"
        return [f"Measured live under ANOTHER SLO ({under}, not {slo_ms:g} ms): Batchyard {by:.2f}/s, Triton "
                f"{tri:.2f}/s; not comparable with the simulated rates above, so no ratio."]
    # 0: Triton's p99 was over the SLO at every live load (vs_triton's "no ratio").
    ratio = (f"the best simulated rule is {best_rate / tri:.2f} × Triton's live figure" if tri
             else "Triton met the SLO at no live load, so no ratio")
    return [f"Measured live under the same SLO (coarse loads, a lower bound of each): Batchyard "
            f"{by:.2f}/s, Triton {tri:.2f}/s; 1.2 × Triton = {1.2 * tri:.2f}/s; {ratio}."]


def main(argv=None) -> None:
    from .commands import at_least, existing_file, number

    ap = argparse.ArgumentParser(prog="python -m batchyard.bench.slo_ceiling", description=__doc__.split("\n")[0])
    # The committed report, wherever the command runs from (relative, it was found only from the
    # repository's root).
    ap.add_argument("--report", type=existing_file,
                    default=str(Path(__file__).resolve().parent / "results" / "vs_triton_perf_analyzer" / "report.json"))
    ap.add_argument("--slo-ms", type=number(0, above=True), default=2000.0)
    ap.add_argument("--requests", type=at_least(1), default=20_000, help="arrivals per simulated trace")
    ap.add_argument("--seeds", type=at_least(1), default=3, help="traces per rate (their median p99 is used)")
    ap.add_argument("--out", default="bench/results/slo_ceiling/vs_triton_perf_analyzer")
    args = ap.parse_args(argv)
    rep = json.loads(Path(args.report).read_text())
    curves = {k: tuple((int(b), v["ms"] / 1e3) for b, v in rep[k]["curve"].items())
              for k in ("limit", "limit_after") if k in rep}
    policies = ["mcb", "greedy"] + GRID
    jobs = [(k, p, pts, args.slo_ms, args.requests, args.seeds) for k, pts in curves.items() for p in policies]
    with Pool() as pool:
        found = pool.map(max_rate, jobs)
    live = rep.get("summary", {}).get("max_under_slo", {})
    lines = [f"# Max Poisson rate with p99 ≤ {args.slo_ms:.0f} ms on one measured curve — SIMULATED", "",
             f"Command: `python -m batchyard.bench.slo_ceiling --report {args.report} --slo-ms {args.slo_ms:g} --out {args.out}`", "",
             f"One worker, T(B) from the physical-limit tables of `{args.report}` (measured directly on the "
             f"server core before and after its runs); {args.requests} Poisson arrivals a trace, median p99 of "
             f"{args.seeds} traces, bisection to 1/{2 ** STEPS} of the range.", "",
             "| policy | " + " | ".join(f"{k} (req/s)" for k in curves) + " |", "|---" * (len(curves) + 1) + "|"]
    table = {p: {k: r for k, q, r in found if q == p} for p in policies}
    for p in policies:
        lines.append(f"| {p} | " + " | ".join(f"{table[p][k]:.2f}" for k in curves) + " |")
    best = {k: max((table[p][k], p) for p in policies if not np.isnan(table[p][k])) for k in curves}
    lines += ["", "Best of these rules (what scheduling alone reaches on the curve, as far as this grid shows): "
              + "; ".join(f"{k}: {r:.2f}/s ({p})" for k, (r, p) in best.items()) + "."]
    delays = rep.get("plan", {}).get("delays_us", [])
    mb = max(b for b, _ in next(iter(curves.values())))
    as_triton = [f"window:{d},{mb}" for d in delays if f"window:{d},{mb}" in table]
    for k in curves:
        if as_triton:
            r, p = max((table[p][k], p) for p in as_triton)
            lines.append(f"{k}: Triton's live settings ({', '.join(as_triton)}) reach {r:.2f}/s at best ({p}); "
                         f"the best rule / that = **{best[k][0] / r:.2f}×**.")
    lines += live_lines(live, rep.get("plan", {}).get("slo_ms"), args.slo_ms, max(r for r, _ in best.values()))
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps({"curves": curves, "max_rate": table, "best": best,
                                                 "live_max_under_slo": live}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
