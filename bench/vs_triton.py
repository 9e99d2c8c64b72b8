"""Batchyard's front door vs Triton's dynamic batcher: same core, same model code, same load tool.

``python -m batchyard.bench.vs_triton [--quick] [--load-fractions 0.25,0.5,0.75,0.9 | --loads 10,20,30,40]
[--saturate R] [--delays-us 0,2000,10000,50000,200000] [--slo-ms 500] [--server-cpus 1] [--load-cpu 0]``

Offered loads default to fractions of the limit measured first (the same plan fits a core of any
speed), plus one at 1.5x the limit for the saturated throughput.

- Physical limit: T(B) of MiniLM-L6 (both servers: bf16 where the CPU has it natively, else
  fp32; workers/precision.py) on one thread of the server core, measured on an AMX worker driven
  directly (workers/harness.py DirectWorker: no dispatcher, no queue); the limit is max over B
  of B / T(B).
- Triton 2.51 (nvidia-pytriton): deploy/triton/cpu/model_amx (python backend, the same factory
  ``batchyard.workers.models:minilm``, one thread per instance) with ``dynamic_batching`` on,
  max batch 32, swept over ``max_queue_delay_microseconds``. Its ``execute`` is given one forward
  pass per dynamic batch (the shipped model runs requests one by one: it is meant for a
  Batchyard worker, which sends one request per batch).
- Batchyard: ``batchyard up`` (dispatcher, policy mcb, one AMX worker per server core, max batch
  32, and the KServe v2 front door).
- The server side (tritonserver and its stubs / the whole ``batchyard up`` tree) runs on
  ``--server-cpus`` (``taskset``), the load generator on ``--load-cpu``: the harness's triton
  target (tritonclient gRPC aio, open-loop Poisson, tokenized sentences) against both.
- ``--control-cpus C`` splits each server instead: its model process (Batchyard's AMX worker,
  Triton's python-backend stub) stays on ``--server-cpus``, every other thread of its tree
  (Batchyard's supervisor, dispatcher and front door; tritonserver's own threads) moves to C.
  It tells what the server's per-request work, apart from the model, costs the model's core.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import numpy as np
import psutil

from batchyard.addresses import free_port
from batchyard.config import FrontendConfig, NodeConfig, to_toml
from batchyard.deploy import asset
from batchyard.workers.precision import resolve
from batchyard.workers.triton_local import TritonLocal

from .demo import demo_config
from . import perf_analyzer
from .harness import LoadSpec, Report, analyse, run_load, sample_total, scrape
from .report import nan_to_null, table, write_outputs

SIZES = (1, 2, 4, 8, 16, 32)
LOAD_TOOLS = {
    "harness": "`batchyard bench`'s triton target (tritonclient gRPC aio, one generator process, open-loop "
               "Poisson, tokenized sentences; latency from each request's scheduled instant, so a generator "
               "that falls behind adds its lag)",
    "perf_analyzer": "Triton's perf_analyzer from the tritonclient wheel (`--async --request-rate-range R "
                     "--request-distribution poisson`, over the protocol named below, the demo's tokenized sentences "
                     "as `--input-data`; "
                     "windows repeated until the last 3 agree within the stability bound, those 3 merged; "
                     "an unstable run reports the mean throughput and the largest p99 of its last 3 windows "
                     "and no p50)"}
MAX_BATCH = 32  # both servers: Batchyard's model max_batch, Triton's max_batch_size
READY_TIMEOUT_S = 300.0  # model load on a busy 2-core machine

# Appended to the model's own model.py in the bench's private repository: the initialize (the
# model, its bf16 weights, one thread) stays the shipped one; only how a batch runs changes.
BATCHED_EXECUTE = '''

class TritonPythonModel(TritonPythonModel):  # noqa: F811 -- bench/vs_triton.py
    """With dynamic batching on, the requests Triton hands over together run as one forward pass."""

    def execute(self, requests):
        ins = [[pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in ("input_ids", "attention_mask")]
               for r in requests]
        ids = torch.from_numpy(np.concatenate([a for a, _ in ins]))
        mask = torch.from_numpy(np.concatenate([m for _, m in ins]))
        with torch.inference_mode():
            emb = self.model(input_ids=ids, attention_mask=mask)["embedding"].float().numpy()
        rows = np.split(emb, np.cumsum([len(a) for a, _ in ins])[:-1])
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("embedding", e.astype(np.float32))])
                for e in rows]
'''


@dataclass
class Plan:
    loads: list  # req/s; empty: load_fractions of the measured limit
    load_fractions: list
    saturate: float  # req/s; 0: saturate_fraction of the measured limit
    saturate_fraction: float
    delays_us: list
    slo_ms: float
    warmup_s: float
    window_s: float
    windows: int
    stability: float
    reps: int
    load_tool: str = "harness"  # or "perf_analyzer" (Triton's own, from the tritonclient wheel)
    protocol: str = "grpc"  # perf_analyzer's -i: both servers' KServe v2 gRPC or HTTP endpoint
    rounds: int = 1  # every (server, load) is measured once per round; the report takes medians


def make_plan(args) -> Plan:
    quick = args.quick
    fractions = args.load_fractions or ("0.3,0.7" if quick else "0.25,0.5,0.75,0.9")
    delays = args.delays_us or ("0,50000" if quick else "0,2000,10000,50000,200000")
    return Plan(loads=[float(x) for x in args.loads.split(",")] if args.loads else [],
                load_fractions=[float(x) for x in fractions.split(",")], saturate=args.saturate,
                saturate_fraction=1.5, delays_us=[int(x) for x in delays.split(",")], slo_ms=args.slo_ms,
                warmup_s=5.0, window_s=10.0 if quick else 20.0, windows=3 if quick else 5,
                stability=0.25 if quick else 0.15, reps=3 if quick else 7, load_tool=args.load_tool,
                protocol=args.protocol, rounds=args.rounds or (1 if quick else 2))


def offered_loads(plan: Plan, limit: float) -> None:
    """Fix the offered loads from the measured limit: the same plan fits a core of any speed."""
    if not plan.loads:
        plan.loads = [round(f * limit, 1) for f in plan.load_fractions]
    if not plan.saturate:
        plan.saturate = round(plan.saturate_fraction * limit, 1)


@contextlib.contextmanager
def on_cpus(cpus: set):
    """Run this process on ``cpus`` for the block: what it starts meanwhile inherits them."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# What runs the model in each server's tree: Batchyard's worker (its process title) and Triton's
# python-backend stub. --control-cpus moves every other process of Triton's tree (Batchyard's
# dispatcher and front door pin themselves: [dispatcher] / [frontend] cpus).
MODEL_PROCESSES = ("amx-worker[", "triton_python_backend_stub")


def process_tree(pid: int) -> list:
    """``pid``'s process and every descendant of it (psutil)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def move_control(pid: int, cpus: set) -> None:
    """Every thread of ``pid``'s tree, but the model processes', onto ``cpus``. Threads, not
    processes: an affinity set through a pid binds only the thread of that id, and the threads a
    server started before now (gRPC's, ZeroMQ's I/O thread) would stay where they were."""
    for p in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            if any(m in " ".join(p.cmdline()) for m in MODEL_PROCESSES):
                continue
            for t in p.threads():
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(t.id, cpus)


def pinning(pid: int) -> dict:
    """{process name: its CPUs} for ``pid`` and its descendants: shows the taskset took."""
    out = {}
    for p in process_tree(pid):
        with contextlib.suppress(psutil.Error):
            out.setdefault(p.name(), sorted({c for c in p.cpu_affinity()}))
    return out


def tree_cpu_s(pid: int) -> dict:
    """{process name: CPU seconds, user + system} of ``pid`` and its descendants, summed by name
    (Batchyard's process titles, ``tritonserver``, ``triton_python_backend_stub``)."""
    out: dict = {}
    for p in process_tree(pid):
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile
            t = p.cpu_times()
            out[p.name()] = out.get(p.name(), 0.0) + t.user + t.system
    return out


def cpu_shares(before: dict, after: dict, wall_s: float) -> dict:
    """{process name: the fraction of one core it used} between two ``tree_cpu_s`` snapshots
    ``wall_s`` apart; the ones that used none are left out."""
    shares = {name: (cpu - before.get(name, 0.0)) / wall_s for name, cpu in after.items()}
    return {name: round(share, 4) for name, share in shares.items() if share > 0}


def model_core_ms_per_item(before: dict, after: dict, items: float) -> float:
    """CPU ms the model processes (MODEL_PROCESSES) spent per item they ran, between two
    ``tree_cpu_s`` snapshots. Not the servers' compute counters: both add a batch's time to each
    of its requests, so their time per item, over batches of varied sizes, weighs the large
    batches up."""
    used = sum(cpu - before.get(name, 0.0) for name, cpu in after.items() if any(m in name for m in MODEL_PROCESSES))
    return used * 1e3 / items if items else float("nan")


NO_DEADLINE_S = 3600.0


def minilm_node(run_dir: str, cpus: list, grpc_port: int = 0, metrics_port: int = 0,
                control: tuple = (), http_port: int = 0) -> NodeConfig:
    """demo_config's model and AMX worker, one worker per server core, policy mcb, the front door;
    the dispatcher and the front door on ``control`` ([dispatcher] / [frontend] cpus; empty: as
    inherited, on the workers' cores, and then the workers run at nice 10)."""
    base = demo_config(run_dir, "mcb")
    amx = base.workers[0]
    # Sharing its core with the dispatcher and the front door, a worker runs nice: they take an
    # arrival or a completion at once, not after the model's timeslice (WorkerConfig.nice).
    nice = 0 if set(control).isdisjoint(cpus) and control else 10
    workers = tuple(msgspec.structs.replace(amx, name=f"amx{c}", cpus=(c,), nice=nice) for c in cpus)
    model = msgspec.structs.replace(base.models[0], max_batch=MAX_BATCH)
    front = FrontendConfig(host="127.0.0.1", grpc_port=grpc_port, http_port=http_port, processes=1,
                           cpus=control) if grpc_port else None
    # Triton sets no deadline on a request without a `timeout` parameter; Batchyard's default
    # (30 s) would expire requests of the saturated run, whose queue grows for minutes.
    return NodeConfig(msgspec.structs.replace(base.dispatcher, policy="mcb", metrics_port=metrics_port,
                                              default_timeout_s=NO_DEADLINE_S, cpus=control),
                      (model,), workers, front).validate()


# ---------------------------------------------------------------- the core's physical limit
def sentences_request(dw, b: int) -> list:
    """A request of ``b`` of the load's own tokenized sentences, repeated in turn. Zero inputs
    ran 1-3 % faster than these at B=4-16 (paired, interleaved, one core): the limit is the
    one the load meets."""
    from batchyard.workers.models import tokenize

    from .demo import SENTENCES

    ids, mask = tokenize(SENTENCES)  # int64 arrays [n, 128]
    return dw.request("minilm", {"input_ids": np.resize(ids, (b, ids.shape[1])),
                                 "attention_mask": np.resize(mask, (b, mask.shape[1]))})


def physical_limit(cpu: int, reps: int) -> dict:
    """T(B) (median ms of the worker's own compute time on the load's sentences) and items/s
    for B in SIZES on ``cpu``."""
    from batchyard.workers.harness import DirectWorker

    with tempfile.TemporaryDirectory(prefix="by-vs-limit-") as d:
        node = minilm_node(d, [cpu])
        with on_cpus({cpu}):  # the worker pins itself to cpu: it must be allowed there
            dw = DirectWorker(node, node.workers[0].name)
        with dw:
            dw.wait_registered(READY_TIMEOUT_S)
            curve = {}
            for b in SIZES:
                req = sentences_request(dw, b)
                dw.run("minilm", [req])  # warm-up at this shape (oneDNN builds kernels per shape)
                ts = sorted(dw.run("minilm", [req])[0].compute_us / 1e3 for _ in range(reps))
                curve[b] = {"ms": ts[len(ts) // 2], "items_per_s": b / ts[len(ts) // 2] * 1e3}
                print(f"  T({b:2d}) = {curve[b]['ms']:7.1f} ms   {curve[b]['items_per_s']:5.1f} items/s", flush=True)
    best = max(curve, key=lambda b: curve[b]["items_per_s"])
    return {"curve": curve, "best_b": best, "limit_items_per_s": curve[best]["items_per_s"]}


# ---------------------------------------------------------------- the two servers
@dataclass
class Server:
    name: str
    url: str  # KServe v2 gRPC
    http_url: str  # KServe v2 HTTP/REST
    model: str
    metrics_url: str
    pinning: dict
    pid: int  # the root of its process tree


@contextlib.contextmanager
def batchyard_server(cpus: list, control: set = frozenset(), trace_file: str = ""):
    """``taskset -c <cpus> batchyard up`` with the front door (with ``control``, the dispatcher
    and the front door pinned there by the config, as a deployment would); stopped with SIGTERM
    as systemd would. ``trace_file``: the front door's ([frontend] trace_file; tracing OFF)."""
    with tempfile.TemporaryDirectory(prefix="by-vs-node-") as d:
        port, hport, mport = free_port(), free_port(), free_port()
        node = minilm_node(d, cpus, grpc_port=port, metrics_port=mport, control=tuple(sorted(control)), http_port=hport)
        if trace_file:
            node = msgspec.structs.replace(node, frontend=msgspec.structs.replace(node.frontend, trace_file=trace_file))
        cfg = Path(d) / "node.toml"
        cfg.write_text(to_toml(node))
        # The worker pins itself to its config's cpus, which must be in the mask it inherits.
        cmd = ["taskset", "-c", ",".join(map(str, sorted({*cpus, *control}))), sys.executable, "-m", "batchyard.cli",
               "--log-level", "WARNING", "up", "--config", str(cfg)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        try:
            url = f"127.0.0.1:{port}"
            wait_model_ready(url, "minilm", proc)
            yield Server("batchyard", url, f"127.0.0.1:{hport}", "minilm", f"http://127.0.0.1:{mport}/metrics",
                         pinning(proc.pid), proc.pid), node
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_model_ready(url: str, model: str, proc: subprocess.Popen) -> None:
    import tritonclient.grpc as grpcclient

    deadline = time.monotonic() + READY_TIMEOUT_S
    client = grpcclient.InferenceServerClient(url)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"vs_triton: batchyard up exited with {proc.returncode} during start-up")
            with contextlib.suppress(Exception):
                if client.is_model_ready(model, client_timeout=1.0):
                    return
            if time.monotonic() > deadline:
                raise SystemExit(f"vs_triton: the front door at {url} not ready within {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.2)  # readiness of another process tree: nothing to wait on but its answer
    finally:
        client.close()


def triton_repo(delay_us: int, instances: int, into: Path) -> Path:
    dst = into / "model_amx"
    shutil.copytree(asset("triton", "cpu", "model_amx"), dst, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = (dst / "config.pbtxt").read_text()
    cfg = cfg.replace("count: 1", f"count: {instances}").replace("max_batch_size: 64", f"max_batch_size: {MAX_BATCH}")
    cfg += (f"\n# bench only (bench/vs_triton.py): Triton's own batcher, to compare with Batchyard's\n"
            f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n")
    (dst / "config.pbtxt").write_text(cfg)
    model_py = dst / "1" / "model.py"
    model_py.write_text(model_py.read_text() + BATCHED_EXECUTE)
    return into


@contextlib.contextmanager
def triton_server(delay_us: int, cpus: list, control: set = frozenset(), trace_file: str = ""):
    """``trace_file``: tritonserver's (--trace-config triton,file=; tracing OFF)."""
    with tempfile.TemporaryDirectory(prefix="by-vs-tri-") as d:
        traced = (f"--trace-config=triton,file={trace_file}", "--trace-config=level=OFF") if trace_file else ()
        tl = TritonLocal(triton_repo(delay_us, len(cpus), Path(d)), models=["model_amx"], extra_args=traced)
        with on_cpus(set(cpus)):  # tritonserver and the stubs it forks inherit this mask
            tl.start(READY_TIMEOUT_S)
        if control:
            move_control(tl.proc.pid, set(control))
        try:
            yield Server(f"triton {delay_us} us", tl.grpc_url, f"127.0.0.1:{tl.http_port}", "model_amx",
                         f"http://127.0.0.1:{tl.metrics_port}/metrics", pinning(tl.proc.pid), tl.proc.pid)
        finally:
            tl.close()


# ---------------------------------------------------------------- one measurement
def counter(samples: list, name: str) -> float:
    """A counter's total over its samples (``scrape`` names them as the text does: Triton's and
    Batchyard's counters are both written without ``_total``)."""
    return sample_total(samples, name)


IDLE_TIMEOUT_S = 900.0  # a saturated run's backlog: minutes of queue on a slow core


def wait_idle(server: Server) -> None:
    """Until ``server`` has nothing queued or running (its ``nv_inference_pending_request_count``,
    queued only, as Triton's, and Batchyard's ``batchyard_inflight_request_count`` are 0): the
    backlog of a saturated run would otherwise be served on the core the next measurement, of
    this server or another, runs on."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S

    def busy(samples) -> float:
        return (sample_total(samples, "nv_inference_pending_request_count")
                + sample_total(samples, "batchyard_inflight_request_count"))

    while busy(scrape(server.metrics_url)) > 0:
        if time.monotonic() > deadline:
            raise SystemExit(f"vs_triton: {server.name} still busy {IDLE_TIMEOUT_S:.0f} s after a run")
        time.sleep(0.5)  # another process tree's queue: nothing to wait on but its metrics


def measure(server: Server, rate: float, plan: Plan, label: str, input_data: Path | None, seed: int = 7) -> dict:
    """One run. ``seed``: the harness's arrival schedule, one per round (every server of a round
    gets the same arrivals; rounds differ, so their range holds the arrivals' variation too).
    perf_analyzer draws its own schedule and takes no seed: its rounds repeat one schedule."""
    spec = LoadSpec(rate=rate, slo_ms=plan.slo_ms, warmup_s=plan.warmup_s, window_s=plan.window_s,
                    windows=plan.windows, stability=plan.stability, processes=1, seed=seed)
    before = scrape(server.metrics_url)
    cpu0, t0 = tree_cpu_s(server.pid), time.perf_counter()
    if plan.load_tool == "perf_analyzer":
        url = server.http_url if plan.protocol == "http" else server.url
        pa = perf_analyzer.run_rate(url, server.model, rate, window_s=plan.window_s, trials=plan.windows + 2,
                                    stability=plan.stability, input_data=input_data, protocol=plan.protocol)
        rep = Report(server.name, label, rate, stable=pa["stable"], summary=pa["summary"],
                     schedule_kept=pa.get("schedule_kept", True))
    else:
        rep = analyse(run_load(server.url, server.model, spec, target="triton", inputs="minilm"), spec,
                      server.name, label)
    # Where the server core went meanwhile (a run's window and its warm-up; the backlog a
    # saturated run leaves is served after this, while the next run waits for it).
    cpu1 = tree_cpu_s(server.pid)
    rep.summary["cpu_share"] = cpu_shares(cpu0, cpu1, time.perf_counter() - t0)
    after = scrape(server.metrics_url)
    batches, items = (counter(after, name) - counter(before, name)
                      for name in ("nv_inference_exec_count", "nv_inference_count"))
    rep.summary["mean_batch"] = items / batches if batches else float("nan")
    rep.summary["model_core_ms_per_item"] = model_core_ms_per_item(cpu0, cpu1, items)
    print(table([rep]) + f"\n  mean batch {rep.summary['mean_batch']:.1f}, model core "
          f"{rep.summary['model_core_ms_per_item']:.2f} ms an item, core shares {rep.summary['cpu_share']}", flush=True)
    return {"server": server.name, "rate": rate, "report": rep}


def run_all(plan: Plan, args) -> dict:
    server_cpus = [int(c) for c in args.server_cpus.split(",")]
    load_cpu = {int(args.load_cpu)}
    control = {int(c) for c in args.control_cpus.split(",")} if args.control_cpus else set()
    have = os.sched_getaffinity(0)
    if not set(server_cpus) | load_cpu | control <= have or (load_cpu | control) & set(server_cpus):
        raise SystemExit(f"vs_triton: need server cpus {server_cpus} apart from the load cpu {sorted(load_cpu)} "
                         f"and the control cpus {sorted(control)}; this process may use {sorted(have)}")
    out = {"server_cpus": server_cpus, "load_cpu": sorted(load_cpu), "control_cpus": sorted(control),
           "precision": resolve("auto"),  # both servers' weights (workers/precision.py)
           "loadavg_start": os.getloadavg(), "runs": [], "pinning": {}}
    print(f"physical limit on cpu {server_cpus[0]} (one thread, the AMX worker's own compute time):", flush=True)
    out["limit"] = physical_limit(server_cpus[0], plan.reps)
    out["limit"]["items_per_s_all_cores"] = out["limit"]["limit_items_per_s"] * len(server_cpus)
    offered_loads(plan, out["limit"]["items_per_s_all_cores"])
    out["plan"] = asdict(plan)
    rates = plan.loads + [plan.saturate]
    print(f"offered loads {plan.loads} req/s, saturated {plan.saturate} req/s", flush=True)
    os.sched_setaffinity(0, load_cpu)  # the generator processes (run_load's, perf_analyzer) inherit it
    with tempfile.TemporaryDirectory(prefix="by-vs-data-") as tmp:
        data = (perf_analyzer.minilm_input_data(Path(tmp) / "minilm.json")
                if plan.load_tool == "perf_analyzer" else None)
        # Every server runs for the whole bench, and the measurements interleave: each load is
        # measured on every server in turn, round after round, with the server that goes first
        # rotating. A machine shared with other sessions drifts over minutes; measured one server
        # after the other, the drift would land on one of them.
        with contextlib.ExitStack() as stack:
            by, node = stack.enter_context(batchyard_server(server_cpus, control))
            servers = [by] + [stack.enter_context(triton_server(d, server_cpus, control)) for d in plan.delays_us]
            out["pinning"] = {s.name: s.pinning for s in servers}
            turn = 0
            for rnd in range(plan.rounds):
                for r in rates:
                    k, turn = turn % len(servers), turn + 1
                    for srv in servers[k:] + servers[:k]:
                        for other in servers:  # every server's backlog: all share the server cores
                            wait_idle(other)
                        run = measure(srv, r, plan, f"{srv.name} @{r:g} round {rnd + 1}", data, seed=7 + rnd)
                        out["runs"].append(run | {"round": rnd})
            from batchyard.client import Client

            with Client(node.dispatcher.frontend) as c:
                st = c.status(timeout=10.0)
            out["batchyard_status"] = {"curves": st.curves, "decisions": st.decisions}
    print("physical limit again, after the runs:", flush=True)
    out["limit_after"] = physical_limit(server_cpus[0], plan.reps)
    out["loadavg_end"] = os.getloadavg()
    return out


# ---------------------------------------------------------------- the report
def _s(run) -> dict:
    return run["report"].summary


MERGED = ("p50_ms", "p99_ms", "throughput_rps", "mean_batch")


def merge_rounds(runs: list) -> dict:
    """{(server, rate): the median over rounds of each figure in MERGED, the p99's range, the
    failed requests of all rounds, and whether every round was stable and kept its schedule} —
    one row of the report from every round's run of it."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["server"], r["rate"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN p50: unstable perf_analyzer runs
            m = {f: float(np.nanmedian([_s(r).get(f, float("nan")) for r in rs])) for f in MERGED}
        p99s = [_s(r)["p99_ms"] for r in rs]
        m.update(p99_min=min(p99s), p99_max=max(p99s), rounds=len(rs),
                 errors=sum(sum(_s(r)["errors"].values()) for r in rs),
                 stable=all(r["report"].stable for r in rs),
                 schedule_kept=all(r["report"].schedule_kept for r in rs))
        out[key] = m
    return out


def _counts(m: dict) -> bool:
    """Whether a merged row can count toward the goals: no request failed (a failed one is in no
    percentile, so its p99 looks better for it) and the generator kept its schedule (else the
    load named was not the load offered). Rows from before schedule_kept was kept: kept."""
    return not m["errors"] and m.get("schedule_kept", True)


def _under_slo(rows: list, slo_ms) -> float:
    """The most served/s at a load where every round's p99 met the SLO (not the median's: with
    two rounds that is their mean, and a round of 1400 ms beside one of 560 passed 1000)."""
    ok = [m["throughput_rps"] for m in rows if m.get("p99_max", m["p99_ms"]) <= slo_ms and _counts(m)]
    return max(ok, default=0.0)


def summarise_results(res: dict) -> dict:
    plan = res["plan"]
    merged = merge_rounds(res["runs"])
    servers = list(dict.fromkeys(r["server"] for r in res["runs"]))
    tri_names = [s for s in servers if s != "batchyard"]
    rows = []
    for rate in plan["loads"] + [plan["saturate"]]:
        at = [(s, merged[(s, rate)]) for s in tri_names]
        # Triton's best delay is picked per load, after the fact: with several delays and noisy
        # runs this favours Triton (the luckiest of them), which the report says. One that
        # failed requests or fell behind is picked only when every delay did.
        best = min(at, key=lambda sm: (not _counts(sm[1]), sm[1]["p99_ms"], -sm[1]["throughput_rps"]))
        if rate == plan["saturate"]:  # past the limit, the best Triton is the one that serves most
            best = max(at, key=lambda sm: sm[1]["throughput_rps"])
        by = merged[("batchyard", rate)]
        rows.append({"rate": rate, "batchyard": by, "triton_delay_us": int(best[0].split()[1]),
                     "triton": best[1], "batchyard_stable": by["stable"], "triton_stable": best[1]["stable"]})
    # The core's capacity is at least the best seen: the limit before or after the runs.
    limit = max(res["limit"]["limit_items_per_s"], res["limit_after"]["limit_items_per_s"]) * len(res["server_cpus"])
    # A load flagged on either server (FLAGS) counts toward neither one's max: Batchyard's headline
    # max under the SLO came from loads the report listed as not counted.
    flagged = {r["rate"] for r in rows if not (_counts(r["batchyard"]) and _counts(r["triton"]))}
    by_max = _under_slo([merged[("batchyard", r)] for r in plan["loads"] + [plan["saturate"]] if r not in flagged],
                        plan["slo_ms"])
    tri_max = max(_under_slo([m for (s, r), m in merged.items() if s == name and r not in flagged], plan["slo_ms"])
                  for name in tri_names)
    sat = rows[-1]
    # A load counts toward the p99 goal only when both servers served every request on schedule.
    not_counted = [r["rate"] for r in rows[:-1] if not (_counts(r["batchyard"]) and _counts(r["triton"]))]
    return {"rows": rows, "merged": [{"server": s, "rate": r, **m} for (s, r), m in merged.items()],
            "max_under_slo": {"batchyard": by_max, "triton": tri_max},
            "saturated_fraction": {"batchyard": sat["batchyard"]["throughput_rps"] / limit,
                                   "triton": sat["triton"]["throughput_rps"] / limit},
            "limit_items_per_s": limit,
            "goals": {"p99_at_or_below_triton_every_load": not not_counted and all(
                          r["batchyard"]["p99_ms"] <= r["triton"]["p99_ms"] for r in rows[:-1]),
                      "loads_not_counted": not_counted,
                      # None: Triton kept p99 under the SLO at no offered load, so there is no ratio.
                      "max_under_slo_ratio": by_max / tri_max if tri_max else None,
                      "saturated_fraction_batchyard": sat["batchyard"]["throughput_rps"] / limit}}


def where_the_core_went(res: dict, lim: dict, lim2: dict) -> list:
    """The saturated runs, one row each: the model processes' CPU time per item under the load
    (beside the limit's time per item, measured alone) and each server process's share of the core."""
    sat = res["plan"]["saturate"]
    runs = [r for r in res["runs"] if r["rate"] == sat and "cpu_share" in _s(r)]
    if not runs:
        return []
    alone = [lim["curve"][lim["best_b"]]["ms"] / lim["best_b"], lim2["curve"][lim2["best_b"]]["ms"] / lim2["best_b"]]
    lines = [f"## Where the server core went at saturation ({sat:g}/s offered)", "",
             f"Per run: each process's CPU time over the run's wall time (`psutil`, warm-up and windows; 1.0 is "
             f"the whole core), and the model processes' CPU time per item they ran under this load (their CPU "
             f"seconds over `nv_inference_count`) against T(B)/B = {alone[0]:.2f} / {alone[1]:.2f} ms at "
             f"B={lim['best_b']} / {lim2['best_b']} measured alone before / after the runs.", "",
             "| server | round | served/s | mean B | model core ms an item | core share by process |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        sm = _s(r)
        shares = ", ".join(f"{n} {v:.2f}" for n, v in sorted(sm["cpu_share"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r['server']} | {r['round'] + 1} | {sm['throughput_rps']:.1f} | {sm['mean_batch']:.1f} | "
                     f"{sm['model_core_ms_per_item']:.2f} | {shares} (sum {sum(sm['cpu_share'].values()):.2f}) |")
    return lines


def _flags(m: dict) -> str:
    """A merged row's marks (FLAGS): its p99 alone does not say it failed requests or fell behind."""
    return (" †" if m["errors"] else "") + ("" if m.get("schedule_kept", True) else " ‡")


FLAGS = ("† requests failed at this load (a failed request is in no percentile); ‡ the load generator fell "
         "behind its schedule (the load named was not the load offered). A load so marked on either server "
         "counts neither toward the p99 goal nor toward the max throughput under the SLO below.")


def render(res: dict, summ: dict, command: str) -> str:
    plan, lim, lim2 = res["plan"], res["limit"], res["limit_after"]
    f = lambda x: f"{x:.1f}"  # noqa: E731
    control = res.get("control_cpus")
    where = (f"model process on cpu {','.join(map(str, res['server_cpus']))}, the rest of each server on cpu "
             f"{','.join(map(str, control))}" if control else f"server on cpu {','.join(map(str, res['server_cpus']))}")
    lines = [f"# Batchyard front door vs Triton dynamic batcher — MiniLM-L6 {res.get('precision', 'bf16')}, {where}, "
             f"load generator on cpu {res['load_cpu'][0]}", "",
             f"Command: `{command}`", "",
             f"Machine: {os.cpu_count()} vCPUs shared with other sessions; load average "
             f"{res['loadavg_start'][0]:.1f} at the start, {res['loadavg_end'][0]:.1f} at the end"
             + (". The numbers are **indicative**: other processes ran on the cores during the runs."
                if max(res['loadavg_start'][0], res['loadavg_end'][0]) > 1.5 else
                " (1-minute averages; the bench's own server and generator count in them)."), "",
             "Same load tool for both: " + LOAD_TOOLS[plan.get("load_tool", "harness")]
             + ("; protocol: KServe v2 "
                + ("HTTP/REST (binary tensor data)" if plan.get("protocol") == "http" else "gRPC")
                if plan.get("load_tool") == "perf_analyzer" else "") + "; latencies are "
             "client-observed; throughput = completions/s in the measured windows; mean batch from each server's "
             "own `nv_inference_count / nv_inference_exec_count` over the whole run.", "",
             "## Physical limit of the core (one thread, AMX worker driven directly)", "",
             "Median of the worker's own compute time, before the runs (sets the offered loads) and after them.", "",
             "| B | T(B) ms before | items/s | T(B) ms after | items/s |", "|---|---|---|---|---|",
             *[f"| {b} | {f(v['ms'])} | {f(v['items_per_s'])} | {f(lim2['curve'][b]['ms'])} | "
               f"{f(lim2['curve'][b]['items_per_s'])} |" for b, v in lim["curve"].items()], "",
             f"Limit: {f(lim['limit_items_per_s'])} items/s at B={lim['best_b']} before, "
             f"{f(lim2['limit_items_per_s'])} at B={lim2['best_b']} after; the saturated fractions below use the "
             f"larger, **{f(summ['limit_items_per_s'])} items/s** (all server cores).", "",
             f"## p50 / p99 (ms) against offered Poisson load; Triton at its best delay of {plan['delays_us']} us", "",
             f"Every server ran for the whole bench; each load was measured on every server in turn, "
             f"{plan.get('rounds', 1)} round(s), the server going first rotating; each figure is the median over "
             f"the rounds. Triton's delay is the best one per load, picked after the runs: of several noisy "
             f"settings that is also the luckiest, which favours Triton.", "",
             "| offered/s | Batchyard p50 | p99 | tput/s | mean B | Triton best delay | p50 | p99 | tput/s | mean B "
             "| p99 By/Tri |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summ["rows"]:
        b, t = r["batchyard"], r["triton"]
        mark = lambda ok: "" if ok else " (unstable)"  # noqa: E731
        sat = " (saturated)" if r["rate"] == plan["saturate"] else ""
        lines.append(f"| {r['rate']:g}{sat} | {f(b['p50_ms'])} | {f(b['p99_ms'])}{mark(r['batchyard_stable'])}"
                     f"{_flags(b)} | {f(b['throughput_rps'])} | {f(b['mean_batch'])} | {r['triton_delay_us']} us | "
                     f"{f(t['p50_ms'])} | {f(t['p99_ms'])}{mark(r['triton_stable'])}{_flags(t)} | "
                     f"{f(t['throughput_rps'])} | {f(t['mean_batch'])} | {b['p99_ms'] / t['p99_ms']:.2f} |")
    if any(_flags(m) for m in summ["merged"]):
        lines += ["", FLAGS]
    rng = lambda m: f" ({f(m['p99_min'])}–{f(m['p99_max'])})" if m["rounds"] > 1 else ""  # noqa: E731
    merged = {(m["server"], m["rate"]): m for m in summ["merged"]}
    servers = list(dict.fromkeys(m["server"] for m in summ["merged"]))
    lines += ["", "p99 ms, median (range) over the rounds [throughput, mean batch], of every server at every load:",
              "", "| offered/s | " + " | ".join(servers) + " |", "|---" * (len(servers) + 1) + "|"]
    for rate in plan["loads"] + [plan["saturate"]]:
        cells = [merged[(sv, rate)] for sv in servers]
        lines.append(f"| {rate:g} | " + " | ".join(f"{f(c['p99_ms'])}{rng(c)}{_flags(c)} [{f(c['throughput_rps'])}/s, "
                                                   f"B {f(c['mean_batch'])}]" for c in cells) + " |")
    g, m, sf = summ["goals"], summ["max_under_slo"], summ["saturated_fraction"]
    lim_all = summ["limit_items_per_s"]
    ratio = (f"ratio **{g['max_under_slo_ratio']:.2f}×**" if g["max_under_slo_ratio"] is not None
             else "**no ratio**: Triton's p99 was over the SLO at every offered load")
    lines += ["", "## Against the goals of issue 12", "",
              "- p99 at or below Triton's best at every offered load: "
              f"**{'yes' if g['p99_at_or_below_triton_every_load'] else 'no'}**"
              + (f" (not counted: {', '.join(f'{x:g}/s' for x in g['loads_not_counted'])}, marked † or ‡ above)."
                 if g.get("loads_not_counted") else "."),
              f"- Max throughput with p99 ≤ {plan['slo_ms']:.0f} ms (over the offered loads, no errors, on "
              f"schedule): Batchyard "
              f"{f(m['batchyard'])}/s, Triton {f(m['triton'])}/s, {ratio} (goal ≥ 1.2×; "
              f"the loads are coarse, so this is a lower bound of each).",
              f"- Saturated throughput at {plan['saturate']:g}/s offered, as a fraction of the measured limit "
              f"({f(lim_all)}/s): Batchyard **{sf['batchyard']:.0%}**, Triton {sf['triton']:.0%} (goal ≥ 95 %).",
              f"- Batch size at saturation: Batchyard mean {f(summ['rows'][-1]['batchyard']['mean_batch'])}, Triton "
              f"{f(summ['rows'][-1]['triton']['mean_batch'])}; the core's best B was {lim['best_b']} before and "
              f"{lim2['best_b']} after the runs (B=1: {f(lim['curve'][1]['items_per_s'])} / "
              f"{f(lim2['curve'][1]['items_per_s'])} items/s).", "",
              *where_the_core_went(res, lim, lim2), "",
              "Batchyard's learned curves and decisions at the end: `" + json.dumps(res["batchyard_status"]) + "`", "",
              "Process pinning seen (`psutil` cpu_affinity of each server's process tree): `"
              + json.dumps(res["pinning"]) + "`", "",
              "Per-run tables and plots: [bench.md](bench.md)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m batchyard.bench.vs_triton", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="loads 0.3 and 0.7 of the limit, delays 0,50000 us, 3 windows of 10 s (else 5 of 20 s)")
    ap.add_argument("--loads", default="", help="offered Poisson loads, req/s (default: --load-fractions)")
    ap.add_argument("--load-fractions", default="", help="offered loads as fractions of the measured limit "
                    "(default 0.25,0.5,0.75,0.9)")
    ap.add_argument("--saturate", type=float, default=0.0, help="an offered load above the limit, req/s "
                    "(default 1.5 x the measured limit)")
    ap.add_argument("--delays-us", default="", help="Triton max_queue_delay_microseconds sweep")
    ap.add_argument("--slo-ms", type=float, default=500.0)
    ap.add_argument("--server-cpus", default="1", help="cores for the servers: one AMX worker / Triton "
                    "instance each (two workers: 1,2 where the host has a third core for the generator)")
    ap.add_argument("--two-workers", action="store_true", help="same as --server-cpus 1,2 (needs 3 cores)")
    ap.add_argument("--load-cpu", default="0")
    ap.add_argument("--control-cpus", default="", help="cores for everything of each server but its model "
                    "process (Batchyard's worker, Triton's python stub); may be the load cpu")
    ap.add_argument("--load-tool", choices=sorted(LOAD_TOOLS), default="harness",
                    help="the load generator for both servers (perf_analyzer: Triton's own)")
    ap.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                    help="the KServe v2 endpoint both servers are driven through (http: --load-tool perf_analyzer)")
    ap.add_argument("--rounds", type=int, default=0, help="measure every (server, load) this many times, "
                    "interleaved; the report takes medians (default 1 with --quick, else 2)")
    ap.add_argument("--out", default="bench/results/vs_triton")
    args = ap.parse_args(argv)
    if args.protocol == "http" and args.load_tool != "perf_analyzer":
        ap.error("--protocol http needs --load-tool perf_analyzer (the harness's triton target speaks gRPC)")
    if args.two_workers:
        args.server_cpus = "1,2"
    plan = make_plan(args)
    res = run_all(plan, args)
    summ = summarise_results(res)
    out = Path(args.out)
    reports = [r["report"] for r in res["runs"]]
    write_outputs(reports, out, "Batchyard front door vs Triton dynamic batcher — every run", "")
    command = "python -m batchyard.bench.vs_triton " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(res, summ, command.strip())
    (out / "report.md").write_text(text)
    data = {k: v for k, v in res.items() if k != "runs"}
    data["runs"] = [{"server": r["server"], "rate": r["rate"], "round": r["round"], "stable": r["report"].stable,
                     "schedule_kept": r["report"].schedule_kept, "summary": r["report"].summary} for r in res["runs"]]
    data["summary"] = summ
    (out / "report.json").write_text(json.dumps(nan_to_null(data), indent=1, default=float, allow_nan=False))
    print(text)


if __name__ == "__main__":
    main()
