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


def _handler_at_wake_up(io, handler):
    """Run ``handler`` once, as a signal handler that interrupted this thread's submit where it
    wakes the I/O thread (the queueing lock held); returns the real wake-up."""
    wake, ran = io._wakeup.set, []

    def set_then_handler():
        wake()
        if not ran:
            ran.append(1)
            handler()

    io._wakeup.set = set_then_handler
    return wake


def test_close_from_a_signal_handler_that_interrupted_a_submit_on_its_thread_does_not_wait_on_itself(start_node):
    """A graceful stop's handler (gunicorn's, uvicorn's workers) calling close() while its
    thread was in submit, inside the lock that queues a request: close() took that lock, its
    own, and the process hung for ever (an outside review). The handler's run is simulated
    where it interrupted: at the wake-up of the I/O thread, the lock held."""
    node = start_node([sim_worker("w", models=("sum",))], models=(SUM_MODEL,))
    c = node.client()
    c.model_info("sum")
    io = c._io
    interrupted = []
    _handler_at_wake_up(io, lambda: interrupted.append(1) or c.close())
    outcome = []

    def submit():
        try:
            outcome.append(c.submit("sum", {"x": ONE}).result(timeout=30))
        except Cancelled as e:
            outcome.append(str(e))

    t = threading.Thread(target=submit, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "close() waits on its own thread's lock"
    assert interrupted and outcome == ["CANCELLED: client closed"], outcome
    c.close()
    assert not io._thread.is_alive()


def test_a_submit_from_a_signal_handler_that_interrupted_a_submit_on_its_thread_is_sent(start_node):
    """As close() from such a handler (above), a submit from it took the lock its own thread
    held below it, and waited for ever. The handler's run is simulated where it interrupted."""
    node = start_node([sim_worker("w", models=("sum",))], models=(SUM_MODEL,))
    with node.client() as c:
        c.model_info("sum")
        io = c._io
        from_handler = []
        wake = _handler_at_wake_up(io, lambda: from_handler.append(c.submit("sum", {"x": ONE * 2})))
        got = []
        t = threading.Thread(target=lambda: got.append(c.submit("sum", {"x": ONE}).result(timeout=30)), daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), "submit() waits on its own thread's lock"
        io._wakeup.set = wake
        assert got[0]["y"].shape == (1, 2) and from_handler[0].result(timeout=30)["y"].shape == (1, 2)


def test_two_threads_closing_a_client_at_once_both_return_once_it_is_closed(start_node):
    """The second of two close() calls at once returned at once, the I/O thread still running
    and the pool still in /dev/shm, while the first waited for them (20 of 20 rounds, a
    done-callback holding the I/O thread; an outside review)."""
    node = start_node([sim_worker("w", models=("sum",))], models=(SUM_MODEL,))
    c = node.client()
    c.model_info("sum")
    held, release = threading.Event(), threading.Event()
    c.submit("sum", {"x": ONE}).add_done_callback(lambda _: (held.set(), release.wait(30)))
    assert held.wait(30)  # the I/O thread is in the callback: no close() can end it yet
    io, real_close, real_wake = c._io, c._io.close, c._io._wakeup.set
    first_in, progress, seen = threading.Event(), threading.Event(), []

    def wake():  # the first close() asks the I/O thread to stop (and then waits for it)
        first_in.set()
        real_wake()

    def close_entered(timeout):  # the second one waits for it too (the first's finalizer holds its own)
        progress.set()
        real_close(timeout)

    io._wakeup.set, io.close = wake, close_entered

    def close(who):
        c.close()
        seen.append((who, io._thread.is_alive()))
        if who == "second":
            progress.set()

    a = threading.Thread(target=close, args=("first",), daemon=True)
    a.start()
    assert first_in.wait(30)
    b = threading.Thread(target=close, args=("second",), daemon=True)
    b.start()
    assert progress.wait(30)
    release.set()
    a.join(30)
    b.join(30)
    assert sorted(seen) == [("first", False), ("second", False)], seen


def test_a_done_callback_that_raises_a_base_exception_leaves_the_client_serving(start_node):
    """concurrent.futures lets a callback's BaseException through (asyncio.CancelledError is
    one): on the I/O thread it ended the client, and every later call of every thread was told
    "client closed" (an outside review)."""
    import asyncio

    node = start_node([sim_worker("w", models=("sum",))], models=(SUM_MODEL,))
    with node.client() as c:
        ran = threading.Event()

        def cancelled(_):
            ran.set()
            raise asyncio.CancelledError

        c.submit("sum", {"x": ONE}).add_done_callback(cancelled)
        assert ran.wait(30)
        assert c.infer("sum", {"x": ONE})["y"].shape == (1, 2) and not c.closed


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


def test_a_blocking_call_from_a_done_callback_fails_at_once_and_the_client_keeps_serving(start_node):
    # A model's first submit waits for its spec, which only the I/O thread (the one running
    # done-callbacks) can deliver: the callback waited for ever, and with it every request of
    # every thread sharing the client. (A batch of 0.3 s: the first reply must not come before
    # its callbacks are added, which then run on this thread: seen under a loaded machine.)
    node = start_node([sim_worker("sim0", launch_us=300_000.0)])
    seen = []
    with node.client() as c:
        first = c.submit("sum", {"x": ONE})
        first.add_done_callback(lambda f: seen.append(_raised(lambda: c.infer("big", {"x": np.ones((1, 256, 1024),
                                                                                                   np.float32)}))))
        first.add_done_callback(lambda f: seen.append(_raised(lambda: c.submit("sum", {"x": ONE}).exception())))
        first.result(timeout=60)
        np.testing.assert_array_equal(c.infer("sum", {"x": ONE}, timeout=30)["y"], sim_outputs({"x": ONE}, SUM)["y"])
    assert len(seen) == 2 and all(type(e).__name__ == "InvalidArgument" and "done-callback" in str(e) for e in seen)


def _raised(call):
    try:
        call()
    except Exception as e:
        return e
    return None


FORKED_CHILD = """
import os, sys
import numpy as np
from batchyard.client import Client
c = Client(sys.argv[1])
x = np.ones((1, 256, 1024), np.float32)
assert c.infer("big", {"x": x}, timeout=30)["y"].shape == (1, 256, 1024)
segments = c._codec.pool.segment_names()
c._codec.pool._lock.acquire()  # as a thread of the parent holding it at the fork
pid = os.fork()
if pid == 0:  # the child: a clear error, then a normal exit (its atexit handlers run)
    try:
        c.infer("sum", {"x": np.ones((1, 4), np.float32)}, timeout=1)
    except Exception as e:
        print("child:", type(e).__name__, e, flush=True)
    try:
        c.alloc_array((4,), np.float32)  # the parent's memory: never lent here
    except Exception as e:
        print("child alloc:", type(e).__name__, flush=True)
    sys.exit(0)
c._codec.pool._lock.release()
assert os.waitpid(pid, 0)[1] == 0
print("segments left:", all(os.path.exists("/dev/shm/" + s) for s in segments))
assert c.infer("big", {"x": x}, timeout=30)["y"].shape == (1, 256, 1024)
print("parent served")
c.close()
"""


def test_a_forked_child_can_neither_hang_on_nor_delete_its_parents_client(start_node):
    # The child had no I/O thread: a call waited for ever, its timeout included. Its normal
    # exit unlinked the parent's shared memory, whose big requests then failed for good.
    node = start_node([sim_worker("sim0")])
    proc = subprocess.run([sys.executable, "-c", FORKED_CHILD, node.address], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("child: Cancelled") and "made in the parent of this forked process" in lines[0], proc.stdout
    assert lines[1:] == ["child alloc: Cancelled", "segments left: True", "parent served"], proc.stdout


IN_FLIGHT_AT_THE_FORK = """
import os, signal, sys, threading
import numpy as np
from batchyard.client import Client
c = Client(sys.argv[1])
x = np.ones((1, 4), np.float32)
first = c.submit("sum", {"x": x}, timeout=60)  # 2 s a batch
if sys.argv[2] == "settled":
    first.result(timeout=60)
second = c.submit("sum", {"x": x}, timeout=60)
held, release = threading.Event(), threading.Event()
if sys.argv[2] in ("locked", "settled"):  # held by another thread at the fork (settling it, or waking in result())
    def hold():
        with first._condition:
            held.set()
            release.wait()
    threading.Thread(target=hold, daemon=True).start()
    held.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(60)  # a hang ends the child (and fails the test) here
    if sys.argv[2] == "close":  # close() settles them; else the wait itself does
        c.close()
    asked = second.cancel()  # nothing can be sent from here: False (it said True, "sent")
    for f in (first, second):
        try:
            f.result(timeout=20)
            print("child: answered", flush=True)
        except Exception as e:
            print("child:", type(e).__name__, e, flush=True)
    print("child cancel:", asked, flush=True)
    os._exit(0)
release.set()
assert os.waitpid(pid, 0)[1] == 0
print("parent:", first.result(timeout=60)["y"].tolist(), second.result(timeout=60)["y"].tolist())
c.close()
"""


@pytest.mark.parametrize("then", ["close", "wait", "locked", "settled"])
def test_requests_in_flight_at_a_fork_fail_in_the_child_and_are_answered_in_the_parent(start_node, then):
    """In a fork's child, a future of the parent's request in flight was never settled: its
    result() waited for ever (its timeout included), and close() did not settle it either; one
    whose lock a thread of the parent held at the fork hung every look at it, settled or not."""
    node = start_node([sim_worker("sim0", ("sum",), launch_us=2_000_000.0)])
    proc = subprocess.run([sys.executable, "-c", IN_FLIGHT_AT_THE_FORK, node.address, then], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 4, proc.stdout
    if then == "settled":  # answered before the fork: its answer stands in the child
        assert lines[0] == "child: answered", proc.stdout
    else:
        assert lines[0].startswith("child: Cancelled") and "forked process" in lines[0], proc.stdout
    assert lines[1].startswith("child: Cancelled") and "forked process" in lines[1], proc.stdout
    assert lines[2:] == ["child cancel: False", "parent: [[4.0, 4.0]] [[4.0, 4.0]]"], proc.stdout


ASYNC_FORKED_CHILD = """
import asyncio, os, sys
from batchyard.client_async import AsyncClient

async def main():
    c = AsyncClient(sys.argv[1])
    c.alloc_array((1024,), "float32")  # the pool is made
    pid = os.fork()
    if pid == 0:
        try:
            a = c.alloc_array((1024,), "float32")
            a[:] = 7.0
            print("child alloc: OK", flush=True)
        except Exception as e:
            print("child alloc:", type(e).__name__, flush=True)
        try:
            c.submit("sum", {"x": None})
        except Exception as e:  # as the blocking Client says it (it said "client closed")
            print("child submit:", type(e).__name__, "forked process" in str(e), flush=True)
        os._exit(0)
    os.waitpid(pid, 0)
    mine = c.alloc_array((1024,), "float32")
    print("parent's next array:", "the child's data" if (mine == 7.0).all() else "its own")
    c.close()

asyncio.run(main())
"""


def test_a_forked_childs_async_client_does_not_share_its_parents_memory(run_dir):
    """A Client closes itself in a fork's child; an AsyncClient did not: the child's alloc_array
    handed out the parent's live memory, and the parent's next array was the same region, with
    the child's data in it."""
    proc = subprocess.run([sys.executable, "-c", ASYNC_FORKED_CHILD, f"ipc://{run_dir}/none"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["child alloc: Cancelled", "child submit: Cancelled True",
                                        "parent's next array: its own"], proc.stdout


def test_a_calls_set_up_steps_take_from_its_timeout(run_dir, monkeypatch):
    # Each step (the model's spec, a segment's two grant steps) had the whole timeout, and the
    # request then had it again: against a slow dispatcher infer(timeout=2) took 8.5 s. The
    # dispatcher here is slow on the client's clock: each answer moves it on before it is sent.
    import types

    import zmq

    from batchyard import client as client_module, client_codec
    from batchyard import protocol as P
    from batchyard.client import Client
    from batchyard.errors import InvalidArgument, Overloaded

    slow_by = [0.0]
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + slow_by[0])
    monkeypatch.setattr(client_module, "time", clock)
    monkeypatch.setattr(client_codec, "time", clock)

    address = f"ipc://{run_dir}/slow"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    asked: list = []

    def slow_dispatcher():
        while len(asked) < 2:
            if not router.poll(30_000):
                return
            peer, raw = router.recv_multipart()[:2]
            msg = P.client_message_decoder.decode(raw)
            if type(msg) is P.ModelInfoRequest:
                slow_by[0] += 0.5
                reply = P.ModelInfoReply(v=P.PROTOCOL_VERSION, id=msg.id, status=0, spec=BIG)
            elif type(msg) is P.ShmRegisterRequest:
                slow_by[0] += 0.3
                reply = P.ShmReply(v=P.PROTOCOL_VERSION, id=msg.id, status=0, challenge=b"x" * 16)
            elif type(msg) is P.InferRequest:
                asked.append(msg.timeout_us)
                reply = P.InferReply(v=P.PROTOCOL_VERSION, id=msg.id, status=int(P.Status.OVERLOADED), message="busy")
            else:
                continue
            router.send_multipart([peer, P.encode(reply)])

    t = threading.Thread(target=slow_dispatcher)
    t.start()
    big = np.ones((1, 256, 1024), np.float32)  # through shared memory: its segment is granted first
    try:
        with Client(address) as c:
            with pytest.raises(InvalidArgument, match="timeout must be > 0"):
                c.infer("big", {"x": big}, timeout=-1)  # refused before any step (it waited for the spec)
            with pytest.raises(Overloaded):
                c.infer("big", {"x": big}, timeout=2.0)
            with pytest.raises(Overloaded):  # no step left to take: the whole (tiny) timeout is the request's
                c.infer("big", {"x": big}, timeout=1e-6)
    finally:
        t.join(timeout=60)
        router.close()
    assert asked[0] <= 0.9e6 and asked[1] == 1  # what 0.5 s of spec and 2 x 0.3 s of grant left


def test_alloc_array_refuses_what_no_model_takes_before_taking_memory(run_dir):
    # An object dtype was refused by numpy only after the pool's region was taken, never given
    # back (48 MiB held after 6 calls); a negative dimension made an empty array.
    from batchyard.client import Client
    from batchyard.errors import InvalidArgument

    with Client(f"ipc://{run_dir}/nobody-home") as c:
        for shape, dtype in (((1 << 20,), object), ((-5,), np.float32), ((2, 2), "U8"), ("x", np.float32)):
            with pytest.raises(InvalidArgument, match="alloc_array"):
                c.alloc_array(shape, dtype)
        assert c._codec.pool.segment_names() == []  # no memory taken for any of them
        assert c.alloc_array((3, 4), np.float32).shape == (3, 4)


def test_an_async_client_used_after_its_loop_ended_says_so_and_keeps_nothing(start_node):
    # A second asyncio.run with the first run's client: RuntimeError('Event loop is closed')
    # after the request was put in pending and its memory taken, never given back.
    import asyncio

    from batchyard.client import AsyncClient

    node = start_node([sim_worker("sim0")])
    holder = {}

    async def first():
        holder["c"] = AsyncClient(node.address)
        await holder["c"].infer("sum", {"x": ONE}, timeout=30)

    async def second():
        await holder["c"].infer("big", {"x": np.ones((1, 256, 1024), np.float32)}, timeout=30)

    asyncio.run(first())
    c = holder["c"]
    held = c._codec.pool.segment_names()
    for _ in range(3):
        with pytest.raises(RuntimeError, match="event loop is closed: an AsyncClient serves the loop it was made in"):
            asyncio.run(second())
    assert not c._codec.pending and c._codec.pool.segment_names() == held
    c.close()
