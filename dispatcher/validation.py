"""Semantic checks of an infer request against its model's spec.

Typed decoding (protocol.py) already guarantees field types and ranges; this module checks
what needs the model: names, dtypes, shapes, byte counts, frame indices and the inline-size
limit. It never reads tensor bytes: shared-memory references are checked for arithmetic
consistency here and for existence and bounds by the worker that maps them.
"""

from __future__ import annotations

import math

import numpy as np

from .protocol import DTYPES, InferRequest, ModelSpec, TensorSpec

_ITEMSIZE = {name: np.dtype(name).itemsize for name in DTYPES}


class RequestInvalid(Exception):
    """The request cannot be served as sent; the message says which field and why."""


MAX_TENSOR_BYTES = 2 ** 63


def item_nbytes(spec: TensorSpec) -> int:
    return _ITEMSIZE[spec.dtype] * math.prod(spec.shape)


_SPEC_TABLES: dict[int, tuple] = {}


def _where(i: int, ref) -> str:
    # Only built for error messages: formatting it for every input of every request cost
    # more than the checks themselves (cProfile of the dispatcher under load).
    return f"inputs[{i}] ({ref.name!r})"


def _tables(spec: ModelSpec) -> tuple[dict, dict]:
    """Per-spec lookup tables, built once (validation runs for every request)."""
    hit = _SPEC_TABLES.get(id(spec))
    if hit is None or hit[0] is not spec:
        hit = _SPEC_TABLES[id(spec)] = (spec, {t.name: (t, item_nbytes(t)) for t in spec.inputs},
                                        {t.name: (t, item_nbytes(t)) for t in spec.outputs})
    return hit[1], hit[2]


def over_inline_limit_hint(shm_allowed: bool) -> str:
    """What a client whose inline tensors are over the node's limit can do: over tcp without
    allow_shm_over_tcp shared memory is refused, so the usual advice would fail too."""
    if shm_allowed:
        return "send large tensors through shared memory"
    return ("this endpoint takes tensors inline only (tcp without [dispatcher] allow_shm_over_tcp): raise "
            "the node's max_inline_bytes, or connect over ipc to send them through shared memory")


# Dimensions of a wrong shape quoted back in its error: the whole of a 200,000-dimension shape
# made a reply five times the header that asked (one-byte dimensions, five-character words).
SHAPE_WORDS_MAX = 8


def _shape_words(shape: list) -> str:
    if len(shape) <= SHAPE_WORDS_MAX:
        return str(list(shape))
    return f"[{', '.join(map(str, shape[:SHAPE_WORDS_MAX]))}, ...] (rank {len(shape)})"


def validate_infer(req: InferRequest, spec: ModelSpec, frame_sizes: list[int],
                   max_inline_bytes: int, shm_allowed: bool = True) -> int:
    """Return the request's item count (its batch dimension) or raise RequestInvalid."""
    by_name, out_specs = _tables(spec)
    seen: set[str] = set()
    items = -1
    inline_total = 0
    used_frames: set[int] = set()
    for i, ref in enumerate(req.inputs):
        entry = by_name.get(ref.name)
        if entry is None:
            raise RequestInvalid(f"{_where(i, ref)}: model {spec.name!r} has no input {ref.name!r}; "
                                 f"expected {sorted(by_name)}")
        if ref.name in seen:
            raise RequestInvalid(f"{_where(i, ref)}: input given twice")
        seen.add(ref.name)
        tspec, per_item = entry
        if ref.dtype != tspec.dtype:
            raise RequestInvalid(f"{_where(i, ref)}: dtype {ref.dtype!r}, model expects {tspec.dtype!r}")
        if len(ref.shape) != len(tspec.shape) + 1 or tuple(ref.shape[1:]) != tspec.shape:
            expected = ", ".join(["n", *map(str, tspec.shape)])
            raise RequestInvalid(f"{_where(i, ref)}: shape {_shape_words(ref.shape)}, model expects [{expected}]")
        n = ref.shape[0]
        if n < 1 or n > spec.max_batch:
            raise RequestInvalid(f"{_where(i, ref)}: batch dimension {n} outside 1..{spec.max_batch}")
        if items == -1:
            items = n
        elif n != items:
            raise RequestInvalid(f"{_where(i, ref)}: batch dimension {n} differs from other inputs' {items}")
        nbytes = n * per_item
        if (ref.frame is not None) == (ref.shm is not None):
            raise RequestInvalid(f"{_where(i, ref)}: give exactly one of 'frame' or 'shm'")
        if ref.shm is not None:
            if ref.shm.nbytes != nbytes:
                raise RequestInvalid(f"{_where(i, ref)}: shm nbytes {ref.shm.nbytes}, shape and dtype "
                                     f"need {nbytes}")
            if ref.shm.offset % _ITEMSIZE[ref.dtype]:
                raise RequestInvalid(f"{_where(i, ref)}: shm offset {ref.shm.offset} not aligned to "
                                     f"{ref.dtype} ({_ITEMSIZE[ref.dtype]} bytes)")
        else:
            if ref.frame >= len(frame_sizes):
                raise RequestInvalid(f"{_where(i, ref)}: frame {ref.frame} but the message has "
                                     f"{len(frame_sizes)} payload frames")
            if ref.frame in used_frames:
                raise RequestInvalid(f"{_where(i, ref)}: frame {ref.frame} used by two inputs")
            used_frames.add(ref.frame)
            if frame_sizes[ref.frame] != nbytes:
                raise RequestInvalid(f"{_where(i, ref)}: frame has {frame_sizes[ref.frame]} bytes, shape "
                                     f"and dtype need {nbytes}")
            inline_total += nbytes
    missing = set(by_name) - seen
    if missing:
        raise RequestInvalid(f"missing inputs {sorted(missing)} for model {spec.name!r}")
    if len(used_frames) != len(frame_sizes):
        raise RequestInvalid(f"message has {len(frame_sizes)} payload frames, inputs use "
                             f"{len(used_frames)}")
    if inline_total > max_inline_bytes:
        raise RequestInvalid(f"inline payload {inline_total} bytes exceeds max_inline_bytes "
                             f"{max_inline_bytes}; {over_inline_limit_hint(shm_allowed)}")
    for name, ref in req.outputs.items():
        entry = out_specs.get(name)
        if entry is None:
            raise RequestInvalid(f"outputs[{name!r}]: model {spec.name!r} has no such output; "
                                 f"expected {sorted(out_specs)}")
        ospec, per_item = entry
        need = items * per_item
        if ref.nbytes < need:
            raise RequestInvalid(f"outputs[{name!r}]: shm region of {ref.nbytes} bytes, output "
                                 f"needs {need}")
        if ref.offset % _ITEMSIZE[ospec.dtype]:
            raise RequestInvalid(f"outputs[{name!r}]: shm offset {ref.offset} not aligned")
    return items


def validate_spec(spec: ModelSpec) -> None:
    """Raise ValueError for a spec no request could satisfy (bad dtype, duplicate names)."""
    for group, tensors in (("input", spec.inputs), ("output", spec.outputs)):
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"model {spec.name!r}: duplicate {group} names {names}")
        if not tensors:
            raise ValueError(f"model {spec.name!r}: no {group}s")
        for t in tensors:
            if t.dtype not in DTYPES:
                raise ValueError(f"model {spec.name!r} {group} {t.name!r}: dtype {t.dtype!r} "
                                 f"not one of {sorted(DTYPES)}")
            # A C long's bytes at most (a size past it is no memory's): a [2**31, 2**31] output
            # was accepted, and every request then failed in the client with a bare OverflowError
            # from the pool allocating its region.
            if (nbytes := item_nbytes(t) * spec.max_batch) >= MAX_TENSOR_BYTES:
                raise ValueError(f"model {spec.name!r} {group} {t.name!r}: shape {list(t.shape)} of {t.dtype} is "
                                 f"{nbytes} bytes a batch of max_batch {spec.max_batch}, more than memory can hold")


def registration_problem(models, known: dict) -> str:
    """Why a worker's registration must be refused ("" when it may register): a model spec that
    is invalid, or that differs from the one the dispatcher already serves under that name."""
    for spec in models:
        try:
            validate_spec(spec)
        except ValueError as e:
            return str(e)
        k = known.get(spec.name)
        if k is not None and (k.inputs, k.outputs) != (spec.inputs, spec.outputs):
            return f"model {spec.name!r}: worker's spec differs from the dispatcher's"
    return ""
