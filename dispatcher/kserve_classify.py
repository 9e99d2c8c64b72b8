"""Triton's classification extension: an output asked for with a class count (tritonclient's
``InferRequestedOutput(name, class_count=k)``) comes back as the top ``k`` of each batch item,
a BYTES tensor of "value:index" strings, as tritonserver makes it (its ``src/classification.cc``
and the gRPC and HTTP servers' output handling):

- per batch item (the first dimension), its elements flattened, the ``min(k, elements)``
  largest, largest first; the shape is ``[B, min(k, elements)]``;
- each string is the value as C++'s ``std::to_string`` writes it (``%f`` for FP32 and FP64,
  decimal for integers), a colon, and the element's index in the item (Batchyard's models have
  no label files, so no ":label" follows);
- FP16, BOOL and BYTES outputs cannot be ranked: INVALID_ARGUMENT, in Triton's words (Triton
  says so after running the model; this says so before).

Equal values are ranked by index, the lower first (Triton sorts with ``std::sort``, which sets
no order for them); a NaN ranks above every number (numpy's order).
"""

from __future__ import annotations

import struct

import numpy as np

from .kserve_common import NP_TO_KSERVE, invalid

RANKED = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64")


def check_classifiable(datatype: str) -> None:
    """INVALID_ARGUMENT for an output type Triton cannot rank (its message)."""
    if datatype not in RANKED:
        raise invalid(f"class result not available for output due to unsupported type '{datatype}'")


def classify(arr: np.ndarray, count: int) -> np.ndarray:
    """``arr`` ([B, ...], one of the ranked types) as its classification: an object array of
    bytes, [B, min(count, elements an item)]."""
    check_classifiable(NP_TO_KSERVE.get(arr.dtype.name, arr.dtype.name))
    rows = arr.reshape(arr.shape[0], -1)
    k = min(count, rows.shape[1])
    form = "%f:%d" if rows.dtype.kind == "f" else "%d:%d"
    out = np.empty((rows.shape[0], k), dtype=object)
    for b, row in enumerate(rows):
        top = _top(row, k)
        values = row[top]
        # Ascending by value, then by descending index; reversed: the largest first, equal ones
        # by index.
        order = np.lexsort((-top, values))[::-1]
        out[b] = [(form % vj).encode() for vj in zip(values[order].tolist(), top[order].tolist())]
    return out


def _top(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest of ``row`` (NaN the largest), of equal ones at the cut the
    lowest: linear in the row, not a sort of it (an output of a million classes)."""
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


def serialize_bytes(strings: np.ndarray) -> bytes:
    """A BYTES tensor's binary form (raw gRPC contents, HTTP binary data): each element as its
    length (4 bytes, little-endian) and its bytes, in C order."""
    return b"".join(struct.pack("<I", len(s)) + s for s in strings.reshape(-1))
