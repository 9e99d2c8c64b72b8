"""The front door's gRPC TLS credentials (``[frontend] grpc_tls_cert``, ``grpc_tls_key``,
``grpc_tls_client_ca``), as tritonserver's --grpc-use-ssl and --grpc-use-ssl-mutual.

The files are checked before gRPC sees them: gRPC says only "Failed to bind to address" of a file
it cannot use, and a front door that exits 1 on it is restarted for ever. Here each is read as a
regular file of bounded size without blocking (a FIFO at the path held the front door, deaf to
SIGTERM), and the certificate, key and CA are loaded by Python's ssl (OpenSSL) first, so that a key
that does not go with its certificate, or one that needs a passphrase, is named as such.
"""

from __future__ import annotations

import ssl

import grpc

from .node_files import read_small_file

MAX_PEM_BYTES = 1 << 20  # a certificate chain or a CA bundle is kilobytes; /dev/zero is not


class TlsFileError(OSError):
    """A TLS file of the config the front door cannot use: it cannot serve gRPC (EX_CONFIG)."""


def _read(key: str, path: str) -> bytes:
    try:
        return read_small_file(path, MAX_PEM_BYTES)
    except OSError as e:
        raise TlsFileError(f"[frontend] {key} {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise TlsFileError(f"[frontend] {key} {path}: {e}") from None


def _needs_passphrase():
    raise TlsFileError("it is encrypted: gRPC takes no passphrase; give it unencrypted, readable by the "
                       "front door's user alone")


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """gRPC's TLS credentials from PEM files (``client_ca``: clients must present a certificate it
    signed); TlsFileError naming the config key and file of one that cannot be used."""
    pem = {name: _read(name, path) for name, path in
           (("grpc_tls_cert", cert), ("grpc_tls_key", key), ("grpc_tls_client_ca", client_ca)) if path}
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key, password=_needs_passphrase)
    except TlsFileError as e:
        raise TlsFileError(f"[frontend] grpc_tls_key {key}: {e}") from None
    except (ssl.SSLError, OSError) as e:
        raise TlsFileError(f"[frontend] grpc_tls_cert {cert} and grpc_tls_key {key}: not a PEM certificate and "
                           f"the private key that goes with it ({e})") from None
    if client_ca:
        try:
            ctx.load_verify_locations(cadata=pem["grpc_tls_client_ca"].decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as e:
            raise TlsFileError(f"[frontend] grpc_tls_client_ca {client_ca}: no PEM certificates ({e})") from None
    return grpc.ssl_server_credentials([(pem["grpc_tls_key"], pem["grpc_tls_cert"])],
                                       root_certificates=pem.get("grpc_tls_client_ca"),
                                       require_client_auth="grpc_tls_client_ca" in pem)
