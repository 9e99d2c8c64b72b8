"""Triton's generate extension for the LLM mode's models, in the shape Triton's vLLM backend
gives it, so a client written against Triton + vLLM runs unchanged:
``POST /v2/models/{m}/generate`` with ``{"text_input": "...", "parameters": {"max_tokens": 16}}``
answers ``{"model_name": m, "model_version": "1", "text_output": "<prompt><completion>"}``.

The backend's inputs are members of the body (or of its ``parameters``): ``text_input``;
``exclude_input_in_output`` (false: the prompt is written before the completion, the backend's
default, and true when streaming); ``stream``; ``return_finish_reason``,
``return_num_input_tokens`` and ``return_num_output_tokens`` for the outputs of those names.
Every other member is a sampling parameter, as the backend reads its request's parameters, and
converted to its type as the backend does (``"4"`` is 4 tokens): ``max_tokens`` (16 when left
out, vLLM's default) and ``temperature``, which must be 0 or left out (Batchyard decodes greedily;
vLLM's default would sample). Any other sampling parameter is refused rather than ignored, as on
``/v1/completions``. Batchyard's engines decode ``max_tokens`` tokens, past an end-of-sequence
token too (``finish_reason`` "length"), where the backend stops at one ("stop").

``stream`` true is served by ``generate_stream`` only, as one event holding the whole completion
(Batchyard's engines answer once); from ``generate`` it is Triton's error for a model that
answers more than once.
"""

from __future__ import annotations

from typing import Optional

import grpc

from .errors import BatchyardError
from .kserve_common import KServeError, from_batchyard, invalid
from .openai_http import OpenAiCompletions, OpenAiError
from .protocol import MAX_TOKEN_ID

# The vLLM backend's inputs that Batchyard serves, with their kinds; its others (images,
# logprobs, sampling_parameters as a string) are refused.
_BOOL_INPUTS = ("exclude_input_in_output", "stream", "return_finish_reason", "return_num_input_tokens",
                "return_num_output_tokens")
_REFUSED_INPUTS = ("sampling_parameters", "image", "return_cumulative_logprob", "return_logprobs")
_INPUTS = ("text_input", *_BOOL_INPUTS, *_REFUSED_INPUTS)
# Members a client sends for Triton itself, not for the sampler.
_NOT_SAMPLING = ("id", "parameters")
MANY_ANSWERS = ("generate expects model to produce exactly 1 response, use generate stream for model that "
                "generates various number of responses")


def _shown(value) -> str:
    """A JSON value in an error, at a cost that does not grow with it."""
    if isinstance(value, (list, dict)):
        return f"an {'array' if isinstance(value, list) else 'object'} of {len(value)} items"
    return repr(value[:80] + "..." if isinstance(value, str) and len(value) > 80 else value)


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


def read_request(body: dict, streaming: bool) -> tuple[str, dict, int]:
    """-> (prompt, the backend's switches by name, max_tokens) of a generate request's body."""
    members = [(k, v) for k, v in body.items() if k != "parameters"]
    nested = body.get("parameters", {})
    if not isinstance(nested, dict):
        raise invalid("Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as object")
    seen: dict = {}
    for name, value in [*members, *nested.items()]:
        if name in seen:
            raise invalid(f"input '{name}' already exists in request" if name in _INPUTS else
                          f"parameter '{name}' is given twice (in the body and in its parameters)")
        seen[name] = value
    if "text_input" not in seen:
        raise invalid("expected 1 inputs but got 0 inputs: missing required input(s) ['text_input']")
    prompt = _one("text_input", seen.pop("text_input"), str)
    if not prompt:
        raise invalid("input 'text_input' is empty")
    switches = {name: _one(name, seen.pop(name), bool) for name in _BOOL_INPUTS if name in seen}
    for name in _REFUSED_INPUTS:
        if name in seen:
            raise invalid(f"input '{name}' is not supported by Batchyard's LLM mode")
    stream = switches.get("stream", False)
    if stream and not streaming:
        raise KServeError(grpc.StatusCode.INTERNAL, MANY_ANSWERS)
    prepend = not switches.get("exclude_input_in_output", stream)
    if prepend and stream:
        raise invalid("When streaming, `exclude_input_in_output` = False is not allowed.")
    switches["exclude_input_in_output"] = not prepend
    max_tokens = _sampling("max_tokens", seen.pop("max_tokens", 16), int)
    if not 1 <= max_tokens <= MAX_TOKEN_ID:
        raise invalid(f"max_tokens must be a positive integer, got {max_tokens}")
    temperature = _sampling("temperature", seen.pop("temperature", 0), float)
    if temperature != 0:
        raise invalid(f"only greedy decoding is served: temperature must be 0, got {temperature:g}")
    for name, value in seen.items():
        if name in _NOT_SAMPLING:
            continue
        if value is None or isinstance(value, (list, dict)):
            raise invalid(f"parameter '{name}' has invalid type. It should be either 'int', 'bool', or 'string'.")
        raise invalid(f"sampling parameter '{name}' is not supported by Batchyard's LLM mode")
    return prompt, switches, max_tokens


class LlmGenerate:
    """The generate extension's answers for LLM models, from the completions route's engines and
    tokenizers."""

    def __init__(self, completions: OpenAiCompletions):
        self.completions = completions

    async def answer(self, model: str, body: dict, streaming: bool, timeout: Optional[float] = None) -> dict:
        """The answer's members besides model_name, model_version and id (KServeError for the
        request's fault or its run's)."""
        prompt, switches, max_tokens = read_request(body, streaming)
        try:
            (ids,) = await self.completions.encode(model, [prompt])
            out = await self.completions.client.generate(
                model, ids, max_tokens, timeout=timeout or self.completions.default_timeout_s)
            text = self.completions.decode(model, list(out))
        except OpenAiError as e:  # (a prompt too long or that cannot be tokenized)
            raise invalid(e.message) from None
        except BatchyardError as e:
            raise from_batchyard(e, model) from None
        members = {"text_output": text if switches["exclude_input_in_output"] else prompt + text}
        if switches.get("return_finish_reason"):
            members["finish_reason"] = "length"  # (max_tokens decoded, as on /v1/completions)
        if switches.get("return_num_input_tokens"):
            members["num_input_tokens"] = len(ids)
        if switches.get("return_num_output_tokens"):
            members["num_output_tokens"] = len(out)
        return members
