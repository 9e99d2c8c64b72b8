"""The OpenAI routes read loosely typed members as vLLM's server does (pydantic's lax mode):
"max_tokens": "4" is 4 there, and was a 400 here. The last test holds the member table to
vLLM's own request models (needs .venv-llm: `make test-llm`)."""

from __future__ import annotations

import math
import typing

import pytest

from batchyard import openai_lax
from batchyard.openai_lax import as_vllm_reads

# (member, value as sent, value vLLM reads, or REFUSED: left as sent, for the route's 400)
REFUSED = object()
CASES = [
    ("max_tokens", "4", 4), ("max_tokens", 4.0, 4), ("max_tokens", " 4 ", 4), ("max_tokens", "4.0", 4),
    ("max_tokens", True, 1), ("max_tokens", "1_000", 1000), ("max_tokens", 4.5, REFUSED), ("max_tokens", "1e3", REFUSED),
    ("max_tokens", "0x10", REFUSED), ("max_tokens", "\u0663", REFUSED), ("n", "2", 2), ("seed", "-1", -1),
    ("temperature", "0", 0.0), ("temperature", " 0.5", 0.5), ("temperature", True, 1.0), ("top_p", "x", REFUSED),
    ("echo", 1, True), ("echo", 1.0, True), ("echo", "yes", True), ("echo", "off", False), ("echo", 2, REFUSED),
    ("stream", "TRUE", True), ("stream", "maybe", REFUSED), ("ignore_eos", "0", False),
    # (vLLM's models check these are JSON numbers before they convert them)
    ("logprobs", True, 1), ("logprobs", 2.0, 2), ("logprobs", "1", REFUSED), ("prompt_logprobs", "1", REFUSED),
    ("prompt_logprobs", 1.0, 1),
    ("prompt", [1.0, 2.0], [1, 2]), ("prompt", [True, 2], [1, 2]), ("prompt", [[1.0], [2]], [[1], [2]]),
    ("prompt", ["1", "2"], ["1", "2"]), ("prompt", ["a", 1], REFUSED), ("prompt", [-1], REFUSED),
    ("prompt", [2.5], REFUSED), ("prompt", 1, REFUSED), ("prompt", "text", "text"), ("prompt", ["1", 2], [1, 2]),
    ("prompt", [[True]], [[1]]), ("prompt", [["a"]], REFUSED), ("prompt", [[1], 2], REFUSED), ("prompt", [], []),
    ("prompt", ["a", [1]], REFUSED),
    ("stop_token_ids", ["5", 6.0, True], [5, 6, 1]), ("logit_bias", {"5": "3", "6": True}, {"5": 3.0, "6": 1.0}),
    ("logit_bias", {"5": "x"}, REFUSED), ("bad_words", [1], REFUSED), ("stop", 5, REFUSED),
]


CHAT_CASES = [("logprobs", 1, True), ("logprobs", 2, REFUSED), ("top_logprobs", 2.0, 2), ("top_logprobs", "2", REFUSED),
              ("max_completion_tokens", "8", 8), ("add_generation_prompt", "false", False)]


def _read(got, sent, read) -> bool:
    want = sent if read is REFUSED else read
    return got == want and type(got) is type(want)


@pytest.mark.parametrize(("member", "sent", "read"), CASES)
def test_a_completions_member_is_read_as_vllms_server_reads_it(member, sent, read):
    assert _read(as_vllm_reads({"model": "m", member: sent}, openai_lax.COMPLETION)[member], sent, read)


@pytest.mark.parametrize(("member", "sent", "read"), CHAT_CASES)
def test_a_chat_member_is_read_as_vllms_server_reads_it(member, sent, read):
    assert _read(as_vllm_reads({"logprobs": True, member: sent}, openai_lax.CHAT)[member], sent, read)


def test_chat_reads_its_own_types_and_null_is_left_out():
    body = {"logprobs": 1, "top_logprobs": 3.0, "max_completion_tokens": 8.0, "add_generation_prompt": "false",
            "n": None, "messages": [{"role": "user", "content": 5}]}
    assert as_vllm_reads(body, openai_lax.CHAT) == {
        "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 8, "add_generation_prompt": False, "n": None,
        "messages": [{"role": "user", "content": 5}]}  # (a member not in the table: as sent)


def test_stream_options_members_are_read_too_and_the_body_is_not_changed():
    body = {"stream": "true", "stream_options": {"include_usage": "yes", "continuous_usage_stats": 1, "other": "x"}}
    got = as_vllm_reads(body, openai_lax.COMPLETION)
    assert got == {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True,
                                                      "other": "x"}}
    assert body["stream"] == "true" and body["stream_options"]["include_usage"] == "yes"
    assert as_vllm_reads({"stream_options": {}}, openai_lax.COMPLETION) == {"stream_options": {}}


def test_tokenize_routes():
    assert as_vllm_reads({"add_special_tokens": "no", "return_token_strs": 1}, openai_lax.TOKENIZE) == {
        "add_special_tokens": False, "return_token_strs": True}
    assert as_vllm_reads({"tokens": ["1", 2.0]}, openai_lax.DETOKENIZE) == {"tokens": [1, 2]}
    assert as_vllm_reads({"tokens": [-1]}, openai_lax.DETOKENIZE) == {"tokens": [-1]}


def test_a_request_s_lists_are_read_whole_and_not_past_a_prompt_s_worth_of_items_in_all():
    """Read through the prompt's union of four types, a refused list of 100,000 ids cost the
    front door's loop 260 ms; past the limit of a prompt's ids (all of a request's lists
    together), a list is left as sent unless it is ints already."""
    refused = [1.0] * 10 + ["a"] + [2.0] * 100_000
    assert as_vllm_reads({"prompt": refused}, openai_lax.COMPLETION)["prompt"] is refused
    long = [1.0] * (openai_lax.MAX_ITEMS_READ + 1)
    assert as_vllm_reads({"prompt": long}, openai_lax.COMPLETION)["prompt"] is long
    rows = [[1.0] * (openai_lax.MAX_ITEMS_READ // 2 + 1)] * 2  # (the limit holds over all rows together)
    assert as_vllm_reads({"prompt": rows}, openai_lax.COMPLETION)["prompt"] is rows
    half = [1.0] * (openai_lax.MAX_ITEMS_READ // 2 + 1)  # (and over all members together)
    got = as_vllm_reads({"prompt": half, "stop_token_ids": half}, openai_lax.COMPLETION)
    assert sorted(type(got[k][0]).__name__ for k in ("prompt", "stop_token_ids")) == ["float", "int"]
    ints = list(range(openai_lax.MAX_ITEMS_READ * 2))
    assert as_vllm_reads({"prompt": ints}, openai_lax.COMPLETION)["prompt"] is ints


# vLLM's checks of the request as sent, on raw truthiness ("false" is a true value there):
# (route, body, the param its refusal names, or None where it passes)
RAW = [
    ("completion", {"stream": "false", "stream_options": {"include_usage": True}}, None),
    ("completion", {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ("completion", {"stream_options": {}}, None),
    ("completion", {"stream": "false", "prompt_logprobs": 1}, "prompt_logprobs"),
    ("completion", {"stream": True, "prompt_logprobs": 0}, None),
    ("chat", {"logprobs": "false", "top_logprobs": 2}, None),
    ("chat", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("chat", {"top_logprobs": 0}, None),
    ("chat", {"stream": "false", "prompt_logprobs": 1}, "prompt_logprobs"),
    ("chat", {"stream": True, "prompt_logprobs": 0}, None),
    ("chat", {"continue_final_message": "false", "add_generation_prompt": True}, ""),
    ("chat", {"continue_final_message": True}, None),
]


@pytest.mark.parametrize(("route", "body", "param"), RAW)
def test_vllms_checks_of_the_request_as_sent_are_made_on_it_as_sent(route, body, param):
    from batchyard.openai_fields import OpenAiError

    members = openai_lax.COMPLETION if route == "completion" else openai_lax.CHAT
    if param is None:
        as_vllm_reads(body, members)
    else:
        with pytest.raises(OpenAiError) as e:
            as_vllm_reads(body, members)
        assert (e.value.status, e.value.param) == (400, param)


# ------------------------------------------------------------------ against vLLM's models
_KINDS = {int: "int", float: "float", bool: "bool"}


def _kind(annotation) -> str:
    """"int", "float", "bool", "list[int]", "dict[str,float]" for vLLM's simple member types
    (Optional or not), "" for others."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType")) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
        if typing.get_origin(annotation) is typing.Union:
            return _kind(annotation)
    if annotation in _KINDS:
        return _KINDS[annotation]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and len(args) == 1 and _kind(args[0]) == "int":
        return "list[int]"
    if origin is dict and args == (str, float):
        return "dict[str,float]"
    return ""


@pytest.mark.llm
def test_the_member_table_is_vllms_and_reads_as_its_models_do():
    pytest.importorskip("vllm")
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.tokenize.protocol import (DetokenizeRequest, TokenizeChatRequest,
                                                          TokenizeCompletionRequest)

    for models, table in (((CompletionRequest,), openai_lax.COMPLETION), ((ChatCompletionRequest,), openai_lax.CHAT),
                          ((TokenizeCompletionRequest, TokenizeChatRequest), openai_lax.TOKENIZE),
                          ((DetokenizeRequest,), openai_lax.DETOKENIZE)):
        theirs = {k: _kind(f.annotation) for m in models for k, f in m.model_fields.items() if _kind(f.annotation)}
        ours = {k: _kind(a) for k, a in table.items() if k != "prompt"}
        assert ours == theirs, (models, set(ours.items()) ^ set(theirs.items()))
    # Each case, read by vLLM's request model: the same value, or a refusal naming the member.
    from vllm.exceptions import VLLMValidationError

    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
    for model, table, base, cases in ((CompletionRequest, openai_lax.COMPLETION, {"prompt": "x"}, CASES),
                                      (ChatCompletionRequest, openai_lax.CHAT, chat, CHAT_CASES)):
        for member, sent, read in cases:
            assert _read(as_vllm_reads({**base, member: sent}, table)[member], sent, read), (member, sent)
            try:
                got = getattr(model.model_validate({**base, member: sent}), member)
            except ValidationError as e:  # (a member's type)
                assert read is REFUSED and {err["loc"][0] for err in e.errors()} == {member}, (member, sent)
                continue
            except VLLMValidationError as e:  # (their checks of the raw request)
                assert read is REFUSED and e.parameter == member, (member, sent)
                continue
            assert read is not REFUSED and _read(got, sent, read), (member, sent, got)
    assert math.isnan(CompletionRequest.model_validate({"prompt": "x", "temperature": "nan"}).temperature)
    for route, body, param in RAW:
        model, base = (CompletionRequest, {"prompt": "x"}) if route == "completion" else (ChatCompletionRequest, chat)
        base = {k: v for k, v in base.items() if k != "logprobs"}
        try:
            model.model_validate({**base, **body})
        except VLLMValidationError as e:
            assert param is not None and (e.parameter or "") == param, (body, e)
        else:
            assert param is None, body
