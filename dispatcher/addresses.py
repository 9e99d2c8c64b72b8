"""HOST:PORT as the node's config, its Triton url and the SDK's tcp endpoints write it, and
free ports for the servers tests and benches start."""

from __future__ import annotations

import socket
from typing import Optional

_HANDED: set[int] = set()  # the ports free_port gave this process


def host_port(text: str) -> Optional[tuple[str, int]]:
    """(HOST, PORT) of ``text`` ("HOST:PORT", an IPv6 host in brackets), or None where it has
    no host or its port is not 1-65535: ZeroMQ and gRPC take a larger one modulo 65536, and
    port 70000 reached whatever listened on 4464. A host with a "/" or a blank (a scheme,
    "grpc://host", or a stray space) is none either: no resolver finds it, and a Triton worker
    given one retried "unreachable" until its start-up timeout instead of failing its config."""
    host, sep, port = text.rpartition(":")
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
        return None
    if "/" in host or any(c.isspace() for c in host):
        return None
    return host, int(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at the time of the call, and none this process was given before. The
    kernel may hand the same port to two binds in a row once the first socket is closed: a
    tritonserver given such a pair for gRPC and HTTP refused to start ("cannot listen to HTTP
    requests and GRPC requests at the same address and port"), and so would a front door."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED:
            break
    _HANDED.add(port)
    return port
