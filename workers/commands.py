"""``batchyard worker``, ``calibrate`` and ``triton-local``: registered through the
``batchyard.commands`` entry point. Arguments only; the work is imported when the command runs."""

from __future__ import annotations

import argparse
import sys


def _run_worker(args) -> int:
    from batchyard.cli import load_node
    from batchyard.config import config_source

    from .main import run_worker

    return run_worker(load_node(args.config, workers=(args.name,)), args.name, config_source(args.config))


def _run_calibrate(args) -> int:
    from batchyard.cli import exit_on_sigterm, load_node

    from .calibrate import CalibrationFailed, calibrate
    from .harness import WorkerExited

    exit_on_sigterm()  # (its worker's folder and socket file were left behind)
    try:
        calibrate(load_node(args.config, workers=tuple(args.worker) if args.worker else None), args.out,
                  sizes=args.sizes or None, reps=args.reps, workers=args.worker)
    except (CalibrationFailed, TimeoutError) as e:
        print(f"batchyard calibrate: {e}", file=sys.stderr)
        return 1
    except WorkerExited as e:  # the worker logged why; a traceback said nothing more
        print(f"batchyard calibrate: {e}", file=sys.stderr)
        # Its status passes through: 78 (EX_CONFIG, a factory typo, a Triton model unlike the
        # spec) is a configuration error, for whatever runs calibrate (a script, CI).
        return e.exit_code if e.exit_code > 0 else 1
    except KeyboardInterrupt:  # (cleaned up on the way out; a traceback said no more)
        print("batchyard calibrate: interrupted", file=sys.stderr)
        return 130
    return 0


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes are >= 1: {text!r}")
    return sizes


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a positive integer, got {text!r}")
    return n


def _port(text: str) -> int:
    """A TCP port, 0 (a free one) to 65535: 99999 reached tritonserver, which listened on
    99999 - 65536, while the command said it was ready on 99999."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port 0-65535 (0: a free one), got {text!r}")
    return n


def _run_triton_local(args) -> int:
    from .triton_local import TritonLocal

    return TritonLocal(args.model_repository, args.grpc_port, args.http_port, args.metrics_port,
                       host=args.host).serve(120)


def register(sub: argparse._SubParsersAction) -> None:
    from batchyard.deploy import asset

    p = sub.add_parser("worker", help="run one worker process of a node")
    p.add_argument("--config", required=True)
    p.add_argument("--name", required=True)
    p.set_defaults(run=_run_worker)
    p = sub.add_parser("calibrate", help="measure T(B) on each worker of a node; write a cost-curve profile")
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True, help="profile JSON to write (name it in [dispatcher] profile)")
    p.add_argument("--sizes", type=_sizes, default=[], help="comma-separated batch sizes (default: powers of two)")
    p.add_argument("--reps", type=_positive, default=5)
    p.add_argument("--worker", action="append", help="only these workers (repeatable)")
    p.set_defaults(run=_run_calibrate)
    p = sub.add_parser("triton-local", help="run nvidia-pytriton's tritonserver on a model repository until SIGTERM")
    p.add_argument("--model-repository", default=str(asset("triton", "cpu")),
                   help="default: the CPU repository shipped with Batchyard")
    p.add_argument("--grpc-port", type=_port, default=8001)
    p.add_argument("--http-port", type=_port, default=8000)
    p.add_argument("--metrics-port", type=_port, default=8002)
    p.add_argument("--host", default="127.0.0.1",
                   help="the address Triton's gRPC, HTTP and metrics servers bind (default: loopback only; "
                        "0.0.0.0 for every interface: its shared-memory API then answers other hosts)")
    p.set_defaults(run=_run_triton_local)
