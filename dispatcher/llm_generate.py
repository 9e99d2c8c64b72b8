"""The LLM mode's models through Triton's protocols, in the shape Triton's vLLM backend gives
them, so a client written against Triton + vLLM runs unchanged: Triton's generate extension
(``POST /v2/models/{m}/generate`` with ``{"text_input": "...", "parameters": {"max_tokens": 16}}``
answers ``{"model_name": m, "model_version": "1", "text_output": "<prompt><completion>"}``), and
gRPC ``ModelStreamInfer`` with the backend's tensors (tritonclient's ``stream_infer``,
perf_analyzer ``--streaming``).

The backend's inputs: ``text_input``; ``exclude_input_in_output`` (false: the prompt is written
before the completion, the backend's default, and true when streaming); ``stream``;
``sampling_parameters`` (a JSON object in a string, read in place of the request's parameters,
as the backend reads it); ``return_finish_reason``, ``return_cumulative_logprob``,
``return_logprobs`` (with vLLM's ``logprobs`` among the sampling parameters: ``BackendLogprobs``),
``return_num_input_tokens`` and ``return_num_output_tokens`` for the outputs of those names. The
request's parameters (in generate, its members that are no input, and those of its
``parameters``) are the sampling parameters, converted to their types as the backend does
(``"4"`` is 4 tokens): ``max_tokens``
(16 when left out, vLLM's default; no more than the context leaves after the prompt, as vLLM's
engine ends a sequence at ``max_model_len``), ``ignore_eos``, ``stop``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``min_tokens``, ``stop_token_ids``,
``allowed_token_ids``, ``bad_words`` and ``logit_bias`` (as on /v1/completions; the last four, a
list or an object, in ``sampling_parameters`` only; the backend's own passes logit_bias' string keys to
vLLM unconverted, which refuses them), ``logprobs``, and the sampling ones: ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``seed`` and the presence, frequency and repetition penalties,
within vLLM's bounds, each left out at vLLM's default, as the backend leaves it (temperature 1:
a request that gives none samples; ``temperature`` 0 is greedy; the model's
generation_config.json is not read, as the backend does not read it). Any other sampling parameter
is refused rather than ignored, as on ``/v1/completions``. A completion ends at the model's
end-of-sequence token (``finish_reason`` "stop") or at ``max_tokens`` ("length"), as vLLM's.

The backend's model is decoupled: Triton refuses it ModelInfer and HTTP infer, and so does this
(``DECOUPLED_*``). ``stream`` true is served by ``generate_stream`` and ModelStreamInfer as the
backend streams: a response for each engine step, its ``text_output`` the text that step's
tokens complete (llm_text), ``num_output_tokens`` the step's tokens, ``finish_reason`` "None"
but on the last, which is marked final; from ``generate`` a run of one response (one engine
step) is answered with it, and one of more with Triton's error for a model that answers more
than once, under 200, as tritonserver 2.51 answers both (kserve_generate).
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
from typing import AsyncIterator, Awaitable, Callable, Optional

import numpy as np

from .client_codec import sampling_as_vllm
from .errors import BatchyardError, InvalidArgument
from .kserve_common import from_batchyard, invalid
from .openai_fields import (MAX_PROMPT_CHARS, OpenAiError, bad_words_field, logit_bias_field, shown as _shown,
                            stop_strings)
from .openai_http import OpenAiCompletions, TextRule
from .openai_logprobs import logprob_objects
from .protocol import MAX_TOKEN_ID

# The backend's inputs that Batchyard serves (name, KServe datatype, optional), in its order;
# its other (images) is refused.
BACKEND_INPUTS = (("text_input", "BYTES", False), ("stream", "BOOL", True), ("sampling_parameters", "BYTES", True),
                  ("exclude_input_in_output", "BOOL", True), ("return_finish_reason", "BOOL", True),
                  ("return_cumulative_logprob", "BOOL", True), ("return_logprobs", "BOOL", True),
                  ("return_num_input_tokens", "BOOL", True), ("return_num_output_tokens", "BOOL", True))
# Its outputs: (name, KServe datatype, dims).
BACKEND_OUTPUTS = (("text_output", "BYTES", [-1]), ("finish_reason", "BYTES", [-1]),
                   ("cumulative_logprob", "FP32", [-1]), ("logprobs", "BYTES", [-1]),
                   ("num_input_tokens", "UINT32", [1]), ("num_output_tokens", "UINT32", [-1]))
_BOOL_INPUTS = tuple(name for name, datatype, _ in BACKEND_INPUTS if datatype == "BOOL")
_REFUSED_INPUTS = ("image",)
INPUT_NAMES = frozenset((*(name for name, _, _ in BACKEND_INPUTS), *_REFUSED_INPUTS))
# Members a client sends for Triton itself, not for the sampler.
_NOT_SAMPLING = ("id",)
MANY_ANSWERS = ("generate expects model to produce exactly 1 response, use generate stream for model that "
                "generates various number of responses")
DECOUPLED_GRPC = "ModelInfer RPC doesn't support models with decoupled transaction policy"
DECOUPLED_HTTP = "HTTP end point doesn't support models with decoupled transaction policy"


def llm_metadata(model: str) -> dict:
    """KServe's model metadata of an LLM model, as Triton shows the vLLM backend's."""
    return {"name": model, "versions": ["1"], "platform": "vllm",
            "inputs": [{"name": n, "datatype": d, "shape": [1]} for n, d, _ in BACKEND_INPUTS],
            "outputs": [{"name": n, "datatype": d, "shape": dims} for n, d, dims in BACKEND_OUTPUTS]}


def llm_config(model: str) -> dict:
    """Triton's model configuration of an LLM model, as the vLLM backend completes it: no batch
    dimension, optional inputs, decoupled (perf_analyzer then asks for ``--streaming``)."""
    kind = {"BYTES": "TYPE_STRING", "BOOL": "TYPE_BOOL", "UINT32": "TYPE_UINT32", "FP32": "TYPE_FP32"}
    return {"name": model, "platform": "vllm", "backend": "vllm", "max_batch_size": 0,
            "input": [{"name": n, "data_type": kind[d], "dims": [1], "optional": optional}
                      for n, d, optional in BACKEND_INPUTS],
            "output": [{"name": n, "data_type": kind[d], "dims": dims} for n, d, dims in BACKEND_OUTPUTS],
            "model_transaction_policy": {"decoupled": True}}


def _one(name: str, value, kind: type):
    """An input given as a value or a list of one (the backend reads the first of a tensor)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if kind is bool and not isinstance(value, bool) or kind is str and not isinstance(value, str):
        raise invalid(f"input '{name}' must be {'a boolean' if kind is bool else 'a string'}, got {_shown(value)}")
    return value


def _sampling(name: str, value, kind: type):
    """A sampling parameter converted as the backend converts it (``int("4")``, ``int(4.0)``,
    ``float("0")``: TritonSamplingParams.from_dict casts each to its SamplingParams type)."""
    try:
        return kind(value)
    except (TypeError, ValueError, OverflowError):
        raise invalid(f"{name} must be {'an integer' if kind is int else 'a number'}, got {_shown(value)}") from None


def read_generate_body(body: dict) -> tuple[str, dict, int]:
    """-> (prompt, the backend's switches by name, max_tokens) of a generate request's body: its
    members and those of its ``parameters`` that name the backend's inputs are those inputs,
    the others the request's parameters."""
    nested = body.get("parameters", {})
    if not isinstance(nested, dict):
        raise invalid("Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as object")
    inputs: dict = {}
    params: dict = {}
    for name, value in [*((k, v) for k, v in body.items() if k != "parameters"), *nested.items()]:
        into = inputs if name in INPUT_NAMES else params
        if name in into:
            raise invalid(f"input '{name}' already exists in request" if into is inputs else
                          f"parameter '{name}' is given twice (in the body and in its parameters)")
        if into is params and (value is None or isinstance(value, (list, dict))):  # (Triton's HTTP layer)
            raise invalid(f"parameter '{name}' has invalid type. It should be either 'int', 'bool', or 'string'.")
        into[name] = value
    return read_backend_request(inputs, params)


def read_backend_request(inputs: dict, params: dict) -> tuple[str, dict, int]:
    """-> (prompt, switches, max_tokens) from the backend's inputs by name (values, or lists of
    one) and the request's parameters, as the backend reads them."""
    if "text_input" not in inputs:
        raise invalid("expected 1 inputs but got 0 inputs: missing required input(s) ['text_input']")
    prompt = _one("text_input", inputs["text_input"], str)
    if not prompt:
        raise invalid("input 'text_input' is empty")
    switches = {name: _one(name, inputs[name], bool) for name in _BOOL_INPUTS if name in inputs}
    for name in _REFUSED_INPUTS:
        if name in inputs:
            raise invalid(f"input '{name}' is not supported by Batchyard's LLM mode")
    if "sampling_parameters" in inputs:  # in place of the request's parameters, as the backend reads it
        text = _one("sampling_parameters", inputs["sampling_parameters"], str)
        if len(text) > MAX_SAMPLING_JSON:  # (parsed on the loop: 30 MiB of it held it 2.6 s)
            raise invalid(f"input 'sampling_parameters' of {len(text)} characters: at most {MAX_SAMPLING_JSON}")
        try:
            params = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise invalid(f"input 'sampling_parameters' is not JSON: {e}") from None
        if not isinstance(params, dict):
            raise invalid(f"input 'sampling_parameters' must be a JSON object, got {_shown(params)}")
    params = {k: v for k, v in params.items() if v is not None}  # (the backend's vLLM defaults)
    stream = switches.get("stream", False)
    prepend = not switches.get("exclude_input_in_output", stream)
    if prepend and stream:
        raise invalid("When streaming, `exclude_input_in_output` = False is not allowed.")
    switches["exclude_input_in_output"] = not prepend
    max_tokens = _sampling("max_tokens", params.pop("max_tokens", 16), int)
    if not 1 <= max_tokens <= MAX_TOKEN_ID:
        raise invalid(f"max_tokens must be a positive integer, got {max_tokens}")
    # (bool() of the value, as the backend converts it: the string "false" is true there too)
    switches["ignore_eos"] = _sampling("ignore_eos", params.pop("ignore_eos", False), bool)
    switches["include_stop_str_in_output"] = _sampling("include_stop_str_in_output",
                                                       params.pop("include_stop_str_in_output", False), bool)
    switches["skip_special_tokens"] = _sampling("skip_special_tokens", params.pop("skip_special_tokens", True), bool)
    try:  # (str or a list of str, as the backend leaves it for vLLM)
        switches["stop"] = stop_strings(params.pop("stop", None), "stop")
    except OpenAiError as e:
        raise invalid(e.message) from None
    sampling = {name: _sampling(name, params.pop(name), kind) for name, kind in _SAMPLING_TYPES.items()
                if name in params}
    # (lists and an object: only sampling_parameters' JSON holds them; the backend leaves them be)
    for name in ("stop_token_ids", "allowed_token_ids"):
        if name in params:
            sampling[name] = params.pop(name)
            if not isinstance(sampling[name], list):
                raise invalid(f"{name} must be a list of token ids, got {_shown(sampling[name])}")
    try:
        switches["bad_words"] = bad_words_field(params.pop("bad_words", None))
    except OpenAiError as e:
        raise invalid(e.message) from None
    if "logit_bias" in params:
        try:
            sampling["logit_bias"] = logit_bias_field(params.pop("logit_bias"))
        except OpenAiError as e:
            raise invalid(e.message) from None
    try:
        switches["sampling"] = sampling_as_vllm(sampling)
    except InvalidArgument as e:
        raise invalid(e.message) from None
    for name in params:
        if name not in _NOT_SAMPLING:
            raise invalid(f"sampling parameter '{name}' is not supported by Batchyard's LLM mode")
    return prompt, switches, max_tokens


# The sampling parameters served, with the type the backend converts each to (SamplingParams'
# annotations: Optional[int] is int).
_SAMPLING_TYPES = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int,
                   "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float,
                   "min_tokens": int, "logprobs": int}


# Request parameters Triton takes for itself (its scheduler's, its protocol's): not the model's.
_TRITON_PARAMETERS = frozenset(("sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                                "binary_data_output", "triton_enable_empty_final_response"))


# The largest text input: a prompt within /v1/completions' character limit, at 4 bytes a
# character (UTF-8's most); past it, refused before it is decoded or tokenized.
MAX_TEXT_BYTES = 4 * MAX_PROMPT_CHARS
MAX_SAMPLING_JSON = 1 << 16  # sampling_parameters' JSON: a few small members, read on the loop


def _one_bytes_element(name: str, data: bytes) -> bytes:
    """A raw BYTES tensor's one element (a 4-byte little-endian length, then its bytes): the
    backend's inputs hold one, and a tensor of millions of elements, split into Python objects,
    held the loop seconds."""
    if len(data) < 4:
        raise invalid(f"input '{name}': the BYTES data ends inside an element's length")
    (n,) = struct.unpack_from("<I", data, 0)
    if 4 + n != len(data):
        raise invalid(f"input '{name}': unexpected number of elements or bytes: one element of {n} bytes "
                      f"declared, {len(data)} bytes of data (it holds one element)")
    return bytes(data[4:])


def _text(name: str, value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"input '{name}' is not UTF-8 text: {e}") from None


def grpc_request(model: str, request) -> tuple[dict, dict]:
    """(the backend's inputs by name, as lists of values; the request's parameters) of a
    ModelInferRequest, its tensors raw or typed. Shared memory is not served for these models."""
    want = {name: datatype for name, datatype, _ in BACKEND_INPUTS}
    inputs: dict = {}
    raw = iter(request.raw_input_contents)
    for t in request.inputs:
        if t.name in inputs:
            raise invalid(f"input '{t.name}' already exists in request")
        if t.name not in want:
            raise invalid(f"unexpected inference input '{t.name}' for model '{model}'")
        if "shared_memory_region" in t.parameters:
            raise invalid(f"input '{t.name}': an LLM model takes no shared-memory input")
        if t.datatype != want[t.name]:
            raise invalid(f"inference input '{t.name}' data-type is '{t.datatype}', but model '{model}' expects "
                          f"'{want[t.name]}'")
        if list(t.shape) != [1]:  # (the backend's dims, with no batch dimension)
            shape = list(t.shape) if len(t.shape) <= 8 else f"a shape of {len(t.shape)} dimensions"
            raise invalid(f"unexpected shape for input '{t.name}' for model '{model}'. Expected [1], got {shape}")
        if request.raw_input_contents:
            data = next(raw, None)
            if data is None:
                raise invalid(f"expected raw input content for input '{t.name}' "
                              f"({len(request.raw_input_contents)} given for {len(request.inputs)} inputs)")
            if t.datatype == "BOOL" and len(data) != 1:
                raise invalid(f"input '{t.name}': {len(data)} bytes of BOOL data for one element")
            value = _one_bytes_element(t.name, data) if t.datatype == "BYTES" else bool(data[0])
        else:
            values = t.contents.bytes_contents if t.datatype == "BYTES" else t.contents.bool_contents
            if len(values) != 1:
                raise invalid(f"unexpected number of elements {len(values)} for input '{t.name}', expecting 1")
            value = values[0]
        if t.datatype == "BYTES" and len(value) > (MAX_TEXT_BYTES if t.name == "text_input" else MAX_SAMPLING_JSON):
            raise invalid(f"input '{t.name}' of {len(value)} bytes: at most "
                          f"{MAX_TEXT_BYTES if t.name == 'text_input' else MAX_SAMPLING_JSON}")
        inputs[t.name] = [_text(t.name, value) if t.datatype == "BYTES" else value]
    params = {k: getattr(p, p.WhichOneof("parameter_choice")) for k, p in request.parameters.items()
              if k not in _TRITON_PARAMETERS and p.WhichOneof("parameter_choice")}
    return inputs, params


def grpc_outputs(members: dict) -> list[tuple[str, str, list, bytes]]:
    """The backend's outputs as (name, KServe datatype, shape, raw contents), each of one
    element: shape [1], as the backend's tensors of a list, but num_input_tokens, a 0-d one in
    the backend (``np.asarray(len(prompt_token_ids))``), shape [] as Triton sends it (it was [1],
    and ``as_numpy`` gave an array where Triton's client gets a scalar)."""
    out = []
    for name, datatype, _ in BACKEND_OUTPUTS:
        if name in members:
            value = members[name]
            shape = [] if name == "num_input_tokens" else [1]
            if datatype == "BYTES":
                data = value.encode()
                out.append((name, datatype, shape, struct.pack("<I", len(data)) + data))
            elif datatype == "FP32":
                out.append((name, datatype, shape, struct.pack("<f", value)))
            else:
                out.append((name, datatype, shape, struct.pack("<I", value)))
    return out


class LlmGenerate:
    """The answers of LLM models to Triton's protocols, from the completions route's engines and
    tokenizers."""

    def __init__(self, completions: OpenAiCompletions):
        self.completions = completions

    async def answer(self, model: str, body: dict, emit: Optional[Callable[[dict], None]] = None) -> dict:
        """A generate request's answer: its members besides model_name, model_version and id
        (KServeError for the request's fault or its run's). ``emit``: see ``run``."""
        return await self.run(model, *read_generate_body(body), emit=emit)

    async def run(self, model: str, prompt: str, switches: dict, max_tokens: int,
                  timeout: Optional[float] = None, emit: Optional[Callable[[dict], None]] = None) -> dict:
        """The backend's outputs by name, as JSON values (text, a number). Under the ``stream``
        switch, ``emit`` is called with those of each engine step but the last, whose are
        returned (the stream's final response)."""
        streamed = bool(switches.get("stream")) and emit is not None
        given = 0  # tokens of the responses emitted
        last = ""  # the piece of the step a stop string ended it at: the final response's, as the backend's
        logprobs: Optional[BackendLogprobs] = None
        decoded: list = []  # the logprobs of the tokens decoded, as the engine gave them

        def on_text(piece: str, tokens: int, stopped: bool) -> None:
            nonlocal given, last
            if stopped:
                last = piece
                return
            given += tokens
            emit(_outputs(switches, piece, len(ids), tokens, logprobs=logprobs.of(decoded, given)))

        try:
            logprobs = BackendLogprobs(self.completions, model, switches)
            (ids,) = await self.completions.encode(model, [prompt])
            switches["sampling"] = await self.completions.with_bad_words(model, switches["sampling"],
                                                                         switches["bad_words"])
            # (no more than the context leaves: vLLM's engine ends a sequence there, "length")
            max_tokens = self.completions.max_tokens_for(model, ids, max_tokens, sampling=switches["sampling"])
            run = dict(timeout=timeout or self.completions.default_timeout_s, ignore_eos=switches["ignore_eos"],
                       sampling=switches["sampling"])
            rule = TextRule(switches["stop"], switches["include_stop_str_in_output"], switches["skip_special_tokens"])
            out = await self.completions.complete(model, ids, max_tokens, run, rule,
                                                  on_text=on_text if streamed else None,
                                                  on_step=(lambda step: decoded.extend(step.logprobs))
                                                  if streamed else None)
        except OpenAiError as e:  # (a prompt too long or that cannot be tokenized)
            raise invalid(e.message) from None
        except BatchyardError as e:
            raise from_batchyard(e, model) from None
        rest = await asyncio.to_thread(logprobs.of, out.logprobs)  # (up to 21 decodes a token)
        if streamed:
            return _outputs(switches, last + out.rest, len(ids), len(out.tokens) - given, out.finish_reason, rest)
        text = out.text if switches["exclude_input_in_output"] else prompt + out.text
        return _outputs(switches, text, len(ids), len(out.tokens), out.finish_reason, rest)


class BackendLogprobs:
    """The backend's ``logprobs`` and ``cumulative_logprob`` outputs of one run, a response at a
    time: ``of(positions)``, with every position of the generation so far (the engine's
    P.PositionLogprobs), gives those of the positions past the last response's."""

    def __init__(self, completions: OpenAiCompletions, model: str, switches: dict):
        self.asked = switches["sampling"].logprobs is not None
        self.wanted = bool(switches.get("return_logprobs") or switches.get("return_cumulative_logprob"))
        self.texts = completions.token_texts(model) if self.asked and self.wanted else None
        self.given = 0  # positions of the responses before
        self.cumulative = 0.0

    def of(self, positions: list, end: Optional[int] = None) -> tuple:
        """-> (the JSON text of the positions past those given, up to ``end``: each {token id:
        {logprob, rank, decoded_token}}, the decoded token first; "null" where the sampling asked
        none, as the backend's; the sum of the generation's logprobs so far, as the backend's
        float32 tensor holds it, NaN where none asked, as its None)."""
        if self.texts is None:
            return "null", math.nan
        end = len(positions) if end is None else end
        new, self.given = positions[self.given:end], max(self.given, end)
        for position in new:  # (a token at a time, as vLLM sums them)
            self.cumulative += position[0][1]
        return json.dumps(logprob_objects(new, self.texts.of(new))), float(np.float32(self.cumulative))


def _outputs(switches: dict, text: str, n_in: int, n_out: int, finish_reason: str = "None",
             logprobs: tuple = ("null", math.nan)) -> dict:
    """One response's outputs, as the backend's ``create_response`` makes them: ``finish_reason``
    is ``str`` of vLLM's, "None" until the last ("stop" at an end-of-sequence token, "length" at
    max_tokens); under a stream, ``num_output_tokens`` counts the response's own tokens, and
    ``logprobs`` holds theirs (BackendLogprobs.of)."""
    members = {"text_output": text}
    if switches.get("return_finish_reason"):
        members["finish_reason"] = finish_reason
    if switches.get("return_cumulative_logprob"):
        members["cumulative_logprob"] = logprobs[1]
    if switches.get("return_logprobs"):
        members["logprobs"] = logprobs[0]
    if switches.get("return_num_input_tokens"):
        members["num_input_tokens"] = n_in
    if switches.get("return_num_output_tokens"):
        members["num_output_tokens"] = n_out
    return members


async def responses(run: Callable[[Callable[[dict], None]], Awaitable[dict]]) -> AsyncIterator[dict]:
    """The responses of a streamed run, ``run(emit)``: what it emits, as it emits it, then what
    it returns. Its exception is raised after the responses emitted before it."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    task = asyncio.ensure_future(run(queue.put_nowait))
    # (emitted from the client's reply handling, before the reply that ends the run)
    task.add_done_callback(lambda _: queue.put_nowait(done))
    try:
        while (item := await queue.get()) is not done:
            yield item
        yield task.result()
    finally:
        task.cancel()
