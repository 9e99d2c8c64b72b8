"""Reading an HTTP request's body, compressed or not, for the front door's aiohttp servers.

aiohttp's server undoes Content-Encoding itself, on the event loop and bounded only by the
body-size limit of the *decompressed* body: a 1 MiB gzip upload that expands to 1 GiB took
2 GB of memory and held every other client of that front-door process for 16 s. The servers
turn that off (``auto_decompress=False``) and read bodies here: the compressed bytes bounded by
the body-size limit, then inflated on a thread, at most ``INFLATING`` at once, and refused as
soon as they pass what their route can use (an infer: the JSON limit plus a whole batch of the
model's inputs).
"""

from __future__ import annotations

import asyncio
import zlib

import grpc
from aiohttp import web

from .kserve_common import KServeError, invalid

# Bodies inflated at once per process: each may hold up to the body-size limit while it grows.
INFLATING = 2
# The application's longest wait for the next bytes of a body ([frontend] idle_timeout_s).
BODY_STALL_S = web.AppKey("body_stall_s", float)
# After that first wait, a body must keep arriving at this average rate: a client that sends a
# byte just before each stall would otherwise hold its connection and descriptor for ever.
# Apache's mod_reqtimeout has the same rule and this default (body=...,MinRate=500).
MIN_BODY_RATE = 500.0  # bytes/s
# The JSON part of a body, binary tensors apart: the front door's own bound on what one parse may
# hold (tritonserver 2.51, the wheel's, has no such limit: it served 65, 100 and 200 MiB of JSON).
MAX_JSON_BYTES = 64 << 20
_inflating: asyncio.Semaphore | None = None
# HTTP's deflate is zlib-wrapped, but some clients send it raw; gzip has its own header.
_WBITS = {"gzip": (16 + zlib.MAX_WBITS,), "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}  # (not "x-gzip": Triton's 501)


def too_large(size: int, limit: int, sent_so_far: bool = False) -> str:
    """Triton's words for a JSON body past the limit (``sent_so_far``: of at least ``size`` bytes)."""
    return (f"request JSON size of {'at least ' if sent_so_far else ''}{size} bytes exceeds the maximum allowed "
            f"input size of {limit} bytes")


async def read_body(request: web.Request, limit: int = 0, raw_limit: int = 0) -> bytes:
    """The request's body, decompressed; INVALID_ARGUMENT (400) for one that cannot be read,
    does not decompress, uses an encoding other than gzip and deflate, or inflates past
    ``limit`` (at most the application's ``client_max_size``, which is also the default): the
    most a route can use, so that a small upload cannot make the process hold gigabytes.
    ``raw_limit``: a body as sent of more bytes is refused as soon as it passes them (a JSON
    route's own bound, where ``client_max_size`` is the binary tensors' too)."""
    global _inflating
    try:
        raw = await _read_raw(request, raw_limit)
    except web.RequestPayloadError as e:  # e.g. a chunked body that breaks off: the client's fault
        raise invalid(f"the request body cannot be read: {e}") from None
    except ConnectionResetError:  # the client hung up mid-body: nobody to answer, no server error
        raise invalid("the client closed the connection before its body arrived") from None
    # Names as they are, as Triton 2.51 compares them: "GZIP", "Identity" and an empty value are
    # its 501 (they were taken here).
    encoding = request.headers.get("Content-Encoding", "identity").strip()
    if encoding == "identity":
        return raw
    wbits = _WBITS.get(encoding)
    if wbits is None:  # Triton: UNSUPPORTED (501), naming what it takes
        raise KServeError(grpc.StatusCode.UNIMPLEMENTED, f"the request body cannot be read: unsupported "
                          f"Content-Encoding '{encoding}' (gzip, deflate or none)",
                          {"Accept-Encoding": "gzip, deflate"})
    if _inflating is None:
        _inflating = asyncio.Semaphore(INFLATING)
    slots = _inflating
    await slots.acquire()
    cap = request.client_max_size
    try:
        job = asyncio.ensure_future(asyncio.to_thread(inflate, raw, wbits, min(limit, cap) if limit else cap))
    except BaseException:
        slots.release()
        raise
    # The slot is the inflation's, not the handler's: a client that hangs up cancels its handler
    # while the thread inflates on (16 clients that hung up ran 5-6 inflations at once). What a
    # job nobody awaits any more raised is retrieved, not logged as never retrieved.
    job.add_done_callback(lambda done: (slots.release(), done.cancelled() or done.exception()))
    return await asyncio.shield(job)


async def _read_raw(request: web.Request, raw_limit: int = 0) -> bytes:
    """The body as sent, as ``request.read()`` reads it (up to ``client_max_size``, 413 past it),
    but waiting at most the application's BODY_STALL_S for each next chunk, and no longer than
    that plus one second per MIN_BODY_RATE bytes received for the whole body: a body that stalls
    or trickles answers 408 (it held its descriptor for as long as the client kept sending).
    aiohttp then reads what is left of the body for its lingering time, and closes the
    connection. Past ``raw_limit`` bytes (when given), INVALID_ARGUMENT, as Triton words a JSON
    body past its limit."""
    stall = request.app.get(BODY_STALL_S)
    cap = request.client_max_size
    if raw_limit and (request.content_length or 0) > raw_limit:  # refused before it is read
        raise invalid(too_large(request.content_length, raw_limit))
    body = bytearray()
    loop = asyncio.get_running_loop()
    started = loop.time()
    while True:
        by_rate = started + stall + len(body) / MIN_BODY_RATE - loop.time()
        try:
            async with asyncio.timeout(min(stall, max(by_rate, 0.0))):
                chunk = await request.content.readany()
        except TimeoutError:
            if by_rate < stall:
                raise KServeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"the request body arrives too slowly: {len(body)} bytes in "
                                  f"{loop.time() - started:.1f} s (at least {MIN_BODY_RATE:g} bytes/s "
                                  f"after the first {stall:g} s)") from None
            raise KServeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"the request body stalled: no bytes for {stall:g} s ({len(body)} received)") from None
        if not chunk:
            return bytes(body)
        body.extend(chunk)
        if raw_limit and len(body) > raw_limit:  # (a chunked body, of no announced length)
            raise invalid(too_large(len(body), raw_limit, sent_so_far=True))
        if cap and len(body) > cap:
            raise web.HTTPRequestEntityTooLarge(max_size=cap, actual_size=len(body))


def inflate(raw: bytes, wbits: tuple[int, ...], limit: int) -> bytes:
    """``raw`` decompressed (the first of ``wbits`` that reads it), at most ``limit`` bytes."""
    for i, w in enumerate(wbits):
        d = zlib.decompressobj(w)
        try:
            out = d.decompress(raw, limit + 1)
        except zlib.error as e:
            if i + 1 < len(wbits):
                continue
            raise invalid(f"the request body cannot be read: it does not decompress ({e})") from None
        if len(out) > limit:
            raise invalid(f"the request body decompresses to more than {limit} bytes, the most this server takes")
        if not d.eof:
            raise invalid("the request body cannot be read: its compressed data ends early")
        if d.unused_data:  # a second gzip member or garbage: refused, not silently dropped
            raise invalid("the request body cannot be read: data follows the compressed body")
        return out
    raise AssertionError("unreachable")
