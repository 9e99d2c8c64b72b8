"""Turn a batch message into model inputs, and model outputs into per-request results.

Per request: inline inputs are numpy views of their frames; shared-memory inputs are checked
against the request's references (the segment must exist and the range must fit — the
dispatcher never opens a segment), then are views of the segment where the worker maps it, or
are read by offset straight into the batch's arrays when the batch is assembled where it does
not (``SegmentCache.maps``). A bad request gets its own error; the rest of the batch still runs.
"""

from __future__ import annotations

import math

import numpy as np

from batchyard import protocol as P
from batchyard.protocol import Status
from batchyard.shm import SegmentCache, ShmError


class ShmInput:
    """An input still in its client's segment: read when the batch is assembled."""

    __slots__ = ("segment", "offset", "nbytes", "file_id")

    def __init__(self, segment: str, offset: int, nbytes: int, file_id: tuple):
        self.segment, self.offset, self.nbytes, self.file_id = segment, offset, nbytes, file_id


class BatchItem:
    __slots__ = ("seq", "request", "arrays", "items", "error", "files")

    def __init__(self, seq: int):
        self.seq = seq
        self.request = None
        self.arrays: dict[str, np.ndarray | ShmInput] = {}
        self.items = 0
        self.error: tuple[int, str] | None = None
        self.files: dict = {}  # segment -> (st_dev, st_ino) granted (protocol.Batch.files)


def read_batch(msg: P.Batch, frames: list, cache: SegmentCache) -> list[BatchItem]:
    """``frames``: everything after the batch header, as the dispatcher forwarded it."""
    out = []
    pos = 0
    for seq, n in zip(msg.seqs, msg.n_frames):
        item = BatchItem(seq)
        header, payload = frames[pos], frames[pos + 1:pos + 1 + n]
        pos += 1 + n
        try:
            req = P.infer_request_decoder.decode(header.buffer)
            item.request = req
            item.files = files = msg.files.get(seq, {})
            for ref in req.inputs:
                if ref.shm is not None:
                    shm = ref.shm
                    if shm.nbytes != np.dtype(ref.dtype).itemsize * math.prod(ref.shape):
                        raise ShmError(f"input {ref.name!r}: {shm.nbytes} bytes for shape {ref.shape} of {ref.dtype}")
                    file_id = files.get(shm.segment, ())
                    view = cache.view(shm.segment, shm.offset, shm.nbytes, file_id)
                    if view is None:
                        item.arrays[ref.name] = ShmInput(shm.segment, shm.offset, shm.nbytes, file_id)
                    else:
                        # Read-only: a model that changes its input in place (x.mul_()) wrote into
                        # the client's own buffer when the request ran alone; the executor copies a
                        # read-only array, as it does a frame's.
                        arr = np.frombuffer(view, dtype=ref.dtype).reshape(ref.shape)
                        arr.flags.writeable = False
                        item.arrays[ref.name] = arr
                else:
                    item.arrays[ref.name] = np.frombuffer(payload[ref.frame].buffer, dtype=ref.dtype).reshape(ref.shape)
            item.items = req.inputs[0].shape[0]
        except ShmError as e:
            item.error = (Status.INVALID_ARGUMENT, f"input shared memory: {e}")
        except P.DecodeError as e:  # the dispatcher validated it, so this is a bug somewhere
            item.error = (Status.INTERNAL, f"worker could not decode request: {e}")
        out.append(item)
    return out


def assemble(items: list[BatchItem], spec: P.ModelSpec, cache: SegmentCache) -> dict[str, np.ndarray]:
    """The good items' inputs, concatenated along the batch dimension: inline ones copied in,
    shared-memory ones read straight into place. An item whose segment ends before its range
    (shrunk since ``read_batch`` checked it) gets its error, and the rest are assembled again.
    A lone request's inline inputs are passed as they are, uncopied. Empty when no item is left."""
    while True:
        good = [it for it in items if it.error is None]
        if len(good) == 1 and not any(type(a) is ShmInput for a in good[0].arrays.values()):
            return dict(good[0].arrays)
        total = sum(it.items for it in good)
        out = {t.name: np.empty((total, *t.shape), dtype=t.dtype) for t in spec.inputs}
        short = False
        for t in spec.inputs:
            arr, start = out[t.name], 0
            for it in good:
                part, src = arr[start:start + it.items], it.arrays[t.name]
                start += it.items
                if type(src) is ShmInput:
                    try:
                        cache.read_into(src.segment, src.offset, part.reshape(-1).view(np.uint8), src.file_id)
                    except ShmError as e:
                        it.error = (Status.INVALID_ARGUMENT, f"input shared memory: {e}")
                        short = True
                else:
                    part[...] = src
        if not short:
            return out if good else {}


def check_outputs(outputs: dict[str, np.ndarray], spec: P.ModelSpec, n_items: int) -> dict[str, np.ndarray]:
    fixed = {}
    for t in spec.outputs:
        arr = outputs.get(t.name)
        if arr is None:
            raise ValueError(f"model returned no output {t.name!r}")
        if arr.shape != (n_items, *t.shape):
            raise ValueError(f"output {t.name!r} has shape {arr.shape}, spec says {(n_items, *t.shape)}")
        fixed[t.name] = arr.astype(t.dtype, copy=False)
    return fixed


def write_results(items: list[BatchItem], outputs: dict[str, np.ndarray] | None,
                  batch_error: tuple[int, str] | None, cache: SegmentCache,
                  spec: P.ModelSpec) -> tuple[list[P.ItemResult], list]:
    """Per-request results and the inline output frames that follow the reply header."""
    results: list[P.ItemResult] = []
    frames: list = []
    start = 0
    for it in items:
        if it.error is not None:
            results.append(P.ItemResult(seq=it.seq, status=int(it.error[0]), message=it.error[1]))
            continue
        if batch_error is not None:
            results.append(P.ItemResult(seq=it.seq, status=int(batch_error[0]), message=batch_error[1]))
            continue
        refs, local = [], []
        try:
            for t in spec.outputs:
                part = outputs[t.name][start:start + it.items]
                placement = it.request.outputs.get(t.name)
                if placement is not None:
                    cache.write(placement.segment, placement.offset,
                                np.ascontiguousarray(part).reshape(-1).view(np.uint8), it.files.get(placement.segment, ()))
                    refs.append(P.TensorRef(name=t.name, dtype=t.dtype, shape=list(part.shape),
                                            shm=P.ShmRef(placement.segment, placement.offset, part.nbytes)))
                else:
                    refs.append(P.TensorRef(name=t.name, dtype=t.dtype, shape=list(part.shape),
                                            frame=len(local)))
                    local.append(np.ascontiguousarray(part))
        except ShmError as e:
            results.append(P.ItemResult(seq=it.seq, status=int(Status.INVALID_ARGUMENT),
                                        message=f"output shared memory: {e}"))
        else:
            results.append(P.ItemResult(seq=it.seq, status=int(Status.OK), outputs=refs, n_frames=len(local)))
            frames.extend(local)
        start += it.items
    return results, frames
