"""Drive one worker process directly, playing the dispatcher's part (no policy, no queue).

Used by ``batchyard calibrate`` (sweep batch sizes, read the worker's own compute times) and
by the benchmark that measures what the dispatcher adds (bench/dispatch_bench.py (a)).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import zmq

from batchyard import protocol as P
from batchyard.config import NodeConfig, to_toml

from .triton_local import die_with_parent


class WorkerExited(RuntimeError):
    """The worker exited before it did what was waited for (it logged why). ``exit_code``: its
    exit status, -N when signal N killed it; 78 (EX_CONFIG) says it cannot run as configured."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class DirectWorker:
    def __init__(self, node: NodeConfig, worker: str, log_level: str = "WARNING"):
        self.dir = tempfile.mkdtemp(prefix="by-direct-", dir="/tmp")
        backend = f"ipc://{self.dir}/be"
        node = msgspec.structs.replace(node, dispatcher=msgspec.structs.replace(
            node.dispatcher, backend=backend, frontend=f"ipc://{self.dir}/fe"))
        cfg = Path(self.dir) / "node.toml"
        cfg.write_text(to_toml(node))
        self.node = node
        self.name = worker
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(backend)
        # SIGTERM when this process dies, however it dies: killed by -9 (the OOM killer, a CI
        # runner's hard kill), `batchyard calibrate` left its worker running for good, holding its
        # shared memory and its Triton regions. (The signal comes when the *thread* that started
        # the worker ends: a DirectWorker lives on the thread that made it, every caller's main.)
        parent = os.getpid()
        self.proc = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "--log-level", log_level, "worker",
                                      "--config", str(cfg), "--name", worker],
                                     preexec_fn=lambda: die_with_parent(parent))
        # Readable once the worker exits: every wait below ends then, instead of waiting for a
        # message a dead worker will never send (calibrate hung for good on a worker killed mid-batch).
        self._exited = os.pidfd_open(self.proc.pid)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._exited, zmq.POLLIN)
        self.identity = None
        self.spec: dict[str, P.ModelSpec] = {}
        self.path = ""
        self._batch = 0

    def _wait(self, timeout_s: float, what: str) -> None:
        """Until a message from the worker is waiting; WorkerExited if it exits first."""
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        if self.sock in events:
            return
        if self._exited in events:
            code = self.proc.wait()
            raise WorkerExited(f"worker {self.name} exited with {code} before it {what}", code)
        raise TimeoutError(f"worker {self.name} did not {what} within {timeout_s:.0f} s")

    def wait_registered(self, timeout_s: float = 300.0) -> None:
        while self.identity is None:
            self._wait(timeout_s, "registered")
            frames = self.sock.recv_multipart()
            msg = P.worker_message_decoder.decode(frames[1])
            if type(msg) is P.Register:
                self.identity = frames[0]
                self.spec = {s.name: s for s in msg.models}
                self.path = msg.path
                self.sock.send_multipart([self.identity, P.encode(P.Registered(worker=self.name))])

    def run(self, model: str, requests: list[list], timeout_s: float = 600.0) -> tuple[P.BatchDone, list]:
        """Send one batch made of ``requests`` (each [header, *payload frames]); return the reply."""
        self._batch += 1
        header = P.Batch(batch_id=self._batch, model=model, seqs=list(range(len(requests))),
                         n_frames=[len(r) - 1 for r in requests])
        self.sock.send_multipart([self.identity, P.encode(header), *[f for r in requests for f in r]], copy=False)
        while True:
            self._wait(timeout_s, f"answered batch {self._batch}")
            frames = self.sock.recv_multipart(copy=False)
            msg = P.worker_message_decoder.decode(frames[1].buffer)
            if type(msg) is P.BatchDone and msg.batch_id == self._batch:
                return msg, frames[2:]

    def zeros_request(self, model: str, items: int) -> list:
        """One request of ``items`` items with zero-filled inline inputs."""
        return self.request(model, {t.name: np.zeros((items, *t.shape), dtype=t.dtype) for t in self.spec[model].inputs})

    @staticmethod
    def request(model: str, arrays: dict) -> list:
        """One request with these inline inputs (name -> array)."""
        refs = [P.TensorRef(name=name, dtype=a.dtype.name, shape=list(a.shape), frame=i)
                for i, (name, a) in enumerate(arrays.items())]
        return [P.encode(P.InferRequest(v=P.PROTOCOL_VERSION, id=0, model=model, inputs=refs)),
                *(np.ascontiguousarray(a) for a in arrays.values())]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.sock.close(linger=0)
        self.ctx.term()
        os.close(self._exited)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
