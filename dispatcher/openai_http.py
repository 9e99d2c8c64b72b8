"""OpenAI-compatible ``/v1/completions`` and ``/v1/models`` on the front door's HTTP port (LLM mode).

Text prompts are tokenized here, in the front-door process, with the model folder's
``tokenizer.json`` (the ``tokenizers`` library, no transformers), so the dispatcher only ever
sees token ids. A prompt may also be given as token ids, as OpenAI's API allows. The sampling
fields are OpenAI's ``temperature``, ``top_p``, ``seed``, ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` (each bias cut to [-100, 100], as vLLM's server cuts it),
and vLLM's ``top_k``, ``min_p``, ``repetition_penalty``, ``allowed_token_ids`` and ``bad_words``
(tokenized here as vLLM's SamplingParams tokenizes them: openai_fields.bad_words_token_ids), within vLLM's
bounds (a 400 naming the field past them). One left out (or null) is taken as vLLM's server
takes it: the model folder's generation_config.json value (config ``generation_config =
"auto"``, vLLM's default), else vLLM's own: a request that gives none samples at temperature 1;
``temperature: 0`` is greedy. ``max_tokens`` left out or null is 16; one past the model's context
is a 400, and any other is cut to what the context leaves after the prompt, as vLLM's server
does both (chat: openai_chat). ``model`` left out, null or "" is the server's only model. ``n``
completions of each prompt,
up to MAX_N, need a temperature above 0; a seed gives each of them its own, seed + k. ``stop``
(a string or a list) cuts the text before the first one found, left out as vLLM
leaves it (kept with vLLM's ``include_stop_str_in_output``; ``finish_reason`` "stop", vLLM's
``stop_reason`` the string), and stops the
generation in its engine. vLLM's ``stop_token_ids`` end it at any of those tokens (no text of
that token, unless ``include_stop_str_in_output``; ``stop_reason`` its id), and its
``min_tokens`` holds back the end-of-sequence and stop tokens, and the stop strings, until
that many tokens are decoded. The text leaves special tokens out unless vLLM's
``skip_special_tokens`` is false, and is decoded as it reads after the prompt (vLLM primes its
detokenizer with the prompt's tokens). ``add_special_tokens`` (vLLM's, true by default) adds the tokenizer's
own (a BOS) to a text prompt. ``logprobs`` (0 to P.MAX_LOGPROBS) gives each choice OpenAI's
``logprobs`` object: its tokens' texts, logprobs, text offsets and each position's most likely
tokens (openai_logprobs, as vLLM's server writes them), under ``echo`` the prompt's first (its
first token's null: what lm-eval's loglikelihood requests read); vLLM's
``return_tokens_as_token_ids`` writes their tokens "token_id:<id>". vLLM's ``prompt_logprobs`` (or
echo's logprobs) has the engine compute the prompt's, given as vLLM's ``prompt_logprobs`` member
(not under ``stream``, as vLLM refuses it); such a request takes the "gpu" route (the dispatcher
sees to it), whose prefill computes them. vLLM's ``return_token_ids`` gives each choice's
``token_ids`` and ``prompt_token_ids`` (chat: the answer's), a chunk its own (ChunkExtras;
with ``echo``, the text then leaves the prompt's out, as vLLM's). Not supported yet, and refused
with a 400 naming the field rather than ignored, unless at its default: ``suffix``, ``best_of`` > 1, and
every field of vLLM's request it does not serve (openai_fields.UNSUPPORTED: its server would
apply them); a few are taken and left alone (IGNORED), and fields neither OpenAI nor
vLLM has are ignored, as vLLM's server ignores them.

OpenAI's ``echo`` begins each choice's text with its prompt's (a text prompt as given, token
ids decoded with their special tokens, as vLLM's server echoes them); with ``max_tokens`` 0, the
prompt alone (vLLM then decodes one token and counts it). ``stream`` true answers Server-Sent Events as OpenAI's API does: a chunk of each prompt's text as
its engine decodes it (llm_text), its last with ``finish_reason``, with ``stream_options:
{"include_usage": true}`` a chunk of the usage (and with vLLM's ``"continuous_usage_stats": true``
each chunk with its choice's usage so far), then ``data: [DONE]``. A chunk's ``logprobs`` are
those of the tokens decoded since the chunk before (a token whose text is held back, as vLLM's
chunk of an engine step holds it, comes with the next chunk of text, or the last). The answer starts with its
first chunk, so a request refused before a token came (overloaded, its deadline) is the JSON
error under its status, as without ``stream``; an error after that is an ``error`` event, then
``[DONE]`` (vLLM's server does the same).

A completion ends at the model's end-of-sequence token (``finish_reason`` "stop", the token
counted in ``completion_tokens`` and left out of the text, as vLLM leaves out the token that
ended it; ``stop_reason`` null for the tokenizer's EOS, the id for the model's other EOS ids,
as vLLM) or at
``max_tokens`` ("length"); vLLM's ``ignore_eos`` decodes ``max_tokens`` tokens whatever they are.

Replies carry OpenAI's fields plus ``batchyard``: the route (prefill-cpu or gpu), the
instances, TTFT, KV tokens moved and ``stand_in`` (the "gpu" instance is a CPU engine).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, Optional

import msgspec
from aiohttp import web

from . import errors, openai_lax
from .openai_lax import as_vllm_reads
from .http_body import MAX_JSON_BYTES, read_body
from .kserve_common import STOPPING_MESSAGE, KServeError
from .llm_text import TextStream, decoding_after, whole_text
from .openai_logprobs import CompletionLogprobs, RequestLogprobs, TokenIds, TokenTexts, joined, leading_space_marker
from . import protocol as P
from .llm_model_files import GenerationDefaults, config_eos_token_ids, tokenizer_eos_token_id
from .chat_template import ChatTemplateError
from .openai_fields import (OPENAI_MAX_STOPS, OpenAiError, bad_words_field, bad_words_token_ids, check_prompt_tokens,
                            check_supported, check_text_length, flag, forced_route, is_token,
                            max_tokens_field, model_name, stop_strings, stream_options)
from .protocol import Status

log = logging.getLogger("batchyard.frontend")
_HTTP = {Status.INVALID_ARGUMENT: 400, Status.UNKNOWN_MODEL: 404, Status.DEADLINE_EXCEEDED: 504,
         Status.OVERLOADED: 429, Status.UNAVAILABLE: 503, Status.CANCELLED: 499}
# The error body's "type", by HTTP status.
# OpenAI's own: a model that does not exist is a 404 invalid_request_error, code model_not_found.
_KIND = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
         499: "request_cancelled", 503: "service_unavailable_error", 504: "timeout_error"}
MAX_PROMPTS = 1024  # prompts in one request (a list of them)
NO_DEFAULTS = GenerationDefaults()
NO_SAMPLING = P.Sampling()


class OpenAiCompletions:
    def __init__(self, client, models: dict[str, str], default_timeout_s: float = 30.0,
                 stopping=lambda: False, defaults: Optional[dict[str, GenerationDefaults]] = None,
                 max_model_len: Optional[dict[str, int]] = None):
        self.client = client  # batchyard AsyncClient
        self.stopping = stopping  # True once the front door's stop failed what still waits (503, not 499)
        self.models = models  # LLM model name -> model folder (tokenizer.json inside)
        # by model: what a request that leaves a field out is sampled with, under vLLM's rule
        # (llm_model_files; none: vLLM's own), and its context, which bounds max_tokens
        self.defaults = defaults or {}
        self.max_model_len = max_model_len or {}
        self.default_timeout_s = default_timeout_s  # the node's, for a body without "timeout"
        self._tokenizers: dict = {}
        self._eos: dict = {}  # by model: (the tokenizer's end-of-sequence id, the configured ones)
        self._markers: dict = {}  # by model: its tokenizer's leading-space marker (openai_logprobs)
        self._alone: dict = {}  # by model: its tokens' texts alone (openai_logprobs.TokenTexts)
        self.in_flight = 0  # completions (of this route and chat's) being served: vLLM's /load
        self._ids = itertools.count(1)

    def routes(self) -> list:
        return [web.post("/v1/completions", self.completions), web.get("/v1/models", self.list_models)]

    async def list_models(self, request) -> web.Response:
        now = int(time.time())
        return web.json_response({"object": "list", "data": [
            # (vLLM's model card: its root, parent and context too)
            {"id": m, "object": "model", "created": now, "owned_by": "batchyard", "root": m, "parent": None,
             "max_model_len": self.max_model_len.get(m)} for m in sorted(self.models)]})

    async def completions(self, request) -> web.Response:
        try:
            return await self._completions(request)
        except Exception as e:  # noqa: BLE001 -- OpenAI's shape for every error of the route (a 500 logged once)
            return self.as_openai(e).response()

    def as_openai(self, e: Exception) -> OpenAiError:
        """Any error of the OpenAI routes as OpenAI's: ours, the node's statuses, a chat
        template's refusal (400 on messages), and a 500 for the rest, logged here."""
        if isinstance(e, OpenAiError):
            return e
        if isinstance(e, ChatTemplateError):
            return OpenAiError(400, str(e), param="messages")
        if not isinstance(e, errors.BatchyardError):  # (a stream's run: said once, here)
            log.error("completion failed: %s", e, exc_info=e)
            return OpenAiError(500, f"internal error: {type(e).__name__}", "server_error")
        if e.status == Status.CANCELLED and self.stopping():
            return OpenAiError(503, STOPPING_MESSAGE, _KIND[503])
        status = _HTTP.get(e.status, 500)
        code = "model_not_found" if e.status == Status.UNKNOWN_MODEL else ""
        if e.param:  # an engine's refusal naming the field: its words and the field, as vLLM's server
            return OpenAiError(status, e.message, _KIND.get(status, "server_error"), param=e.param, code=code)
        return OpenAiError(status, str(e), _KIND.get(status, "server_error"), code=code)

    async def body(self, request, members: dict) -> tuple[dict, str]:
        """-> (the request's JSON object, its typed ``members`` converted as vLLM's server
        converts them (openai_lax), its model, one this server has); OpenAiError otherwise.
        A model left out, null or "" is the server's only model, as vLLM's server takes it (its
        ``_is_model_supported``: no name is its model's; a 400 before). With several models it
        must be named."""
        try:
            # Bounded as the KServe routes' JSON: unbounded, 1 MB of gzip inflated to 2 GiB.
            body = json.loads(await read_body(request, MAX_JSON_BYTES))
        except KServeError as e:  # unreadable, stalled (408), or a compressed body that inflates past the limit
            raise OpenAiError(e.http_status, e.message) from None
        except (ValueError, RecursionError) as e:
            raise OpenAiError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise OpenAiError(400, "the body must be a JSON object")
        body = as_vllm_reads(body, members)
        model = next(iter(self.models)) if body.get("model") in (None, "") and len(self.models) == 1 \
            else model_name(body)
        if model not in self.models:
            raise OpenAiError(404, f"model {model!r} does not exist; this server has {sorted(self.models)}",
                              param="model", code="model_not_found")
        return body, model

    async def _completions(self, request) -> web.Response:
        body, model = await self.body(request, openai_lax.COMPLETION)
        checked = check_supported(body, self.defaults.get(model, NO_DEFAULTS).sampling)
        echo = flag(body, "echo")  # OpenAI's: each choice's text begins with its prompt's
        # left out or null: 16, vLLM's default (and OpenAI's; vLLM reads a null as left out here);
        # 0 only with echo: the prompt alone, as vLLM's server answers it
        max_tokens = max_tokens_field(body.get("max_tokens"), "max_tokens", zero_ok=echo)
        max_tokens = 16 if max_tokens is None else max_tokens
        self.check_context(model, max_tokens, "max_tokens")
        special = flag(body, "add_special_tokens", default=True)  # vLLM's: the tokenizer's BOS, ...
        prompt = body.get("prompt")
        from_text = isinstance(prompt, str) or (isinstance(prompt, list) and all(type(p) is str for p in prompt))
        return await self.serve(request, body, model, checked, max_tokens,
                                lambda: self._prompts(model, prompt, special), TEXT,
                                echoed=(lambda ids: self._prompt_texts(model, prompt, ids)) if echo else None,
                                from_text=from_text)

    async def serve(self, *args, **kwargs) -> web.StreamResponse:
        """``_serve``, counted in ``in_flight`` while it runs."""
        self.in_flight += 1
        try:
            return await self._serve(*args, **kwargs)
        finally:
            self.in_flight -= 1

    async def _serve(self, request, body: dict, model: str, checked: tuple, max_tokens: Optional[int],
                     prompts: Callable[[], Awaitable[list]], shape: "AnswerShape",
                     echoed: Optional[Callable[[list], Awaitable[list]]] = None,
                     from_text: bool = False) -> web.StreamResponse:
        """The completions of a request whose fields are ``checked`` (its sampling and ``n``,
        check_supported) and ``max_tokens`` (None: vLLM's, max_tokens_for), of the ``prompts``
        (token ids) that function gives, answered in the ``shape`` of its route. ``echoed``: the
        prompts' texts, of their ids, each choice's text to begin with (OpenAI's echo); with a
        max_tokens of 0, the choice's whole text, after a generation of one token, as vLLM's."""
        sampling, n = checked
        defaults = self.defaults.get(model, NO_DEFAULTS)
        timeout = body.get("timeout")  # Batchyard extension: seconds, the request's deadline
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                    or not 0 < timeout <= 86400):
            raise OpenAiError(400, f"timeout must be a number of seconds in (0, 86400], got {timeout!r}", param="timeout")
        route = forced_route(body)
        stream, *usage = stream_options(body)
        ignore_eos = flag(body, "ignore_eos")  # vLLM's extension: decode max_tokens past an end-of-sequence
        rule = TextRule(stop_strings(body.get("stop"), "stop", OPENAI_MAX_STOPS),
                        flag(body, "include_stop_str_in_output"),  # vLLM's: the stop string ends the text
                        flag(body, "skip_special_tokens", default=True))  # vLLM's
        words = bad_words_field(body.get("bad_words"))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(sampling, name) is not None:
                self.tokenizer(model, name)  # (their tokens' texts)
        if echoed is not None and sampling.logprobs is not None and sampling.prompt_logprobs is None:
            # (vLLM's: echo's logprobs begin with the prompt's)
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=sampling.logprobs)
        prompts = await prompts()
        for ids in prompts:
            self.check_prompt_fits(model, ids, from_text)
        sampling = await self.with_bad_words(model, sampling, words)
        if len(prompts) * n > MAX_PROMPTS:
            raise OpenAiError(400, f"{len(prompts)} prompts of n {n} make {len(prompts) * n} completions; at most "
                                   f"{MAX_PROMPTS} a request", param="n")
        quiet = max_tokens == 0  # (echo's: the prompt alone)
        max_tokens = 1 if quiet else max_tokens
        run = dict(route=route, timeout=timeout or self.default_timeout_s, ignore_eos=ignore_eos)
        # OpenAI's choice order: prompt by prompt, each prompt's n in a row. A seed gives each of
        # a prompt's n its own (seed, seed + 1, ...), so that they differ and repeat.
        gens = [(ids, self.max_tokens_for(model, ids, max_tokens, defaults, sampling),
                 {**run, "sampling": _nth(sampling, k)}) for ids in prompts for k in range(n)]
        token_ids = flag(body, "return_token_ids")  # vLLM's: the choices' token ids and their prompts'
        # (vLLM's: under return_token_ids, echo's text leaves the prompt's out)
        texts = await echoed(prompts) if echoed and not token_ids else [""] * len(prompts)
        leads = [text for text in texts for _ in range(n)]
        # (vLLM's return_tokens_as_token_ids: the logprobs' tokens written "token_id:<id>")
        logprobs = RequestLogprobs(self, model, shape, sampling, echoed is not None, quiet,
                                   flag(body, "return_tokens_as_token_ids"))
        if stream:
            return await self._stream(request, model, prompts, gens, rule, usage, shape, leads, quiet,
                                      logprobs if logprobs.asked else None, token_ids)
        # A list of prompts runs at once, under the one deadline of the request (one after
        # another, each had the whole timeout and none was batched with the others).
        tasks = [asyncio.ensure_future(self.complete(model, ids, limit, run_k, rule)) for ids, limit, run_k in gens]
        try:
            outs = await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # one failed, or the client hung up: the others stop in their engines
                t.cancel()
        choices = [shape.choice(i, leads[i] + ("" if quiet else out.text), out) for i, out in enumerate(outs)]
        answer = {"id": f"{shape.id_prefix}-{next(self._ids)}", "object": shape.object, "created": int(time.time()),
                  "model": model, "choices": choices, "usage": _usage(prompts, outs),
                  "batchyard": [_timing(out) for out in outs]}
        for choice, (ids, _, _), out in zip(choices, gens, outs) if token_ids else ():
            choice["token_ids"] = out.tokens
            shape.put_prompt_token_ids(answer, choice, ids)
        if not (logprobs.asked or logprobs.prompt):
            return web.json_response(answer)
        # (their texts decoded, and the answer written, on a thread: up to 21 decodes a token, and
        # a long prompt's logprobs are megabytes of JSON)
        written = await asyncio.to_thread(lambda: [logprobs.whole(gen[0], out) for gen, out in zip(gens, outs)])
        for choice, (lp, member) in zip(choices, written):
            if logprobs.asked:
                choice["logprobs"] = lp
            if member is not None:
                shape.put_prompt_logprobs(answer, choice, member)
        return web.Response(text=await asyncio.to_thread(json.dumps, answer), content_type="application/json")

    async def complete(self, model: str, ids: list, max_tokens: int, run: dict, rule: "TextRule" = None,
                       on_text: Optional[Callable[[str, int, bool], None]] = None,
                       on_step: Optional[Callable[[list], None]] = None) -> Completion:
        """One prompt's completion, as text: its generation (``run``: the generate call's other
        arguments), as ``rule`` makes text of it; a stop string found ends it in its engine.
        ``on_text(piece, tokens, last)`` streams it: called at each engine step but the last with the
        text that may be sent (llm_text.TextStream), the step's token count, and whether a stop
        string ended the generation there; the rest is the Completion's ``rest``. ``on_step``:
        called before it with the step's tokens (client_codec.StepTokens: with their logprobs and
        the first step's of the prompt, where the sampling asks them)."""
        sampling, rule = run.get("sampling") or NO_SAMPLING, rule or PLAIN
        # (the text as it reads after the prompt)
        decode = decoding_after(lambda t: self.decode(model, t, rule.skip_special_tokens), ids)
        text = TextStream(decode, rule.stops, rule.include_stop, sampling.min_tokens)

        def on_tokens(tokens: list) -> bool:
            if on_step is not None:
                on_step(tokens)
            piece = text.push(tokens)
            if on_text is not None:
                on_text(piece, len(tokens), bool(text.stopped))
            # True: enough (a stop string), the SDK ends the generation here, served
            return bool(text.stopped)

        watch = on_text is not None or bool(text.stops)
        out = await self.client.generate(model, ids, max_tokens, **run, on_tokens=on_tokens if watch else None)
        tokens, logprobs, prompt = list(out), out.logprobs, out.prompt_logprobs
        # Ended by a token's id (an end-of-sequence one, or of stop_token_ids): vLLM decodes no
        # text of that token, unless include_stop_str_in_output.
        by_id = out.finish_reason == "stop" and bool(tokens)
        shown = tokens[:-1] if by_id and not rule.include_stop else tokens
        reason = await self.stop_token(model, tokens[-1], sampling, run.get("ignore_eos", False)) if by_id else None
        if not watch:
            return Completion(whole_text(decode, shown), "", tokens, out.finish_reason, reason, out.timing, logprobs,
                              prompt)
        # (a stop string in the last step's text, which only the reply holds, is found here; one
        # found before ended the generation there, and this adds nothing)
        rest = text.finish(shown, len(tokens))
        if not text.stopped:
            return Completion(text.text, rest, tokens, out.finish_reason, reason, out.timing, logprobs, prompt)
        # the tokens up to the one completing it, as vLLM keeps them (and their logprobs)
        tokens = _up_to(tokens, text.stopped, text.stop_at, decode)
        return Completion(text.text, rest, tokens, "stop", text.stopped, out.timing, logprobs[:len(tokens)], prompt)

    async def stop_token(self, model: str, token: int, sampling: P.Sampling, ignore_eos: bool) -> Optional[int]:
        """vLLM's ``stop_reason`` of a generation that ``token`` ended: none for the tokenizer's
        end-of-sequence token, the id for one of stop_token_ids or another of the model's
        end-of-sequence ids (its generation_config.json's), which vLLM adds to them. (The model
        folder's files are read once, on a thread: tokenizer.json may be tens of MB.)"""
        if model not in self._eos:
            folder = self.models[model]
            self._eos[model] = await asyncio.to_thread(
                lambda: (tokenizer_eos_token_id(folder), config_eos_token_ids(folder)))
        primary, eos = self._eos[model]
        if not ignore_eos and token == primary:
            return None
        return token if token in sampling.stop_token_ids or not ignore_eos and token in eos else None

    async def with_bad_words(self, model: str, sampling: P.Sampling, words: list) -> P.Sampling:
        """``sampling`` banning vLLM's ``bad_words`` (none: as it is): the token sequences its
        engine bans (bad_words_token_ids), tokenized on a thread."""
        if not words:
            return sampling
        tok = self.tokenizer(model, "bad_words")
        stripped = [w.lstrip() for w in words]
        encodings = await asyncio.to_thread(tok.encode_batch, [*stripped, *(" " + w for w in stripped)],
                                            add_special_tokens=False)
        ids = [e.ids for e in encodings]
        return msgspec.structs.replace(sampling, bad_words_token_ids=bad_words_token_ids(ids[:len(words)],
                                                                                         ids[len(words):]))

    def check_context(self, model: str, max_tokens: Optional[int], name: str) -> None:
        """A max_tokens past the model's context is refused, in vLLM's words (its TokenizeParams);
        one within it is cut to what a prompt leaves (max_tokens_for). Cut too, 1,000,000 was
        served as the 2,046 tokens left where vLLM's server answers 400."""
        context = self.max_model_len.get(model)
        if context and max_tokens is not None and max_tokens > context:
            raise OpenAiError(400, f"{name}={max_tokens} cannot be greater than max_model_len={context}. Please "
                                   "request fewer output tokens.", param=name)

    def check_prompt_fits(self, model: str, ids: list, from_text: bool = False) -> None:
        """A prompt longer than the model's context is refused in vLLM's words, naming vLLM's
        parameter (its TokenizeParams' token length check); the dispatcher's refusal was
        Batchyard's, without a parameter. ``from_text``: the prompt was text, which vLLM
        tokenizes cut to one token past the context, so it says "at least" that many. (One of
        the context's length exactly leaves no token to decode: the dispatcher's refusal.)"""
        context = self.max_model_len.get(model)
        if context and len(ids) > context:
            count = f"at least {context + 1}" if from_text else str(len(ids))
            raise OpenAiError(400, f"This model's maximum context length is {context} tokens. However, your prompt "
                                   f"contains {count} input tokens, which exceeds this limit even without any "
                                   "output tokens. Please reduce the length of the input prompt.", param="input_tokens")

    def max_tokens_for(self, model: str, ids: list, max_tokens: Optional[int],
                       defaults: GenerationDefaults = NO_DEFAULTS, sampling: P.Sampling = NO_SAMPLING) -> int:
        """A prompt's max_tokens as vLLM's server sets it (its get_max_tokens): the request's
        (None: the model's max_new_tokens, which only a chat request can leave out), and no
        more than the context leaves after the prompt, nor than a request of Batchyard's may
        ask (MAX_NEW_TOKENS). A prompt that leaves none is refused by the dispatcher; one that
        leaves fewer than the sampling's min_tokens is refused here, as vLLM refuses it."""
        if max_tokens is None:
            max_tokens = defaults.max_tokens
        context = self.max_model_len.get(model)
        left = context - len(ids) if context else None
        limit = max(1, min(v for v in (max_tokens, left, P.MAX_NEW_TOKENS) if v is not None))
        if sampling.min_tokens > limit:
            raise OpenAiError(400, f"min_tokens must be less than or equal to max_tokens={limit}, got "
                                   f"{sampling.min_tokens}", param="min_tokens")
        return limit

    async def _stream(self, request, model: str, prompts: list, gens: list, rule: "TextRule",
                      usage: list, shape: "AnswerShape", leads: list, quiet: bool,
                      logprobs: Optional[RequestLogprobs] = None, token_ids: bool = False) -> web.StreamResponse:
        """The completions ``gens`` (of ``prompts``: (token ids, max_tokens, the generate call's
        other arguments), by choice index) as Server-Sent Events, each choice's chunks in order;
        each choice's text begins with its ``leads`` (echo's prompt text), sent with the first of
        it the engine gives, as vLLM sends it; ``quiet``: the generated text is left out.
        ``usage``: (include_usage: a last chunk of the usage; continuous_usage_stats: each chunk
        with its choice's usage so far, its tokens decoded whether or not their text is sent yet,
        as vLLM counts them). ``logprobs``: the choices' logprobs (None: not asked); a chunk holds
        those of the tokens decoded since the chunk before, its last those left, as vLLM's chunks
        hold each engine step's (so joined, they are the answer's without stream); under echo, the
        prompt's come first. ``token_ids`` (vLLM's return_token_ids): a chunk holds the tokens
        decoded since the chunk before, a choice's first its prompt's (chat: its role chunk)."""
        include_usage, continuous = usage
        head = {"id": f"{shape.id_prefix}-{next(self._ids)}", "object": shape.chunk_object,
                "created": int(time.time()), "model": model}
        started: set = set()  # the choices that had their first chunk (a chat's says the role)
        events: asyncio.Queue = asyncio.Queue()  # (prompt index, _DECODED | Completion | exception)
        # Each prompt's text not yet sent: a client that reads slowly gets it merged into fewer
        # chunks, rather than an event queued an engine step.
        decoded: list = [""] * len(gens)
        counted = [0] * len(gens)  # each choice's tokens so far
        extras = [ChunkExtras(logprobs, token_ids, ids, quiet) for ids, _, _ in gens]

        def so_far(i: int, tokens: int) -> dict:
            if not continuous:
                return {}
            n = len(gens[i][0])
            return {"usage": {"prompt_tokens": n, "completion_tokens": tokens, "total_tokens": n + tokens}}

        def on_text(i: int, piece: str, tokens: int) -> None:
            counted[i] += tokens
            piece, leads[i] = leads[i] + ("" if quiet else piece), ""
            if piece and not decoded[i]:
                events.put_nowait((i, _DECODED))
            decoded[i] += piece

        async def generate(i: int, ids: list, max_tokens: int, run: dict) -> None:
            try:
                out = await self.complete(model, ids, max_tokens, run, rule,
                                          on_text=lambda piece, tokens, _last: on_text(i, piece, tokens),
                                          on_step=extras[i].on_step if extras[i].wanted else None)
            except Exception as e:  # noqa: BLE001 -- told to the stream, which answers it
                events.put_nowait((i, e))
            else:
                events.put_nowait((i, out))

        tasks = [asyncio.ensure_future(generate(i, *gen)) for i, gen in enumerate(gens)]
        response: Optional[web.StreamResponse] = None

        async def send(chunk: dict) -> None:
            nonlocal response
            for c in chunk.get("choices", ()):  # (an error's chunk has none)
                if c["index"] not in started:
                    started.add(c["index"])
                    if (first := shape.first(c["index"])) is not None:
                        ids = {"prompt_token_ids": gens[c["index"]][0]} if token_ids else {}  # (vLLM's, chat's)
                        await send({**head, "choices": [first], **so_far(c["index"], 0), **ids})
            if response is None:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                                       "Cache-Control": "no-cache"})
                await response.prepare(request)
            await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")

        outs: list = [None] * len(gens)
        try:
            for _ in range(len(gens)):
                while True:
                    i, got = await events.get()
                    if isinstance(got, BaseException):
                        if response is None:  # nothing sent yet: the error under its status
                            raise self.as_openai(got) from None
                        await send(self.as_openai(got).body())
                        await response.write(b"data: [DONE]\n\n")
                        return response
                    if isinstance(got, Completion):
                        break
                    piece, decoded[i] = decoded[i], ""
                    if piece:
                        await send({**head, "choices": [await extras[i].attach(shape, shape.piece(i, piece))],
                                    **so_far(i, counted[i])})
                outs[i] = got
                # (what on_text gave and this stream has not sent yet, then the rest)
                text = leads[i] + decoded[i] + ("" if quiet else got.rest)
                last = await extras[i].attach(shape, shape.last(i, text, got), got)
                await send({**head, "choices": [last], **so_far(i, len(got.tokens)), "batchyard": _timing(got)})
            if include_usage:
                await send({**head, "choices": [], "usage": _usage(prompts, outs)})
            await response.write(b"data: [DONE]\n\n")
            return response
        except ConnectionResetError:  # the client left while a chunk was written: nobody to tell
            return response
        finally:
            for t in tasks:  # one failed, or the client hung up: the others stop in their engines
                t.cancel()

    async def _prompts(self, model: str, prompt, special_tokens: bool = True) -> list[list[int]]:
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not all(is_token(t) for t in prompt):
            # Each prompt is a request of its own: 100,000 of them held the loop 6 s before one ran.
            raise OpenAiError(400, f"{len(prompt)} prompts in one request; at most {MAX_PROMPTS}", param="prompt")
        if isinstance(prompt, str):
            prompts = await self.encode(model, [prompt], special_tokens)
        elif isinstance(prompt, list) and prompt and all(is_token(t) for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = await self.encode(model, prompt, special_tokens)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(is_token(t) for t in p)
                                                         for p in prompt):
            prompts = prompt
        else:
            raise OpenAiError(400, "prompt must be a non-empty string, list of strings, list of token ids, or list "
                                   "of lists of token ids", param="prompt")
        for ids in prompts:
            check_prompt_tokens(ids)
        return prompts

    async def _prompt_texts(self, model: str, prompt, prompts: list) -> list[str]:
        """The texts of a request's ``prompts`` (token ids, of its ``prompt`` field), as vLLM's
        server echoes them: a text prompt as given, token ids decoded with their special tokens
        (on a thread, as they are encoded: up to MAX_PROMPTS prompts of MAX_PROMPT_TOKENS)."""
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, str) for p in prompt):
            return list(prompt)
        try:
            tok = self.tokenizer(model)
        except OpenAiError:
            return [""] * len(prompts)  # (token-id users without a tokenizer: no text, as decode)
        return await asyncio.to_thread(tok.decode_batch, prompts, skip_special_tokens=False)

    def tokenizer(self, model: str, param: str = "prompt"):
        """The model folder's tokenizer.json, loaded once; OpenAiError naming ``param`` (the
        field whose text needs it) where the folder has none."""
        tok = self._tokenizers.get(model)
        if tok is None:
            path = Path(self.models[model]) / "tokenizer.json"
            if not path.exists():
                raise OpenAiError(400, f"model {model!r} has no tokenizer.json in {path.parent}: send token ids",
                                  param=param)
            from tokenizers import Tokenizer

            tok = self._tokenizers[model] = Tokenizer.from_file(str(path))
        return tok

    async def encode(self, model: str, texts: list[str], special_tokens: bool = True,
                     empty_ok: bool = False, param: str = "prompt") -> list[list[int]]:
        """``special_tokens``: the tokenizer's own added (a BOS); a chat template writes them.
        ``empty_ok``: text of no tokens is no prompt's, but /tokenize answers it. ``param``: the
        field an error names."""
        check_text_length(texts, param)
        tok = self.tokenizer(model, param)
        try:
            # encode_batch, on a thread: it lets go of the GIL (encode holds it), so the front
            # door's other clients are served while a long prompt is tokenized.
            encodings = await asyncio.to_thread(tok.encode_batch, texts, add_special_tokens=special_tokens)
        except Exception as e:  # a lone surrogate, which no tokenizer takes
            raise OpenAiError(400, f"the prompt cannot be tokenized: {e}", param=param) from None
        if not empty_ok and any(not e.ids for e in encodings):
            raise OpenAiError(400, "the prompt is empty after tokenization", param=param)
        return [e.ids for e in encodings]

    def token_texts(self, model: str) -> TokenTexts:
        """A generation's token texts as vLLM's logprobs give them (a fresh one each generation)."""
        tok = self.tokenizer(model, "logprobs")
        if model not in self._markers:
            self._markers[model] = leading_space_marker(tok)
        return TokenTexts(tok, self._markers[model], self._alone.setdefault(model, {}))

    def decode(self, model: str, ids: list[int], skip_special_tokens: bool = True) -> str:
        """``ids`` as text, its special tokens left out (vLLM's default for generated text)."""
        try:
            return self.tokenizer(model).decode(ids, skip_special_tokens=skip_special_tokens)
        except OpenAiError:
            return ""  # token-id users without a tokenizer read batchyard[].token_ids


_DECODED = object()  # a stream's event: text of that choice waits to be sent


def _up_to(tokens: list, stop: str, at: int, decode: Callable[[list], str]) -> list:
    """The tokens up to the one whose text completes ``stop``, found at ``at`` of the text
    (vLLM keeps no more): the shortest prefix whose decoding holds it there, found by halving."""
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if whole_text(decode, tokens[:mid]).find(stop, at) >= 0:  # (the text vLLM has given by that token)
            hi = mid
        else:
            lo = mid + 1
    return tokens[:lo]


@dataclass(frozen=True)
class TextRule:
    """How a generation's tokens become its text, as vLLM's detokenizer makes it: cut before the
    first of ``stops`` (after it with ``include_stop``, vLLM's include_stop_str_in_output, which
    also keeps the text of a token that ended the generation by its id), special tokens left out
    unless ``skip_special_tokens`` is false."""

    stops: tuple = ()
    include_stop: bool = False
    skip_special_tokens: bool = True


PLAIN = TextRule()


class ChunkExtras:
    """What a stream's chunks of one choice hold beside its text: its ``logprobs`` (RequestLogprobs:
    what the request asks of them; None: none) and, with ``token_ids`` (vLLM's
    return_token_ids), its tokens and its ``prompt``'s. A chunk holds those of the tokens decoded
    since the chunk before (``on_step`` is given each engine step); the last, those left of the
    completion; the first, under echo, the prompt's logprobs before them."""

    def __init__(self, logprobs: Optional[RequestLogprobs], token_ids: bool, prompt: list, quiet: bool):
        self.logprobs, self.token_ids, self.prompt, self.quiet = logprobs, token_ids, prompt, quiet
        self.wanted = logprobs is not None or token_ids
        self.writer = logprobs.writer() if logprobs is not None else None
        self.tokens: list = []  # decoded, not in a chunk yet
        self.positions: list = []  # ... their logprobs
        self.prompt_positions: list = []  # the prompt's logprobs, once the first step brings them
        self.sent = 0  # tokens in the chunks sent
        self.first = True

    def on_step(self, step) -> None:
        self.tokens.extend(step)
        self.positions.extend(step.logprobs)
        self.prompt_positions.extend(step.prompt_logprobs)

    async def attach(self, shape: "AnswerShape", choice: dict, last: Optional["Completion"] = None) -> dict:
        """``choice`` (a chunk's) with what it holds beside its text; ``last``: the completion
        whose last chunk it is."""
        if last is not None:
            tokens, positions = last.tokens[self.sent:], last.logprobs[self.sent:]
        else:
            tokens, positions = self.tokens, self.positions
        self.tokens, self.positions = [], []
        first, self.first = self.first, False
        if self.token_ids:
            choice["token_ids"] = tokens
            if first:
                shape.put_prompt_token_ids(None, choice, self.prompt)
        if self.writer is not None:
            head = None
            if first and self.logprobs.echo:  # (the prompt's first, decoded off the loop: a long prompt's many)
                prompt = self.prompt_positions or (last.prompt_logprobs if last is not None else [])
                head = await asyncio.to_thread(self.logprobs.prompt_part, self.writer, self.prompt, prompt)
            part = self.writer.of([] if self.quiet else positions)
            choice["logprobs"] = part if head is None else joined(head, part)
        self.sent += len(tokens)
        return choice


class Completion:
    """One prompt's completion: its ``text`` (cut before a stop string), the ``rest`` of it past
    the pieces a stream was given, its ``tokens``, ``finish_reason`` ("stop": an end-of-sequence
    token or a stop token or string; "length"), vLLM's ``stop_reason`` (the stop string found,
    the stop token's id, or None), the generation's ``timing`` (None where a stop string
    ended it before its reply), its tokens' ``logprobs`` and its prompt's ``prompt_logprobs``
    (P.PositionLogprobs, where asked)."""

    __slots__ = ("text", "rest", "tokens", "finish_reason", "stop_reason", "timing", "logprobs", "prompt_logprobs")

    def __init__(self, text: str, rest: str, tokens: list, finish_reason: str, stop_reason: str, timing,
                 logprobs: Optional[list] = None, prompt_logprobs: Optional[list] = None):
        self.text, self.rest, self.tokens = text, rest, tokens
        self.finish_reason, self.stop_reason, self.timing = finish_reason, stop_reason, timing
        self.logprobs, self.prompt_logprobs = logprobs or [], prompt_logprobs or []


class AnswerShape:
    """How a route's answer and its stream's chunks hold a choice: /v1/completions' text (TEXT);
    openai_chat's messages."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    @staticmethod
    def choice(i: int, text: str, out: Completion) -> dict:
        # stop_reason: vLLM's extension, the stop string that ended it (null otherwise)
        return {"index": i, "text": text, "logprobs": None, "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason}

    last = choice  # a stream's last chunk of a choice

    @staticmethod
    def piece(i: int, text: str) -> dict:
        return {"index": i, "text": text, "logprobs": None, "finish_reason": None}

    @staticmethod
    def first(i: int) -> Optional[dict]:
        """A chunk sent before a choice's first (None: none)."""
        return None

    @staticmethod
    def logprobs(texts: TokenTexts, sampling: P.Sampling, as_ids: bool = False):
        """A choice's logprobs writer (``of(positions)``: the route's object for those tokens;
        ``as_ids``: vLLM's return_tokens_as_token_ids)."""
        return CompletionLogprobs(TokenIds() if as_ids else texts)

    @staticmethod
    def put_prompt_logprobs(answer: dict, choice: dict, member: list) -> None:
        """Where vLLM's answer holds the prompt's logprobs: each choice (chat: the answer)."""
        choice["prompt_logprobs"] = member

    @staticmethod
    def put_prompt_token_ids(answer: Optional[dict], choice: dict, ids: list) -> None:
        """Where vLLM's answer (None: a stream's chunk) holds the prompt's token ids
        (return_token_ids): each choice; chat: the answer, and its role chunk."""
        choice["prompt_token_ids"] = ids


TEXT = AnswerShape()


def _usage(prompts: list, outs: list) -> dict:
    """Each prompt counted once whatever its n, as OpenAI counts it; every completion's tokens."""
    n_in, n_out = sum(map(len, prompts)), sum(len(out.tokens) for out in outs if out is not None)
    return {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}


def _nth(sampling: P.Sampling, k: int) -> P.Sampling:
    if sampling.seed is None or k == 0:
        return sampling
    # vLLM's server gives the k-th seed + k (ParentRequest), past int64 as torch reads it: the
    # same 64 bits, which keep it on the wire's int64 (2**63 - 1 + 1 is -2**63)
    return msgspec.structs.replace(sampling, seed=(sampling.seed + k + 2**63) % 2**64 - 2**63)


def _timing(out: Completion) -> dict:
    """Batchyard's account of one generation (the ``batchyard`` member); a stop string that
    ended it before its reply leaves the timings null."""
    t = out.timing
    if t is None:
        return {"route": None, "prefill_worker": None, "decode_worker": None, "ttft_ms": None, "total_ms": None,
                "kv_tokens": None, "stand_in": None, "token_ids": out.tokens}
    return {"route": t.route, "prefill_worker": t.prefill_worker, "decode_worker": t.decode_worker,
            "ttft_ms": t.ttft_us / 1e3, "total_ms": t.total_us / 1e3, "kv_tokens": t.kv_tokens,
            "stand_in": t.stand_in, "token_ids": out.tokens}


