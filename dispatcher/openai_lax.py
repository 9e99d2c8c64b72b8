"""An OpenAI request's typed members read as vLLM's server reads them: its request models are
pydantic models in pydantic's lax mode, so "max_tokens": "4", 4.0 or true is 4, "echo": 1 or
"yes" is true, "temperature": "0" is 0.0, and a prompt of [1.0, 2.0] is token ids 1 and 2. The
OpenAI routes (openai_http, openai_chat, openai_tokenize) convert those members here first and
check them strictly after (openai_fields); a value pydantic refuses is left as it came, for
that check's 400 naming it.

pydantic does the converting, not rules written here: its lax mode has many cases (strings with
spaces or underscores, floats without a fraction, "on"/"off", 0/1), and the same library's
answer is vLLM's answer. Each member's type is vLLM's (0.32) annotation, but for null, taken
everywhere as the member left out (as the routes took it before: "n": null is 1 here, a 400 in
vLLM).
"""

from __future__ import annotations

import functools
from typing import Annotated, Optional, Union

import pydantic

from .openai_fields import OpenAiError
from .protocol import MAX_PROMPT_TOKENS

_INT, _FLOAT, _BOOL = Optional[int], Optional[float], Optional[bool]
_TOKEN = Annotated[int, pydantic.Field(ge=0)]
_TOKEN_IDS = Optional[list[int]]
_TOKENS = Optional[list[_TOKEN]]
_PROMPT = Optional[Union[list[_TOKEN], list[list[_TOKEN]], str, list[str]]]
_BIASES = Optional[dict[str, float]]
# An int that vLLM's models check is a JSON number before they convert it (their check_logprobs
# compares it raw): "logprobs": "1" is its 400, "logprobs": 1.0 or true its 1.
_NUMBER = Annotated[Optional[int], "a JSON number"]

# Members of vLLM's CompletionRequest and ChatCompletionRequest alike.
_SAMPLING = {
    **dict.fromkeys(("frequency_penalty", "presence_penalty", "temperature", "top_p", "min_p", "repetition_penalty",
                     "length_penalty"), _FLOAT),
    **dict.fromkeys(("seed", "top_k", "n", "min_tokens", "max_tokens", "priority",
                     "truncate_prompt_tokens", "thinking_token_budget", "stream_interval",
                     "routed_experts_prompt_start"), _INT),
    **dict.fromkeys(("stream", "echo", "use_beam_search", "watermarking", "include_stop_str_in_output", "ignore_eos",
                     "skip_special_tokens", "spaces_between_special_tokens", "add_special_tokens",
                     "return_tokens_as_token_ids", "return_token_ids", "return_token_offsets", "return_mm_kwargs"),
                    _BOOL),
    **dict.fromkeys(("stop_token_ids", "allowed_token_ids", "logprob_token_ids"), _TOKEN_IDS),
    "logit_bias": _BIASES, "prompt_logprobs": _NUMBER,
}
class Members(dict):
    """A route's typed members (name: vLLM's type), and ``raw_check``: vLLM's checks of the
    request as it came, which its models run before converting anything (their
    mode="before" validators), so on values' raw truthiness: "stream": "false" is a true
    value there."""

    def __init__(self, types: dict, raw_check=None):
        super().__init__(types)
        self.raw_check = raw_check


def _shared_raw(body: dict) -> None:
    """vLLM's checks that its completion and chat models both make."""
    if body.get("stream_options") and not body.get("stream"):
        raise OpenAiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
    prompt_logprobs = body.get("prompt_logprobs")
    if isinstance(prompt_logprobs, (int, float)) and body.get("stream") and (prompt_logprobs > 0
                                                                            or prompt_logprobs == -1):
        raise OpenAiError(400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")


def _chat_raw(body: dict) -> None:
    _shared_raw(body)
    top = body.get("top_logprobs")
    if isinstance(top, (int, float)) and (top == -1 or top > 0) and not body.get("logprobs"):
        raise OpenAiError(400, "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise OpenAiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


COMPLETION = Members({**_SAMPLING, "logprobs": _NUMBER, "prompt": _PROMPT}, _shared_raw)
_CHAT_TEMPLATE = dict.fromkeys(("add_generation_prompt", "continue_final_message"), _BOOL)
CHAT = Members({**_SAMPLING, **_CHAT_TEMPLATE, "logprobs": _BOOL, "top_logprobs": _NUMBER, "max_completion_tokens": _INT,
                **dict.fromkeys(("include_reasoning", "parallel_tool_calls", "return_prompt_text"), _BOOL)}, _chat_raw)
# /tokenize's two requests (by messages or prompt) in one, /detokenize's
TOKENIZE = {**_CHAT_TEMPLATE, "add_special_tokens": _BOOL, "return_token_strs": _BOOL}
DETOKENIZE = {"tokens": _TOKENS}
STREAM_OPTIONS = dict.fromkeys(("include_usage", "continuous_usage_stats"), _BOOL)


@functools.cache
def _adapter(annotation) -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(annotation)


def as_vllm_reads(body: dict, members: dict) -> dict:
    """``body`` with each of its ``members`` (name: vLLM's type) that pydantic converts
    converted, and stream_options' too; the others as they came. OpenAiError where the members'
    raw_check refuses the body as it came."""
    raw_check = getattr(members, "raw_check", None)
    if raw_check is not None:
        raw_check(body)
    out, budget = dict(body), [MAX_ITEMS_READ]
    for name, annotation in members.items():
        value = body.get(name)
        if value is not None:
            out[name] = _converted(value, annotation, budget)
    options = body.get("stream_options")
    if isinstance(options, dict) and "stream" in members:
        out["stream_options"] = as_vllm_reads(options, STREAM_OPTIONS) if options else options
    return out


# The items of a request's lists (all of them together) read at most: a prompt's ids are at most
# MAX_PROMPT_TOKENS, so lists of more are left as they came (and refused) unless ints already.
# pydantic reads 131,072 floats in ~13 ms, refuses them in 8-45 ms.
MAX_ITEMS_READ = MAX_PROMPT_TOKENS


def _converted(value, annotation, budget: list):
    """``value`` as pydantic reads it as ``annotation``, or as it came where it refuses it.
    Lists go whole to one list's type: pydantic gathers an error an item for each type of a
    union, and a refused prompt of 100,000 ids read through the prompt's four cost 260 ms."""
    if annotation is _NUMBER and not isinstance(value, (int, float)):
        return value
    if annotation is _PROMPT:
        return _prompt(value, budget)
    if isinstance(value, list) and annotation in (_TOKEN_IDS, _TOKENS):
        got = _items(value, int if annotation is _TOKEN_IDS else _TOKEN, budget)
        return value if got is None else got
    if isinstance(value, dict) and annotation is _BIASES:
        budget[0] -= len(value)
        return value if budget[0] < 0 else _read(value, annotation)
    return _read(value, annotation)


def _read(value, annotation):
    try:
        return _adapter(annotation).validate_python(value)
    except pydantic.ValidationError:
        return value


def _prompt(value, budget: list):
    """vLLM's prompt: token ids, lists of them, a text, or texts, taken as pydantic's smart
    union takes them (texts only where every item is one; else lists of ids where every item is
    a list; else ids)."""
    if not isinstance(value, list) or all(type(v) is str for v in value):
        return value  # (a text or texts as they are; anything else refused)
    if all(isinstance(v, list) for v in value):
        rows = []
        for row in value:
            got = _items(row, _TOKEN, budget)
            if got is None:
                return value
            rows.append(got)
        return rows
    got = _items(value, _TOKEN, budget)
    return value if got is None else got


def _items(values: list, item, budget: list) -> Optional[list]:
    """``values`` read as a list of ``item``; None where refused, or past ``budget[0]`` items
    read in the request."""
    if all(type(v) is int for v in values):
        return values  # (already ints: as pydantic would give them, or a refusal the route's check words)
    budget[0] -= len(values)
    if budget[0] < 0:
        return None
    got = _read(values, list[item])
    return None if got is values else got
