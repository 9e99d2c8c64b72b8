"""Reading an OpenAI request's fields as vLLM's server reads them (the LLM mode's OpenAI routes:
openai_http, openai_chat, openai_tokenize): each field served checked, with an OpenAiError (a
400 naming it) otherwise; every field of vLLM's request that Batchyard does not serve refused
unless at its default (UNSUPPORTED), a few left alone by name (IGNORED); the limits that keep a
request's text within what the front door tokenizes at once.
"""

from __future__ import annotations

import re
from typing import Optional

from aiohttp import web

from . import errors
from . import protocol as P
from .client_codec import sampling_as_vllm
from .protocol import MAX_PROMPT_TOKENS, MAX_TOKEN_ID


# Text past these is refused before it is tokenized, which costs the front door about 1 s of CPU
# and 300 MiB a million characters. A prompt: MAX_PROMPT_TOKENS tokens at 8 characters each, twice
# what usual tokenizers average on prose or code (3-5), so a prompt within the token limit passes,
# while text of one token a character tokenizes at most 8 times what a request may hold. A request:
# the same, all of its prompts together (bounded one by one, a list of them tokenized 63 MB).
CHARS_PER_TOKEN_BOUND = 8
MAX_PROMPT_CHARS = CHARS_PER_TOKEN_BOUND * MAX_PROMPT_TOKENS
MAX_REQUEST_CHARS = MAX_PROMPT_CHARS


# Refused unless at their defaults, rather than ignored: a `stop` taken and ignored answered 200
# with the very text the caller asked to stop at. OpenAI's fields not served, then every field of
# vLLM's (0.32) completion request it does not serve: its server would apply them.
UNSUPPORTED = {"suffix": None,
               "use_beam_search": False,
               "length_penalty": 1.0, "watermarking": None,
               "spaces_between_special_tokens": True, "truncate_prompt_tokens": None, "truncation_side": None,
               "logprob_token_ids": None,
               "prompt_embeds": None, "structured_outputs": None, "priority": 0,
               "return_token_offsets": False, "kv_transfer_params": None,
               "ec_transfer_params": None, "vllm_xargs": None, "repetition_detection": None,
               "thinking_token_budget": None}
# Taken and left alone: nothing an answer holds depends on them here (OpenAI's user; vLLM's ids of
# a request for its logs, its prefix cache's salt, which a node without prefix caching has no
# use for, the number of tokens a stream's chunk gathers, an MoE's routing record, and the
# multimodal payload's form, which its generation routes ignore too).
IGNORED = ("user", "request_id", "session_id", "cache_salt", "stream_interval", "routed_experts_prompt_start",
           "mm_payload", "return_mm_kwargs")


# What /v1/completions serves (besides Batchyard's timeout and batchyard_route).
SERVED = ("model", "prompt", "max_tokens", "n", "stop", "include_stop_str_in_output", "stream", "stream_options",
          "ignore_eos", "add_special_tokens", "response_format", "frequency_penalty", "presence_penalty", "seed", "temperature",
          "top_p", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "skip_special_tokens",
          "logit_bias", "allowed_token_ids", "echo", "bad_words", "logprobs", "prompt_logprobs",
          "return_tokens_as_token_ids", "return_token_ids")


SAMPLING_FIELDS = tuple(P.Sampling.__struct_fields__)


class OpenAiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str = "",
                 code: str = ""):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param or None,
                          "code": self.code or None}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


MAX_N = 128  # completions of one prompt


def choices_per_prompt(body: dict, sampling: P.Sampling) -> int:
    """OpenAI's ``n`` (null: 1): completions of each prompt, which must sample (greedy, they
    would be n copies, and vLLM refuses that too)."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise OpenAiError(400, f"n must be an integer in 1..{MAX_N}, got {n!r:.40}", param="n")
    if n > 1 and sampling.temperature == 0:
        raise OpenAiError(400, f"n of {n} needs a temperature above 0: greedy, its completions would all be the "
                               "same", param="n")
    return n


MAX_STOPS = 64  # stop strings a request may give, each of at most MAX_STOP_CHARS
MAX_STOP_CHARS = 1024
OPENAI_MAX_STOPS = 4  # in a list on the OpenAI routes: OpenAI's limit, which vLLM's request models keep


def stop_strings(value, name: str, most: int = MAX_STOPS) -> tuple:
    """A request's stop strings: one, a list of at most ``most``, or null (none); OpenAiError
    naming ``name`` otherwise."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (not isinstance(stops, list) or len(stops) > most
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)):
        raise OpenAiError(400, f"{name} must be a string or a list of at most {most} strings of 1 to "
                               f"{MAX_STOP_CHARS} characters, got {shown(value)}", param=name)
    return tuple(dict.fromkeys(stops))


def shown(value) -> str:
    """A JSON value in an error, at a cost that does not grow with it."""
    if isinstance(value, (list, dict)):
        return f"an {'array' if isinstance(value, list) else 'object'} of {len(value)} items"
    return repr(value[:80] + "..." if isinstance(value, (str, bytes)) and len(value) > 80 else value)


def stream_options(body: dict) -> tuple[bool, bool, bool]:
    """-> (stream, include_usage, continuous_usage_stats), as OpenAI and vLLM read them: null
    is the default; vLLM's continuous_usage_stats (each chunk with the usage so far) counts
    only with include_usage."""
    stream = flag(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not isinstance(options, dict):
        raise OpenAiError(400, f"stream_options must be an object, got {options!r:.80}", param="stream_options")
    # Other keys are ignored and {} is taken without stream, as vLLM's (its StreamOptions allows
    # extra keys, OpenAI's include_obfuscation among them): both were a 400. A non-empty one
    # without stream is refused before (openai_lax's raw check, on the value as sent, as vLLM's).
    include = flag(options, "include_usage", "stream_options")
    continuous = flag(options, "continuous_usage_stats", "stream_options")
    return stream, include, include and continuous


def flag(body: dict, name: str, param: str = "", default: bool = False) -> bool:
    """A boolean member, null or left out ``default``; OpenAiError naming it otherwise."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAiError(400, f"{name} must be a boolean, got {value!r:.80}", param=param or name)
    return value


def is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID


def model_name(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str):  # a list or an object is unhashable
        raise OpenAiError(400, "model is required where the server has several: the name of one, a string"
                          if model is None
                          else f"model must be a string, got {model!r}", param="model")
    return model


def check_text_length(texts: list[str], param: str = "prompt") -> None:
    """Refuse text that cannot fit the token limit before tokenizing it (see MAX_PROMPT_CHARS)."""
    limit = (f"at most {MAX_PROMPT_CHARS} characters a prompt and {MAX_REQUEST_CHARS} in all a request "
             f"({CHARS_PER_TOKEN_BOUND} a token of the {MAX_PROMPT_TOKENS} a prompt may have); send token ids, "
             "or the prompts in several requests")
    longest = max(map(len, texts))
    if longest > MAX_PROMPT_CHARS:
        raise OpenAiError(400, f"a prompt of {longest} characters; {limit}", param=param)
    total = sum(map(len, texts))
    if total > MAX_REQUEST_CHARS:
        raise OpenAiError(400, f"{len(texts)} prompts of {total} characters in all; {limit}", param=param)


def forced_route(body: dict) -> str:
    route = body.get("batchyard_route")  # Batchyard extension: force "prefill-cpu" or "gpu"
    if route is None:  # null is the default, as for max_tokens, n and temperature
        route = ""
    if route not in ("", "prefill-cpu", "gpu"):
        raise OpenAiError(400, f"batchyard_route must be 'prefill-cpu' or 'gpu', got {route!r}", param="batchyard_route")
    return route


def max_tokens_field(value, name: str, zero_ok: bool = False) -> Optional[int]:
    """A request's max_tokens (null: None, vLLM's rule), or OpenAiError naming ``name``;
    ``zero_ok``: 0 is one too (echo's)."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < (0 if zero_ok else 1)):
        raise OpenAiError(400, f"{name} must be a {'non-negative' if zero_ok else 'positive'} integer, got {value!r}",
                          param=name)
    return value


def check_supported(body: dict, defaults: dict, unsupported: Optional[dict] = None) -> tuple[P.Sampling, int]:
    """-> the body's sampling, its fields left out taken from ``defaults`` (the model's) or else
    vLLM's (sampling_as_vllm), and its ``n``, once its fields are checked; OpenAiError naming
    the first it refuses."""
    # Compared by type as well: False == 0 and True == 1, and "temperature": false, "n": true were served.
    # (n: choices_per_prompt)
    if isinstance(body.get("best_of"), bool) or body.get("best_of", 1) not in (1, None):
        raise OpenAiError(400, f"best_of must be 1, got {body['best_of']!r}", param="best_of")
    refuse_unsupported(body, UNSUPPORTED if unsupported is None else unsupported)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:  # (text: no constraint)
        raise OpenAiError(400, f"response_format {shown(fmt)} is not supported yet by Batchyard's LLM mode (text only)",
                          param="response_format")
    # OpenAI's sampling fields and vLLM's extensions (top_k, min_p, repetition_penalty); null
    # is the default, as OpenAI takes it
    given = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    if "logit_bias" in given:
        given["logit_bias"] = logit_bias_field(given["logit_bias"])
    try:
        sampling = sampling_as_vllm(given, defaults)
    except errors.InvalidArgument as e:
        field = re.search(r"\$\.(\w+)", e.message)
        raise OpenAiError(400, e.message, param=field.group(1) if field else "") from None
    return sampling, choices_per_prompt(body, sampling)


def logit_bias_field(value) -> dict:
    """OpenAI's ``logit_bias`` as vLLM's server reads it: token ids (JSON's keys are strings) to
    biases, each cut to [-100, 100]; OpenAiError naming it otherwise."""
    if not isinstance(value, dict):
        raise OpenAiError(400, f"logit_bias must be an object of token ids to biases, got {shown(value)}",
                          param="logit_bias")
    biases = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise OpenAiError(400, f"logit_bias contains a key that cannot be converted to an integer token id: "
                                   f"{shown(key)}", param="logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or bias != bias:
            raise OpenAiError(400, f"logit_bias values must be numbers, got {shown(bias)}", param="logit_bias")
        biases[token] = min(100.0, max(-100.0, float(bias)))
    return biases


def bad_words_field(value, name: str = "bad_words") -> list:
    """vLLM's ``bad_words``: a list of non-empty strings (null: none), duplicates dropped as
    vLLM drops them; OpenAiError naming ``name`` otherwise."""
    if value is None:
        return []
    if (not isinstance(value, list) or len(value) > P.MAX_BAD_WORDS
            or not all(isinstance(w, str) and 0 < len(w) <= MAX_STOP_CHARS for w in value)):
        raise OpenAiError(400, f"{name} must be a list of at most {P.MAX_BAD_WORDS} non-empty strings of at most "
                               f"{MAX_STOP_CHARS} characters, got {shown(value)}", param=name)
    return list(dict.fromkeys(value))


def bad_words_token_ids(alone: list, spaced: list) -> list:
    """The token sequences vLLM bans for bad words (its SamplingParams.update_from_tokenizer):
    each word's token ids (its leading spaces stripped) ``alone``, and those after a space
    (``spaced``) where that gives a sequence as long that begins with another token (the word in
    the middle of text)."""
    banned: list = []
    for alone, spaced in zip(alone, spaced):
        if not alone:
            raise OpenAiError(400, "bad_words entries must tokenize to at least one token.", param="bad_words")
        banned.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            banned.append(spaced)
        if len(banned) > P.MAX_BAD_WORDS:
            raise OpenAiError(400, f"Too many bad words after tokenization: {len(banned)}. The max number is "
                                   f"{P.MAX_BAD_WORDS}.", param="bad_words")
    return banned


def refuse_unsupported(body: dict, unsupported: dict) -> None:
    """OpenAiError naming the first field of ``unsupported`` (name: default) that asks something."""
    for key, default in unsupported.items():
        if not asks_nothing(body.get(key, default), default):
            raise OpenAiError(400, f"{key!r} is not supported yet by Batchyard's LLM mode", param=key)


def check_prompt_tokens(ids: list, param: str = "prompt") -> None:
    if len(ids) > MAX_PROMPT_TOKENS:
        raise OpenAiError(400, f"the prompt has {len(ids)} tokens; a request takes at most {MAX_PROMPT_TOKENS}",
                          param=param)


def asks_nothing(value, default) -> bool:
    """Whether an unsupported field's value asks for nothing: null, its default, or an empty
    list or map where the default is null. By ``==``, 0 passed as False: `logprobs: 0` (OpenAI's
    request for the sampled token's logprob) was served without it, 200, silently."""
    if value is None or value is default:
        return True
    if default is None:
        return value == [] or value == {}
    if isinstance(default, (bool, str)):
        return value == default and type(value) is type(default)
    return type(value) in (int, float) and value == default
