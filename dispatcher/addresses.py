"""HOST:PORT as the node's config, its Triton url and the SDK's tcp endpoints write it."""

from __future__ import annotations

from typing import Optional


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
