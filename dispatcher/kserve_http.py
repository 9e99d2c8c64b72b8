"""The front door's HTTP/REST side: KServe v2 with Triton's binary tensor data extension and
system shared-memory endpoints, on aiohttp, translated onto Batchyard through ``KServeCore``.

Binary tensor data: a request whose JSON header is followed by raw tensor bytes says how long the
header is in ``Inference-Header-Content-Length``; each input carried that way has
``parameters.binary_data_size``, and the binary data must be used up exactly. Outputs come back
binary when the output's ``binary_data`` parameter (or, for a request that names no outputs, its
``binary_data_output``) says so, else as a JSON list. A header length of 0 is Triton's raw binary
request: the body is the one input of a one-input model, one item, and every output comes back
binary.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from typing import Optional

import grpc
import numpy as np
from aiohttp import web, web_protocol

from . import __version__
from .addresses import asyncio_listen_host
from .client_codec import dtype_name
from .http_body import BODY_STALL_S, MAX_JSON_BYTES, read_body, too_large
from .kserve_common import (EXTENSIONS, MALFORMED, NP_TO_KSERVE, SERVER_NAME, UINT64_MAX, KServeCore, KServeError, as_kserve,
                            batch_input_bytes, check_declared_input, check_input_name, check_new_input, check_parameter_names, cuda_shm_refused, cuda_shm_status, invalid,
                            in_model_order, model_control_refused, repository_named, model_metadata, output_nbytes, tensor_from_bytes,
                            tensor_from_list, timeout_s)
from .kserve_classify import answer_ranked, check_classifiable, class_count
from .kserve_generate import serve_generate
from .kserve_json import decode_json, encode_json
from .llm_generate import DECOUPLED_HTTP, llm_config, llm_metadata
from .kserve_logging import parse_http_update
from .kserve_restrict import Restrictions, restrict_routes
from .kserve_shm import close_outputs
from .kserve_trace import http_traced, parse_update
from .tcp_peer import peer_uid

HEADER_LENGTH = "Inference-Header-Content-Length"
log = logging.getLogger("batchyard.frontend")


def _error(e: KServeError) -> web.Response:
    return web.json_response({"error": e.message}, status=e.http_status, headers=e.headers or None)


def _client_uid(request: web.Request) -> Optional[int]:
    """The client's uid, for its shared-memory regions (tcp_peer); None for one not on this host."""
    peer, ours = request.transport.get_extra_info("peername"), request.transport.get_extra_info("sockname")
    if not (isinstance(peer, tuple) and isinstance(ours, tuple)):
        return None
    return peer_uid(peer[0], peer[1], ours[1], ours[0])


def _uses_shm(header: dict) -> bool:
    """Whether a request names a shared-memory region (malformed parts are for the parse to refuse)."""
    return any(isinstance(t, dict) and isinstance(t.get("parameters"), dict)
               and "shared_memory_region" in t["parameters"]
               for key in ("inputs", "outputs") if isinstance(header.get(key), list) for t in header[key])


def _version(request: web.Request) -> str:
    return request.match_info.get("version", "")


@web.middleware
async def _json_errors(request: web.Request, handler):
    """Every answer of the front door is JSON, as Triton's are: tritonclient parses an error's
    body, and aiohttp's own text for an unknown path (or a handler's crash) made the client fail
    on the parse instead of reporting the error."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if request.path == "/v1" or request.path.startswith("/v1/"):
            # The OpenAI routes' paths answer in OpenAI's shape, as its server does for a path it
            # lacks: an OpenAI client reads error.message and error.type.
            what = "Invalid URL" if e.status == 404 else e.reason
            return web.json_response({"error": {"message": f"{what} ({request.method} {request.path})",
                                                "type": "invalid_request_error", "param": None, "code": None}},
                                     status=e.status)
        return web.json_response({"error": f"{e.reason}: {request.method} {request.path}"}, status=e.status)
    except KServeError as e:  # a handler that left its request's error to this: its own status, not a 500
        return _error(e)
    except Exception as e:  # noqa: BLE001 -- one request's fault; the front door keeps serving
        log.exception("HTTP %s %s failed", request.method, request.path)
        return web.json_response({"error": f"internal error: {type(e).__name__}: {e}"}, status=500)


def _uint(obj: dict, key: str) -> int:
    """A JSON parameter Triton reads as an unsigned integer (0 when absent): a string, a
    fraction, a boolean or a negative number is the request's fault, as in Triton."""
    v = obj.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise invalid(f"Unable to parse '{key}': expected an unsigned integer, got {_kind_of(v)}")
    return v


_REQUIRED = object()
_KINDS = {list: "an array", dict: "an object", str: "a string"}


def _kind_of(v) -> str:
    """A JSON value, shown for an error at a cost that does not grow with it."""
    if isinstance(v, dict):
        return f"an object of {len(v)} members"
    if isinstance(v, list):
        return f"an array of {len(v)} items"
    return json.dumps(v[:80] + "..." if isinstance(v, str) and len(v) > 80 else v)


def _field(obj, key: str, kind: type, default=_REQUIRED, null_is_absent: bool = True):
    """``obj[key]`` when it is a JSON value of ``kind`` (``default`` when absent, or null where
    ``null_is_absent``, if there is one): another kind, a missing required member, or a parent that
    is no object is the request's fault, in Triton's words ("Unable to parse 'shape'"). Unchecked,
    these failed as Python's own exceptions, named in the error ("AttributeError: 'str' object has
    no attribute 'get'")."""
    if not isinstance(obj, dict):
        raise invalid(f"Unable to parse '{key}': it belongs to an object, got {_kind_of(obj)}")
    v = obj.get(key)
    if v is None and (null_is_absent or key not in obj):
        if default is _REQUIRED:
            raise invalid(f"Unable to parse '{key}': " + ("it is null" if key in obj else
                                                          f"the object has no member '{key}'"))
        return default
    if not isinstance(v, kind):
        raise invalid(f"Unable to parse '{key}': expected {_KINDS[kind]}, got {_kind_of(v)}")
    return v


def _outputs_named(header: dict) -> list:
    """The request's ``outputs``: [] when absent or empty (all of the model's, as Triton answers
    both). Any other value, null and {} among them, is Triton's error ("Unable to parse
    'outputs'"); read by its truth, {} "" 0 false and null were served as if no output were named."""
    if "outputs" not in header:
        return []
    requested = header["outputs"]
    if not isinstance(requested, list):
        raise invalid(f"Unable to parse 'outputs': expected an array, got {_kind_of(requested)}")
    return requested


def _shape(t: dict) -> list[int]:
    shape = _field(t, "shape", list)
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool):
            raise invalid(f"Unable to parse 'shape': expected an array of integers, got {_kind_of(d)} in it")
    return shape


def _bool(obj: dict, key: str, default: bool) -> bool:
    v = obj.get(key, default)
    if not isinstance(v, bool):
        raise invalid(f"Unable to parse '{key}': expected true or false, got {_kind_of(v)}")
    return v


def _shm(params: dict) -> Optional[tuple[str, int, int]]:
    if "shared_memory_region" not in params:
        return None
    region = params["shared_memory_region"]
    if region is not None and not isinstance(region, str):  # (5 was the region named "5")
        raise invalid(f"Unable to parse 'shared_memory_region': expected {_KINDS[str]}, got {_kind_of(region)}")
    if not region:  # (as over gRPC)
        raise invalid("'shared_memory_region' names no region: give a registered region's name")
    return region, _uint(params, "shared_memory_offset"), _uint(params, "shared_memory_byte_size")


def _data_source(name: str, t: dict, tp: dict) -> str:
    """Which one of the three places an input's data can be in this input names; Triton refuses
    an input that names none or several (the binary data used to win over the others)."""
    given = [k for k, present in (("data", "data" in t), ("binary_data_size", "binary_data_size" in tp),
                                  ("shared_memory_region", "shared_memory_region" in tp)) if present]
    if len(given) != 1:
        got = " no field is set" if not given else " set " + " ".join(f"'{k}'" for k in given)
        raise invalid(f"Input must set only one of the following fields: 'data', 'binary_data_size' in "
                      f"'parameters', 'shared_memory_region' in 'parameters'. But{got} (input '{name}')")
    return given[0]


# C's atoi: blanks, a sign, ASCII digits, and nothing read past them (int() also reads "6_9" and
# other scripts' digits: "\u0663" was 3).
_ATOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)?")


def _header_length(request: web.Request) -> Optional[int]:
    """``Inference-Header-Content-Length`` as Triton reads it, with ``std::atoi``: "104abc" is 104,
    "abc" 0 (a raw binary request), and glibc's atoi is strtol's long cut to an int, so past
    int32 it wraps ("4294967296" is 0). None where the header is absent."""
    text = request.headers.get(HEADER_LENGTH)
    if text is None:
        return None
    digits = _ATOI.match(text).group(1)
    n = max(-(1 << 63), min((1 << 63) - 1, int(digits))) if digits else 0  # strtol saturates
    return (n + (1 << 31)) % (1 << 32) - (1 << 31)


def _is_raw(request: web.Request) -> bool:
    """Triton's raw binary request: ``Inference-Header-Content-Length: 0``, the whole body being
    the one input's bytes."""
    return _header_length(request) == 0


def _split(request: web.Request, body: bytes) -> tuple[dict, memoryview]:
    """The JSON header and the binary tensor data after it."""
    n = _header_length(request)
    try:
        n = len(body) if n is None else n
        if not 0 <= n <= len(body):
            raise ValueError(f"{HEADER_LENGTH} {n} is beyond the body's {len(body)} bytes")
        if n > MAX_JSON_BYTES:
            raise invalid(too_large(n, MAX_JSON_BYTES) + " (send large tensors as binary data)")
        header = decode_json(body[:n])
    except (ValueError, RecursionError) as e:  # RecursionError: json's, for JSON nested past its depth
        raise invalid(f"failed to parse the request JSON buffer: {e}") from None
    if not isinstance(header, dict):
        raise invalid("the request body must be a JSON object")
    return header, memoryview(body)[n:]


class KServeHttp:

    def __init__(self, core: KServeCore):
        self.core = core

    def routes(self) -> list:
        m = "/v2/models/{model}"
        # As Triton's routes: a version is digits ("01" is 1); any other string is no route (404).
        v = "/v2/models/{model}/versions/{version:[0-9]+}"
        r = "/v2/systemsharedmemory"
        c = "/v2/cudasharedmemory"
        # No HEAD beside GET (aiohttp's default adds one): Triton answers HEAD 405 on every route.
        get = functools.partial(web.get, allow_head=False)
        return [get("/v2/health/live", self.live), get("/v2/health/ready", self.ready),
                get("/v2", self.server_metadata),
                get(m, self.metadata), get(v, self.metadata),
                get(m + "/ready", self.model_ready), get(v + "/ready", self.model_ready),
                get(m + "/config", self.config), get(v + "/config", self.config),
                get(m + "/stats", self.stats), get(v + "/stats", self.stats),
                get("/v2/models/stats", self.stats),
                web.post(m + "/infer", self.infer), web.post(v + "/infer", self.infer),
                get(r + "/status", self.shm_status), get(r + "/region/{name}/status", self.shm_status),
                web.post(r + "/region/{name}/register", self.shm_register),
                web.post(r + "/region/{name}/unregister", self.shm_unregister),
                web.post(r + "/unregister", self.shm_unregister),
                get(c + "/status", self.cuda_status), get(c + "/region/{name}/status", self.cuda_status),
                web.post(c + "/region/{name}/register", self.cuda_register),
                web.post(c + "/region/{name}/unregister", self.cuda_unregister),
                web.post(c + "/unregister", self.cuda_unregister),
                # (Triton's HTTP index does not read a repository's name; its load and unload refuse one)
                *[web.post(p + "/index", self.repository_index) for p in ("/v2/repository", "/v2/repository/{repo}")],
                *[web.post(f"{p}/models/{{model}}/{action}", self.model_control)
                  for p in ("/v2/repository", "/v2/repository/{repo}") for action in ("load", "unload")],
                get("/v2/trace/setting", self.trace_setting), web.post("/v2/trace/setting", self.trace_setting),
                get(m + "/trace/setting", self.trace_setting), web.post(m + "/trace/setting", self.trace_setting),
                get("/v2/logging", self.log_settings), web.post("/v2/logging", self.log_settings),
                *[web.post(p + "/generate", self.generate) for p in (m, v)],
                *[web.post(p + "/generate_stream", self.generate_stream) for p in (m, v)]]

    # ---------------------------------------------------------------- health and metadata
    async def live(self, request):
        return web.Response()

    async def ready(self, request):
        return web.Response(status=200 if await self.core.server_ready() else 400)

    async def model_ready(self, request):
        if await self.core.model_ready(request.match_info["model"], _version(request)):
            return web.Response()
        return web.json_response({"error": "Model version not ready"}, status=400)  # Triton's answer

    async def server_metadata(self, request):
        return web.json_response({"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS})

    async def metadata(self, request):
        model = request.match_info["model"]
        try:
            if self.core.llm_model(model, _version(request)):
                return web.json_response(llm_metadata(model))
            return web.json_response(model_metadata(await self.core.spec(model, _version(request))))
        except KServeError as e:
            return _error(e)

    async def config(self, request):
        model = request.match_info["model"]
        try:
            if self.core.llm_model(model, _version(request)):
                return web.json_response(llm_config(model))
            return web.json_response(await self.core.config(model, _version(request)))
        except KServeError as e:
            return _error(e)

    async def stats(self, request):
        try:
            stats = await self.core.model_stats(request.match_info.get("model", ""), _version(request))
        except KServeError as e:
            return _error(e)
        return web.json_response({"model_stats": stats})

    # ---------------------------------------------------------------- repository (control mode NONE)
    async def repository_index(self, request):
        try:
            body, _ = _split(request, await read_body(request, MAX_JSON_BYTES)) if request.can_read_body else ({}, b"")
            return web.json_response(await self.core.repository_index(_bool(body, "ready", False)))
        except (KServeError, *MALFORMED) as e:
            return _error(as_kserve(e, "repository index request"))

    async def model_control(self, request):
        if "repo" in request.match_info:
            return _error(repository_named())
        return _error(model_control_refused(request.match_info["model"]))

    # ---------------------------------------------------------------- trace settings (kserve_trace)
    async def trace_setting(self, request):
        async def changes() -> dict:
            body = await read_body(request, MAX_JSON_BYTES)
            settings = decode_json(body) if bytes(body).strip() else {}
            # Triton finds no field in JSON that is no object, and makes the setting anew all the same.
            return parse_update(settings if isinstance(settings, dict) else {}, http=True)
        try:  # (a GET reads)
            return web.json_response(await self.core.trace_setting(request.match_info.get("model", ""),
                                                                   changes if request.method == "POST" else None))
        except (KServeError, *MALFORMED) as e:
            return _error(as_kserve(e, "trace setting request"))

    # ---------------------------------------------------------------- log settings (kserve_logging)
    async def log_settings(self, request):
        try:
            changes = None
            if request.method == "POST":
                raw = bytes(await read_body(request, MAX_JSON_BYTES))
                try:  # (a key given twice: its first value, as Triton's reader keeps)
                    settings = json.loads(raw, object_pairs_hook=lambda pairs: dict(reversed(pairs)))
                except (ValueError, RecursionError):  # (Triton's words for an empty body; RapidJSON's own for the rest)
                    raise KServeError(grpc.StatusCode.INTERNAL, "failed to parse the request JSON buffer: " + (
                        "invalid JSON" if raw.strip() else f"The document is empty. at {len(raw)}")) from None
                changes = lambda: parse_http_update(settings)  # noqa: E731 -- read after the core's own check
            return web.json_response(self.core.log_setting(changes))
        except (KServeError, *MALFORMED) as e:
            return _error(as_kserve(e, "log settings request"))

    # ---------------------------------------------------------------- system shared memory
    async def shm_register(self, request):
        try:
            body, _ = _split(request, await read_body(request, MAX_JSON_BYTES))
            for required in ("key", "byte_size"):  # Triton's errors; a missing size read as 0 bytes
                if required not in body:
                    raise invalid(f"Shared memory register request has no '{required}' field")
            key = _field(body, "key", str)
            self.core.shm.register(request.match_info["name"], key, _uint(body, "offset"), _uint(body, "byte_size"),
                                   _client_uid(request))
        except (KServeError, *MALFORMED) as e:  # a body of the wrong shape: the client's fault, a 400
            return _error(as_kserve(e, "shared-memory registration"))
        return web.Response()

    async def shm_unregister(self, request):
        self.core.shm.unregister(request.match_info.get("name", ""), _client_uid(request))
        return web.Response()

    async def shm_status(self, request):
        try:
            regions = self.core.shm.status(request.match_info.get("name", ""), _client_uid(request))
        except KServeError as e:
            return _error(e)
        return web.json_response([{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                                  for r in regions])

    # ---------------------------------------------------------------- CUDA shared memory (no GPUs)
    async def cuda_register(self, request):
        return _error(cuda_shm_refused(request.match_info["name"]))

    async def cuda_unregister(self, request):
        return web.Response()

    async def cuda_status(self, request):
        try:
            return web.json_response(cuda_shm_status(request.match_info.get("name", "")))
        except KServeError as e:
            return _error(e)

    # ---------------------------------------------------------------- inference
    async def generate(self, request):  # Triton's generate extension (kserve_generate)
        return await serve_generate(self.core, request, streaming=False)

    async def generate_stream(self, request):
        return await serve_generate(self.core, request, streaming=True)

    async def infer(self, request):
        async def answer(traced: list, received: int) -> web.Response:
            try:
                return await self._infer(request, traced, received)
            except (KServeError, *MALFORMED) as e:
                return _error(as_kserve(e))

        return await http_traced(self.core.tracer, request, answer)

    async def _infer(self, request, traced: list, received: int) -> web.Response:
        model = request.match_info["model"]
        if self.core.llm_model(model, _version(request)):  # (Triton's answer for a decoupled model)
            raise KServeError(grpc.StatusCode.UNIMPLEMENTED, DECOUPLED_HTTP)
        spec = await self.core.spec(model, _version(request))  # an unknown model (version) is the first error
        trace = self.core.tracer.sample(model)  # (as Triton: a model it does not serve is not traced)
        if trace is not None:
            traced.append(trace)
            trace.stamp("HTTP_RECV_START", received)
        body = await read_body(request, MAX_JSON_BYTES + batch_input_bytes(spec))
        if trace is not None:
            trace.stamp("HTTP_RECV_END")
        if _is_raw(request):
            header, params = {}, {}
            inputs = self._raw_input(spec, body)
            wanted = [(t.name, True, None, None) for t in spec.outputs]  # Triton answers a raw request in binary
        else:
            header, binary = _split(request, body)
            # A request's own id and parameters may not be null (Triton 2.51 refuses both; a tensor's
            # parameters may be)
            params = _field(header, "parameters", dict, {}, null_is_absent=False)
            check_parameter_names(params)
            uid = _client_uid(request) if _uses_shm(header) else None
            inputs = self._inputs(spec, header, binary, uid)
            wanted = self._requested_outputs(header, spec, _bool(params, "binary_data_output", False), inputs, uid)
        def answer(out, labels: dict) -> tuple[list, list, bool]:
            # Made inside core.infer (as the gRPC route's): a region that cannot take an output
            # fails the request in the statistics, where made after it the request was counted a
            # success while its client got a 400.
            outputs, chunks, finite = [], [], True
            for name, binary_out, classes, region in wanted:
                arr = out[name]
                if classes is not None:
                    shape, data = labels[name]
                    o = {"name": name, "datatype": "BYTES", "shape": shape}
                    if binary_out:
                        chunks.append(data)
                        o["parameters"] = {"binary_data_size": len(data)}
                    else:  # (ASCII: digits, '.', '-', ':', nan, inf)
                        o["data"] = data
                    outputs.append(o)
                    continue
                o = {"name": name, "datatype": NP_TO_KSERVE[dtype_name(arr.dtype)], "shape": list(arr.shape)}
                if region is not None:
                    # As Triton: name, datatype and shape only. tritonclient's C++ HTTP client (and
                    # so perf_analyzer) reads any output "parameters" as binary data and requires
                    # binary_data_size in them.
                    region.write(arr, name)
                elif binary_out:
                    chunks.append(np.ascontiguousarray(arr).tobytes())
                    o["parameters"] = {"binary_data_size": len(chunks[-1])}
                else:
                    o["data"] = arr.reshape(-1).tolist()
                    finite = finite and (arr.dtype.kind != "f" or bool(np.isfinite(arr).all()))
                outputs.append(o)
            return outputs, chunks, finite

        ranked = [(name, classes, binary_out) for name, binary_out, classes, _ in wanted if classes is not None]

        try:
            rid = _field(header, "id", str, "", null_is_absent=False)
            if trace is not None:
                trace.request_id = rid
            _, (outputs, chunks, finite) = await self.core.infer(
                model, inputs, priority=_uint(params, "priority"), timeout=timeout_s(_uint(params, "timeout"))[0],
                reply=lambda out: answer_ranked(answer, out, ranked, self.core.ranker), trace=trace)
        finally:
            close_outputs(wanted)
        reply = {"model_name": model, "model_version": "1", "outputs": outputs}
        if rid:  # Triton leaves an empty id out
            reply["id"] = rid
        text = encode_json(reply, finite)
        if not chunks:
            return web.Response(body=text, content_type="application/json")
        return web.Response(body=b"".join([text, *chunks]), content_type="application/octet-stream",
                            headers={HEADER_LENGTH: str(len(text))})

    def _inputs(self, spec, header: dict, binary: memoryview, uid: Optional[int]) -> dict[str, np.ndarray]:
        model, inputs, pos = spec.name, {}, 0
        for t in _field(header, "inputs", list):
            name, datatype, shape = _field(t, "name", str), _field(t, "datatype", str), _shape(t)
            check_new_input(inputs, name, shape, model)
            check_input_name(spec, name)
            tp = _field(t, "parameters", dict, {})
            source = _data_source(name, t, tp)
            if source == "shared_memory_region":
                region = _shm(tp)
                if region is None:
                    raise invalid(f"input '{name}': 'shared_memory_region' must name a registered region")
                inputs[name] = self.core.shm.read(*region, datatype, shape, name, spec, uid, self.core.input_array)
            elif source == "binary_data_size":
                n = _uint(tp, "binary_data_size")
                if pos + n > len(binary):
                    raise invalid(f"unexpected end of binary data for input '{name}': {n} bytes at offset {pos}, "
                                  f"{len(binary)} bytes of binary data in the body")
                check_declared_input(spec, name, datatype, shape)
                inputs[name] = tensor_from_bytes(name, datatype, shape, binary[pos:pos + n])
                pos += n
            else:
                check_declared_input(spec, name, datatype, shape)
                inputs[name] = tensor_from_list(name, datatype, shape, t["data"])
        if pos != len(binary):
            raise invalid(f"unexpected additional input data for model '{model}' ({len(binary) - pos} bytes of "
                          "binary data that no input's binary_data_size takes)")
        return inputs

    @staticmethod
    def _raw_input(spec, body: bytes) -> dict[str, np.ndarray]:
        """A raw binary request's body as the model's only input, one item (Triton's raw input)."""
        if len(spec.inputs) != 1:
            raise invalid(f"a raw binary request (Inference-Header-Content-Length: 0) needs a model with one "
                          f"input; '{spec.name}' has {len(spec.inputs)}")
        t = spec.inputs[0]
        datatype = NP_TO_KSERVE.get(t.dtype, t.dtype)
        return {t.name: tensor_from_bytes(t.name, datatype, [1, *t.shape], memoryview(body))}

    def _requested_outputs(self, header: dict, spec, binary_default: bool, inputs: dict,
                           uid: Optional[int]) -> list:
        """(name, binary?, class count or None, shm region or None) per output to return. None named: all of them, binary
        as the request's ``binary_data_output`` says; a named one is binary only if its own
        ``binary_data`` says so (Triton: the request's setting is for outputs not named). An
        output named twice is returned once, as its first mention asks (as Triton 2.51)."""
        requested = _outputs_named(header)
        if not requested:
            return [(t.name, binary_default, None, None) for t in spec.outputs]
        tensors = {t.name: t for t in spec.outputs}
        wanted, seen = [], set()
        try:
            for o in requested:
                name, op = _field(o, "name", str), _field(o, "parameters", dict, {})
                if name not in tensors:
                    raise invalid(f"unexpected inference output '{name}' for model '{spec.name}'")
                region, binary = _shm(op), _bool(op, "binary_data", False)
                if region is not None:  # (Triton's ValidateOutputParameter, in its words)
                    if "classification" in op:
                        raise invalid("Output can't set both 'shared_memory_region' and 'classification'")
                    if binary:
                        raise invalid("Output can't set both 'shared_memory_region' and 'binary_data'")
                # Triton keeps the count as a uint32 and reads 0 classes as none asked (2**32 too):
                # the tensor as usual.
                classes = _uint(op, "classification")
                if classes > UINT64_MAX:  # (Triton's JSON reader refuses it too, 500)
                    raise invalid(f"Unable to parse 'classification': expected an unsigned 64-bit integer, got {classes}")
                classes = class_count(classes) or None
                if classes is not None:
                    t = tensors[name]
                    check_classifiable(NP_TO_KSERVE.get(t.dtype, t.dtype), math.prod(t.shape))
                if name in seen:
                    if region is not None:  # looked up as Triton looks up every mention's (its first is used)
                        self.core.shm.output(*region, name, None, uid).close()
                    continue
                seen.add(name)
                if region is not None:  # held until close_outputs: nothing may raise before it is in wanted
                    region = self.core.shm.output(*region, name, output_nbytes(spec, name, inputs), uid)
                wanted.append((name, binary, classes, region))
        except BaseException:
            close_outputs(wanted)
            raise
        return in_model_order(spec, wanted)


class _AnswersAfterHalfClose(web_protocol.RequestHandler):
    """aiohttp's connection, except that a client that half-closes after its request (``nc -N``,
    socat, some probes and proxies) still gets its answer, as Triton's: aiohttp let the transport
    close on the client's FIN, which cancelled the request unanswered. An idle connection, or one
    whose request's body was cut short by the FIN, still closes as before."""

    __slots__ = ()

    def eof_received(self):
        request = self._current_request
        if self._waiter is not None and not self._messages:  # idle, between requests
            return None
        if any(not payload.is_eof() for _, payload in self._messages) or (
                request is not None and not request.content.is_eof()):
            return None
        self.close()  # aiohttp's own: no more requests; the transport closes after the answers
        return True  # keep writing


class _ServerAnsweringAfterHalfClose(web.Server):
    """aiohttp's server (the runner's, made by the application), whose connections are
    ``_AnswersAfterHalfClose``. Both classes add no state, so the objects aiohttp made take them."""

    __slots__ = ()

    def __call__(self):
        handler = super().__call__()
        handler.__class__ = _AnswersAfterHalfClose
        return handler


async def start_http(core: KServeCore, host: str, port: int, max_body_bytes: int = (1 << 31) - 1,
                     extra_routes=(), idle_timeout_s: float = 75.0, restricted_apis=()) -> web.AppRunner:
    """A started aiohttp site on host:port, sharing the port with this node's other front-door
    processes (SO_REUSEPORT). ``extra_routes``: e.g. the OpenAI completions of the LLM mode.
    ``idle_timeout_s``: a connection waiting for a request (none yet, headers unfinished, or
    idle after an answer) is closed after it, and a body that stalls that long answers 408.
    ``restricted_apis``: the config's ``[[frontend.restricted_apis]]`` (kserve_restrict)."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_json_errors])
    app[BODY_STALL_S] = idle_timeout_s
    app.add_routes(restrict_routes([*KServeHttp(core).routes(), *extra_routes], Restrictions(restricted_apis, "http")))
    # handler_cancellation: an HTTP client that hangs up withdraws its request, as a cancelled
    # gRPC call does; aiohttp's default lets the handler run on, and the abandoned request then
    # still took its place in a batch on a worker.
    # auto_decompress off: compressed bodies are inflated by read_body, bounded and off the loop.
    # keepalive_timeout: aiohttp arms it at the connection's start and after each answer, and
    # closes the connection if no request has arrived whole by then (its default is an hour).
    # lingering_time: after an answer to a request whose body is not all read (a stalled one,
    # 408; one too large, 413), how long aiohttp reads on before it closes the connection.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, auto_decompress=False,
                           keepalive_timeout=idle_timeout_s, lingering_time=min(10.0, idle_timeout_s))
    await runner.setup()
    runner.server.__class__ = _ServerAnsweringAfterHalfClose
    await web.TCPSite(runner, asyncio_listen_host(host), port, reuse_port=True).start()
    return runner
