"""Which local user is at the other end of a loopback TCP connection.

The front door's system shared-memory extension takes a segment's name from its client: the
segment must be the client's own, as an SDK client's must be (shm_grants.py), or any client could
read and write any memory the front door can open. gRPC and HTTP arrive over TCP, which carries
no credentials; for a peer on this host the kernel's socket table does: the client's end of the
connection (local address = the peer's, remote = ours) holds the uid that made it. The kernel finds
that one socket by its address pair (sock_diag over netlink, as `ss` asks); /proc/net/tcp and tcp6
(column 8) hold the same, but reading them walks the whole TCP hash table, 4.5 ms a file on a 24 GiB
host (tcp_ehash_entries 262144) and more on a bigger one, on the front door's event loop at every
request naming a region: they are read only where netlink is refused. A peer on another host has no
uid here: None.
"""

from __future__ import annotations

import ipaddress
import itertools
import socket
import struct
import sys
import urllib.parse
from typing import Optional

TABLES = ("/proc/net/tcp6", "/proc/net/tcp")
ESTABLISHED = "01"  # the table's state column (include/net/tcp_states.h)
# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h
NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, NLMSG_ERROR = 4, 20, 1, 2
TCP_ESTABLISHED = 1
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_REQ = struct.Struct("=IHHII BBBxI HH16s16sI II")  # nlmsghdr + inet_diag_req_v2 (its sockid's ports big-endian)
_MSG = struct.Struct("=BBBB HH16s16sI II IIIII")  # inet_diag_msg
_seq = itertools.count(1)


def is_local(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def peer_uid(host: str, port: int, server_port: int, server_host: Optional[str] = None) -> Optional[int]:
    """The uid owning the client end of the connection from ``host``:``port`` to our
    ``server_port`` at ``server_host``, the address the connection arrived at; None for a peer
    not on this host, or one the kernel does not know as one established connection.

    ``server_host`` None: the caller cannot tell (gRPC, bound to every address): None, no uid.
    The tables' one connection from the peer's address and port to our port, whatever our
    address, was taken for it, and that is a guess another user can steer: bound to the client's
    address and port with SO_REUSEADDR, connected to another of our addresses, its own socket
    half-closed so as not to be listed as established, it left the victim's connection the only
    one listed, and passed for the victim (its regions unregistered).

    Asked at every call: a cache by the peer's address and port gave a new connection from that
    port the last one's uid, and so another user's regions. The client's address must match too,
    and the connection be established: matched by ports alone, the first line of the table was a
    closed connection's (TIME_WAIT, listed as uid 0) from another loopback address."""
    if not is_local(host):
        return None
    if server_host is None:
        return None
    peer, server = _ip(host), _ip(server_host)
    try:
        return _diag_uid(peer, port, server, server_port)
    except (OSError, ValueError):  # no netlink here (a sandbox): the tables say the same, slowly
        return _table_uid(peer, port, server_port, server)


def _diag_uid(local, local_port: int, remote, remote_port: int) -> Optional[int]:
    """The uid of the established TCP socket whose own end is ``local``:``local_port`` and whose
    other end is ``remote``:``remote_port`` (a sock_diag lookup of that one socket); None if
    there is none, or it is not established (a TIME_WAIT socket reads as uid 0)."""
    if local.version != remote.version:
        return None
    family = socket.AF_INET if local.version == 4 else socket.AF_INET6
    src, dst = local.packed.ljust(16, b"\0"), remote.packed.ljust(16, b"\0")
    seq = next(_seq) & 0xFFFFFFFF
    req = _REQ.pack(_REQ.size, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0,
                    family, socket.IPPROTO_TCP, 0, 1 << TCP_ESTABLISHED,
                    socket.htons(local_port), socket.htons(remote_port), src, dst, 0,
                    INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as s:
        s.sendto(req, (0, 0))
        data = s.recv(4096)
    _, kind, _, got_seq, _ = struct.unpack_from("=IHHII", data)
    if kind == NLMSG_ERROR or kind != SOCK_DIAG_BY_FAMILY or got_seq != seq:
        return None  # ENOENT: no such socket
    (got_family, state, _, _, sport, dport, got_src, got_dst, _, _, _, _, _, _, uid, _) = _MSG.unpack_from(data, 16)
    # The answer is in the socket's own family: a dual-stack (AF_INET6) client socket connected
    # to an IPv4 address, as gRPC's are, answers with v4-mapped addresses.
    if (state != TCP_ESTABLISHED or socket.ntohs(sport) != local_port or socket.ntohs(dport) != remote_port
            or _diag_ip(got_family, got_src) != local or _diag_ip(got_family, got_dst) != remote):
        return None
    return uid


def _diag_ip(family: int, raw: bytes):
    ip = ipaddress.ip_address(raw[:4] if family == socket.AF_INET else raw)
    return getattr(ip, "ipv4_mapped", None) or ip


def _table_uid(peer, port: int, server_port: int, server) -> Optional[int]:
    """``peer_uid`` from /proc/net/tcp{6,}: the client's address and port, our address and port."""
    uids = set()
    for table in TABLES:
        try:
            with open(table) as f:
                lines = f.readlines()[1:]  # past the header
        except OSError:
            continue
        for line in lines:
            try:
                fields = line.split()
                local, remote, state = fields[1], fields[2], fields[3]
                addr, _, lport = local.rpartition(":")
                raddr, _, rport = remote.rpartition(":")
                if (state == ESTABLISHED and int(lport, 16) == port and int(rport, 16) == server_port
                        and _table_ip(addr) == peer and _table_ip(raddr) == server):
                    uids.add(int(fields[7]))
            except (IndexError, ValueError):
                continue
    return uids.pop() if len(uids) == 1 else None


def _ip(host: str):
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    return getattr(ip, "ipv4_mapped", None) or ip


def _table_ip(hex_addr: str):
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in the host's byte order."""
    raw = bytes.fromhex(hex_addr)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    return getattr(ip, "ipv4_mapped", None) or ip


def bound_address(bound: str) -> Optional[str]:
    """The one address a server bound to ``bound`` is reached at, or None when bound to every
    address (or to a name of several): then only its connection can tell, and gRPC's does not say."""
    if bound == "localhost":  # gRPC binds it on ::1 and 127.0.0.1 alike, whatever /etc/hosts says
        return None
    try:
        ip = ipaddress.ip_address(bound.strip("[]"))
    except ValueError:
        try:
            found = {info[4][0] for info in socket.getaddrinfo(bound, None, type=socket.SOCK_STREAM)}
        except (OSError, UnicodeError):
            return None
        if len(found) != 1:
            return None
        ip = ipaddress.ip_address(found.pop())
    return None if ip.is_unspecified else str(ip)


def grpc_peer(peer: str) -> tuple[str, int]:
    """grpc's ``context.peer()`` ("ipv4:127.0.0.1:54321", "ipv6:[::1]:54321") as (host, port);
    ("", 0) for anything else (a unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return "", 0
    host, _, port = rest.rpartition(":")
    try:
        # grpcio writes an IPv6 peer's brackets URL-encoded ("ipv6:%5B::1%5D:46952"): undecoded,
        # a client on ::1 read as remote, its registrations refused.
        return urllib.parse.unquote(host).strip("[]"), int(port)
    except ValueError:
        return "", 0
