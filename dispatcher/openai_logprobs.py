"""A generation's logprobs in OpenAI's shapes (``/v1/completions``' ``logprobs``, chat's
``logprobs.content``), each token's text written as vLLM's server writes it.

The engine gives, for each token decoded, P.PositionLogprobs: (id, logprob, rank) of that token,
then of the position's most likely tokens by rank, without it again (vLLM's order: its
Logprob dict). The token texts are vLLM's LogprobsProcessor's: each token decoded alone with
its special tokens; a SentencePiece piece given back the leading spaces that decoding drops
(vLLM's convert_ids_list_to_tokens, for a Metaspace pre-tokenizer); a token whose text ends
inside a character (U+FFFD, a byte of a character split over tokens) decoded after up to
CONTEXT of the tokens decoded before it, less the text of those that end whole
(_correct_decoded_token), or "" while the character is still incomplete. RequestLogprobs: what
a request asks of them (and of its prompt's), written in its route's shape.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Optional

from . import protocol as P

if TYPE_CHECKING:
    from . import openai_http

FLOOR = -9999.0  # vLLM's: a logprob of -inf (a masked token) is written as this
CONTEXT = 4  # the tokens decoded before one that a split character is looked for in (UTF-8: 4 bytes)
MAX_ALONE = 1 << 20  # texts of tokens alone kept a model (a vocabulary's; its ids are bounded anyway)
_PARTIAL = "\ufffd"


def leading_space_marker(tokenizer) -> Optional[str]:
    """The replacement character of a Metaspace pre-tokenizer (alone or in a Sequence), whose
    leading instance decoding a piece alone drops; None for any other (vLLM's
    get_leading_space_marker)."""
    pre = tokenizer.pre_tokenizer
    if pre is None:
        return None
    try:
        config = json.loads(pre.__getstate__())
    except (TypeError, ValueError):
        return None
    for part in [config, *config.get("pretokenizers", ())] if config.get("type") == "Sequence" else [config]:
        if part.get("type") == "Metaspace":
            return part.get("replacement", "\u2581")
    return None


class TokenTexts:
    """The texts of a generation's tokens and of the likely ones at each position, as vLLM's
    logprobs give them. ``at(ids)``: those of one position's ids (the decoded token's first),
    after the positions before it; ``decoded(token)`` moves on past that position. ``alone``:
    the model's texts of tokens alone, kept across generations (they depend on the token only)."""

    __slots__ = ("tokenizer", "marker", "context", "alone")

    def __init__(self, tokenizer, marker: Optional[str], alone: Optional[dict] = None):
        self.tokenizer, self.marker = tokenizer, marker
        self.context: list = []  # the last CONTEXT tokens decoded
        self.alone = {} if alone is None else alone

    def _decode(self, ids: list) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _alone(self, token: int) -> str:
        """The token decoded alone, a SentencePiece piece's dropped leading spaces given back."""
        text = self.alone.get(token)
        if text is None:
            text = self._decode([token]) or ""
            if self.marker is not None:
                raw = self.tokenizer.id_to_token(token) or ""
                markers = len(raw) - len(raw.lstrip(self.marker))
                missing = markers - (len(text) - len(text.lstrip(" ")))
                if markers and missing > 0:
                    text = " " * missing + text
            if len(self.alone) < MAX_ALONE:
                self.alone[token] = text
        return text

    def at(self, ids: list) -> list[str]:
        texts = [self._alone(i) for i in ids]
        return [self._completed(i) if t.endswith(_PARTIAL) else t for i, t in zip(ids, texts)]

    def decoded(self, token: int) -> None:
        self.context = [*self.context, token][-CONTEXT:]

    def of(self, positions: list) -> list[list[str]]:
        """The texts of each position's ids (P.PositionLogprobs), one position after another."""
        out = []
        for position in positions:
            out.append(self.at([tid for tid, _, _ in position]))
            self.decoded(position[0][0])
        return out

    def _completed(self, token: int) -> str:
        """The text of ``token``, whose own ends inside a character: what it adds to the fewest
        tokens before it that make it whole, less the text of those of them that end whole."""
        for n in range(1, len(self.context) + 1):
            context = self.context[-n:]
            whole = self._decode(context + [token])
            if whole.endswith(_PARTIAL):
                continue
            clean = len(context)  # the context's tokens before those that are bytes of this character
            while clean and self._alone(context[clean - 1]).endswith(_PARTIAL):
                clean -= 1
            prefix = self._decode(context[:clean]) if clean else ""
            if whole.startswith(prefix):
                return whole[len(prefix):]
            common = 0
            for a, b in zip(prefix, whole):
                if a != b:
                    break
                common += 1
            return whole[common:]
        return ""


class TokenIds(TokenTexts):
    """Token texts as vLLM's ``return_tokens_as_token_ids`` writes them: "token_id:<id>"."""

    def __init__(self):
        super().__init__(None, None)

    def at(self, ids: list) -> list[str]:
        return [f"token_id:{i}" for i in ids]


def _lp(value: float) -> float:
    return max(value, FLOOR)


class CompletionLogprobs:
    """``/v1/completions``' ``logprobs`` of a choice, one chunk at a time: ``of(positions)``
    gives the object for those tokens, its text offsets going on from the chunk before
    (vLLM's _create_completion_logprobs: the offset of a token is that of the one before plus
    its text's length; every entry of the position in ``top_logprobs``). Under ``echo``, the
    prompt's come first (``prompt``)."""

    __slots__ = ("texts", "offset")

    def __init__(self, texts: TokenTexts, offset: int = 0):
        self.texts, self.offset = texts, offset

    def of(self, positions: list, strings: Optional[list] = None) -> dict:
        """``strings``: the positions' texts where known (TokenTexts.of), else of ``texts``."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for position, texts in zip(positions, self.texts.of(positions) if strings is None else strings):
            tokens.append(texts[0])
            token_logprobs.append(_lp(position[0][1]))
            # (a dict: the decoded token's text again, or two tokens of one text, is one entry)
            top.append({s: _lp(lp) for s, (_, lp, _) in zip(texts, position)})
            offsets.append(self.offset)
            self.offset += len(texts[0])
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}

    def prompt(self, first: str, positions: list, strings: list, keep: int) -> dict:
        """The prompt's part: its first token (of text ``first``), which has no logprobs (null,
        as vLLM writes a position without), then its ``positions`` (of texts ``strings``), each
        its first ``keep`` entries (vLLM writes the request's logprobs + 1 of each, however many
        its prompt_logprobs had the engine give)."""
        head = {"text_offset": [self.offset], "token_logprobs": [None], "tokens": [first], "top_logprobs": [None]}
        self.offset += len(first)
        return joined(head, self.of([p[:keep] for p in positions], [s[:keep] for s in strings]))


def joined(a: dict, b: dict) -> dict:
    """Two parts of a completion's logprobs object, one after the other."""
    return {k: [*a[k], *b[k]] for k in a}


def logprob_objects(positions: list, strings: list, clamp: bool = False) -> list[dict]:
    """Each position (of texts ``strings``) as vLLM's {token id: Logprob} is written in JSON:
    {"<token id>": {logprob, rank, decoded_token}}, the decoded token's first; ``clamp``: -inf
    written -9999, as vLLM's clamp_prompt_logprobs writes it."""
    return [{str(tid): {"logprob": FLOOR if clamp and lp == -math.inf else lp, "rank": rank, "decoded_token": s}
             for s, (tid, lp, rank) in zip(texts, position)} for position, texts in zip(positions, strings)]


def prompt_logprobs(positions: list, strings: list) -> list:
    """vLLM's ``prompt_logprobs`` member: null for the prompt's first token, then each position's
    logprob object, clamped."""
    return [None, *logprob_objects(positions, strings, clamp=True)]


class ChatLogprobs:
    """Chat's ``logprobs`` of a choice, one chunk at a time: ``of(positions)`` gives
    ``{"content": [...]}`` for those tokens, each with its text's UTF-8 bytes and the first
    ``top`` entries of its position as ``top_logprobs`` (vLLM's _create_chat_logprobs: the
    decoded token's own entry first, so where it is not among the most likely, one of those
    is left out). ``as_ids``: the tokens written "token_id:<id>" (return_tokens_as_token_ids),
    a decoded token's bytes still its text's, as vLLM's."""

    __slots__ = ("texts", "top", "as_ids")

    def __init__(self, texts: TokenTexts, top: int, as_ids: bool = False):
        self.texts, self.top, self.as_ids = texts, top, as_ids

    def of(self, positions: list) -> dict:
        content = []
        for position, strings in zip(positions, self.texts.of(positions)):
            shown = [f"token_id:{tid}" for tid, _, _ in position] if self.as_ids else strings
            content.append({"token": shown[0], "logprob": _lp(position[0][1]), "bytes": _utf8(strings[0]),
                            "top_logprobs": [{"token": s, "logprob": _lp(lp), "bytes": _utf8(s)}
                                             for s, (_, lp, _) in zip(shown[:self.top], position)]})
        return {"content": content}


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


class RequestLogprobs:
    """What a request asks of logprobs (its sampling's ``logprobs`` and ``prompt_logprobs``;
    ``echo``'s, which begin with the prompt's), and their writing in its route's ``shape``."""

    def __init__(self, completions: "openai_http.OpenAiCompletions", model: str, shape: "openai_http.AnswerShape",
                 sampling: P.Sampling, echo: bool, quiet: bool, as_ids: bool = False):
        self.completions, self.model, self.shape, self.sampling = completions, model, shape, sampling
        self.as_ids = as_ids  # the tokens of the logprobs objects as vLLM's "token_id:<id>"
        self.asked = sampling.logprobs is not None
        self.prompt = sampling.prompt_logprobs is not None
        self.echo = echo and self.asked
        self.quiet = quiet  # (echo's max_tokens 0: the prompt's alone, as vLLM's)

    def writer(self):
        """A choice's logprobs writer (``of(positions)``: the route's object for those tokens)."""
        return self.shape.logprobs(self.completions.token_texts(self.model), self.sampling, self.as_ids)

    def _texts(self) -> TokenTexts:
        return TokenIds() if self.as_ids else self.completions.token_texts(self.model)

    def prompt_part(self, writer, ids: list, positions: list, strings: Optional[list] = None) -> dict:
        """The logprobs object's part of the prompt ``ids`` (``positions``: their logprobs but
        the first's; ``strings``: their texts, where known), as ``writer``'s first."""
        if strings is None or self.as_ids:
            strings = self._texts().of(positions)
        first = (TokenIds().at(ids[:1])[0] if self.as_ids
                 else self.completions.decode(self.model, [ids[0]], skip_special_tokens=False))
        return writer.prompt(first, positions, strings, self.sampling.logprobs + 1)

    def whole(self, ids: list, out: "openai_http.Completion") -> tuple[Optional[dict], Optional[list]]:
        """-> (a choice's logprobs object, or None; vLLM's ``prompt_logprobs`` member, or None)
        of the completion ``out`` of the prompt ``ids``."""
        strings = self.completions.token_texts(self.model).of(out.prompt_logprobs) if self.prompt else []
        member = prompt_logprobs(out.prompt_logprobs, strings) if self.prompt else None
        if not self.asked:
            return None, member
        writer = self.writer()
        head = self.prompt_part(writer, ids, out.prompt_logprobs, strings) if self.echo else None
        part = writer.of([] if self.quiet else out.logprobs)
        return (part if head is None else joined(head, part)), member
