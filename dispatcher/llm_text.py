"""A streamed generation's text, piece by piece, as its tokens come (the LLM mode's streams:
``/v1/completions`` with ``stream``, Triton's ``generate_stream`` and ModelStreamInfer).

A token is not always whole text: byte-level tokenizers split a character of several UTF-8 bytes
over tokens, and SentencePiece's decoder drops the space of a window's first token. So, as vLLM's
incremental detokenizer does, each piece is the decoding of a short window of the last tokens
less that of the window before them, held back while it ends inside a character (U+FFFD), and
the window moves on only when a piece is given. Decoding the whole generation again at each
step would cost the square of its length.

The pieces end as the whole text ends: ``rest`` gives what the whole decoding holds past the
pieces given, so a client that joins them reads what a request without ``stream`` reads. As
vLLM's detokenizer, the whole text ends at the generation's last whole character
(``whole_text``), and a generation is decoded as it reads after its prompt (``decoding_after``).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

log = logging.getLogger("batchyard.frontend")

_PARTIAL = "\ufffd"  # what a decoder writes for bytes that end inside a character


class TextPieces:
    """``push`` the tokens of each step: -> the text they complete ("" while a character is
    incomplete); ``rest`` with every token of the generation: -> the text past the pieces."""

    __slots__ = ("decode", "tokens", "prefix", "read", "text")

    def __init__(self, decode: Callable[[list], str]):
        self.decode = decode
        self.tokens: list = []
        self.prefix = 0  # the window's start: tokens before it are text given
        self.read = 0  # tokens up to here are in the pieces given
        self.text = ""  # the pieces given, joined

    def push(self, tokens: list) -> str:
        self.tokens.extend(tokens)
        before = self.decode(self.tokens[self.prefix:self.read])
        end = len(self.tokens)
        now = self.decode(self.tokens[self.prefix:])
        if now.endswith(_PARTIAL):
            if end - self.read <= MAX_HELD:
                return ""  # held while it ends inside a character
            # Not held past MAX_HELD tokens: bytes that never make a character, as a client can
            # ask with allowed_token_ids, grew the window without bound. Given then up to the last
            # token whose text ends in a whole character, or short of the last PARTIAL_TOKENS
            # where none does: given whole, steps that each ended inside a character (a run of
            # multi-byte text, several tokens a step) sent the one incomplete at the end as
            # U+FFFD, in the middle of the joined text; so did bytes that make none followed by
            # the first bytes of one.
            end, now = self._short_of_the_last_character(end)
        if len(now) <= len(before):
            return ""
        piece = now[len(before):]
        self.prefix, self.read = self.read, end
        self.text += piece
        return piece

    def _short_of_the_last_character(self, end: int) -> tuple[int, str]:
        """(a token boundary before ``end``, the window's text up to it): the last of the last
        PARTIAL_TOKENS boundaries whose text ends in a whole character, else the earliest of
        them: the character incomplete at ``end`` began within those tokens."""
        for e in range(end - 1, end - PARTIAL_TOKENS - 1, -1):
            text = self.decode(self.tokens[self.prefix:e])
            if not text.endswith(_PARTIAL):
                break
        return e, text

    def rest(self, tokens: list) -> str:
        whole = whole_text(self.decode, tokens)
        if whole.startswith(self.text):
            return whole[len(self.text):]
        # A tokenizer whose window decodes other than the whole does: what is given stays given.
        log.warning("a streamed generation's pieces are not a prefix of its text; its end is sent as decoded")
        return whole[len(_common_prefix(whole, self.text)):]


CONTEXT_TOKENS = 5  # the prompt's last tokens a generation is decoded after (vLLM's slow detokenizer's offset)
MAX_CONTEXT_TOKENS = 64  # ... more where those are text of none (special tokens skipped), up to this many
MAX_HELD = 32  # tokens held while the text ends inside a character (one: at most 4 bytes; special tokens count)
PARTIAL_TOKENS = 3  # the bytes of a character but its last (UTF-8: at most 4), a token each at most


def decoding_after(decode: Callable[[list], str], prompt: list) -> Callable[[list], str]:
    """``decode`` of a generation's tokens as they read after its ``prompt``: the text of the
    prompt's last tokens and them, past that of those prompt tokens alone. Decoded alone, a
    generation's first token loses what the prompt gives it: SentencePiece's decoder drops the
    space a word's first piece begins with ("▁from" is "from" alone, " from" after "moves"),
    and vLLM's detokenizer, primed with the prompt's tokens, keeps it."""
    n = CONTEXT_TOKENS
    while not (base := decode(tail := list(prompt[-n:]))) and n < min(len(prompt), MAX_CONTEXT_TOKENS):
        n *= 2  # (vLLM primes with the whole prompt: a tail of special tokens alone gives no context)
    if not tail:
        return decode

    def after(tokens: list) -> str:
        whole = decode(tail + list(tokens))
        # (past a prompt that ends inside a character, the character it completes is the generation's)
        return whole[len(base):] if whole.startswith(base) else whole[len(_common_prefix(whole, base)):]

    return after


def whole_text(decode: Callable[[list], str], tokens: list) -> str:
    """A generation's text, as vLLM's detokenizer ends it: it gives no text that ends inside a
    character, so a generation that stops there ends with the last token whose text did not.
    (At most MAX_HELD tokens are taken back, each a decoding of the whole: past them, bytes that
    make no character, the text ends before its last U+FFFD.)"""
    tokens = list(tokens)
    text = decode(tokens)
    for _ in range(MAX_HELD):
        if not (tokens and text.endswith(_PARTIAL)):
            return text
        tokens.pop()
        text = decode(tokens) if tokens else ""
    return text.rstrip(_PARTIAL)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


class TextStream:
    """A generation's text as its tokens come, cut before the first of ``stops`` (vLLM's stop
    strings, left out of the text as vLLM leaves them by default; after it with ``include``,
    vLLM's include_stop_str_in_output). ``push`` gives what may be sent now: while a stop string
    could still begin in the last characters decoded (one fewer than the longest stop), they are
    held back, as vLLM's detokenizer holds them (not with ``include``: nothing is then cut from
    them). ``finish`` gives the rest. ``stopped``: the stop string found, once found, beginning
    at ``stop_at`` of the text; the generation is then over. ``min_tokens`` (vLLM's): a stop
    string counts only once the generation has more tokens than that, and only where it ends
    past the text of the first ``min_tokens`` tokens, as vLLM's detokenizer looks for them."""

    __slots__ = ("pieces", "stops", "include", "lookback", "hold", "text", "sent", "stopped", "stop_at",
                 "min_tokens", "count", "floor")

    def __init__(self, decode: Callable[[list], str], stops: tuple = (), include: bool = False,
                 min_tokens: int = 0):
        self.pieces = TextPieces(decode)
        self.stops = tuple(s for s in stops if s)
        self.include = include
        # how far before the text given a stop string may begin: it ends in the text decoded since
        self.lookback = max(map(len, self.stops), default=1) - 1
        self.hold = 0 if include else self.lookback
        self.text = ""  # decoded so far, cut at a stop string once one is found
        self.sent = 0  # characters of it given
        self.stopped = ""
        self.stop_at = 0
        self.min_tokens = min_tokens
        self.count = 0  # the generation's tokens so far
        self.floor = 0 if min_tokens == 0 else -1  # the first min_tokens tokens' text length (-1: not yet known)

    @property
    def tokens(self) -> list:
        """The tokens pushed."""
        return self.pieces.tokens

    def push(self, tokens: list) -> str:
        if self.stopped:
            return ""
        self.count += len(tokens)
        self.text += self.pieces.push(tokens)
        return self._release(self.pieces.tokens, final=False)

    def finish(self, tokens: list, count: Optional[int] = None) -> str:
        """``tokens``: every token of the generation whose text it holds; ``count``: its tokens,
        where more (the one that ended it by its id, which vLLM decodes no text of)."""
        self.count = len(tokens) if count is None else count
        if not self.stopped:
            self.text += self.pieces.rest(tokens)
        return self._release(tokens, final=True)

    def _release(self, tokens: list, final: bool) -> str:
        if self.stops and not self.stopped and self.count > self.min_tokens:
            if self.floor < 0:  # (the text vLLM's detokenizer has given by then: no partial character)
                self.floor = len(whole_text(self.pieces.decode, tokens[:self.min_tokens]))
            # A stop string beginning before the characters given would have been found then;
            # one must end past the first min_tokens tokens' text.
            start = max(0, self.sent - self.lookback)
            # As vLLM picks: the one that ends first, then the first in the list.
            hits = [(i + len(s), n, i, s) for n, s in enumerate(self.stops)
                    if (i := self.text.find(s, max(start, self.floor - len(s) + 1))) >= 0]
            if hits:
                end, _, self.stop_at, self.stopped = min(hits)
                self.text = self.text[:end if self.include else self.stop_at]
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent:end], end
        return piece
