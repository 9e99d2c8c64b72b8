"""Triton's generate extension on the front door's HTTP port: ``POST
/v2/models/{m}[/versions/{v}]/generate`` and ``.../generate_stream``, a request of plain JSON
members where ``infer`` takes typed tensors.

A member of the body that names one of the model's inputs is that input: one JSON value or a
flat array of them, shaped from the model's metadata as Triton shapes it (``generate_shape``).
The members of ``parameters`` are read the same way. Any other member is, to Triton, a request
parameter for the model to read; Batchyard's models read none, so such a member is checked as
Triton checks it (a string, a number or a boolean) and goes no further. ``priority`` and
``timeout`` are such members too: Triton's generate does not give them to its scheduler either.

The answer holds ``model_name``, ``model_version``, the request's ``id`` when it has one, and
each output by name: a lone value where the output holds one element, else a flat array, as
Triton writes them. ``generate_stream`` sends that answer as one Server-Sent Event (a Batchyard
model answers a request once). A request refused before it runs is a JSON error under its
status from either route; one whose run fails is, from ``generate_stream``, the event
``data: {"error": ...}`` under the status of that error, as Triton sends it. Requests are
counted and traced as ``infer``'s. An LLM model's are answered by the LLM mode (llm_generate).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math

import grpc
import numpy as np
from aiohttp import web

from . import protocol as P
from .http_body import MAX_JSON_BYTES, read_body
from .kserve_common import (MALFORMED, NP_TO_KSERVE, KServeCore, KServeError, as_kserve, check_declared_input,
                            check_inputs, dims, invalid, tensor_from_list, unreshaped)
from .kserve_json import decode_json, encode_json
from .kserve_trace import http_traced
from .llm_generate import MANY_ANSWERS, responses

log = logging.getLogger("batchyard.frontend")

PARAMETERS = "parameters"  # the one member Triton reads as a nested object of more members
EVENT_STREAM = "text/event-stream; charset=utf-8"


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object, read as infer's JSON is (msgspec; what it refuses, by
    ``json``); Triton's words for one that is empty or no object. A key written twice has its
    last value (Triton's reader finds the first, and refuses an input written twice): reading
    each object as its members, in Python, took 3x msgspec's time for an array of floats and 18x
    for a body of many small objects, on the front door's loop."""
    if not raw.strip():
        raise invalid(f"failed to parse the request JSON buffer: The document is empty. at {len(raw)}")
    try:
        body = decode_json(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested past json's depth
        raise invalid(f"failed to parse the request JSON buffer: {e}") from None
    if not isinstance(body, dict):
        raise invalid("attempt to get members for non-object")
    return body


def request_id(body: dict) -> str:
    """The body's ``id``: Triton reads it before anything else and takes only a string."""
    rid = body.get("id", "")
    if not isinstance(rid, str):
        raise invalid("Unable to parse 'id': attempt to access JSON non-string as string")
    return rid


def generate_shape(name: str, metadata_shape: list[int], count: int) -> list[int]:
    """The shape Triton gives ``count`` values of an input whose metadata shape (batch dimension
    first, -1 where it varies) is ``metadata_shape``: the fixed dimensions divide the count, the
    innermost varying one takes what is left, the other varying ones 1."""
    shape = list(metadata_shape)
    for d in reversed(shape):
        if d != -1:
            if d == 0 or count % d:
                raise invalid(f"The schema can not convert input '{name}' to tensor with proper shape")
            count //= d
    for i in reversed(range(len(shape))):
        if shape[i] == -1:
            shape[i], count = count, 1
    if count != 1:
        raise invalid(f"The schema can not convert input '{name}' to tensor with proper shape")
    return shape


def generate_inputs(spec: P.ModelSpec, body: dict) -> dict[str, np.ndarray]:
    """The model's input tensors a generate request names, checked as Triton converts them, each
    against the model before its values are converted."""
    if PARAMETERS in body and any(t.name == PARAMETERS for t in spec.inputs):
        raise invalid(f"Keyword '{PARAMETERS}' for nested schema also given as input tensor name")
    inputs: dict[str, np.ndarray] = {}
    for name, value in body.items():
        if name != PARAMETERS:
            _member(spec, inputs, name, value)
            continue
        if not isinstance(value, dict):
            raise invalid(f"Expected JSON object for keyword: '{name}': attempt to access JSON non-object as object")
        try:
            for inner, v in value.items():
                _member(spec, inputs, inner, v)
        except KServeError as e:
            raise invalid(f"Converting keyword: '{name}': {e.message}") from None
    return inputs


def _member(spec: P.ModelSpec, inputs: dict, name: str, value) -> None:
    t = next((t for t in spec.inputs if t.name == name), None)
    if t is None:  # a request parameter to Triton; Batchyard's models take none
        if value is None or isinstance(value, (list, dict)):
            raise invalid(f"parameter '{name}' has invalid type. It should be either 'int', 'bool', or 'string'.")
        return
    if name in inputs:
        raise invalid(f"input '{name}' already exists in request")
    values = value if isinstance(value, list) else [value]
    datatype = NP_TO_KSERVE[t.dtype]
    shape = generate_shape(name, [-1, *dims(t)], len(values))
    check_declared_input(spec, name, datatype, shape)  # (a batch past the model's, before conversion)
    inputs[name] = tensor_from_list(name, datatype, shape, values)


def generate_answer(model: str, rid: str, outputs) -> tuple[dict, bool]:
    """The answer's JSON object of a model's output tensors, and whether every value in it is
    finite: a lone value where an output holds one element, else a flat array."""
    values, finite = {}, True
    for name, arr in outputs.items():
        flat = np.asarray(arr).reshape(-1)
        finite = finite and (flat.dtype.kind != "f" or bool(np.isfinite(flat).all()))
        listed = flat.tolist()
        values[name] = listed[0] if len(listed) == 1 else listed
    return answer_members(model, rid, values), finite


def answer_members(model: str, rid: str, values: dict) -> dict:
    """``values`` with ``model_name``, ``model_version`` and the request's ``id`` (left out when
    empty), in Triton's order: by name, Triton keeping them in an ordered map, where those three
    win over an output of the same name."""
    members: dict = {"model_name": model, "model_version": "1"}
    if rid:
        members["id"] = rid
    for name, value in values.items():
        members.setdefault(name, value)
    return dict(sorted(members.items()))


def _finite(members: dict) -> bool:
    """Whether an LLM answer's numbers are all finite (its cumulative_logprob is NaN where no
    logprobs were asked): else written as Triton writes them, NaN (encode_json)."""
    return all(not isinstance(v, float) or math.isfinite(v) for v in members.values())


def _error_body(e: KServeError, streaming: bool) -> bytes:
    text = json.dumps({"error": e.message}).encode()
    return b"data: " + text + b"\n\n" if streaming else text


async def serve_generate(core: KServeCore, request: web.Request, streaming: bool) -> web.StreamResponse:
    """One generate (``streaming``: generate_stream) request, answered; an LLM model's by the
    LLM mode's (``core.llm``, llm_generate). A tensor model's request is traced as infer's are,
    when the trace setting samples it (Triton traces generate requests too)."""
    return await http_traced(core.tracer, request,
                             lambda traced, received: _serve_generate(core, request, streaming, traced, received))


async def _serve_generate(core: KServeCore, request: web.Request, streaming: bool, traced: list,
                          received: int) -> web.Response:
    model = request.match_info["model"]
    version = request.match_info.get("version", "")
    trace = None
    try:
        for_llm = core.llm_model(model, version)  # (no ModelSpec: its engine takes text, not tensors)
        if not for_llm:
            spec = await core.spec(model, version)
            trace = core.tracer.sample(model)  # (as Triton: a model it does not serve is not traced)
            if trace is not None:
                traced.append(trace)
                trace.stamp("HTTP_RECV_START", received)
        # Triton's check, before the body is read: the header's exact value (tritonserver 2.51
        # refuses "Identity" and an empty one too)
        if request.headers.get("Content-Encoding", "identity") != "identity":
            raise invalid("Unsupported content-encoding, only 'identity' is supported.")
        body = parse_body(bytes(await read_body(request, MAX_JSON_BYTES, raw_limit=MAX_JSON_BYTES)))
        if trace is not None:
            trace.stamp("HTTP_RECV_END")
        rid = request_id(body)
        if trace is not None:
            trace.request_id = rid
        if not for_llm:
            inputs = unreshaped(spec, generate_inputs(spec, body))
            check_inputs(spec, inputs)  # refused here, a JSON error from either route, as Triton's
    except (KServeError, *MALFORMED) as e:
        e = as_kserve(e, "generate request")
        return web.Response(body=_error_body(e, False), status=e.http_status, content_type="application/json",
                            headers=e.headers or None)
    if for_llm and streaming:
        return await _llm_events(core, request, model, rid, body)
    try:
        if for_llm:
            # (its refusals come after the body is read, as the vLLM backend's come from the
            # model: under a stream, an event)
            # Under the stream switch, KServe's generate answers a run of one response (a stream of
            # one engine step) with it, and one of more with Triton's error under 200, as
            # tritonserver 2.51 does; a refusal is its 400. All three were a 500 before the run.
            more: list = []
            members = await core.llm_run(model, core.llm.answer(model, body, more.append))
            if more:
                return web.Response(body=encode_json({"error": MANY_ANSWERS}, True), content_type="application/json")
            text = encode_json(answer_members(model, rid, members), _finite(members))
        else:
            _, text = await core.infer(model, inputs, reply=lambda out: encode_json(*generate_answer(model, rid, out)),
                                       trace=trace)
    except KServeError as e:
        return _answer(_error_body(e, streaming), streaming, e.http_status)
    return _answer(b"data: " + text + b"\n\n" if streaming else text, streaming)


async def _llm_events(core: KServeCore, request: web.Request, model: str, rid: str,
                      body: dict) -> web.StreamResponse:
    """An LLM model's generate_stream: an event a response of its run (one, or one an engine
    step under the ``stream`` switch), sent as it comes. The answer starts with its first
    event: a run that fails before it is that error's event under its status, as a tensor
    model's; after it, the error's event ends the stream."""
    response = None
    try:
        # (closed at once when a write fails: the client left, and its generation stops)
        async with contextlib.aclosing(responses(
                lambda emit: core.llm_run(model, core.llm.answer(model, body, emit)))) as answers:
            async for members in answers:
                if response is None:
                    response = web.StreamResponse(headers={"Content-Type": EVENT_STREAM})
                    await response.prepare(request)
                await response.write(b"data: " + encode_json(answer_members(model, rid, members), _finite(members))
                                     + b"\n\n")
    except ConnectionResetError:  # the client left while an event was written: nobody to tell
        return response
    except Exception as e:  # noqa: BLE001 -- the request's answer, whatever failed it
        if not isinstance(e, KServeError):
            log.exception("generate_stream of model %r failed", model)
            e = KServeError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")
        if response is None:
            return _answer(_error_body(e, True), True, e.http_status)
        await response.write(_error_body(e, True))
    return response


def _answer(body: bytes, streaming: bool, status: int = 200) -> web.Response:
    if streaming:
        return web.Response(body=body, status=status, headers={"Content-Type": EVENT_STREAM})
    return web.Response(body=body, status=status, content_type="application/json")
