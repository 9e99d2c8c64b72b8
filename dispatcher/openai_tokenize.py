"""vLLM's tokenizer routes on the front door's HTTP port (LLM mode), for the clients and load
tools that count tokens with the server's own tokenizer:

- ``POST /tokenize``: ``{"prompt": "..."}`` (the tokenizer's special tokens added unless
  ``add_special_tokens`` is false) or ``{"messages": [...]}`` (the chat route's rendering:
  the model's chat template, ``add_generation_prompt`` true by default, no special tokens
  added unless asked) answers ``{"count", "max_model_len", "tokens"}``, and ``token_strs`` (the
  tokenizer's strings of them) with ``return_token_strs``;
- ``POST /detokenize``: ``{"tokens": [...]}`` answers ``{"prompt": text}``, special tokens kept.

``model`` may be left out where the node serves one LLM model, as vLLM's serves one. Errors are
OpenAI's shape, as on /v1.
"""

from __future__ import annotations

from aiohttp import web

from . import openai_lax
from .openai_chat import TOKENIZE_CHAT_UNSUPPORTED, OpenAiChat
from .openai_fields import OpenAiError, flag, is_token, refuse_unsupported, shown
from .protocol import MAX_PROMPT_TOKENS


class OpenAiTokenize:
    def __init__(self, chat: OpenAiChat):
        self.chat, self.completions = chat, chat.completions

    def routes(self) -> list:
        return [web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize)]

    async def tokenize(self, request) -> web.Response:
        oa = self.completions
        try:
            body, model = await oa.body(request, openai_lax.TOKENIZE)
            chat = body.get("messages") is not None
            special = flag(body, "add_special_tokens", default=not chat)
            strs = flag(body, "return_token_strs")
            if chat:
                refuse_unsupported(body, TOKENIZE_CHAT_UNSUPPORTED)
                text = await self.chat.prompt_text(body, model)
            else:
                text = body.get("prompt")
                if not isinstance(text, str):
                    raise OpenAiError(400, f"prompt must be a string (or give messages), got {shown(text)}",
                                      param="prompt")
            [ids] = await oa.encode(model, [text], special_tokens=special, empty_ok=True,
                                    param="messages" if chat else "prompt")
            out = {"count": len(ids), "max_model_len": oa.max_model_len.get(model), "tokens": ids, "token_strs": None}
            if strs:
                tok = oa.tokenizer(model)
                out["token_strs"] = [tok.id_to_token(i) for i in ids]
            return web.json_response(out)
        except Exception as e:  # noqa: BLE001 -- OpenAI's shape for every error (a 500 logged once)
            return oa.as_openai(e).response()

    async def detokenize(self, request) -> web.Response:
        oa = self.completions
        try:
            body, model = await oa.body(request, openai_lax.DETOKENIZE)
            tokens = body.get("tokens")
            if (not isinstance(tokens, list) or len(tokens) > MAX_PROMPT_TOKENS
                    or not all(is_token(t) for t in tokens)):
                raise OpenAiError(400, f"tokens must be a list of at most {MAX_PROMPT_TOKENS} token ids, got "
                                       f"{shown(tokens)}", param="tokens")
            oa.tokenizer(model, "tokens")  # (no tokenizer: its 400, where decode would answer "")
            return web.json_response({"prompt": oa.decode(model, tokens, skip_special_tokens=False)})
        except Exception as e:  # noqa: BLE001 -- as tokenize's
            return oa.as_openai(e).response()

