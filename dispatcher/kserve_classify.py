"""Triton's classification extension: an output asked for with a class count (tritonclient's
``InferRequestedOutput(name, class_count=k)``) comes back as the top ``k`` of each batch item,
a BYTES tensor of "value:index" strings, as tritonserver makes it (its ``src/classification.cc``
and the gRPC and HTTP servers' output handling):

- per batch item (the first dimension), its elements flattened, the ``min(k, elements)``
  largest, largest first; the shape is ``[B, min(k, elements)]``;
- each string is the value as C++'s ``std::to_string`` writes it (glibc's ``%f`` for FP32 and
  FP64, "-nan" for a NaN with its sign bit set, as most computed NaNs on x86 have; decimal for
  integers), a colon, and the element's index in the item (Batchyard's models have no label
  files, so no ":label" follows);
- the count is Triton's ``uint32_t``: a larger one keeps its low 32 bits, as Triton's does (2**32
  asks 0 classes: a [B, 0] tensor over gRPC, the plain tensor over HTTP, where 0 asks none);
- FP16, BOOL and BYTES outputs cannot be ranked, nor an item of more than a million elements
  (Triton's cap in its code since January 2026; tritonserver 2.51, which the tests run, has
  none): INVALID_ARGUMENT, in Triton's words, said before the model runs (Triton says so after
  it, and counts the request a success).

Where Triton's ``std::sort`` sets no order this sets its own: equal values are ranked by index,
the lower first (tritonserver 2.51's agreed up to 16 elements an item in a review's runs, not
past them), and a NaN ranks above every number, as numpy's ``argmax`` ranks it (Triton's place
for it depends on its neighbours).
"""

from __future__ import annotations

import asyncio
import math
import struct
import threading  # (the front-door process's only: the dispatcher never imports this module)
from typing import Optional

import numpy as np

from .kserve_common import NP_TO_KSERVE, invalid

RANKED = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64")
# Triton's kMaxClassificationElements: past it an item's ranking is refused.
MAX_ITEM_ELEMENTS = 1_000_000
# A ranking past either size is done in a worker thread, not on the front door's event loop:
# each is about 1 ms on an EPYC core (~7 ns an element partitioned, ~0.4 us a string made). A
# batch of 4 items of a million classes, all ranked, held the loop 1.7 s (a review's probe).
OFF_LOOP_ELEMENTS = 100_000
OFF_LOOP_STRINGS = 2_000


def class_count(value: int) -> int:
    """A requested count as Triton keeps it (``uint32_t``): its low 32 bits."""
    return value & 0xFFFFFFFF


def check_classifiable(datatype: str, item_elements: int) -> None:
    """INVALID_ARGUMENT for an output Triton cannot rank (its messages)."""
    if datatype not in RANKED:
        raise invalid(f"class result not available for output due to unsupported type '{datatype}'")
    if item_elements > MAX_ITEM_ELEMENTS:
        raise invalid("classification output tensor too large")


class Abandoned(Exception):
    """A ranking stopped because its caller no longer waits for it."""


def ranked(arr: np.ndarray, count: int, binary: bool,
           abandoned: Optional[threading.Event] = None) -> tuple[list[int], object]:
    """``arr``'s classification ([B, ...], one of the ranked types) as it goes on the wire:
    (shape, its binary form) or, for JSON, (shape, its strings); the shape is
    [B, min(count, elements an item)]. Once ``abandoned`` is set, Abandoned at the next item or chunk."""
    shape, chunks = _labels(arr, count, abandoned)
    if not binary:
        return shape, [s for chunk in chunks for s in chunk]
    return shape, b"".join(serialize_bytes(s.encode() for s in chunk) for chunk in chunks)


async def ranked_off_loop(arr: np.ndarray, count: int, binary: bool, executor) -> tuple[list[int], object]:
    """``ranked``, on ``executor`` (one thread: rankings one at a time, as on Triton's response
    thread) where it is large enough to hold the event loop. Three at once in the default
    executor took the front door from 651 to 1,096 MiB, and their pure-Python string making
    held the loop 839 ms through the GIL (a review's probe). A caller cancelled (its client
    left, or the front door stops) stops its ranking at the next item or chunk: run to its
    end, an abandoned ranking of 16 items of a million classes held the next client's small
    one 3.6 s, and one of 32 held a stopping front door past its supervisor's kill (10 s)."""
    rows = arr.shape[0]
    if arr.size >= OFF_LOOP_ELEMENTS or rows * min(count, arr.size // max(rows, 1)) >= OFF_LOOP_STRINGS:
        abandoned = threading.Event()
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, ranked, arr, count, binary, abandoned)
        except asyncio.CancelledError:
            abandoned.set()  # (one still queued is cancelled by asyncio: it never starts)
            raise
    return ranked(arr, count, binary)


def answer_ranked(answer, out, ranked: list, executor):
    """``answer(out, labels)`` where ``ranked`` ((name, count, binary) of each classified output)
    is empty; else an awaitable of it, with ``labels[name]`` each such output's ``ranked`` form,
    made off the loop where large (``ranked_off_loop``). The gRPC and HTTP routes' reply."""
    if not ranked:
        return answer(out, {})

    async def classified():
        return answer(out, {name: await ranked_off_loop(out[name], count, binary, executor)
                            for name, count, binary in ranked})
    return classified()


# Strings are made CHUNK at a time: a million values' tolist() at once held the GIL (and so the
# event loop) ~100 ms, and all of an item's strings at once doubled the ranking's peak memory.
CHUNK = 1 << 16


def _labels(arr: np.ndarray, count: int, abandoned: Optional[threading.Event] = None):
    """The classification's shape, and its strings in C order, in lists of at most CHUNK (raising
    Abandoned before an item or a chunk once ``abandoned`` is set)."""
    n = math.prod(arr.shape[1:])
    rows = arr.reshape(arr.shape[0], n)
    check_classifiable(NP_TO_KSERVE.get(arr.dtype.name, arr.dtype.name), n)
    k = min(count, n)
    text = _float_text if rows.dtype.kind == "f" else str

    def chunks():
        for row in rows if k else ():
            if abandoned is not None and abandoned.is_set():
                raise Abandoned
            top = _top(row, k)
            # Ascending by value, then by descending index; reversed: the largest first, equal
            # ones by index.
            top = top[np.lexsort((-top, row[top]))[::-1]]
            for start in range(0, k, CHUNK):
                if abandoned is not None and abandoned.is_set():
                    raise Abandoned
                idx = top[start:start + CHUNK]
                yield [f"{text(v)}:{j}" for v, j in zip(row[idx].tolist(), idx.tolist())]
    return [rows.shape[0], k], chunks()


def _float_text(v: float) -> str:
    # glibc's %f writes a NaN's sign; Python's drops it.
    if v != v:
        return "-nan" if math.copysign(1.0, v) < 0 else "nan"
    return "%f" % v


def _top(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest of ``row`` (NaN the largest), of equal ones at the cut the
    lowest: linear in the row, not a sort of it."""
    n = row.size
    if k >= n:
        return np.arange(n)
    cut = np.partition(row, n - k)[n - k]  # the k-th largest
    nan = np.isnan(row) if row.dtype.kind == "f" else None
    if nan is not None and np.isnan(cut):
        return np.flatnonzero(nan)[:k]
    above = row > cut
    if nan is not None:
        above |= nan
    above = np.flatnonzero(above)
    return np.concatenate([above, np.flatnonzero(row == cut)[:k - above.size]])


def serialize_bytes(strings) -> bytes:
    """A BYTES tensor's binary form (raw gRPC contents, HTTP binary data) of its elements in C
    order (bytes each): each as its length (4 bytes, little-endian) and its bytes."""
    return b"".join(struct.pack("<I", len(s)) + s for s in strings)
