"""Discrete-event simulator: the dispatcher's own request lifecycle on a virtual clock.

It drives the same ``RequestCore`` (dispatcher/core.py) and the same policy objects as the live
dispatcher: admission, deadlines, expiry (queued or in flight), dispatch, completion and cost
learning are the code that runs, not a re-implementation. What is simulated is the rest:
devices (service time from a cost curve, optional jitter), and no network or codec time.
Everything this module reports is *simulated*.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from batchyard.core import Rejected, RequestCore
from batchyard.cost_model import CostCurve
from batchyard.policy import make_policy
from batchyard.protocol import Status
from batchyard.state import QUEUED, WorkerState

from .traces import Trace

MODEL = "m"


@dataclass(frozen=True)
class Device:
    name: str
    path: str  # "cpu" | "gpu"
    launch_s: float
    per_item_s: float
    max_batch: int = 64
    jitter: float = 0.0  # relative std-dev of service time
    points: tuple = ()  # measured (B, seconds): when given, service time follows them (piecewise)

    def curve(self) -> CostCurve:
        if self.points:
            return CostCurve.from_points(list(self.points))
        return CostCurve(launch_s=self.launch_s, per_item_s=self.per_item_s)


def seeds_devices(n_cpu: int = 2) -> list[Device]:
    """The seeds' curves: GPU 0.15 ms + 0.02 ms*B, AMX 0.08 ms*B per worker."""
    return [Device("gpu0", "gpu", 0.15e-3, 0.02e-3)] + [Device(f"amx{i}", "cpu", 0.0, 0.08e-3) for i in range(n_cpu)]


@dataclass
class SimResult:
    policy: str
    trace: str
    latency: np.ndarray  # per request, seconds; nan when not served
    status: np.ndarray  # 0 served, 1 rejected on arrival, 2 expired in queue
    met_deadline: np.ndarray  # bool
    priority: np.ndarray
    path_of: np.ndarray  # 0 cpu, 1 gpu, -1 none
    batch_sizes: list = field(default_factory=list)
    batch_paths: list = field(default_factory=list)
    decisions: dict = field(default_factory=dict)
    duration: float = 0.0

    def summary(self) -> dict:
        ok = self.status == 0
        lat = self.latency[ok] * 1e3
        q = (lambda p: float(np.percentile(lat, p))) if lat.size else (lambda p: float("nan"))
        bs = np.asarray(self.batch_sizes)
        return {
            "policy": self.policy, "trace": self.trace, "requests": int(len(self.status)),
            "served": int(ok.sum()), "rejected": int((self.status == 1).sum()), "expired": int((self.status == 2).sum()),
            "p50_ms": q(50), "p90_ms": q(90), "p99_ms": q(99), "p999_ms": q(99.9),
            "mean_ms": float(lat.mean()) if lat.size else float("nan"),
            "throughput_rps": float(ok.sum() / self.duration) if self.duration else 0.0,
            "goodput_rps": float((ok & self.met_deadline).sum() / self.duration) if self.duration else 0.0,
            "p99_by_class_ms": [float(np.percentile(self.latency[ok & (self.priority == c)] * 1e3, 99))
                                if (ok & (self.priority == c)).any() else None for c in range(3)],
            "mean_batch": float(bs.mean()) if bs.size else 0.0,
            "gpu_share": float((self.path_of[ok] == 1).mean()) if ok.any() else 0.0,
            "batch_hist": {int(k): int(v) for k, v in zip(*np.unique(bs, return_counts=True))} if bs.size else {},
            "decisions": self.decisions,
        }


def simulate(policy, trace: Trace, devices: list[Device], seed: int = 0, learn: bool = True) -> SimResult:
    """Run ``trace`` through ``policy`` (object or name) on ``devices``."""
    if isinstance(policy, str):
        policy = make_policy(policy)
    rng = np.random.default_rng(seed)
    n = len(trace)
    arr, prio, tout = trace.arrivals, trace.priority, trace.timeout
    latency = np.full(n, np.nan)
    status = np.zeros(n, np.int8)
    met = np.zeros(n, bool)
    path_of = np.full(n, -1, np.int8)
    batch_sizes: list = []
    batch_paths: list = []

    def on_fail(req, code, message):
        status[req.req_id] = 2  # expired (deadline passed, queued or in flight)

    core = RequestCore(policy, on_fail, max_queue=2**62)
    st = core.state
    dev_of = {}
    for k, dev in enumerate(devices):
        w = WorkerState(dev.name, dev.path, {MODEL: dev.max_batch})
        core.add_worker(w, 0.0)
        dev_of[w.name] = (k, dev)
        st.costs.setdefault((MODEL, dev.path), dev.curve())  # as if calibrated
        st.costs[(MODEL, dev.path)].samples = 100
    true_curve = [dev.curve() for dev in devices]  # the device's real T(B); the policy learns its own
    free_at = [0.0] * len(devices)
    events: list = []  # (done time, tiebreak, batch id, service seconds)
    tie = 0
    wake = math.inf
    i = 0
    while i < n or events or wake < math.inf:
        now = min(arr[i] if i < n else math.inf, events[0][0] if events else math.inf, wake)
        if now == math.inf:
            break
        while events and events[0][0] <= now:  # completions first: they free workers
            t_done, _, batch_id, service = heapq.heappop(events)
            batch = core.complete(batch_id, service if learn else None, t_done)
            for r in batch.requests:
                if core.finish(r):
                    latency[r.req_id] = t_done - r.arrival
                    met[r.req_id] = t_done <= r.deadline
                    path_of[r.req_id] = 1 if batch.worker.path == "gpu" else 0
        while i < n and arr[i] <= now:
            # admit's 0 is the node's default timeout; a trace's 0 is a deadline at arrival
            got = core.admit(MODEL, 1, int(prio[i]), float(tout[i]) or 1e-9, float(arr[i]), req_id=i)
            if type(got) is Rejected:
                status[i] = 1 if got.status in (Status.DEADLINE_EXCEEDED, Status.OVERLOADED) else 2
            i += 1
        for batch in core.decide(now):
            k, dev = dev_of[batch.worker.name]
            service = true_curve[k].predict(batch.items)
            if dev.jitter:
                service *= max(0.05, 1.0 + dev.jitter * rng.standard_normal())
            free_at[k] = max(now, free_at[k]) + service
            tie += 1
            heapq.heappush(events, (free_at[k], tie, batch.batch_id, service))
            batch_sizes.append(batch.items)
            batch_paths.append(dev.path)
        # As the live dispatcher's timer: a wake-up at or before now would only repeat the
        # decision just made; arrivals and completions wake the loop by themselves.
        wake = core.next_wake()
        if wake <= now:
            wake = math.inf
    for r in core.requests.values():  # never dispatched: nobody would ever serve them
        if r.state == QUEUED:
            status[r.req_id] = 2
    return SimResult(policy.name, trace.name, latency, status, met, prio.copy(), path_of, batch_sizes,
                     batch_paths, dict(core.decisions), duration=trace.duration)


def clairvoyant_mean_latency(arrivals: np.ndarray, launch_s: float, per_item_s: float, max_batch: int = 64) -> float:
    """Exact offline optimum of the mean latency for ONE path with cost a + b*B, knowing every
    arrival in advance.

    Why it is a bound: with identical requests an exchange argument shows some optimal
    schedule serves them in arrival order in contiguous batches, each started as soon as both
    its last request has arrived and the path is free. The dynamic program below enumerates
    exactly those schedules: state = how many requests are served; for each state it keeps the
    Pareto set of (path free time, total latency so far), because a schedule that frees the
    path later can still win later. Nothing is pruned that could lead to the optimum, so the
    result is the optimum itself, and every online policy on this path is at or above it.
    (It is *not* a bound for a policy that also uses other paths.)
    """
    t = np.asarray(arrivals, dtype=np.float64)
    n = len(t)
    prefix = np.concatenate([[0.0], np.cumsum(t)])
    fronts: list[list[tuple[float, float]]] = [[] for _ in range(n + 1)]
    fronts[0] = [(-math.inf, 0.0)]
    for j in range(1, n + 1):
        cand = []
        last = t[j - 1]
        for i in range(max(0, j - max_batch), j):
            m = j - i
            svc = launch_s + per_item_s * m
            sum_t = prefix[j] - prefix[i]
            for free, cost in fronts[i]:
                f = (last if last > free else free) + svc
                cand.append((f, cost + m * f - sum_t))
        cand.sort()
        front, best = [], math.inf
        for f, c in cand:
            if c < best - 1e-15:
                front.append((f, c))
                best = c
        fronts[j] = front
        if j >= max_batch:
            fronts[j - max_batch] = None  # no later batch can start that far back
    return min(c for _, c in fronts[n]) / n
