"""A streamed generation's text, piece by piece, as its tokens come (the LLM mode's streams:
``/v1/completions`` with ``stream``, Triton's ``generate_stream`` and ModelStreamInfer).

A token is not always whole text: byte-level tokenizers split a character of several UTF-8 bytes
over tokens, and SentencePiece's decoder drops the space of a window's first token. So, as vLLM's
incremental detokenizer does, each piece is the decoding of a short window of the last tokens
less that of the window before them, held back while it ends inside a character (U+FFFD), and
the window moves on only when a piece is given. Decoding the whole generation again at each
step would cost the square of its length.

The pieces end as the whole text ends: ``rest`` gives what the whole decoding holds past the
pieces given, so a client that joins them reads what a request without ``stream`` reads.
"""

from __future__ import annotations

import logging
from typing import Callable

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
        now = self.decode(self.tokens[self.prefix:])
        if len(now) <= len(before) or now.endswith(_PARTIAL):
            return ""
        piece = now[len(before):]
        self.prefix, self.read = self.read, len(self.tokens)
        self.text += piece
        return piece

    def rest(self, tokens: list) -> str:
        whole = self.decode(list(tokens))
        if whole.startswith(self.text):
            return whole[len(self.text):]
        # A tokenizer whose window decodes other than the whole does: what is given stays given.
        log.warning("a streamed generation's pieces are not a prefix of its text; its end is sent as decoded")
        return whole[len(_common_prefix(whole, self.text)):]


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
    them). ``finish`` gives the rest. ``stopped``: the stop string found, once found; the
    generation is then over."""

    __slots__ = ("pieces", "stops", "include", "lookback", "hold", "text", "sent", "stopped")

    def __init__(self, decode: Callable[[list], str], stops: tuple = (), include: bool = False):
        self.pieces = TextPieces(decode)
        self.stops = tuple(s for s in stops if s)
        self.include = include
        # how far before the text given a stop string may begin: it ends in the text decoded since
        self.lookback = max(map(len, self.stops), default=1) - 1
        self.hold = 0 if include else self.lookback
        self.text = ""  # decoded so far, cut at a stop string once one is found
        self.sent = 0  # characters of it given
        self.stopped = ""

    @property
    def tokens(self) -> list:
        """The tokens pushed."""
        return self.pieces.tokens

    def push(self, tokens: list) -> str:
        if self.stopped:
            return ""
        self.text += self.pieces.push(tokens)
        return self._release(final=False)

    def finish(self, tokens: list) -> str:
        """``tokens``: every token of the generation."""
        if not self.stopped:
            self.text += self.pieces.rest(tokens)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stops and not self.stopped:
            # A stop string beginning before the characters given would have been found then.
            start = max(0, self.sent - self.lookback)
            # As vLLM picks: the one that ends first, then the first in the list.
            hits = [(i + len(s), n, i, s) for n, s in enumerate(self.stops) if (i := self.text.find(s, start)) >= 0]
            if hits:
                end, _, at, self.stopped = min(hits)
                self.text = self.text[:end if self.include else at]
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent:end], end
        return piece
