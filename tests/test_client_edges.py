"""The SDK's edges against a fake dispatcher (no node): what a request sends is what its inputs
held at submit(), set-up steps (a model's spec, a segment's grant) that cannot finish, or take
too long, fail the call in its own time, and a grant never outlives its connection."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import threading
import time
import types
import warnings
from decimal import Decimal

import numpy as np
import pytest
import zmq

from batchyard import protocol as P
from batchyard.client import AsyncClient, Client
from batchyard.client_codec import checked_timeout
from batchyard.errors import DeadlineExceeded, InvalidArgument, Unavailable
from batchyard.shm import ALIGN

from conftest import BIG_MODEL, SUM_MODEL
from test_client_threads import _raised

SPECS = {"sum": SUM_MODEL.spec(), "big": BIG_MODEL.spec(), "refused": BIG_MODEL.spec()}
ONE = np.ones((1, 4), np.float32)
BIG_X = np.ones((1, 256, 1024), np.float32)  # 1 MiB: through the client's shared-memory pool


class FakeDispatcher:
    """A dispatcher's ROUTER on ``address``, answered by its own thread: the models' specs, the
    two steps of a segment's grant (remembered per connection: a request naming a segment its
    connection never proved gets PERMISSION_DENIED, as from the real one), "sum" echoed (y = x,
    inline), "big" answered OK with its outputs in the client's memory.

    ``answer(msg)`` runs on that thread before each reply: it may wait, and returning False
    holds the message until ``answer_held()``. ``stop_after(msg)``: True closes the socket
    right after that reply (the dispatcher going away)."""

    def __init__(self, address: str, answer=lambda msg: True, stop_after=lambda msg: False,
                 default_timeout_us: int | None = None):
        self.address, self._answer, self._stop_after = address, answer, stop_after
        self.default_timeout_us = default_timeout_us
        self.seen: list = []
        self.held: list = []
        self._release, self._stop, self._bound = threading.Event(), threading.Event(), threading.Event()
        self._proved: dict[bytes, set] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._bound.wait(10)

    def answer_held(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(self.address)
        self._bound.set()
        try:
            while not self._stop.is_set():
                if self._release.is_set():
                    held, self.held = self.held, []
                    for ident, msg, frames in held:
                        self._reply(sock, ident, msg, frames)
                if not sock.poll(20):
                    continue
                ident, *frames = sock.recv_multipart()
                msg = P.client_message_decoder.decode(frames[0])
                self.seen.append(msg)
                if not self._answer(msg):
                    self.held.append((ident, msg, frames))
                    continue
                self._reply(sock, ident, msg, frames)
                if self._stop_after(msg):
                    return
        finally:
            sock.close(linger=500)  # what was answered still reaches the client

    def _reply(self, sock, ident: bytes, msg, frames: list) -> None:
        proved = self._proved.setdefault(ident, set())
        payload = []
        if type(msg) is P.ModelInfoRequest:
            reply = P.ModelInfoReply(v=1, id=msg.id, status=0, spec=SPECS[msg.model],
                                     default_timeout_us=self.default_timeout_us)
        elif type(msg) is P.ShmRegisterRequest:
            if msg.proved:
                proved.add(msg.segment)
            reply = P.ShmReply(v=1, id=msg.id, status=0, challenge=b"" if msg.proved else b"c" * 16)
        elif type(msg) is P.InferRequest:
            named = {t.shm.segment for t in msg.inputs if t.shm} | {r.segment for r in msg.outputs.values()}
            if named - proved:
                reply = P.InferReply(v=1, id=msg.id, status=int(P.Status.PERMISSION_DENIED),
                                     message=f"segments {sorted(named - proved)} not registered")
            elif msg.model == "refused":  # as a dispatcher refuses a timeout no path can meet
                reply = P.InferReply(v=1, id=msg.id, status=int(P.Status.DEADLINE_EXCEEDED),
                                     message="Request timeout expired: no path can finish it in time")
            elif msg.model == "sum":
                x = msg.inputs[0]
                reply = P.InferReply(v=1, id=msg.id, status=0, outputs=[P.TensorRef("y", x.dtype, x.shape, frame=0)])
                payload = [frames[1 + x.frame]]
            else:
                reply = P.InferReply(v=1, id=msg.id, status=0,
                                     outputs=[P.TensorRef(name, "float32", [1, 256, 1024], shm=ref)
                                              for name, ref in msg.outputs.items()])
        else:
            return
        sock.send_multipart([ident, P.encode(reply), *payload])


@pytest.fixture
def fake(run_dir):
    started = []

    def start(**kw) -> FakeDispatcher:
        started.append(FakeDispatcher(f"ipc://{run_dir}/dispatcher", **kw))
        return started[-1]

    yield start
    for f in started:
        f.close()


def _pool_in_use(client) -> int:
    """Bytes of the client's pool handed out and not given back."""
    pool = client._codec._pool
    if pool is None:
        return 0
    return sum(seg.size for seg in pool._segments.values()) - sum(
        ALIGN + sum(size for _, size in free) for free in pool._free.values())  # ALIGN: each one's header


# ---------------------------------------------------------------- inputs are read at submit()

def test_client_submit_sends_the_inputs_as_they_were_at_submit_not_as_they_are_when_sent(fake):
    # The I/O thread sends later, without copying: a buffer refilled after submit() returned was
    # sent with its new contents, and earlier requests computed on later ones' data.
    callback_added, io_blocked, io_release = threading.Event(), threading.Event(), threading.Event()
    f = fake(answer=lambda msg: type(msg) is not P.InferRequest or callback_added.wait(10))
    with Client(f.address) as c:
        c.model_info("sum")
        first = c.submit("sum", {"x": ONE})
        first.add_done_callback(lambda _: (io_blocked.set(), io_release.wait(10)))
        callback_added.set()
        assert io_blocked.wait(10)  # the I/O thread is in the callback: nothing is sent meanwhile
        buf, futs = np.zeros((1, 4), np.float32), []
        for i in range(5):
            buf[...] = i
            futs.append(c.submit("sum", {"x": buf}))
        strided = np.arange(8, dtype=np.float32).reshape(2, 4)[:, ::2]  # not contiguous: one copy
        futs.append(c.submit("sum", {"x": strided}))
        strided[...] = -1
        io_release.set()
        got = [f.result(timeout=10)["y"] for f in futs]
    assert [float(y[0, 0]) for y in got[:5]] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert got[5].tolist() == [[0.0, 2.0], [4.0, 6.0]]


def test_async_submit_reads_the_inputs_before_it_returns(fake):
    # The Task encoded its inputs only when it first ran: five submits of one refilled buffer
    # all sent the last contents.
    f = fake()

    async def main():
        c = AsyncClient(f.address)
        try:
            await c.model_info("sum")
            buf, tasks = np.zeros((1, 4), np.float32), []
            for i in range(5):
                buf[...] = i
                tasks.append(c.submit("sum", {"x": buf}))
            assert [float((await t)["y"][0, 0]) for t in tasks] == [0.0, 1.0, 2.0, 3.0, 4.0]
            with pytest.raises(InvalidArgument, match="dtype"):  # from submit itself, as Client.submit's
                c.submit("sum", {"x": np.array([object()])})
            cancelled = c.submit("big", {"x": BIG_X})  # cancelled before it ever runs
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            await asyncio.sleep(0)
            assert _pool_in_use(c) == 0  # its input's region went back
        finally:
            c.close()

    asyncio.run(main())


# ---------------------------------------------------------------- set-up steps

def test_a_done_callbacks_submit_that_needs_a_grant_fails_at_once_instead_of_blocking_the_client(fake):
    # The callback (on the I/O thread) waited for the grant lock, held by a thread waiting for
    # its grant, which only the blocked I/O thread could deliver: both, and every other request
    # of the client, waited for ever.
    grant_asked, callback_added = threading.Event(), threading.Event()

    def answer(msg):
        if type(msg) is P.ShmRegisterRequest and not msg.proved:
            grant_asked.set()
            return False  # held until the callback has run
        if type(msg) is P.InferRequest and msg.model == "sum":
            callback_added.wait(10)
        return True

    f = fake(answer=answer)
    outcome, callback_done = {}, threading.Event()
    with Client(f.address) as c:
        c.model_info("big")
        a = threading.Thread(target=lambda: outcome.update(a=_raised(lambda: c.infer("big", {"x": BIG_X},
                                                                                      timeout=20))), daemon=True)
        a.start()
        assert grant_asked.wait(10)  # thread A holds the grant lock, waiting for its challenge

        def on_done(_):
            outcome["callback"] = _raised(lambda: c.submit("big", {"x": BIG_X}, timeout=5))
            callback_done.set()

        c.submit("sum", {"x": ONE}).add_done_callback(on_done)
        callback_added.set()
        assert callback_done.wait(5), "the done-callback's submit is blocked"
        f.answer_held()
        a.join(timeout=10)
        assert c.infer("sum", {"x": ONE}, timeout=5)["y"].tolist() == ONE.tolist()  # the client still serves
    assert isinstance(outcome["callback"], InvalidArgument) and "done-callback" in str(outcome["callback"])
    assert outcome["a"] is None  # A's own request went through


def test_a_grant_answered_just_before_the_dispatcher_went_away_is_not_kept(fake, monkeypatch):
    # The I/O thread cleared the grants at the disconnection, then the registering thread added
    # the old dispatcher's grant back: the restarted one refused every request naming that
    # segment (PERMISSION_DENIED) until the next disconnection. Here the registering thread is
    # held after the last grant step until the disconnection has been seen.
    from batchyard import client as client_module

    old = fake(stop_after=lambda msg: type(msg) is P.ShmRegisterRequest and msg.proved)
    lost = threading.Event()
    result = client_module.InferFuture.result

    def result_after_the_loss(self, timeout=None):
        value = result(self, timeout)
        if value == b"":  # the grant's last step: answered, and the dispatcher gone right after
            assert lost.wait(10)
        return value

    monkeypatch.setattr(client_module.InferFuture, "result", result_after_the_loss)
    with Client(old.address) as c:
        lost_connection = c._codec.lost_connection
        c._codec.lost_connection = lambda: (lost_connection(), lost.set())[0]
        first = _raised(lambda: c.infer("big", {"x": BIG_X}, timeout=2))
        old.close()
        restarted = fake()
        c.infer("big", {"x": BIG_X}, timeout=5)  # registered again: not PERMISSION_DENIED
    assert isinstance(first, Unavailable) and "while registering shared memory" in str(first), first
    assert [type(m).__name__ for m in restarted.seen] == ["ModelInfoRequest", "ShmRegisterRequest",
                                                          "ShmRegisterRequest", "InferRequest"]


@pytest.mark.parametrize("kind", ["Client", "AsyncClient"])
def test_a_call_without_a_timeout_after_a_lost_connection_waits_the_nodes_default_for_its_spec(fake, kind,
                                                                                             monkeypatch):
    """A lost connection makes the next call fetch its model's spec again (a restarted dispatcher
    may serve another shape); without a timeout of its own that fetch waited SETUP_TIMEOUT_S
    (10 s), not the node's default_timeout_s the dispatcher had said: DeadlineExceeded after 10 s
    while the node's default was 30 s and the dispatcher was back at 13 s. (SETUP_TIMEOUT_S set
    to nothing once the node's default is known: the call must not read it.)"""
    from batchyard import client_codec

    old = fake(stop_after=lambda msg: type(msg) is P.InferRequest, default_timeout_us=20_000_000)
    lost, asked = threading.Event(), threading.Event()

    def watch(codec):
        lost_connection = codec.lost_connection
        codec.lost_connection = lambda: (lost_connection(), lost.set())[0]

    def restart():
        assert lost.wait(10)
        monkeypatch.setattr(client_codec, "SETUP_TIMEOUT_S", 0.0)
        old.close()
        return fake(answer=lambda msg: type(msg) is not P.ModelInfoRequest or asked.set())  # held

    def release(restarted):
        assert asked.wait(10)
        restarted.answer_held()

    if kind == "Client":
        with Client(old.address) as c:
            watch(c._codec)
            c.infer("sum", {"x": ONE})  # the node's default said; the dispatcher gone after
            restarted = restart()
            done = []

            def call():
                try:
                    done.append(c.infer("sum", {"x": ONE}))
                except Exception as e:  # noqa: BLE001 - the test reads what it raised
                    done.append(e)

            t = threading.Thread(target=call)
            t.start()
            release(restarted)
            t.join(10)
        got = done[0]
    else:
        async def main():
            async with AsyncClient(old.address) as c:
                watch(c._codec)
                await c.infer("sum", {"x": ONE})
                assert await asyncio.to_thread(lost.wait, 10)  # the loop must run to see the loss
                restarted = restart()
                call = asyncio.ensure_future(c.infer("sum", {"x": ONE}))
                await asyncio.to_thread(release, restarted)
                try:
                    return await call
                except Exception as e:  # noqa: BLE001 - the test reads what it raised
                    return e

        got = asyncio.run(main())
    assert not isinstance(got, BaseException), got
    assert got["y"].tolist() == ONE.tolist()


def test_an_async_client_dropped_without_close_is_collected_and_frees_its_sockets(run_dir):
    """The event loop's readers held the client: one dropped without close() was never collected,
    its sockets and context open for good (200 such clients left 1,807 file descriptors open).
    Client has a finalizer for this; AsyncClient had none."""
    import gc

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main():
        AsyncClient(f"ipc://{run_dir}/nobody").close()  # the loop's own fds, made once
        gc.collect()
        before = fds()
        for _ in range(20):
            AsyncClient(f"ipc://{run_dir}/nobody")
        gc.collect()
        return before, fds()

    before, after = asyncio.run(main())
    assert after <= before + 2, (before, after)


def test_an_async_client_made_outside_an_event_loop_says_where_to_make_it_and_leaves_nothing_open(run_dir):
    """It raised asyncio's bare "no running event loop", after its codec was made."""
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError, match="AsyncClient needs a running event loop: create it inside a coroutine"):
        AsyncClient(f"ipc://{run_dir}/nobody")
    assert set(os.listdir("/proc/self/fd")) <= before


def test_bad_arguments_raise_the_sdks_invalid_argument_not_a_bare_python_error(run_dir):
    """Each raised a bare OverflowError or TypeError, which `except BatchyardError` let through:
    an alloc_array of 2**63 bytes or more (the pool's file size is a C long), a status count past
    what the wire carries, a model named by a list, an input numpy cannot read (a torch bfloat16
    tensor). No dispatcher is needed: each is refused before anything is sent."""
    import torch

    with Client(f"ipc://{run_dir}/nobody") as c, Client("tcp://127.0.0.1:9") as plain:  # (tcp: plain memory)
        for call, words in ((lambda: c.alloc_array((2 ** 63,), "uint8"), "more than memory can hold"),
                            (lambda: plain.alloc_array((2 ** 63,), "uint8"), "more than memory can hold"),
                            (lambda: c.status(min_registrations=2 ** 70), "min_registrations must be >= 0"),
                            (lambda: c.infer(["sum"], {"x": ONE}), "model must be a str, got list")):
            with pytest.raises(InvalidArgument, match=words):
                call()

    async def main():
        async with AsyncClient(f"ipc://{run_dir}/nobody") as c:
            with pytest.raises(InvalidArgument, match="model must be a str, got list"):
                c.submit(["sum"], {"x": ONE})
            with pytest.raises(InvalidArgument, match="input 'x' is not an array"):
                c.submit("sum", {"x": torch.ones((1, 4), dtype=torch.bfloat16)})

    asyncio.run(main())


def test_an_input_name_the_encoder_refuses_frees_the_pool_it_took_and_a_numpy_string_name_is_a_name(fake):
    """A name from numpy or pandas (numpy.str_, a str subclass) was a TypeError from the
    encoder, and a name with a lone surrogate a UnicodeEncodeError, each raised after the pool
    was taken for the request's input and outputs: 40 such calls took the pool from 127 to 47
    MiB free and grew a segment (an outside review). Now the first is a name, the second
    InvalidArgument, and the pool is given back, with either client."""
    f = fake()
    with Client(f.address) as c:
        assert c.infer("sum", {np.str_("x"): ONE})["y"].tolist() == ONE.tolist()
        c.infer("big", {"x": BIG_X})
        for _ in range(3):
            with pytest.raises(InvalidArgument, match="cannot be encoded"):
                c.infer("big", {"x\udcff": BIG_X})
            assert _pool_in_use(c) == 0
        with pytest.raises(InvalidArgument, match="input names must be strings, got int 3"):
            c.infer("sum", {3: ONE})

    async def main():
        async with AsyncClient(f.address) as c:
            assert (await c.infer("sum", {np.str_("x"): ONE}))["y"].tolist() == ONE.tolist()
            await c.infer("big", {"x": BIG_X})
            before = _pool_in_use(c)  # (the answer's output, until collected)
            for _ in range(3):
                with pytest.raises(InvalidArgument, match="cannot be encoded"):
                    await c.infer("big", {"x\udcff": BIG_X})
                assert _pool_in_use(c) == before

    asyncio.run(main())


def test_an_async_client_called_from_another_running_loop_is_refused_before_anything_is_sent(fake):
    """Its rule is to serve the loop it was made in; awaited from another thread's loop, the
    request went out on its loop's socket from that thread, and the caller got asyncio's
    "attached to a different loop" after the dispatcher had run it (an outside review)."""
    f = fake()
    home = asyncio.new_event_loop()
    thread = threading.Thread(target=home.run_forever, daemon=True)
    thread.start()
    try:
        async def make():
            return AsyncClient(f.address)

        c = asyncio.run_coroutine_threadsafe(make(), home).result(10)
        asyncio.run_coroutine_threadsafe(c.infer("big", {"x": BIG_X}), home).result(10)  # at home: served
        sent = sum(type(m) is P.InferRequest for m in f.seen)
        used = _pool_in_use(c)

        async def elsewhere():
            for call in (lambda: c.infer("big", {"x": BIG_X}), lambda: c.model_info("sum"),
                         lambda: c.submit("sum", {"x": ONE})):
                with pytest.raises(RuntimeError, match="belongs to another event loop"):
                    await call()

        asyncio.run(elsewhere())
        assert sum(type(m) is P.InferRequest for m in f.seen) == sent and _pool_in_use(c) == used
        home.call_soon_threadsafe(c.close)
    finally:
        home.call_soon_threadsafe(home.stop)
        thread.join(10)


def _never_grant(grant_asked: threading.Event):
    def answer(msg):
        if type(msg) is P.ShmRegisterRequest:
            grant_asked.set()
            return False
        return True
    return answer


def test_a_call_waiting_for_another_threads_grant_keeps_its_own_timeout(fake):
    # The grant lock was taken with no limit: infer(timeout=0.3) waited out the other
    # thread's whole registration.
    grant_asked = threading.Event()
    f = fake(answer=_never_grant(grant_asked))
    outcome = {}
    with Client(f.address) as c:
        c.model_info("big")
        a = threading.Thread(target=lambda: outcome.update(a=_raised(lambda: c.infer("big", {"x": BIG_X},
                                                                                      timeout=5))))
        a.start()
        assert grant_asked.wait(10)  # A holds the grant lock
        t0 = time.monotonic()
        error = _raised(lambda: c.infer("big", {"x": BIG_X}, timeout=0.3))
        took = time.monotonic() - t0
    a.join(timeout=10)
    assert took < 1.5, took
    assert isinstance(error, DeadlineExceeded) and "setting up the request" in str(error), error
    assert type(outcome["a"]).__name__ == "Cancelled"  # A is answered by close()


def test_an_async_call_waiting_for_another_tasks_grant_keeps_its_own_timeout(fake):
    grant_asked = threading.Event()
    f = fake(answer=_never_grant(grant_asked))

    async def main():
        c = AsyncClient(f.address)
        try:
            await c.model_info("big")
            a = asyncio.ensure_future(c.infer("big", {"x": BIG_X}, timeout=5))
            assert await asyncio.get_running_loop().run_in_executor(None, grant_asked.wait, 10)
            t0 = time.monotonic()
            try:
                await c.infer("big", {"x": BIG_X}, timeout=0.3)
            except Exception as e:
                return time.monotonic() - t0, e, a
        finally:
            c.close()

    took, error, a = asyncio.run(main())
    assert took < 1.5, took
    assert isinstance(error, DeadlineExceeded) and "setting up the request" in str(error), error
    assert type(a.exception()).__name__ == "Cancelled"


@pytest.mark.parametrize("kind", ["Client", "AsyncClient"])
def test_each_grant_step_takes_from_what_the_call_has_left(fake, monkeypatch, kind):
    # Every step of every new segment's grant had the call's whole timeout again: four new
    # segments against a slow dispatcher made infer(timeout=1) take 3.6 s. The dispatcher here
    # is slow on the client's clock: each answer moves it on by 0.3 s.
    from batchyard import client as client_module, client_async, client_codec

    slow_by = [0.0]
    clock = types.SimpleNamespace(monotonic=lambda: time.monotonic() + slow_by[0])
    for module in (client_module, client_async, client_codec):
        monkeypatch.setattr(module, "time", clock)

    def answer(msg):
        if type(msg) is P.ShmRegisterRequest:
            slow_by[0] += 0.3
        return True

    f = fake(answer=answer)
    inputs = {f"x{i}": np.ones((1, 1 << 18), np.float32) for i in range(4)}  # 1 MiB each: a segment each
    if kind == "Client":
        with Client(f.address, pool_bytes=1 << 20) as c:
            c.model_info("sum")
            error = _raised(lambda: c.infer("sum", inputs, timeout=1.0))
    else:
        async def main():
            c = AsyncClient(f.address, pool_bytes=1 << 20)
            try:
                await c.model_info("sum")
                return await c.infer("sum", inputs, timeout=1.0)
            except Exception as e:
                return e
            finally:
                c.close()

        error = asyncio.run(main())
    assert isinstance(error, DeadlineExceeded), error
    assert slow_by[0] <= 1.0 + 0.3  # it gave up once its second was spent, not after all 8 steps (2.4 s)


# ---------------------------------------------------------------- arguments

BAD_WAITS = (math.nan, math.inf, -1.0, "soon")


def test_bad_wait_and_timeout_are_refused_naming_the_argument(run_dir):
    # nan / inf reached the wire's integer conversion (ValueError / OverflowError), and
    # model_info(timeout=0) ran out at once and asked "is it running?".
    with Client(f"ipc://{run_dir}/nobody-home") as c:
        for wait in BAD_WAITS:
            with pytest.raises(InvalidArgument, match="wait must be"):
                c.status(wait=wait, timeout=0.2)
        with pytest.raises(InvalidArgument, match="timeout must be > 0"):
            c.model_info("sum", timeout=0)
        with pytest.raises(InvalidArgument, match="timeout must be > 0"):
            c.status(timeout=math.nan)


@pytest.mark.parametrize("timeout", [True, "2", b"2", np.bool_(True)], ids=["True", "str", "bytes", "np.bool_"])
def test_a_timeout_that_is_not_a_number_is_refused_not_read_as_one(run_dir, timeout):
    """float() read True as 1 s and "2" as 2 s; the wire refuses a bool, the front door a string."""
    with Client(f"ipc://{run_dir}/nobody-home") as c:
        with pytest.raises(InvalidArgument, match="timeout must be a number of seconds"):
            c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=timeout)
        with pytest.raises(InvalidArgument, match="wait must be a number of seconds"):
            c.status(wait=timeout, timeout=0.2)
    # numbers float() reads stay numbers: numpy's, a 0-d array, a Decimal
    numbers = (np.float32(0.5), np.int64(3), np.array(0.5), Decimal("0.5"))
    assert [checked_timeout(t) for t in numbers] == [0.5, 3, 0.5, 0.5]


def test_bad_wait_and_timeout_are_refused_by_the_async_client_too(run_dir):
    async def main():
        c = AsyncClient(f"ipc://{run_dir}/nobody-home")
        try:
            for wait in BAD_WAITS:
                with pytest.raises(InvalidArgument, match="wait must be"):
                    await c.status(wait=wait, timeout=0.2)
            with pytest.raises(InvalidArgument, match="timeout must be > 0"):
                await c.model_info("sum", timeout=0)
        finally:
            c.close()

    asyncio.run(main())



@pytest.mark.parametrize("spelling", ["await c.close()", "c.close()", "async with"])
def test_an_async_client_closes_with_or_without_await_and_as_a_context(fake, spelling):
    # The README gives AsyncClient "the same calls as coroutines", and tritonclient's aio clients
    # are closed with ``await client.close()``: that was a TypeError (close returned None), and an
    # ``async def close`` would have closed nothing for the callers that do not await it.
    from batchyard.errors import Cancelled

    f = fake(answer=lambda msg: type(msg) is not P.InferRequest)  # an inference is never answered

    async def main():
        if spelling == "async with":
            async with AsyncClient(f.address) as c:
                await c.model_info("sum")
                pending = c.submit("sum", {"x": ONE})
        else:
            c = AsyncClient(f.address)
            await c.model_info("sum")
            pending = c.submit("sum", {"x": ONE})
            if spelling == "await c.close()":
                assert await c.close() is None
            else:
                c.close()
        # closed at once, whichever the spelling: the request in flight is settled
        with pytest.raises(Cancelled, match="client closed"):
            await asyncio.wait_for(pending, 5)
        with pytest.raises(Cancelled, match="client closed"):
            await c.infer("sum", {"x": ONE})
        await c.close()  # again: nothing left to do, and no error
        c.close()
        return c

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine ... was never awaited" from the bare call
        c = asyncio.run(main())
        # As tritonclient's aio close, a coroutine asyncio.run takes (it said "a coroutine was expected")
        assert asyncio.run(c.close()) is None


# ---------------------------------------------------------------- what the node refuses, refused here

@contextlib.contextmanager
def _dispatcher_on_tcp(run_dir, **cfg):
    """A real dispatcher (no workers: its requests wait in the queue) serving on a tcp port of
    its own from a thread; yields its address."""
    from batchyard.config import DispatcherConfig
    from batchyard.server import Dispatcher

    loop, ctx = asyncio.new_event_loop(), zmq.Context()
    d = Dispatcher(DispatcherConfig(frontend="tcp://127.0.0.1:*", backend=f"ipc://{run_dir}/be", **cfg),
                   (SUM_MODEL.spec(), BIG_MODEL.spec()), ctx=ctx)
    d.start(loop)
    serving = threading.Thread(target=loop.run_forever, daemon=True)
    serving.start()
    try:
        yield d.frontend.getsockopt(zmq.LAST_ENDPOINT).decode()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        serving.join(timeout=10)
        d.close()
        loop.close()
        ctx.term()


@pytest.mark.parametrize("kind", ["Client", "AsyncClient"])
def test_an_inline_tensor_over_the_nodes_limit_fails_alone_with_the_dispatchers_words(run_dir, kind):
    # On tcp all goes inline: a 1 MiB tensor, past the node's frame limit, made ZeroMQ drop the
    # client's connection, and it and every other request in flight on it failed UNAVAILABLE ("lost
    # the connection ... if the node uses CURVE") instead of INVALID_ARGUMENT for it alone.
    # (The hint said "send large tensors through shared memory", which this client, inline over
    # tcp by default, does not do.)
    refused = ("inline payload 1048576 bytes exceeds max_inline_bytes 65536; this client sends tensors inline "
               "(shared_memory=False, a tcp endpoint's default): raise the node's max_inline_bytes, or send them "
               "through shared memory (an ipc endpoint, or shared_memory=True where the node sets allow_shm_over_tcp)")
    with _dispatcher_on_tcp(run_dir, max_inline_bytes=64 << 10, max_message_bytes=128 << 10) as address:
        if kind == "Client":
            with Client(address) as c:
                others = [c.submit("sum", {"x": ONE}, timeout=0.5) for _ in range(3)]
                error = _raised(lambda: c.infer("big", {"x": BIG_X}, timeout=1))
                outcomes = [_raised(f.result) for f in others]
        else:
            async def main():
                async with AsyncClient(address) as c:
                    others = [c.submit("sum", {"x": ONE}, timeout=0.5) for _ in range(3)]
                    try:
                        await c.infer("big", {"x": BIG_X}, timeout=1)
                    except Exception as e:
                        error = e
                    return error, [e for e in await asyncio.gather(*others, return_exceptions=True)]

            error, outcomes = asyncio.run(main())
    assert isinstance(error, InvalidArgument) and refused in str(error), (error, outcomes)
    # the others waited in the queue (no worker) until the dispatcher answered them at their
    # deadline: UNAVAILABLE, no worker registered for the model (as Triton answers one not ready)
    assert all(isinstance(e, Unavailable) and "no worker serves 'sum'" in str(e) for e in outcomes), outcomes


# ---------------------------------------------------------------- a lost connection, and why

def _model_info_error(kind: str, address: str, calls: int = 1) -> tuple[BaseException, float]:
    """What the last of ``calls`` calls of ``model_info("sum", timeout=3)`` on one client raised,
    and how long they took."""
    t0 = time.monotonic()
    if kind == "Client":
        with Client(address) as c:
            for _ in range(calls):
                error = _raised(lambda: c.model_info("sum", timeout=3))
    else:
        async def main():
            async with AsyncClient(address) as c:
                for _ in range(calls):
                    try:
                        await c.model_info("sum", timeout=3)
                    except Exception as e:
                        error = e
                return error

        error = asyncio.run(main())
    return error, time.monotonic() - t0


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
@pytest.mark.parametrize("kind", ["Client", "AsyncClient"])
def test_a_dispatcher_that_goes_away_fails_the_request_unavailable_at_once_without_a_curve_hint(
        run_dir, kind, transport):
    # AsyncClient never heard of a lost connection (its monitor's FD was never armed): requests in
    # flight waited out their timeout. Client told every lost tcp connection's requests about
    # CURVE keys, a node without CURVE that stopped (or a frame over its limit) included.
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{run_dir}/gone")
    address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    def go_away_at_the_first_message():
        sock.poll(10_000)
        sock.close(linger=0)

    node = threading.Thread(target=go_away_at_the_first_message)
    node.start()
    try:
        error, took = _model_info_error(kind, address)
    finally:
        node.join(timeout=15)
        ctx.term()
    assert isinstance(error, Unavailable) and "lost the connection" in str(error), error
    assert "CURVE" not in str(error)
    assert took < 2, took  # not at its timeout (3 s)


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("kind", ["Client", "AsyncClient"])
def test_a_client_without_keys_at_a_curve_node_is_told_the_handshake_failed_and_about_keys(kind, calls):
    # The handshake's failure was overwritten by the disconnection that follows it: the message
    # said only that the connection was lost, as if the node had died. ZeroMQ does not retry such
    # a handshake: a request sent after its failure came (the second here; under load, CI's
    # first) waited out its timeout, "no reply ... (is it running?)".
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.curve_server = True
    sock.bind("tcp://127.0.0.1:*")
    try:
        error, took = _model_info_error(kind, sock.getsockopt(zmq.LAST_ENDPOINT).decode(), calls)
    finally:
        sock.close(linger=0)
        ctx.term()
    assert isinstance(error, Unavailable) and "handshake with the dispatcher failed" in str(error), error
    assert "if the node uses CURVE: this client needs its keys" in str(error)
    assert took < 2, took


# ---------------------------------------------------------------- asyncio hygiene

def test_a_request_the_dispatcher_refuses_lets_go_of_its_inputs_with_its_answer(fake):
    """The awaited future held the error, whose traceback held the call's frame, which held the
    future: the inputs (a front door's, in its pool) lived on until the cycle collector ran; 200
    requests the dispatcher refused held 24-44 MiB of a front door's pool (an outside review)."""
    import gc
    import weakref

    f = fake()

    async def main():
        async with AsyncClient(f.address) as c:
            x = c.alloc_array(BIG_X.shape, np.float32)  # in the pool, as a front door reads inputs
            x[...] = 1.0
            kept = weakref.ref(x)
            try:
                await c.infer("refused", {"x": x})
            except DeadlineExceeded:
                pass
            del x
            await asyncio.sleep(0)  # (the loop's step that woke this task holds the future until it ends)
            return kept() is None, _pool_in_use(c)

    gc.disable()
    try:
        assert asyncio.run(main()) == (True, 0), "the refused request's inputs outlive its answer"
    finally:
        gc.enable()


def test_a_cancelled_request_leaves_no_timer_behind(fake):
    """Its local timeout stayed armed until it ran out: a Triton client's timeout may be 10^9 s,
    and each request its client cancelled (a gRPC cancel, an HTTP hang-up) kept a timer and its
    entry in a front door for that long (2,000 cancels: 1,921 timers left; an outside review)."""
    f = fake(answer=lambda msg: type(msg) is not P.InferRequest)  # inference held, never answered

    async def main():
        async with AsyncClient(f.address) as c:
            await c.model_info("sum")
            call = asyncio.ensure_future(c.infer("sum", {"x": ONE}, timeout=3600.0))
            await asyncio.sleep(0)  # (the call's first step sends it)
            assert len(c._timers) == 1
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            return len(c._timers), len(c._codec.pending)

    assert asyncio.run(main()) == (0, 0)


def test_a_call_cancelled_as_the_grant_lock_is_handed_to_it_is_cancelled(run_dir):
    """Python 3.11's wait_for, which waited for the lock, swallows a cancellation that comes after
    the lock was handed over and before the task ran again: the cancelled call went on (its
    request sent, its outputs written to the caller's region). An outside review."""
    async def main():
        async with AsyncClient(f"ipc://{run_dir}/nobody") as c:
            await c._grant_lock.acquire()  # another call registers a segment
            went_on = []

            async def call():
                await c._register_segments("sum", set(), time.monotonic() + 10)
                went_on.append(True)

            waiting = asyncio.ensure_future(call())
            for _ in range(3):
                await asyncio.sleep(0)  # (waiting for the lock)
            c._grant_lock.release()  # handed to the waiting call
            waiting.cancel()  # whose caller goes away before it runs again
            with pytest.raises(asyncio.CancelledError):
                await waiting
            return went_on, c._grant_lock.locked()

    assert asyncio.run(main()) == ([], False)


def test_an_async_deadline_passed_before_a_segments_grant_leaves_no_unawaited_coroutine(fake):
    # The grant lock's acquire() coroutine was made before the time left was asked, which raised:
    # "RuntimeWarning: coroutine 'Lock.acquire' was never awaited" on the user's stderr.
    import gc

    f = fake()

    async def main():
        async with AsyncClient(f.address) as c:
            await c.model_info("big")
            try:
                await c.infer("big", {"x": BIG_X}, timeout=1e-6)  # spent copying the tensor into the pool
            except Exception as e:
                return e

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = asyncio.run(main())
        gc.collect()
    assert isinstance(error, DeadlineExceeded) and "setting up the request" in str(error), error
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("kind", ["Client", "AsyncClient"])
def test_a_first_call_whose_timeout_ends_before_its_models_spec_says_so_not_is_it_running(fake, kind):
    """The spec's request, waiting only the call's own timeout, failed in the words of a
    dispatcher that never answers: "no reply ... (is it running?)" about one that does; now the
    call's timeout is named as the likelier cause."""
    f = fake(answer=lambda msg: type(msg) is not P.ModelInfoRequest)  # the spec's reply held back
    x = np.ones((1, 4), np.float32)
    if kind == "Client":
        with Client(f.address) as c:
            error = _raised(lambda: c.infer("sum", {"x": x}, timeout=0.05))
    else:
        async def main():
            async with AsyncClient(f.address) as c:
                try:
                    await c.infer("sum", {"x": x}, timeout=0.05)
                except Exception as e:
                    return e

        error = asyncio.run(main())
    assert isinstance(error, DeadlineExceeded) and "the spec of 'sum' within the call's timeout (0.05 s)" in str(error) \
        and "timeout too short for a first call" in str(error), error


def test_a_request_without_a_timeout_takes_the_nodes_default_timeout(start_node):
    """``[dispatcher] default_timeout_s`` is the deadline of a request that names none
    (docs/protocol.md); the SDK sent its own 30 s instead, and a 0.2 s default had no effect on
    its requests: one a 0.4 s model cannot finish in 0.2 s was served after 0.4 s. (Refused on
    arrival once the node knows the model's time, expired while running before.)"""
    from conftest import sim_worker

    node = start_node([sim_worker(launch_us=400_000.0)], default_timeout_s=0.2)
    x = {"x": np.ones((1, 4), np.float32)}
    with Client(node.address) as c:
        with pytest.raises(DeadlineExceeded):
            c.infer("sum", x)  # the first call: the node's default comes with the model's spec
        with pytest.raises(DeadlineExceeded):
            c.submit("sum", x).result()
        assert c.infer("sum", x, timeout=5)["y"].tolist() == [[4.0, 4.0]]

    async def go():
        async with AsyncClient(node.address) as a:
            with pytest.raises(DeadlineExceeded):
                await a.submit("sum", x)  # sent before the spec came: the node's default all the same
            with pytest.raises(DeadlineExceeded):
                await a.infer("sum", x)

    asyncio.run(go())


def test_a_generation_without_a_timeout_leaves_it_to_the_node():
    """An LLM-only client never asks a model_info, which brings the node's default: its
    generations went out with the SDK's 30 s whatever the node's default_timeout_s. Before the
    default is known they name none (the node's applies); once known, they name it."""
    from batchyard.client_codec import ClientCodec

    codec = ClientCodec("ipc:///nowhere")
    try:
        _, frames, wait = codec.encode_generate("llm", [1, 2], 4, "normal", None)
        assert P.client_message_decoder.decode(frames[0]).timeout_us == 0 and wait == P.MAX_TIMEOUT_S
        codec.node_timeout_s = 120.0  # as a model_info reply says it
        _, frames, wait = codec.encode_generate("llm", [1, 2], 4, "normal", None)
        assert P.client_message_decoder.decode(frames[0]).timeout_us == 120_000_000 and wait == 120.0
        _, frames, wait = codec.encode_generate("llm", [1, 2], 4, "normal", 2.5)
        assert P.client_message_decoder.decode(frames[0]).timeout_us == 2_500_000 and wait == 2.5
    finally:
        codec.close_pool()


def test_a_timeout_of_weeks_is_taken_by_the_sync_client(start_node):
    """Timeouts up to MAX_TIMEOUT_S are valid, but one past ~24.8 days overflowed zmq_poll's
    milliseconds on the I/O thread: UNAVAILABLE "client I/O thread failed: OverflowError", and
    the client closed for good (every later call CANCELLED)."""
    from conftest import sim_worker

    node = start_node([sim_worker()])
    with Client(node.address) as c:
        assert c.status(wait=3e6).registrations >= 1  # (answered at once: nothing to wait for)
        assert c.infer("sum", {"x": np.ones((1, 4), np.float32)}, timeout=P.MAX_TIMEOUT_S)["y"].tolist() == [[4.0, 4.0]]
        assert c.infer("sum", {"x": np.ones((1, 4), np.float32)}, timeout=5)["y"].tolist() == [[4.0, 4.0]]


def test_an_on_tokens_callback_that_raises_a_base_exception_fails_nothing_else(run_dir):
    """on_tokens runs on the I/O thread; only an Exception of it was caught: an
    asyncio.CancelledError (a callback bridging into a cancelled task) ended the I/O thread, and
    every request of every thread failed UNAVAILABLE, the client closed (an outside review)."""
    from batchyard.client_codec import ClientCodec, Pending

    codec = ClientCodec(f"ipc://{run_dir}/nobody")
    got = []

    def on_tokens(tokens):
        raise asyncio.CancelledError()

    codec.pending[7] = Pending("generate", [], {}, got.append, on_tokens)
    codec.on_reply([P.encode(P.GenerateTokens(v=1, id=7, tokens=[1], start=0))])  # (the I/O thread's call)
    codec.on_reply([P.encode(P.GenerateReply(v=1, id=7, status=0, tokens=[1, 2], finish_reason="length"))])
    assert [list(g) for g in got] == [[1, 2]]


def test_a_message_of_another_kind_for_a_waiting_request_ends_it_once_and_fails_nothing_else(run_dir):
    """The request was taken from the pending ones before the reply was read as its kind's: a
    Release (or a reply of another kind) with its id raised AttributeError on the I/O thread, which
    ended the client for every thread, and that request was never settled, its call waiting for
    ever (an outside review). A stray release is not an answer; a reply of another kind fails its
    request INTERNAL."""
    from batchyard.client_codec import ClientCodec, Pending
    from batchyard.errors import InternalError

    codec = ClientCodec(f"ipc://{run_dir}/nobody")
    got = []
    codec.pending[1] = Pending("infer", [], {}, got.append)
    codec.on_reply([P.encode(P.Release(v=1, id=1))])
    assert not got and 1 in codec.pending  # still waiting for its answer (or its timeout)
    codec.on_reply([P.encode(P.ShmReply(v=1, id=1, status=0))])
    assert len(got) == 1 and isinstance(got[0], InternalError) and "a ShmReply to a infer request" in str(got[0])
    codec.pending[2] = Pending("model_info", [], {}, got.append)  # an error comes as an InferReply to any kind
    codec.on_reply([P.error_reply(2, P.Status.UNKNOWN_MODEL, "unknown model")])
    assert "unknown model" in str(got[1]) and not codec.pending


# ---------------------------------------------------------------- the dispatcher away

def test_an_async_client_whose_send_queue_is_full_keeps_its_event_loop_running(fake, run_dir, monkeypatch):
    """The dispatcher away, a send past the socket's high-water mark blocked the event loop until
    one came back: every task and timer stopped, local timeouts included (requests with 2 s
    timeouts settled at 38 s), and a front door's every route with them. Now they wait unsent:
    those that expire meanwhile fail on time and are never sent, the others go when it is back."""
    from batchyard import client_codec

    monkeypatch.setattr(client_codec, "DEALER_HWM", 4)
    started = []

    def start_dispatcher():
        if not started:
            started.append(fake())

    # On the code before (its fixed 100,000 made patchable), the loop stayed blocked in the fifth
    # send until a dispatcher came: this brings one, so that the test fails instead of hanging.
    guard = threading.Timer(3.0, start_dispatcher)
    guard.start()

    async def main():
        async with AsyncClient(f"ipc://{run_dir}/dispatcher") as c:
            t0 = time.monotonic()
            short = [asyncio.create_task(c.model_info("sum", timeout=0.3)) for _ in range(20)]
            lasting = [asyncio.create_task(c.model_info("sum", timeout=30)) for _ in range(20)]
            expired = await asyncio.gather(*short, return_exceptions=True)
            took = time.monotonic() - t0
            start_dispatcher()
            return expired, took, await asyncio.gather(*lasting, return_exceptions=True)

    try:
        expired, took, served = asyncio.run(main())
    finally:
        guard.cancel()
    assert took < 2.5, took
    assert all(isinstance(e, DeadlineExceeded) for e in expired), expired
    assert all(s == SPECS["sum"] for s in served), served
    sent = [m for m in started[0].seen if type(m) is P.ModelInfoRequest]
    assert 20 <= len(sent) <= 24  # the expired ones never left but the 4 the socket had queued


@pytest.mark.parametrize("kind", ["Client", "AsyncClient"])
def test_a_first_call_spends_its_own_timeout_on_its_set_up_not_a_fixed_10_s(fake, kind, monkeypatch):
    """A model's first call fetches its spec, and a new segment's first use its grant, before the
    request goes; both waited at most SETUP_TIMEOUT_S (10 s) whatever the call's timeout:
    submit(timeout=30) raised DeadlineExceeded after 10 s while its dispatcher restarted, where
    the same call a moment later was served. (SETUP_TIMEOUT_S set to nothing here: a call with a
    timeout of its own must not read it.)"""
    from batchyard import client_codec

    monkeypatch.setattr(client_codec, "SETUP_TIMEOUT_S", 0.0)
    f = fake()
    if kind == "Client":
        with Client(f.address) as c:
            got = [c.infer("sum", {"x": ONE}, timeout=30)["y"], c.infer("big", {"x": BIG_X}, timeout=30)["y"]]
    else:
        async def main():
            async with AsyncClient(f.address) as c:
                return [(await c.infer("sum", {"x": ONE}, timeout=30))["y"],
                        (await c.infer("big", {"x": BIG_X}, timeout=30))["y"]]

        got = asyncio.run(main())
    assert got[0].tolist() == ONE.tolist() and got[1].shape == (1, 256, 1024)
    assert [type(m) for m in f.seen].count(P.ShmRegisterRequest) == 2  # the grant's two steps
