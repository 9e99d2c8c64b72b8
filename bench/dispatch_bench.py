"""Dispatcher micro-benchmarks (issues 2 and 9): ``python -m batchyard.bench.dispatch_bench [a|b|...|j|all]``.

(a) added latency, one request in flight, no-op worker: client -> dispatcher -> worker minus
    client -> worker directly; the same for pyzmq's C ``zmq.proxy`` and a bare Python uvloop
    forwarder in the middle (anchors), each minus the direct path to its own worker
(b) routed requests/s, closed loop, 2 client processes x 128 in flight: dispatcher, C proxy, forwarder
(c) idle dispatcher CPU %
(d) shared-memory handoff (producer start -> consumer holds an ndarray view) vs inline ZeroMQ
(e) decision lateness under open-loop load at 50 % and 90 % of (b)'s routed capacity
(f) CPU per request at a low Poisson rate (one request at a time, mostly): the dispatcher's
    process against the bare forwarder's, idle CPU subtracted. At this rate every message costs
    a wake-up, which is what a node shares its core with the model for
(g) one decision's time when 1,000 requests expire behind 1,000 / 10,000 / 100,000 patient ones
    of their class (the decision code alone, no sockets)
(h) the sender's CPU for one ZeroMQ send on ipc (two frames, as a request's) back to back, after
    a 10 ms idle gap slept, and after one spun, against a pipe write that wakes a thread after a
    gap: what each message of a hop costs at a low rate, where the processes sleep between them
(i) one MCB plan (``policy_mcb.plan``, the decision's inner loop: up to eight a model's pass)
    of 1 to 1,000 queued items over the seeds' devices, a GPU and two CPUs, all free (the
    decision code alone, no sockets)
(j) MCB's whole decision (``decide``, every pass and plan of it) over a simulated trace of the
    seeds' devices at 50 %, 80 % and 90 % of the GPU's capacity, 20,000 Poisson arrivals: mean,
    p50 and p99 of a decision (the simulator's own time left out)

The paths are built in bench/noop_paths.py. Each mode runs ``--runs`` times, alternating the
paths inside a run; medians are reported, and written to ``--json``. This machine is shared
and noisy: compare numbers from one invocation, and run it more than once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from batchyard import protocol as P
from batchyard.client import AsyncClient, Client
from batchyard.client_pool import ShmPool
from batchyard.shm import SegmentCache

from .noop_paths import X, Anchor, NodeRun, encode_request, noop_node, read_reply, round_trips

PROXY = "C zmq.proxy"
GOALS = {"added_p50": 1.5, "routed_rps": 0.5}  # issue 9: dispatcher / C proxy


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def _med(xs) -> float:
    return float(np.median(xs))


# ---------------------------------------------------------------- (a) added latency
def _direct_worker_latency(n: int, warmup: int = 200) -> list[float]:
    """Play the dispatcher's part for the simulated worker: the client's encoding, one-request
    batches, the reply the dispatcher would build, decoded as the client would."""
    from batchyard.workers.harness import DirectWorker

    with tempfile.TemporaryDirectory(prefix="by-bench-", dir="/tmp") as run_dir, \
            DirectWorker(noop_node(run_dir), "noop0") as dw:
        dw.wait_registered()
        lat = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            done, out_frames = dw.run("noop", [encode_request(i + 1)])
            reply = P.encode(P.InferReply(v=1, id=i + 1, status=0, outputs=done.results[0].outputs))
            read_reply([reply, *out_frames])
            if i >= warmup:
                lat.append(time.perf_counter() - t0)
        return lat


def _sdk_latency(address: str, n: int) -> list[float]:
    """The same path with the SDK's blocking Client (its I/O thread included): what a user sees."""
    with Client(address) as c:
        for _ in range(200):
            c.infer("noop", {"x": X})
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.infer("noop", {"x": X})
            lat.append(time.perf_counter() - t0)
        return lat


A_PATHS = {  # path -> the direct path it is compared with
    "via dispatcher": "sim worker directly",
    PROXY: "echo worker directly",
    "bare forwarder": "echo worker directly",
}


def bench_a(n: int = 3000, runs: int = 3) -> dict:
    lat: dict[str, list] = {k: [] for k in ("via dispatcher", "via dispatcher, SDK Client", "sim worker directly",
                                            PROXY, "bare forwarder", "echo worker directly")}
    for _ in range(runs):
        with NodeRun() as r:
            lat["via dispatcher"].append(round_trips(r.address, n))
            lat["via dispatcher, SDK Client"].append(_sdk_latency(r.address, n))
        lat["sim worker directly"].append(_direct_worker_latency(n))
        for kind in Anchor.KINDS:
            with Anchor(kind) as a:
                lat[kind].append(round_trips(a.address, n))
    out = {"n": n, "runs": runs, "paths": {}, "added": {}}
    print(f"(a) round-trip latency, no-op worker, 1 request in flight, raw DEALER with the SDK's encoding "
          f"(unless named), {runs} runs x {n}")
    for k, runs_ in lat.items():
        p50 = [pct(x, 50) * 1e6 for x in runs_]
        p99 = [pct(x, 99) * 1e6 for x in runs_]
        out["paths"][k] = {"p50_us": _med(p50), "p99_us": _med(p99), "runs_p50_us": p50, "runs_p99_us": p99}
        print(f"    {k:<27} p50 {_med(p50):7.1f} us (runs {', '.join(f'{x:.0f}' for x in p50)})"
              f"   p99 {_med(p99):7.1f} us (runs {', '.join(f'{x:.0f}' for x in p99)})")
    print("    added by the middle box (path minus the direct path to its own worker):")
    for path, direct in A_PATHS.items():
        p, d = out["paths"][path], out["paths"][direct]
        added = {"p50_us": p["p50_us"] - d["p50_us"], "p99_us": p["p99_us"] - d["p99_us"], "minus": direct}
        out["added"][path] = added
        print(f"    {path:<27} p50 {added['p50_us']:7.1f} us   p99 {added['p99_us']:7.1f} us   (minus {direct})")
    return out


# ---------------------------------------------------------------- (b) throughput
def _load_proc(address: str, inflight: int, duration: float, q) -> None:
    async def main():
        async with AsyncClient(address) as c:
            await c.model_info("noop")
            done = 0
            stop = time.monotonic() + duration

            async def lane():
                nonlocal done
                while time.monotonic() < stop:
                    await c.infer("noop", {"x": X})
                    done += time.monotonic() <= stop  # inside the window only (each lane's last ends after it)

            await asyncio.gather(*(lane() for _ in range(inflight)))
            return done

    import uvloop

    q.put(uvloop.run(main()))


def _closed_loop(address: str, procs: int, inflight: int, duration: float) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_load_proc, args=(address, inflight, duration, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    total = sum(q.get(timeout=duration + 60) for _ in ps)
    for p in ps:
        p.join()
    return total / duration


def bench_b(duration: float = 5.0, runs: int = 3, procs: int = 2, inflight: int = 128) -> dict:
    res = {"dispatcher": [], PROXY: [], "bare forwarder": []}
    for _ in range(runs):
        with NodeRun() as r:
            res["dispatcher"].append(_closed_loop(r.address, procs, inflight, duration))
        for kind in (PROXY, "bare forwarder"):
            with Anchor(kind) as a:
                res[kind].append(_closed_loop(a.address, procs, inflight, duration))
    print(f"(b) closed loop, {procs} client processes (AsyncClient) x {inflight} in flight, {duration:.0f} s, "
          f"{runs} runs")
    for k, v in res.items():
        print(f"    {k:<16} median {_med(v):8.0f} req/s (runs {', '.join(f'{x:.0f}' for x in v)})")
    for k in (PROXY, "bare forwarder"):
        print(f"    ratio dispatcher / {k}: {_med(res['dispatcher']) / _med(res[k]):.2f}x")
    return {"procs": procs, "inflight": inflight, "duration_s": duration, "runs": runs,
            "req_per_s": {k: _med(v) for k, v in res.items()}, "runs_req_per_s": res}


def dispatcher_capacity(runs: int, duration: float = 5.0) -> float:
    """(b)'s dispatcher number alone: the routed capacity the lateness bench loads a fraction of."""
    caps = []
    for _ in range(runs):
        with NodeRun() as r:
            caps.append(_closed_loop(r.address, 2, 128, duration))
    print(f"    dispatcher routed capacity: median {_med(caps):.0f} req/s (runs {', '.join(f'{x:.0f}' for x in caps)})")
    return _med(caps)


# ---------------------------------------------------------------- (c) idle CPU
def bench_c(seconds: float = 10.0) -> float:
    import psutil

    with NodeRun() as r, Client(r.address) as c:
        pid = c.status().dispatcher_pid
        p = psutil.Process(pid)
        c.infer("noop", {"x": X})
        t0, cpu0 = time.monotonic(), sum(p.cpu_times()[:2])
        time.sleep(seconds)  # measuring idle: nothing to wait for by design
        pct_ = (sum(p.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0) * 100
    print(f"(c) idle dispatcher (1 worker heartbeating every 0.2 s): {pct_:.2f} % of one core over {seconds:.0f} s")
    return pct_


# ---------------------------------------------------------------- (f) CPU per request at a low rate
def _open_loop(address: str, rate: float, seconds: float, seed: int = 1) -> int:
    """Poisson requests over a raw DEALER at ``rate``, replies read as they come; the count sent."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        for i in range(50):  # warm: the worker registered, the model's spec known, caches hot
            s.send_multipart(encode_request(i + 1))
            s.recv_multipart()
        rng = np.random.default_rng(seed)
        t = time.perf_counter()
        end, sent, got = t + seconds, 0, 0
        while t < end:
            t += rng.exponential(1 / rate)
            while (left := t - time.perf_counter()) > 0:  # read replies until the next send is due
                if s.poll(left * 1000, zmq.POLLIN):
                    s.recv_multipart()
                    got += 1
            s.send_multipart(encode_request(1000 + sent))
            sent += 1
        while got < sent:
            s.recv_multipart()
            got += 1
        return sent
    finally:
        s.close()
        ctx.term()


def _cpu_per_request(address: str, pid: int, rate: float, seconds: float, idle_s: float = 3.0) -> float:
    """Microseconds of the process's CPU (all threads, user + system) per request, less its idle CPU."""
    import psutil

    p = psutil.Process(pid)
    t0, c0 = time.monotonic(), sum(p.cpu_times()[:2])
    time.sleep(idle_s)  # measuring idle CPU: nothing to wait for by design
    t1, c1 = time.monotonic(), sum(p.cpu_times()[:2])
    n = _open_loop(address, rate, seconds)
    t2, c2 = time.monotonic(), sum(p.cpu_times()[:2])
    return ((c2 - c1) - (c1 - c0) / (t1 - t0) * (t2 - t1)) / n * 1e6


def bench_f(rate: float = 100.0, seconds: float = 15.0, runs: int = 3) -> dict:
    res: dict = {"dispatcher": [], "bare forwarder": []}
    for _ in range(runs):
        with NodeRun() as r, Client(r.address) as c:
            pid = c.status().dispatcher_pid
            res["dispatcher"].append(_cpu_per_request(r.address, pid, rate, seconds))
        with Anchor("bare forwarder") as a:
            res["bare forwarder"].append(_cpu_per_request(a.address, a.box_pid, rate, seconds))
    print(f"(f) CPU per request at {rate:g} req/s Poisson, no-op worker, {runs} runs (us, idle subtracted)")
    for k, v in res.items():
        print(f"    {k:16s} median {_med(v):7.0f}  (runs {', '.join(f'{x:.0f}' for x in v)})")
    return {"rate": rate, "seconds": seconds, "runs_us": res, "median_us": {k: _med(v) for k, v in res.items()}}


# ---------------------------------------------------------------- (d) shm handoff
def _consumer(addr: str) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PAIR)
    s.connect(addr)
    cache = SegmentCache()
    while True:
        f = s.recv_multipart(copy=False)
        ref = P.msgspec.msgpack.decode(f[0].bytes, type=P.TensorRef) if len(f[0]) else None
        if ref is None:
            break
        if ref.shm is not None:  # as a worker reads it: a view where it maps the segment, else a copy
            buf = cache.view(ref.shm.segment, ref.shm.offset, ref.shm.nbytes)
            if buf is None:
                buf = np.empty(ref.shm.nbytes, np.uint8)
                cache.read_into(ref.shm.segment, ref.shm.offset, memoryview(buf))
        else:
            buf = f[1].buffer
        arr = np.frombuffer(buf, dtype=ref.dtype).reshape(ref.shape)
        t = time.monotonic()
        s.send(np.float64(t).tobytes() + bytes([int(arr.reshape(-1)[:1].view(np.uint8)[0] if arr.size else 0)]))
    cache.close()


def bench_d(reps: int = 200) -> dict:
    d = tempfile.mkdtemp(prefix="by-bench-", dir="/tmp")
    addr = f"ipc://{d}/pair"
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PAIR)
    s.bind(addr)
    proc = mp.get_context("spawn").Process(target=_consumer, args=(addr,))
    proc.start()
    pool = ShmPool(segment_bytes=64 << 20)
    sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
    out = {}
    print(f"(d) handoff, producer start -> consumer holds an ndarray view, median / p99 us, {reps} reps")
    print(f"    {'size':>8} {'pool, in place':>18} {'pool, copy in':>18} {'inline zmq':>18}")
    for size in sizes:
        src = np.random.default_rng(0).integers(0, 255, size=size, dtype=np.uint8)
        inplace = pool.alloc(size)
        np.frombuffer(pool.view(inplace), np.uint8)[:] = src
        row = {}
        for mode in ("inplace", "copy", "inline"):
            lat = []
            for _ in range(reps):
                t0 = time.monotonic()
                if mode == "inplace":
                    ref = P.TensorRef("x", "uint8", [size], shm=P.ShmRef(inplace.segment, inplace.offset, size))
                    s.send_multipart([P.encode(ref)])
                elif mode == "copy":
                    reg = pool.alloc(size)
                    np.frombuffer(pool.view(reg), np.uint8)[:] = src
                    s.send_multipart([P.encode(P.TensorRef("x", "uint8", [size], shm=P.ShmRef(reg.segment, reg.offset, size)))])
                else:
                    s.send_multipart([P.encode(P.TensorRef("x", "uint8", [size], frame=0)), src], copy=size < (64 << 10))
                t1 = np.frombuffer(s.recv()[:8], np.float64)[0]
                if mode == "copy":
                    pool.free(reg)
                lat.append((t1 - t0) * 1e6)
            row[mode] = (pct(lat, 50), pct(lat, 99))
        out[size] = row
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"    {label:>8} " + " ".join(f"{row[m][0]:>9.0f} / {row[m][1]:<6.0f}" for m in ("inplace", "copy", "inline")))
    s.send_multipart([b""])
    proc.join(10)
    pool.close()
    s.close()
    shutil.rmtree(d, ignore_errors=True)
    return out


# ---------------------------------------------------------------- summary and record
def summary(a: dict | None, b: dict | None) -> dict:
    """Issue 9's anchor table: the dispatcher against the C proxy, as ratios."""
    rows = {}
    if a:
        for q in ("p50", "p99"):
            d, c = a["added"]["via dispatcher"][f"{q}_us"], a["added"][PROXY][f"{q}_us"]
            rows[f"added_{q}"] = {"dispatcher": d, "c_proxy": c, "ratio": d / c if c > 0 else float("nan"),
                                  "unit": "us", "goal": GOALS.get(f"added_{q}"), "better": "lower"}
    if b:
        d, c = b["req_per_s"]["dispatcher"], b["req_per_s"][PROXY]
        rows["routed_rps"] = {"dispatcher": d, "c_proxy": c, "ratio": d / c, "unit": "req/s",
                              "goal": GOALS["routed_rps"], "better": "higher"}
    if rows:
        print("issue 9: dispatcher vs C zmq.proxy (medians)")
        print(f"    {'':<18} {'dispatcher':>11} {'C proxy':>9} {'ratio':>6}  goal")
        for k, r in rows.items():
            goal = ""
            if r["goal"] is not None:
                lower = r["better"] == "lower"
                met = (r["ratio"] <= r["goal"]) if lower else (r["ratio"] >= r["goal"])
                goal = f"{'<=' if lower else '>='} {r['goal']} {'met' if met else 'missed'}"
            label = f"{k} ({r['unit']})"
            print(f"    {label:<18} {r['dispatcher']:>11.1f} {r['c_proxy']:>9.1f} {r['ratio']:>6.2f}  {goal}")
    return rows


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    amx = any("amx" in line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    # "-dirty" where the working tree differs from HEAD: the numbers are then not HEAD's
    rev = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                         text=True).stdout.strip()
    return {"cpu": cpu, "amx": amx, "cores": os.cpu_count(), "loadavg_at_start": os.getloadavg(), "git_head": rev,
            "python": sys.version.split()[0], "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version()}


def bench_g(runs: int = 3) -> dict:
    from batchyard.core import RequestCore
    from batchyard.policy import make_policy
    from batchyard.state import WorkerState

    out = {}
    for n in (1_000, 10_000, 100_000):
        times = []
        for _ in range(runs):
            core = RequestCore(make_policy("greedy"), lambda r, s, m: None, max_queue=10**9)
            core.add_worker(WorkerState("g0", "gpu", {"m": 8}), 0.0)
            w = core.state.workers["g0"]
            w.inflight, w.busy_until = 1, 0.0  # busy: nothing is dispatched
            for i in range(n):
                core.admit("m", 1, 1, 1000.0, 0.0, req_id=i)
            for i in range(1000):
                core.admit("m", 1, 1, 0.5, 0.0, req_id=n + i)
            t0 = time.perf_counter()
            core.decide(1.0)  # their deadlines have passed
            times.append((time.perf_counter() - t0) * 1e3)
        out[str(n)] = {"decide_ms_median": float(np.median(times)), "runs_ms": times}
        print(f"(g) {n:>7} patient + 1,000 expiring: one decision {np.median(times):.1f} ms (median of {runs})")
    return out


def bench_i(runs: int = 3, reps: int = 300) -> dict:
    from batchyard.policy_mcb import plan
    from batchyard.state import SchedulerState, WorkerState

    from .simulator import seeds_devices

    state, ws = SchedulerState(), []
    for dev in seeds_devices(2):
        ws.append(WorkerState(dev.name, dev.path, {"m": dev.max_batch}))
        state.add_worker(ws[-1])
        state.costs.setdefault(("m", dev.path), dev.curve())
    out = {}
    for n in (1, 4, 16, 64, 192, 1000):
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            for _ in range(reps):
                plan(state, "m", ws, n, 1.0)
            times.append((time.perf_counter() - t0) / reps * 1e6)
        out[str(n)] = {"plan_us_median": float(np.median(times)), "runs_us": times}
        print(f"(i) a plan of {n:>5} queued items: {np.median(times):.1f} us (median of {runs} runs of {reps})")
    return out


def bench_j(runs: int = 3, n: int = 20_000) -> dict:
    from batchyard.policy_mcb import MarginalCost

    from .sim_report import scenario_trace, SCENARIOS
    from .simulator import simulate

    out = {}
    for load in (0.5, 0.8, 0.9):
        trace, rows = scenario_trace("seeds", load, n), []
        for _ in range(runs):
            policy, times = MarginalCost(), []
            decide = policy.decide

            def timed(state, now, decide=decide, times=times):
                t0 = time.perf_counter()
                d = decide(state, now)
                times.append(time.perf_counter() - t0)
                return d

            policy.decide = timed
            simulate(policy, trace, SCENARIOS["seeds"][0])
            us = np.asarray(times) * 1e6
            rows.append({"mean": float(us.mean()), "p50": float(np.percentile(us, 50)),
                         "p99": float(np.percentile(us, 99)), "decisions": len(us)})
        med = {k: float(np.median([r[k] for r in rows])) for k in ("mean", "p50", "p99")}
        out[f"{load:.0%}"] = {**{f"{k}_us_median": v for k, v in med.items()}, "runs": rows}
        print(f"(j) MCB's decision at {load:.0%} of the seeds' load: mean {med['mean']:.1f} us, p50 {med['p50']:.1f}, "
              f"p99 {med['p99']:.0f} (medians of {runs} runs, {rows[0]['decisions']} decisions each)")
    return out


def bench_h(runs: int = 3, n: int = 200, gap_s: float = 0.01) -> dict:
    import threading

    def sends(wait) -> list[int]:
        with tempfile.TemporaryDirectory(prefix="by-db-", dir="/tmp") as d, zmq.Context() as ctx:
            router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
            router.bind(f"ipc://{d}/h")
            dealer.connect(f"ipc://{d}/h")

            def drain():
                while router.recv_multipart()[-1] != b"stop":
                    pass
            t = threading.Thread(target=drain)
            t.start()
            cpu = []
            for _ in range(n):
                wait()
                c0 = time.thread_time_ns()
                dealer.send_multipart([b"h" * 200, b"p" * 64])
                cpu.append(time.thread_time_ns() - c0)
            dealer.send_multipart([b"stop"])
            t.join()
            router.close(0)
            dealer.close(0)
            return cpu

    def spin():
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass

    def pipe_wakes() -> list[int]:
        r, w = os.pipe()

        def drain():
            while os.read(r, 1) != b"s":
                pass
        t = threading.Thread(target=drain)
        t.start()
        cpu = []
        for _ in range(n):
            time.sleep(gap_s)
            c0 = time.thread_time_ns()
            os.write(w, b"x")
            cpu.append(time.thread_time_ns() - c0)
        os.write(w, b"s")
        t.join()
        os.close(r)
        os.close(w)
        return cpu

    cases = {"zmq send, back to back": lambda: sends(lambda: None),
             f"zmq send, {gap_s * 1e3:.0f} ms slept before": lambda: sends(lambda: time.sleep(gap_s)),
             f"zmq send, {gap_s * 1e3:.0f} ms spun before": lambda: sends(spin),
             f"pipe write waking a thread, {gap_s * 1e3:.0f} ms slept before": pipe_wakes}
    out = {name: [] for name in cases}
    for _ in range(runs):
        for name, case in cases.items():
            out[name].append(float(np.median(case())) / 1e3)
    for name, meds in out.items():
        print(f"(h) {name:48s} sender CPU median {np.median(meds):6.1f} us (runs: "
              + ", ".join(f"{m:.1f}" for m in meds) + ")")
    return {name: {"cpu_us_median": float(np.median(meds)), "runs_us": meds} for name, meds in out.items()}


def record(path: str, results: dict) -> None:
    """Merge this invocation's modes into the JSON file, so separate invocations accumulate."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(p.read_text()) if p.exists() else {}
    old.update(results)
    p.write_text(json.dumps(old, indent=1, default=float) + "\n")
    print(f"wrote {p}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="*", default=["all"], choices=["a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "all"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--capacity", type=float, default=0.0, help="(e): routed capacity in req/s (0: measure it)")
    ap.add_argument("--json", default="bench/results/dispatch_bench.json", help="merge results here ('' : don't)")
    args = ap.parse_args(argv)
    which = {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"} if "all" in args.which else set(args.which)
    meta = {"command": "python -m batchyard.bench.dispatch_bench " + " ".join(sys.argv[1:] if argv is None else argv),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **machine()}
    load = ", ".join(f"{x:.1f}" for x in meta["loadavg_at_start"])
    print(f"{meta['cpu']}, {meta['cores']} cores, load average {load} (other processes share these cores)")
    out: dict = {}
    if "a" in which:
        out["a_latency"] = bench_a(runs=args.runs)
    if "b" in which:
        out["b_routed"] = bench_b(runs=args.runs)
    if "a" in which or "b" in which:
        out["vs_c_proxy"] = summary(out.get("a_latency"), out.get("b_routed"))
    if "c" in which:
        out["c_idle_cpu_pct"] = bench_c()
    if "d" in which:
        out["d_handoff"] = {str(k): v for k, v in bench_d().items()}
    if "e" in which:
        from .dispatch_lateness import bench_lateness

        cap = args.capacity or (out["b_routed"]["req_per_s"]["dispatcher"] if "b_routed" in out
                                else dispatcher_capacity(args.runs))
        out["e_lateness"] = bench_lateness(cap, runs=args.runs)
    if "f" in which:
        out["f_cpu_per_request"] = bench_f(runs=args.runs)
    if "g" in which:
        out["g_expiry_decision_ms"] = bench_g(runs=args.runs)
    if "h" in which:
        out["h_send_after_idle_us"] = bench_h(runs=args.runs)
    if "i" in which:
        out["i_plan_us"] = bench_i(runs=args.runs)
    if "j" in which:
        out["j_decision_us"] = bench_j(runs=args.runs)
    if args.json:
        record(args.json, {k: {"meta": meta, "result": v} for k, v in out.items()})


if __name__ == "__main__":
    import logging

    logging.basicConfig(level="WARNING")
    main()
