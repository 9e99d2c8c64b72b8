"""Which local user is at the other end of a loopback TCP connection.

The front door's system shared-memory extension takes a segment's name from its client: the
segment must be the client's own, as an SDK client's must be (shm_grants.py), or any client could
read and write any memory the front door can open. gRPC and HTTP arrive over TCP, which carries
no credentials; for a peer on this host the kernel's socket table does: the client's end of the
connection (local port = the peer's port, remote port = ours) lists the uid that made it
(/proc/net/tcp and tcp6, column 8). A peer on another host has no uid here: None.
"""

from __future__ import annotations

import ipaddress
import sys
from typing import Optional

TABLES = ("/proc/net/tcp6", "/proc/net/tcp")
ESTABLISHED = "01"  # the table's state column (include/net/tcp_states.h)


def is_local(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def peer_uid(host: str, port: int, server_port: int) -> Optional[int]:
    """The uid owning the client end of the connection from ``host``:``port`` to our
    ``server_port``; None for a peer not on this host, or one the table does not list as one
    established connection.

    Read at every call (a few hundred lines): a cache by the peer's address and port gave a new
    connection from that port the last one's uid, and so another user's regions. The client's
    address must match too, and the connection be established: matched by ports alone, the first
    line was a closed connection's (TIME_WAIT, listed as uid 0) from another loopback address."""
    if not is_local(host):
        return None
    peer = _ip(host)
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
                if (state == ESTABLISHED and int(lport, 16) == port
                        and int(remote.rpartition(":")[2], 16) == server_port and _table_ip(addr) == peer):
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


def grpc_peer(peer: str) -> tuple[str, int]:
    """grpc's ``context.peer()`` ("ipv4:127.0.0.1:54321", "ipv6:[::1]:54321") as (host, port);
    ("", 0) for anything else (a unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return "", 0
    host, _, port = rest.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return "", 0
