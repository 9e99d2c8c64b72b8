"""One Client shared by many threads: nobody waits on anybody else's reply, requests from
different threads are batched together, and close() answers everything still in flight."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import wait
from pathlib import Path

import numpy as np
import pytest

from batchyard.config import ModelConfig
from batchyard.errors import Cancelled
from batchyard.workers.executors import sim_outputs

from conftest import BIG_MODEL, SUM_MODEL, sim_worker

ROOT = Path(__file__).resolve().parents[1]
SLOW_MODEL = ModelConfig(name="slow", factory=SUM_MODEL.factory, max_batch=SUM_MODEL.max_batch,
                         inputs=SUM_MODEL.inputs, outputs=SUM_MODEL.outputs)
SUM, BIG = SUM_MODEL.spec(), BIG_MODEL.spec()
ONE = np.ones((1, 4), np.float32)


def start_threads(target, n):
    threads = [threading.Thread(target=target, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    return threads


def test_eight_threads_share_one_client_and_each_gets_its_own_answers(start_node):
    node = start_node([sim_worker("sim0", launch_us=3000.0)])
    errors, batch_sizes = [], []
    start = threading.Barrier(8, timeout=60)
    with node.client() as c:

        def user(k):
            try:
                rng = np.random.default_rng(k)
                start.wait()
                for i in range(30):
                    x = rng.integers(0, 100, size=(int(rng.integers(1, 4)), 4)).astype(np.float32)
                    r = c.infer("sum", {"x": x})
                    np.testing.assert_array_equal(r["y"], sim_outputs({"x": x}, SUM)["y"])
                    batch_sizes.append(r.timing.batch_size)
                xs = [rng.integers(0, 100, size=(1, 4)).astype(np.float32) for _ in range(5)]
                futs = [c.submit("sum", {"x": x}) for x in xs]  # several in flight from one thread too
                assert not wait(futs, timeout=30).not_done
                for x, f in zip(xs, futs):
                    np.testing.assert_array_equal(f.result()["y"], sim_outputs({"x": x}, SUM)["y"])
                if k < 2:  # big tensors through the shared pool, both ways, from two threads at once
                    x = rng.integers(0, 3, size=(1, 256, 1024)).astype(np.float32)
                    big = c.infer("big", {"x": x})
                    np.testing.assert_array_equal(big["y"], sim_outputs({"x": x}, BIG)["y"])
                    del big
            except Exception as e:  # surfaced below; a thread cannot fail the test itself
                errors.append(e)

        for t in start_threads(user, 8):
            t.join()
    assert not errors, errors
    assert max(batch_sizes) > 1  # requests of different threads went to the worker together


def test_a_thread_waiting_on_a_slow_reply_does_not_hold_up_another_threads_requests(start_node):
    node = start_node([sim_worker("fast", models=("sum",)), sim_worker("slow", models=("slow",), launch_us=2e6)],
                      models=(SUM_MODEL, SLOW_MODEL))
    with node.client() as c:
        c.model_info("slow")
        slow_submitted = threading.Event()
        seen = {}

        def waiter():
            seen["future"] = c.submit("slow", {"x": ONE})
            slow_submitted.set()
            seen["y"] = seen["future"].result()["y"].tolist()  # ~2 s in result()

        t = threading.Thread(target=waiter)
        t.start()
        assert slow_submitted.wait(timeout=30)
        # Twenty round trips: the waiter is inside result() for nearly all of them.
        for i in range(20):
            assert c.infer("sum", {"x": np.full((1, 4), i, np.float32)})["y"].tolist() == [[4.0 * i] * 2]
        slow = seen["future"]
        assert not slow.done()  # every one of them answered while the slow reply was still out
        with pytest.raises(TimeoutError):
            slow.result(timeout=0.01)  # a bounded wait gives up; the request stays in flight
        t.join(timeout=30)
        assert seen["y"] == [[4.0, 4.0]]


def test_close_with_requests_in_flight_fails_every_one_promptly_with_a_clear_error(start_node):
    node = start_node([sim_worker("slow", models=("sum",), launch_us=3e6)], models=(SUM_MODEL,))
    c = node.client()
    c.model_info("sum")
    in_flight = threading.Barrier(5, timeout=30)  # four waiting threads and this one
    outcomes = []

    def waiter(k):
        fut = c.submit("sum", {"x": ONE})
        in_flight.wait()
        try:
            fut.result()
            outcomes.append("answered")
        except Cancelled as e:
            outcomes.append(str(e))

    threads = start_threads(waiter, 4)
    futs = [c.submit("sum", {"x": ONE}) for _ in range(10)]
    in_flight.wait()
    t0 = time.monotonic()
    c.close()
    for t in threads:
        t.join(timeout=10)
    assert time.monotonic() - t0 < 1.0  # not the 3 s the worker would take
    assert outcomes == ["CANCELLED: client closed"] * 4
    for f in futs:
        with pytest.raises(Cancelled, match="client closed"):
            f.result(timeout=0)
    with pytest.raises(Cancelled, match="client closed"):
        c.submit("sum", {"x": ONE})
    c.close()  # twice is fine


UNCLOSED_CLIENT = """
import sys, threading, numpy as np
from batchyard.client import Client
c = Client(sys.argv[1])
c.alloc_array((1024,), np.float32)
threading.Thread(target=c.status, kwargs={"timeout": 60}, daemon=True).start()
print(c.pool.segment_names()[0], flush=True)
"""


def test_a_client_never_closed_does_not_hold_up_interpreter_exit(run_dir):
    proc = subprocess.run([sys.executable, "-c", UNCLOSED_CLIENT, f"ipc://{run_dir}/nobody-home"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seg = proc.stdout.strip()
    assert seg and not os.path.exists(os.path.join("/dev/shm", seg))  # and its memory went with it
