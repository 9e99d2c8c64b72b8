"""Latency tables from load records."""

from __future__ import annotations

import numpy as np


def percentiles(latencies_s, qs=(50, 90, 99)) -> dict[int, float]:
    arr = np.asarray(latencies_s, dtype=np.float64) * 1e3
    return {q: float(np.percentile(arr, q)) if arr.size else float("nan") for q in qs}


def latency_table(records, duration_s: float) -> str:
    """p50/p90/p99 (ms) and throughput, overall and per path; errors counted by status."""
    rows = [("all", [r for r in records if r.status == "OK"])]
    for path in sorted({r.path for r in records if r.status == "OK"}):
        rows.append((path.rstrip("*") + (" (simulated)" if path.endswith("*") else ""),
                     [r for r in records if r.status == "OK" and r.path == path]))
    lines = [f"{'path':<18}{'count':>7}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'req/s':>9}{'mean B':>8}",
             "-" * 69]
    for name, rs in rows:
        p = percentiles([r.latency_s for r in rs])
        mean_b = np.mean([r.batch_size for r in rs]) if rs else float("nan")
        lines.append(f"{name:<18}{len(rs):>7}{p[50]:>9.2f}{p[90]:>9.2f}{p[99]:>9.2f}"
                     f"{len(rs) / duration_s:>9.1f}{mean_b:>8.1f}")
    errors: dict[str, int] = {}
    for r in records:
        if r.status != "OK":
            errors[r.status] = errors.get(r.status, 0) + 1
    lines.append(f"errors: {errors or 'none'}  (sent {len(records)})")
    return "\n".join(lines)
