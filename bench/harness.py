"""``batchyard bench``: perf_analyzer-style load against a Batchyard dispatcher or a Triton server.

Load modes (as perf_analyzer): closed loop ``--concurrency N``; open loop ``--request-rate R``
with ``--distribution poisson|constant``; ``--request-intervals FILE`` (one interval in
seconds per line); plus lambda(t) profiles ``--profile step:R1,R2|sine:MEAN,AMP,PERIOD|
bursts:LOW,HIGH`` and priority/deadline mixes. Load comes from ``--processes`` generator
processes (each its own client and event loop), so the generator is not the bottleneck; each
run checks that it kept to its schedule and says so when it did not.

Measurement: a warm-up, then fixed windows; the report uses the first ``stable_windows``
consecutive windows whose throughput and p99 stay within ``--stability`` of their mean (the
perf_analyzer criterion), or all windows, marked unstable. Latencies go into HDR histograms
(the ``hdrhistogram`` package). Output: terminal table, JSON, Markdown, PNG.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import queue
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .traces import bursts, diurnal, poisson, steps

STATUS_OK = 0
HDR_MAX_US = 600_000_000


@dataclass
class LoadSpec:
    concurrency: int = 0  # > 0: closed loop
    rate: float = 0.0  # open loop, requests/s
    distribution: str = "poisson"  # or "constant"
    intervals_file: str = ""
    profile: str = ""  # step:R1,R2 | sine:MEAN,AMP,PERIOD | bursts:LOW,HIGH
    priority_mix: tuple = (0.0, 1.0, 0.0)
    deadlines_ms: tuple = (0.0, 0.0, 0.0)  # per class; 0 = the dispatcher's default
    warmup_s: float = 2.0
    window_s: float = 5.0
    windows: int = 3
    stability: float = 0.15
    stable_windows: int = 3
    processes: int = 2
    seed: int = 0

    @property
    def duration(self) -> float:
        return self.warmup_s + self.window_s * self.windows


def schedule(spec: LoadSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Send offsets (s), priority class, timeout (s) for open-loop modes."""
    dur, rng = spec.duration, np.random.default_rng(spec.seed)
    if spec.intervals_file:
        iv = np.array([float(x) for x in Path(spec.intervals_file).read_text().split()])
        t = np.cumsum(np.resize(iv, int(dur / max(iv.mean(), 1e-6)) + 1))
    elif spec.profile:
        kind, _, args = spec.profile.partition(":")
        a = [float(x) for x in args.split(",")]
        if kind == "step":
            t = steps([(0.0, a[0]), (dur / 2, a[1])], dur, seed=spec.seed).arrivals
        elif kind == "sine":
            t = diurnal(a[0], a[1], a[2], dur, seed=spec.seed).arrivals
        elif kind == "bursts":
            t = bursts(a[0], a[1], dur / 20, dur / 80, dur, seed=spec.seed).arrivals
        else:
            raise ValueError(f"unknown profile {spec.profile!r}")
    elif spec.distribution == "constant":
        t = np.arange(0.0, dur, 1.0 / spec.rate)
    else:
        t = poisson(spec.rate, int(spec.rate * dur * 1.3) + 10, seed=spec.seed).arrivals
    t = t[t < dur]
    prio = rng.choice(3, size=len(t), p=np.asarray(spec.priority_mix) / sum(spec.priority_mix)).astype(np.int8)
    timeout = np.asarray(spec.deadlines_ms, dtype=np.float64)[prio] / 1e3
    return t, prio, timeout


# ---------------------------------------------------------------- generator processes
PATHS = ("", "cpu", "gpu")
COLUMNS = ("sent", "latency_us", "status", "path", "priority", "queue_us", "compute_us")


def _make_inputs(kind: str, spec_inputs):
    if kind == "minilm":
        from batchyard.workers.models import tokenize

        from .demo import SENTENCES

        ids, mask = tokenize(SENTENCES)
        return lambda i: {"input_ids": ids[i % 8:i % 8 + 1], "attention_mask": mask[i % 8:i % 8 + 1]}
    zeros = {t.name: np.zeros((1, *t.shape), dtype=t.dtype) for t in spec_inputs}
    return lambda i: zeros


async def _run_batchyard(address, model, inputs_kind, spec: LoadSpec, part: int, t0: float):
    from batchyard.client import AsyncClient
    from batchyard.errors import BatchyardError

    rows = []
    async with AsyncClient(address) as c:
        try:
            mspec = await c.model_info(model, timeout=3.0)
        except BatchyardError as e:
            raise SystemExit(f"bench: cannot reach a dispatcher serving {model!r} at {address}: {e}")
        make = _make_inputs(inputs_kind, mspec.inputs)

        async def one(i, prio, timeout):
            sent = time.monotonic()
            try:
                r = await c.infer(model, make(i), priority=int(prio), timeout=timeout or None)
                tm = r.timing
                rows.append((sent - t0, (time.monotonic() - sent) * 1e6, 0, PATHS.index(tm.path) if tm.path in PATHS else 0,
                             prio, tm.queue_us, tm.compute_us))
            except BatchyardError as e:
                rows.append((sent - t0, (time.monotonic() - sent) * 1e6, int(e.status), 0, prio, 0, 0))

        await _drive(spec, part, t0, one)
    return rows


async def _run_triton(url, model, inputs_kind, spec: LoadSpec, part: int, t0: float):
    import tritonclient.grpc.aio as aio
    from batchyard.protocol import TensorSpec

    client = aio.InferenceServerClient(url)
    try:
        try:
            meta = await client.get_model_metadata(model, as_json=True)
        except Exception as e:
            raise SystemExit(f"bench: cannot reach Triton model {model!r} at {url}: {e}")
        dt = {"INT64": "int64", "FP32": "float32", "INT32": "int32", "FP16": "float16"}
        ins = [TensorSpec(i["name"], dt[i["datatype"]], tuple(int(x) for x in i["shape"][1:])) for i in meta["inputs"]]
        make = _make_inputs(inputs_kind, ins)
        out_name = meta["outputs"][0]["name"]
        rows = []

        async def one(i, prio, timeout):
            arrays = make(i)
            req = []
            for t in ins:
                x = aio.InferInput(t.name, list(arrays[t.name].shape), {v: k for k, v in dt.items()}[t.dtype])
                x.set_data_from_numpy(arrays[t.name])
                req.append(x)
            sent = time.monotonic()
            try:
                await client.infer(model, req, outputs=[aio.InferRequestedOutput(out_name)],
                                   client_timeout=timeout or 30.0)
                rows.append((sent - t0, (time.monotonic() - sent) * 1e6, 0, 0, prio, 0, 0))
            except Exception:
                rows.append((sent - t0, (time.monotonic() - sent) * 1e6, 14, 0, prio, 0, 0))

        await _drive(spec, part, t0, one)
        return rows
    finally:
        await client.close()


async def _drive(spec: LoadSpec, part: int, t0: float, one) -> None:
    tasks = []
    if spec.concurrency:
        stop = t0 + spec.duration
        lanes = range(part, spec.concurrency, spec.processes)
        counter = iter(range(10**9))

        async def lane():
            while time.monotonic() < stop:
                await one(next(counter), 1, 0.0)

        await asyncio.gather(*(lane() for _ in lanes))
        return
    t, prio, timeout = schedule(spec)
    for i in range(part, len(t), spec.processes):
        delay = t0 + t[i] - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # open-loop pacing to the schedule
        tasks.append(asyncio.ensure_future(one(i, prio[i], timeout[i])))
    await asyncio.gather(*tasks)


def _proc(target, address, model, inputs_kind, spec_dict, part, t0, q) -> None:
    import uvloop

    spec = LoadSpec(**spec_dict)
    fn = _run_triton if target == "triton" else _run_batchyard
    try:
        rows = uvloop.run(fn(address, model, inputs_kind, spec, part, t0))
        q.put(("ok", np.asarray(rows, dtype=np.float64).reshape(-1, len(COLUMNS)).tobytes()))
    except BaseException as e:  # report, never hang the coordinator
        q.put(("error", str(e) or type(e).__name__))


class _NoBar:
    def update_to(self, _t: float) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total_s: float, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    bar = tqdm(total=round(total_s, 1), unit="s", desc="load", leave=False, bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s")

    def update_to(t: float) -> None:
        bar.n = min(bar.total, round(t, 1))
        bar.refresh()

    bar.update_to = update_to
    return bar


def run_load(address: str, model: str, spec: LoadSpec, target: str = "batchyard", inputs: str = "zeros",
             progress: bool = False) -> np.ndarray:
    """Run the load from ``spec.processes`` processes; return one row per request (COLUMNS)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    t0 = time.monotonic() + 1.5 + 0.2 * spec.processes  # a common start once every process is up
    ps = [ctx.Process(target=_proc, args=(target, address, model, inputs, asdict(spec), k, t0, q), daemon=True)
          for k in range(spec.processes)]
    for p in ps:
        p.start()
    parts, errors = [], []
    bar = _progress(spec.duration + (t0 - time.monotonic()), progress)
    deadline = t0 + spec.duration + 120
    try:
        while len(parts) + len(errors) < len(ps):
            try:
                kind, payload = q.get(timeout=1.0)  # the 1 s tick only moves the progress bar
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise SystemExit("bench: load generator processes did not finish in time") from None
                bar.update_to(time.monotonic() - (t0 - 1.5))
                continue
            (parts if kind == "ok" else errors).append(payload)
        bar.close()
    finally:
        for p in ps:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise SystemExit(errors[0] if errors[0].startswith("bench:") else f"bench: load generator failed: {errors[0]}")
    rows = np.concatenate([np.frombuffer(b, dtype=np.float64).reshape(-1, len(COLUMNS)) for b in parts])
    return rows[np.argsort(rows[:, 0], kind="stable")]


# ---------------------------------------------------------------- analysis
def hdr(values_us) -> "object":
    from hdrh.histogram import HdrHistogram

    h = HdrHistogram(1, HDR_MAX_US, 3)
    for v in values_us:
        h.record_value(max(1, min(int(v), HDR_MAX_US)))
    return h


@dataclass
class Report:
    target: str
    label: str
    offered_rps: float
    windows: list = field(default_factory=list)
    stable: bool = False
    used_windows: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    schedule_kept: bool = True
    latencies_ms: list = field(default_factory=list, repr=False)  # the measured windows, for CDFs


def analyse(rows: np.ndarray, spec: LoadSpec, target: str, label: str) -> Report:
    sent, lat, status = rows[:, 0], rows[:, 1], rows[:, 2].astype(int)
    off = float(len(schedule(spec)[0]) / spec.duration) if not spec.concurrency else 0.0
    rep = Report(target, label, off)
    for w in range(spec.windows):
        lo = spec.warmup_s + w * spec.window_s
        m = (sent >= lo) & (sent < lo + spec.window_s)
        ok = m & (status == STATUS_OK)
        rep.windows.append({"throughput_rps": float(ok.sum() / spec.window_s),
                            "p99_ms": float(np.percentile(lat[ok], 99) / 1e3) if ok.any() else float("nan")})
    k = spec.stable_windows
    chosen = list(range(spec.windows))
    for start in range(0, spec.windows - k + 1):
        ws = rep.windows[start:start + k]
        ok = True
        for key in ("throughput_rps", "p99_ms"):
            vals = np.array([x[key] for x in ws])
            if not np.all(np.isfinite(vals)) or np.any(np.abs(vals - vals.mean()) > spec.stability * vals.mean()):
                ok = False
        if ok:
            rep.stable, chosen = True, list(range(start, start + k))
            break
    rep.used_windows = chosen
    lo = spec.warmup_s + chosen[0] * spec.window_s
    hi = spec.warmup_s + (chosen[-1] + 1) * spec.window_s
    m = (sent >= lo) & (sent < hi)
    span = hi - lo
    rep.summary = summarise(rows[m], span)
    rep.latencies_ms = (rows[m & (status == STATUS_OK), 1] / 1e3).round(3).tolist()
    if not spec.concurrency:
        t = schedule(spec)[0]
        planned = ((t >= lo) & (t < hi)).sum()
        # Rows are stamped when sent: if the generator fell behind, sends slide out of the window.
        rep.schedule_kept = bool(m.sum() >= 0.97 * planned)
        rep.summary["sent_rps"] = float(m.sum() / span)
        rep.summary["planned_rps"] = float(planned / span)
    return rep


def summarise(rows: np.ndarray, span: float) -> dict:
    lat, status = rows[:, 1], rows[:, 2].astype(int)
    ok = status == STATUS_OK
    h = hdr(lat[ok]) if ok.any() else None
    q = (lambda p: h.get_value_at_percentile(p) / 1e3) if h is not None else (lambda p: float("nan"))
    out = {"requests": int(len(rows)), "served": int(ok.sum()),
           "p50_ms": q(50), "p90_ms": q(90), "p95_ms": q(95), "p99_ms": q(99), "p999_ms": q(99.9),
           "throughput_rps": float(ok.sum() / span) if span else 0.0,
           # The dispatcher answers DEADLINE_EXCEEDED at a request's deadline, so every OK reply was
           # within its deadline: goodput = served requests/s (requests without a deadline count too).
           "goodput_rps": float(ok.sum() / span) if span else 0.0,
           "deadline_exceeded": int((status == 4).sum()), "overloaded": int((status == 8).sum()),
           "errors": {str(s): int((status == s).sum()) for s in np.unique(status[~ok])}}
    for c, name in enumerate(("high", "normal", "low")):
        mc = rows[:, 4] == c
        if mc.any():
            out[f"class_{name}"] = {"served": int((ok & mc).sum()), "errors": int((~ok & mc).sum()),
                                    "p99_ms": float(np.percentile(lat[ok & mc], 99) / 1e3) if (ok & mc).any() else None}
    for p in (1, 2):
        mp_ = ok & (rows[:, 3] == p)
        if mp_.any():
            out[f"path_{PATHS[p]}"] = {"served": int(mp_.sum()), "p99_ms": float(np.percentile(lat[mp_], 99) / 1e3),
                                       "mean_queue_ms": float(rows[mp_, 5].mean() / 1e3),
                                       "mean_compute_ms": float(rows[mp_, 6].mean() / 1e3)}
    return out


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text exposition as {'name{labels}': value}."""
    import urllib.request

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def server_split(before: dict, after: dict) -> dict:
    """Mean queue and compute time per served request, per path, from Triton-named counters."""
    def by_path(name):
        acc: dict[str, float] = {}
        for k, v in after.items():
            if k.startswith(name + "{"):
                path = k.split('path="')[1].split('"')[0]
                acc[path] = acc.get(path, 0.0) + v - before.get(k, 0.0)
        return acc

    n, qd, cd = (by_path(x) for x in ("nv_inference_request_success", "nv_inference_queue_duration_us",
                                       "nv_inference_compute_infer_duration_us"))
    return {p: {"served": int(n[p]), "mean_queue_ms": qd.get(p, 0) / n[p] / 1e3, "mean_compute_ms": cd.get(p, 0) / n[p] / 1e3}
            for p in n if n[p] > 0}


def table(reports: list[Report]) -> str:
    head = f"{'target':<26}{'offered/s':>10}{'tput/s':>9}{'p50':>8}{'p90':>8}{'p99':>8}{'p99.9':>8}{'errors':>8}  stable"
    lines = [head, "-" * len(head)]
    for r in reports:
        s = r.summary
        errs = sum(s["errors"].values())
        lines.append(f"{r.label:<26}{r.offered_rps:>10.1f}{s['throughput_rps']:>9.1f}{s['p50_ms']:>8.2f}"
                     f"{s['p90_ms']:>8.2f}{s['p99_ms']:>8.2f}{s['p999_ms']:>8.2f}{errs:>8}  "
                     f"{'yes' if r.stable else 'NO'}{'' if r.schedule_kept else ' (generator behind schedule)'}")
    return "\n".join(lines)


def write_outputs(reports: list[Report], out: Path, title: str, notes: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps([{k: v for k, v in asdict(r).items() if k != "latencies_ms"}
                                                for r in reports], indent=1, default=float))
    md = [f"# {title}", "", notes, "", "```", table(reports), "```", "",
          "Latencies in ms (client-observed, HDR histograms); throughput = served requests/s in the measured windows.",
          "", "![p99 vs offered load](p99_vs_load.png)", "", "![latency CDF](latency_cdf.png)", ""]
    (out / "bench.md").write_text("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label in dict.fromkeys(r.label.split(" @")[0] for r in reports):
        rs = [r for r in reports if r.label.split(" @")[0] == label]
        ax.plot([r.offered_rps for r in rs], [r.summary["p99_ms"] for r in rs], marker="o", label=label)
    ax.set_xlabel("offered load, requests/s")
    ax.set_ylabel("p99 latency, ms")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "p99_vs_load.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in reports:
        lat = np.sort(np.asarray(r.latencies_ms))
        if lat.size:
            ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, label=r.label, lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("latency, ms")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title("latency CDF", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110)
    plt.close(fig)
