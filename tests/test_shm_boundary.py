"""The shared-memory trust boundary against a client that plays tricks with its own files and
routing ids: a grant is for the file proved, held by the process that proved it, and nothing a
client does to its files stops the dispatcher or kills a worker."""

from __future__ import annotations

import os
import secrets
import struct
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import zmq

from batchyard import protocol as P
from batchyard.shm import SHM_DIR

from conftest import sim_worker
from test_request_path import _deleted_segments_held, header, shm_register

SEGMENT_BYTES = 64 * 1024


@pytest.fixture
def files():
    """make(fill) -> the name of a fresh file in /dev/shm (no Batchyard name: the dispatcher's
    reaper would take it), float32 ``fill`` from offset 64; all removed after the test."""
    made = []

    def make(fill: float = 0.0, name: str = "") -> str:
        name = name or f"bytest_{os.getpid()}_{secrets.token_hex(4)}"
        made.append(name)
        data = bytearray(SEGMENT_BYTES)
        data[64:64 + 16] = np.full(4, fill, np.float32).tobytes()
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(data)
        return name

    yield make
    for name in made:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def write_challenge(segment: str, challenge: bytes) -> None:
    fd = os.open(os.path.join(SHM_DIR, segment), os.O_WRONLY)
    try:
        os.pwrite(fd, challenge, 0)
    finally:
        os.close(fd)


def dealer(address: str, routing_id: bytes = b"") -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if routing_id:
        s.setsockopt(zmq.ROUTING_ID, routing_id)
    s.connect(address)
    return s


def infer_input_from(sock, segment: str) -> P.InferReply:
    sock.send_multipart([header(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4],
                                         "shm": {"segment": segment, "offset": 64, "nbytes": 16}}])])
    assert sock.poll(10_000), "no reply"
    return P.reply_decoder.decode(sock.recv_multipart()[0])


def infer_output_to(sock, segment: str, offset: int) -> P.InferReply:
    sock.send_multipart([header(outputs={"y": {"segment": segment, "offset": offset, "nbytes": 8}}),
                         np.ones((1, 4), np.float32).tobytes()])
    assert sock.poll(10_000), "no reply"
    return P.reply_decoder.decode(sock.recv_multipart()[0])


def test_a_segment_replaced_by_a_symlink_after_its_proof_is_not_followed(start_node, files):
    """The grant was for a name: a client proved its own file, then put a symlink to another
    file (another user's segment) under that name, and the worker read and wrote through it."""
    node = start_node([sim_worker()])
    victim, mine = files(7.0), files(0.0)
    with dealer(node.address) as s:
        assert shm_register(s, mine, write_challenge).status == P.Status.OK
        os.unlink(os.path.join(SHM_DIR, mine))
        os.symlink(os.path.join(SHM_DIR, victim), os.path.join(SHM_DIR, mine))
        reply = infer_input_from(s, mine)
        assert reply.status == P.Status.INVALID_ARGUMENT and "input shared memory" in reply.message, reply
        reply = infer_output_to(s, mine, 64)
        assert reply.status == P.Status.INVALID_ARGUMENT and "output shared memory" in reply.message, reply
    with open(os.path.join(SHM_DIR, victim), "rb") as f:
        assert np.frombuffer(f.read()[64:80], np.float32).tolist() == [7.0] * 4


def test_a_name_made_again_by_someone_else_is_not_served_from_the_old_mapping(start_node, files):
    """Workers kept a segment mapped by name: once its owner unlinked it, whoever made a file of
    that name and proved it read the old owner's tensors from the worker's stale mapping. The old
    owner's grant does not reach the new file either."""
    node = start_node([sim_worker()])
    name = files(7.0)
    with node.client() as c, dealer(node.address) as first, dealer(node.address) as second:
        assert shm_register(first, name, write_challenge).status == P.Status.OK
        first.send_multipart([header(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4],
                                              "shm": {"segment": name, "offset": 64, "nbytes": 16}}])])
        assert first.poll(10_000)
        old = first.recv_multipart()
        assert np.frombuffer(old[1], np.float32).tolist() == [28.0, 28.0]
        os.unlink(os.path.join(SHM_DIR, name))
        files(1.0, name=name)
        assert shm_register(second, name, write_challenge).status == P.Status.OK
        second.send_multipart([header(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4],
                                               "shm": {"segment": name, "offset": 64, "nbytes": 16}}])])
        assert second.poll(10_000)
        new = second.recv_multipart()
        assert P.reply_decoder.decode(new[0]).status == P.Status.OK
        assert np.frombuffer(new[1], np.float32).tolist() == [4.0, 4.0]  # not the old file's 28
        reply = infer_input_from(first, name)
        assert reply.status in (P.Status.INVALID_ARGUMENT, P.Status.PERMISSION_DENIED), reply
        assert c.status().departures == 0


def test_a_segment_made_again_after_a_worker_used_it_is_refused_not_served_from_the_old_file(start_node, files):
    """The worker kept the proved file open: once a batch had used it, the client's segment
    made again under its name (no new proof) was answered OK, its input read from the old,
    deleted file and its output written there, the file under the name never touched."""
    node = start_node([sim_worker()])
    name = files(7.0)
    with dealer(node.address) as s:
        assert shm_register(s, name, write_challenge).status == P.Status.OK
        assert infer_input_from(s, name).status == P.Status.OK  # the worker has it open now
        os.unlink(os.path.join(SHM_DIR, name))
        files(1.0, name=name)
        reply = infer_input_from(s, name)
        assert reply.status == P.Status.INVALID_ARGUMENT and "replaced since" in reply.message, reply
        reply = infer_output_to(s, name, 128)
        assert reply.status == P.Status.INVALID_ARGUMENT and "replaced since" in reply.message, reply


def test_registering_a_fifo_does_not_stop_the_dispatcher(start_node):
    """Proving a segment opened it for reading, and opening a FIFO waits for a writer: the
    dispatcher's one thread stopped until somebody opened it."""
    node = start_node([sim_worker()])
    name = f"bytest_{os.getpid()}_{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    os.mkfifo(path)
    try:
        with node.client() as c, dealer(node.address) as s:
            reply = shm_register(s, name, lambda segment, challenge: None)
            assert reply.status == P.Status.PERMISSION_DENIED and "not a regular file" in reply.message, reply
            assert c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[4.0, 4.0]]
    finally:
        os.unlink(path)


def test_a_segment_shrunk_after_it_was_mapped_does_not_kill_the_worker(start_node, files):
    """The worker checked ranges against the size it mapped: a client that shrank its segment
    and then asked for an output past the new end killed the worker with SIGBUS."""
    node = start_node([sim_worker()])
    name = files(1.0)
    with node.client() as c, dealer(node.address) as s:
        assert shm_register(s, name, write_challenge).status == P.Status.OK
        out = {"y": {"segment": name, "offset": 16384, "nbytes": 8}}
        s.send_multipart([header(outputs=out), np.ones((1, 4), np.float32).tobytes()])
        assert s.poll(10_000) and P.reply_decoder.decode(s.recv_multipart()[0]).status == P.Status.OK
        os.truncate(os.path.join(SHM_DIR, name), 4096)
        s.send_multipart([header(outputs=out), np.ones((1, 4), np.float32).tobytes()])
        assert s.poll(10_000)
        reply = P.reply_decoder.decode(s.recv_multipart()[0])
        assert reply.status == P.Status.INVALID_ARGUMENT and "outside segment" in reply.message, reply
        assert c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[4.0, 4.0]]
        assert c.status().departures == 0  # the worker never left


TAKE_OVER = """
import sys, msgspec, zmq
address, rid, segment = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3]
head = msgspec.msgpack.encode({"type": "infer", "v": 1, "id": 9, "model": "sum", "inputs": [
    {"name": "x", "dtype": "float32", "shape": [1, 4], "shm": {"segment": segment, "offset": 64, "nbytes": 16}}]})
for attempt in range(40):  # until the dispatcher has let the closed connection's id go
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, rid)
    s.connect(address)
    s.send_multipart([head])
    if s.poll(500):
        print(msgspec.msgpack.decode(s.recv_multipart()[0])["status"])
        break
    s.close()
"""


def test_a_closed_connections_grants_do_not_pass_to_a_process_that_takes_its_routing_id(start_node, files):
    """A peer may choose a routing id of the form ZeroMQ assigns: a process that took a closed
    connection's id inherited its grants, and read that client's memory."""
    node = start_node([sim_worker()])
    name = files(7.0)
    rid = b"\0" + secrets.token_bytes(4)
    with dealer(node.address, rid) as s:
        assert shm_register(s, name, write_challenge).status == P.Status.OK
        assert infer_input_from(s, name).status == P.Status.OK
    out = subprocess.run([sys.executable, "-c", TAKE_OVER, node.address, rid.hex(), name],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(int(P.Status.PERMISSION_DENIED)), (out.stdout, out.stderr)


def test_holding_the_ids_zeromq_would_give_next_does_not_abort_the_dispatcher(start_node):
    """libzmq numbers a ROUTER's peers from rand(), unseeded: every dispatcher's first peer id was
    0x6B8B4567. A client that held the next ids made libzmq abort the dispatcher (an assertion)
    when it numbered the next connection."""
    node = start_node([sim_worker()])
    with node.client() as c:
        pid = c.status().dispatcher_pid
    squatters = [dealer(node.address, b"\0" + struct.pack(">I", 0x6B8B4567 + k)) for k in range(64)]
    try:
        for s in squatters:  # each connected and known to the dispatcher
            s.send_multipart([msgspec.msgpack.encode({"type": "status", "v": 1, "id": 1, "brief": True})])
        for s in squatters:
            assert s.poll(10_000)
            s.recv_multipart()
        with node.client() as c:
            assert c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[4.0, 4.0]]
            assert c.status().dispatcher_pid == pid
    finally:
        for s in squatters:
            s.close()


READ_THEN_SHRINK = """
import os, sys, numpy as np
from batchyard import protocol as P
from batchyard.shm import SHM_DIR, SegmentCache
from batchyard.workers.batch_io import assemble, read_batch

name, mode = sys.argv[1], sys.argv[2]
os.chmod(os.path.join(SHM_DIR, name), 0o660)  # its group may write (and shrink) it too
spec = P.ModelSpec("sum", (P.TensorSpec("x", "float32", (4,)),), (P.TensorSpec("y", "float32", (2,)),), 16)
ref = P.TensorRef(name="x", dtype="float32", shape=[1, 4], shm=P.ShmRef(name, 64, 16))
head = P.encode(P.InferRequest(v=P.PROTOCOL_VERSION, id=1, model="sum", inputs=[ref]))
frame = type("Frame", (), {"buffer": memoryview(head)})
cache = SegmentCache()
n = 1 if mode == "one" else 2
items = read_batch(P.Batch(batch_id=1, model="sum", seqs=list(range(n)), n_frames=[0] * n), [frame] * n, cache)
inputs = assemble(items, spec, cache)
os.truncate(os.path.join(SHM_DIR, name), 0)  # the client shrinks its file while the model runs
print(float(inputs["x"].sum()), [it.error for it in items])
"""


@pytest.mark.parametrize("mode", ["one", "two"])
def test_inputs_shrunk_while_the_model_runs_do_not_kill_the_worker(files, mode):
    """A lone request's shared-memory inputs were handed to the model as views of the worker's
    mapping: a client that shrank its file during the batch killed the worker with SIGBUS (and
    the check before each access could never close that race). A file that someone besides the
    worker's user may write is now never mapped: its inputs are read into the batch's arrays."""
    name = files(2.5)
    r = subprocess.run([sys.executable, "-c", READ_THEN_SHRINK, name, mode], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    expected = 10.0 if mode == "one" else 20.0
    assert r.stdout.split()[0] == str(expected) and "[None" in r.stdout, r.stdout


def test_a_segment_shrunk_between_the_check_and_the_read_fails_only_its_request(files):
    from batchyard.shm import SegmentCache
    from batchyard.workers.batch_io import assemble, read_batch

    spec = P.ModelSpec("sum", (P.TensorSpec("x", "float32", (4,)),), (P.TensorSpec("y", "float32", (2,)),), 16)
    names = [files(1.0), files(3.0)]
    for n in names:
        os.chmod(os.path.join(SHM_DIR, n), 0o660)
    heads = [P.encode(P.InferRequest(v=P.PROTOCOL_VERSION, id=i, model="sum", inputs=[
        P.TensorRef(name="x", dtype="float32", shape=[1, 4], shm=P.ShmRef(n, 64, 16))])) for i, n in enumerate(names)]
    frames = [type("Frame", (), {"buffer": memoryview(h)}) for h in heads]
    cache = SegmentCache()
    try:
        items = read_batch(P.Batch(batch_id=1, model="sum", seqs=[0, 1], n_frames=[0, 0]), frames, cache)
        assert [it.error for it in items] == [None, None]  # both fit when checked
        os.truncate(os.path.join(SHM_DIR, names[0]), 32)  # then the first client shrinks its file
        inputs = assemble(items, spec, cache)
    finally:
        cache.close()
    assert inputs["x"].tolist() == [[3.0] * 4]  # the other request runs alone
    assert items[0].error[0] == P.Status.INVALID_ARGUMENT and "outside segment" in items[0].error[1]


def test_only_a_segment_no_one_but_the_workers_user_can_shrink_is_mapped(files):
    """Mapped, a segment's inputs cost no copy; a client that can shrink a file only the
    worker's user may write could kill the worker by other means anyway."""
    from batchyard.shm import SegmentCache

    path = os.path.join(SHM_DIR, files(1.0))
    for mode, mapped in ((0o600, True), (0o644, True), (0o620, False), (0o602, False)):
        os.chmod(path, mode)
        assert SegmentCache.maps(os.stat(path)) is mapped, oct(mode)
    if os.geteuid() == 0:  # a file of another user is never mapped, whatever its mode
        os.chown(path, 65534, -1)
        os.chmod(path, 0o600)
        assert not SegmentCache.maps(os.stat(path))


def test_a_segment_of_another_user_is_not_granted_though_it_holds_the_challenge(files):
    """The challenge at offset 0 proves only that someone wrote it: the Triton worker copied a
    client's tensor to offset 0 of its own region, and a client of another uid, which could not
    open that region, got a grant for it and read other clients' batches through it. A grant now
    needs the segment to be the connection's own user's (the kernel's SO_PEERCRED uid)."""
    from batchyard.shm_grants import ShmGrants, peer_uid

    segment = files()
    me, other = os.getuid(), os.getuid() + 1
    grants = ShmGrants()
    for uid, granted in ((other, False), (me, True)):
        conn = (b"\0" + secrets.token_bytes(4), f"localhost:{uid}:0:{os.getpid()}")
        challenge, why = grants.challenge(conn, segment)
        write_challenge(segment, challenge)
        why = grants.prove(conn, segment)
        assert (why == "") == granted, why
        if not granted:
            assert f"belongs to uid {me}, not to this connection's uid {other}" in why
    assert peer_uid("localhost:1000:1000:42") == 1000
    assert peer_uid("127.0.0.1") is None and peer_uid("fe80::1:2:3:4") is None


def test_a_fifo_named_as_a_segment_does_not_stop_the_orphan_sweep(tmp_path):
    """Anyone may make a FIFO in /dev/shm: opened to see if its owner lived, it held the sweep
    (every new client, and the dispatcher's one thread) until someone wrote to it."""
    from batchyard.shm import reap_orphans

    fifo = tmp_path / "batchyard_1_deadbeef0001"
    os.mkfifo(fifo)
    done = subprocess.run([sys.executable, "-c", "import sys; from batchyard.shm import reap_orphans; "
                           "print(reap_orphans(sys.argv[1]))", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done
    assert fifo.exists() and reap_orphans(str(tmp_path)) == []


def test_a_failing_write_or_a_full_dev_shm_is_a_typed_error(monkeypatch, files):
    """ENOSPC writing a client's sparse segment escaped as OSError and killed the worker; a
    client's own segment is allocated when made (a sparse one made the worker die of SIGBUS when
    /dev/shm was full), and a full /dev/shm is then its ShmError."""
    import errno

    from batchyard.shm import Segment, SegmentCache, ShmError

    cache, name = SegmentCache(), files()
    try:
        def full(*args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(SegmentCache, "maps", staticmethod(lambda st: False))  # read and written by offset
        monkeypatch.setattr(os, "pwrite", full)
        with pytest.raises(ShmError, match="No space left"):
            cache.write(name, 64, b"\0" * 16)
        monkeypatch.setattr(os, "preadv", full)
        with pytest.raises(ShmError, match="No space left"):
            cache.read_into(name, 64, bytearray(16))
    finally:
        cache.close()
    seg = Segment.create(1 << 20)
    try:
        assert os.fstat(seg.lock_fd).st_blocks * 512 >= 1 << 20  # allocated, not sparse
    finally:
        seg.close()
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ShmError, match="cannot allocate"):
        Segment.create(1 << 20)


def test_a_lost_connection_forgets_the_model_specs():
    """A restarted dispatcher may serve a model of another shape: the old spec sized the output
    regions, too small for the new one, and every request was refused until a new client."""
    from batchyard.client_codec import ClientCodec

    codec = ClientCodec("ipc:///nowhere")
    codec.specs["m"] = object()
    codec.lost_connection()
    assert codec.needs_spec("m")


def test_the_grant_sweep_looks_at_each_segment_once_however_many_connections_hold_it(tmp_path, monkeypatch):
    """One segment registered over 100,000 connections (which then closed) made each sweep stat
    it 100,000 times on the dispatcher's thread (375 ms)."""
    from batchyard import shm_grants
    from batchyard.shm_grants import ShmGrants, file_id

    (tmp_path / "seg").write_bytes(b"x")
    (tmp_path / "gone").write_bytes(b"x")
    g = ShmGrants(str(tmp_path))
    for i in range(1000):
        g.granted[(b"\0%d" % i, "")] = {"seg": file_id(os.stat(tmp_path / "seg")),
                                        "gone": file_id(os.stat(tmp_path / "gone"))}
    (tmp_path / "gone").unlink()
    calls = []
    real = os.stat
    monkeypatch.setattr(shm_grants.os, "stat", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    g.sweep()
    assert len(calls) == 2
    assert all(segs.keys() == {"seg"} for segs in g.granted.values()) and len(g.granted) == 1000


def test_a_client_of_another_user_than_a_non_root_node_sends_inline(tmp_path, monkeypatch):
    """Its segments are 0600 and its own: neither the dispatcher's proof nor a worker of the
    node's user can open them, and every tensor of 64 KiB or more was refused. The SDK reads the
    node's user off the ipc socket file (the dispatcher's own) and sends inline instead."""
    from batchyard.client_codec import ClientCodec

    sock = tmp_path / "fe"
    sock.write_bytes(b"")
    node_uid = os.stat(sock).st_uid
    if os.getuid() == 0:  # a node of an unprivileged user
        node_uid = 54321
        os.chown(sock, node_uid, -1)
    monkeypatch.setattr(os, "getuid", lambda: 12345)  # a client of another (non-root) user
    assert ClientCodec(f"ipc://{sock}").shared_memory is False
    monkeypatch.setattr(os, "getuid", lambda: node_uid)  # the node's own user
    assert ClientCodec(f"ipc://{sock}").shared_memory is True
    assert ClientCodec(f"ipc://{tmp_path}/not-bound-yet").shared_memory is True
    assert ClientCodec(f"ipc://{sock}", shared_memory=True).shared_memory is True  # asked for: as asked


def test_an_idle_worker_lets_go_of_a_departed_clients_segments(start_node):
    """A worker let go of segments whose client was gone only after its next batch: an idle one
    kept a closed client's pool (64 MiB) allocated, and in Docker's 64 MiB /dev/shm the next
    client had no room for its own, every big request refused."""
    import time

    from batchyard.client import Client

    node = start_node([sim_worker()])
    with node.client() as watcher:
        worker_pid = watcher.status().workers[0].pid
        with Client(node.address) as c:
            x = c.alloc_array((1, 256, 1024), np.float32)
            x[...] = 1
            c.infer("big", {"x": x})
            segments = c._codec.pool.segment_names()
        # the worker opened the client's segment, unlinked by its close
        assert any(s in t for t in _deleted_segments_held(worker_pid) for s in segments)
        deadline = time.monotonic() + 10
        while any(s in t for t in _deleted_segments_held(worker_pid) for s in segments):  # each look: a round trip
            assert time.monotonic() < deadline, f"still held: {_deleted_segments_held(worker_pid)}"
            watcher.status()


def _register(grants, conn: tuple, shm_dir, segment: str) -> P.ShmReply:
    """Both steps of a registration, straight to ``ShmGrants`` (the challenge written as a client would)."""
    first = grants.answer(P.ShmRegisterRequest(v=1, id=1, segment=segment), conn, True)
    if first.status != P.Status.OK:
        return first
    with open(os.path.join(shm_dir, segment), "r+b") as f:
        f.write(first.challenge)
    return grants.answer(P.ShmRegisterRequest(v=1, id=2, segment=segment, proved=True), conn, True)


def _sweep_through(grants) -> None:
    while not grants.sweep():
        pass


def test_one_users_abandoned_registrations_do_not_evict_anothers(tmp_path, monkeypatch):
    """The node's oldest half-way registration was forgotten past PENDING_CONNECTIONS, whoever's:
    uid nobody, looping step 1 and a failed step 2 over 6,000 connections, made every root
    client's first registration fail "no challenge outstanding". Each holder now evicts only its
    own; node-wide, the holder with the most loses its oldest."""
    from batchyard import shm_grants
    from batchyard.shm_grants import ShmGrants

    monkeypatch.setattr(shm_grants, "PENDING_CONNECTIONS", 8)
    monkeypatch.setattr(shm_grants, "PENDING_CONNECTIONS_PER_HOLDER", 4, raising=False)
    (tmp_path / "mine").write_bytes(bytes(64))
    g = ShmGrants(str(tmp_path))
    me = (b"\0" + secrets.token_bytes(4), f"localhost:{os.getuid()}:0:{os.getpid()}")
    challenge, why = g.challenge(me, "mine")
    assert why == ""
    others = [(b"\0" + secrets.token_bytes(4), f"localhost:{os.getuid() + 1 + k % 3}:0:{k + 1}")
              for k in range(100)]  # three other users' connections, each registering half-way
    for conn in others:
        assert g.challenge(conn, "theirs")[1] == ""
    assert len(g.pending) <= 8 and me in g.pending
    write_challenge(str(tmp_path / "mine"), challenge)
    assert g.prove(me, "mine") == ""
    # The node full, two users with as many half-way: the asking one loses its own oldest (the
    # first of the two in the node's order lost one, whoever asked).
    monkeypatch.setattr(shm_grants, "PENDING_CONNECTIONS", 4)
    g = ShmGrants(str(tmp_path))
    b = [(b"\0" + secrets.token_bytes(4), f"localhost:{os.getuid() + 7}:0:{k + 1}") for k in range(2)]
    a = [(b"\0" + secrets.token_bytes(4), f"localhost:{os.getuid() + 8}:0:{k + 1}") for k in range(3)]
    for conn in b + a[:2]:
        g.challenge(conn, "theirs")
    g.challenge(a[2], "theirs")
    assert all(conn in g.pending for conn in b) and a[0] not in g.pending


def test_grants_past_a_users_cap_are_refused_until_some_are_given_back(tmp_path, monkeypatch):
    """Grants had no limit and outlive their connection: one client made 200,000 (hard links of
    its own files) and closed it, and every sweep then held the dispatcher for all of them
    (777 ms). A uid holds at most GRANTS_PER_UID (3 here), over all its connections."""
    from batchyard import shm_grants
    from batchyard.shm_grants import ShmGrants

    monkeypatch.setattr(shm_grants, "GRANTS_PER_UID", 3, raising=False)
    for k in range(5):
        (tmp_path / f"seg{k}").write_bytes(bytes(64))
    g = ShmGrants(str(tmp_path))
    me = f"localhost:{os.getuid()}:0:{os.getpid()}"
    a, b = (b"\0" + secrets.token_bytes(4), me), (b"\0" + secrets.token_bytes(4), me)
    for conn, seg in ((a, "seg0"), (a, "seg1"), (b, "seg2")):
        assert _register(g, conn, tmp_path, seg).status == P.Status.OK
    refused = _register(g, b, tmp_path, "seg3")  # a closed connection's grants count too
    assert refused.status == P.Status.PERMISSION_DENIED, refused
    assert f"uid {os.getuid()} holds 3 shared-memory grants" in refused.message
    assert "unregister segments no longer used" in refused.message
    _sweep_through(g)  # the dispatcher's housekeeping ticks carry on the sweep a refusal begins
    assert _register(g, a, tmp_path, "seg0").status == P.Status.OK  # granted again, not counted again
    tcp = (b"\0" + secrets.token_bytes(4), "127.0.0.1")  # no uid: counted under its address
    assert _register(g, tcp, tmp_path, "seg4").status == P.Status.OK
    g.answer(P.ShmUnregisterRequest(v=1, id=3, segment="seg1"), a, True)
    assert _register(g, b, tmp_path, "seg3").status == P.Status.OK  # the one given back
    assert _register(g, b, tmp_path, "seg4").status == P.Status.PERMISSION_DENIED
    (tmp_path / "seg3").unlink()  # its client unlinked it: the sweep gives its grant back
    _sweep_through(g)
    assert _register(g, b, tmp_path, "seg4").status == P.Status.OK
    assert g.held == {("uid", os.getuid()): 3, ("address", "loopback"): 1}


def _infer_naming(segments) -> P.InferRequest:
    return P.InferRequest(v=1, id=1, model="sum", inputs=[
        P.TensorRef(name=f"x{k}", dtype="FP32", shape=[4], shm=P.ShmRef(s, 64, 16)) for k, s in enumerate(segments)])


def test_a_clients_reconnects_do_not_fill_its_users_grant_cap(tmp_path, monkeypatch):
    """An SDK client registers its segments again on each ZeroMQ reconnect (heartbeat timeout,
    a restarted dispatcher); the old connection's grants, their files still there, stayed and
    counted, and after GRANTS_PER_UID of them (3 here) every client of that user was refused
    shared memory until those processes exited. A process's grant moves to its newest
    connection."""
    client, other_peer, holds = (f"localhost:{os.getuid()}:0:4242", f"localhost:{os.getuid()}:0:9999",
                                 ("uid", os.getuid()))
    from batchyard import shm_grants
    from batchyard.shm_grants import ShmGrants

    monkeypatch.setattr(shm_grants, "GRANTS_PER_UID", 3, raising=False)
    pool = ["batchyard_4242_0", "batchyard_4242_1"]
    for seg in (*pool, "batchyard_9999_0"):
        (tmp_path / seg).write_bytes(bytes(64))
    g = ShmGrants(str(tmp_path))
    conns = [(b"\0" + k.to_bytes(4, "big"), client) for k in range(10)]  # the same process, reconnecting
    for conn in conns:
        assert [_register(g, conn, tmp_path, seg).status for seg in pool] == [P.Status.OK, P.Status.OK]
        assert g.files(_infer_naming(pool), conn, True)[1] == ""
        _sweep_through(g)
    assert g.held == {holds: 2}
    assert "not registered on this connection" in g.files(_infer_naming(pool), conns[-2], True)[1]
    # Another process of the same user: registers what it proves, gains nothing of the client's.
    other = (b"\0new", other_peer)
    assert _register(g, other, tmp_path, "batchyard_9999_0").status == P.Status.OK
    assert "not registered on this connection" in g.files(_infer_naming(pool[:1]), other, True)[1]
    assert g.files(_infer_naming(pool), conns[-1], True)[1] == ""


@pytest.mark.parametrize("peer", ["127.0.0.1", f"localhost:{os.getuid()}:0:0"], ids=["tcp", "pid-0"])
def test_two_local_tcp_clients_that_prove_one_segment_both_use_it(tmp_path, peer):
    """Over tcp a peer tells no process: two local processes (a parent's buffer its children
    share) are told apart by nothing but their connections, and a grant moved between a host's
    connections took the segment from the first child (INVALID_ARGUMENT "not registered on this
    connection"). Grants stay with their connections there."""
    from batchyard.shm_grants import ShmGrants

    (tmp_path / "shared").write_bytes(bytes(64))
    g = ShmGrants(str(tmp_path))
    # (pid 0: processes outside a containerised dispatcher's pid namespace, all alike to it)
    children = [(b"\0" + secrets.token_bytes(4), peer) for _ in range(2)]
    assert [_register(g, conn, tmp_path, "shared").status for conn in children] == [P.Status.OK, P.Status.OK]
    assert [g.files(_infer_naming(["shared"]), conn, True)[1] for conn in children] == ["", ""]


def test_tcp_peers_on_loopback_addresses_share_one_grant_cap(tmp_path, monkeypatch):
    """Over tcp (allow_shm_over_tcp) a peer has no uid and counts under its address; a local
    client connects from any of 127/8 as it likes, and each address had a cap of its own."""
    from batchyard import shm_grants
    from batchyard.shm_grants import ShmGrants

    monkeypatch.setattr(shm_grants, "GRANTS_PER_UID", 2, raising=False)
    for k in range(3):
        (tmp_path / f"seg{k}").write_bytes(bytes(64))
    g = ShmGrants(str(tmp_path))
    peers = [(b"\0" + secrets.token_bytes(4), ip) for ip in ("127.0.0.2", "127.0.0.3", "::1")]
    assert [_register(g, conn, tmp_path, f"seg{k}").status for k, conn in enumerate(peers)] == [
        P.Status.OK, P.Status.OK, P.Status.PERMISSION_DENIED]


def test_the_grant_sweep_looks_at_a_bounded_number_of_names_per_call(tmp_path):
    """Each janitor sweep went through every grant at once on the dispatcher's one thread: 20,000
    grants held every other client 117 ms. A call looks at SWEEP_STATS_PER_CALL names at most (4
    here); the dispatcher makes one a housekeeping tick until the sweep is done."""
    from batchyard.shm_grants import ShmGrants

    g = ShmGrants(str(tmp_path))
    me = f"localhost:{os.getuid()}:0:{os.getpid()}"
    conn = (b"\0" + secrets.token_bytes(4), me)
    for k in range(10):
        (tmp_path / f"seg{k}").write_bytes(bytes(64))
        assert _register(g, conn, tmp_path, f"seg{k}").status == P.Status.OK
    for k in range(0, 10, 2):
        (tmp_path / f"seg{k}").unlink()
    calls = 1
    while not g.sweep(max_stats=4):
        calls += 1
    assert calls == 3 and not g.sweeping
    assert set(g.granted[conn]) == {f"seg{k}" for k in range(1, 10, 2)}
    assert g.held == {("uid", os.getuid()): 5}


def test_the_dispatcher_answers_while_the_orphan_reaper_works(run_dir, monkeypatch):
    """The janitor's reaper lists /dev/shm and opens every `batchyard_*` name, and any local user
    may make 200,000 of them: swept at once on the dispatcher's one thread, no client was answered
    for 3.5 s each janitor_interval_s. A step takes REAP_ENTRIES_PER_TICK entries of it at most."""
    import asyncio
    import time

    from batchyard import server
    from batchyard.config import DispatcherConfig
    from batchyard.server import Dispatcher

    from conftest import SUM_MODEL

    entries, started, closed = 10 * server.REAP_ENTRIES_PER_TICK, [], []
    looked = [0]

    def many_names():  # a /dev/shm full of names, none of them an orphan
        started.append(1)
        try:
            for _ in range(entries):
                looked[0] += 1
                yield None
        finally:
            closed.append(1)

    monkeypatch.setattr(server, "reaping", many_names)
    ctx = zmq.Context()
    d = Dispatcher(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                   (SUM_MODEL.spec(),), ctx=ctx)
    d.loop = asyncio.new_event_loop()  # never run: the steps are taken below
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.connect(f"ipc://{run_dir}/fe")
    try:
        client.send(msgspec.msgpack.encode({"type": "status", "v": 1, "id": 1, "brief": True}))
        deadline = time.monotonic() + 10
        while not client.poll(0):
            assert time.monotonic() < deadline, "no status reply"
            d._step_once()
        assert P.reply_decoder.decode(client.recv_multipart()[0]).status == P.Status.OK
        assert 0 < looked[0] < entries  # answered while the sweep goes on, a slice a step
        d._next_janitor = d._next_housekeeping = 0.0
        before = looked[0]
        d._step_once()  # the next janitor tick, the sweep still under way: not a second one
        assert started == [1] and looked[0] - before <= server.REAP_ENTRIES_PER_TICK
    finally:
        client.close()
        d.close()
        d.loop.close()
        ctx.term()
    assert closed == [1]  # the listing is let go with the dispatcher


def test_a_non_root_reaper_does_not_open_names_of_users_whose_files_it_cannot_unlink(tmp_path, monkeypatch):
    """A non-root node's janitor opened, locked and failed to unlink (sticky /dev/shm) each of the
    200,000 names another user planted: 1.1-2.8 s a sweep. Another user's names are passed over
    on their directory entry; its own orphans are reaped as before."""
    from batchyard import shm

    os.chmod(tmp_path, 0o1777)
    planted = [f"batchyard_1_{k:012x}" for k in range(300)]
    for name in planted:
        (tmp_path / name).write_bytes(b"")
    node_uid = os.geteuid() + 4321  # the node's user; the planted names are someone else's
    own = "batchyard_2_00000000beef"
    (tmp_path / own).write_bytes(b"")
    root = os.geteuid() == 0  # asked now: the monkeypatch below patches os.geteuid itself
    if root:
        os.chown(tmp_path / own, node_uid, -1)
    opened, real_open = [], os.open
    monkeypatch.setattr(shm.os, "geteuid", lambda: node_uid)
    monkeypatch.setattr(shm.os, "open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k))
    reaped = shm.reap_orphans(str(tmp_path))
    assert not [p for p in opened if os.path.basename(p) in planted]
    assert all((tmp_path / name).exists() for name in planted)
    if root:
        assert reaped == [own]


def test_a_new_client_looks_at_a_bounded_number_of_names(tmp_path, monkeypatch):
    """Every new SDK client reaped /dev/shm, all of it: 200,000 names anyone made there made
    each one wait seconds. It looks at CLIENT_REAP_ENTRIES names (100 here); the dispatcher's
    janitor gets the rest."""
    from batchyard import client_codec, shm
    from batchyard.client_codec import ClientCodec

    for k in range(300):
        (tmp_path / f"batchyard_1_{k:012x}").write_bytes(b"")  # orphans: no owner holds a lock
    monkeypatch.setattr(client_codec, "CLIENT_REAP_ENTRIES", 100, raising=False)
    monkeypatch.setattr(client_codec, "reap_orphans", lambda **kw: shm.reap_orphans(str(tmp_path), **kw))
    ClientCodec("ipc:///nowhere")
    assert len(os.listdir(tmp_path)) == 200
