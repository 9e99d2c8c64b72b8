"""Transport security of a live node: CURVE on tcp, shm references refused over tcp, ipc socket
file permissions, oversized frames dropped by ZeroMQ while everyone else is served."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from batchyard.addresses import free_port
from batchyard import protocol as P
from batchyard.transport import read_keypair, write_keypair

from conftest import SUM_MODEL, Node, sim_worker, spawn_up

X1 = np.ones((1, 4), np.float32).tobytes()


def infer_header(rid=1, **fields) -> bytes:
    h = {"type": "infer", "v": 1, "id": rid, "model": "sum",
         "inputs": [{"name": "x", "dtype": "float32", "shape": [1, 4], "frame": 0}]}
    h.update(fields)
    return msgspec.msgpack.encode(h)


@pytest.fixture
def tcp_node(run_dir):
    nodes = []

    def start(**dispatcher):
        cfg, up = spawn_up(run_dir, [sim_worker(models=("sum",))], [SUM_MODEL], dispatcher, stdout=subprocess.DEVNULL)
        node = Node(cfg, up, run_dir)
        nodes.append(node)
        return node

    yield start
    for n in nodes:
        n.stop()


def dealer(address: str, keys: tuple[bytes, bytes] | None = None, server_key: bytes | None = None) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if keys:
        s.curve_publickey, s.curve_secretkey = keys
        s.curve_serverkey = server_key
    s.connect(address)
    return s


def roundtrip(s: zmq.Socket, frames, timeout_ms=60_000):
    """The reply, or None if none came within ``timeout_ms``. A DEALER whose CURVE handshake was
    refused may have no peer left to queue to, and a blocking send then waited for good (a clean-
    clone CI run hung here 300 s): the send is bounded too, and a send that cannot go is no reply."""
    s.setsockopt(zmq.SNDTIMEO, timeout_ms)
    try:
        s.send_multipart(frames)
    except zmq.Again:
        return None
    if not s.poll(timeout_ms):
        return None
    return P.reply_decoder.decode(s.recv_multipart()[0])


def ready(s: zmq.Socket) -> P.StatusReply:
    """Wait (long poll) until the node's worker registered."""
    return roundtrip(s, [msgspec.msgpack.encode({"type": "status", "v": 1, "id": 0, "min_registrations": 1,
                                                 "wait_us": 120_000_000})], timeout_ms=180_000)


def test_shm_references_are_refused_on_a_tcp_endpoint_inline_works(tcp_node, run_dir):
    node = tcp_node(frontend=f"tcp://127.0.0.1:{free_port()}")
    with dealer(node.address) as s:
        assert ready(s).registrations >= 1
        shm = {"segment": "batchyard_1_victim", "offset": 0, "nbytes": 16}
        for frames in ([infer_header(2, inputs=[{"name": "x", "dtype": "float32", "shape": [1, 4], "shm": shm}])],
                       [infer_header(3, outputs={"y": shm}), X1]):
            reply = roundtrip(s, frames)
            assert reply.status == P.Status.PERMISSION_DENIED and "tcp" in reply.message
        ok = roundtrip(s, [infer_header(4), X1])
        assert ok.status == P.Status.OK


def test_curve_lets_only_authorized_clients_in(tcp_node, run_dir):
    keys = Path(run_dir) / "keys"
    _, server_secret = write_keypair(str(keys / "server"), "node")
    write_keypair(str(keys / "authorized"), "alice")
    _, alice_secret = write_keypair(str(keys / "alice"), "alice")  # a copy kept by the client
    (keys / "alice" / "alice.key").replace(keys / "authorized" / "alice.key")
    _, mallory_secret = write_keypair(str(keys / "mallory"), "mallory")
    server_public, _ = read_keypair(server_secret)
    node = tcp_node(frontend=f"tcp://127.0.0.1:{free_port()}", curve_secret_key=server_secret,
                    curve_authorized_keys=str(keys / "authorized"))
    with dealer(node.address, read_keypair(alice_secret), server_public) as alice:
        assert ready(alice).registrations >= 1
        assert roundtrip(alice, [infer_header(5), X1]).status == P.Status.OK
    for keys_ in (None, read_keypair(mallory_secret)):  # no CURVE at all; a key not authorized
        with dealer(node.address, keys_, server_public if keys_ else None) as s:
            assert roundtrip(s, [infer_header(6), X1], timeout_ms=1500) is None  # the handshake never completes


def test_ipc_socket_files_are_not_world_accessible(start_node):
    node = start_node([sim_worker()])
    path = node.address[len("ipc://"):]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660


def test_an_oversized_frame_drops_only_its_sender(start_node):
    node = start_node([sim_worker()], max_inline_bytes=4096, max_message_bytes=8192)
    with dealer(node.address) as big, node.client() as good:
        big.send_multipart([infer_header(7), b"\0" * 100_000])  # ZeroMQ disconnects this peer
        assert good.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"].tolist() == [[4.0, 4.0]]
        assert not big.poll(500)  # and it got nothing back


def test_workers_and_clients_reach_a_curve_secured_tcp_backend_and_frontend(tcp_node, run_dir):
    """Both endpoints on tcp with CURVE: the worker (node key) registers through the backend,
    `up` (node key) sees it ready, and an authorized client is served."""
    keys = Path(run_dir) / "keys"
    _, server_secret = write_keypair(str(keys), "node")
    _, bob_secret = write_keypair(str(keys), "bob")
    server_public, _ = read_keypair(server_secret)
    node = tcp_node(frontend=f"tcp://127.0.0.1:{free_port()}", backend=f"tcp://127.0.0.1:{free_port()}",
                    curve_secret_key=server_secret, curve_authorized_keys=str(keys))
    with dealer(node.address, read_keypair(bob_secret), server_public) as bob:
        assert ready(bob).registrations >= 1
        assert roundtrip(bob, [infer_header(8), X1]).status == P.Status.OK
    # A client's authorized key does not open the backend: registered as a worker, a client was
    # given other clients' batches (the handshake now never completes)
    with dealer(node.cfg.dispatcher.backend, read_keypair(bob_secret), server_public) as rogue:
        register = P.encode(P.Register(v=P.PROTOCOL_VERSION, worker="rogue", pid=1, path="cpu",
                                       models=[SUM_MODEL.spec()]))
        rogue.send(register)
        assert not rogue.poll(1500)
    # `batchyard status --config` reaches it with the node's key (--address alone could not)
    r = subprocess.run([sys.executable, "-m", "batchyard.cli", "status", "--config", f"{run_dir}/node.toml"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["registrations"] >= 1, r.stderr


def test_a_peer_on_the_workers_socket_that_never_reads_does_not_hold_the_dispatcher(run_dir):
    """Heartbeats under a name not registered are answered "register again". A peer that sent them
    and never read the answers filled its send queue, and with ROUTER_MANDATORY the next answer
    waited for room: the dispatcher's one thread held for good, no client answered, SIGTERM unheard.
    (The queue of 100,000 answers is made 10 here, for the pipe this peer opens.)"""
    import threading
    import time

    import zmq

    from batchyard import protocol as P
    from batchyard.config import DispatcherConfig
    from batchyard.server import Dispatcher

    from conftest import SUM_MODEL

    ctx = zmq.Context()
    d = Dispatcher(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                   (SUM_MODEL.spec(),), ctx=ctx)
    ghost = ctx.socket(zmq.DEALER)
    ghost.setsockopt(zmq.LINGER, 0)
    ghost.setsockopt(zmq.RCVHWM, 1)
    ghost.setsockopt(zmq.RCVBUF, 4096)
    ghost.setsockopt(zmq.IDENTITY, b"ghost#hb")
    try:
        d.backend.setsockopt(zmq.SNDHWM, 10)  # for pipes made from now on: the ghost's
        ghost.connect(f"ipc://{run_dir}/be")
        answer = P.encode(P.Reregister(worker="ghost"))
        deadline = time.monotonic() + 10
        while not d._send_worker(b"ghost#hb", answer):  # EHOSTUNREACH until the ghost's handshake is done
            assert time.monotonic() < deadline, "the ghost never connected"
        answers = []
        sender = threading.Thread(target=lambda: answers.extend(
            d._send_worker(b"ghost#hb", answer) for _ in range(100_000)), daemon=True)
        sender.start()
        sender.join(60)
        assert not sender.is_alive(), "a send to a peer that reads nothing blocked the dispatcher"
        assert answers[0] is True and answers[-1] is False  # the queue filled; the rest were dropped
    finally:
        ghost.close()
        d.close()
        ctx.term()


def test_a_failed_tcp_handshake_names_curve_as_a_possible_cause_a_lost_connection_does_not():
    """A CURVE node drops a client that offers no key at the handshake: `batchyard status --address`
    against one said "lost the connection", as if the node had died. A connection lost after its
    handshake (the node stopped; a frame over its limit) has nothing to do with keys."""
    from batchyard.client_codec import lost_error

    msg = str(lost_error("tcp://127.0.0.1:7755", "handshake with the dispatcher failed"))
    assert "if the node uses CURVE" in msg and "status --config" in msg
    assert "CURVE" not in str(lost_error("ipc:///run/batchyard/fe", "handshake with the dispatcher failed"))
    assert "CURVE" not in str(lost_error("tcp://127.0.0.1:7755", "lost the connection to the dispatcher"))


def _map(*pairs) -> bytes:
    """A MessagePack map with these (key, value) pairs in this order, a key given twice kept."""
    return bytes([0x80 | len(pairs)]) + b"".join(msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v)
                                                 for k, v in pairs)


@pytest.mark.parametrize("second_type", ["infer", "status", 7])
def test_a_malformed_cancel_with_a_second_type_is_not_answered_under_the_id_it_names(run_dir, second_type):
    # Read as a dict, the last `type` hid the first ("cancel"): the malformed message was answered
    # INVALID_ARGUMENT under the id of the request it names, which got that result before its own.
    from test_client_edges import _dispatcher_on_tcp

    with _dispatcher_on_tcp(run_dir) as address:  # no workers: request 5 waits until its deadline
        s = dealer(address)
        try:
            s.send_multipart([infer_header(5, timeout_us=300_000), X1])
            s.send(_map(("type", "cancel"), ("v", 1), ("id", 5), ("type", second_type)))
            replies = []
            while len(replies) < 2 and s.poll(5000):
                replies.append(P.reply_decoder.decode(s.recv_multipart()[0]))
        finally:
            s.close()
    assert sorted((r.id or 0, r.status) for r in replies) == [(0, P.Status.INVALID_ARGUMENT),
                                                              (5, P.Status.UNAVAILABLE)], replies


def test_a_keygen_that_cannot_place_its_public_key_leaves_no_lone_secret_key(tmp_path):
    """The secret key was linked into place first: with a NAME.key there (made since the
    command's check), the secret stayed alone, and every later keygen refused the name."""
    (tmp_path / "n0.key").write_text("someone's public key")
    with pytest.raises(FileExistsError):
        write_keypair(str(tmp_path), "n0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n0.key"]
    assert (tmp_path / "n0.key").read_text() == "someone's public key"


def test_a_dispatcher_whose_backend_is_served_elsewhere_leaves_no_frontend_socket_file(run_dir):
    """Its frontend bound, then its backend refused: the frontend's socket file stayed behind (no
    close() ran for a dispatcher never made)."""
    import socket

    from batchyard.config import DispatcherConfig
    from batchyard.server import Dispatcher
    from batchyard.transport import EndpointInUse

    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # another process's live listener
    other.bind(f"{run_dir}/be")
    other.listen(1)
    ctx = zmq.Context()
    try:
        with pytest.raises(EndpointInUse):
            Dispatcher(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"), (), ctx=ctx)
        assert not os.path.lexists(f"{run_dir}/fe")
        assert os.path.exists(f"{run_dir}/be")  # the other's, untouched
    finally:
        other.close()
        ctx.term()
