"""The no-op request paths the dispatcher micro-benchmarks compare (bench/dispatch_bench.py).

Each path ends in a worker that does no work, so only what sits between the client and the
worker differs:
- ``NodeRun``: a Batchyard node (dispatcher + a simulated worker) whose worker, by default,
  takes zero time; the policy and the service time are arguments for the lateness bench;
- ``Anchor``: the no-op *echo* worker (answers each request as a no-op model would, speaking
  the client protocol) reached directly, through pyzmq's C ``zmq.proxy`` (ROUTER -> DEALER), or
  through a bare Python uvloop forwarder. The dispatcher needs a worker that speaks the worker
  protocol, so its worker is the simulated one; each middle box is therefore compared with the
  direct path *to its own worker*.
- ``round_trips``: one request in flight over a raw DEALER socket with the SDK's wire encoding,
  the same client code for every path (no SDK I/O thread in the measurement).
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
import time

import numpy as np
import zmq

from batchyard import protocol as P
from batchyard.config import DispatcherConfig, ModelConfig, NodeConfig, SimConfig, TensorConfig, WorkerConfig
from batchyard.supervisor import running_node

NOOP = ModelConfig(name="noop", factory="batchyard.workers.models:mlp", max_batch=256,
                   inputs=(TensorConfig("x", "float32", (4,)),), outputs=(TensorConfig("y", "float32", (1,)),))
X = np.ones((1, 4), np.float32)
HWM = 100_000  # far above the in-flight counts used here: no box ever drops or blocks on a full queue


ZERO_TIME = SimConfig(launch_us=0.0, per_item_us=0.0)


def noop_node(run_dir: str, n_workers: int = 1, policy: str = "mcb", sim: SimConfig = ZERO_TIME) -> NodeConfig:
    return NodeConfig(
        dispatcher=DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be", policy=policy),
        models=(NOOP,),
        workers=tuple(WorkerConfig(name=f"noop{i}", kind="sim", models=("noop",), sim=sim) for i in range(n_workers)),
    ).validate()


class NodeRun:
    """A no-op node (simulated worker, zero service time unless told) for a with-block."""

    def __init__(self, n_workers: int = 1, **node_args):
        self._dir = tempfile.mkdtemp(prefix="by-bench-", dir="/tmp")
        self.node = noop_node(self._dir, n_workers, **node_args)
        self._ctx = running_node(self.node, ready_timeout_s=60)

    @property
    def address(self) -> str:
        return self.node.dispatcher.frontend

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            return self._ctx.__exit__(*exc)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)


# ---------------------------------------------------------------- the raw client
def encode_request(rid: int) -> list:
    """What the SDK puts on the wire for one inline no-op request."""
    ref = P.TensorRef(name="x", dtype="float32", shape=[1, 4], frame=0)
    return [P.encode(P.InferRequest(v=P.PROTOCOL_VERSION, id=rid, model="noop", inputs=[ref])), X.tobytes()]


def read_reply(frames: list) -> np.ndarray:
    """What the SDK does with a reply: decode the header, view the output."""
    P.reply_decoder.decode(frames[0])
    return np.frombuffer(frames[1], dtype=np.float32)


def round_trips(address: str, n: int, warmup: int = 200) -> list[float]:
    """Seconds per request, one in flight, over a raw DEALER with the SDK's encoding."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    lat = []
    try:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            s.send_multipart(encode_request(i + 1))
            read_reply(s.recv_multipart())
            if i >= warmup:
                lat.append(time.perf_counter() - t0)
    finally:
        s.close()
        ctx.term()
    return lat


# ---------------------------------------------------------------- the echo worker and the middle boxes
def _echo_worker_main(address: str, bind: bool, hello: bool) -> None:
    """Answers each request like a no-op model would. ``bind``: a ROUTER clients reach directly;
    else a DEALER behind a middle box. Either way it reads [client id, header, x]."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER if bind else zmq.DEALER)
    s.setsockopt(zmq.SNDHWM, HWM)
    s.setsockopt(zmq.RCVHWM, HWM)
    s.bind(address) if bind else s.connect(address)
    if hello:  # the Python forwarder learns its worker's identity from this
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


def _c_proxy_main(front: str, back: str, ready) -> None:
    """libzmq's own proxy loop (zmq_proxy, no Python per message): ROUTER in, DEALER out."""
    ctx = zmq.Context()
    fe, be = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (fe, be):
        s.setsockopt(zmq.SNDHWM, HWM)
        s.setsockopt(zmq.RCVHWM, HWM)
    fe.bind(front)
    be.bind(back)
    ready.set()
    zmq.proxy(fe, be)


def _forwarder_main(front: str, back: str, ready) -> None:
    """A bare Python uvloop forwarder: add_reader + NOBLOCK drains, to one worker, no decoding
    at all. The ceiling a Python broker of this design can reach."""
    import uvloop

    ctx = zmq.Context()
    fe, be = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    for s in (fe, be):
        s.setsockopt(zmq.SNDHWM, HWM)
        s.setsockopt(zmq.RCVHWM, HWM)
    fe.bind(front)
    be.bind(back)
    worker = be.recv_multipart()[0]
    ready.set()
    loop = uvloop.new_event_loop()

    def pump():
        while True:
            moved = False
            try:
                be.send_multipart([worker, *fe.recv_multipart(zmq.NOBLOCK, copy=False)], copy=False)
                moved = True
            except zmq.Again:
                pass
            try:
                fe.send_multipart(be.recv_multipart(zmq.NOBLOCK, copy=False)[1:], copy=False)
                moved = True
            except zmq.Again:
                pass
            if not moved:
                return

    loop.add_reader(fe.getsockopt(zmq.FD), pump)
    loop.add_reader(be.getsockopt(zmq.FD), pump)
    loop.run_forever()


class Anchor:
    """The echo worker behind one of KINDS, in their own processes, for a with-block;
    ``address`` is where clients connect."""

    KINDS = ("echo worker directly", "C zmq.proxy", "bare forwarder")

    def __init__(self, kind: str):
        if kind not in self.KINDS:
            raise ValueError(f"anchor {kind!r} not one of {self.KINDS}")
        self.kind = kind
        self._dir = tempfile.mkdtemp(prefix="by-bench-", dir="/tmp")
        self.address = f"ipc://{self._dir}/fe"
        self._procs: list = []

    def __enter__(self):
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        back = f"ipc://{self._dir}/be"
        try:
            if self.kind == "echo worker directly":
                self._start(ctx, _echo_worker_main, self.address, True, False)
                return self  # the client's first round trip waits for the bind
            box = _c_proxy_main if self.kind == "C zmq.proxy" else _forwarder_main
            self._start(ctx, box, self.address, back, ready)
            self._start(ctx, _echo_worker_main, back, False, self.kind == "bare forwarder")
            if not ready.wait(60):
                raise RuntimeError(f"{self.kind} did not start within 60 s")
            return self
        except BaseException:
            self.__exit__()
            raise

    @property
    def box_pid(self) -> int:
        """The middle box's process (the echo worker's when it is reached directly)."""
        return self._procs[0].pid

    def _start(self, ctx, target, *args) -> None:
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        self._procs.append(p)

    def __exit__(self, *exc):
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            p.join(10)
        shutil.rmtree(self._dir, ignore_errors=True)
