"""What the KServe front door costs (issue 12), on a no-op model (a sim worker with a tiny cost):

  latency     one request at a time (low load): p50/p99 of the SDK against the same requests
              through the front door with tritonclient gRPC and HTTP, inline and with input and
              output in system shared memory (grpc-shm, http-shm); the difference is what the
              front door adds.
  restricted  the same, one request at a time, through two like nodes, one whose inference is
              a restricted API asked with its header, one without: what the check costs.
  generate    the same, one request at a time over one HTTP connection: Triton's generate and
              generate_stream (plain JSON members) against infer with the same tensor in JSON.
  throughput  max completed requests/s through gRPC with 1, 2 and 4 front-door processes on
              one port (SO_REUSEPORT), driven by closed-loop tritonclient.grpc.aio load
              processes holding many requests in flight on several connections each.
  cpu         CPU time per request of each node process (front door, dispatcher, worker), user
              and system apart, at an offered Poisson rate: (CPU/s under load - CPU/s idle) /
              completions/s. On one shared core this is what the node takes from the model.
              With --threads, each process's threads apart too (its main thread, ZeroMQ's I/O
              thread, gRPC's event-engine threads), summed by thread name. With --floor, also
              a bare server of the same protocol (grpc.aio or aiohttp on uvloop, a fixed reply,
              no Batchyard) under the same load: what the protocol library alone costs. With
              --trace-rate N, the front door traces one request in N (level TIMESTAMPS, to a
              file of the run's own, or kept at --trace-file for Triton's trace_summary.py):
              what Triton's trace extension costs, and where a request's time goes.
  status      the dispatcher's CPU per status request, full and brief (what a readiness probe
              asks), against a model-info request, after --fill requests have filled the
              decision-lateness rings the full status summarises.
  stall       what one large JSON request costs everyone else of its front-door process: small
              gRPC requests, one at a time, while HTTP infer requests of --mib MiB of JSON
              tensor data (float32, 4 MiB an item) are served; the longest small request during
              each is how long the process's loop was held. With --classes, the large request
              is a gRPC one whose --items items of a million FP32 outputs each are ranked
              (Triton's classification, the top --classes).
  tensors     large tensors (--mib MiB in and out a request, -b 4 of a [256, 1024] float32 item per
              MiB), one at a time from perf_analyzer (the C++ load tool, so no Python client's
              cost): its average latency and the front door's CPU a request, over gRPC and HTTP,
              in the request body and in system shared memory.

    .venv/bin/python -m batchyard.bench.kserve_bench latency --n 2000
    .venv/bin/python -m batchyard.bench.kserve_bench throughput --processes 1 2 4 --seconds 5
    .venv/bin/python -m batchyard.bench.kserve_bench cpu --rate 40 --seconds 15 --protocol grpc [--threads] [--floor] [--trace-rate 1 [--trace-file /tmp/trace.json]]
    .venv/bin/python -m batchyard.bench.kserve_bench status --fill 70000 --n 1000
    .venv/bin/python -m batchyard.bench.kserve_bench stall --mib 62 --n 3
    .venv/bin/python -m batchyard.bench.kserve_bench stall --classes 2147483647 --items 4 --n 3
    .venv/bin/python -m batchyard.bench.kserve_bench tensors --mib 4 --n 100
"""

from __future__ import annotations

import argparse
import contextlib
import asyncio
import multiprocessing as mp
import json
import os
import tempfile
import time

import numpy as np

from batchyard.addresses import free_port as _free_port
from batchyard.config import (DispatcherConfig, FrontendConfig, ModelConfig, NodeConfig, RestrictedApisConfig, SimConfig,
                              TensorConfig, WorkerConfig)
from batchyard.supervisor import running_node

NOOP = ModelConfig(name="noop", max_batch=64, inputs=(TensorConfig("x", "float32", (16,)),),
                   outputs=(TensorConfig("y", "float32", (16,)),))
X = np.ones((1, 16), np.float32)
BIG = ModelConfig(name="big", max_batch=16, inputs=(TensorConfig("x", "float32", (1024, 1024)),),
                  outputs=(TensorConfig("y", "float32", (2,)),))
WIDE = ModelConfig(name="wide", max_batch=8, inputs=(TensorConfig("x", "float32", (1,)),),
                   outputs=(TensorConfig("y", "float32", (1_000_000,)),))


def noop_node(run_dir: str, processes: int, models: tuple = (NOOP,), restricted_apis: tuple = ()) -> NodeConfig:
    return NodeConfig(
        dispatcher=DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
        models=models,
        workers=(WorkerConfig(name="sim0", kind="sim", models=tuple(m.name for m in models), max_inflight=4,
                              sim=SimConfig(launch_us=20.0, per_item_us=1.0)),),
        frontend=FrontendConfig(grpc_port=_free_port(), http_port=_free_port(), processes=processes,
                                restricted_apis=restricted_apis)).validate()


# --restricted: a second node whose inference is restricted, asked with the header (the check runs
# and passes on every request).
BENCH_RESTRICTION = RestrictedApisConfig(apis=("inference",), header="bench-key", value="bench")


def _pcts(samples_s: list[float]) -> tuple[float, float]:
    a = np.asarray(samples_s) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def latency(n: int) -> None:
    import tritonclient.grpc as tg
    try:
        import tritonclient.http as th
    except RuntimeError as e:  # tritonclient[grpc] alone (it raises, not ImportError): gRPC is still worth measuring
        print(f"HTTP not measured: {e}")
        th = None

    from multiprocessing import shared_memory

    from batchyard.client import Client

    y_bytes = X.nbytes  # the no-op model's y is x's shape and type
    with tempfile.TemporaryDirectory(prefix="by-kb-", dir="/tmp") as d, contextlib.ExitStack() as stack:
        node = noop_node(d, 1)
        stack.enter_context(running_node(node))
        g_url, h_url = f"127.0.0.1:{node.frontend.grpc_port}", f"127.0.0.1:{node.frontend.http_port}"
        g = tg.InferenceServerClient(g_url)
        gi = tg.InferInput("x", [1, 16], "FP32")
        gi.set_data_from_numpy(X)
        # The client's own segment, input then output, registered as a Triton user does.
        seg = shared_memory.SharedMemory(f"by_kb_{os.getpid()}", create=True, size=X.nbytes + y_bytes)
        stack.callback(seg.unlink)
        stack.callback(seg.close)
        seg.buf[:X.nbytes] = X.tobytes()
        g.register_system_shared_memory("kb_in", f"/{seg.name}", X.nbytes)
        g.register_system_shared_memory("kb_out", f"/{seg.name}", y_bytes, X.nbytes)
        stack.callback(g.unregister_system_shared_memory)
        gsi = tg.InferInput("x", [1, 16], "FP32")
        gsi.set_shared_memory("kb_in", X.nbytes)
        gso = tg.InferRequestedOutput("y")
        gso.set_shared_memory("kb_out", y_bytes)
        with Client(node.dispatcher.frontend) as c:
            paths = {"sdk": lambda: c.infer("noop", {"x": X}),
                     "grpc": lambda: g.infer("noop", [gi]),
                     "grpc-shm": lambda: g.infer("noop", [gsi], outputs=[gso])}
            if th is not None:
                h = th.InferenceServerClient(h_url)
                hi = th.InferInput("x", [1, 16], "FP32")
                hi.set_data_from_numpy(X)
                hsi = th.InferInput("x", [1, 16], "FP32")
                hsi.set_shared_memory("kb_in", X.nbytes)
                hso = th.InferRequestedOutput("y")
                hso.set_shared_memory("kb_out", y_bytes)
                paths["http"] = lambda: h.infer("noop", [hi])
                paths["http-shm"] = lambda: h.infer("noop", [hsi], outputs=[hso])
            times: dict[str, list[float]] = {k: [] for k in paths}
            for _ in range(50):  # warm-up: connections, spec caches, learned cost curves
                for f in paths.values():
                    f()
            for _ in range(n):  # interleaved, so a noisy moment hits every path alike
                for k, f in paths.items():
                    t = time.perf_counter()
                    f()
                    times[k].append(time.perf_counter() - t)
    sdk50, sdk99 = _pcts(times["sdk"])
    print(f"latency, one request at a time, n={n} per path (us):")
    for k in paths:
        p50, p99 = _pcts(times[k])
        print(f"  {k:8s} p50 {p50:8.0f}  p99 {p99:8.0f}   added over sdk: p50 {p50 - sdk50:+7.0f}  p99 {p99 - sdk99:+7.0f}")


def _load_proc(url: str, seconds: float, inflight: int, channels: int, ready, go, q) -> None:
    import tritonclient.grpc.aio as ta

    async def run() -> int:
        clients = [ta.InferenceServerClient(url) for _ in range(channels)]
        inp = ta.InferInput("x", [1, 16], "FP32")
        inp.set_data_from_numpy(X)
        for c in clients:
            await c.infer("noop", [inp])
        done = 0
        ready.put(1)
        go.wait()
        end = time.perf_counter() + seconds

        async def lane(c):
            nonlocal done
            while time.perf_counter() < end:
                await c.infer("noop", [inp])
                # Completions inside the window only: each lane's last request ends after it,
                # and counting those added loaders x inflight completions (76.8/s in 5 s windows).
                done += time.perf_counter() <= end

        await asyncio.gather(*[lane(clients[i % channels]) for i in range(inflight)])
        for c in clients:
            await c.close()
        return done

    q.put(asyncio.run(run()))


def throughput(processes: list[int], seconds: float, loaders: int, inflight: int) -> None:
    ctx = mp.get_context("spawn")
    print(f"max req/s through gRPC, no-op model, {loaders} load processes x {inflight} in flight, {seconds:.0f} s:")
    for k in processes:
        with tempfile.TemporaryDirectory(prefix="by-kb-", dir="/tmp") as d:
            node = noop_node(d, k)
            with running_node(node):
                url = f"127.0.0.1:{node.frontend.grpc_port}"
                ready, go, q = ctx.Queue(), ctx.Event(), ctx.Queue()
                procs = [ctx.Process(target=_load_proc, args=(url, seconds, inflight, 4, ready, go, q))
                         for _ in range(loaders)]
                for p in procs:
                    p.start()
                for _ in procs:  # each has imported tritonclient, connected and sent one request
                    ready.get(timeout=120)
                go.set()
                total = sum(q.get(timeout=seconds + 120) for _ in procs)
                for p in procs:
                    p.join()
        print(f"  {k} front-door process(es): {total / seconds:8.0f} req/s")


def _node_processes(sup) -> dict:
    """The node's processes by the supervisor's names (dispatcher, each worker, frontend#i)."""
    import psutil

    return {name: psutil.Process(p.pid) for name, p in {"dispatcher": sup.dispatcher, **sup.workers}.items()}


def _thread_name(pid: int, tid: int) -> str:
    if tid == pid:
        return "main"  # its name is the process title, cut to 15 characters
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"  # it ended meanwhile


def _switches(pid: int, tid: int) -> int:
    """A thread's voluntary context switches so far: each a time it slept and was woken."""
    try:
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    except (OSError, StopIteration):
        return 0  # it ended meanwhile


def _node_cpu(procs: dict, threads: bool = False) -> dict:
    """(user, system) CPU seconds and voluntary context switches of each node process (summed
    over its threads: /proc's count for the process is its main thread's); with ``threads``
    also of each of its threads, summed by thread name ("dispatcher/main",
    "frontend#0/event_engine", ...)."""
    out = {}
    for name, p in procs.items():
        ts = p.threads()
        out[name] = (*p.cpu_times()[:2], sum(_switches(p.pid, t.id) for t in ts))
        for t in ts if threads else ():
            key = f"{name}/{_thread_name(p.pid, t.id)}"
            u, s, w = out.get(key, (0.0, 0.0, 0))
            out[key] = (u + t.user_time, s + t.system_time, w + _switches(p.pid, t.id))
    return out


async def _poisson_load(url: str, protocol: str, rate: float, seconds: float) -> int:
    if protocol == "grpc":
        import tritonclient.grpc as tc
        import tritonclient.grpc.aio as ta
    else:
        import tritonclient.http as tc
        import tritonclient.http.aio as ta
    client = ta.InferenceServerClient(url)
    inp = tc.InferInput("x", [1, 16], "FP32")
    inp.set_data_from_numpy(X)
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    end, calls = t + seconds, []
    while t < end:
        t += rng.exponential(1 / rate)
        await asyncio.sleep(max(0.0, t - time.perf_counter()))  # the schedule's next send, not a sync
        calls.append(asyncio.ensure_future(client.infer("noop", [inp])))
    await asyncio.gather(*calls)
    await client.close()
    return len(calls)


def _cpu_per_request(procs: dict, url: str, protocol: str, rate: float, seconds: float,
                     threads: bool = False) -> tuple[int, float, dict]:
    """An idle window, then ``seconds`` of Poisson load on ``url``: (requests, their rate,
    {name: (user, system) ms of CPU a request, voluntary context switches a request}), each
    process's idle rates subtracted. A thread that never ran in either window (gRPC's timer,
    ZeroMQ's reaper) is left out."""
    t0, idle0 = time.perf_counter(), _node_cpu(procs, threads)
    time.sleep(seconds)  # the idle window: timers and heartbeats cost this much without requests
    t1, idle1 = time.perf_counter(), _node_cpu(procs, threads)
    n = asyncio.run(_poisson_load(url, protocol, rate, seconds))
    t2, busy = time.perf_counter(), _node_cpu(procs, threads)
    per_s = n / (t2 - t1)
    zero = (0.0, 0.0, 0)  # a thread that started after a snapshot
    out = {}
    for name in busy:
        b, i1, i0 = busy[name], idle1.get(name, zero), idle0.get(name, zero)
        if "/" in name and b == i0:
            continue
        out[name] = tuple(scale * ((b[k] - i1[k]) / (t2 - t1) - (i1[k] - i0[k]) / (t1 - t0)) / per_s
                          for k, scale in ((0, 1e3), (1, 1e3), (2, 1)))
    return n, per_s, out


def cpu(rate: float, seconds: float, protocol: str, threads: bool = False, trace_rate: int = 0,
        trace_file: str = "") -> None:
    import msgspec

    with tempfile.TemporaryDirectory(prefix="by-kb-", dir="/tmp") as d:
        node = noop_node(d, 1)
        if trace_rate:
            node = msgspec.structs.replace(node, frontend=msgspec.structs.replace(
                node.frontend, trace_file=os.path.abspath(trace_file) if trace_file else f"{d}/trace.json",
                trace_level="TIMESTAMPS", trace_rate=trace_rate))
        with running_node(node) as sup:
            port = node.frontend.grpc_port if protocol == "grpc" else node.frontend.http_port
            n, per_s, per = _cpu_per_request(_node_processes(sup), f"127.0.0.1:{port}", protocol, rate, seconds,
                                             threads)
    traced = f", one in {trace_rate} traced" if trace_rate else ""
    print(f"CPU per request, no-op model, {protocol}{traced}, {n} requests at {per_s:.1f}/s offered {rate:.0f}/s "
          "(user + system ms; times the thread slept and was woken):")
    for name, (user, system, woken) in per.items():
        print(f"  {name:32s} {user:6.3f} + {system:6.3f} = {user + system:6.3f} ms, woken {woken:5.1f}")


def _bare_server(protocol: str, port: int, ready) -> None:
    """A server of ``protocol`` that answers every infer with one fixed reply of NOOP's shape."""
    import uvloop

    y = np.ones((1, 16), np.float32)
    if protocol == "grpc":
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        reply = service_pb2.ModelInferResponse(model_name="noop", model_version="1")
        reply.outputs.add(name="y", datatype="FP32", shape=[1, 16])
        reply.raw_output_contents.append(y.tobytes())

        class Bare(service_pb2_grpc.GRPCInferenceServiceServicer):
            async def ModelInfer(self, request, context):
                return reply

        async def serve():
            server = grpc.aio.server()
            service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Bare(), server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            ready.set()
            await server.wait_for_termination()
    else:
        import json

        from aiohttp import web

        body = json.dumps({"model_name": "noop", "model_version": "1", "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [1, 16], "data": y.ravel().tolist()}]}).encode()

        async def infer(request):
            await request.read()
            return web.Response(body=body, content_type="application/json")

        async def serve():
            app = web.Application()
            app.router.add_post("/v2/models/{model}/infer", infer)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            ready.set()
            await asyncio.Event().wait()
    uvloop.install()
    asyncio.run(serve())


def floor(rate: float, seconds: float, protocol: str) -> None:
    """CPU per request of ``_bare_server`` under the load ``cpu`` offers, idle subtracted."""
    import psutil

    port, ready = _free_port(), mp.Event()
    proc = mp.Process(target=_bare_server, args=(protocol, port, ready), daemon=True)
    proc.start()
    try:
        if not ready.wait(60):
            raise SystemExit("the bare server did not start")
        name = f"bare {protocol} server (floor)"
        _, _, per = _cpu_per_request({name: psutil.Process(proc.pid)}, f"127.0.0.1:{port}", protocol, rate, seconds)
    finally:
        proc.kill()
        proc.join()
    user, system, woken = per[name]
    print(f"  {name:32s} {user:6.3f} + {system:6.3f} = {user + system:6.3f} ms, woken {woken:5.1f}")


def status_cost(fill: int, n: int) -> None:
    from batchyard.client import Client

    with tempfile.TemporaryDirectory(prefix="by-kb-", dir="/tmp") as d:
        node = noop_node(d, 1)
        with running_node(node) as sup:
            dispatcher = _node_processes(sup)["dispatcher"]
            with Client(node.dispatcher.frontend) as c:
                for _ in range(fill):  # each step that reads a message adds a lateness sample
                    c.model_info("noop")
                print(f"dispatcher CPU per request after {fill:,} requests, {n:,} each, one at a time:")
                for name, call in (("model_info", lambda: c.model_info("noop")),
                                   ("status brief", lambda: c.status(brief=True)), ("status", c.status)):
                    cpu0, t0 = sum(dispatcher.cpu_times()[:2]), time.perf_counter()
                    for _ in range(n):
                        call()
                    cpu1, t1 = sum(dispatcher.cpu_times()[:2]), time.perf_counter()
                    print(f"  {name:13s} {1e6 * (cpu1 - cpu0) / n:7.0f} us CPU, {1e6 * (t1 - t0) / n:7.0f} us round trip")


def stall(mib: float, n: int, classes: int = 0, items: int = 4) -> None:
    """``classes``: the big request is instead a gRPC one of ``items`` items to a model of a
    million FP32 outputs an item, that output asked as its top ``classes`` (Triton's
    classification)."""
    import json
    import threading
    import urllib.request

    import tritonclient.grpc as tg

    if classes:
        big_request = _classified_request(items, classes)
    else:
        rng = np.random.default_rng(0)
        per_item = len(json.dumps(rng.standard_normal(1024 * 1024).astype(np.float32).tolist()))
        items = max(1, int(mib * 2**20 // per_item))
        data = rng.standard_normal((items, 1024, 1024)).astype(np.float32)
        body = json.dumps({"inputs": [{"name": "x", "shape": list(data.shape), "datatype": "FP32",
                                       "data": data.ravel().tolist()}]}).encode()
    with tempfile.TemporaryDirectory(prefix="by-kb-", dir="/tmp") as d:
        node = noop_node(d, 1, (NOOP, WIDE if classes else BIG))
        with running_node(node):
            url = f"http://127.0.0.1:{node.frontend.http_port}/v2/models/big/infer"
            if classes:
                def big() -> str:
                    return big_request(f"127.0.0.1:{node.frontend.grpc_port}")
            else:
                def big() -> str:
                    with urllib.request.urlopen(urllib.request.Request(url, body, method="POST"), timeout=300) as r:
                        return str(r.status)
            g = tg.InferenceServerClient(f"127.0.0.1:{node.frontend.grpc_port}")
            gi = tg.InferInput("x", [1, 16], "FP32")
            gi.set_data_from_numpy(X)
            for _ in range(50):
                g.infer("noop", [gi])
            small: list[tuple[float, float]] = []  # (start, seconds)
            done = threading.Event()
            answered = threading.Condition()

            def probe():
                while not done.is_set():
                    t = time.perf_counter()
                    g.infer("noop", [gi])
                    with answered:
                        small.append((t, time.perf_counter() - t))
                        answered.notify()
                    done.wait(0.005)  # the probe's pace: a small request every ~5 ms

            th = threading.Thread(target=probe)
            th.start()
            try:
                print(f"stall: {items} items of a million FP32 outputs, their top {classes} asked (gRPC)" if classes
                      else f"stall: {len(body) / 2**20:.1f} MiB of JSON ({items} items)", "one front-door process")
                for _ in range(n):
                    done.wait(0.5)
                    t0 = time.perf_counter()
                    status = big()
                    t1 = time.perf_counter()
                    # The small request held during the big one comes back after it: wait for a
                    # small request that started after it.
                    with answered:
                        answered.wait_for(lambda: small[-1][0] >= t1, timeout=60)
                    during = [s for t, s in small if t0 - 0.5 <= t <= t1]
                    print(f"  big request {status}, {1e3 * (t1 - t0):6.0f} ms; small requests meanwhile: "
                          f"{len(during)}, longest {1e3 * max(during, default=0):6.0f} ms")
            finally:
                done.set()
                th.join()
    print(f"  small requests in all: p50 {1e3 * float(np.median([s for _, s in small])):.1f} ms")


def _classified_request(items: int, classes: int):
    """A sender of one ModelInfer of ``items`` items to WIDE, its output asked as its top
    ``classes``: its status ("OK", or the gRPC code) and the answer's shape."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name="wide")
    req.inputs.add(name="x", datatype="FP32", shape=[items, 1])
    req.raw_input_contents.append(np.ones((items, 1), np.float32).tobytes())
    req.outputs.add(name="y").parameters["classification"].int64_param = classes

    def send(url: str) -> str:
        with grpc.insecure_channel(url, options=[("grpc.max_receive_message_length", (1 << 31) - 1)]) as ch:
            try:
                r = service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=300)
            except grpc.RpcError as e:
                return e.code().name
        return f"OK {list(r.outputs[0].shape)}"
    return send


def tensors(mib: int, n: int) -> None:
    import re
    import subprocess
    import sys

    item = ModelConfig(name="big", max_batch=mib, inputs=(TensorConfig("x", "float32", (256, 1024)),),
                       outputs=(TensorConfig("y", "float32", (256, 1024)),))
    with tempfile.TemporaryDirectory(prefix="by-kb-", dir="/tmp") as d:
        node = noop_node(d, 1, models=(item,))
        with running_node(node) as sup:
            front = _node_processes(sup)["frontend#0"]
            print(f"{mib} MiB in and out a request, one at a time, {n} requests a case (perf_analyzer):")
            for protocol, port in (("grpc", node.frontend.grpc_port), ("http", node.frontend.http_port)):
                for shm in ((), ("--shared-memory", "system")):
                    cpu0 = sum(front.cpu_times()[:2])
                    out = subprocess.run(
                        [sys.executable, "-m", "batchyard.bench.perf_analyzer", "-m", "big", "-b", str(mib), "-i",
                         protocol, "-u", f"127.0.0.1:{port}", *shm, "--concurrency-range", "1",
                         "--measurement-mode", "count_windows", "--measurement-request-count", str(n), "-s", "50"],
                        capture_output=True, text=True, timeout=600).stdout
                    cpu = sum(front.cpu_times()[:2]) - cpu0
                    sent = sum(int(c) for c in re.findall(r"Request count: (\d+)", out)) or 1
                    m = re.search(r"Concurrency: 1, throughput: [\d.]+ infer/sec, latency (\d+) usec", out)
                    where = "shared memory" if shm else "body"
                    if m is None:
                        print(f"  {protocol:4s} {where:13s} perf_analyzer failed: {out[-300:]}")
                        continue
                    # perf_analyzer's warm-up and its windows' requests all reached the front door;
                    # its counts are the measured windows': the CPU a request is an upper bound.
                    print(f"  {protocol:4s} {where:13s} average latency {int(m.group(1)) / 1e3:6.1f} ms, "
                          f"front door {cpu / sent * 1e3:5.1f} ms of CPU a request (at most)")


def restriction_cost(n: int) -> None:
    """p50/p99 of one request at a time through two like nodes, one whose inference is a
    restricted API asked with its header (the check runs and passes), one without restrictions;
    gRPC and HTTP, the four paths interleaved so that each node's processes idle alike."""
    import tritonclient.grpc as tg
    import tritonclient.http as th

    with contextlib.ExitStack() as stack:
        urls = {}
        for name, rules in (("plain", ()), ("restricted", (BENCH_RESTRICTION,))):
            node = noop_node(stack.enter_context(tempfile.TemporaryDirectory(prefix="by-kb-", dir="/tmp")), 1,
                             restricted_apis=rules)
            stack.enter_context(running_node(node))
            urls[name] = (f"127.0.0.1:{node.frontend.grpc_port}", f"127.0.0.1:{node.frontend.http_port}")
        gi = tg.InferInput("x", [1, 16], "FP32")
        gi.set_data_from_numpy(X)
        hi = th.InferInput("x", [1, 16], "FP32")
        hi.set_data_from_numpy(X)
        paths = {}
        for name, (g_url, h_url) in urls.items():
            g, h = tg.InferenceServerClient(g_url), th.InferenceServerClient(h_url)
            key = name == "restricted"
            paths[f"grpc-{name}"] = (lambda g=g, key=key:
                                     g.infer("noop", [gi], headers={"triton-grpc-protocol-bench-key": "bench"}
                                             if key else None))
            paths[f"http-{name}"] = lambda h=h, key=key: h.infer("noop", [hi], headers={"bench-key": "bench"}
                                                                 if key else None)
        times: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(50):
            for f in paths.values():
                f()
        for _ in range(n):
            for k, f in paths.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
    print(f"restricted APIs, one request at a time, n={n} per path (us):")
    for k in paths:
        p50, p99 = _pcts(times[k])
        print(f"  {k:16s} p50 {p50:8.0f}  p99 {p99:8.0f}")


def generate_cost(n: int) -> None:
    """p50/p99 of one request at a time over one kept-alive HTTP connection (the same client code
    for each path): infer with the tensor in JSON, generate and generate_stream with it as a plain
    member, the three interleaved."""
    import http.client

    values = X.ravel().tolist()
    bodies = {"infer": ("/v2/models/noop/infer", json.dumps(
                  {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": values}]})),
              "generate": ("/v2/models/noop/generate", json.dumps({"x": values})),
              "generate_stream": ("/v2/models/noop/generate_stream", json.dumps({"x": values}))}
    with tempfile.TemporaryDirectory(prefix="by-kb-", dir="/tmp") as run_dir:
        node = noop_node(run_dir, 1)
        with running_node(node):
            conn = http.client.HTTPConnection("127.0.0.1", node.frontend.http_port, timeout=30)

            def post(path: str, body: str) -> None:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                text = r.read()
                if r.status != 200:
                    raise RuntimeError(f"{path}: {r.status} {text[:200]!r}")

            times: dict[str, list[float]] = {k: [] for k in bodies}
            for _ in range(50):
                for path, body in bodies.values():
                    post(path, body)
            for _ in range(n):
                for k, (path, body) in bodies.items():
                    t = time.perf_counter()
                    post(path, body)
                    times[k].append(time.perf_counter() - t)
            conn.close()
    print(f"generate against infer (JSON), one request at a time over one HTTP connection, n={n} per path (us):")
    for k in bodies:
        p50, p99 = _pcts(times[k])
        print(f"  {k:16s} p50 {p50:8.0f}  p99 {p99:8.0f}")


def main(argv=None) -> None:
    from .commands import number

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("latency")
    p.add_argument("--n", type=int, default=2000)
    p = sub.add_parser("restricted")
    p.add_argument("--n", type=int, default=1000)
    p = sub.add_parser("generate")
    p.add_argument("--n", type=int, default=1000)
    p = sub.add_parser("throughput")
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--loaders", type=int, default=2)
    p.add_argument("--inflight", type=int, default=64)
    p = sub.add_parser("cpu")
    p.add_argument("--rate", type=number(0, above=True), default=40.0)
    p.add_argument("--seconds", type=number(0, above=True), default=15.0)
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--threads", action="store_true", help="also each process's threads, by thread name")
    p.add_argument("--floor", action="store_true", help="also a bare server of the protocol, no Batchyard")
    p.add_argument("--trace-rate", type=int, default=0, help="trace one request in this many (0: tracing off)")
    p.add_argument("--trace-file", default="", help="with --trace-rate: keep the traces here")
    p = sub.add_parser("status")
    p.add_argument("--fill", type=int, default=70_000)
    p.add_argument("--n", type=int, default=1000)
    p = sub.add_parser("stall")
    p.add_argument("--mib", type=float, default=62.0, help="JSON size (under the 64 MiB JSON limit)")
    p.add_argument("--n", type=int, default=3)
    p.add_argument("--classes", type=int, default=0,
                   help="instead, a classified gRPC request: the top CLASSES of a million FP32 outputs an item")
    p.add_argument("--items", type=int, default=4, help="items of the classified request")
    p = sub.add_parser("tensors")
    p.add_argument("--mib", type=int, default=4, help="MiB in and out a request (items of 1 MiB)")
    p.add_argument("--n", type=int, default=100, help="requests a measurement window")
    a = ap.parse_args(argv)
    if a.cmd == "tensors":
        tensors(a.mib, a.n)
    elif a.cmd == "stall":
        stall(a.mib, a.n, a.classes, a.items)
    elif a.cmd == "status":
        status_cost(a.fill, a.n)
    elif a.cmd == "latency":
        latency(a.n)
    elif a.cmd == "restricted":
        restriction_cost(a.n)
    elif a.cmd == "generate":
        generate_cost(a.n)
    elif a.cmd == "cpu":
        cpu(a.rate, a.seconds, a.protocol, a.threads, a.trace_rate, a.trace_file)
        if a.floor:
            floor(a.rate, a.seconds, a.protocol)
    else:
        throughput(a.processes, a.seconds, a.loaders, a.inflight)


if __name__ == "__main__":
    main()
