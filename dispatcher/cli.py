"""The ``batchyard`` command."""

from __future__ import annotations

import argparse
import logging
import sys

from .config import ConfigError, load_config


def _node(args):
    try:
        return load_config(args.config)
    except ConfigError as e:
        print(f"batchyard: {e}", file=sys.stderr)
        raise SystemExit(2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="batchyard", description="Batchyard inference dispatcher")
    ap.add_argument("--log-level", default="INFO")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("dispatcher", help="run the dispatcher process of a node")
    p.add_argument("--config", required=True)
    p = sub.add_parser("worker", help="run one worker process of a node")
    p.add_argument("--config", required=True)
    p.add_argument("--name", required=True)
    p = sub.add_parser("up", help="start a node's dispatcher and workers; restart workers that die")
    p.add_argument("--config", required=True)
    p = sub.add_parser("triton-local", help="run nvidia-pytriton's tritonserver on a model repository until SIGTERM")
    p.add_argument("--model-repository", default="deploy/triton/cpu")
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--metrics-port", type=int, default=8002)
    p = sub.add_parser("status", help="a running dispatcher's workers, learned cost curves, lambda and decisions")
    p.add_argument("--address", required=True, help="the dispatcher's frontend, e.g. tcp://127.0.0.1:7755")
    p = sub.add_parser("calibrate", help="measure T(B) on each worker of a node; write a cost-curve profile")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True, help="profile JSON to write (name it in [dispatcher] profile)")
    p.add_argument("--sizes", default="", help="comma-separated batch sizes (default: powers of two)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--worker", action="append", help="only these workers (repeatable)")
    p = sub.add_parser("bench", help="perf_analyzer-style load against a dispatcher or a Triton server")
    from bench.bench_cli import add_arguments

    add_arguments(p)
    p = sub.add_parser("demo", help="dispatcher + AMX worker (MiniLM) + simulated GPU, Poisson load, latency table")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    p.add_argument("--rate", type=float, default=60.0, help="mean requests per second (Poisson)")
    p.add_argument("--policy", default="mcb")
    p.add_argument("--triton", action="store_true", help="GPU worker backed by a real local tritonserver")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    if args.cmd == "dispatcher":
        from .server import run_dispatcher

        run_dispatcher(_node(args))
        return 0
    if args.cmd == "worker":
        from workers.main import run_worker

        return run_worker(_node(args), args.name)
    if args.cmd == "up":
        from .supervisor import run_up

        return run_up(args.config, _node(args), args.log_level.upper())
    if args.cmd == "triton-local":
        import signal

        from workers.triton_local import TritonLocal

        tl = TritonLocal(args.model_repository, args.grpc_port, args.http_port, args.metrics_port)
        try:
            tl.start(ready_timeout_s=120)
            print(f"tritonserver ready: gRPC {tl.grpc_url}, metrics http://127.0.0.1:{tl.metrics_port}/metrics",
                  flush=True)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
            signal.sigwait({signal.SIGTERM, signal.SIGINT})
        finally:
            tl.close()
        return 0
    if args.cmd == "status":
        import json

        import msgspec

        from .client import Client

        with Client(args.address) as c:
            print(json.dumps(msgspec.to_builtins(c.status(timeout=5.0)), indent=1))
        return 0
    if args.cmd == "calibrate":
        from .calibrate import calibrate

        sizes = [int(x) for x in args.sizes.split(",") if x] or None
        calibrate(_node(args), args.out, sizes=sizes, reps=args.reps, workers=args.worker)
        return 0
    if args.cmd == "bench":
        from bench.bench_cli import main as bench_main

        return bench_main(args)
    if args.cmd == "demo":
        from bench.demo import run_demo

        return run_demo(duration=args.duration, rate=args.rate, policy=args.policy, triton=args.triton)
    return 2


if __name__ == "__main__":
    sys.exit(main())
