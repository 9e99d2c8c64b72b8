"""Restricted APIs, as tritonserver's ``--grpc-restricted-protocol`` and ``--http-restricted-api``:
the front door answers a request to a restricted category only when it carries the category's
header with its value.

A front door reachable from a network otherwise lets anyone who reaches its ports change the
node's trace setting (and with it how much is written to the node's disk), register shared
memory or read every model's statistics. The categories, the requests each covers and the
refusals are Triton 2.51's (src/restricted_features.h; HTTP 403 "This API is restricted,
expecting header 'K'", gRPC UNAVAILABLE "This protocol is restricted, expecting header
'triton-grpc-protocol-K'").
The value is compared in constant time (Triton compares strings).
"""

from __future__ import annotations

import hmac
from typing import Callable, Iterable, Optional

import grpc
from aiohttp import web

# tritonserver's gRPC side reads the header under this prefix (--grpc-restricted-protocol=trace:
# admin-key=v wants metadata "triton-grpc-protocol-admin-key"), its HTTP side under the name alone.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
# Triton's names, in its order.
CATEGORIES = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
              "statistics", "trace", "logging")

SERVICE = "/inference.GRPCInferenceService/"  # a method's full name starts so
# Each gRPC method of inference.GRPCInferenceService, by its category (as Triton registers them).
GRPC_CATEGORY = {
    "ServerLive": "health", "ServerReady": "health", "ModelReady": "health",
    "ServerMetadata": "metadata", "ModelMetadata": "metadata",
    "ModelInfer": "inference", "ModelStreamInfer": "inference",
    "SystemSharedMemoryStatus": "shared-memory", "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory", "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory", "CudaSharedMemoryUnregister": "shared-memory",
    "ModelConfig": "model-config",
    "RepositoryIndex": "model-repository", "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "ModelStatistics": "statistics",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


def http_category(path: str) -> Optional[str]:
    """The category of an HTTP route, by its pattern (``/v2/models/{model}/infer``); None for
    one Triton has no category for. The OpenAI routes of the LLM mode are inference, as
    Triton's generate is."""
    parts = path.strip("/").split("/")
    if parts[0] == "v1":
        return "inference"
    if parts[0] != "v2":
        return None
    rest = parts[1:]
    if not rest:
        return "metadata"  # GET /v2
    head = rest[0]
    if head == "health":
        return "health"
    if head in ("systemsharedmemory", "cudasharedmemory"):
        return "shared-memory"
    if head == "repository":
        return "model-repository"
    if head == "logging":
        return "logging"
    if head == "trace" or rest[-2:] == ["trace", "setting"]:
        return "trace"
    if head != "models":
        return None
    if rest[1:] == ["stats"]:  # /v2/models/stats: every model's
        return "statistics"
    tail = rest[2:]
    if tail[:1] == ["versions"]:
        tail = tail[2:]
    if not tail:
        return "metadata"
    return {"ready": "health", "config": "model-config", "stats": "statistics", "infer": "inference",
            "generate": "inference", "generate_stream": "inference"}.get(tail[0])


class Restrictions:
    """The restricted categories of one protocol: category -> (header, value)."""

    def __init__(self, rules: Iterable, protocol: str):
        """``rules``: the config's ``[[frontend.restricted_apis]]`` tables; those whose
        ``protocols`` hold ``protocol`` ("grpc" or "http") count."""
        self._of: dict[str, tuple[str, str, bytes]] = {}  # category -> (name, name as written, value)
        prefix = GRPC_HEADER_PREFIX if protocol == "grpc" else ""
        for rule in rules:
            if protocol in rule.protocols:
                for api in rule.apis:
                    written = prefix + rule.header
                    self._of[api] = (written.lower(), written, rule.value.encode())

    def __bool__(self) -> bool:
        return bool(self._of)

    def restricts(self, category: Optional[str]) -> bool:
        return category in self._of

    def refusal(self, category: Optional[str], header: Callable[[str], Optional[str]]) -> Optional[str]:
        """None where the request may go on, else the header it lacks (as the config writes it).
        ``header(name)``: the request's first value of a header (``name`` in lower case: HTTP's
        names are read in any case, gRPC's come in lower case), or None."""
        rule = self._of.get(category) if category is not None else None
        if rule is None:
            return None
        name, written, value = rule
        got = header(name)
        if got is not None and hmac.compare_digest(got.encode("utf-8", "surrogateescape"), value):
            return None
        return written


def http_refusal_message(header: str) -> str:
    return f"This API is restricted, expecting header '{header}'"


def grpc_refusal_message(header: str) -> str:
    return f"This protocol is restricted, expecting header '{header}'"


class GrpcRestrictions(grpc.aio.ServerInterceptor):
    """Refuses a call to a restricted method that lacks its header, before its request is read
    (as Triton's, a stream at its start)."""

    def __init__(self, restrictions: Restrictions):
        self.restrictions = restrictions

    async def intercept_service(self, continuation, details):
        method = details.method[len(SERVICE):] if details.method.startswith(SERVICE) else ""
        missing = self.restrictions.refusal(GRPC_CATEGORY.get(method),
                                            lambda name: _first(details.invocation_metadata, name))
        if missing is None:
            return await continuation(details)
        message = grpc_refusal_message(missing)

        async def refuse(_requests, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)

        # A streaming handler for every method: one for a unary request read it whole first (up
        # to [frontend] max_request_bytes, 2 GiB) from any client, header or not. The wire is
        # the same for both, and this one never asks for the request.
        if method == "ModelStreamInfer":
            return grpc.stream_stream_rpc_method_handler(refuse)
        return grpc.stream_unary_rpc_method_handler(refuse)


def _first(metadata, name: str) -> Optional[str]:
    for key, value in metadata or ():
        if key == name:
            return value if isinstance(value, str) else None  # (a "-bin" key's bytes: no header value)
    return None


def restrict_routes(routes: list, restrictions: Restrictions) -> list:
    """``routes`` (aiohttp RouteDefs), those of a restricted category refusing a request without
    its header 403, before its body is read. The category is the route's, known from its pattern
    when the app is made: classified from a request's path, a model name holding "%2F" (aiohttp
    routes on the path with it encoded) passed for no route at all, and was let through."""
    out = []
    for r in routes:
        category = http_category(r.path)
        if not restrictions.restricts(category):
            out.append(r)
            continue
        out.append(web.RouteDef(r.method, r.path, _checked(r.handler, category, restrictions),
                                {**r.kwargs, "expect_handler": _checked_expect(category, restrictions)}))
    return out


def _refused(request: web.Request, category: str, restrictions: Restrictions) -> Optional[web.Response]:
    missing = restrictions.refusal(category, request.headers.get)
    return None if missing is None else web.json_response({"error": http_refusal_message(missing)}, status=403)


def _checked(handler, category: str, restrictions: Restrictions):
    async def checked(request: web.Request):
        refused = _refused(request, category, restrictions)
        return refused if refused is not None else await handler(request)
    return checked


def _checked_expect(category: str, restrictions: Restrictions):
    """A request with "Expect: 100-continue" is refused before the client is told to send its
    body (aiohttp answers the Expect before any handler or middleware runs)."""
    async def expect(request: web.Request):
        refused = _refused(request, category, restrictions)
        if refused is not None:
            return refused
        # aiohttp's own answer (its default expect handler, which is private to it)
        if request.version == (1, 1):
            if request.headers.get("Expect", "").lower() != "100-continue":
                raise web.HTTPExpectationFailed(text=f"Unknown Expect: {request.headers.get('Expect', '')}")
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # (as aiohttp's: the interim answer is no part of the answer's size)
        return None
    return expect
