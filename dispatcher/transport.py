"""Binding the dispatcher's sockets with the node's transport security.

- tcp endpoints: CURVE (ZeroMQ's own encryption and authentication) when ``[dispatcher]
  curve_secret_key`` names a key file made by ``batchyard keygen``; client public keys are
  checked by a ZAP handler on the dispatcher's own event loop (no extra thread) against the
  ``*.key`` files in ``curve_authorized_keys`` ("*": any key, encryption only).
- ipc endpoints: the clients' socket file gets ``ipc_mode`` and ``ipc_group``, so the file
  system decides who may connect; the workers' one is 0600, the node user's alone.
- the frontend refuses frames over ``max_message_bytes`` (ZMQ_MAXMSGSIZE): ZeroMQ drops such a
  peer before a byte of it reaches the dispatcher.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import secrets
import socket
import stat
from pathlib import Path
from typing import Optional

import zmq

from .config import DispatcherConfig

log = logging.getLogger("batchyard.dispatcher")


def read_keypair(path: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a ``batchyard keygen`` secret key file."""
    import zmq.auth

    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ValueError(f"{path}: has no secret key (give the .key_secret file)")
    return public, secret


def write_keypair(folder: str, name: str, replace: bool = False) -> tuple[str, str]:
    """``batchyard keygen``: NAME.key (public, to share) and NAME.key_secret (0600 from its first
    byte), in the certificate format ``zmq.auth.load_certificate`` reads. Written here rather than
    by ``zmq.auth.create_certificates``, which opens both with a plain ``open("w")``: the secret
    was 0644 until a chmod after it (another local user who opened it meanwhile kept the node's
    secret), and a NAME.key already there, or a symlink planted under that name, was written
    over. Each file is written under a name of its own and then linked into place, which fails
    on anything already there (FileExistsError), unless ``replace``: then renamed over it (a
    symlink itself is replaced, not followed)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    public, secret = (k.decode() for k in zmq.curve_keypair())
    base = os.path.join(folder, name)
    files = ((f"{base}.key_secret", 0o600, f'curve\n    public-key = "{public}"\n    secret-key = "{secret}"\n'),
             (f"{base}.key", 0o644, f'curve\n    public-key = "{public}"\n'))
    temps, placed = [], []
    try:
        for path, mode, text in files:  # both written before either is placed
            tmp = f"{path}.new-{os.getpid()}-{secrets.token_hex(4)}"  # (a pid alone recurs in containers)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
            temps.append(tmp)
            with os.fdopen(fd, "w") as f:
                f.write(f"#   ZeroMQ CURVE certificate written by batchyard keygen\nmetadata\n{text}")
        for tmp, (path, _, _) in zip(temps, files):
            if replace:
                os.replace(tmp, path)
            else:
                os.link(tmp, path)
            placed.append(path)
    except BaseException:
        if not replace:  # a secret key placed without its public key would refuse the next run
            for path in placed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        raise
    finally:
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return f"{base}.key", f"{base}.key_secret"


class EndpointInUse(RuntimeError):
    """Another process serves the address this one was to bind."""


def refuse_if_served(address: str) -> None:
    """EndpointInUse when a live process listens on ``address``'s ipc socket file. libzmq
    unlinks the file and binds anew: a second node on the same config took the first one's
    clients silently, and removed the file when it stopped, leaving the first unreachable.
    A file nobody listens on (a node killed hard) is stale and may be bound over."""
    path = address[len("ipc://"):] if address.startswith("ipc://") else ""
    if not path or path.startswith("@") or not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):  # libzmq would delete it to bind
        raise EndpointInUse(f"{address}: {path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:  # ECONNREFUSED: stale
        return
    finally:
        probe.close()
    raise EndpointInUse(f"{address} is served by another process (a node already running this config?)")


# The backend's ZAP domain: the ZAP handler admits there the node's own key alone. One domain for
# both sockets admitted every authorized client key on the backend too, and a client registered as
# a worker was given other clients' batches.
BACKEND_ZAP_DOMAIN = "batchyard-backend"


def bind(sock: zmq.Socket, address: str, cfg: DispatcherConfig, frontend: bool) -> Optional[tuple]:
    """Bind ``sock``; returns the socket file of an ipc endpoint, for ``remove_socket_file``.
    EndpointInUse when another process serves ``address``."""
    if address.startswith("tcp://") and cfg.curve_secret_key:
        public, secret = read_keypair(cfg.curve_secret_key)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        if not frontend:
            sock.zap_domain = BACKEND_ZAP_DOMAIN.encode()
    if frontend:
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes or cfg.max_inline_bytes + (1 << 20))
    refuse_if_served(address)
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        if e.errno == errno.EADDRINUSE:
            raise EndpointInUse(f"{address} is served by another process: {e}") from None
        raise
    if address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if not path.startswith("@"):  # an abstract socket has no file
            if frontend:
                os.chmod(path, int(cfg.ipc_mode, 8))
                if cfg.ipc_group:
                    os.chown(path, -1, grp.getgrnam(cfg.ipc_group).gr_gid)
            else:
                # Workers run as the node's user (the dispatcher refuses others' registrations):
                # the clients' mode and group gave every client a connection here, where one that
                # took a dead worker's routing id was handed its batches.
                os.chmod(path, 0o600)
            st = os.stat(path)
            return (path, st.st_dev, st.st_ino)
    return None


def remove_socket_file(bound: Optional[tuple]) -> None:
    """Unlink an ipc endpoint's file once its socket is closed (libzmq leaves it behind), if it
    is still the one this process bound: a dispatcher started on that path since keeps its own."""
    if bound is None:
        return
    path, dev, ino = bound
    try:
        st = os.stat(path)
        if (st.st_dev, st.st_ino) == (dev, ino):
            os.unlink(path)
    except OSError:
        pass


def start_authenticator(ctx: zmq.Context, cfg: DispatcherConfig) -> Optional[object]:
    """A ZAP handler for CURVE clients, on the running asyncio loop; None when CURVE is off.
    The node's own key is always accepted: its supervisor and workers connect with it."""
    if not cfg.curve_secret_key:
        return None
    import zmq.auth
    from zmq.auth.asyncio import AsyncioAuthenticator

    own_public, _ = read_keypair(cfg.curve_secret_key)
    allowed = None if cfg.curve_authorized_keys == "*" else {
        *zmq.auth.load_certificates(cfg.curve_authorized_keys), own_public}

    class Keys:
        def callback(self, domain: str, key: bytes) -> bool:
            if domain == BACKEND_ZAP_DOMAIN:  # workers: the node's own key only
                return key == own_public
            return allowed is None or key in allowed  # key: z85, as load_certificates gives them

    auth = AsyncioAuthenticator(ctx, log=log)
    auth.start()
    for domain in ("*", BACKEND_ZAP_DOMAIN):  # "*": the frontend's (no domain set)
        auth.configure_curve_callback(domain=domain, credentials_provider=Keys())
    return auth


def node_client_keys(cfg: DispatcherConfig, address: str) -> dict:
    """Client/AsyncClient keyword arguments for the node's own processes (supervisor, front
    door) connecting to ``address``: the node's key pair, which the ZAP handler always admits."""
    if not (cfg.curve_secret_key and is_tcp(address)):
        return {}
    public, secret = read_keypair(cfg.curve_secret_key)
    return {"curve_server_key": public, "curve_keys": (public, secret)}


def secure_worker_socket(sock: zmq.Socket, cfg: DispatcherConfig, address: str) -> None:
    """A worker's DEALER to a CURVE-secured tcp backend: the node's own key pair."""
    keys = node_client_keys(cfg, address)
    if keys:
        sock.curve_publickey, sock.curve_secretkey = keys["curve_keys"]
        sock.curve_serverkey = keys["curve_server_key"]


def is_tcp(address: str) -> bool:
    return address.startswith("tcp://")


def seed_routing_ids() -> None:
    """Make the routing ids a ROUTER created after this call gives its peers unpredictable.

    libzmq numbers the peers of a ROUTER from ``rand()``, which nothing seeds: every dispatcher
    named its connections 0x6B8B4567, +1, ... A peer may also choose such an id itself, and libzmq
    aborts the whole process (an assertion) when the id it then numbers a new connection with is
    taken: a client that held the next few ids killed the dispatcher. Seeded, the next id is
    one of 2**32 nobody can name in advance."""
    import ctypes

    try:
        ctypes.CDLL(None).srand(int.from_bytes(os.urandom(4), "little"))
    except (OSError, AttributeError):  # no libc rand to seed: nothing to do
        pass


def connection(frames: list) -> tuple:
    """Who sent a message from a client: (routing identity, the peer's credentials). On ipc the
    credentials are the kernel's (ZeroMQ's "Peer-Address": uid, gid and pid by SO_PEERCRED), so a
    process that takes another connection's routing id is still told apart (shm_grants.py)."""
    try:
        peer = frames[1].get("Peer-Address")
    except (zmq.ZMQError, AttributeError, IndexError):  # inproc, or frames that are plain bytes
        peer = ""
    return (frames[0].bytes, peer)
