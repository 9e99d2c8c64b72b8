"""Priorities under a flood, live: Batchyard against Triton's own priority levels (seed 004's shape).

``python -m batchyard.bench.priority_vs_triton [--quick] [--out bench/results/priority]``

Seed 004 (XSched's Triton experiment, Fig. 15a): three classes of one model — high (low rate,
latency-critical), normal, low (a flood) — and the high class's p99 under the flood against its
p99 alone, for native Triton, Triton with its priority config, and a scheduler with priorities.
Here, on the real MiniLM-L6 bf16 model, the server side on ``--server-cpus`` and the load
generator on ``--load-cpu`` (taskset), as bench/vs_triton.py does:

- Triton 2.51 (nvidia-pytriton), python backend, ``dynamic_batching`` with vs_triton's one
  forward pass per dynamic batch, max batch 32; (a) without priority levels, (b) with
  ``priority_levels: 3 default_priority_level: 2``. Both with ``default_queue_policy { timeout_action:
  REJECT default_timeout_microseconds: 30 s allow_timeout_override: true }``: a request's own,
  shorter ``timeout`` then applies (Triton only lets a request *lower* the default).
- Batchyard: ``batchyard up`` (policy mcb, one AMX worker, max batch 32, the KServe v2 front door).
- One load tool for all: the harness's triton target (tritonclient gRPC aio, open-loop Poisson,
  one stream whose requests are drawn high/normal/low in proportion to the class rates: the
  superposition of three independent Poisson streams), sending Triton's schedule-policy
  parameters: ``priority`` 1/2/3 (the front door maps them to Batchyard's classes 0/1/2) and, for
  the low class, ``timeout`` (server side) so that the flood's queue stays bounded.

Rates are fractions of the core's limit, measured first as vs_triton does (max over B of B/T(B)
of the AMX worker driven directly). Runs per server: the high class alone, then all three.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from batchyard.deploy import asset
from batchyard.workers.precision import resolve
from batchyard.workers.triton_local import TritonLocal

from .harness import PRIORITY, SENT, STATUS, LoadSpec, done_times, latency_us, run_load, scrape
from .report import percentiles_ms
from .vs_triton import (BATCHED_EXECUTE, MAX_BATCH, READY_TIMEOUT_S, Server, batchyard_server, counter, cpu_shares,
                        on_cpus, physical_limit, pinning, tree_cpu_s)

CLASSES = ("high", "normal", "low")
DEFAULT_TIMEOUT_US = 30_000_000  # Triton's queue timeout for requests without their own = Batchyard's default_timeout_s
HIGH_TARGET = 75  # completed high requests wanted per measured window (>= 60 asked, with margin)
SERVERS = (("triton", 0), ("triton+prio", 3), ("batchyard", None))  # (name, Triton priority_levels)


@dataclass
class Plan:
    fractions: tuple  # high, normal, low: offered rate as a fraction of the measured limit
    low_timeout_ms: float
    delay_us: int  # Triton's max_queue_delay_microseconds
    warmup_s: float
    window_s: float  # 0: long enough for HIGH_TARGET high completions, within [min_window_s, max_window_s]
    min_window_s: float
    max_window_s: float
    reps: int  # physical-limit repetitions per batch size
    seed: int
    rates: tuple = ()  # req/s per class, fixed from the limit


def make_plan(args) -> Plan:
    q = args.quick
    fr = tuple(float(x) for x in args.fractions.split(","))
    if len(fr) != 3:
        raise SystemExit("priority_vs_triton: --fractions takes three numbers: high,normal,low")
    return Plan(fractions=fr, low_timeout_ms=args.low_timeout_ms, delay_us=args.delay_us,
                warmup_s=12.0 if q else 20.0, window_s=args.window_s, min_window_s=20.0 if q else 60.0,
                max_window_s=25.0 if q else 100.0, reps=3 if q else 5, seed=args.seed)


def fix_rates(plan: Plan, limit: float) -> None:
    plan.rates = tuple(round(f * limit, 3) for f in plan.fractions)
    if not plan.window_s:
        plan.window_s = float(min(plan.max_window_s, max(plan.min_window_s, math.ceil(HIGH_TARGET / plan.rates[0]))))


# ---------------------------------------------------------------- Triton with or without priority levels
def dynamic_batching(levels: int, delay_us: int) -> str:
    prio = f"  priority_levels: {levels}\n  default_priority_level: {(levels + 1) // 2}\n" if levels else ""
    return (f"\n# bench only (bench/priority_vs_triton.py): Triton's own batcher and queue policy\n"
            f"dynamic_batching {{\n  max_queue_delay_microseconds: {delay_us}\n{prio}"
            f"  default_queue_policy {{ timeout_action: REJECT default_timeout_microseconds: {DEFAULT_TIMEOUT_US} "
            f"allow_timeout_override: true }}\n}}\n")


def triton_repo(levels: int, delay_us: int, into: Path) -> Path:
    """deploy/triton/cpu/model_amx with vs_triton's batched execute, max batch 32, and the batcher above."""
    import shutil

    dst = into / "model_amx"
    shutil.copytree(asset("triton", "cpu", "model_amx"), dst, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = (dst / "config.pbtxt").read_text().replace("max_batch_size: 64", f"max_batch_size: {MAX_BATCH}")
    (dst / "config.pbtxt").write_text(cfg + dynamic_batching(levels, delay_us))
    model_py = dst / "1" / "model.py"
    model_py.write_text(model_py.read_text() + BATCHED_EXECUTE)
    return into


@contextlib.contextmanager
def triton_server(name: str, levels: int, delay_us: int, cpus: list):
    with tempfile.TemporaryDirectory(prefix="by-prio-tri-") as d:
        tl = TritonLocal(triton_repo(levels, delay_us, Path(d)), models=["model_amx"])
        with on_cpus(set(cpus)):  # tritonserver and its stubs inherit this mask
            tl.start(READY_TIMEOUT_S)
        try:
            cfg = (Path(d) / "model_amx" / "config.pbtxt").read_text()
            server = Server(name, tl.grpc_url, f"127.0.0.1:{tl.http_port}", "model_amx",
                            f"http://127.0.0.1:{tl.metrics_port}/metrics", pinning(tl.proc.pid), tl.proc.pid)
            yield server, cfg[cfg.index("dynamic_batching {"):], None
        finally:
            tl.close()


@contextlib.contextmanager
def server(name: str, levels, plan: Plan, cpus: list):
    if levels is None:
        with batchyard_server(cpus) as (srv, node):
            srv.name = name
            yield srv, "batchyard up: policy mcb, one AMX worker, max_batch 32, KServe v2 front door", node
    else:
        with triton_server(name, levels, plan.delay_us, cpus) as triple:
            yield triple


# ---------------------------------------------------------------- one run
def class_stats(rows: np.ndarray, lo: float, hi: float) -> dict:
    """Per class, the requests whose reply (or error) arrived in [lo, hi): completions, rates,
    p50/p99 of the served, and the failures split into expired by the server (status 4) and others."""
    done, status, span = done_times(rows), rows[:, STATUS].astype(int), hi - lo
    inside = (done >= lo) & (done < hi)
    out = {}
    for c, name in enumerate(CLASSES):
        m = inside & (rows[:, PRIORITY] == c)
        if not (rows[:, PRIORITY] == c).any():
            continue
        ok = m & (status == 0)
        pct = percentiles_ms(latency_us(rows)[ok], (50, 99))
        sent = ((rows[:, SENT] >= lo) & (rows[:, SENT] < hi) & (rows[:, PRIORITY] == c)).sum()
        out[name] = {"served": int(ok.sum()), "completions_per_s": float(ok.sum() / span),
                     "sent_per_s": float(sent / span), "p50_ms": pct[50], "p99_ms": pct[99],
                     "expired": int((m & (status == 4)).sum()),
                     "other_errors": int((m & ~np.isin(status, (0, 4))).sum())}
    return out


def measure(srv: Server, plan: Plan, which: str) -> dict:
    """``which``: "alone" (the high class only) or "flood" (all three classes)."""
    rates = plan.rates if which == "flood" else (plan.rates[0], 0.0, 0.0)
    spec = LoadSpec(rate=sum(rates), priority_mix=rates, deadlines_ms=(0.0, 0.0, plan.low_timeout_ms),
                    warmup_s=plan.warmup_s, window_s=plan.window_s, windows=1, stable_windows=1, processes=1,
                    seed=plan.seed, schedule_policy=True)
    before, load0, t0 = scrape(srv.metrics_url), os.getloadavg()[0], time.monotonic()
    cpu0 = tree_cpu_s(srv.pid)
    rows = run_load(srv.url, srv.model, spec, target="triton", inputs="minilm")
    # Where the server's core went over the run (warm-up and window): under the flood, what
    # each request costs the server's own processes is taken from the model's share.
    shares = cpu_shares(cpu0, tree_cpu_s(srv.pid), time.monotonic() - t0)
    after = scrape(srv.metrics_url)
    batches, items = (counter(after, n) - counter(before, n) for n in ("nv_inference_exec_count", "nv_inference_count"))
    out = {"server": srv.name, "which": which, "rates": list(rates), "wall_s": time.monotonic() - t0,
           "loadavg_1m": [load0, os.getloadavg()[0]], "batches": batches,
           "mean_batch": items / batches if batches else float("nan"), "cpu_share": shares,
           "classes": class_stats(rows, plan.warmup_s, plan.warmup_s + plan.window_s)}
    print(f"  {srv.name:12s} {which:5s} mean B {out['mean_batch']:4.1f}  " + "  ".join(
        f"{k}: {v['served']} ok p50 {v['p50_ms']:.0f} p99 {v['p99_ms']:.0f} ms, {v['completions_per_s']:.2f}/s, "
        f"{v['expired']} expired, {v['other_errors']} other" for k, v in out["classes"].items()), flush=True)
    return out


def dispatcher_status(node) -> dict:
    """Batchyard's learned curve and decision counts after its runs: what mcb did under the flood."""
    from batchyard.client import Client

    with Client(node.dispatcher.frontend) as c:
        st = c.status(timeout=10.0)
    return {"curves": st.curves, "decisions": st.decisions}


def machine() -> dict:
    info = Path("/proc/cpuinfo").read_text()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    # amx_flag_lines is what `grep -c amx /proc/cpuinfo` prints
    return {"cpu_model": model, "amx_flag_lines": sum("amx" in ln for ln in info.splitlines()),
            "vcpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}


def run_all(plan: Plan, args) -> dict:
    server_cpus, load_cpu = [int(c) for c in args.server_cpus.split(",")], {int(args.load_cpu)}
    have = os.sched_getaffinity(0)
    if not set(server_cpus) | load_cpu <= have or load_cpu & set(server_cpus):
        raise SystemExit(f"priority_vs_triton: need server cpus {server_cpus} and a separate load cpu "
                         f"{sorted(load_cpu)}; this process may use {sorted(have)}")
    res = {"machine": machine(), "server_cpus": server_cpus, "load_cpu": sorted(load_cpu),
           "loadavg_start": os.getloadavg(), "runs": [], "pinning": {}, "configs": {},
           "precision": resolve("auto")}
    if args.limit:
        res["limit"] = {"limit_items_per_s": args.limit, "given": True}
    else:
        print(f"physical limit on cpu {server_cpus[0]} (one thread, the AMX worker's own compute time):", flush=True)
        res["limit"] = physical_limit(server_cpus[0], plan.reps)
    fix_rates(plan, res["limit"]["limit_items_per_s"] * len(server_cpus))
    res["plan"] = asdict(plan)
    print(f"rates high/normal/low {plan.rates} req/s; low timeout {plan.low_timeout_ms:g} ms; "
          f"warm-up {plan.warmup_s:g} s + window {plan.window_s:g} s per run", flush=True)
    os.sched_setaffinity(0, load_cpu)  # the generator processes (spawned by run_load) inherit it
    for name, levels in SERVERS:
        if args.only and name not in args.only.split(","):
            continue
        with server(name, levels, plan, server_cpus) as (srv, cfg, node):
            res["pinning"][name], res["configs"][name] = srv.pinning, cfg
            for which in ("alone", "flood"):
                res["runs"].append(measure(srv, plan, which))
            if node is not None:
                res["batchyard_status"] = dispatcher_status(node)
    res["loadavg_end"] = os.getloadavg()
    return res


# ---------------------------------------------------------------- the report
def summarise(res: dict) -> list[dict]:
    rows = []
    for name in dict.fromkeys(r["server"] for r in res["runs"]):
        alone = next(r for r in res["runs"] if r["server"] == name and r["which"] == "alone")["classes"]["high"]
        flood = next(r for r in res["runs"] if r["server"] == name and r["which"] == "flood")
        c = flood["classes"]
        rows.append({"server": name, "high_p99_alone_ms": alone["p99_ms"], "high_p99_flood_ms": c["high"]["p99_ms"],
                     "ratio": c["high"]["p99_ms"] / alone["p99_ms"], "high_p50_alone_ms": alone["p50_ms"],
                     "high_p50_flood_ms": c["high"]["p50_ms"], "high_served": [alone["served"], c["high"]["served"]],
                     "high_failed_flood": c["high"]["expired"] + c["high"]["other_errors"],
                     "normal_p99_ms": c["normal"]["p99_ms"], "normal_per_s": c["normal"]["completions_per_s"],
                     "normal_failed": c["normal"]["expired"] + c["normal"]["other_errors"],
                     "low_per_s": c["low"]["completions_per_s"], "low_p99_ms": c["low"]["p99_ms"],
                     "low_expired": c["low"]["expired"], "low_other_errors": c["low"]["other_errors"],
                     "total_per_s": sum(v["completions_per_s"] for v in c.values()), "mean_batch": flood["mean_batch"],
                     "batches": flood["batches"]})
    return rows


def render(res: dict, rows: list[dict], command: str) -> str:
    plan, m, f0 = res["plan"], res["machine"], lambda x: f"{x:.0f}"  # noqa: E731
    lim = res["limit"]["limit_items_per_s"]
    r = plan["rates"]
    lines = [f"# Priorities under a flood: Triton vs Triton priority levels vs Batchyard — MiniLM-L6 "
             f"{res.get('precision', 'bf16')}", "",
             f"Command: `{command}`", "",
             f"Machine: {m['cpu_model']}, {m['vcpus']} vCPUs, `grep -c amx /proc/cpuinfo` = {m['amx_flag_lines']} "
             f"(no AMX: the model runs in {res.get('precision', 'bf16')} without it). Server side on cpu {','.join(map(str, res['server_cpus']))}, load "
             f"generator on cpu {res['load_cpu'][0]} (taskset). **Other sessions' work shared both cores** during the "
             f"runs (load average {res['loadavg_start'][0]:.1f} at the start, {res['loadavg_end'][0]:.1f} at the end; "
             f"per run in report.json): the numbers are indicative.", "",
             f"Limit of the core: {lim:.1f} items/s" + (" (given)" if res["limit"].get("given") else
                                                           f" (best B={res['limit']['best_b']})") + ". Offered "
             f"Poisson rates: high {r[0]:.2f}/s ({plan['fractions'][0]:.0%}), normal {r[1]:.2f}/s "
             f"({plan['fractions'][1]:.0%}), low {r[2]:.2f}/s ({plan['fractions'][2]:.0%}, the flood) with a "
             f"{plan['low_timeout_ms']:g} ms timeout. Each run: {plan['warmup_s']:g} s warm-up, then one "
             f"{plan['window_s']:g} s window; a request counts in the window its reply arrived in.", "",
             "| server | high p99 alone | high p99 under flood | ratio | high p50 alone / flood | high served "
             "alone / flood | normal p99 | normal/s | low completions/s | low expired | low other errors "
             "| all/s | batches | served items / batch |", "|---" * 14 + "|"]
    for x in rows:
        lines.append(f"| {x['server']} | {f0(x['high_p99_alone_ms'])} ms | {f0(x['high_p99_flood_ms'])} ms | "
                     f"**{x['ratio']:.1f}×** | {f0(x['high_p50_alone_ms'])} / {f0(x['high_p50_flood_ms'])} ms | "
                     f"{x['high_served'][0]} / {x['high_served'][1]} | {f0(x['normal_p99_ms'])} ms | "
                     f"{x['normal_per_s']:.2f} | {x['low_per_s']:.2f} | {x['low_expired']} | {x['low_other_errors']} | "
                     f"{x['total_per_s']:.2f} | {x['batches']:.0f} | {x['mean_batch']:.1f} |")
    lines += ["", "Latencies are client-observed (tritonclient gRPC aio). \"expired\": the server answered "
              "`Request timeout expired` (UNAVAILABLE) — Triton for a request whose queue timeout passed before it "
              "was batched, Batchyard for one whose deadline passed, queued or in flight. \"other\": any other "
              "failure (client-side deadline: the server's timeout + 30 s). High and normal requests carry no "
              "timeout (30 s server default). batches, served items / batch: from the server's "
              "`nv_inference_exec_count` and `nv_inference_count` over the whole flood run (warm-up and drain "
              "included); Triton counts every item it ran, Batchyard only the items served, so an item that "
              "expired in flight is in a batch but not in the count.", ""]
    shares = [(r["server"], r["cpu_share"]) for r in res["runs"] if r["which"] == "flood" and "cpu_share" in r]
    if shares:
        lines += ["Where the server core went during each flood run (its warm-up and window; each process's CPU "
                  "time over the wall time, `psutil`, by process title):", ""]
        lines += [f"- {name}: " + ", ".join(f"{p} {v:.2f}" for p, v in sorted(sh.items(), key=lambda kv: -kv[1]))
                  + f" (sum {sum(sh.values()):.2f})"
                  for name, sh in shares]
        lines += [""]
    lines += ["Server configurations:", ""]
    for name, cfg in res["configs"].items():
        lines += [f"- {name}:", "", "```", cfg.strip(), "```", ""]
    if "batchyard_status" in res:
        lines += ["Batchyard's learned curve and decision counts after its runs: `"
                  + json.dumps(res["batchyard_status"]) + "`", ""]
    lines += ["Process pinning seen (`psutil` cpu_affinity of each server's process tree): `"
              + json.dumps(res["pinning"]) + "`"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m batchyard.bench.priority_vs_triton",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 12 s warm-up and a 20-25 s window per run "
                    "(else 20 s and 60-100 s, long enough for ~75 high completions)")
    ap.add_argument("--fractions", default="0.1,0.2,1.5",
                    help="high,normal,low offered rates as fractions of the limit")
    ap.add_argument("--low-timeout-ms", type=float, default=5000.0, help="the low class's timeout (server side)")
    ap.add_argument("--delay-us", type=int, default=50000, help="Triton's max_queue_delay_microseconds "
                    "(bench/vs_triton.py's best at these loads)")
    ap.add_argument("--window-s", type=float, default=0.0, help="measured window per run (0: from the high rate)")
    ap.add_argument("--limit", type=float, default=0.0, help="items/s of the core (0: measure it first)")
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(n for n, _ in SERVERS))
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--server-cpus", default="1")
    ap.add_argument("--load-cpu", default="0")
    ap.add_argument("--out", default="bench/results/priority")
    args = ap.parse_args(argv)
    plan = make_plan(args)
    res = run_all(plan, args)
    rows = summarise(res)
    command = "python -m batchyard.bench.priority_vs_triton " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(res, rows, command.strip())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps({**res, "command": command.strip(), "summary": rows}, indent=1,
                                                default=float))
    print(text)


if __name__ == "__main__":
    main()
