"""Threads sharing one Client vs a Client each (issue 9):
``python -m batchyard.bench.client_threads [--runs 3] [--client-file PATH]``.

One node, one simulated worker taking 10 ms per batch (whatever its size). Closed loop: each
thread sends its next request when its previous one is answered. Three configurations, run in
turn ``--runs`` times on the same node: 1 thread; 8 threads sharing one Client; 8 threads with a
Client each. Printed: requests/s (median and every run), the mean batch size the worker saw, and
the ratio shared / separate (the goal: >= 0.9; threads sharing a Client must not wait on each
other's replies, so their requests get batched like separate clients' requests do).

Expect two regimes run to run, with shared and separate clients alike: either every thread's
request rides in one batch (~8 per batch, ~500 req/s here), or the threads split into two
groups that take turns on the worker (~4 per batch, ~340 req/s) and stay split, as the dispatcher
sends a group the moment the worker frees. The mean batch column says which one a run was in;
use several runs.

``--client-file`` measures another Client implementation against the same node, e.g. the one
in git: ``git show HEAD:dispatcher/client.py > /tmp/old/client_head.py`` then
``--client-file /tmp/old/client_head.py`` (it is loaded as a module of the batchyard package,
so its relative imports resolve).
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from batchyard.client import Client
from batchyard.config import DispatcherConfig, ModelConfig, NodeConfig, SimConfig, TensorConfig, WorkerConfig
from batchyard.supervisor import running_node

MODEL = ModelConfig(name="sum", factory="batchyard.workers.models:mlp", max_batch=16,
                    inputs=(TensorConfig("x", "float32", (4,)),), outputs=(TensorConfig("y", "float32", (2,)),))
X = np.ones((1, 4), np.float32)


def node_config(run_dir: str, launch_ms: float) -> NodeConfig:
    return NodeConfig(
        dispatcher=DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
        models=(MODEL,),
        workers=(WorkerConfig(name="sim0", kind="sim", models=("sum",),
                              sim=SimConfig(launch_us=launch_ms * 1000.0, per_item_us=0.0)),),
    ).validate()


def load_client_class(path: str) -> type:
    """``Client`` from another implementation's source file, as a module of this package."""
    spec = importlib.util.spec_from_file_location("batchyard._bench_client_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.Client


def closed_loop(client_cls: type, address: str, threads: int, shared: bool,
                warmup_s: float, window_s: float) -> tuple[float, float]:
    """-> (requests/s over the window, mean batch size the replies report)."""
    clients = [client_cls(address) for _ in range(1 if shared else threads)]
    for c in clients:
        c.model_info("sum")
    done = [0] * threads
    batch_sum = [0] * threads
    stop = threading.Event()
    errors: list[BaseException] = []
    go = threading.Barrier(threads + 1)

    def lane(k: int) -> None:
        c = clients[0 if shared else k]
        go.wait()
        try:
            while not stop.is_set():
                r = c.infer("sum", {"x": X})
                done[k] += 1
                batch_sum[k] += r.timing.batch_size
        except BaseException as e:  # reported by the caller
            errors.append(e)

    lanes = [threading.Thread(target=lane, args=(k,), daemon=True) for k in range(threads)]
    for t in lanes:
        t.start()
    go.wait()
    time.sleep(warmup_s)  # the measurement window, not synchronisation
    n0, b0, t0 = sum(done), sum(batch_sum), time.perf_counter()
    time.sleep(window_s)
    n1, b1, t1 = sum(done), sum(batch_sum), time.perf_counter()
    stop.set()
    for t in lanes:
        t.join()
    for c in clients:
        c.close()
    if errors:
        raise errors[0]
    n = n1 - n0
    return n / (t1 - t0), (b1 - b0) / max(n, 1)


def main(argv=None) -> int:
    from .commands import at_least, existing_file

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=at_least(1), default=3)
    ap.add_argument("--threads", type=at_least(1), default=8)
    ap.add_argument("--window", type=float, default=3.0, help="seconds measured per configuration and run")
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--launch-ms", type=float, default=10.0, help="simulated time per batch")
    ap.add_argument("--client-file", type=existing_file, default=None,  # (argparse runs the type on a str default)
                    help="measure the Client defined in this file instead")
    args = ap.parse_args(argv)
    client_cls = load_client_class(args.client_file) if args.client_file else Client
    n = args.threads
    configs = {"1 thread": (1, True), f"{n} threads, one shared Client": (n, True),
               f"{n} threads, a Client each": (n, False)}
    rates: dict[str, list[float]] = {k: [] for k in configs}
    batches: dict[str, list[float]] = {k: [] for k in configs}
    run_dir = tempfile.mkdtemp(prefix="by-bench-", dir="/tmp")
    node = node_config(run_dir, args.launch_ms)
    try:
        with running_node(node, ready_timeout_s=60):
            address = node.dispatcher.frontend
            for _ in range(args.runs):  # configurations interleaved, so drift on a shared host hits all alike
                for name, (threads, shared) in configs.items():
                    rate, batch = closed_loop(client_cls, address, threads, shared, args.warmup, args.window)
                    rates[name].append(rate)
                    batches[name].append(batch)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    source = args.client_file or "batchyard.client"
    print(f"Client from {source}; simulated worker {args.launch_ms:g} ms per batch; closed loop; "
          f"{args.runs} runs x {args.window:g} s")
    for name in configs:
        runs = ", ".join(f"{r:.0f}" for r in rates[name])
        print(f"  {name:<32} {statistics.median(rates[name]):7.1f} req/s (runs {runs})"
              f"   mean batch {statistics.median(batches[name]):4.1f}")
    shared = statistics.median(rates[f"{n} threads, one shared Client"])
    separate = statistics.median(rates[f"{n} threads, a Client each"])
    print(f"  shared / separate: {shared / separate:.2f} (goal >= 0.9)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
