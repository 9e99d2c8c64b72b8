"""End to end with real processes: SDK -> dispatcher -> simulated worker -> back."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

from batchyard import protocol as P
from batchyard.client import AsyncClient, Client
from batchyard.errors import Cancelled, DeadlineExceeded, InvalidArgument, Overloaded, UnknownModel
from batchyard.workers.executors import sim_outputs

from conftest import BIG_MODEL, SUM_MODEL, sim_worker

SUM, BIG = SUM_MODEL.spec(), BIG_MODEL.spec()


def expected_sum(x):
    return sim_outputs({"x": x}, SUM)["y"]


def test_many_clients_interleaved_each_get_their_own_answers(start_node):
    node = start_node([sim_worker("sim0"), sim_worker("sim1")])
    errors = []

    def sync_client(k):
        try:
            with node.client() as c:
                rng = np.random.default_rng(k)
                xs = [rng.integers(0, 100, size=(int(rng.integers(1, 4)), 4)).astype(np.float32) for _ in range(60)]
                futs = [c.submit("sum", {"x": x}) for x in xs]  # all in flight at once
                for x, f in zip(xs, futs):
                    np.testing.assert_array_equal(f.result()["y"], expected_sum(x))
        except Exception as e:  # surfaced below; a thread cannot fail the test itself
            errors.append(e)

    async def async_client(k):
        async with AsyncClient(node.address) as c:
            rng = np.random.default_rng(100 + k)
            xs = [rng.integers(0, 100, size=(1, 4)).astype(np.float32) for _ in range(80)]
            results = await asyncio.gather(*(c.infer("sum", {"x": x}, priority=k % 3) for x in xs))
            for x, r in zip(xs, results):
                np.testing.assert_array_equal(r["y"], expected_sum(x))
                assert r.timing.path == "gpu" and r.timing.simulated and r.timing.batch_size >= 1

    threads = [threading.Thread(target=sync_client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()

    async def many():
        await asyncio.gather(*(async_client(k) for k in range(3)))

    asyncio.run(many())
    for t in threads:
        t.join()
    assert not errors, errors


def test_batches_form_under_load(start_node):
    node = start_node([sim_worker("sim0", launch_us=3000.0)])
    with node.client() as c:
        futs = [c.submit("sum", {"x": np.full((1, 4), i, np.float32)}) for i in range(40)]
        sizes = [f.result().timing.batch_size for f in futs]
    assert max(sizes) > 1  # requests that arrived while the worker was busy went together


def test_a_big_endian_array_is_sent_by_value(start_node):
    """The wire carries native (little-endian) bytes under a dtype name; an array read from a
    big-endian file has the same name, so its bytes must be swapped, not sent as they are."""
    node = start_node([sim_worker()])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with node.client() as c:
        np.testing.assert_array_equal(c.infer("sum", {"x": x.astype(">f4")})["y"], expected_sum(x))


def test_large_tensors_go_through_shared_memory_both_ways(start_node):
    node = start_node([sim_worker()])
    with node.client() as c:
        x = np.random.default_rng(0).integers(0, 3, size=(2, 256, 1024)).astype(np.float32)
        r = c.infer("big", {"x": x})  # copied into the pool by the SDK (1 MiB per item)
        np.testing.assert_array_equal(r["y"], sim_outputs({"x": x}, BIG)["y"])
        inplace = c.alloc_array((1, 256, 1024), np.float32)  # filled in place: no copy at all
        inplace[...] = 2.0
        r2 = c.infer("big", {"x": inplace})
        np.testing.assert_array_equal(r2["y"], sim_outputs({"x": inplace}, BIG)["y"])
        # The output array is a view of the client's shared memory, not a copy off the socket.
        seg_names = set(c.pool.segment_names())
        assert r2["y"].base is not None and seg_names
        del r, r2, inplace


def test_large_tensors_go_inline_to_a_tcp_endpoint(start_node):
    """A tcp endpoint refuses shared-memory references (a segment names a file on the
    dispatcher's host): every tensor of 64 KiB or more, alloc_array's too, was refused
    PERMISSION_DENIED, though the docs said the SDK sends everything inline over tcp."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = start_node([sim_worker()], frontend=f"tcp://127.0.0.1:{port}")
    with node.client() as c:
        x = np.random.default_rng(0).integers(0, 3, size=(2, 256, 1024)).astype(np.float32)
        np.testing.assert_array_equal(c.infer("big", {"x": x})["y"], sim_outputs({"x": x}, BIG)["y"])
        a = c.alloc_array((1, 256, 1024), np.float32)
        a[...] = 2.0
        np.testing.assert_array_equal(c.infer("big", {"x": a})["y"], sim_outputs({"x": a}, BIG)["y"])
        assert not c.pool.segment_names()  # no shared memory made


def test_unknown_model_and_bad_shapes_raise_typed_errors(start_node):
    node = start_node([sim_worker()])
    with node.client() as c:
        with pytest.raises(UnknownModel, match="unknown model 'nope'; this dispatcher serves"):
            c.infer("nope", {"x": np.zeros((1, 4), np.float32)})
        with pytest.raises(InvalidArgument, match="dtype 'float64', model expects 'float32'"):
            c.infer("sum", {"x": np.zeros((1, 4), np.float64)})
        with pytest.raises(InvalidArgument, match=r"shape \[1, 3\], model expects \[n, 4\]"):
            c.infer("sum", {"x": np.zeros((1, 3), np.float32)})
        for timeout in (0, -1.0, 2e13):  # 2e13 s: past the wire's uint64 of microseconds
            with pytest.raises(InvalidArgument, match="timeout must be > 0 and at most 1e\\+09 seconds"):
                c.infer("sum", {"x": np.ones((1, 4), np.float32)}, timeout=timeout)
        np.testing.assert_array_equal(c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"], [[4.0, 4.0]])


def test_an_array_no_tensor_type_fits_is_refused_and_the_client_serves_on(start_node):
    """A datetime64 array has no buffer to send: it killed the client's I/O thread, and every
    later call of every thread sharing the client failed."""
    node = start_node([sim_worker()])
    with node.client() as c:
        for x in (np.zeros((1, 4), "datetime64[s]"), np.zeros((1, 4), object), np.ones((1, 4), np.complex64),
                  np.array([["a"] * 4])):
            with pytest.raises(InvalidArgument, match=re.escape(f"dtype '{x.dtype.name}' is not a tensor type")):
                c.infer("sum", {"x": x})
        for inputs, text in ((np.ones((1, 4), np.float32), "inputs must be a dict"),  # an AttributeError before
                             ({"x": [[1.0, 2.0], [3.0]]}, "input 'x' is not an array")):  # a ValueError before
            with pytest.raises(InvalidArgument, match=text):
                c.infer("sum", inputs)
        np.testing.assert_array_equal(c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"], [[4.0, 4.0]])


def test_a_frame_that_cannot_be_sent_fails_its_request_alone(start_node):
    """Whatever slips past the encoder's checks, the I/O thread that every thread of the client
    shares fails that one request and goes on."""
    node = start_node([sim_worker()])
    with node.client() as c:
        rid, frames, *_ = c._codec.encode_infer("sum", {"x": np.ones((1, 4), np.float32)}, "normal", None)
        with pytest.raises(InvalidArgument, match="a tensor of this request cannot be sent"):
            c._send("infer", rid, [frames[0], object()], [], {}, 5.0).result()
        np.testing.assert_array_equal(c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"], [[4.0, 4.0]])

    async def go():  # AsyncClient too: the error escaped its send, and the requests behind it waited
        async with AsyncClient(node.address) as c:
            rid, frames, *_ = c._codec.encode_infer("sum", {"x": np.ones((1, 4), np.float32)}, "normal", None)
            with pytest.raises(InvalidArgument, match="a tensor of this request cannot be sent"):
                await c._send("infer", rid, [frames[0], object()], [], {}, 5.0)
            return (await c.infer("sum", {"x": np.ones((1, 4), np.float32)}, timeout=5))["y"]

    np.testing.assert_array_equal(asyncio.run(go()), [[4.0, 4.0]])


def raw_roundtrip(address, frames, timeout_ms=5000):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    try:
        s.send_multipart(frames)
        assert s.poll(timeout_ms), "no reply from the dispatcher"
        reply = s.recv_multipart()
    finally:
        s.close()
    return P.reply_decoder.decode(reply[0])


def header(**fields):
    base = {"type": "infer", "v": 1, "id": 9, "model": "sum",
            "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4], "frame": 0}]}
    base.update(fields)
    return msgspec.msgpack.encode(base)


X1 = np.ones((1, 4), np.float32).tobytes()


def non_utf8_header(**fields) -> bytes:
    """A header whose strings are MessagePack str but not valid UTF-8 (old-style raw)."""
    import msgpack

    base = {"type": "infer", "v": 1, "id": 11, "model": "sum",
            "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4], "frame": 0}]}
    base.update(fields)
    return msgpack.packb(base, use_bin_type=False)


@pytest.mark.parametrize("frames,status,needle", [
    ([b"\x00garbage\xff"], P.Status.INVALID_ARGUMENT, "malformed header"),
    ([b"\xc1\xc1"], P.Status.INVALID_ARGUMENT, "malformed header"),
    ([msgspec.msgpack.encode({"type": "infer", "v": 1, "id": 9})], P.Status.INVALID_ARGUMENT, "missing required field"),
    ([header(v=99), X1], P.Status.INVALID_ARGUMENT, "protocol version 99 not supported"),
    ([non_utf8_header(model=b"s\xffm"), X1], P.Status.INVALID_ARGUMENT, "malformed header"),
    ([non_utf8_header(inputs=[{"name": b"\xc3", "dtype": "float32", "shape": [1, 4], "frame": 0}]), X1],
     P.Status.INVALID_ARGUMENT, "malformed header"),
    ([header(model="ghost"), X1], P.Status.UNKNOWN_MODEL, "unknown model 'ghost'"),
    ([header(inputs=[{"name": "x", "dtype": "int32", "shape": [1, 4], "frame": 0}]), X1],
     P.Status.INVALID_ARGUMENT, "dtype 'int32'"),
    ([header(inputs=[{"name": "x", "dtype": "float32", "shape": [2, 4], "frame": 0}]), X1],
     P.Status.INVALID_ARGUMENT, "frame has 16 bytes, shape and dtype need 32"),
    ([header(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4],
                      "shm": {"segment": "batchyard_1_missing", "offset": 0, "nbytes": 16}}])],
     P.Status.PERMISSION_DENIED, "segment 'batchyard_1_missing' is not registered on this connection"),
    ([header(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4],
                      "shm": {"segment": "../../etc/passwd", "offset": 0, "nbytes": 16}}])],
     P.Status.INVALID_ARGUMENT, "segment"),
])
def test_bad_input_gets_explicit_status_and_others_keep_being_served(start_node, frames, status, needle):
    node = start_node([sim_worker()])
    with node.client() as good:
        before = good.submit("sum", {"x": np.ones((1, 4), np.float32)})
        reply = raw_roundtrip(node.address, frames)
        assert reply.status == status, reply
        assert needle in reply.message
        assert reply.id == P.salvage_id(frames[0])  # matched to the request whenever possible
        after = good.infer("sum", {"x": np.full((1, 4), 2, np.float32)})
        np.testing.assert_array_equal(after["y"], [[8.0, 8.0]])
        assert before.result()["y"].tolist() == [[4.0, 4.0]]


def test_a_flood_of_undecodable_headers_does_not_delay_the_others(start_node):
    """Each bad header is answered at once, in the same pass over the socket as the good
    requests behind it: none of them waits for a later wake-up."""
    node = start_node([sim_worker()])
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as s, node.client() as good:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(node.address)
        bad = [non_utf8_header(id=i, model=b"\xff") for i in range(200)]
        for h in bad:
            s.send_multipart([h, X1])
        fut = good.submit("sum", {"x": np.ones((1, 4), np.float32)})
        ids = set()
        for _ in bad:
            assert s.poll(10_000), "an undecodable header got no reply"
            reply = P.reply_decoder.decode(s.recv_multipart()[0])
            assert reply.status == P.Status.INVALID_ARGUMENT
            ids.add(reply.id)
        assert ids == set(range(200))  # each matched to its request
        assert fut.result(timeout=10)["y"].tolist() == [[4.0, 4.0]]


def test_a_bool_request_id_is_not_echoed_as_a_bool(start_node):
    node = start_node([sim_worker()])
    reply = raw_roundtrip(node.address, [header(id=True), X1])
    assert reply.status == P.Status.INVALID_ARGUMENT
    assert reply.id is None


def shm_register(sock, segment: str, write_header) -> P.ShmReply:
    """The two-step registration of docs/protocol.md on a raw socket; ``write_header`` writes
    the challenge into the segment (or does not, to play a client that cannot)."""
    sock.send_multipart([msgspec.msgpack.encode({"type": "shm_register", "v": 1, "id": 500, "segment": segment})])
    assert sock.poll(5000)
    first = P.reply_decoder.decode(sock.recv_multipart()[0])
    if first.status != P.Status.OK:
        return first
    write_header(segment, first.challenge)
    sock.send_multipart([msgspec.msgpack.encode({"type": "shm_register", "v": 1, "id": 501, "segment": segment,
                                                 "proved": True})])
    assert sock.poll(5000)
    return P.reply_decoder.decode(sock.recv_multipart()[0])


def test_shm_reference_out_of_bounds_is_rejected_by_the_worker(start_node):
    node = start_node([sim_worker()])
    with node.client() as c, zmq.Context.instance().socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(node.address)
        region = c.pool.alloc(64)
        seg = region.segment
        assert shm_register(s, seg, c.pool.write_header).status == P.Status.OK  # this process can write it
        size = c.pool.segment_bytes
        s.send_multipart([header(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4],
                                          "shm": {"segment": seg, "offset": size - 8, "nbytes": 16}}])])
        assert s.poll(5000)
        reply = P.reply_decoder.decode(s.recv_multipart()[0])
        assert reply.status == P.Status.INVALID_ARGUMENT
        assert "outside segment" in reply.message
        c.pool.free(region)
        assert c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[4.0, 4.0]]


def test_a_client_cannot_use_another_clients_shared_memory(start_node):
    """Another connection naming a client's segment, for input or output, is refused; so is
    one that asks for a grant but cannot write the segment to prove it."""
    node = start_node([sim_worker()])
    with node.client() as victim:
        x = victim.alloc_array((1, 4), np.float32)
        x[...] = 7
        assert victim.infer("sum", {"x": x})["y"].tolist() == [[28.0, 28.0]]  # registered and used
        (seg,) = victim.pool.segment_names()
        before = bytes(victim.pool.view(victim._codec._array_regions[x.__array_interface__["data"][0]]))
        ref = {"segment": seg, "offset": 64, "nbytes": 16}
        for frames in ([header(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4], "shm": ref}])],
                       [header(outputs={"y": {"segment": seg, "offset": 64, "nbytes": 8}}), X1]):
            reply = raw_roundtrip(node.address, frames)
            assert reply.status == P.Status.PERMISSION_DENIED, reply
            assert "not registered on this connection" in reply.message
        with zmq.Context.instance().socket(zmq.DEALER) as thief:
            thief.setsockopt(zmq.LINGER, 0)
            thief.connect(node.address)
            denied = shm_register(thief, seg, lambda segment, challenge: None)  # cannot write it
            assert denied.status == P.Status.PERMISSION_DENIED and "challenge" in denied.message
        assert bytes(victim.pool.view(victim._codec._array_regions[x.__array_interface__["data"][0]])) == before


def test_oversized_inline_payload_is_refused_with_a_hint(start_node):
    node = start_node([sim_worker()], max_inline_bytes=1024)
    with node.client(shm_threshold=1 << 30) as c:  # force inline
        # The hint names what keeps these tensors inline here: the client's threshold (it said
        # "send large tensors through shared memory", which this client believed it did).
        with pytest.raises(InvalidArgument, match=r"exceeds max_inline_bytes 1024; this client sends tensors under "
                                                  r"its shm_threshold \(1073741824 bytes\) inline: lower shm_threshold"):
            c.infer("big", {"x": np.zeros((1, 256, 1024), np.float32)})
    with node.client() as c:  # the default SDK threshold sends it by shared memory: accepted
        assert c.infer("big", {"x": np.zeros((1, 256, 1024), np.float32)})["y"].shape == (1, 256, 1024)


def test_expired_deadline_and_full_queue_get_their_status(start_node):
    node = start_node([sim_worker("slow", launch_us=300_000.0)], max_queue=2)
    with node.client() as c:
        busy = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=10)
        c.status()  # answered after the dispatcher decided on `busy`: it is running now
        q1 = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=0.05)
        q2 = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=10)
        over = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=10)
        # Failed in the queue: when its deadline passes, or as soon as no path can make it.
        with pytest.raises(DeadlineExceeded, match="deadline passed in queue|cannot finish before its deadline"):
            q1.result()
        with pytest.raises(Overloaded, match="queue for 'sum' is full"):
            over.result()
        assert busy.result()["y"].tolist() == [[4.0, 4.0]]
        assert q2.result()["y"].tolist() == [[4.0, 4.0]]


def test_a_header_nested_a_thousand_deep_is_invalid_argument_with_its_id(start_node):
    """An unknown field nested 1,000 deep raised RecursionError in the decoder: answered INTERNAL,
    with a traceback in the log, instead of the sender's error."""
    node = start_node([sim_worker()])
    raw = header(zz=0)
    assert raw.endswith(b"\xa2zz\x00")
    raw = raw[:-1] + b"\x91" * 1000 + b"\x90"  # zz = [[[...]]]
    reply = raw_roundtrip(node.address, [raw, X1])
    assert reply.status == P.Status.INVALID_ARGUMENT and reply.id == 9, reply


def test_client_without_dispatcher_fails_fast_with_clear_error(run_dir):
    """Within about the call's timeout: fetching the model's spec first waited a fixed 10 s."""
    with Client(f"ipc://{run_dir}/nobody-home") as c:
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="no reply from the dispatcher"):
            c.infer("sum", {"x": np.ones((1, 4), np.float32)}, timeout=0.2)
        assert time.monotonic() - t0 < 5.0

    async def go():
        async with AsyncClient(f"ipc://{run_dir}/nobody-home") as c:
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="no reply from the dispatcher"):
                await c.infer("sum", {"x": np.ones((1, 4), np.float32)}, timeout=0.2)
            assert time.monotonic() - t0 < 5.0

    asyncio.run(go())


def test_a_malformed_address_raises_at_once_and_the_cli_says_so_in_one_line(run_dir):
    """Client("foo") hung for good: the connect failed after the socket was made, and closing
    the context waited for that socket."""
    with pytest.raises(InvalidArgument, match="cannot connect to the dispatcher at 'foo'"):
        Client("foo")

    async def go():
        with pytest.raises(InvalidArgument, match="cannot connect to the dispatcher at 'tcp://'"):
            AsyncClient("tcp://")

    asyncio.run(go())
    for address, code, text in (("foo", 64, "cannot connect to the dispatcher at 'foo'"),
                                # ZeroMQ wraps it (31694 + 65536): status answered from port 31694
                                ("tcp://127.0.0.1:97230", 64, "'tcp://127.0.0.1:97230': not tcp://HOST:PORT with a port of 1-65535"),
                                (f"ipc://{run_dir}/nobody-home", 69, "no reply from the dispatcher")):
        r = subprocess.run([sys.executable, "-m", "batchyard.cli", "status", "--address", address],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == code and text in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_dispatcher_shutdown_answers_queued_requests(start_node):
    """A request queued when SIGTERM comes is served while the drain lasts, as Triton serves the
    requests it took before its exit (it failed UNAVAILABLE at once)."""
    node = start_node([sim_worker("slow", launch_us=500_000.0)])
    with node.client() as c:
        running = c.submit("sum", {"x": np.ones((1, 4), np.float32)})
        c.status()  # answered after `running` was dispatched to the (only) worker
        queued = c.submit("sum", {"x": np.ones((1, 4), np.float32)})
        c.status()  # `queued` has reached the dispatcher and waits behind it
        os.kill(c.status().dispatcher_pid, signal.SIGTERM)
        assert queued.result()["y"].tolist() == [[4.0, 4.0]]  # served by the drain
        assert running.result()["y"].tolist() == [[4.0, 4.0]]  # drained, not dropped


def test_dispatcher_shutdown_answers_a_pending_status_long_poll(start_node):
    """A long poll still waiting when the dispatcher shuts down gets its one reply, the status as
    of then: it used to get none, and its caller waited out its whole timeout."""
    node = start_node([sim_worker("g")])

    async def go():
        async with AsyncClient(node.address) as c:
            poll = asyncio.ensure_future(c.status(min_registrations=10**6, wait=20, timeout=5))
            st = await c.status()  # answered after the long poll above was taken in
            assert not poll.done()
            os.kill(st.dispatcher_pid, signal.SIGTERM)
            reply = await poll
            assert reply.dispatcher_pid == st.dispatcher_pid and reply.registrations < 10**6

    asyncio.run(go())


def test_queued_request_can_be_cancelled(start_node):
    """The cancelled request raises Cancelled, also a concurrent.futures.CancelledError, as the
    Future it is promises (it was a BatchyardError only); the running one completes."""
    import concurrent.futures

    node = start_node([sim_worker("slow", launch_us=300_000.0)])
    with node.client() as c:
        running = c.submit("sum", {"x": np.ones((1, 4), np.float32)})
        c.status()  # `running` is on the worker now
        queued = c.submit("sum", {"x": np.ones((1, 4), np.float32)})
        assert queued.cancel()  # asked: the dispatcher settles whether it is still queued
        with pytest.raises(concurrent.futures.CancelledError, match="cancelled by the client while queued") as e:
            queued.result()
        assert isinstance(e.value, Cancelled)
        assert running.result()["y"].tolist() == [[4.0, 4.0]]  # running work is not affected


def _wait_inflight(c) -> None:
    """Until the node's worker runs a batch (each look is a round trip to the dispatcher)."""
    deadline = time.monotonic() + 30
    while not c.status().workers[0].inflight:
        assert time.monotonic() < deadline, "the batch never started"


def test_a_malformed_cancel_is_answered_under_no_id_and_its_request_gets_one_result(start_node):
    """A cancel's id names the request it withdraws: a cancel of another protocol version, or one
    that did not decode, was answered INVALID_ARGUMENT under that id, and the request, still
    queued, got its real result after it: two results for one id."""
    node = start_node([sim_worker("slow", launch_us=300_000.0)])
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as s, node.client() as c:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(node.address)
        s.send_multipart([header(id=9), X1])
        _wait_inflight(c)  # 9 runs; 10 is queued behind it
        s.send_multipart([header(id=10), X1])
        s.send_multipart([msgspec.msgpack.encode({"type": "cancel", "v": 2, "id": 10})])
        s.send_multipart([msgspec.msgpack.encode({"type": "cancel", "v": "1", "id": 10})])
        replies = []
        while len(replies) < 4:
            assert s.poll(30_000), f"replies so far: {replies}"
            replies.append(P.reply_decoder.decode(s.recv_multipart()[0]))
        assert not s.poll(500)  # nothing more comes (a release only where one was answered in flight)
    by_id = {}
    for r in replies:
        by_id.setdefault(r.id, []).append(r)
    assert [r.status for r in by_id[10]] == [P.Status.OK] and [r.status for r in by_id[9]] == [P.Status.OK]
    assert [r.status for r in by_id[None]] == [P.Status.INVALID_ARGUMENT] * 2


def test_async_cancel_withdraws_the_queued_request(start_node):
    node = start_node([sim_worker("slow", launch_us=300_000.0)])

    async def go():
        async with AsyncClient(node.address) as c:
            # With the spec known, each task sends its request at its first step, so yielding
            # once fixes the order on the wire. Without it a task that fetched the spec could be
            # overtaken by one created later (seen in CI: `second` ran, `first` was the queued one).
            await c.model_info("sum")
            first = c.submit("sum", {"x": np.ones((1, 4), np.float32)})
            await asyncio.sleep(0)
            st = await c.status()
            assert (st.queued, st.workers[0].inflight) == (0, 1)  # `first` is on the worker
            second = c.submit("sum", {"x": np.ones((1, 4), np.float32)})
            await asyncio.sleep(0)
            assert (await c.status()).queued == 1  # `second` waits behind it
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            st = await c.status()
            assert st.queued == 0  # the dispatcher dropped it
            assert (await first)["y"].tolist() == [[4.0, 4.0]]

    asyncio.run(go())


def test_a_reply_waiting_when_a_cancellation_is_sent_is_still_read(run_dir):
    """The async client learns of replies from its socket's edge-triggered FD, and any send may
    consume that edge (libzmq handles its pending commands then), so every send must look for
    waiting replies itself. A cancellation's send did not: a reply that had arrived just before
    it sat unread while the client had nothing else to send (seen on a front door whose HTTP
    client hung up: another client's request hung until its local timeout, about 1 run in 6 of
    tests/test_kserve.py under load). Here a dispatcher played by a ROUTER socket sets the order,
    and the FD's edge is taken away outright: only the cancellation's own look can read the reply."""
    spec = P.ModelSpec(name="sum", max_batch=16, inputs=[P.TensorSpec("x", "float32", [4])],
                       outputs=[P.TensorSpec("y", "float32", [2])])
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake.bind(f"ipc://{run_dir}/fake")

    def received() -> tuple[bytes, object]:
        assert fake.poll(10_000)
        frames = fake.recv_multipart()
        return frames[0], P.client_message_decoder.decode(frames[1])

    async def go():
        async with AsyncClient(f"ipc://{run_dir}/fake", ctx=ctx) as c:
            c._codec.specs["sum"] = spec  # no model-info round trip before the infer
            info = asyncio.ensure_future(c.model_info("other"))
            doomed = asyncio.ensure_future(c.infer("sum", {"x": np.ones((1, 4), np.float32)}))
            await asyncio.sleep(0)  # both sent
            peer, first = received()
            _, second = received()
            assert type(first) is P.ModelInfoRequest and type(second) is P.InferRequest
            c.loop.remove_reader(c.sock.getsockopt(zmq.FD))  # the edge is gone, as a send can take it
            fake.send_multipart([peer, P.encode(P.ModelInfoReply(v=P.PROTOCOL_VERSION, id=first.id,
                                                                  status=P.Status.OK, spec=spec))])
            while not c.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # the reply is in the client's socket
                pass
            doomed.cancel()
            with pytest.raises(asyncio.CancelledError):
                await doomed
            assert type(received()[1]) is P.CancelRequest
            assert (await asyncio.wait_for(info, 5.0)).name == "sum"

    try:
        asyncio.run(go())
    finally:
        fake.close()
        ctx.term()


def test_status_shows_learned_curves_and_arrival_rate(start_node):
    node = start_node([sim_worker("g", launch_us=2000.0, per_item_us=500.0)])
    with node.client() as c:
        for n in (1, 4, 8, 1, 4, 8, 2, 6, 3):
            c.infer("sum", {"x": np.ones((n, 4), np.float32)})
        st = c.status()
    curve = st.curves["sum/gpu"]
    assert st.policy == "mcb" and curve["samples"] >= 9
    # Learned online from the batches (the prior is 10 us an item). The simulated worker sleeps
    # 2 ms + 500 us an item, and on a loaded machine sleeps overrun, the small batches' as much as
    # the large: the fit's slope is a difference of noisy times (748 us an item was learnt with
    # both cores busy, 274 in one CI run, where 400-1500 was asserted). What a batch was measured
    # to take is never less than its sleep.
    assert curve["knots_us"]["1"] >= 2500 and curve["knots_us"]["8"] >= 6000
    assert st.arrival_rate["sum"] > 0 and sum(st.decisions.values()) >= 9
    late = st.decision_lateness["arrival"]  # one sample per step that read a request
    assert late["n"] >= 9 and 0 <= late["p50_us"] <= late["p99_us"] <= late["max_us"]
    assert type(late["n"]) is int  # a count (it read 9.0)
    assert not [k for k in st.decisions if k.startswith("llm_")]  # no LLM model: no LLM routes (they read 0)
    out = subprocess.run([sys.executable, "-m", "batchyard.cli", "status", "--address", node.address],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and '"sum/gpu"' in out.stdout


def test_memory_of_a_request_answered_while_its_batch_runs_is_not_reused_until_released(start_node):
    """Its deadline passes while the worker runs it: the client gets DEADLINE_EXCEEDED at once,
    but the worker still writes the output region afterwards; that region must not be handed
    out again before the dispatcher's `release`."""
    # The batch outlives its request's deadline by 1 s: the worker is not hung until 5 s after it.
    node = start_node([sim_worker("slow", launch_us=2_000_000.0)], worker_dead_after_s=5.0)
    with node.client() as c:
        x = np.full((1, 256, 1024), 111, np.float32)
        # The timeout must outlast the call's set-up (the model's spec, the grant of the input
        # segment: more than 0.1 s on a loaded machine) and end inside the batch's 2 s.
        with pytest.raises(DeadlineExceeded, match="while its batch was running"):
            c.infer("big", {"x": x}, timeout=1.0)
        fresh = [c.alloc_array((1, 256, 1024), np.float32) for _ in range(3)]
        for a in fresh:
            a[...] = -1
        deadline = time.monotonic() + 10
        while c.status().workers[0].inflight and time.monotonic() < deadline:  # until the batch has ended
            c.status(wait=0.02, min_registrations=10**6)
        assert all((a == -1).all() for a in fresh), "the worker wrote into memory handed out again"
        # The release came before that status reply (same connection, in order): all is free now.
        assert not c._codec.late, "no release for the answered request's regions"


def test_a_brief_status_has_what_readiness_needs_and_nothing_costly(start_node):
    node = start_node([sim_worker("g")])
    with node.client() as c:
        c.infer("sum", {"x": np.ones((2, 4), np.float32)})
        full, brief = c.status(), c.status(brief=True)
    assert [w.name for w in brief.workers] == [w.name for w in full.workers] == ["g"]
    assert brief.models == full.models and brief.registrations == full.registrations >= 1
    assert full.curves and full.decision_lateness and full.decisions
    assert not (brief.curves or brief.decision_lateness or brief.decisions or brief.arrival_rate)


# ---------------------------------------------------------------- the SDK's pool, and what it lends
def test_a_slice_kept_of_a_shared_memory_output_is_not_overwritten_by_the_next_request(start_node):
    """The region went back to the pool when the array infer() returned was collected, though
    a slice of it (whose base is the buffer's own array, not that one) was still held: the next
    request's output was written into the caller's slice."""
    import gc

    node = start_node([sim_worker()])
    with node.client() as c:
        x = np.zeros((1, 256, 1024), np.float32)
        x[0, 0, :3] = 1
        first = c.infer("big", {"x": x})["y"][0]  # only a slice is kept
        want = first.copy()
        gc.collect()
        x[0, 0, :7] = 1
        second = c.infer("big", {"x": x})["y"]
        assert not np.array_equal(second[0], want)  # the two outputs differ...
        np.testing.assert_array_equal(first, want)  # ...and the slice still holds the first


def test_an_alloc_array_input_dropped_while_its_request_runs_is_not_lent_again(start_node):
    """The caller's array was its only reference: collected, its region went back to the pool
    while the request was queued, the next alloc_array got it, and the worker read that one's
    data as this request's input."""
    import gc

    node = start_node([sim_worker(launch_us=300_000.0)])
    with node.client() as c:
        c.model_info("sum")

        def ones():
            a = c.alloc_array((1, 4), "float32")
            a[...] = 1.0
            return a

        busy = c.submit("sum", {"x": np.zeros((1, 4), np.float32)})  # keeps the one worker busy
        dropped = c.submit("sum", {"x": ones()})
        gc.collect()
        other = c.alloc_array((1, 4), "float32")
        other[...] = 100.0
        later = c.submit("sum", {"x": other})
        assert busy.result(30)["y"].tolist() == [[0.0, 0.0]]
        assert dropped.result(30)["y"].tolist() == [[4.0, 4.0]]
        assert later.result(30)["y"].tolist() == [[400.0, 400.0]]


def test_a_request_refused_by_the_sdk_gives_back_the_memory_it_took(start_node):
    """A 16 MiB input copied into the pool, then a second input of no tensor type: refused, and
    its region was never freed (four refused calls filled the 64 MiB segment, and each one after
    grew the pool by another)."""
    node = start_node([sim_worker()])
    with node.client() as c:
        c.infer("sum", {"x": np.ones((1, 4), np.float32)})
        big = np.ones(4 << 20, np.float32)
        for _ in range(2):  # the first makes the pool's segment
            with pytest.raises(InvalidArgument, match="not a tensor type"):
                c.infer("sum", {"a": big, "b": np.array([object()])})
        segments = set(c.pool.segment_names())
        for _ in range(5):
            with pytest.raises(InvalidArgument, match="not a tensor type"):
                c.infer("sum", {"a": big, "b": np.array([object()])})
        assert set(c.pool.segment_names()) == segments


def test_after_close_every_call_raises_the_sdks_cancelled(start_node):
    """alloc_array and AsyncClient.infer raised the pool's internal ShmError ("pool is closed")."""
    node = start_node([sim_worker()])
    c = node.client()
    c.infer("big", {"x": np.ones((1, 256, 1024), np.float32)})  # the pool exists
    c.close()
    with pytest.raises(Cancelled, match="client closed"):
        c.alloc_array((4,), "float32")

    async def run():
        a = AsyncClient(node.address)
        await a.infer("big", {"x": np.ones((1, 256, 1024), np.float32)})
        a.close()
        with pytest.raises(Cancelled, match="client closed"):
            await a.infer("big", {"x": np.ones((1, 256, 1024), np.float32)})

    asyncio.run(run())


def test_a_timeout_under_a_microsecond_is_not_the_nodes_default():
    """It went on the wire as 0 us, which the dispatcher reads as its default (30 s)."""
    from batchyard.client_codec import timeout_us

    assert timeout_us(1e-7) == 1 and timeout_us(0.001) == 1000 and timeout_us(2.5) == 2_500_000


def _deleted_segments_held(pid: int) -> list[str]:
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/") and target.endswith(" (deleted)"):
            held.append(target)
    return held


def test_a_worker_lets_go_of_the_memory_of_clients_that_closed(start_node):
    # It held each closed client's segment open, its 64 MiB allocated, until 32 newer ones
    # pushed it out: six clients left 384 MiB of /dev/shm behind a worker.
    node = start_node([sim_worker("sim0")])
    big = np.ones((1, 256, 1024), np.float32)  # through shared memory
    for _ in range(3):
        with node.client() as c:
            assert c.infer("big", {"x": big}, timeout=30)["y"].shape == (1, 256, 1024)
            pid = next(w.pid for w in c.status().workers if w.name == "sim0")
    with node.client() as c:  # a new client's first segment: the worker lets go of those gone
        assert c.infer("big", {"x": big}, timeout=30)["y"].shape == (1, 256, 1024)
        assert _deleted_segments_held(pid) == []
