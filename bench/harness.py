"""``batchyard bench``: perf_analyzer-style load against a Batchyard dispatcher or a Triton server.

Load modes (as perf_analyzer): closed loop ``--concurrency N``; open loop ``--request-rate R``
with ``--distribution poisson|constant``; ``--request-intervals FILE`` (one interval in
seconds per line); plus lambda(t) profiles ``--profile step:R1,R2|sine:MEAN,AMP,PERIOD|
bursts:LOW,HIGH`` and priority/deadline mixes. Load comes from ``--processes`` generator
processes (each its own client and event loop), so the generator is not the bottleneck; each
run checks that it kept to its schedule and says so when it did not.

Measurement: a warm-up, then fixed windows. As in perf_analyzer, a request belongs to the window
in which its reply *arrived*: throughput is completions per second inside the window (past
saturation that is the service rate, not the offered rate), and the latencies are those of the
requests completed there; goodput counts only the completions within their deadline and the SLO.
The report uses the first ``stable_windows`` consecutive windows whose largest throughput and
largest p99 are each within ``1 + --stability`` times the smallest (the perf_analyzer criterion,
with p99 as its latency), or all windows, marked unstable. Percentiles and outputs (terminal
table, JSON, Markdown, PNG): bench/report.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional
from pathlib import Path

import numpy as np

from .report import percentiles_ms
from .traces import bursts, diurnal, poisson, steps

STATUS_OK = 0
MIN_MEAN_INTERVAL_S = 1e-6  # a million requests a second: past any node, and the schedule fits memory
START_TIMEOUT_S = 120.0  # for the generator processes to connect and make their inputs
CLIENT_GRACE_S = 30.0  # schedule_policy: how much longer than the server's timeout the client waits


@dataclass
class LoadSpec:
    concurrency: int = 0  # > 0: closed loop
    rate: float = 0.0  # open loop, requests/s
    distribution: str = "poisson"  # or "constant"
    intervals_file: str = ""
    profile: str = ""  # step:R1,R2 | sine:MEAN,AMP,PERIOD | bursts:LOW,HIGH
    priority_mix: tuple = (0.0, 1.0, 0.0)
    deadlines_ms: tuple = (0.0, 0.0, 0.0)  # per class; 0 = the dispatcher's default
    slo_ms: float = 0.0  # goodput counts completions within this latency (0: deadlines only)
    warmup_s: float = 2.0
    window_s: float = 5.0
    windows: int = 3
    stability: float = 0.15
    stable_windows: int = 3
    processes: int = 2
    seed: int = 0
    # triton target: send Triton's schedule-policy parameters (priority = class + 1, so 1 is the
    # highest; the deadline as the server-side ``timeout``) and count a reply the server expired
    # ("Request timeout expired", Triton's and Batchyard's front door's) as status 4, not 14.
    schedule_policy: bool = False

    @property
    def duration(self) -> float:
        return self.warmup_s + self.window_s * self.windows


MAX_SCHEDULED = 50_000_000  # requests in one run's schedule (~1.2 GB of it, in every load process)


def scheduled_requests(spec: LoadSpec) -> float:
    """About how many requests an open-loop run of ``spec`` schedules (0 for a closed loop)."""
    dur = spec.duration
    if spec.concurrency:
        return 0.0
    if spec.intervals_file:
        iv = [float(x) for x in Path(spec.intervals_file).read_text().split()]
        return dur / max(sum(iv) / max(len(iv), 1), MIN_MEAN_INTERVAL_S)
    if spec.profile:
        return dur * profile_peak_rate(*profile_parts(spec.profile))
    return spec.rate * dur


def profile_parts(profile: str) -> tuple[str, list[float]]:
    """A --profile KIND:N1,N2,...: its kind and numbers (ValueError where they are not numbers)."""
    kind, _, args = profile.partition(":")
    return kind, [float(x) for x in args.split(",")]


def profile_peak_rate(kind: str, numbers: list[float]) -> float:
    """The highest rate a profile's load reaches, req/s."""
    return numbers[0] + numbers[1] if kind == "sine" else max(numbers[:2])


def schedule(spec: LoadSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Send offsets (s), priority class, timeout (s) for open-loop modes."""
    dur, rng = spec.duration, np.random.default_rng(spec.seed)
    if spec.intervals_file:
        iv = np.array([float(x) for x in Path(spec.intervals_file).read_text().split()])
        # Intervals of 0 (or below) sent the whole run at its first instant: 1e6 requests a second;
        # ones of 1e-9 s made a schedule of 17e9 requests (MemoryError, after the run started).
        if not (len(iv) and np.all(np.isfinite(iv)) and iv.min() > 0 and iv.mean() >= MIN_MEAN_INTERVAL_S):
            raise ValueError(f"{spec.intervals_file}: intervals must be seconds > 0, at least one, "
                             f"{MIN_MEAN_INTERVAL_S:g} s apart on average")
        # The file whole, again and again until the run is full, as perf_analyzer cycles it: as
        # many intervals as the run holds at their mean took 28 of a file that filled 7 s with
        # 112 (short intervals first), all in the warm-up.
        t = np.cumsum(np.tile(iv, int(dur // iv.sum()) + 1))
    elif spec.profile:
        kind, a = profile_parts(spec.profile)
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
# One float64 row per request. sent: seconds from the common start; path: index in PATHS;
# simulated: 1 when a simulated device served it; timeout_us: the request's deadline (0: none);
# lag_us: how long after its scheduled instant the request was sent (open loop; 0 closed loop).
COLUMNS = ("sent", "latency_us", "status", "path", "priority", "queue_us", "compute_us", "batch_size",
           "simulated", "timeout_us", "lag_us")
(SENT, LATENCY_US, STATUS, PATH, PRIORITY, QUEUE_US, COMPUTE_US, BATCH_SIZE, SIMULATED, TIMEOUT_US,
 LAG_US) = range(len(COLUMNS))
# A run whose sends lag their schedule by more than this (p99) did not offer the load it names.
SEND_LAG_MAX_MS = 5.0


MINILM_INPUTS = ("input_ids", "attention_mask")


def _make_inputs(kind: str, spec_inputs, model: str = ""):
    if kind == "minilm":
        names = tuple(t.name for t in spec_inputs)
        if sorted(names) != sorted(MINILM_INPUTS):
            # (every request failed INVALID_ARGUMENT and the run exited 0, or, at Triton, a KeyError)
            raise SystemExit(f"bench: --inputs minilm makes {' and '.join(MINILM_INPUTS)}; model {model!r} takes "
                             f"{', '.join(names) or 'none'}: give --inputs zeros")
        from batchyard.workers.models import tokenize

        from .demo import SENTENCES

        ids, mask = tokenize(SENTENCES)
        return lambda i: {"input_ids": ids[i % 8:i % 8 + 1], "attention_mask": mask[i % 8:i % 8 + 1]}
    zeros = {t.name: np.zeros((1, *t.shape), dtype=t.dtype) for t in spec_inputs}
    return lambda i: zeros


async def _run_batchyard(address, model, inputs_kind, spec: LoadSpec, part: int, ready, keys: dict = {}):
    from batchyard.client import AsyncClient
    from batchyard.errors import BatchyardError

    rows = []
    async with AsyncClient(address, **keys) as c:
        try:
            mspec = await c.model_info(model, timeout=3.0)
        except BatchyardError as e:
            raise SystemExit(f"bench: cannot reach a dispatcher serving {model!r} at {address}: {e}")
        make = _make_inputs(inputs_kind, mspec.inputs, model)

        async def one(i, prio, timeout, due=None):
            sent = time.monotonic()
            lag = (sent - due) * 1e6 if due is not None else 0.0
            try:
                r = await c.infer(model, make(i), priority=int(prio), timeout=timeout or None)
                tm = r.timing
                rows.append((sent - t0, (time.monotonic() - sent) * 1e6, 0, PATHS.index(tm.path) if tm.path in PATHS else 0,
                             prio, tm.queue_us, tm.compute_us, tm.batch_size, tm.simulated, timeout * 1e6, lag))
            except BatchyardError as e:
                rows.append((sent - t0, (time.monotonic() - sent) * 1e6, int(e.status), 0, prio, 0, 0, 0, 0, timeout * 1e6,
                             lag))

        t0 = ready()
        await _drive(spec, part, t0, one)
    return rows


async def _run_triton(url, model, inputs_kind, spec: LoadSpec, part: int, ready):
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
        make = _make_inputs(inputs_kind, ins, model)
        out_name = meta["outputs"][0]["name"]
        policy, error_status = _triton_policy(spec.schedule_policy)
        rows = []

        async def one(i, prio, timeout, due=None):
            arrays = make(i)
            req = []
            for t in ins:
                x = aio.InferInput(t.name, list(arrays[t.name].shape), {v: k for k, v in dt.items()}[t.dtype])
                x.set_data_from_numpy(arrays[t.name])
                req.append(x)
            sent = time.monotonic()
            lag = (sent - due) * 1e6 if due is not None else 0.0
            try:
                await client.infer(model, req, outputs=[aio.InferRequestedOutput(out_name)], **policy(prio, timeout))
                rows.append((sent - t0, (time.monotonic() - sent) * 1e6, 0, 0, prio, 0, 0, 0, 0, timeout * 1e6, lag))
            except Exception as e:
                rows.append((sent - t0, (time.monotonic() - sent) * 1e6, error_status(e), 0, prio, 0, 0, 0, 0,
                             timeout * 1e6, lag))

        t0 = ready()
        await _drive(spec, part, t0, one)
        return rows
    finally:
        await client.close()


def triton_error_status(e: Exception, own_deadline: int = 4) -> int:
    """The Batchyard status of a tritonclient failure (the statuses are gRPC's numbers): the
    server's expiry ("Request timeout expired") is 4, the client's own deadline ``own_deadline``,
    a full queue ("Exceeds maximum queue size", Triton's and the front door's) 8, else the call's
    gRPC code, 14 where it has none. Every failure was 14, which also means "the node went away"
    (bench exits 1 on it): an overloaded run against a node that stayed up exited 1."""
    text = str(e).lower()
    if "timeout expired" in text:
        return 4
    if "deadline exceeded" in text:
        return own_deadline
    if "exceeds maximum queue size" in text:
        return 8
    import grpc

    status = getattr(e, "status", None)
    name = str(status() if callable(status) else "").rpartition(".")[2]
    try:
        return grpc.StatusCode[name].value[0]
    except KeyError:
        return 14


def _triton_policy(on: bool):
    """(the ``infer`` keywords for a request of class ``prio`` with deadline ``timeout`` s, the
    status of a failed request) for the triton target. Off: the deadline is only the client's
    (30 s without one), its expiry 4. On: the server gets the priority and the deadline, the
    client waits CLIENT_GRACE_S longer so that the server's own expiry (4) is what is seen; the
    client's deadline past that is its giving up on the server, CANCELLED (1), not an expiry the
    server reported (``priority_vs_triton`` counts those apart)."""
    if not on:
        return (lambda prio, timeout: {"client_timeout": timeout or 30.0}), triton_error_status

    def kwargs(prio, timeout):
        return {"priority": int(prio) + 1, "timeout": int(timeout * 1e6) if timeout else None,
                "client_timeout": timeout + CLIENT_GRACE_S if timeout else 2 * CLIENT_GRACE_S}

    return kwargs, lambda e: triton_error_status(e, own_deadline=1)


async def _drive(spec: LoadSpec, part: int, t0: float, one) -> None:
    tasks = []
    if spec.concurrency:
        stop = t0 + spec.duration
        lanes = range(part, spec.concurrency, spec.processes)
        counter = iter(range(10**9))
        # Each request's class and deadline drawn from the mix, as the open loop's schedule does:
        # every closed-loop request went out normal with no deadline, whatever the options said.
        rng = np.random.default_rng([spec.seed, part])
        mix = np.asarray(spec.priority_mix) / sum(spec.priority_mix)
        timeouts = np.asarray(spec.deadlines_ms, dtype=np.float64) / 1e3

        async def lane():
            while time.monotonic() < stop:
                prio = int(rng.choice(3, p=mix))
                await one(next(counter), prio, float(timeouts[prio]))

        await asyncio.gather(*(lane() for _ in lanes))
        return
    t, prio, timeout = schedule(spec)
    for i in range(part, len(t), spec.processes):
        delay = t0 + t[i] - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)  # open-loop pacing to the schedule
        tasks.append(asyncio.ensure_future(one(i, prio[i], timeout[i], t0 + t[i])))
    await asyncio.gather(*tasks)


def _proc(target, address, model, inputs_kind, spec_dict, part, q, go, start, keys: dict) -> None:
    import functools

    import uvloop

    spec = LoadSpec(**spec_dict)
    fn = _run_triton if target == "triton" else functools.partial(_run_batchyard, keys=keys)

    def ready() -> float:
        """Report this process connected and its inputs made; block until the common start time."""
        q.put(("ready", b""))
        if not go.wait(timeout=START_TIMEOUT_S):  # blocking is fine: nothing runs on this loop yet
            raise SystemExit("bench: the coordinator never gave the start")
        return start.value

    try:
        rows = uvloop.run(fn(address, model, inputs_kind, spec, part, ready))
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


def drain_limit_s(spec: LoadSpec) -> float:
    """How long after its schedule ends a run waits for its last replies: they may come as late
    as the longest deadline asked (a saturated run with 300 s deadlines was given up 120 s after
    its windows, nothing written)."""
    return max(120.0, max(spec.deadlines_ms) / 1e3 + 30.0)


@contextlib.contextmanager
def _stops_deferred():
    """Hold a SIGTERM or SIGINT that comes in the block until it ends, then take it as it came.

    A spawn context's Queue, Event and Value are named semaphores in /dev/shm, unlinked at exit
    only once registered, and the first one registered starts the resource tracker (a process:
    tens of ms on a busy box). A demo stopped by SIGTERM in that window left its semaphore in
    /dev/shm for good (exit_on_sigterm raises there)."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers are the main thread's
        yield
        return
    got: list[int] = []
    held = (signal.SIGTERM, signal.SIGINT)
    before = {s: signal.signal(s, lambda signo, _frame: got.append(signo)) for s in held}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: not set from Python
        if got:
            signal.raise_signal(got[0])  # to the handler it would have met


def run_load(address: str, model: str, spec: LoadSpec, target: str = "batchyard", inputs: str = "zeros",
             progress: bool = False, keys: Optional[dict] = None) -> np.ndarray:
    """Run the load from ``spec.processes`` processes; return one row per request (COLUMNS).
    ``keys``: the Batchyard client's CURVE keyword arguments (``transport.node_client_keys``)."""
    n = scheduled_requests(spec)
    if n > MAX_SCHEDULED:  # a rate or duration no argument check bounds alone: 1e6/s over 1e7 s was 284 TiB
        raise SystemExit(f"bench: a run of {n:.3g} requests (rate x duration); at most {MAX_SCHEDULED:.3g} in one run")
    ctx = mp.get_context("spawn")
    with _stops_deferred():
        q, go, start = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    ps = [ctx.Process(target=_proc, args=(target, address, model, inputs, asdict(spec), k, q, go, start,
                                                   keys or {}), daemon=True)
          for k in range(spec.processes)]
    for p in ps:
        p.start()
    parts, errors, n_ready = [], [], 0
    bar = _NoBar()
    # The schedule starts once every process has connected and made its inputs (importing a
    # tokenizer can take seconds): a start fixed in advance would begin the run behind schedule.
    deadline = time.monotonic() + START_TIMEOUT_S
    done = False
    try:
        while len(parts) + len(errors) < len(ps) and not (errors and n_ready < len(ps)):
            try:
                kind, payload = q.get(timeout=1.0)  # the 1 s tick only moves the progress bar
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise SystemExit("bench: load generator processes did not finish in time (requests without "
                                     "--deadlines-ms wait up to the node's default_timeout_s for their replies)") from None
                bar.update_to(time.monotonic() - start.value)
                continue
            if kind == "ready":
                n_ready += 1
                if n_ready == len(ps):
                    start.value = time.monotonic() + 0.05  # time.monotonic is one clock for all processes
                    go.set()
                    deadline = start.value + spec.duration + drain_limit_s(spec)
                    bar = _progress(spec.duration, progress)
                continue
            (parts if kind == "ok" else errors).append(payload)
        bar.close()
        done = True
    finally:
        for p in ps:
            # Waited for only once the run started and finished: before the start (one process
            # failed to connect) the rest wait for a go that will not come, and a run cut short
            # (SIGTERM to the demo, Ctrl-C) held the demo's stop 10 s a process, mid-run, before
            # its node was stopped.
            p.join(timeout=10 if done and go.is_set() else 0)
            if p.is_alive():
                p.kill()
    if errors:
        raise SystemExit(errors[0] if errors[0].startswith("bench:") else f"bench: load generator failed: {errors[0]}")
    rows = np.concatenate([np.frombuffer(b, dtype=np.float64).reshape(-1, len(COLUMNS)) for b in parts])
    return rows[np.argsort(rows[:, SENT], kind="stable")]


# ---------------------------------------------------------------- analysis
@dataclass
class Report:
    target: str
    label: str
    offered_rps: float
    windows: list = field(default_factory=list)
    stable: Optional[bool] = False  # None: not judged (one window has nothing to agree with)
    used_windows: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    schedule_kept: bool = True
    latencies_ms: list = field(default_factory=list, repr=False)  # the measured windows, for CDFs


def latency_us(rows: np.ndarray) -> np.ndarray:
    """Each request's latency from its *scheduled* instant: the reply's time less the schedule's,
    so a generator that falls behind (a stalled event loop) adds its lag instead of hiding the
    queueing it caused (coordinated omission). Measured from the actual send, one 250 ms stall
    of the client left a reported p99 of 2.6 ms where the scheduled requests waited up to 249."""
    return rows[:, LATENCY_US] + rows[:, LAG_US]


def done_times(rows: np.ndarray) -> np.ndarray:
    """When each reply arrived, seconds from the common start."""
    return rows[:, SENT] + rows[:, LATENCY_US] / 1e6


def windows_stable(windows: list, stability: float) -> bool:
    """perf_analyzer's rule (IsInferWindowStable, IsLatencyWindowStable): over ``windows``, the
    largest throughput and the largest p99 at most ``1 + stability`` times the smallest. Within
    ``stability`` of their mean, windows of 85, 100 and 115/s passed at 0.15 (max/min 1.35)."""
    for key in ("throughput_rps", "p99_ms"):
        vals = np.array([w[key] for w in windows])
        # An empty window (NaN p99, no throughput) is no measurement: not stable.
        if not (np.all(np.isfinite(vals)) and vals.min() > 0 and vals.max() <= (1 + stability) * vals.min()):
            return False
    return True


def analyse(rows: np.ndarray, spec: LoadSpec, target: str, label: str) -> Report:
    sent, done, status = rows[:, SENT], done_times(rows), rows[:, STATUS].astype(int)
    off = float(len(schedule(spec)[0]) / spec.duration) if not spec.concurrency else 0.0
    rep = Report(target, label, off)
    for w in range(spec.windows):
        lo = spec.warmup_s + w * spec.window_s
        ok = (done >= lo) & (done < lo + spec.window_s) & (status == STATUS_OK)
        rep.windows.append({"throughput_rps": float(ok.sum() / spec.window_s),
                            "p99_ms": percentiles_ms(latency_us(rows)[ok], (99,))[99]})
    k = spec.stable_windows
    chosen = list(range(spec.windows))
    if k < 2:  # compared with itself only, a saturated run's one window passed as stable
        rep.stable = None
    for start in range(0, spec.windows - k + 1 if k >= 2 else 0):
        if windows_stable(rep.windows[start:start + k], spec.stability):
            rep.stable, chosen = True, list(range(start, start + k))
            break
    rep.used_windows = chosen
    lo = spec.warmup_s + chosen[0] * spec.window_s
    hi = spec.warmup_s + (chosen[-1] + 1) * spec.window_s
    completed = (done >= lo) & (done < hi)
    span = hi - lo
    rep.summary = summarise(rows[completed], span, spec.slo_ms)
    rep.latencies_ms = (latency_us(rows)[completed & (status == STATUS_OK)] / 1e3).round(3).tolist()
    # The requests *sent* in the windows that failed, whenever their reply came: a node that went
    # away mid-run failed most of them only at their timeout, after the last window, and the
    # table said "errors 2" of 201 (UNAVAILABLE among them makes `batchyard bench` exit 1).
    sent_in = (sent >= lo) & (sent < hi)
    rep.summary["failed_of_sent"] = {str(c): int(n) for c, n in zip(*np.unique(status[sent_in & (status != STATUS_OK)],
                                                                              return_counts=True))}
    if not spec.concurrency:
        t = schedule(spec)[0]
        planned = ((t >= lo) & (t < hi)).sum()
        # Rows are stamped when sent: if the generator fell behind, sends slide out of the window,
        # and a stall that only delays them shows in their lag.
        lag_p99 = percentiles_ms(rows[sent_in, LAG_US], (99,))[99] if sent_in.any() else 0.0
        rep.schedule_kept = bool(sent_in.sum() >= 0.97 * planned and not lag_p99 > SEND_LAG_MAX_MS)
        rep.summary["sent_rps"] = float(sent_in.sum() / span)
        rep.summary["planned_rps"] = float(planned / span)
        rep.summary["send_lag_p99_ms"] = lag_p99
    return rep


def summarise(rows: np.ndarray, span: float, slo_ms: float = 0.0) -> dict:
    """Latency and rates of the requests *completed* in a span of ``span`` seconds."""
    lat, status = latency_us(rows), rows[:, STATUS].astype(int)
    ok = status == STATUS_OK
    timeout_us = rows[:, TIMEOUT_US]
    # Client-observed: a reply that arrived after the request's deadline or the SLO is not good.
    good = ok & ((timeout_us == 0) | (lat <= timeout_us)) & ((slo_ms <= 0) | (lat <= slo_ms * 1e3))
    pct = percentiles_ms(lat[ok], (50, 90, 95, 99, 99.9))
    per_s = (lambda n: float(n / span)) if span else (lambda n: 0.0)
    out = {"requests": int(len(rows)), "served": int(ok.sum()),
           "p50_ms": pct[50], "p90_ms": pct[90], "p95_ms": pct[95], "p99_ms": pct[99], "p999_ms": pct[99.9],
           "throughput_rps": per_s(ok.sum()), "goodput_rps": per_s(good.sum()), "slo_ms": slo_ms,
           "deadline_exceeded": int((status == 4).sum()), "overloaded": int((status == 8).sum()),
           "errors": {str(s): int((status == s).sum()) for s in np.unique(status[~ok])}}
    for c, name in enumerate(("high", "normal", "low")):
        mc = rows[:, PRIORITY] == c
        if mc.any():
            p99 = percentiles_ms(lat[ok & mc], (99,))[99]
            out[f"class_{name}"] = {"served": int((ok & mc).sum()), "errors": int((~ok & mc).sum()),
                                    "p99_ms": p99 if (ok & mc).any() else None}
    for p in (1, 2):
        mp_ = ok & (rows[:, PATH] == p)
        if mp_.any():
            q = percentiles_ms(lat[mp_], (50, 90, 99))
            out[f"path_{PATHS[p]}"] = {"served": int(mp_.sum()), "p50_ms": q[50], "p90_ms": q[90], "p99_ms": q[99],
                                       "throughput_rps": per_s(mp_.sum()),
                                       "mean_batch": float(rows[mp_, BATCH_SIZE].mean()),
                                       "simulated": bool(rows[mp_, SIMULATED].any()),
                                       "mean_queue_ms": float(rows[mp_, QUEUE_US].mean() / 1e3),
                                       "mean_compute_ms": float(rows[mp_, COMPUTE_US].mean() / 1e3)}
    return out


# ---------------------------------------------------------------- the dispatcher's /metrics
def scrape(url: str) -> list:
    """The samples (name, labels, value) of the Prometheus text exposition at ``url``, named as
    written (exposition_samples)."""
    import urllib.request

    return exposition_samples(urllib.request.urlopen(url, timeout=10).read().decode())


def exposition_samples(text: str) -> list:
    """The samples (name, labels, value) of a Prometheus text exposition, read by prometheus_client
    and named as the text writes them, as Prometheus stores them. The parser renames the samples
    of a counter declared without ``_total`` (Triton's nv_inference_* counters, and the
    dispatcher's) to OpenMetrics' ``<name>_total``: ``nv_inference_count`` would have matched
    nothing here, and a dashboard's query by that name everything."""
    import re

    from prometheus_client.parser import text_string_to_metric_families

    bare_counters = set(re.findall(r"^# TYPE (\S+) counter\s*$", text, re.M))
    out = []
    for family in text_string_to_metric_families(text):
        renamed = family.type == "counter" and family.name in bare_counters
        for s in family.samples:
            out.append(s._replace(name=family.name) if renamed and s.name == family.name + "_total" else s)
    return out


def sample_total(samples: list, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``. Where none is called
    ``name``, those called ``<name>_total``: the name prometheus_client's parser, read directly
    rather than through exposition_samples, gives the samples of a counter declared without it."""
    called = name if any(s.name == name for s in samples) else f"{name}_total"
    return float(sum(s.value for s in samples
                     if s.name == called and all(s.labels.get(k) == v for k, v in labels.items())))


def server_split(before: list, after: list) -> dict:
    """Mean queue and compute time per served request, per path, from Triton-named counters; a
    server whose counters have no path (Triton's own) under "all"."""
    def by_path(name):
        acc: dict[str, float] = {}
        for samples, sign in ((after, 1), (before, -1)):
            for s in samples:
                if s.name == name:
                    path = s.labels.get("path", "all")
                    acc[path] = acc.get(path, 0.0) + sign * s.value
        return acc

    n, qd, cd = (by_path(x) for x in ("nv_inference_request_success", "nv_inference_queue_duration_us",
                                       "nv_inference_compute_infer_duration_us"))
    return {p: {"served": int(n[p]), "mean_queue_ms": qd.get(p, 0) / n[p] / 1e3, "mean_compute_ms": cd.get(p, 0) / n[p] / 1e3}
            for p in n if n[p] > 0}
