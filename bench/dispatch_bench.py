"""Dispatcher micro-benchmarks (issue 2): run ``python -m batchyard.bench.dispatch_bench [a|b|c|d|all]``.

(a) added latency: SDK -> dispatcher -> worker vs SDK -> worker directly (no-op model, low load)
(b) max routed requests/s: dispatcher vs a bare Python uvloop forwarder, same clients, same run
(c) idle dispatcher CPU %
(d) shared-memory handoff (producer start -> consumer holds an ndarray view) vs inline ZeroMQ

The no-op model is the simulated worker with zero service time. Numbers are printed as
median / p99 over repeated runs; this machine is shared and noisy, so run it more than once.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import tempfile
import time

import numpy as np
import zmq

from batchyard import protocol as P
from batchyard.client import AsyncClient, Client
from batchyard.config import (DispatcherConfig, ModelConfig, NodeConfig, SimConfig, TensorConfig,
                               WorkerConfig)
from batchyard.client_pool import ShmPool
from batchyard.shm import SegmentCache
from batchyard.supervisor import running_node

NOOP = ModelConfig(name="noop", factory="batchyard.workers.models:mlp", max_batch=256,
                   inputs=(TensorConfig("x", "float32", (4,)),), outputs=(TensorConfig("y", "float32", (1,)),))
X = np.ones((1, 4), np.float32)


def _node(run_dir: str, n_workers: int = 1) -> NodeConfig:
    return NodeConfig(
        dispatcher=DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
        models=(NOOP,),
        workers=tuple(WorkerConfig(name=f"noop{i}", kind="sim", models=("noop",),
                                   sim=SimConfig(launch_us=0.0, per_item_us=0.0)) for i in range(n_workers)),
    ).validate()


class _NodeRun:
    """A no-op node (simulated worker, zero service time) for the duration of a with-block."""

    def __init__(self, n_workers: int = 1):
        self.node = _node(tempfile.mkdtemp(prefix="by-bench-", dir="/tmp"), n_workers)
        self._ctx = running_node(self.node, ready_timeout_s=60)

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


# ---------------------------------------------------------------- (a) added latency
def _direct_worker_latency(n: int) -> list[float]:
    """Play the dispatcher's part for one worker: the SDK's own encoding, one-request batches."""
    from batchyard.workers.harness import DirectWorker

    run_dir = tempfile.mkdtemp(prefix="by-bench-", dir="/tmp")
    with DirectWorker(_node(run_dir), "noop0") as dw:
        dw.wait_registered()
        sdk = Client(f"ipc://{run_dir}/unused")  # only for its encoder and decoder
        sdk.specs["noop"] = NOOP.spec()
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            rid, frames, _, _, _ = sdk._encode_infer("noop", {"x": X}, "normal", 10.0)
            done, out_frames = dw.run("noop", [frames])
            reply = P.encode(P.InferReply(v=1, id=rid, status=0, outputs=done.results[0].outputs))
            P.reply_decoder.decode(reply)  # what the SDK does with a reply
            np.frombuffer(out_frames[0], dtype=np.float32)
            lat.append(time.perf_counter() - t0)
        sdk.close()
        return lat


def bench_a(n: int = 3000, runs: int = 3) -> dict:
    rows = {"via dispatcher": [], "worker directly": []}
    for _ in range(runs):
        with _NodeRun() as r, Client(r.node.dispatcher.frontend) as c:
            c.infer("noop", {"x": X})
            lat = []
            for _ in range(n):
                t0 = time.perf_counter()
                c.infer("noop", {"x": X})
                lat.append(time.perf_counter() - t0)
            rows["via dispatcher"].append(lat)
        rows["worker directly"].append(_direct_worker_latency(n))
    out = {}
    print(f"(a) round-trip latency, no-op model, 1 request in flight, {runs} runs x {n}")
    for k, runs_ in rows.items():
        p50 = [pct(l, 50) * 1e6 for l in runs_]
        p99 = [pct(l, 99) * 1e6 for l in runs_]
        out[k] = {"p50_us": p50, "p99_us": p99}
        print(f"    {k:<18} p50 {np.median(p50):7.1f} us (runs {', '.join(f'{x:.0f}' for x in p50)})"
              f"   p99 {np.median(p99):7.1f} us (runs {', '.join(f'{x:.0f}' for x in p99)})")
    added = np.median(out["via dispatcher"]["p50_us"]) - np.median(out["worker directly"]["p50_us"])
    print(f"    added by the dispatcher at p50: {added:.1f} us")
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
                    done += 1

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


def _forwarder_main(front: str, back: str, n_workers: int, ready) -> None:
    """A bare Python uvloop forwarder: add_reader + NOBLOCK drains, round-robin to workers,
    no decoding at all. The ceiling a Python broker of this design can reach."""
    import uvloop

    ctx = zmq.Context()
    fe, be = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    for s in (fe, be):
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.setsockopt(zmq.RCVHWM, 100_000)
    fe.bind(front)
    be.bind(back)
    workers = []
    while len(workers) < n_workers:
        workers.append(be.recv_multipart()[0])
    ready.set()
    loop = uvloop.new_event_loop()
    rr = [0]

    def pump():
        while True:
            moved = False
            try:
                f = fe.recv_multipart(zmq.NOBLOCK, copy=False)
                rr[0] = (rr[0] + 1) % len(workers)
                be.send_multipart([workers[rr[0]], *f], copy=False)
                moved = True
            except zmq.Again:
                pass
            try:
                f = be.recv_multipart(zmq.NOBLOCK, copy=False)
                fe.send_multipart(f[1:], copy=False)
                moved = True
            except zmq.Again:
                pass
            if not moved:
                return

    loop.add_reader(fe.getsockopt(zmq.FD), pump)
    loop.add_reader(be.getsockopt(zmq.FD), pump)
    loop.run_forever()


def _echo_worker(back: str) -> None:
    """Forwarder's worker: answers each request like a no-op model would."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(back)
    s.send(b"hello")
    y = np.zeros((1, 1), np.float32).tobytes()
    out = [P.TensorRef(name="y", dtype="float32", shape=[1, 1], frame=0)]
    spec = NOOP.spec()
    while True:
        f = s.recv_multipart()
        ident, hdr = f[0], P.client_message_decoder.decode(f[1])
        if type(hdr) is P.ModelInfoRequest:
            s.send_multipart([ident, P.encode(P.ModelInfoReply(v=1, id=hdr.id, status=0, spec=spec))])
            continue
        s.send_multipart([ident, P.encode(P.InferReply(v=1, id=hdr.id, status=0, outputs=out)), y])


def bench_b(duration: float = 5.0, runs: int = 3, procs: int = 2, inflight: int = 128) -> dict:
    res = {"dispatcher": [], "bare forwarder": []}
    for _ in range(runs):
        with _NodeRun() as r:
            res["dispatcher"].append(_closed_loop(r.node.dispatcher.frontend, procs, inflight, duration))
        d = tempfile.mkdtemp(prefix="by-bench-", dir="/tmp")
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        fwd = ctx.Process(target=_forwarder_main, args=(f"ipc://{d}/fe", f"ipc://{d}/be", 1, ready), daemon=True)
        fwd.start()
        wk = ctx.Process(target=_echo_worker, args=(f"ipc://{d}/be",), daemon=True)
        wk.start()
        ready.wait(30)
        res["bare forwarder"].append(_closed_loop(f"ipc://{d}/fe", procs, inflight, duration))
        fwd.terminate(), wk.terminate()
        fwd.join(), wk.join()
    print(f"(b) closed loop, {procs} client processes x {inflight} in flight, {duration:.0f} s, {runs} runs")
    for k, v in res.items():
        print(f"    {k:<16} median {np.median(v):8.0f} req/s (runs {', '.join(f'{x:.0f}' for x in v)})")
    print(f"    ratio dispatcher / forwarder: {np.median(res['dispatcher']) / np.median(res['bare forwarder']):.2f}x")
    return res


# ---------------------------------------------------------------- (c) idle CPU
def bench_c(seconds: float = 10.0) -> float:
    import psutil

    with _NodeRun() as r, Client(r.node.dispatcher.frontend) as c:
        pid = c.status().dispatcher_pid
        p = psutil.Process(pid)
        c.infer("noop", {"x": X})
        t0, cpu0 = time.monotonic(), sum(p.cpu_times()[:2])
        time.sleep(seconds)  # measuring idle: nothing to wait for by design
        pct_ = (sum(p.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0) * 100
    print(f"(c) idle dispatcher (1 worker heartbeating every 0.2 s): {pct_:.2f} % of one core over {seconds:.0f} s")
    return pct_


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
        if ref.shm is not None:
            buf = cache.buffer(ref.shm.segment, ref.shm.offset, ref.shm.nbytes)
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
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="*", default=["all"], choices=["a", "b", "c", "d", "all"])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    which = set(args.which)
    if which & {"a", "all"}:
        bench_a(runs=args.runs)
    if which & {"b", "all"}:
        bench_b(runs=args.runs)
    if which & {"c", "all"}:
        bench_c()
    if which & {"d", "all"}:
        bench_d()


if __name__ == "__main__":
    import logging

    logging.basicConfig(level="WARNING")
    main()
