"""GPU-worker executor that drives a Triton Inference Server over gRPC with system shared memory.

- Inputs and outputs never ride in gRPC message bodies: each in-flight slot owns one input and
  one output POSIX shared-memory segment, registered with Triton once (``/batchyard_<pid>_...``)
  and reused; ``close()`` unregisters and unlinks them. (On a GPU host, Triton's CUDA shared
  memory extension is the next step; this machine has no GPU to test it on.)
- Up to ``inflight`` batches at once (``async_infer``) to hide the gRPC round trip; the worker
  runtime gets completions through its wake-up pipe.
- Triton's own dynamic batching must be OFF for models we dispatch to (it would re-batch our
  batches and add its queue delay): checked at start from the model config, with a warning.
- Outage: a failed call marks the connection down; calls during back-off fail at once with
  ExecutorUnavailable (the requests get UNAVAILABLE), the next call after it reconnects and
  re-registers the regions.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from dispatcher.protocol import ModelSpec
from dispatcher.shm import Segment
from dispatcher.validation import item_nbytes

from .runtime import ExecutorUnavailable

log = logging.getLogger("batchyard.worker")

_TRITON_DTYPE = {"bool": "BOOL", "uint8": "UINT8", "int8": "INT8", "uint16": "UINT16", "int16": "INT16",
                 "uint32": "UINT32", "int32": "INT32", "uint64": "UINT64", "int64": "INT64",
                 "float16": "FP16", "float32": "FP32", "float64": "FP64"}
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.2, 5.0


class _Slot:
    """One in-flight batch's input and output regions (registered with Triton)."""

    def __init__(self, tag: str, in_bytes: int, out_bytes: int):
        self.inp = Segment.create(max(in_bytes, 64))
        self.out = Segment.create(max(out_bytes, 64))
        self.in_region, self.out_region = f"{tag}-in", f"{tag}-out"


class TritonExecutor:
    path = "gpu"
    simulated = False

    def __init__(self, url: str, model_names: dict[str, str] | None = None, inflight: int = 2,
                 timeout_s: float = 30.0, use_shm: bool = True, channel_args=None):
        import tritonclient.grpc as grpcclient

        self.grpc = grpcclient
        self.url = url
        self.model_names = model_names or {}
        self.inflight = inflight
        self.timeout_s = timeout_s
        self.use_shm = use_shm
        self.channel_args = channel_args
        self.specs: dict[str, ModelSpec] = {}
        self.client = None
        self._slots: list[_Slot] = []
        self._free: list[_Slot] = []
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = BACKOFF_MIN_S
        self._registered = False

    # ------------------------------------------------------------------ setup
    def load(self, spec: ModelSpec, factory: str = "") -> None:
        self.specs[spec.name] = spec
        self._connect()
        name = self.model_names.get(spec.name, spec.name)
        cfg = self.client.get_model_config(name, client_timeout=self.timeout_s).config
        if cfg.HasField("dynamic_batching"):
            log.warning("Triton model %r has dynamic_batching on: it will re-batch Batchyard's batches and add "
                        "its own queue delay. Remove the dynamic_batching block from its config.pbtxt.", name)
        if cfg.max_batch_size and cfg.max_batch_size < spec.max_batch:
            raise ValueError(f"Triton model {name!r} has max_batch_size {cfg.max_batch_size} < Batchyard's "
                             f"max_batch {spec.max_batch} for {spec.name!r}")
        t_in = {i.name for i in cfg.input}
        t_out = {o.name for o in cfg.output}
        missing = ({t.name for t in spec.inputs} - t_in) | ({t.name for t in spec.outputs} - t_out)
        if missing:
            raise ValueError(f"Triton model {name!r} lacks tensors {sorted(missing)} of spec {spec.name!r}")
        if self.use_shm:
            in_b = max(sum(item_nbytes(t) for t in s.inputs) * s.max_batch for s in self.specs.values())
            out_b = max(sum(item_nbytes(t) for t in s.outputs) * s.max_batch for s in self.specs.values())
            self._make_slots(in_b, out_b)

    def _make_slots(self, in_bytes: int, out_bytes: int) -> None:
        if self._slots and self._slots[0].inp.size >= in_bytes and self._slots[0].out.size >= out_bytes:
            return
        self._drop_slots()
        self._slots = [_Slot(f"by-{id(self) & 0xFFFFFF:x}-{k}", in_bytes, out_bytes) for k in range(self.inflight)]
        self._free = list(self._slots)
        self._register_slots()

    def _register_slots(self) -> None:
        for s in self._slots:
            self.client.register_system_shared_memory(s.in_region, "/" + s.inp.name, s.inp.size)
            self.client.register_system_shared_memory(s.out_region, "/" + s.out.name, s.out.size)
        self._registered = True

    def _connect(self) -> None:
        if self.client is None:
            self.client = self.grpc.InferenceServerClient(self.url, channel_args=self.channel_args)

    def _ensure_up(self) -> None:
        """Fail fast during back-off; after it, reconnect and re-register the regions."""
        now = time.monotonic()
        if now < self._down_until:
            raise ExecutorUnavailable(f"Triton at {self.url} is unreachable; retrying in "
                                      f"{self._down_until - now:.1f} s")
        if not self._registered and self._slots:
            try:
                self.client.unregister_system_shared_memory(client_timeout=self.timeout_s)
                self._register_slots()
                log.info("reconnected to Triton at %s; shared-memory regions registered again", self.url)
            except Exception as e:
                self._mark_down(e)

    def _mark_down(self, err: Exception) -> None:
        self._registered = False
        self._down_until = time.monotonic() + self._backoff
        log.warning("Triton at %s failed (%s); backing off %.1f s", self.url, err, self._backoff)
        self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)
        raise ExecutorUnavailable(f"Triton at {self.url} is unavailable: {err}") from None

    # ------------------------------------------------------------------ running
    def _prepare(self, model: str, inputs: dict[str, np.ndarray], slot: _Slot | None):
        spec = self.specs[model]
        n = next(iter(inputs.values())).shape[0]
        g = self.grpc
        t_inputs, t_outputs, out_layout = [], [], []
        off = 0
        for t in spec.inputs:
            arr = np.ascontiguousarray(inputs[t.name])
            inp = g.InferInput(t.name, list(arr.shape), _TRITON_DTYPE[t.dtype])
            if slot is not None:
                np.frombuffer(slot.inp.mm, dtype=np.uint8, count=arr.nbytes, offset=off)[:] = arr.reshape(-1).view(np.uint8)
                inp.set_shared_memory(slot.in_region, arr.nbytes, off)
                off += arr.nbytes
            else:
                inp.set_data_from_numpy(arr)
            t_inputs.append(inp)
        off = 0
        for t in spec.outputs:
            nbytes = n * item_nbytes(t)
            out = g.InferRequestedOutput(t.name)
            if slot is not None:
                out.set_shared_memory(slot.out_region, nbytes, off)
            t_outputs.append(out)
            out_layout.append((t, off, nbytes))
            off += nbytes
        return self.model_names.get(model, model), t_inputs, t_outputs, out_layout, n

    def _read(self, result, out_layout, n: int, slot: _Slot | None) -> dict[str, np.ndarray]:
        out = {}
        for t, off, nbytes in out_layout:
            if slot is not None:
                # With outputs in shared memory, the region holds the data (not result.as_numpy).
                out[t.name] = np.frombuffer(slot.out.mm, dtype=t.dtype, count=nbytes // np.dtype(t.dtype).itemsize,
                                            offset=off).reshape((n, *t.shape)).copy()
            else:
                out[t.name] = result.as_numpy(t.name)
        return out

    def run(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Synchronous path (warm-up, calibration)."""
        self._ensure_up()
        slot = self._take_slot()
        try:
            name, ti, to, layout, n = self._prepare(model, inputs, slot)
            try:
                res = self.client.infer(name, ti, outputs=to, client_timeout=self.timeout_s)
            except Exception as e:
                self._mark_down(e)
            self._backoff = BACKOFF_MIN_S
            return self._read(res, layout, n, slot)
        finally:
            self._give_slot(slot)

    def submit(self, model: str, inputs: dict[str, np.ndarray], done) -> None:
        """Asynchronous path: ``done(outputs_or_exception, compute_us)`` runs on a gRPC thread."""
        try:
            self._ensure_up()
        except ExecutorUnavailable as e:
            done(e, 0)
            return
        slot = self._take_slot()
        name, ti, to, layout, n = self._prepare(model, inputs, slot)
        t0 = time.perf_counter()

        def callback(result, error):
            us = int((time.perf_counter() - t0) * 1e6)
            try:
                if error is not None:
                    try:
                        self._mark_down(error)
                    except ExecutorUnavailable as e:
                        done(e, 0)
                    return
                self._backoff = BACKOFF_MIN_S
                done(self._read(result, layout, n, slot), us)
            except Exception as e:  # never let an exception die silently on a gRPC thread
                done(e, 0)
            finally:
                self._give_slot(slot)

        try:
            self.client.async_infer(name, ti, callback, outputs=to, client_timeout=self.timeout_s)
        except Exception as e:
            self._give_slot(slot)
            try:
                self._mark_down(e)
            except ExecutorUnavailable as ue:
                done(ue, 0)

    def _take_slot(self) -> _Slot | None:
        if not self.use_shm:
            return None
        with self._lock:
            if not self._free:
                # The dispatcher sends at most max_inflight batches; more means a bug upstream.
                raise RuntimeError("more batches in flight than shared-memory slots")
            return self._free.pop()

    def _give_slot(self, slot: _Slot | None) -> None:
        if slot is not None:
            with self._lock:
                self._free.append(slot)

    # ------------------------------------------------------------------ shutdown
    def _drop_slots(self) -> None:
        if self.client is not None and self._registered:
            for s in self._slots:
                for region in (s.in_region, s.out_region):
                    try:
                        self.client.unregister_system_shared_memory(region, client_timeout=5.0)
                    except Exception:
                        pass  # Triton gone: nothing registered any more
        for s in self._slots:
            s.inp.close()
            s.out.close()
        self._slots, self._free, self._registered = [], [], False

    def close(self) -> None:
        self._drop_slots()
        if self.client is not None:
            self.client.close()
            self.client = None
