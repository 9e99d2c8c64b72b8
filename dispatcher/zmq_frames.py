"""ZeroMQ multipart send/receive for the dispatcher's hot path."""

from __future__ import annotations

import zmq

# Plain ints: pyzmq's send_multipart/recv_multipart combine enum flags per frame, and that
# enum arithmetic was ~15 % of the dispatcher's CPU under load (cProfile, bench (b)).
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)
POLLIN = int(zmq.POLLIN)
EVENTS = int(zmq.EVENTS)


def recv_parts(sock: zmq.Socket) -> list:
    """One multipart message as zmq.Frame objects, non-blocking (raises zmq.Again)."""
    frame = sock.recv(NOBLOCK, copy=False)
    parts = [frame]
    while frame.more:
        frame = sock.recv(NOBLOCK, copy=False)
        parts.append(frame)
    return parts


def send_parts(sock: zmq.Socket, parts: list) -> None:
    send = sock.send
    last = len(parts) - 1
    for i, p in enumerate(parts):
        send(p, SNDMORE if i < last else 0, copy=False)
