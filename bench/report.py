"""How the bench presents results: its one percentile method, the terminal tables (``batchyard
bench`` and ``batchyard demo``), and bench.json / bench.md / PNG plots of harness reports.

Percentiles are ``np.percentile`` with its default linear interpolation, on the raw latency
arrays: exact, with no histogram resolution to reason about. Every summary in bench/ uses it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from batchyard.protocol import Status

if TYPE_CHECKING:  # harness imports this module: no cycle at run time
    from .harness import Report


def percentiles_ms(latency_us, qs=(50, 90, 99)) -> dict[float, float]:
    """{q: the q-th percentile in ms} of latencies in µs; NaN for each q when there are none."""
    arr = np.asarray(latency_us, dtype=np.float64)
    if not arr.size:
        return {q: float("nan") for q in qs}
    return {q: float(v) / 1e3 for q, v in zip(qs, np.percentile(arr, qs))}


def latency_table(summary: dict, sent: int) -> str:
    """p50/p90/p99 (ms), completions/s and mean batch, overall and per path, from a harness summary
    (``harness.summarise``); errors counted by status name."""
    lines = [f"{'path':<18}{'count':>7}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'req/s':>9}{'mean B':>8}", "-" * 69]
    paths = [(k[5:], v) for k, v in summary.items() if k.startswith("path_")]
    served = sum(v["served"] for _, v in paths)
    mean_b = sum(v["mean_batch"] * v["served"] for _, v in paths) / served if served else float("nan")
    rows = [("all", summary["served"], summary["p50_ms"], summary["p90_ms"], summary["p99_ms"],
             summary["throughput_rps"], mean_b)]
    rows += [(name + (" (simulated)" if v["simulated"] else ""), v["served"], v["p50_ms"], v["p90_ms"], v["p99_ms"],
              v["throughput_rps"], v["mean_batch"]) for name, v in paths]
    for name, n, p50, p90, p99, rps, b in rows:
        lines.append(f"{name:<18}{n:>7}{p50:>9.2f}{p90:>9.2f}{p99:>9.2f}{rps:>9.1f}{b:>8.1f}")
    errors = {status_name(int(s)): n for s, n in summary["errors"].items()}
    lines.append(f"errors: {errors or 'none'}  (sent {sent})")
    return "\n".join(lines)


def status_name(status: int) -> str:
    try:
        return Status(status).name
    except ValueError:
        return f"status {status}"


def unavailable_of_sent(r: Report) -> int:
    """The requests sent in ``r``'s windows that failed UNAVAILABLE, whenever they failed: the
    node went away or could not be reached (``batchyard bench`` exits 1 on any)."""
    return r.summary.get("failed_of_sent", {}).get(str(int(Status.UNAVAILABLE)), 0)


_LATENCIES = (("p50", "p50_ms"), ("p90", "p90_ms"), ("p99", "p99_ms"), ("p99.9", "p999_ms"))


def table(reports: list[Report]) -> str:
    width = max([26, *(len(r.label) + 1 for r in reports)])  # (a longer label pushed every column out of line)
    # Each latency column as wide as its widest figure and a space: at 8, latencies of 10 s and
    # more ran into each other ("7005.5311322.73").
    lat = {key: max([8, *(len(f"{r.summary[key]:.2f}") + 1 for r in reports)]) for _, key in _LATENCIES}
    head = (f"{'target':<{width}}{'offered/s':>10}{'tput/s':>9}{'good/s':>9}"
            + "".join(f"{name:>{lat[key]}}" for name, key in _LATENCIES) + f"{'errors':>8}  stable")
    lines = [head, "-" * len(head)]
    for r in reports:
        s = r.summary
        errs = sum(s["errors"].values())
        offered = f"{r.offered_rps:>10.1f}" if r.offered_rps else f"{'-':>10}"  # a closed loop offers no rate
        stable = "n/a" if r.stable is None else "yes" if r.stable else "NO"
        lost = unavailable_of_sent(r)
        lines.append(f"{r.label:<{width}}{offered}{s['throughput_rps']:>9.1f}{s['goodput_rps']:>9.1f}"
                     + "".join(f"{s[key]:>{lat[key]}.2f}" for _, key in _LATENCIES) + f"{errs:>8}  "
                     f"{stable}{'' if r.schedule_kept else ' (generator behind schedule)'}"
                     f"{f' ({lost} sent in the windows failed UNAVAILABLE)' if lost else ''}")
    return "\n".join(lines)


def nan_to_null(obj):
    """``obj`` with every NaN or infinite float as None: JSON has no NaN, and strict parsers
    (JavaScript's, Go's, serde) refused the files where an empty percentile was a bare NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: nan_to_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [nan_to_null(v) for v in obj]
    if isinstance(obj, np.generic):
        return nan_to_null(obj.item())
    return obj


def write_outputs(reports: list[Report], out: Path, title: str, notes: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(nan_to_null([{k: v for k, v in asdict(r).items() if k != "latencies_ms"}
                                                            for r in reports]), indent=1, default=float, allow_nan=False))
    md = [f"# {title}", "", notes, "", "```", table(reports), "```", "",
          "Latencies in ms, client-observed, of the requests completed in the measured windows (np.percentile, "
          "linear); throughput = completions/s in those windows (as perf_analyzer); goodput = the completions "
          "within their deadline and the SLO; errors = the failures that came in those windows "
          "(`failed_of_sent` in bench.json: of the requests sent in them, whenever they failed). "
          "`server_split` (with --metrics-url) is the dispatcher's counters over the whole run, warm-up and "
          "the drain after the windows included.",
          "", "![p99 vs offered load](p99_vs_load.png)", "", "![latency CDF](latency_cdf.png)", ""]
    (out / "bench.md").write_text("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label in dict.fromkeys(r.label.split(" @")[0] for r in reports):
        rs = [r for r in reports if r.label.split(" @")[0] == label and r.offered_rps]  # (closed loops: no load)
        ax.plot([r.offered_rps for r in rs], [r.summary["p99_ms"] for r in rs], marker="o", label=label)
    ax.set_xlabel("offered load, requests/s")
    ax.set_ylabel("p99 latency, ms")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "p99_vs_load.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in reports:
        lat = np.sort(np.asarray(r.latencies_ms))
        if lat.size:
            ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=r.label, lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("latency, ms")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend(fontsize=6)
    else:  # (every run failed: matplotlib warned of a legend with nothing in it)
        ax.text(0.5, 0.5, "no request completed", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("latency CDF", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110)
    plt.close(fig)
