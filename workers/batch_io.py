"""Turn a batch message into model inputs, and model outputs into per-request results.

Per request: inputs are read as numpy views (inline frames or shared memory, no copy) and
checked against the request's shared-memory references (the segment must exist and the range
must fit — the dispatcher cannot check that without mapping). A bad request gets its own
error; the rest of the batch still runs.
"""

from __future__ import annotations

import numpy as np

from batchyard import protocol as P
from batchyard.protocol import Status
from batchyard.shm import SegmentCache, ShmError


class BatchItem:
    __slots__ = ("seq", "request", "arrays", "items", "error", "files")

    def __init__(self, seq: int):
        self.seq = seq
        self.request = None
        self.arrays: dict[str, np.ndarray] = {}
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
                    buf = cache.buffer(ref.shm.segment, ref.shm.offset, ref.shm.nbytes, files.get(ref.shm.segment, ()))
                else:
                    buf = payload[ref.frame].buffer
                item.arrays[ref.name] = np.frombuffer(buf, dtype=ref.dtype).reshape(ref.shape)
            item.items = req.inputs[0].shape[0]
        except ShmError as e:
            item.error = (Status.INVALID_ARGUMENT, f"input shared memory: {e}")
        except P.DecodeError as e:  # the dispatcher validated it, so this is a bug somewhere
            item.error = (Status.INTERNAL, f"worker could not decode request: {e}")
        out.append(item)
    return out


def assemble(items: list[BatchItem], spec: P.ModelSpec) -> dict[str, np.ndarray]:
    """Concatenate the good items' inputs along the batch dimension."""
    good = [it for it in items if it.error is None]
    if len(good) == 1:
        return dict(good[0].arrays)
    return {t.name: np.concatenate([it.arrays[t.name] for it in good]) for t in spec.inputs}


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
                    buf = cache.buffer(placement.segment, placement.offset, part.nbytes,
                                       it.files.get(placement.segment, ()))
                    np.frombuffer(buf, dtype=part.dtype).reshape(part.shape)[...] = part
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
