"""HOST:PORT as the node's config, its Triton url and the SDK's tcp endpoints write it, the
hosts its servers listen on, and free ports for the servers tests and benches start."""

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


# A config's host for every address: "" and "*" (both families), and "::", which the config's
# checks and docs take as every address too (gRPC listens on both families there).
EVERY_ADDRESS = ("", "*", "::", "[::]")


def asyncio_listen_host(host: str) -> Optional[str]:
    """``host`` as asyncio's create_server (aiohttp's TCPSite) takes it: None for every address,
    each family's (it sets IPV6_V6ONLY, so "::" served IPv6 clients only, and "*" is no name to
    its resolver), else the host without an IPv6 address's brackets."""
    return None if host in EVERY_ADDRESS else host.strip("[]")


def grpc_listen_address(host: str, port: int) -> str:
    """host:port as gRPC's add_*_port takes it: "[::]" for every address (both families; "*:port"
    and ":port" failed to bind), an IPv6 address in brackets."""
    host = "::" if host in EVERY_ADDRESS else host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
