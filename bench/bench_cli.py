"""Argument handling of ``batchyard bench`` (the harness is bench/harness.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .harness import LoadSpec, analyse, run_load, scrape, server_split, table, write_outputs


def _targets(args, address):
    """(policy label, address) pairs: the given address, or one fresh node per --compare policy."""
    if not args.compare:
        yield "", address
        return
    from dispatcher.config import DispatcherConfig, NodeConfig, load_config
    from dispatcher.supervisor import running_node

    if not args.config:
        raise SystemExit("bench: --compare needs --config (the node to start once per policy)")
    base = load_config(args.config)
    for policy in args.compare:
        disp = DispatcherConfig(**{**base.dispatcher.__dict__, "policy": policy})
        with running_node(NodeConfig(disp, base.models, base.workers).validate()):
            yield policy, disp.frontend


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="dispatcher frontend, e.g. tcp://127.0.0.1:7755")
    p.add_argument("--model", default="minilm")
    p.add_argument("--inputs", default="zeros", choices=["zeros", "minilm"],
                   help="request contents: zeros of the model's spec, or tokenized MiniLM sentences")
    p.add_argument("--target", default="batchyard", choices=["batchyard", "triton"])
    p.add_argument("--triton-url", default="127.0.0.1:8001")
    g = p.add_argument_group("load (as perf_analyzer)")
    g.add_argument("--concurrency", type=int, default=0, help="closed loop with N requests in flight")
    g.add_argument("--request-rate", type=float, default=0.0)
    g.add_argument("--distribution", default="poisson", choices=["poisson", "constant"])
    g.add_argument("--request-intervals", default="", help="file of inter-request intervals (s)")
    g.add_argument("--profile", default="", help="step:R1,R2 | sine:MEAN,AMP,PERIOD | bursts:LOW,HIGH")
    g.add_argument("--sweep-rates", default="", help="comma-separated rates: one run each (p99 vs load)")
    g.add_argument("--priority-mix", default="0,1,0", help="fractions high,normal,low")
    g.add_argument("--deadlines-ms", default="0,0,0", help="per class; 0 = dispatcher default")
    g.add_argument("--processes", type=int, default=2)
    g.add_argument("--warmup", type=float, default=2.0)
    g.add_argument("--window", type=float, default=5.0)
    g.add_argument("--windows", type=int, default=3)
    g.add_argument("--stability", type=float, default=0.15)
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-url", default="", help="the dispatcher's /metrics: adds the server-side queue/compute split")
    p.add_argument("--compare", action="append", default=[], metavar="POLICY",
                   help="repeatable: start the node of --config once per policy and replay the same seeded load")
    p.add_argument("--config", default="", help="node config for --compare")
    p.add_argument("--out", default="", help="folder for bench.json, bench.md and plots")
    p.add_argument("--measure-ceiling", action="store_true",
                   help="measure this load generator's own ceiling against a no-op worker, then exit")


def spec_from(args, rate: float = 0.0) -> LoadSpec:
    floats = lambda s: tuple(float(x) for x in s.split(","))
    return LoadSpec(concurrency=args.concurrency, rate=rate or args.request_rate, distribution=args.distribution,
                    intervals_file=args.request_intervals, profile=args.profile,
                    priority_mix=floats(args.priority_mix), deadlines_ms=floats(args.deadlines_ms),
                    warmup_s=args.warmup, window_s=args.window, windows=args.windows, stability=args.stability,
                    processes=args.processes, seed=args.seed)


def measure_ceiling(processes: int, concurrency: int = 256, window: float = 5.0) -> float:
    from .dispatch_bench import _NodeRun

    with _NodeRun() as r:
        spec = LoadSpec(concurrency=concurrency, warmup_s=1.0, window_s=window, windows=1, processes=processes,
                        stable_windows=1)
        rep = analyse(run_load(r.node.dispatcher.frontend, "noop", spec), spec, "batchyard", "no-op ceiling")
    return rep.summary["throughput_rps"]


def main(args) -> int:
    if args.measure_ceiling:
        rps = measure_ceiling(args.processes)
        print(f"load generator ceiling: {rps:,.0f} requests/s ({args.processes} processes, closed loop, "
              f"256 in flight, no-op worker behind a dispatcher on this machine)")
        return 0
    address = args.triton_url if args.target == "triton" else args.address
    if not address and not args.compare:
        raise SystemExit("bench: give --address, --compare with --config, or --target triton --triton-url")
    rates = [float(x) for x in args.sweep_rates.split(",") if x] or [args.request_rate]
    if not args.concurrency and not any(rates) and not args.request_intervals and not args.profile:
        raise SystemExit("bench: choose a load: --concurrency, --request-rate, --sweep-rates, "
                         "--request-intervals or --profile")
    reports = []
    for policy, address in _targets(args, address):
        for rate in rates:
            spec = spec_from(args, rate)
            name = f"{args.target}[{policy}]" if policy else args.target
            label = f"{name}:{args.model} @{rate:g}/s" if rate else f"{name}:{args.model}"
            before = scrape(args.metrics_url) if args.metrics_url else None
            rows = run_load(address, args.model, spec, target=args.target, inputs=args.inputs, progress=True)
            rep = analyse(rows, spec, args.target, label)
            if before is not None:
                rep.summary["server_split"] = server_split(before, scrape(args.metrics_url))
            reports.append(rep)
            print(table(reports[-1:]), flush=True)
    print()
    print(table(reports))
    if args.out:
        write_outputs(reports, Path(args.out), f"batchyard bench: {args.target} {args.model}")
        print(f"(written to {args.out}/)")
    return 0
