"""One live run routing between the real AMX worker and a Triton-backed GPU worker.

``python -m bench.live_triton [--policy mcb] [--rate 20] [--duration 20]``

Both paths serve MiniLM-L6 (bf16 weights): the AMX worker in-process, the GPU worker through
a real tritonserver (python backend, deploy/triton/cpu/model_amx) over gRPC + system shared
memory. On this GPU-less machine Triton runs on the CPU too, standing in for a GPU's speed.
Prints the latency table and the cost curves the dispatcher learned for both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from dispatcher.client import Client
from dispatcher.config import DispatcherConfig, NodeConfig, TritonConfig, WorkerConfig, to_toml
from dispatcher.supervisor import Supervisor
from workers.triton_local import TritonLocal

from .demo import SENTENCES, demo_config
from .loadgen import poisson_load
from .report import latency_table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="mcb")
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    from workers.models import tokenize

    ids, mask = tokenize(SENTENCES)
    repo = Path(__file__).resolve().parents[1] / "deploy" / "triton" / "cpu"
    with TritonLocal(repo, models=["model_amx"]) as tl, tempfile.TemporaryDirectory(prefix="by-lt-") as d:
        base = demo_config(d, args.policy)
        gpu = WorkerConfig(name="gpu0", kind="triton", models=("minilm",), warmup_sizes=(1, 2, 4, 8, 16, 32),
                           triton=TritonConfig(url=tl.grpc_url, models={"minilm": "model_amx"}, inflight=2))
        node = NodeConfig(DispatcherConfig(**{**base.dispatcher.__dict__, "policy": args.policy}), base.models,
                          (base.workers[0], gpu)).validate()
        cfg = Path(d) / "node.toml"
        cfg.write_text(to_toml(node))
        sup = Supervisor(cfg, node, log_level="WARNING")
        sup.start()
        try:
            sup.wait_ready(300)
            make = lambda i: {"input_ids": ids[i % 8:i % 8 + 1], "attention_mask": mask[i % 8:i % 8 + 1]}
            recs = asyncio.run(poisson_load(node.dispatcher.frontend, "minilm", make, args.rate, args.duration, seed=9))
            with Client(node.dispatcher.frontend) as c:
                st = c.status()
        finally:
            sup.stop()
    print(f"live: policy {args.policy}, AMX worker + Triton-backed GPU worker (Triton on CPU), MiniLM, "
          f"Poisson {args.rate:.0f}/s, {args.duration:.0f} s")
    print(latency_table(recs, args.duration))
    print("learned cost curves:")
    for k, v in st.curves.items():
        print(f"  {k}: T(B) = {v['launch_us'] / 1e3:.2f} ms + {v['per_item_us'] / 1e3:.2f} ms*B ({v['samples']} batches, "
              f"{v['outliers']} outliers); knots {v['knots_us']}")
    print("decisions:", st.decisions)
    if args.out:
        Path(args.out).write_text(json.dumps({"curves": st.curves, "decisions": st.decisions,
                                              "table": latency_table(recs, args.duration)}, indent=1))


if __name__ == "__main__":
    main()
