"""The front door's system shared-memory registry, shared by the front-door processes of a node
(several of them serve one port with SO_REUSEPORT; Triton's registry is server-wide)."""

from __future__ import annotations

import os
import socket
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest

from batchyard import protocol as P
from batchyard.kserve_common import KServeError
from batchyard.kserve_shm import ShmRegions

SPEC = P.ModelSpec("m", (P.TensorSpec("x", "float32", (4,)),), (P.TensorSpec("y", "float32", (4,)),), 8)


@pytest.fixture
def registry(tmp_path):
    d = str(tmp_path / "registry")
    opened = []

    def front_door() -> ShmRegions:
        opened.append(ShmRegions(d))
        return opened[-1]

    yield front_door
    for r in opened:
        r.close()
    assert not os.path.exists(d), "the last front door out leaves no registry behind"


@pytest.fixture
def segment():
    seg = shared_memory.SharedMemory(f"kshm_{os.getpid()}", create=True, size=64)
    np.ndarray((16,), np.float32, buffer=seg.buf)[...] = np.arange(16, dtype=np.float32)
    yield seg
    seg.close()
    seg.unlink()


def test_a_region_registered_in_one_process_serves_in_another(registry, segment):
    a, b = registry(), registry()
    a.register("in", segment.name, 0, 64)
    got = b.read("in", 0, 16, "FP32", [1, 4], "x", SPEC)
    np.testing.assert_array_equal(got, [[0, 1, 2, 3]])
    out = b.output("in", 16, 16, "y", 16)
    out.write(np.full(4, 7.0, np.float32), "y")
    out.close()
    np.testing.assert_array_equal(a.read("in", 16, 16, "FP32", [1, 4], "x", SPEC), [[7, 7, 7, 7]])
    assert [r.name for r in b.status()] == ["in"]


@pytest.mark.parametrize("name", ["n" * 300, "\udc80 lone surrogate", "région ✓"])
def test_a_region_may_have_any_name(registry, segment, name):
    """A client picks the name; a long one made the registry's file name too long and a lone
    surrogate (JSON's "\\udc80") none at all: both were internal errors, before and after
    registering."""
    a, b = registry(), registry()
    with pytest.raises(KServeError) as e:
        b.read(name, 0, 16, "FP32", [1, 4], "x", SPEC)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    a.register(name, segment.name, 0, 64)
    np.testing.assert_array_equal(b.read(name, 0, 16, "FP32", [1, 4], "x", SPEC), [[0, 1, 2, 3]])
    assert [r.name for r in b.status(name)] == [name]
    b.unregister(name)
    assert a.status() == []


def test_one_name_once_across_processes(registry, segment):
    a, b = registry(), registry()
    a.register("in", segment.name, 0, 64)
    with pytest.raises(KServeError) as e:
        b.register("in", segment.name, 0, 32)
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS


def test_unregister_anywhere_ends_the_region_everywhere(registry, segment):
    a, b = registry(), registry()
    a.register("in", segment.name, 0, 64)
    b.read("in", 0, 16, "FP32", [1, 4], "x", SPEC)  # b has it mapped now
    a.unregister("in")
    with pytest.raises(KServeError) as e:
        b.read("in", 0, 16, "FP32", [1, 4], "x", SPEC)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    # Registered again with a smaller size: b must see the new entry, not its old mapping.
    a.register("in", segment.name, 16, 16)
    np.testing.assert_array_equal(b.read("in", 0, 16, "FP32", [1, 4], "x", SPEC), [[4, 5, 6, 7]])
    with pytest.raises(KServeError):
        b.read("in", 16, 16, "FP32", [1, 4], "x", SPEC)


def test_an_output_goes_where_its_region_was_when_the_request_came(registry, segment):
    """An output region unregistered while its request runs, and its name registered again by
    another client over another segment: the output lands in the first segment, and nothing in the
    second (written by name after the inference, it went into the other client's memory)."""
    other = shared_memory.SharedMemory(f"kshm_other_{os.getpid()}", create=True, size=64)
    try:
        other.buf[:] = b"\xaa" * 64
        a, b = registry(), registry()
        a.register("out", segment.name, 0, 64)
        out = a.output("out", 16, 16, "y", 16)  # as the request is read
        b.unregister("out")
        b.register("out", other.name, 0, 64)
        out.write(np.full(4, 7.0, np.float32), "y")  # as the reply is written
        out.close()
        np.testing.assert_array_equal(np.ndarray((16,), np.float32, buffer=segment.buf)[4:8], [7, 7, 7, 7])
        assert bytes(other.buf) == b"\xaa" * 64
    finally:
        other.close()
        other.unlink()


def test_a_region_whose_segment_was_replaced_is_not_opened_by_another_process(registry, tmp_path):
    """Another front-door process opens a region's key again by name: a root client's segment
    unlinked and another file made under its name (by another user, root's clients may name any
    user's segment) took root's outputs and gave its inputs. The file registered, or an error."""
    name = f"kshm_swap_{os.getpid()}"
    first = shared_memory.SharedMemory(name, create=True, size=64)
    try:
        a, b = registry(), registry()
        a.register("r", name, 0, 64, uid=0)
        first.unlink()  # gone, not unregistered
        planted = shared_memory.SharedMemory(name, create=True, size=64)
        try:
            planted.buf[:] = b"\xaa" * 64
            with pytest.raises(KServeError, match="the segment registered is gone"):
                b.output("r", 0, 16, "y", 16)
            with pytest.raises(KServeError, match="the segment registered is gone"):
                b.read("r", 0, 16, "FP32", [1, 4], "x", SPEC)
            assert bytes(planted.buf) == b"\xaa" * 64
        finally:
            planted.close()
            planted.unlink()
    finally:
        first.close()


def _fds_on(path: str) -> int:
    """This process's open fds on ``path``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:
            pass
    return n


def test_a_region_unregistered_elsewhere_lets_go_of_its_segment(registry, segment):
    """A region unregistered through one front-door process: another that had opened its segment
    closes it at its next registry call or sweep, instead of holding the client's memory after the
    client unlinked it (it closed it only if a request named the region again)."""
    path = f"/dev/shm/{segment.name}"
    a, b, c = registry(), registry(), registry()
    a.register("in", segment.name, 0, 64)
    b.read("in", 0, 16, "FP32", [1, 4], "x", SPEC)
    c.read("in", 0, 16, "FP32", [1, 4], "x", SPEC)
    held = _fds_on(path)
    a.unregister("in")
    assert _fds_on(path) == held - 1
    b.status()
    assert _fds_on(path) == held - 2
    c.sweep()  # the front door's timer
    assert _fds_on(path) == held - 3


def test_a_restarted_front_door_starts_with_no_regions(registry, segment, tmp_path):
    a = registry()
    a.register("in", segment.name, 0, 64)
    survivor = registry()  # while one front door serves, a new one keeps the registrations
    assert [r.name for r in survivor.status()] == ["in"]
    a.close()
    survivor.close()
    fresh = registry()
    assert fresh.status() == []


def test_a_front_door_restarted_within_its_node_keeps_the_registry_and_the_statistics(tmp_path, segment):
    """The only front door, killed and restarted by `up`, started the registry afresh: every
    client's region and the node's statistics were gone. Within one run of the node (`up`
    names it) they are kept; another run starts afresh, as a new node."""
    from batchyard.kserve_stats import SUCCESS, NodeStats

    d = str(tmp_path / "registry")

    def killed(r: ShmRegions) -> None:  # the kernel lets go of its fds; it leaves nothing else
        os.close(r._alive_fd)
        os.close(r._dir_fd)

    a = ShmRegions(d, "run-1")
    a.register("in", segment.name, 0, 64)
    NodeStats(a.dir_fd).counters("m")[SUCCESS] += 3
    killed(a)
    b = ShmRegions(d, "run-1")
    assert [r.name for r in b.status()] == ["in"]
    assert NodeStats(b.dir_fd).totals()["m"][SUCCESS] == 3
    killed(b)
    c = ShmRegions(d, "run-2")
    try:
        assert c.status() == [] and NodeStats(c.dir_fd).totals() == {}
    finally:
        c.close()
    assert not os.path.exists(d)


def test_another_users_directory_is_refused(tmp_path):
    d = tmp_path / "registry"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    with pytest.raises(PermissionError):
        ShmRegions(str(d))


def test_a_front_door_whose_registry_folder_was_taken_serves_with_its_own(tmp_path, segment, caplog):
    # Anyone may make the folder first in /dev/shm (its name is predictable): the front door
    # refused to start, and systemd restarted it for ever.
    from batchyard.kserve_shm import open_registry

    d = tmp_path / "registry"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)  # not a private folder of this user
    regions = open_registry(str(d))
    assert regions.dir_fd is None and "this front-door process's own" in caplog.text
    try:
        regions.register("r", f"/{segment.name}", 0, 16, uid=os.getuid())
        assert [r.name for r in regions.status(uid=os.getuid())] == ["r"]
    finally:
        regions.close()


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_a_file_planted_where_the_registry_folder_goes_does_not_stop_the_front_door(tmp_path, planted, caplog):
    """A plain file or a symlink under the registry's predictable name: NotADirectoryError, which
    only PermissionError was caught for, and no front door of the node started."""
    from batchyard.kserve_shm import open_registry

    d = tmp_path / "registry"
    if planted == "file":
        d.write_bytes(b"")
    else:
        (tmp_path / "elsewhere").mkdir()
        d.symlink_to(tmp_path / "elsewhere")
    regions = open_registry(str(d))
    try:
        assert regions.dir_fd is None and "this front-door process's own" in caplog.text
    finally:
        regions.close()


def test_a_segment_shrunk_under_a_region_is_an_error_not_a_crash(registry, segment):
    """The front door mapped a region's segment once: after its client shrank it, the next
    access past the new end was a SIGBUS that killed the front door (and its restart dropped
    every client's registrations)."""
    a = registry()
    a.register("in", segment.name, 0, 64)
    np.testing.assert_array_equal(a.read("in", 32, 16, "FP32", [1, 4], "x", SPEC), [[8, 9, 10, 11]])
    out = a.output("in", 32, 16, "y", 16)
    os.truncate(f"/dev/shm/{segment.name}", 16)
    for call in (lambda: a.read("in", 32, 16, "FP32", [1, 4], "x", SPEC),
                 lambda: out.write(np.zeros(4, np.float32), "y")):
        with pytest.raises(KServeError) as e:
            call()
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "now 16 bytes long" in e.value.message
    out.close()
    assert os.stat(f"/dev/shm/{segment.name}").st_size == 16  # the write did not grow it back
    np.testing.assert_array_equal(a.read("in", 0, 16, "FP32", [1, 4], "x", SPEC), [[0, 1, 2, 3]])


def test_keys_of_the_nodes_own_segments_and_non_files_are_refused(registry, segment):
    """The Triton worker's regions with its local tritonserver (by_triton_*) hold other clients'
    tensors; a key ending in a newline passed the name check; a FIFO stopped the front door's
    event loop until someone wrote to it."""
    a = registry()
    triton_like = f"by_triton_{os.getpid()}_0a1b2c3d_in"
    fifo = f"kfifo_{os.getpid()}"
    os.link(f"/dev/shm/{segment.name}", f"/dev/shm/{triton_like}")
    os.mkfifo(f"/dev/shm/{fifo}")
    try:
        for key, code in ((triton_like, grpc.StatusCode.INVALID_ARGUMENT),
                          (segment.name + "\n", grpc.StatusCode.INVALID_ARGUMENT),
                          (fifo, grpc.StatusCode.INTERNAL)):
            with pytest.raises(KServeError) as e:
                a.register("r", key, 0, 16)
            assert e.value.code == code, key
        assert a.status() == []
    finally:
        os.unlink(f"/dev/shm/{triton_like}")
        os.unlink(f"/dev/shm/{fifo}")


def test_a_region_read_is_checked_against_the_model_before_any_byte_is_copied(registry):
    """The read copied as many bytes as the request claimed before comparing them with the shape:
    a 2 GiB claim on a sparse 1 TiB file held the front door's loop 7 s and took 2.2 GB, a 1 TiB
    claim was a 500 (MemoryError)."""
    path = "/dev/shm/bytest_sparse_%d" % os.getpid()
    with open(path, "wb") as f:
        f.truncate(1 << 40)
    try:
        a = registry()
        a.register("big", path.rsplit("/", 1)[1], 0, 1 << 40)
        for size, shape, match in ((1 << 31, [1, 4], "unexpected total byte size 2147483648 for input 'x', expecting 16"),
                                   (1 << 40, [1 << 38, 4], r"inference request batch-size must be <= 8 for 'm'"),
                                   (16, [1, 4, 1], r"unexpected shape"), (16, [1, 4], None)):
            if match is None:
                assert a.read("big", 0, size, "FP32", shape, "x", SPEC).shape == (1, 4)
                continue
            with pytest.raises(KServeError, match=match) as e:
                a.read("big", 0, size, "FP32", shape, "x", SPEC)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(KServeError, match="unexpected inference input 'z' for model 'm'"):
            a.read("big", 0, 16, "FP32", [1, 4], "z", SPEC)
    finally:
        os.unlink(path)


def test_statistics_of_a_model_with_a_long_or_non_ascii_name(tmp_path):
    """The statistics file was named by the model's name in hex: past 124 characters (42 CJK
    ones) the name passed the 255-byte limit, and every front-door infer of that model failed."""
    from batchyard.kserve_stats import ITEMS, SUCCESS, NodeStats

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    names = ["m" * 128, "模型" * 40, "sum"]
    try:
        a, b = NodeStats(fd), NodeStats(fd)
        for n in names:
            a.counters(n)[SUCCESS] += 2
            a.counters(n)[ITEMS] += 5
        totals = b.totals()
        a.close()
    finally:
        os.close(fd)
    assert sorted(totals) == sorted(names)
    assert all(totals[n][SUCCESS] == 2 and totals[n][ITEMS] == 5 for n in names)


def test_one_user_registers_a_bounded_number_of_regions(registry, segment, monkeypatch):
    """Each region holds a descriptor in every front-door process that used it: a client
    registering without end ran them out (every client's registrations then failed, 500)."""
    from batchyard import kserve_shm

    monkeypatch.setattr(kserve_shm, "MAX_REGIONS_PER_USER", 3)
    a = registry()
    for i in range(3):
        a.register(f"r{i}", segment.name, 0, 64, uid=0)
    with pytest.raises(KServeError, match="has 3 regions registered already"):
        a.register("r3", segment.name, 0, 64, uid=0)
    a.unregister("r0")
    a.register("r3", segment.name, 0, 64, uid=0)


def test_registrations_racing_through_two_front_doors_stay_within_the_limit(registry, segment, monkeypatch):
    """Counted, then published, with nothing shared in between: registrations arriving at once
    on several front-door processes each passed the count (1026 regions of one user with 4
    processes, 1024 the limit). Here the other process's registration lands while this one
    opens its segment, after its count."""
    from batchyard import kserve_shm

    monkeypatch.setattr(kserve_shm, "MAX_REGIONS_PER_USER", 2)
    a, b = registry(), registry()
    a.register("r0", segment.name, 0, 64, uid=0)
    open_segment = kserve_shm._open_segment

    def meanwhile_through_the_other_process(*args):
        monkeypatch.setattr(kserve_shm, "_open_segment", open_segment)
        a.register("r1", segment.name, 0, 64, uid=0)
        return open_segment(*args)

    monkeypatch.setattr(kserve_shm, "_open_segment", meanwhile_through_the_other_process)
    with pytest.raises(KServeError, match="has 2 regions registered already"):
        b.register("r2", segment.name, 0, 64, uid=0)
    assert sorted(r.name for r in b.status()) == ["r0", "r1"]
    a.unregister()


def _tcp_line(local: str, remote: str, state: str, uid: int) -> str:
    def hexaddr(hostport: str) -> str:
        host, port = hostport.rsplit(":", 1)
        return bytes(reversed([int(x) for x in host.split(".")])).hex().upper() + f":{int(port):04X}"

    return f"   0: {hexaddr(local)} {hexaddr(remote)} {state} 00000000:00000000 00:00000000 00000000 {uid:5d} 0 1 1\n"


def test_a_clients_uid_is_its_own_established_connections_never_another_ones(tmp_path, monkeypatch):
    # Matched by ports alone, the first line was taken: a connection the attacker had closed from
    # 127.0.0.2 with the same port (TIME_WAIT, listed as uid 0) made it root, free to name any
    # user's segment. And a cache by the peer's port gave a new connection the last one's uid:
    # another user, from a port just let go, saw and used a victim's regions.
    from batchyard import tcp_peer

    def no_netlink(*a):
        raise OSError("netlink refused")

    table = tmp_path / "tcp"
    monkeypatch.setattr(tcp_peer, "TABLES", (str(table),))
    monkeypatch.setattr(tcp_peer, "_diag_uid", no_netlink)  # where netlink is refused, the tables answer
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    server = "127.0.0.1:8001"
    table.write_text(header + _tcp_line("127.0.0.2:40000", server, "06", 0)
                     + _tcp_line("127.0.0.1:40000", server, "01", 65534)
                     + _tcp_line(server, "127.0.0.1:40000", "01", 0))  # the server's own end
    assert tcp_peer.peer_uid("127.0.0.1", 40000, 8001, "127.0.0.1") == 65534
    assert tcp_peer.peer_uid("127.0.0.2", 40000, 8001, "127.0.0.1") is None  # closed: no uid at all
    table.write_text(header + _tcp_line("127.0.0.1:40000", server, "01", 1000))  # the port, reused at once
    assert tcp_peer.peer_uid("127.0.0.1", 40000, 8001, "127.0.0.1") == 1000
    # Our address counts too: the same client port connected to another of our addresses is
    # another connection (where the tables answer for a refused netlink).
    assert tcp_peer.peer_uid("127.0.0.1", 40000, 8001, "127.0.0.2") is None


def test_bound_to_every_address_no_connection_is_guessed_to_be_the_clients(tmp_path, monkeypatch):
    """gRPC bound to every address does not say which one a connection reached. The tables' one
    connection from the client's address and port to our port was taken for it, whatever our
    address: another user, bound to the victim's port with SO_REUSEADDR and connected to another
    of our addresses, half-closed its own socket (no longer listed as established) and passed
    for the victim (its regions unregistered). No uid now: the registration is refused."""
    from batchyard import tcp_peer

    table = tmp_path / "tcp"
    monkeypatch.setattr(tcp_peer, "TABLES", (str(table),))
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    table.write_text(header + _tcp_line("127.0.0.1:40000", "127.0.0.1:8001", "01", 65534))  # the victim's, alone
    assert tcp_peer.peer_uid("127.0.0.1", 40000, 8001, None) is None


@pytest.mark.parametrize("dual_stack", [False, True])
def test_a_clients_uid_comes_from_the_kernel_for_its_one_connection_without_reading_the_tables(monkeypatch,
                                                                                                dual_stack):
    # The tables were read at every request naming a region: each read walks the kernel's whole
    # TCP hash table, 4.5 ms a file on this host, on the front door's loop (shared-memory
    # requests took 13 ms against 2 ms inline, and stalled every other client of the process).
    # A dual-stack client socket (gRPC's) is answered in v4-mapped addresses.
    from batchyard import tcp_peer

    monkeypatch.setattr(tcp_peer, "TABLES", ())  # the answer must come from the socket lookup
    other = os.geteuid() == 0  # as root, the client is another user
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        told, tell = os.pipe()
        done, wait = os.pipe()
        pid = os.fork()
        if pid == 0:  # the client: connects, says its port, holds the connection until told
            try:
                os.close(told)
                os.close(wait)
                if other:
                    os.setuid(65534)  # (no imports from here: the interpreter's files may be root's alone)
                c = socket.socket(socket.AF_INET6 if dual_stack else socket.AF_INET)
                c.connect(("::ffff:127.0.0.1" if dual_stack else "127.0.0.1", port))
                os.write(tell, str(c.getsockname()[1]).encode())
                os.read(done, 1)
            finally:
                os._exit(0)
        os.close(tell)
        os.close(done)
        try:
            theirs = int(os.read(told, 16))  # b"" (an error) if the client died first
            conn, _ = server.accept()
            uid = tcp_peer.peer_uid("127.0.0.1", theirs, port, tcp_peer.bound_address("127.0.0.1"))
            assert uid == (65534 if other else os.geteuid())
            assert tcp_peer.peer_uid("127.0.0.1", theirs, port, "127.0.0.2") is None  # not that connection
            assert tcp_peer.peer_uid("127.0.0.1", theirs % 65535 + 1, port, "127.0.0.1") is None
        finally:
            os.write(wait, b"x")
            os.waitpid(pid, 0)
            os.close(told)
            os.close(wait)
        # The client's end closed (FIN_WAIT or TIME_WAIT, listed as uid 0): no uid at all.
        assert tcp_peer.peer_uid("127.0.0.1", theirs, port, "127.0.0.1") is None
        conn.close()


def test_bound_to_every_address_a_client_is_not_taken_for_another_user_on_the_same_local_port():
    # gRPC does not say which of our addresses a connection reached. Guessed (the peer's own,
    # then 127.0.0.1), a user who connected from the victim's local port (gRPC's client sockets
    # set SO_REUSEADDR) to 127.0.0.2 passed for the victim, connected to 127.0.0.1: the lookup
    # of the guess found the victim's socket. Unknown, the one connection from the peer's address
    # and port to our port must be the only one, whatever our address.
    from batchyard import tcp_peer

    if os.geteuid() != 0:
        pytest.skip("needs root to connect as two users")
    assert tcp_peer.bound_address("0.0.0.0") is None and tcp_peer.bound_address("::") is None
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.socket() as probe:  # a free local port for both clients
            probe.bind(("127.0.0.1", 0))
            theirs = probe.getsockname()[1]
        children, pipes = [], []
        for uid, ours in ((65534, "127.0.0.1"), (4321, "127.0.0.2")):
            told, tell = os.pipe()
            done, wait = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(told)
                    os.close(wait)
                    os.setuid(uid)
                    c = socket.socket()
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    c.bind(("127.0.0.1", theirs))
                    c.connect((ours, port))
                    os.write(tell, b"1")
                    os.read(done, 1)
                finally:
                    os._exit(0)
            os.close(tell)
            os.close(done)
            children.append(pid)
            pipes.append((told, wait))
            assert os.read(told, 1) == b"1"
        conns = [server.accept()[0] for _ in children]
        try:
            assert tcp_peer.peer_uid("127.0.0.1", theirs, port, None) is None  # two users: nobody's
            assert tcp_peer.peer_uid("127.0.0.1", theirs, port, "127.0.0.1") == 65534  # where the address is known
        finally:
            for (told, wait), pid in zip(pipes, children):
                os.write(wait, b"x")
                os.waitpid(pid, 0)
                os.close(told)
                os.close(wait)
            for c in conns:
                c.close()


def test_a_grpc_front_door_bound_to_every_address_refuses_registrations_in_words(tmp_path):
    """Its clients' users cannot be known (gRPC does not say which address a connection reached):
    a registration is refused, saying why and what to do, not as a client "not on this host"."""
    import asyncio

    import grpc
    from tritonclient.grpc import service_pb2

    from batchyard.kserve_common import KServeCore
    from batchyard.kserve_grpc import KServeServicer
    from batchyard.kserve_shm import ShmRegions

    class Aborted(Exception):
        pass

    class Context:
        def peer(self):
            return "ipv4:127.0.0.1:40000"

        async def abort(self, code, message):
            raise Aborted(code, message)

    core = KServeCore(None, ShmRegions(str(tmp_path / "registry")))
    try:
        servicer = KServeServicer(core, 8001, "0.0.0.0")
        req = service_pb2.SystemSharedMemoryRegisterRequest(name="r", key="/k", offset=0, byte_size=16)
        with pytest.raises(Aborted) as e:
            asyncio.run(servicer.SystemSharedMemoryRegister(req, Context()))
    finally:
        core.close()
    code, message = e.value.args
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bound to every address" in message and "127.0.0.1" in message


def test_an_ipv6_grpc_peer_is_read_as_grpcio_writes_it():
    """grpcio URL-encodes an IPv6 peer's brackets ("ipv6:%5B::1%5D:46952"): read undecoded, a
    client on ::1 was remote, its registrations refused."""
    from batchyard import tcp_peer

    assert tcp_peer.grpc_peer("ipv6:%5B::1%5D:46952") == ("::1", 46952)
    assert tcp_peer.grpc_peer("ipv6:[::1]:46952") == ("::1", 46952)
    assert tcp_peer.grpc_peer("ipv4:127.0.0.1:5") == ("127.0.0.1", 5)
    assert tcp_peer.bound_address("localhost") is None  # gRPC binds it on ::1 and 127.0.0.1 alike


def test_an_unregister_removes_only_the_callers_entry_though_the_name_changed_hands(registry, segment, monkeypatch):
    """A's unregister read the registry, then unlinked the entry by name: meanwhile the name had
    been unregistered through another front-door process and registered again by B, and A's
    unregister took B's region (B's next infer: "Unable to find shared memory region")."""
    from batchyard.kserve_shm import Region

    if os.geteuid() != 0:
        pytest.skip("needs root to make a segment of another user")
    a, b = registry(), registry()
    os.chown(f"/dev/shm/{segment.name}", 54321, -1)  # B's segment
    b.register("r", f"/{segment.name}", 0, 16, uid=54321)
    stale = [Region("r", "/kshm_a", 0, 16, uid=12345)]  # what A read before the name changed hands
    monkeypatch.setattr(a, "_registered", lambda: stale)
    a.unregister("r", uid=12345)
    assert [r.name for r in b.status(uid=54321)] == ["r"]
    b.unregister("r", uid=54321)
    assert b.status(uid=54321) == []


def test_a_refused_grpc_request_lets_go_of_its_inputs_with_its_answer():
    """The abort was raised inside the except block: it kept the request's error as its context,
    and so the failed request's frames and their inputs (read into the Batchyard client's pool)
    until the cycle collector ran: requests refused after reading 8 MiB of shared memory each
    grew the front door's pool from 1 segment of 64 MiB to 6 after 200, 7 after 400 (a review's
    script)."""
    import asyncio
    import weakref

    from batchyard.kserve_grpc import KServeServicer

    class Inputs:
        pass

    held = []

    async def request():
        inputs = Inputs()  # what the request read
        held.append(weakref.ref(inputs))
        raise KServeError(grpc.StatusCode.INVALID_ARGUMENT, "expected 2 inputs but got 1 inputs")

    class Context:
        async def abort(self, code, message):
            raise grpc.aio.AbortError(code, message)

    with pytest.raises(grpc.aio.AbortError) as answered:  # the answer, held as gRPC holds it
        asyncio.run(KServeServicer._call(Context(), request()))
    assert answered.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert held[0]() is None, "the failed request's inputs outlive its answer"
