"""GPU-worker executor that drives a Triton Inference Server over gRPC with shared memory.

- Inputs and outputs never ride in gRPC message bodies: each in-flight slot owns one input and
  one output region, registered with Triton once and reused; ``close()`` unregisters and frees
  them. Regions are CUDA shared memory when the worker sees the GPU, system (POSIX) shared
  memory otherwise (``workers/triton_regions.py``).
- Region names are ``<prefix><slot>-in|out`` with a prefix stable across restarts of the same
  worker, so a restarted worker first unregisters what a killed predecessor left registered,
  and never touches regions of other Triton users.
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
import os
import threading
import time

import numpy as np

from batchyard.protocol import ModelSpec
from batchyard.validation import item_nbytes

from .runtime import CannotStart, ExecutorUnavailable
from .triton_model_check import TRITON_DTYPE, check_model_config
from .triton_regions import make_region, resolve_kind

log = logging.getLogger("batchyard.worker")

BACKOFF_MIN_S, BACKOFF_MAX_S = 0.2, 5.0


class _Slot:
    """One in-flight batch's input and output regions (registered with Triton)."""

    def __init__(self, kind: str, tag: str, in_bytes: int, out_bytes: int, device: int):
        self.inp = make_region(kind, f"{tag}-in", in_bytes, device)
        try:
            self.out = make_region(kind, f"{tag}-out", out_bytes, device)
        except BaseException:
            self.inp.close()
            raise

    @property
    def regions(self):
        return (self.inp, self.out)


class TritonExecutor:
    path = "gpu"
    simulated = False

    def __init__(self, url: str, model_names: dict[str, str] | None = None, inflight: int = 2,
                 timeout_s: float = 30.0, shm: str = "auto", device: int = 0, region_prefix: str = "",
                 tensor_names: dict[str, dict[str, str]] | None = None, channel_args=None):
        """``shm``: "auto" (CUDA if this worker sees GPU ``device``, else system), "cuda",
        "system", or "none" (tensors in gRPC bodies, for comparison). Raises RegionError when
        "cuda" cannot work on this host."""
        import tritonclient.grpc as grpcclient

        self.grpc = grpcclient
        self.url = url
        self.model_names = model_names or {}
        self.tensor_names = tensor_names or {}  # model -> {spec tensor: Triton tensor} where they differ
        self.inflight = inflight
        self.timeout_s = timeout_s
        self.shm_kind = "none" if shm == "none" else resolve_kind(shm, device)
        self.device = device
        self.region_prefix = region_prefix or f"batchyard-{os.getpid()}-"
        self.channel_args = channel_args
        self.specs: dict[str, ModelSpec] = {}
        self.client = None
        self._slots: list[_Slot] = []
        self._free: list[_Slot] = []
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = BACKOFF_MIN_S
        self._registered = False

    @property
    def use_shm(self) -> bool:
        return self.shm_kind != "none"

    # ------------------------------------------------------------------ setup
    def load(self, spec: ModelSpec, factory: str = "") -> None:
        self.specs[spec.name] = spec
        if self.client is None:
            self.client = self.grpc.InferenceServerClient(self.url, channel_args=self.channel_args)
            if self.use_shm:
                self._unregister_ours()  # what a killed predecessor of this worker left
        name = self.model_names.get(spec.name, spec.name)
        cfg = self.client.get_model_config(name, client_timeout=self.timeout_s).config
        check = check_model_config(cfg, spec, self.tensor_names.get(spec.name))
        for w in check.warnings:
            log.warning("%s", w)
        if check.problems:
            raise CannotStart("; ".join(check.problems))
        if self.use_shm:
            in_b = max(sum(item_nbytes(t) for t in s.inputs) * s.max_batch for s in self.specs.values())
            out_b = max(sum(item_nbytes(t) for t in s.outputs) * s.max_batch for s in self.specs.values())
            self._make_slots(in_b, out_b)

    def _make_slots(self, in_bytes: int, out_bytes: int) -> None:
        if self._slots and self._slots[0].inp.size >= in_bytes and self._slots[0].out.size >= out_bytes:
            return
        self._drop_slots()
        for k in range(self.inflight):
            self._slots.append(_Slot(self.shm_kind, f"{self.region_prefix}{k}", in_bytes, out_bytes, self.device))
        self._free = list(self._slots)
        self._register_slots()
        log.info("%d %s shared-memory slots registered with Triton (%d + %d bytes each)",
                 len(self._slots), self.shm_kind, self._slots[0].inp.size, self._slots[0].out.size)

    def _register_slots(self) -> None:
        for s in self._slots:
            for r in s.regions:
                r.register(self.client, self.timeout_s)
        self._registered = True

    def _registered_names(self) -> list[str]:
        c, t = self.client, self.timeout_s
        status = (c.get_cuda_shared_memory_status(client_timeout=t) if self.shm_kind == "cuda"
                  else c.get_system_shared_memory_status(client_timeout=t))
        return [name for name in status.regions if name.startswith(self.region_prefix)]

    def _unregister_ours(self) -> None:
        """Every region registered under our prefix (only ever called while we hold none)."""
        unreg = (self.client.unregister_cuda_shared_memory if self.shm_kind == "cuda"
                 else self.client.unregister_system_shared_memory)
        for name in self._registered_names():
            unreg(name, client_timeout=self.timeout_s)
            log.info("unregistered Triton region %r left from before", name)

    def _ensure_up(self) -> None:
        """Fail fast during back-off; after it, reconnect and re-register the regions."""
        now = time.monotonic()
        if now < self._down_until:
            raise ExecutorUnavailable(f"Triton at {self.url} is unreachable; retrying in "
                                      f"{self._down_until - now:.1f} s")
        if not self._registered and self._slots:
            try:
                self._unregister_ours()  # a restarted Triton has none; a reachable one may
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
        rename = self.tensor_names.get(model, {})
        n = next(iter(inputs.values())).shape[0]
        g = self.grpc
        t_inputs, t_outputs, out_layout = [], [], []
        off = 0
        for t in spec.inputs:
            arr = np.ascontiguousarray(inputs[t.name])
            inp = g.InferInput(rename.get(t.name, t.name), list(arr.shape), TRITON_DTYPE[t.dtype])
            if slot is not None:
                slot.inp.write(off, arr)
                inp.set_shared_memory(slot.inp.name, arr.nbytes, off)
                off += arr.nbytes
            else:
                inp.set_data_from_numpy(arr)
            t_inputs.append(inp)
        off = 0
        for t in spec.outputs:
            nbytes = n * item_nbytes(t)
            tname = rename.get(t.name, t.name)
            out = g.InferRequestedOutput(tname)
            if slot is not None:
                out.set_shared_memory(slot.out.name, nbytes, off)
            t_outputs.append(out)
            out_layout.append((t, tname, off))
            off += nbytes
        return self.model_names.get(model, model), t_inputs, t_outputs, out_layout, n

    def _read(self, result, out_layout, n: int, slot: _Slot | None) -> dict[str, np.ndarray]:
        out = {}
        for t, tname, off in out_layout:
            if slot is not None:
                # With outputs in shared memory, the region holds the data (not result.as_numpy).
                out[t.name] = slot.out.read(off, t.dtype, (n, *t.shape))
            else:
                out[t.name] = result.as_numpy(tname)
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
                for r in s.regions:
                    try:
                        r.unregister(self.client, 5.0)
                    except Exception:
                        pass  # Triton gone: nothing registered any more
        for s in self._slots:
            for r in s.regions:
                r.close()
        self._slots, self._free, self._registered = [], [], False

    def close(self) -> None:
        self._drop_slots()
        if self.client is not None:
            self.client.close()
            self.client = None
