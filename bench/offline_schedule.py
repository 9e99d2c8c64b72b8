"""The best offline schedule a search finds for a trace: an UPPER bound on the optimum's mean
latency, to set MCB's mean against (issue 10). Everything here is SIMULATED (cost-curve devices).

``python -m batchyard.bench.offline_schedule [--requests 5000] [--out bench/results]``

The search knows the whole trace in advance. Its schedules are *FIFO blocks*: the trace is cut
into runs of consecutive requests, each run one batch on one device, started as soon as its last
request has arrived and its device is free. Every such schedule can be run, so the best one found
is an upper bound on the optimum (the optimum may be lower: a schedule outside FIFO blocks, or
one the beam dropped). It is not a lower bound, and it is not MCB's own schedule.

Beam search over cuts: after the first ``i`` requests, a state is the devices' free times and
the summed latency so far. From each state every (device, run length) is tried; at each cut
only the ``beam`` states with the lowest ``summed latency + weight x (device time still busy
past the next arrival)`` are kept (the weight prices the work a state leaves for the requests to
come). No single weight is best on every trace, so several are run and the best schedule kept.
"""

from __future__ import annotations

import argparse
import heapq
import json
import time
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path

import numpy as np

from batchyard.policy_mcb import amortises_launch

from .simulator import Device, simulate

WEIGHTS = (1.0, 4.0, 8.0)
BEAM = 16
# Runs on a device with no launch cost (T linear through 0) never gain from more than a few
# requests: each would wait for the others' compute.
LINEAR_RUN_MAX = 4
POLICIES = ("mcb", "gpu-only", "greedy", "escape:1", "escape:2", "escape:3", "escape:4", "three-segment")


def interchangeable(devices: list[Device]) -> dict[int, list[int]]:
    """Device index -> the indices of every device with the same curve (itself included).
    Such devices are interchangeable: a state is their free times sorted within each group."""
    kind = [(d.launch_s, d.per_item_s, d.max_batch, d.points) for d in devices]
    return {k: [q for q in range(len(devices)) if kind[q] == kind[k]] for k in range(len(devices))}


def busy_until(free: tuple, group: list[int], d: int, t: float) -> tuple:
    """``free`` with device d busy until t, renumbered: free times sorted within d's group."""
    out = list(free)
    out[d] = t
    if len(group) > 1:
        for k, v in zip(group, sorted(out[k] for k in group)):
            out[k] = v
    return tuple(out)


@dataclass
class Schedule:
    mean_s: float
    blocks: list  # (first request, run length, device index, start time), in trace order


def search(arrivals: np.ndarray, devices: list[Device], beam: int = BEAM, weight: float = 4.0) -> Schedule:
    """The best FIFO-block schedule the beam finds (module docstring)."""
    arr = np.asarray(arrivals, dtype=np.float64)
    n, m = len(arr), len(devices)
    prefix = np.concatenate([[0.0], np.cumsum(arr)])
    times = [np.array([0.0] + [d.curve().predict(b) for b in range(1, d.max_batch + 1)]) for d in devices]
    # From the curve, as MCB decides it, not the launch_s field: a device given by measured
    # points has launch_s 0.
    run_max = [d.max_batch if amortises_launch(d.curve()) else min(d.max_batch, LINEAR_RUN_MAX) for d in devices]
    # States that differ only in which of several identical devices is busy are one state.
    group_of = interchangeable(devices)

    # buckets[i]: a max-heap (by negated score) of at most `beam` states at cut i:
    # (-score, cost, tie-break, free times, path); path = (first, length, device, start, previous
    # path). The tie-break (a count) keeps equal scores from comparing paths.
    buckets: list = [[] for _ in range(n + 1)]
    worst = np.full(n + 1, np.inf)  # score a newcomer must beat at each cut (inf while not full)
    buckets[0] = [(0.0, 0.0, 0, (0.0,) * m, None)]
    tie = 0
    next_arrival = np.append(arr, np.inf)
    for i in range(n):
        states = sorted(buckets[i], reverse=True)  # best first: their runs fill the next cuts' beams
        buckets[i] = None
        seen = set()
        for _, cost, _, free, path in states:
            if free in seen:
                continue
            seen.add(free)
            for d in range(m):
                if any(free[k] == free[d] for k in group_of[d] if k < d):
                    continue  # an identical device free at the same time was tried
                r = min(run_max[d], n - i)
                j = np.arange(i + 1, i + r + 1)  # the cut after each run length
                start = np.maximum(free[d], arr[i:i + r])
                finish = start + times[d][1:r + 1]
                costs = cost + (j - i) * finish - (prefix[j] - prefix[i])
                nxt = next_arrival[j]
                busy_others = np.zeros(r)
                for k in range(m):
                    if k != d:
                        busy_others += np.maximum(0.0, free[k] - nxt)
                busy = busy_others + np.maximum(0.0, finish - nxt)
                busy[j == n] = 0.0
                scores = costs + weight * busy
                for q in np.nonzero(scores < worst[j])[0]:
                    cut = i + q + 1
                    tie += 1
                    entry = (-float(scores[q]), float(costs[q]), tie,
                             busy_until(free, group_of[d], d, float(finish[q])), (i, q + 1, d, float(start[q]), path))
                    bucket = buckets[cut]
                    if len(bucket) < beam:
                        heapq.heappush(bucket, entry)
                    elif entry[0] > bucket[0][0]:
                        heapq.heapreplace(bucket, entry)
                    if len(bucket) == beam:
                        worst[cut] = -bucket[0][0]
    _, cost, _, _, path = min(buckets[n], key=lambda e: e[1])
    blocks = []
    while path is not None:
        first, length, d, start, path = path
        blocks.append((first, length, d, start))
    return Schedule(cost / n, blocks[::-1])


def replay(arrivals: np.ndarray, devices: list[Device], blocks: list) -> float:
    """Check that ``blocks`` is a schedule the devices can run (each batch starts after its last
    request arrived and once its device is free, every request in exactly one batch, in trace
    order) and return its mean latency, computed afresh."""
    arr = np.asarray(arrivals, dtype=np.float64)
    free = (0.0,) * len(devices)
    group_of = interchangeable(devices)
    total, expect = 0.0, 0
    for first, length, d, start in blocks:
        assert first == expect and 1 <= length <= devices[d].max_batch, (first, length)
        assert start >= arr[first + length - 1] and start >= free[d] - 1e-15, (first, start, free[d])
        finish = start + devices[d].curve().predict(length)
        total += float(np.sum(finish - arr[first:first + length]))
        free = busy_until(free, group_of[d], d, finish)  # the search's numbering of identical devices
        expect = first + length
    assert expect == len(arr)
    return total / len(arr)


def point(args) -> dict:
    """One (scenario, load) of the simulator report, on the first ``n`` arrivals of its trace."""
    from .sim_report import SCENARIOS, _cut, scenario_trace

    scen, load, n, n_full = args
    devices = SCENARIOS[scen][0]
    trace = _cut(scenario_trace(scen, load, n_full), n)  # the head of sim_report's trace
    row = {"scenario": scen, "load": load, "requests": len(trace)}
    row["policies_ms"] = {p: simulate(p, trace, devices).summary()["mean_ms"] for p in POLICIES}
    t0 = time.perf_counter()
    found = {}
    for w in WEIGHTS:
        s = search(trace.arrivals, devices, weight=w)
        found[w] = replay(trace.arrivals, devices, s.blocks) * 1e3
    row["search_s"] = time.perf_counter() - t0
    row["search_ms"] = {str(w): v for w, v in found.items()}
    row["searched_ms"] = min(found.values())
    row["offline_ms"] = min(row["searched_ms"], min(row["policies_ms"].values()))
    row["mcb_over_offline"] = row["policies_ms"]["mcb"] / row["offline_ms"]
    row["lower_bound_ms"] = min(d.curve().predict(1) for d in devices) * 1e3
    return row


def markdown(rep: dict) -> str:
    L = ["# Offline schedule vs MCB — SIMULATED devices", "",
         f"First {rep['n']:,} arrivals of each trace of `sim_report` (same scenarios, loads and seeds). "
         f"Reproduce: `python -m batchyard.bench.offline_schedule --requests {rep['n']} --full {rep.get('full', 100_000)}"
         f"{' --trace-seeds legacy' if rep.get('trace_seeds', 'legacy') == 'legacy' else ''}` ({rep['wall_s']:.0f} s "
         "on 2 cores).", "",
         "- **searched**: the best FIFO-block schedule a beam search finds knowing the whole trace "
         f"(beam {BEAM}, weights {', '.join(str(w) for w in WEIGHTS)}; `bench/offline_schedule.py` says how). "
         "Each schedule is replayed and checked feasible.",
         "- **offline**: the lower of *searched* and every policy's own schedule of the same arrivals "
         f"({', '.join(POLICIES)}): the best schedule known, an UPPER bound on the optimum's mean.",
         "- **lower bound**: the fastest path's T(1) (no request ever waits or shares a batch): a valid relaxation.",
         "- The optimum lies between *lower bound* and *offline*. MCB / offline ≤ 1.2 is the issue's bar.", "",
         f"**MCB's mean ≤ 1.2 × offline at {sum(r['mcb_over_offline'] <= 1.2 for r in rep['rows'])} of "
         f"{len(rep['rows'])} points; the search beats every policy's schedule at "
         f"{sum(r['searched_ms'] < min(r['policies_ms'].values()) for r in rep['rows'])}; worst MCB / offline "
         f"{max(r['mcb_over_offline'] for r in rep['rows']):.3f}.**", "",
         "| scenario | load | MCB mean ms | best policy | its mean | searched | offline | MCB / offline | lower bound |",
         "|---|---|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        best = min(r["policies_ms"], key=r["policies_ms"].get)
        L.append(f"| {r['scenario']} | {r['load'] * 100:.0f}% | {r['policies_ms']['mcb']:.4f} | {best} | "
                 f"{r['policies_ms'][best]:.4f} | {r['searched_ms']:.4f} | {r['offline_ms']:.4f} | "
                 f"{r['mcb_over_offline']:.3f} | {r['lower_bound_ms']:.3f} |")
    return "\n".join(L) + "\n"


def main(argv=None) -> None:
    from .commands import at_least
    from .sim_report import SCENARIOS, scenario_names

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--requests", type=at_least(1), default=5000, help="arrivals per point (the head of sim_report's trace)")
    ap.add_argument("--full", type=at_least(1), default=200_000,
                    help="the sim_report trace length whose head is taken (the report's --requests: the step "
                         "scenarios' traces depend on their length; the committed results used 100000)")
    ap.add_argument("--trace-seeds", choices=("named", "legacy"), default="named",
                    help="sim_report's trace seeds (legacy: those of the results committed up to 88925ac)")
    ap.add_argument("--scenarios", type=scenario_names, default=",".join(SCENARIOS))
    ap.add_argument("--jobs", type=at_least(1), default=2)
    ap.add_argument("--merge", action="store_true",
                    help="replace only these scenarios' rows in the report already in --out (same --requests)")
    args = ap.parse_args(argv)
    from . import sim_report

    sim_report.TRACE_SEEDS = args.trace_seeds  # before the pool forks
    out = Path(args.out)
    # Checked before the search, which takes minutes a point; the merge itself passed the path
    # where the report belonged and failed with a TypeError after every point was searched.
    to_merge = sim_report.report_to_merge(out / "offline_schedule.json", args.requests) if args.merge else None
    full = to_merge.get("full", 100_000) if to_merge is not None else args.full  # files before "full": 100000
    if full != args.full:
        raise SystemExit(f"{out / 'offline_schedule.json'} was run with --full {full}, not {args.full}: cannot merge")
    t0 = time.perf_counter()
    tasks = [(s, load, args.requests, args.full) for s in args.scenarios.split(",") for load in SCENARIOS[s][2]]
    with Pool(args.jobs) as pool:
        rows = pool.map(point, tasks, chunksize=1)
    if to_merge is not None:
        rep = sim_report.merged(to_merge, rows)
    else:
        rep = {"simulated": True, "rows": sim_report.in_order(rows)}
    # All three checked equal to the merged report's (an older file lacks the last two: written here).
    rep.update(n=args.requests, full=args.full, trace_seeds=args.trace_seeds)
    rep["wall_s"] = rep.get("wall_s", 0.0) + time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "offline_schedule.json").write_text(json.dumps(rep, indent=1))
    (out / "offline_schedule.md").write_text(markdown(rep))
    print(markdown(rep))


if __name__ == "__main__":
    main()
