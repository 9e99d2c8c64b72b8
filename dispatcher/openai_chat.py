"""OpenAI's ``POST /v1/chat/completions`` on the front door's HTTP port (LLM mode), as vLLM's
server serves it: the conversation is rendered to prompt text with the model's chat template
(chat_template), tokenized without special tokens (the template writes them, as vLLM's
default ``add_special_tokens: false`` for chat), and completed as ``/v1/completions`` completes
a prompt (openai_http: the sampling fields and their defaults, ``n``, ``stop``, ``stream`` and
``stream_options``, ``ignore_eos``, ``timeout``, ``batchyard_route``; ``logprobs`` true with
``top_logprobs``, as vLLM's chat reads them, in chat's shape). The answer is chat's:
each choice's ``message`` {role "assistant", content}; under ``stream``, ``chat.completion.chunk``
events of ``delta``s, the first of each choice ``{"role": "assistant", "content": ""}``; with
``add_generation_prompt`` false the role is the last message's, as vLLM's.

``max_completion_tokens`` (or the older ``max_tokens``) left out is what vLLM's server decodes:
the model's ``max_new_tokens`` (generation_config.json), else up to the end of its context
(cut, as any, to what the context leaves after the prompt). A message's ``content`` is a
string, null, or a list of text parts, joined with newlines (vLLM's "string" content format;
a template that loops over a message's parts, which vLLM would give the list, gets the string).
``chat_template_kwargs`` and ``reasoning_effort`` (with ``enable_thinking``, as vLLM sets it)
reach the template. At most MAX_MESSAGES messages, their text within /v1/completions'
character limit; the template is rendered off the front door's loop. Refused with a 400 naming
the field, rather than ignored: anything but text parts, tools and tool calls,
``response_format`` other than text, a request's own ``chat_template``, ``echo``.
``continue_final_message`` (with ``add_generation_prompt`` false) ends the prompt inside the
last message, as transformers' renderer cuts it for vLLM's server. A model folder without a
chat template is a 400 on this route, as vLLM answers one; one whose template does not compile
stops the front door's start.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from aiohttp import web

from . import openai_lax
from .chat_template import ChatTemplate, ChatTemplateError
from .openai_fields import (IGNORED, SERVED, UNSUPPORTED, OpenAiError, check_prompt_tokens, check_supported,
                            check_text_length, flag, max_tokens_field, shown)
from . import protocol as P
from .openai_http import NO_DEFAULTS, AnswerShape, OpenAiCompletions
from .openai_logprobs import ChatLogprobs, TokenTexts

MAX_MESSAGES = 1024  # messages in one conversation
# Chat's fields that would change the answer, refused unless they ask nothing (openai_http's
# rule): beside /v1/completions' own (less those chat has not, or reads otherwise), OpenAI's and
# vLLM's chat fields not served.
CHAT_UNSUPPORTED = {**{k: v for k, v in UNSUPPORTED.items() if k != "suffix"}, "tools": None, "functions": None,
                     "echo": False, "chat_template": None, "documents": None,
                     "media_io_kwargs": None, "mm_processor_kwargs": None, "return_prompt_text": False}
# What /tokenize refuses of a conversation, as the chat route refuses them (vLLM would apply them).
TOKENIZE_CHAT_UNSUPPORTED = {k: CHAT_UNSUPPORTED[k] for k in ("tools", "chat_template", "documents",
                                                              "mm_processor_kwargs")}
# Taken and left alone, beside /v1/completions' (no tools, no reasoning parser: nothing they change)
CHAT_IGNORED = (*IGNORED, "parallel_tool_calls", "include_reasoning")
CHAT_SERVED = (*(f for f in SERVED if f not in ("prompt", "echo")), "messages", "max_completion_tokens",
               "tool_choice", "function_call", "reasoning_effort", "add_generation_prompt", "chat_template_kwargs",
               "top_logprobs", "continue_final_message")


class ChatShape(AnswerShape):
    """``role``: the answer's, as vLLM's get_chat_request_role gives it: "assistant", or without
    add_generation_prompt the last message's (the answer goes on with that turn)."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(self, role: str = "assistant"):
        self.role = role

    def choice(self, i: int, text: str, out) -> dict:
        return {"index": i, "message": {"role": self.role, "content": text}, "logprobs": None,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}

    @staticmethod
    def last(i: int, text: str, out) -> dict:
        return {"index": i, "delta": {"content": text} if text else {}, "logprobs": None,
                "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}

    @staticmethod
    def piece(i: int, text: str) -> dict:
        return {"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": None}

    def first(self, i: int) -> Optional[dict]:
        return {"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None, "finish_reason": None}

    @staticmethod
    def logprobs(texts: TokenTexts, sampling: P.Sampling, as_ids: bool = False) -> ChatLogprobs:
        return ChatLogprobs(texts, sampling.logprobs or 0, as_ids)

    @staticmethod
    def put_prompt_logprobs(answer: dict, choice: dict, member: list) -> None:
        answer["prompt_logprobs"] = member

    @staticmethod
    def put_prompt_token_ids(answer: Optional[dict], choice: dict, ids: list) -> None:
        if answer is not None:  # (a stream's: its role chunk, as vLLM's)
            answer["prompt_token_ids"] = ids


CHAT = ChatShape()


class OpenAiChat:
    """The chat route over ``completions`` (its client, models, tokenizers and defaults)."""

    def __init__(self, completions: OpenAiCompletions):
        self.completions = completions
        self._templates: dict = {}  # model -> ChatTemplate, or the error its folder's gives

    def routes(self) -> list:
        return [web.post("/v1/chat/completions", self.chat)]

    async def chat(self, request) -> web.StreamResponse:
        oa = self.completions
        try:
            body, model = await oa.body(request, openai_lax.CHAT)
            _check_chat_fields(body)
            # (chat's logprobs, a boolean, as the sampling's: top_logprobs tokens a position)
            checked = check_supported({**body, "logprobs": _logprobs(body)},
                                      oa.defaults.get(model, NO_DEFAULTS).sampling, CHAT_UNSUPPORTED)
            # (vLLM's order: max_completion_tokens, else the older max_tokens)
            name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            max_tokens = max_tokens_field(body.get(name), name)
            oa.check_context(model, max_tokens, name)
            text = await self.prompt_text(body, model)
            special = flag(body, "add_special_tokens")  # (false: the template writes them, vLLM's default)

            async def prompt() -> list:
                [ids] = await oa.encode(model, [text], special_tokens=special, param="messages")
                check_prompt_tokens(ids, "messages")
                return [ids]

            generation = flag(body, "add_generation_prompt", default=True)
            shape = CHAT if generation else ChatShape(body["messages"][-1]["role"])
            return await oa.serve(request, body, model, checked, max_tokens, prompt, shape, from_text=True)
        except Exception as e:  # noqa: BLE001 -- OpenAI's shape for every error of this route (a 500 logged once)
            return oa.as_openai(e).response()

    async def prompt_text(self, body: dict, model: str) -> str:
        """A request's conversation (``messages``, ``add_generation_prompt``,
        ``continue_final_message``, ``chat_template_kwargs``, ``reasoning_effort``) as its model's
        prompt text, rendered off the loop (a template's cost grows with the conversation as it
        is written: one of nested loops took 35 s over 4096 messages); OpenAiError,
        ChatTemplateError."""
        messages = chat_messages(body.get("messages"))
        add_generation_prompt = flag(body, "add_generation_prompt", default=True)
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise OpenAiError(400, f"chat_template_kwargs must be an object, got {shown(kwargs)}",
                              param="chat_template_kwargs")
        kwargs = dict(kwargs or {})
        if taken := sorted({"chat_template", "tokenize"} & kwargs.keys()):  # (vLLM's refusal)
            raise OpenAiError(400, f"chat_template_kwargs may not set {taken[0]!r}", param="chat_template_kwargs")
        effort = body.get("reasoning_effort")  # OpenAI's; to the template, as vLLM passes it
        if effort is not None:
            if not isinstance(effort, str):
                raise OpenAiError(400, f"reasoning_effort must be a string, got {shown(effort)}",
                                  param="reasoning_effort")
            kwargs["reasoning_effort"] = effort
            kwargs.setdefault("enable_thinking", effort != "none")  # (templates that need it asked)
        template = self._template(model)
        return await asyncio.to_thread(template.render, messages, add_generation_prompt, kwargs,
                                       flag(body, "continue_final_message"))

    def _template(self, model: str) -> ChatTemplate:
        got = self._templates.get(model)
        if got is None:
            folder = self.completions.models[model]
            try:
                got = ChatTemplate.load(folder) or ChatTemplateError(
                    f"model {model!r} has no chat template (chat_template.jinja, or tokenizer_config.json's "
                    f"chat_template, in {folder}): send its prompt to /v1/completions")
            except ChatTemplateError as e:
                got = e
            self._templates[model] = got
        if isinstance(got, ChatTemplateError):
            raise got
        return got


def _check_chat_fields(body: dict) -> None:
    """Chat's fields that are no mere default: only text is answered."""
    for name in ("tool_choice", "function_call"):  # ("none": no tool, what this serves)
        choice = body.get(name)
        if choice not in (None, "none"):
            raise OpenAiError(400, f"{name} {shown(choice)} is not supported yet by Batchyard's LLM mode (no tools)",
                              param=name)


def _logprobs(body: dict) -> Optional[int]:
    """The sampling's logprobs of chat's ``logprobs`` (a boolean) and ``top_logprobs`` (null:
    0), as vLLM reads them: the most likely tokens a position, or None where not asked."""
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= P.MAX_LOGPROBS):
        raise OpenAiError(400, f"top_logprobs must be an integer in 0..{P.MAX_LOGPROBS}, got {shown(top)}",
                          param="top_logprobs")
    if not flag(body, "logprobs"):  # (with top_logprobs, refused before: openai_lax's raw check)
        return None
    return top or 0


def chat_messages(value) -> list[dict]:
    """The conversation as its template reads it: each message's role, its content as one
    string (text parts joined by newlines, null empty), and its name where given; OpenAiError
    naming what it refuses."""
    if not isinstance(value, list) or not value:
        raise OpenAiError(400, f"messages must be a non-empty list of messages, got {shown(value)}", param="messages")
    if len(value) > MAX_MESSAGES:
        raise OpenAiError(400, f"{len(value)} messages; at most {MAX_MESSAGES} a conversation", param="messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise OpenAiError(400, f"{where} must be an object with a role and a content, got {shown(m)}",
                              param="messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise OpenAiError(400, f"{where}.role must be a non-empty string, got {shown(role)}", param="messages")
        if m.get("tool_calls") or role == "tool":
            raise OpenAiError(400, f"{where}: tool calls and tool messages are not supported yet by Batchyard's "
                                   "LLM mode", param="messages")
        message = {"role": role, "content": _content(where, m.get("content"))}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise OpenAiError(400, f"{where}.name must be a string, got {shown(name)}", param="messages")
            message["name"] = name
        out.append(message)
    # (roles and names count: 61 MB of roles rendered before the length was refused)
    check_text_length(["".join((m["role"], m["content"], m.get("name", ""))) for m in out], param="messages")
    return out


def _content(where: str, content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAiError(400, f"{where}.content must be a string or a list of parts, got {shown(content)}",
                          param="messages")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise OpenAiError(400, f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                   f"supported by Batchyard's LLM mode, got {shown(kind if kind else part)}",
                              param="messages")
        texts.append(part["text"])
    return "\n".join(texts)
