"""Property-based fuzzing of the codec and of a live dispatcher: whatever a client sends, every
message that carries an id gets exactly one reply, and the dispatcher keeps serving."""

from __future__ import annotations

import shutil
import subprocess
import tempfile

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from batchyard import protocol as P
from batchyard.client import Client

from conftest import SUM_MODEL, Node, sim_worker, spawn_up

X1 = np.ones((1, 4), np.float32).tobytes()
VALID = {"type": "infer", "v": 1, "id": 0, "model": "sum",
         "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4], "frame": 0}]}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=8), st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                      max_leaves=12)


@st.composite
def headers(draw):
    """A header as bytes: a valid infer with one field replaced or removed, a random map, raw
    bytes, or strings that are not UTF-8."""
    kind = draw(st.sampled_from(["mutate", "mutate", "map", "bytes", "non-utf8", "other-type"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "map":
        return msgpack.packb(draw(st.dictionaries(st.text(max_size=8), values, max_size=6)))
    h = dict(VALID)
    if kind == "other-type":
        h = {"type": draw(st.sampled_from(["status", "model_info", "bogus", "result"])), "v": 1, "id": 0}
    key = draw(st.sampled_from(sorted(h) + ["extra"]))
    if draw(st.booleans()):
        h.pop(key, None)
    else:
        h[key] = draw(values)
    if kind == "non-utf8":
        h["model"] = b"s\xffm"
        return msgpack.packb(h, use_bin_type=False)
    return msgpack.packb(h)


@given(headers())
@settings(max_examples=500, deadline=None)
def test_the_codec_either_decodes_or_raises_a_decode_error(raw):
    try:
        P.client_message_decoder.decode(raw)
    except P.DecodeError:
        pass
    rid = P.salvage_id(raw)
    assert rid is None or (type(rid) is int and 0 <= rid < 2**63)


@pytest.fixture(scope="module")
def node():
    run_dir = tempfile.mkdtemp(prefix="by-fz-", dir="/tmp")
    cfg, up = spawn_up(run_dir, [sim_worker(models=("sum",), launch_us=50.0, per_item_us=5.0)], [SUM_MODEL],
                       {"heartbeat_interval_s": 0.1, "worker_dead_after_s": 2.0}, stdout=subprocess.DEVNULL)
    n = Node(cfg, up, run_dir)
    try:
        with Client(n.address) as c:
            c.status(min_registrations=1, wait=120)
        yield n
    finally:
        n.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def _with_id(raw: bytes, rid: int) -> tuple[bytes, bool]:
    """Put ``rid`` into a header that is a map (so its reply can be matched); says whether it
    carries an id the dispatcher can read."""
    try:
        obj = msgpack.unpackb(raw, raw=True, strict_map_key=False)
    except Exception:
        return raw, False
    if not isinstance(obj, dict):
        return raw, False
    if obj.get(b"type") == b"cancel":
        obj[b"type"] = b"status"  # a cancel has no reply of its own; keep the count exact
    obj[b"id"] = rid
    return msgpack.packb(obj, use_bin_type=False), True


@given(st.lists(st.tuples(headers(), st.lists(st.binary(max_size=32), max_size=2)), min_size=1, max_size=25))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_every_fuzzed_message_gets_exactly_one_reply_and_service_goes_on(node, batch):
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(node.address)
        with_id, anonymous = set(), 0
        for k, (raw, frames) in enumerate(batch):
            raw, has_id = _with_id(raw, 1000 + k)
            if has_id:
                with_id.add(1000 + k)
            else:
                anonymous += 1
            s.send_multipart([raw, *frames])
        s.send_multipart([msgpack.packb({**VALID, "id": 7}), X1])  # a good request behind them
        seen: dict = {}
        while sum(seen.values()) < anonymous + len(with_id) + 1:
            assert s.poll(20_000), f"missing replies: got {seen}, expected ids {sorted(with_id)} + {anonymous} anonymous"
            reply = P.reply_decoder.decode(s.recv_multipart()[0])
            seen[reply.id] = seen.get(reply.id, 0) + 1
        # A status reply comes after everything sent before it was decided on: nothing more may
        # have arrived for these messages by then.
        s.send_multipart([msgpack.packb({"type": "status", "v": 1, "id": 99})])
        assert s.poll(20_000)
        last = P.reply_decoder.decode(s.recv_multipart()[0])
        assert last.id == 99, f"an extra reply: {last}"
    assert seen.get(7) == 1
    for rid in with_id:
        assert seen.get(rid) == 1, (rid, seen)
    assert seen.get(None, 0) == anonymous  # undecodable ones are answered without an id


def test_a_message_of_more_frames_than_inputs_can_name_is_refused_without_keeping_them(node):
    """A client's header and millions of empty frames (3 MB) were kept whole by the dispatcher's one
    thread: 890 MiB and 2.2 s a million, every other client waiting. Past 4096 payload frames
    they are read and dropped, and the message refused, under its id."""
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(node.address)
        s.send_multipart([msgpack.packb({**VALID, "id": 5}), X1, *[b""] * 5000])
        s.send_multipart([msgpack.packb({**VALID, "id": 7}), X1])  # a good request behind it
        replies = {}
        while len(replies) < 2:
            assert s.poll(20_000), f"missing replies: got {replies}"
            reply = P.reply_decoder.decode(s.recv_multipart()[0])
            replies[reply.id] = reply
    assert (replies[5].status, replies[5].message) == (
        P.Status.INVALID_ARGUMENT, "message has 5001 payload frames, more than 4096 (one per input tensor)")
    assert replies[7].status == P.Status.OK
