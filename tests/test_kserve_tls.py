"""gRPC over TLS (tritonserver's --grpc-use-ssl, --grpc-use-ssl-mutual): tritonclient.grpc with
ssl=True reaches the front door; a plaintext client, or one without a certificate the node trusts,
does not."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from batchyard.config import ConfigError, FrontendConfig

X = np.arange(12, dtype=np.float32).reshape(3, 4)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Self-signed PEM pairs for the server (127.0.0.1) and a client, made by openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make test certificates")
    d = tmp_path_factory.mktemp("tls")
    for name in ("server", "client", "stranger"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                        "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.pem"), "-subj", f"/CN={name}",
                        "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                       check=True, capture_output=True)
    return d


@pytest.fixture(scope="module")
def tls_front_door(certs):
    from test_kserve import _node_with_front_door

    with _node_with_front_door(grpc_tls_cert=str(certs / "server.pem"), grpc_tls_key=str(certs / "server.key"),
                               grpc_tls_client_ca=str(certs / "client.pem")) as fd:
        yield fd


def _infer(url: str, **tls):
    c = tgrpc.InferenceServerClient(url, **tls)
    try:
        x = tgrpc.InferInput("x", [3, 4], "FP32")
        x.set_data_from_numpy(X)
        return c.infer("sum", [x], client_timeout=30).as_numpy("y")
    finally:
        c.close()


def test_a_client_with_the_nodes_trust_is_served_over_tls_and_others_are_not(tls_front_door, certs):
    fd = tls_front_door
    y = _infer(fd.grpc_url, ssl=True, root_certificates=str(certs / "server.pem"),
               private_key=str(certs / "client.key"), certificate_chain=str(certs / "client.pem"))
    assert np.array_equal(y, fd.sdk("sum", X))
    for refused in ({},  # plaintext
                    {"ssl": True, "root_certificates": str(certs / "server.pem")},  # no client certificate
                    {"ssl": True, "root_certificates": str(certs / "server.pem"),  # one the node does not trust
                     "private_key": str(certs / "stranger.key"), "certificate_chain": str(certs / "stranger.pem")},
                    {"ssl": True, "root_certificates": str(certs / "stranger.pem"),  # a server it does not trust
                     "private_key": str(certs / "client.key"), "certificate_chain": str(certs / "client.pem")}):
        with pytest.raises(InferenceServerException) as e:
            _infer(fd.grpc_url, **refused)
        assert e.value.status() == "StatusCode.UNAVAILABLE", refused
    # Shared memory over TLS: the client's user is known from its connection as over plaintext
    from multiprocessing import shared_memory

    seg = shared_memory.SharedMemory(create=True, size=64)
    c = tgrpc.InferenceServerClient(fd.grpc_url, ssl=True, root_certificates=str(certs / "server.pem"),
                                    private_key=str(certs / "client.key"), certificate_chain=str(certs / "client.pem"))
    try:
        c.register_system_shared_memory("tls_region", f"/{seg.name}", 64)
        assert [r["name"] for r in c.get_system_shared_memory_status(as_json=True)["regions"].values()] == [
            "tls_region"]
        c.unregister_system_shared_memory("tls_region")
    finally:
        c.close()
        seg.close()
        seg.unlink()
    # HTTP stays plaintext, as Triton's
    import tritonclient.http as thttp

    assert thttp.InferenceServerClient(fd.http_url).is_server_live()


@pytest.mark.parametrize("keys, message", [
    ({"grpc_tls_cert": "/x/server.pem"}, "grpc_tls_cert and grpc_tls_key go together"),
    ({"grpc_tls_key": "/x/server.key"}, "grpc_tls_cert and grpc_tls_key go together"),
    ({"grpc_tls_client_ca": "/x/ca.pem"}, "grpc_tls_client_ca needs grpc_tls_cert and grpc_tls_key"),
    ({"grpc_tls_cert": "server.pem", "grpc_tls_key": "/x/k"}, "grpc_tls_cert 'server.pem' must be an absolute path"),
    ({"grpc_tls_cert": "/x/c", "grpc_tls_key": "/x/k", "grpc_port": 0}, "grpc_port is 0"),
])
def test_tls_keys_that_cannot_work_together_are_a_config_error(keys, message):
    from batchyard.config import DispatcherConfig, NodeConfig

    from conftest import SUM_MODEL

    with pytest.raises(ConfigError, match=message):
        NodeConfig(dispatcher=DispatcherConfig(frontend="ipc:///tmp/by-t/fe", backend="ipc:///tmp/by-t/be"),
                   models=(SUM_MODEL,), frontend=FrontendConfig(**keys)).validate()


# What a front door given each bad TLS file says (its key and file named), all exit EX_CONFIG.
BAD_TLS = {
    "missing key": "[frontend] grpc_tls_key {d}/server.key: No such file or directory",
    "no certificate": "[frontend] grpc_tls_cert {d}/server.pem and grpc_tls_key {d}/server.key: not a PEM certificate "
                      "and the private key that goes with it",
    "key of another certificate": "[frontend] grpc_tls_cert {d}/server.pem and grpc_tls_key {d}/server.key: not a "
                                  "PEM certificate and the private key that goes with it",
    "encrypted key": "[frontend] grpc_tls_key {d}/server.key: it is encrypted",
    "fifo": "[frontend] grpc_tls_key {d}/server.key: not a regular file",
    "huge": "[frontend] grpc_tls_cert {d}/server.pem: larger than 1 MiB",
    "client ca no pem": "[frontend] grpc_tls_client_ca {d}/ca.pem: no PEM certificates",
}


@pytest.mark.parametrize("bad", list(BAD_TLS))
def test_a_tls_file_the_front_door_cannot_use_stops_it_with_a_config_exit(tmp_path, certs, bad):
    # The front door says which key and file, and exits EX_CONFIG before it serves anything (`up`
    # then stops the node, as for any config error). gRPC said only "Failed to bind to address" of
    # a file that was no PEM, a key of another certificate or an encrypted one, exit 1, and the
    # front door was restarted for ever; a FIFO held it, deaf to SIGTERM.
    import os
    import sys

    from batchyard.config import DispatcherConfig, NodeConfig, to_toml
    from batchyard.exit_codes import EX_CONFIG

    from conftest import ROOT, SUM_MODEL
    from test_kserve import _free_port

    cert, key, ca = tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "ca.pem"
    cert.write_text((certs / "server.pem").read_text())
    key.write_text((certs / "server.key").read_text())
    ca.write_text((certs / "client.pem").read_text())
    if bad == "missing key":
        key.unlink()
    elif bad == "no certificate":
        cert.write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
    elif bad == "key of another certificate":
        key.write_text((certs / "client.key").read_text())
    elif bad == "encrypted key":
        subprocess.run(["openssl", "pkey", "-in", str(certs / "server.key"), "-aes256", "-passout", "pass:x",
                        "-out", str(key)], check=True, capture_output=True)
    elif bad == "fifo":
        key.unlink()
        os.mkfifo(key)
    elif bad == "huge":
        cert.write_bytes(cert.read_bytes() * (2 + (1 << 20) // len(cert.read_bytes())))
    elif bad == "client ca no pem":
        ca.write_text("nothing")
    node = NodeConfig(dispatcher=DispatcherConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"ipc://{tmp_path}/be"),
                      models=(SUM_MODEL,),
                      frontend=FrontendConfig(grpc_port=_free_port(), http_port=_free_port(), grpc_tls_cert=str(cert),
                                              grpc_tls_key=str(key), grpc_tls_client_ca=str(ca))).validate()
    path = tmp_path / "node.toml"
    path.write_text(to_toml(node))
    done = subprocess.run([sys.executable, "-m", "batchyard.cli", "frontend", "--config", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == EX_CONFIG, done.stderr[-2000:]
    assert BAD_TLS[bad].format(d=tmp_path) in done.stderr, done.stderr[-2000:]
