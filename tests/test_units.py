"""Pure pieces, no processes: codec, validation, policies, shm pool, timer."""

from __future__ import annotations

import math
import os
import threading
import select
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest

from batchyard import protocol as P
from batchyard.policy import Greedy, TimeWindow, make_policy
from batchyard.protocol import ModelSpec, TensorSpec
from batchyard.client_pool import ShmPool
from batchyard.shm import ALIGN, SHM_DIR, SegmentCache, ShmError, live_segments, reap_orphans
from batchyard.state import Request, SchedulerState, WorkerState
from batchyard.timer import OneShotTimer
from batchyard.validation import RequestInvalid, validate_infer

from conftest import SUM_MODEL, serve_beside, worker_message

SPEC = SUM_MODEL.spec()


def infer(inputs, outputs=None, **kw):
    return P.InferRequest(v=1, id=7, model="sum", inputs=inputs, outputs=outputs or {}, **kw)


def x_ref(shape=(2, 4), dtype="float32", **placement):
    placement = placement or {"frame": 0}
    return P.TensorRef(name="x", dtype=dtype, shape=list(shape), **placement)


# ---------------------------------------------------------------- codec + validation
def test_codec_round_trip_keeps_every_field():
    req = infer([x_ref(shm=P.ShmRef("batchyard_1_ab", 64, 32))], priority=0, timeout_us=5000,
                outputs={"y": P.ShmRef("batchyard_1_ab", 128, 16)})
    back = P.client_message_decoder.decode(P.encode(req))
    assert back == req


@pytest.mark.parametrize("raw,needle", [
    (b"\xc1", "malformed"),  # reserved msgpack byte
    (msgspec.msgpack.encode({"type": "infer", "v": 1, "id": 1, "inputs": []}), "model"),
    (msgspec.msgpack.encode({"type": "infer", "v": 1, "id": -3, "model": "m", "inputs": []}), "id"),
    (msgspec.msgpack.encode({"type": "launch", "v": 1, "id": 1}), "launch"),
    (msgspec.msgpack.encode({"type": "infer", "v": 1, "id": 1, "model": "m", "inputs": [],
                             "priority": 9}), "priority"),
])
def test_typed_decoding_rejects_with_field_path(raw, needle):
    with pytest.raises(P.DecodeError) as e:
        P.client_message_decoder.decode(raw)
    assert needle in str(e.value) or needle == "malformed"


def test_salvage_id_recovers_id_from_bad_header():
    raw = msgspec.msgpack.encode({"type": "infer", "v": 1, "id": 42, "model": 5})
    assert P.salvage_id(raw) == 42
    assert P.salvage_id(b"\xc1") is None
    assert P.salvage_id(raw + raw) == 42  # two maps in one frame: the id was lost (nil)
    assert P.salvage_id(raw + b"\xc1") == 42


def test_salvage_id_keeps_the_id_read_before_a_value_nested_too_deep_to_skip():
    """A header whose unknown key held a value nested 2,000 deep was answered with no id (the
    skip failed, and what was read before it was dropped): its client never matched the reply."""
    deep = b"\x91" * 2000 + b"\xc0"  # [[[...nil...]]]
    head = lambda pairs: bytes([0x80 | (len(pairs) + 1)]) + b"".join(  # noqa: E731
        msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in pairs) + msgspec.msgpack.encode("x") + deep
    with pytest.raises(P.DecodeError):
        P.client_message_decoder.decode(head([("type", "infer"), ("v", 1), ("id", 6242)]))
    assert P.salvage_id(head([("type", "infer"), ("v", 1), ("id", 6242)])) == 6242
    assert P.salvage_id(head([("id", 6242)])) is None  # its type unread: it may be a cancel's
    assert P.salvage_id(head([("type", "cancel"), ("id", 6242)])) is None


def test_salvage_id_walks_a_bounded_number_of_keys():
    # Each key is unpacked by a call from Python: a 5 MiB header of 2.6M tiny pairs held the
    # dispatcher's one thread 180 ms. Past SALVAGE_MAX_KEYS the header is not a client's message.
    few = {"id": 42, "type": "infer", **{f"k{i}": i for i in range(P.SALVAGE_MAX_KEYS - 2)}}
    assert P.salvage_id(msgspec.msgpack.encode(few)) == 42
    assert P.salvage_id(msgspec.msgpack.encode({**few, "one more": 0})) is None


@pytest.mark.parametrize("req,frames,needle", [
    (infer([x_ref(dtype="float64")]), [64], "dtype 'float64', model expects 'float32'"),
    (infer([x_ref(shape=(2, 5))]), [40], "shape [2, 5], model expects [n, 4]"),
    (infer([x_ref(shape=(17, 4))]), [17 * 16], "batch dimension 17 outside 1..16"),
    # A long wrong shape is quoted by its rank: quoted whole, the reply was 5 times the header.
    (infer([x_ref(shape=[1] * 100_000)]), [16], "shape [1, 1, 1, 1, 1, 1, 1, 1, ...] (rank 100000), model expects"),
    (infer([]), [], "missing inputs ['x']"),
    (infer([x_ref(), P.TensorRef(name="z", dtype="float32", shape=[2, 4], frame=1)]), [32, 32], "no input 'z'"),
    (infer([x_ref()]), [31], "frame has 31 bytes, shape and dtype need 32"),
    (infer([x_ref(frame=3)]), [32], "frame 3 but the message has 1 payload frames"),
    (infer([x_ref(shm=P.ShmRef("batchyard_1_a", 0, 999))]), [], "shm nbytes 999"),
    (infer([x_ref(shm=P.ShmRef("batchyard_1_a", 2, 32))]), [], "not aligned"),
    (infer([x_ref()]), [32, 8], "2 payload frames, inputs use 1"),
    (infer([x_ref()], outputs={"y": P.ShmRef("batchyard_1_a", 0, 4)}), [32], "output needs 16"),
])
def test_validation_names_the_problem(req, frames, needle):
    with pytest.raises(RequestInvalid) as e:
        validate_infer(req, SPEC, frames, max_inline_bytes=1 << 20)
    assert needle in str(e.value)


def test_a_negative_frame_index_is_refused_by_name():
    """``frame`` is an int >= 0: -5 beside an ``shm`` reference was taken, and alone it was told to
    give "exactly one of 'frame' or 'shm'"."""
    raw = msgspec.msgpack.encode({"type": "infer", "v": 1, "id": 7, "model": "m", "inputs": [
        {"name": "x", "dtype": "float32", "shape": [1, 4], "frame": -5,
         "shm": {"segment": "batchyard_1_a", "offset": 0, "nbytes": 16}}]})
    with pytest.raises(P.DecodeError, match=r"Expected `int` >= 0 - at `\$\.inputs\[0\]\.frame`"):
        P.client_message_decoder.decode(raw)


def test_validation_enforces_inline_limit_and_counts_items():
    assert validate_infer(infer([x_ref()]), SPEC, [32], max_inline_bytes=32) == 2
    with pytest.raises(RequestInvalid, match="exceeds max_inline_bytes 16; send large tensors through shared memory"):
        validate_infer(infer([x_ref()]), SPEC, [32], max_inline_bytes=16)
    with pytest.raises(RequestInvalid, match="exceeds max_inline_bytes 16; this endpoint takes tensors inline only "
                       r"\(tcp without \[dispatcher\] allow_shm_over_tcp\): raise the node's max_inline_bytes"):
        validate_infer(infer([x_ref()]), SPEC, [32], max_inline_bytes=16, shm_allowed=False)


# ---------------------------------------------------------------- policies (virtual clock)
def state_with(n_requests, workers=(("w0", 8),), t0=0.0):
    st = SchedulerState()
    for name, mb in workers:
        st.add_worker(WorkerState(name=name, path="cpu", models={"m": mb}))
    q = st.queue("m")
    for i in range(n_requests):
        q.push(Request(i, "m", 1, 1, t0 + i * 1e-3, math.inf))
    return st


def test_greedy_fills_free_workers_up_to_max_batch():
    st = state_with(11, workers=(("w0", 8), ("w1", 8)))
    d = Greedy().decide(st, 1.0)
    assert [len(x.requests) for x in d.dispatches] == [8, 3]
    assert st.queue("m").requests == 0
    assert Greedy().decide(st, 1.0).dispatches == []  # both busy now


def test_window_waits_until_delay_or_size():
    pol = TimeWindow(max_delay_s=0.005, max_batch=4)
    st = state_with(2)
    d = pol.decide(st, 0.002)
    assert d.dispatches == [] and d.wake_at == pytest.approx(0.005)
    d = pol.decide(st, 0.005)
    assert len(d.dispatches) == 1 and len(d.dispatches[0].requests) == 2
    st = state_with(5)
    d = pol.decide(st, 0.0041)
    assert len(d.dispatches[0].requests) == 4  # full batch goes before the delay


def test_priority_order_high_first_fifo_within_class():
    st = state_with(0)
    q = st.queue("m")
    for seq, prio in [(1, 2), (2, 1), (3, 0), (4, 1)]:
        q.push(Request(seq, "m", 1, prio, 0.0, math.inf))
    assert [r.seq for r in q.take(3)] == [3, 2, 4]


def test_make_policy_rejects_bad_window():
    assert make_policy("window:500,8").name == "window:500,8"
    with pytest.raises(ValueError, match="window:<max_delay_us>,<max_batch>"):
        make_policy("window:abc")


@pytest.mark.parametrize("spec", ["escape:1_0", "escape: 2", "fixed:\u0663", "window:5_00,8", "fixed:+4"])
def test_a_policy_number_is_ascii_digits(spec):
    # int() took these (a typo's underscore, a space, another script's digit) and ran a policy
    # the config did not say.
    with pytest.raises(ValueError, match="expected 'window:<max_delay_us>,<max_batch>'"):
        make_policy(spec)


# ---------------------------------------------------------------- shared memory
def test_pool_reuses_and_coalesces_regions():
    pool = ShmPool(segment_bytes=1 << 20)
    try:
        a, b, c = pool.alloc(1000), pool.alloc(5000), pool.alloc(64)
        assert len(pool.segment_names()) == 1
        pool.free(a)
        pool.free(b)
        d = pool.alloc(6000)  # fits only if a and b coalesced
        assert d.offset == ALIGN and d.segment == a.segment  # the first ALIGN bytes are the header
        big = pool.alloc(2 << 20)  # larger than a segment: a new one
        assert len(pool.segment_names()) == 2
        pool.free(big), pool.free(c), pool.free(d)
    finally:
        pool.close()
    assert not set(pool.segment_names()) & set(os.listdir(SHM_DIR))


def test_the_pool_keeps_the_two_largest_free_oversize_segments():
    """Requests bigger than a segment, each larger than the last: each got a segment of its own,
    kept for good and too small for the next (20 segments, 112 MiB of /dev/shm for 6 MiB used).
    Removed as soon as free, every same-size large request made and registered new ones (1.6 ->
    11.7 ms a request), and the client's grants grew by each: the two largest are kept (a big
    input and a big output)."""
    removed = []
    pool = ShmPool(segment_bytes=64 << 10, on_removed=removed.append)
    try:
        keep = pool.alloc(1000)  # the ordinary segment stays
        made = []
        for size in range(100 << 10, 400 << 10, 20 << 10):
            r = pool.alloc(size)
            pool.free(r)
            made.append(r.segment)
            assert sorted(pool.segment_names()) == sorted([keep.segment, *made[-2:]])  # the two largest
            assert all(not os.path.exists(os.path.join(SHM_DIR, n)) for n in made[:-2])
        again = pool.alloc(300 << 10)  # fits a spare: no new segment
        assert again.segment in made[-2:]
        pool.free(again)
        assert removed == made[:-2]
    finally:
        pool.close()


def test_a_region_freed_by_a_collection_inside_the_pools_own_alloc_is_freed_not_waited_for(monkeypatch):
    """Result arrays give their region back from a finalizer, which a garbage collection may run
    on any thread, also one inside ShmPool.alloc or free, which hold the pool's lock: the thread
    waited for that lock, its own, for ever (an outside review, forced with a low GC threshold).
    Here the collection is a free from inside alloc's making of a segment."""
    import batchyard.client_pool as client_pool

    pool = ShmPool(segment_bytes=4096)
    first = pool.alloc(3000)
    real_create = client_pool.Segment.create

    def create_after_a_collection(size):
        pool.free(first)  # what the finalizer of first's array does
        return real_create(size)

    monkeypatch.setattr(client_pool.Segment, "create", create_after_a_collection)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.alloc(3000)), daemon=True)
    try:
        t.start()
        t.join(10)
        assert not t.is_alive(), "the thread waits on its own lock"
        monkeypatch.undo()
        again = pool.alloc(3000)  # first's place, given back once alloc let the lock go
        assert (again.segment, again.offset) == (first.segment, first.offset)
    finally:
        pool.close()


def test_segment_cache_reports_missing_and_out_of_bounds():
    pool = ShmPool(segment_bytes=4096)
    cache = SegmentCache()
    try:
        r = pool.alloc(128)
        pool.view(r)[:4] = b"abcd"
        out = bytearray(4)
        cache.read_into(r.segment, r.offset, memoryview(out))
        assert out == b"abcd"
        cache.write(r.segment, r.offset + 4, memoryview(b"efgh"))
        assert bytes(pool.view(r)[:8]) == b"abcdefgh"
        with pytest.raises(ShmError, match="outside segment"):
            cache.view(r.segment, 4000, 200)
        with pytest.raises(ShmError, match="outside segment"):
            cache.read_into(r.segment, 4000, memoryview(bytearray(200)))
        with pytest.raises(ShmError, match="outside segment"):
            cache.write(r.segment, 4000, memoryview(bytes(200)))
        with pytest.raises(ShmError, match="does not exist"):
            cache.view("batchyard_1_dead", 0, 4)
    finally:
        cache.close()
        pool.close()


def test_a_segment_shrunk_between_its_fstat_and_its_mapping_is_the_requests_shm_error(monkeypatch):
    """A client shrinking its segment in a loop raced the worker's fstat and mmap: the mmap's
    ValueError ("mmap length is greater than file size") was no ShmError, so it ended the worker
    (3 restarts in 2 runs; an outside review) instead of failing the request INVALID_ARGUMENT."""
    import batchyard.shm as shm_module

    pool = ShmPool(segment_bytes=4096)
    cache = SegmentCache()
    real_fstat = os.fstat

    def fstat_then_shrunk(fd):  # the size seen before the client shrank the file
        st = real_fstat(fd)
        return os.stat_result((*st[:6], st.st_size + (1 << 20), *st[7:]))

    try:
        r = pool.alloc(128)
        monkeypatch.setattr(shm_module.os, "fstat", fstat_then_shrunk)
        with pytest.raises(ShmError, match="cannot map shared-memory segment"):
            cache.view(r.segment, r.offset, 4)
    finally:
        monkeypatch.undo()
        cache.close()
        pool.close()


def test_reap_orphans_removes_only_segments_no_live_owner_holds():
    # In a folder of its own: a dispatcher running beside the test (its orphan sweep reaps the
    # shared /dev/shm) took the dead owner's segment first, and this reap's list missed it.
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="bytest-reap-", dir=SHM_DIR)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(child.stdout)
    dead = f"batchyard_{dead_pid}_abc123"  # its creator is gone and holds no lock
    open(os.path.join(folder, dead), "wb").close()
    # A live owner whose pid this process cannot see (another PID namespace): here a pid that
    # does not exist, but the segment's lock is held by a live process.
    elsewhere = f"batchyard_{dead_pid}_def456"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], "
                               "os.O_RDWR | os.O_CREAT, 0o600); fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); "
                               "sys.stdin.read()", os.path.join(folder, elsewhere)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pool = ShmPool(segment_bytes=4096)
    try:
        assert holder.stdout.readline().strip() == "held"
        pool.alloc(10)
        creating = os.path.join(folder, f"batchyard_{dead_pid}_0bad.new")  # mid-creation: not locked yet
        open(creating, "wb").close()
        reaped = reap_orphans(folder)
        assert os.path.exists(creating)  # left alone during its grace period
        assert dead in reaped and elsewhere not in reaped
        reap_orphans()  # the host's own folder: this process's segments are locked
        assert set(pool.segment_names()) <= set(live_segments(os.getpid()))
    finally:
        pool.close()
        holder.stdin.close()
        holder.wait()
        shutil.rmtree(folder)


# ---------------------------------------------------------------- timer
def test_timerfd_fires_not_early_and_can_be_rearmed():
    t = OneShotTimer()
    try:
        target = time.monotonic() + 0.003
        t.arm(target)
        r, _, _ = select.select([t.fd], [], [], 1.0)
        assert r and time.monotonic() >= target
        t.clear()
        assert t.armed_at == math.inf
        r, _, _ = select.select([t.fd], [], [], 0)
        assert not r
    finally:
        t.close()


def test_reply_decoding_of_error_reply():
    msg = P.reply_decoder.decode(P.error_reply(None, P.Status.INVALID_ARGUMENT, "bad"))
    assert msg.id is None and msg.status == 3 and msg.message == "bad"


def test_sim_outputs_are_a_function_of_inputs():
    from batchyard.workers.executors import sim_outputs

    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    y = sim_outputs({"x": x}, SPEC)["y"]
    assert y.tolist() == [[6.0, 6.0], [22.0, 22.0]]


def test_gpu_executors_fail_clearly_without_a_gpu():
    import torch

    from batchyard.workers.cuda_executors import GpuUnavailable, TensorRTExecutor, TorchCudaExecutor

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    with pytest.raises(GpuUnavailable, match="is_available"):
        TorchCudaExecutor()
    with pytest.raises(GpuUnavailable):
        TensorRTExecutor({"m": "/nonexistent.onnx"})


def test_triton_regions_pick_system_shm_without_a_gpu_and_refuse_cuda_clearly():
    from batchyard.workers.triton_regions import HostRegion, RegionError, cuda_device_count, resolve_kind

    if cuda_device_count() > 0:
        pytest.skip("this host has a GPU")
    assert resolve_kind("auto", 0) == "system"
    assert resolve_kind("system", 0) == "system"
    with pytest.raises(RegionError, match="cuda-python|no GPU 0"):
        resolve_kind("cuda", 0)
    r = HostRegion("t", 4096)
    try:  # two tensors at offsets in one region, read back by dtype and shape
        r.write(0, np.arange(6, dtype=np.int64))
        r.write(48, np.full((2, 3), 1.5, np.float32))
        assert r.read(0, "int64", (2, 3)).tolist() == [[0, 1, 2], [3, 4, 5]]
        assert r.read(48, "float32", (2, 3)).tolist() == [[1.5] * 3] * 2
    finally:
        r.close()


def _triton_cfg(max_batch=64, dims=(1024,), dtype="TYPE_FP32", dynamic=False, reshape=None):
    mc = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    cfg = mc.ModelConfig(name="dense", max_batch_size=max_batch)
    for kind, name in ((cfg.input, "x"), (cfg.output, "y")):
        t = kind.add()
        t.name, t.data_type = name, mc.DataType.Value(dtype)
        t.dims.extend(dims)
        if reshape is not None:
            t.reshape.SetInParent()  # present even when empty: Triton's idiom for one value an item
            t.reshape.shape.extend(reshape)
    if dynamic:
        cfg.dynamic_batching.max_queue_delay_microseconds = 100
    return cfg


@pytest.mark.parametrize("cfg_kw, problem", [
    ({}, None),
    ({"max_batch": 0, "dims": (-1, 1024)}, None),  # a non-batching model with a variable first dim
    ({"dims": (-1,)}, None),  # variable dims fit any size
    ({"max_batch": 8}, "max_batch_size 8 < Batchyard's max_batch 64"),
    ({"dtype": "TYPE_FP16"}, "input 'x' is TYPE_FP16, spec 'm' says float32 (TYPE_FP32)"),
    ({"dims": (512,)}, "input 'x' has dims [512], spec 'm' has per-item shape [1024]"),
    ({"max_batch": 0}, "max_batch_size 0 and input 'x' dims [1024]: the first dimension must be -1"),
])
def test_triton_model_config_is_checked_against_the_spec(cfg_kw, problem):
    from batchyard.workers.triton_model_check import check_model_config

    spec = ModelSpec("m", (TensorSpec("x", "float32", (1024,)),), (TensorSpec("y", "float32", (1024,)),), 64)
    check = check_model_config(_triton_cfg(**cfg_kw), spec)
    assert check.warnings == []
    if problem is None:
        assert check.problems == []
    else:
        assert any(problem in p for p in check.problems), check.problems


@pytest.mark.parametrize("spec_shape, cfg_kw, wire, problem", [
    ((), {"dims": (1,), "reshape": ()}, (1,), None),  # one value an item, as Triton declares it
    ((1,), {"dims": (1,), "reshape": ()}, None, None),  # the spec in dims' shape: sent as is
    ((2, 8), {"dims": (16,), "reshape": (2, 8)}, (16,), None),
    ((), {"dims": (-1,), "reshape": ()}, None, "has reshape [] as spec 'm''s per-item shape, but dims [-1]"),
    ((3,), {"dims": (1,), "reshape": ()}, None, "input 'x' has dims [1] and reshape [], spec 'm' has per-item shape [3]"),
    ((), {"dims": (1,)}, None, "input 'x' has dims [1], spec 'm' has per-item shape []"),  # no reshape: refused
])
def test_a_triton_tensor_with_a_reshape_fits_a_spec_of_either_shape(spec_shape, cfg_kw, wire, problem):
    """A spec with one value an item could not be served by any batching Triton model (their
    dims cannot be empty; Triton's idiom is dims [1] with reshape []): the check refused it."""
    from batchyard.workers.triton_model_check import check_model_config

    spec = ModelSpec("m", (TensorSpec("x", "float32", spec_shape),), (TensorSpec("y", "float32", spec_shape),), 64)
    check = check_model_config(_triton_cfg(**cfg_kw), spec)
    assert check.wire_dims == ({} if wire is None else {"x": wire, "y": wire})
    if problem is None:
        assert check.problems == []
    else:
        assert any(problem in p for p in check.problems), check.problems


@pytest.mark.parametrize("optional", [False, True])
def test_a_triton_input_the_spec_does_not_feed_is_refused_unless_optional(optional):
    """It passed the check, and every batch then failed INVALID_ARGUMENT ("missing required
    input(s) ['z']"): the worker exited 69 and was restarted for ever."""
    from batchyard.workers.triton_model_check import check_model_config

    spec = ModelSpec("m", (TensorSpec("x", "float32", (1024,)),), (TensorSpec("y", "float32", (1024,)),), 64)
    cfg = _triton_cfg()
    z = cfg.input.add()
    z.name, z.data_type, z.optional = "z", cfg.input[0].data_type, optional
    z.dims.extend([4])
    problems = check_model_config(cfg, spec).problems
    assert problems == ([] if optional else
                        ["Triton model 'dense' needs input 'z', which spec 'm' does not have (its inputs: ['x']); map a "
                         "spec input to it with triton.tensor_names, or mark it optional in Triton's config"])


def test_triton_model_config_check_renames_and_warns_on_dynamic_batching():
    from batchyard.workers.triton_model_check import check_model_config

    spec = ModelSpec("m", (TensorSpec("feat", "float32", (1024,)),), (TensorSpec("y", "float32", (1024,)),), 64)
    cfg = _triton_cfg(dynamic=True)
    assert "lacks input 'feat' of spec 'm' (it has ['x'])" in check_model_config(cfg, spec).problems[0]
    check = check_model_config(cfg, spec, {"feat": "x"})
    assert check.problems == [] and "dynamic_batching on" in check.warnings[0]


def test_a_worker_whose_spec_differs_from_the_served_one_is_refused():
    from batchyard.validation import registration_problem

    served = P.ModelSpec("sum", (P.TensorSpec("x", "float32", (4,)),), (P.TensorSpec("y", "float32", (2,)),))
    other = P.ModelSpec("sum", (P.TensorSpec("x", "float32", (8,)),), (P.TensorSpec("y", "float32", (2,)),))
    assert registration_problem([served], {"sum": served}) == ""
    assert "differs from the dispatcher's" in registration_problem([other], {"sum": served})
    bad = P.ModelSpec("bad", (P.TensorSpec("x", "complex64", (4,)),), (P.TensorSpec("y", "float32", (2,)),))
    assert "dtype" in registration_problem([bad], {})


def test_decision_lateness_quantiles_are_the_order_statistics_of_the_ring():
    import random

    from batchyard.lateness import RING, Lateness

    late = Lateness()
    rng = random.Random(4)
    xs = [rng.random() * 1e-3 for _ in range(RING + 500)]  # wraps: only the last RING samples count
    for x in xs:
        late.record("timer", x)
    kept = sorted(xs[-RING:])
    q = late.quantiles_us()["timer"]
    assert q == {"n": RING + 500, "p50_us": round(kept[RING // 2] * 1e6, 1),
                 "p99_us": round(kept[(99 * RING) // 100] * 1e6, 1), "max_us": round(kept[-1] * 1e6, 1)}
    assert "arrival" not in late.quantiles_us()


def test_a_curve_that_only_ever_sees_one_batch_size_stays_finite():
    """RLS covariance windup: 200,000 batches of B=1 (a CPU worker serving single requests for
    hours) made the forgetting factor blow the unexcited direction up to inf and the curve NaN."""
    import math

    from batchyard.cost_model import CostCurve

    c = CostCurve()
    for _ in range(200_000):
        c.observe(1, 80e-6)
    assert math.isfinite(c.launch_s) and math.isfinite(c.per_item_s)
    assert c.predict(1) == pytest.approx(80e-6, rel=1e-3)


PIN_EVERY_THREAD = """
import os, threading, numpy  # numpy starts OpenBLAS's threads at import: before the pinning
from batchyard.affinity import pin_cpus
started = threading.Event()
t = threading.Thread(target=lambda: (started.set(), threading.Event().wait(5)), daemon=True)
t.start()
started.wait()
cpu = min(os.sched_getaffinity(0))
pin_cpus((cpu,))
masks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
print(cpu, len(masks), sorted({tuple(m) for m in masks.values()}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one of them")
def test_a_pinned_worker_has_every_thread_on_its_cpus():
    """A worker's threads started before its pinning (OpenBLAS's, numpy's import starts them)
    stayed on every core it inherited: pinning bound only the thread that asked."""
    out = subprocess.run([sys.executable, "-c", PIN_EVERY_THREAD], capture_output=True, text=True, timeout=60,
                         check=True).stdout.split(maxsplit=2)
    cpu, threads, masks = int(out[0]), int(out[1]), out[2].strip()
    assert threads >= 2
    assert masks == f"[({cpu},)]"


def test_patterns_refuse_a_trailing_newline():
    """msgspec matches patterns with re.search, where "$" matches before a final newline: an LLM
    route of "gpu\\n" decoded, raised KeyError in the core after the request was stored, and the
    request was answered twice (INTERNAL at once, DEADLINE_EXCEEDED at its deadline)."""
    base = {"type": "generate", "v": 1, "id": 1, "model": "m", "prompt": [1, 2]}
    assert P.client_message_decoder.decode(msgspec.msgpack.encode(base | {"route": "gpu"})).route == "gpu"
    for bad in ({"route": "gpu\n"}, {"route": "prefill-cpu\n"}):
        with pytest.raises(P.DecodeError):
            P.client_message_decoder.decode(msgspec.msgpack.encode(base | bad))
    ref = {"type": "infer", "v": 1, "id": 1, "model": "m",
           "inputs": [{"name": "x", "dtype": "float32", "shape": [1], "shm": {"segment": "abc\n", "offset": 0,
                                                                             "nbytes": 4}}]}
    with pytest.raises(P.DecodeError):
        P.client_message_decoder.decode(msgspec.msgpack.encode(ref))


def test_a_sizes_first_run_in_a_worker_is_marked_and_not_learnt():
    """A batch of a size the warm-up did not run builds its kernels in its time (up to 10x):
    learnt by a curve with no profile, one such batch set the line at launch -8 ms + 9.5 ms*B,
    and the policy sent one request at a time for good (SIMULATED p99 27 ms against 5)."""
    import zmq

    from batchyard.workers.runtime import WorkerRuntime

    class Model:
        path, simulated = "cpu", False

        def run(self, model, inputs):
            return {"y": np.zeros((len(inputs["x"]), 2), np.float32)}

    spec = SUM_MODEL.spec()
    rt = WorkerRuntime("w", "ipc:///nonexistent", Model(), {"sum": spec})
    rt.warmup({"sum": (1, 2)})

    def run(n: int) -> P.BatchDone:
        heads = [zmq.Frame(P.encode(P.InferRequest(v=P.PROTOCOL_VERSION, id=i, model="sum", inputs=[
            P.TensorRef(name="x", dtype="float32", shape=[1, 4], frame=0)]))) for i in range(n)]
        frames = [f for h in heads for f in (h, zmq.Frame(np.ones((1, 4), np.float32).tobytes()))]
        reply = rt.run_batch(P.Batch(batch_id=1, model="sum", seqs=list(range(n)), n_frames=[1] * n), frames)
        return msgspec.msgpack.decode(reply[0], type=P.BatchDone)

    assert [run(n).first_of_size for n in (1, 2, 3, 3, 1)] == [False, False, True, False, False]
    Model.simulated = True  # a simulated device has no kernels to build: the simulator learns each batch
    assert not run(5).first_of_size



def test_a_stopping_worker_replies_for_the_batches_its_executor_holds_before_its_goodbye(run_dir, monkeypatch):
    """SIGTERM with a batch in an asynchronous executor (Triton's): the worker said goodbye and
    left without its reply, and the dispatcher ran the requests again (one that had spent its
    retry failed UNAVAILABLE). Here the test plays the dispatcher."""
    import threading

    import zmq

    from batchyard.workers import runtime

    monkeypatch.setattr(runtime, "exit_after_grace", lambda: None)  # no hard exit of the test process

    class AsyncModel:
        path, simulated = "gpu", True
        held: list = []

        def submit(self, model, inputs, done):
            self.held.append(lambda: done({"y": inputs["x"] * 2}, 1000))
            submitted.set()

    submitted = threading.Event()
    backend = f"ipc://{run_dir}/be"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(backend)
    rt = runtime.WorkerRuntime("w", backend, AsyncModel(), {"sum": SPEC}, heartbeat_interval_s=60.0)
    seen: list = []

    def dispatcher():
        def recv():
            return worker_message(router, b"w")

        try:
            assert type(recv()) is P.Register
            router.send_multipart([b"w", P.encode(P.Registered(worker="w"))])
            head = P.encode(P.InferRequest(v=P.PROTOCOL_VERSION, id=1, model="sum", inputs=[
                P.TensorRef(name="x", dtype="float32", shape=[1, 4], frame=0)]))
            router.send_multipart([b"w", P.encode(P.Batch(batch_id=7, model="sum", seqs=[0], n_frames=[1])), head,
                                   np.ones((1, 4), np.float32).tobytes()])
            assert submitted.wait(30)
            rt.request_stop()  # SIGTERM, the batch in the executor
            os.write(rt._wake_w, b"x")
            seen.append(type(recv()).__name__)  # told first: no new batch (it said goodbye here)
            AsyncModel.held.pop()()
            seen.append(type(recv()).__name__)
            # One the dispatcher sent before it read `leaving`, arriving after the last completion:
            # run too, since the worker waits for the dispatcher's answer to `leaving`.
            submitted.clear()
            router.send_multipart([b"w", P.encode(P.Batch(batch_id=8, model="sum", seqs=[0], n_frames=[1])), head,
                                   np.ones((1, 4), np.float32).tobytes()])
            assert submitted.wait(30), "the batch sent before the dispatcher knew was never run"
            AsyncModel.held.pop()()
            seen.append(type(recv()).__name__)
            router.send_multipart([b"w", P.encode(P.LeavingNoted(worker="w"))])
            seen.append(type(recv()).__name__)
        finally:
            rt.request_stop()  # the loop sees it at its next poll

    assert serve_beside(rt, dispatcher, router) == 0
    assert seen == ["Leaving", "BatchDone", "BatchDone", "Goodbye"]


def _sim_worker_beside_a_router(run_dir, heartbeat_interval_s: float):
    """(context, a ROUTER bound where a dispatcher's workers' socket would be, a worker runtime
    "w" of a simulated `sum` connecting to it); the caller runs ``serve()`` and closes both."""
    import zmq

    from batchyard.config import SimConfig
    from batchyard.workers import runtime
    from batchyard.workers.executors import SimulatedExecutor

    backend = f"ipc://{run_dir}/be"
    spec = P.ModelSpec(name="sum", max_batch=4, inputs=[P.TensorSpec("x", "float32", [4])],
                       outputs=[P.TensorSpec("y", "float32", [2])])
    ex = SimulatedExecutor(SimConfig(launch_us=10, per_item_us=1))
    ex.load(spec, "")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(backend)
    return ctx, router, runtime.WorkerRuntime("w", backend, ex, {"sum": spec}, heartbeat_interval_s=heartbeat_interval_s)


def test_a_registered_worker_whose_dispatcher_is_gone_stops_at_once(run_dir):
    """A stopping worker tells the dispatcher it is leaving and waits for the answer; one whose
    dispatcher had already stopped (both stopped together, as systemd does) waited for an answer
    that never came for its whole 15 s grace."""
    import threading

    ctx, router, rt = _sim_worker_beside_a_router(run_dir, heartbeat_interval_s=0.1)
    asked_at = []

    def dispatcher_that_goes_away():
        while True:  # the registration, answered
            ident, *frames = router.recv_multipart()
            if ident == b"w" and type(P.worker_message_decoder.decode(frames[0])) is P.Register:
                router.send_multipart([b"w", P.encode(P.Registered(worker="w"))])
                break
        while router.recv_multipart()[0] != b"w#hb":  # a heartbeat: the worker knows it is registered
            pass
        router.close()  # the dispatcher is gone
        asked_at.append(time.monotonic())
        rt._stop = True  # what SIGTERM's request_stop does (without its exit timer)

    t = threading.Thread(target=dispatcher_that_goes_away, daemon=True)
    t.start()
    try:
        rt.serve()
        took = time.monotonic() - asked_at[0]
    finally:
        t.join(10)
        ctx.term()
    assert took < 5.0, f"stopped {took:.1f} s after it was asked"


def test_a_worker_told_its_dispatcher_is_closing_stops_at_once_and_registers_again_only_when_asked(run_dir, monkeypatch):
    """A dispatcher ending its drain tells its workers so (`closing`): `up` stops the dispatcher
    before the workers, and each then sent `leaving` to nobody and waited for the answer
    (LEAVING_NOTED_WAIT_S), then lingered on its `goodbye`: a node of idle workers took 2 s to
    stop. Told, a worker owes that dispatcher nothing, and registers again only when a
    dispatcher asks (its heartbeat answered `reregister`), not on its own retry timer."""
    from batchyard.workers import runtime

    monkeypatch.setattr(runtime, "LEAVING_NOTED_WAIT_S", 60.0)  # a wait for the answer would be plain
    monkeypatch.setattr(runtime, "STOP_GRACE_S", 120.0)
    monkeypatch.setattr(runtime, "REGISTER_RETRY_S", 0.01)  # a worker registering on its own would soon
    monkeypatch.setattr(runtime, "exit_after_grace", lambda: None)
    ctx, router, rt = _sim_worker_beside_a_router(run_dir, heartbeat_interval_s=0.05)
    after_closing: list = []  # what the worker's main socket sent after each `closing`
    stopped_at: list = []

    def recv():
        assert router.poll(30_000), "the worker went silent"
        ident, *frames = router.recv_multipart()
        return ident, type(P.worker_message_decoder.decode(frames[0]))

    def until(ident, kind, seen):
        while True:
            got = recv()
            if got == (ident, kind):
                return
            if got[0] == b"w":
                seen.append(got[1].__name__)

    def dispatcher():
        try:
            until(b"w", P.Register, [])
            router.send_multipart([b"w", P.encode(P.Registered(worker="w"))])
            until(b"w#hb", P.Heartbeat, [])
            router.send_multipart([b"w", P.encode(P.Closing(worker="w"))])
            quiet: list = []
            for _ in range(3):  # heartbeats go on; the main socket stays quiet
                until(b"w#hb", P.Heartbeat, quiet)
            after_closing.append(quiet)
            router.send_multipart([b"w#hb", P.encode(P.Reregister(worker="w"))])  # a dispatcher asks
            until(b"w", P.Register, after_closing[0])
            router.send_multipart([b"w", P.encode(P.Registered(worker="w"))])
            until(b"w#hb", P.Heartbeat, [])
            router.send_multipart([b"w", P.encode(P.Closing(worker="w"))])
            until(b"w#hb", P.Heartbeat, [])  # (the worker has had time to read it)
        finally:
            stopped_at.append(time.monotonic())
            rt.request_stop()
            os.write(rt._wake_w, b"x")

    t = threading.Thread(target=dispatcher, daemon=True)
    t.start()
    try:
        assert rt.serve() == 0
        took = time.monotonic() - stopped_at[0]
        rest: list = []
        while router.poll(0):
            ident, *frames = router.recv_multipart()
            if ident == b"w":
                rest.append(type(P.worker_message_decoder.decode(frames[0])).__name__)
    finally:
        t.join(10)
        router.close()
        ctx.term()
    assert after_closing == [[]], "the worker registered on its own after `closing`, before it was asked"
    assert rest == [], f"it sent {rest} to a dispatcher that had closed"
    assert took < 30.0, f"stopped {took:.1f} s after it was asked: it waited for an answer to `leaving`"


def test_free_ports_are_never_handed_out_twice_even_when_the_kernel_repeats_one(monkeypatch):
    """The kernel may give two binds in a row the same port once the first socket is closed: a
    tritonserver given such a pair for gRPC and HTTP would not start (a CI run's failure)."""
    from batchyard import addresses

    ports = iter([41000, 41000, 41001])

    class Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", next(ports))

    monkeypatch.setattr(addresses, "_HANDED", set())
    monkeypatch.setattr(addresses.socket, "socket", Socket)
    assert [addresses.free_port(), addresses.free_port()] == [41000, 41001]
