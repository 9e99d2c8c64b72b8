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
import time
from typing import Optional

TABLES = ("/proc/net/tcp6", "/proc/net/tcp")
CACHE_S = 1.0  # a connection's uid, kept this long (its requests follow one another; ports are reused later)
CACHE_MAX = 4096
_cache: dict[tuple, tuple[float, Optional[int]]] = {}


def is_local(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def peer_uid(host: str, port: int, server_port: int) -> Optional[int]:
    """The uid owning the client end of the connection from ``host``:``port`` to our
    ``server_port``; None for a peer not on this host, or one the table no longer lists."""
    if not is_local(host):
        return None
    key = (host, port, server_port)
    now = time.monotonic()
    hit = _cache.get(key)
    if hit is not None and now - hit[0] < CACHE_S:
        return hit[1]
    uid = _lookup(port, server_port)
    if len(_cache) >= CACHE_MAX:
        _cache.clear()
    _cache[key] = (now, uid)
    return uid


def _lookup(port: int, server_port: int) -> Optional[int]:
    for table in TABLES:
        try:
            with open(table) as f:
                next(f)  # the header
                for line in f:
                    fields = line.split()
                    if (int(fields[1].rsplit(":", 1)[1], 16) == port
                            and int(fields[2].rsplit(":", 1)[1], 16) == server_port):
                        return int(fields[7])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return None


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
