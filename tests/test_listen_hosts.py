"""The config's hosts for every address ("", "*", "::") reach the front door's HTTP and gRPC and
the metrics server over both IPv4 and IPv6: "*" and "" failed to bind gRPC (the front door
exited 1, restarted for ever), and "::" served HTTP and /metrics to IPv6 clients only (asyncio
sets IPV6_V6ONLY), while the config's checks and docs/frontend.md take it as every address."""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from batchyard.addresses import EVERY_ADDRESS, asyncio_listen_host, free_port, grpc_listen_address


def _reaches(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == 0


@pytest.fixture(scope="module")
def ipv6():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this host")


@pytest.mark.parametrize("host", EVERY_ADDRESS)
def test_an_asyncio_server_on_every_address_answers_both_families(host, ipv6):
    async def main():
        port = free_port()
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, asyncio_listen_host(host), port,
                                                                reuse_port=True)
        try:
            return [await asyncio.to_thread(_reaches, to, port) for to in ("127.0.0.1", "::1")]
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) == [True, True]


@pytest.mark.parametrize("host", EVERY_ADDRESS)
def test_a_grpc_server_on_every_address_binds_and_answers_both_families(host, ipv6):
    server = grpc.server(ThreadPoolExecutor(1))
    port = free_port()
    try:
        assert server.add_insecure_port(grpc_listen_address(host, port)) == port
        server.start()
        assert [_reaches(to, port) for to in ("127.0.0.1", "::1")] == [True, True]
    finally:
        server.stop(None)


def test_one_address_is_taken_as_it_is_written():
    assert [asyncio_listen_host(h) for h in ("127.0.0.1", "[::1]", "::1", "localhost")] == [
        "127.0.0.1", "::1", "::1", "localhost"]
    assert [grpc_listen_address(h, 9) for h in ("127.0.0.1", "[::1]", "::1", "localhost", "0.0.0.0")] == [
        "127.0.0.1:9", "[::1]:9", "[::1]:9", "localhost:9", "0.0.0.0:9"]
