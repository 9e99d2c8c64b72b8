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
``data: {"error": ...}`` under the status of that error, as Triton sends it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Optional

import msgspec
import numpy as np
from aiohttp import web

from . import protocol as P
from .http_body import MAX_JSON_BYTES, read_body
from .kserve_common import (MALFORMED, NP_TO_KSERVE, VERSION, KServeCore, KServeError, as_kserve,
                            check_declared_input, check_inputs, dims, invalid, parse_version, tensor_from_list,
                            unknown_version, unreshaped)
from .kserve_json import encode_json, finite_float

PARAMETERS = "parameters"  # the one member Triton reads as a nested object of more members
EVENT_STREAM = "text/event-stream; charset=utf-8"


class _Members(dict):
    """A JSON object, each key with its first value (RapidJSON's ``Find``, which Triton reads
    members with, finds the first), and ``members``: (key, that value) in the order written, a key
    written twice listed twice (Triton adds such an input twice, and refuses the second)."""
    __slots__ = ("members",)


def _object(pairs: list) -> _Members:
    obj = _Members()
    for k, v in pairs:
        obj.setdefault(k, v)
    obj.members = [(k, obj[k]) for k, _ in pairs]
    return obj


def _members_of(obj: dict) -> _Members:
    out = _Members(obj)
    out.members = list(obj.items())
    return out


def parse_body(raw: bytes) -> _Members:
    """The request body as a JSON object, read with ``json`` (slow: a Python call for each object
    in it; see read_generate_body); Triton's words for a body that is no object."""
    if not raw.strip():
        raise invalid(f"failed to parse the request JSON buffer: The document is empty. at {len(raw)}")
    try:
        body = json.loads(raw, object_pairs_hook=_object, parse_float=finite_float)
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested past json's depth
        raise invalid(f"failed to parse the request JSON buffer: {e}") from None
    if not isinstance(body, _Members):
        raise invalid("attempt to get members for non-object")
    return body


# Past this many members (the body's and its parameters'), a body is read the slow way: each
# name is looked for in the whole body once.
_FAST_MEMBERS = 32


def parse_body_fast(raw: bytes) -> Optional[_Members]:
    """The body as ``parse_body`` reads it, read by msgspec (~18x faster, half the memory, for
    tensor data); None where only ``parse_body`` reads it right: a key that may be written twice
    (msgspec keeps its last value), an escape (which could spell a name another way), more than
    ``_FAST_MEMBERS`` members, or what msgspec refuses (NaN, malformed JSON)."""
    if b"\\" in raw:
        return None
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.MsgspecError:
        return None
    if not isinstance(obj, dict):
        raise invalid("attempt to get members for non-object")
    nested = obj.get(PARAMETERS)
    names = [*obj, *(nested if isinstance(nested, dict) else ())]
    if len(names) > _FAST_MEMBERS:
        return None
    for name in names:  # (without escapes, every occurrence of a key is its name in quotes)
        if raw.count(b'"' + name.encode() + b'"') > 1:
            return None
    body = _members_of(obj)
    if isinstance(nested, dict):
        body[PARAMETERS] = _members_of(nested)
        body.members = [(k, body[k]) for k, _ in body.members]
    return body


async def read_generate_body(request: web.Request) -> _Members:
    """The request's body as a JSON object, of at most ``MAX_JSON_BYTES`` (as infer's JSON), read
    by msgspec where it can be, else by ``json`` on a thread (seconds for tens of MiB)."""
    too_big = "request JSON size of {} bytes exceeds the maximum allowed input size of {} bytes"
    if (request.content_length or 0) > MAX_JSON_BYTES:  # (refused before it is read)
        raise invalid(too_big.format(request.content_length, MAX_JSON_BYTES))
    raw = bytes(await read_body(request, MAX_JSON_BYTES))
    if len(raw) > MAX_JSON_BYTES:  # (a chunked body)
        raise invalid(too_big.format(len(raw), MAX_JSON_BYTES))
    body = parse_body_fast(raw)
    return body if body is not None else await asyncio.to_thread(parse_body, raw)


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


def generate_inputs(spec: P.ModelSpec, body: _Members) -> dict[str, np.ndarray]:
    """The model's input tensors a generate request names, checked as Triton converts them, each
    against the model before its values are converted."""
    if PARAMETERS in body and any(t.name == PARAMETERS for t in spec.inputs):
        raise invalid(f"Keyword '{PARAMETERS}' for nested schema also given as input tensor name")
    inputs: dict[str, np.ndarray] = {}
    for name, value in body.members:
        if name != PARAMETERS:
            _member(spec, inputs, name, value)
            continue
        if not isinstance(value, _Members):
            raise invalid(f"Expected JSON object for keyword: '{name}': attempt to access JSON non-object as object")
        try:
            for inner, v in value.members:
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


def _error_body(e: KServeError, streaming: bool) -> bytes:
    text = json.dumps({"error": e.message}).encode()
    return b"data: " + text + b"\n\n" if streaming else text


async def serve_generate(core: KServeCore, request: web.Request, streaming: bool, llm=None) -> web.Response:
    """One generate (``streaming``: generate_stream) request, answered. ``llm``: the LLM mode's
    (llm_generate.LlmGenerate), for its models."""
    model = request.match_info["model"]
    version = request.match_info.get("version", "")
    for_llm = llm is not None and model in core.llm_models
    try:
        if for_llm:  # (no ModelSpec: its engine takes text, not tensors)
            if parse_version(version) not in (-1, VERSION):
                raise unknown_version(model, version)
        else:
            spec = await core.spec(model, version)
        # Triton's check, before the body is read: the header's exact value (tritonserver 2.51
        # refuses "Identity" and an empty one too)
        if request.headers.get("Content-Encoding", "identity") != "identity":
            raise invalid("Unsupported content-encoding, only 'identity' is supported.")
        body = await read_generate_body(request)
        rid = request_id(body)
        if not for_llm:
            inputs = unreshaped(spec, generate_inputs(spec, body))
            check_inputs(spec, inputs)  # refused here, a JSON error from either route, as Triton's
    except (KServeError, *MALFORMED) as e:
        e = as_kserve(e, "generate request")
        return web.Response(body=_error_body(e, False), status=e.http_status, content_type="application/json",
                            headers=e.headers or None)
    try:
        if for_llm:
            # (its refusals come after the body is read, as the vLLM backend's come from the
            # model: under a stream, an event)
            text = encode_json(answer_members(model, rid, await llm.answer(model, body, streaming)), True)
        else:
            _, text = await core.infer(model, inputs, reply=lambda out: encode_json(*generate_answer(model, rid, out)))
    except KServeError as e:
        return _answer(_error_body(e, streaming), streaming, e.http_status)
    return _answer(b"data: " + text + b"\n\n" if streaming else text, streaming)


def _answer(body: bytes, streaming: bool, status: int = 200) -> web.Response:
    if streaming:
        return web.Response(body=body, status=status, headers={"Content-Type": EVENT_STREAM})
    return web.Response(body=body, status=status, content_type="application/json")
