"""``batchyard demo``: a whole node on this machine under a short Poisson load.

Embedded config: the dispatcher, one AMX worker running MiniLM-L6 (bf16 weights where the
CPU multiplies bf16 natively, else fp32; real PyTorch) and one *simulated* GPU worker (service time from the seeds' GPU curve scaled to
MiniLM). Prints a latency table per path; rows from the simulated device say so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time

from batchyard.deploy import asset
from batchyard.config import (DispatcherConfig, ModelConfig, NodeConfig, SimConfig, TensorConfig,
                               WorkerConfig)
from batchyard.client import Client
from batchyard.supervisor import running_node
from batchyard.workers.precision import resolve

from .harness import LoadSpec, analyse, run_load
from .report import latency_table

SENTENCES = [
    "Batchyard decides when waiting for one more request stops paying.",
    "The GPU only eats batches that are already fat.",
    "Tail requests always have an escape route: the CPU.",
    "Watch p99, never the average.",
    "A single-threaded dispatcher never touches tensor bytes.",
    "Shared memory moves tensors between the client and the workers.",
    "Intel AMX runs bf16 matrix multiplies in tiles.",
    "Triton's own dynamic batcher is switched off for the models we dispatch to.",
]


def demo_config(run_dir: str, policy: str = "mcb") -> NodeConfig:
    cpus = sorted(os.sched_getaffinity(0))
    minilm = ModelConfig(
        name="minilm", factory="batchyard.workers.models:minilm", max_batch=32,
        inputs=(TensorConfig("input_ids", "int64", (128,)), TensorConfig("attention_mask", "int64", (128,))),
        outputs=(TensorConfig("embedding", "float32", (384,)),))
    return NodeConfig(
        dispatcher=DispatcherConfig(frontend=f"ipc://{run_dir}/frontend", backend=f"ipc://{run_dir}/backend",
                                    policy=policy),
        models=(minilm,),
        workers=(
            WorkerConfig(name="amx0", kind="amx", models=("minilm",), cpus=(cpus[-1],), threads=1,
                         warmup_sizes=(1, 2, 4, 8, 16, 32)),
            # A GPU-like curve: 1.5 ms launch + 0.1 ms per item (simulated).
            WorkerConfig(name="gpu-sim0", kind="sim", models=("minilm",),
                         sim=SimConfig(launch_us=1500.0, per_item_us=100.0, jitter=0.05)),
        )).validate()


def run_demo(duration: float = 10.0, rate: float = 60.0, policy: str = "mcb", triton: bool = False) -> int:
    logging.getLogger("batchyard.up").setLevel(logging.WARNING)  # the table is the output
    with contextlib.ExitStack() as stack:
        run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="batchyard-demo-"))
        node = demo_config(run_dir, policy)
        if triton:  # the GPU worker drives a real tritonserver (on the CPU here) instead of a simulation
            from batchyard.config import TritonConfig
            from batchyard.workers.triton_local import TritonLocal

            print("starting tritonserver (nvidia-pytriton, python backend, MiniLM) ...", flush=True)
            tl = stack.enter_context(TritonLocal(asset("triton", "cpu"),
                                                 models=["model_amx"]))
            gpu = WorkerConfig(name="gpu0", kind="triton", models=("minilm",), warmup_sizes=(1, 2, 4, 8),
                               triton=TritonConfig(url=tl.grpc_url, models={"minilm": "model_amx"}))
            node = NodeConfig(node.dispatcher, node.models, (node.workers[0], gpu)).validate()
        print(f"starting dispatcher, AMX worker (MiniLM-L6 {resolve('auto')}) and "
              f"{'Triton-backed' if triton else 'simulated'} GPU worker ...", flush=True)
        t0 = time.monotonic()
        stack.enter_context(running_node(node))
        print(f"ready in {time.monotonic() - t0:.1f} s; {duration:.0f} s of Poisson load at {rate:.0f} req/s", flush=True)

        # One generator process is plenty at demo rates; one window, no warm-up: the whole run is measured.
        spec = LoadSpec(rate=rate, warmup_s=0.0, window_s=duration, windows=1, stable_windows=1, processes=1)
        rows = run_load(node.dispatcher.frontend, "minilm", spec, inputs="minilm")
        summary = analyse(rows, spec, "batchyard", "demo").summary
        with Client(node.dispatcher.frontend) as c:
            st = c.status()
    print()
    print(f"Batchyard demo — policy {policy}, MiniLM-L6 (seq 128), Poisson {rate:.0f} req/s, {duration:.0f} s")
    print(latency_table(summary, sent=len(rows)))
    print("cost curves the dispatcher learned (T(B) = launch + per_item * B):")
    for key, v in sorted(st.curves.items()):
        print(f"  {key:<12} {v['launch_us'] / 1e3:7.2f} ms + {v['per_item_us'] / 1e3:6.2f} ms*B  "
              f"({v['samples']} batches, {v['outliers']} outliers)")
    print(f"decisions: {st.decisions}")
    return 0 if summary["served"] else 1

