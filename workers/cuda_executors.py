"""GPU executors for hosts without Triton: PyTorch on CUDA, and TensorRT from an ONNX file.

Both are import-guarded: nothing here imports CUDA code at module import, and building one
on a host without a usable GPU raises ``GpuUnavailable`` with the reason, so CPU-only
installs and tests never touch them. ``tests/test_gpu.py`` runs the PyTorch path on a GPU
(an H200, PyTorch 2.11 + CUDA 13); the TensorRT path is written against the TensorRT 10 API
but has not run here (no TensorRT on the GPU hosts this project was lent).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from batchyard.protocol import ModelSpec

from .executors import build_model
from .runtime import CannotStart, powers_of_two


log = logging.getLogger("batchyard.worker.cuda")


class GpuUnavailable(CannotStart):
    pass


def _torch_cuda(device: int):
    try:
        import torch
    except ImportError as e:
        raise GpuUnavailable(f"PyTorch is not installed: {e}") from None
    if not torch.cuda.is_available():
        raise GpuUnavailable("torch.cuda.is_available() is False (CPU-only PyTorch build or no GPU)")
    if device >= torch.cuda.device_count():
        raise GpuUnavailable(f"cuda:{device} does not exist ({torch.cuda.device_count()} GPUs)")
    return torch


class TorchCudaExecutor:
    """The model factory's module on ``cuda:<device>`` with half-precision weights (converted
    once). Inputs and outputs go through pinned host buffers allocated once per model at
    ``max_batch`` (a ``pin_memory()`` per batch is a cudaHostAlloc on the hot path); one CUDA
    stream; synchronous, so one batch uses the buffers at a time.

    With ``graphs`` (the default) each model is captured once per batch-size bucket (powers of
    two up to ``max_batch``) as a CUDA graph, and a batch of B items replays the smallest bucket
    that holds it. Eager PyTorch launches each of a model's kernels from Python: on an H200,
    MiniLM-L6 took 3.1-5.8 ms at every B from 1 to 64 eagerly, 0.39-1.23 ms as graphs. A model whose capture
    fails (a host sync or a data-dependent shape in its forward) runs eagerly, with a warning."""

    path = "gpu"
    simulated = False

    def __init__(self, device: int = 0, precision: str = "bf16", graphs: bool = True):
        torch = _torch_cuda(device)
        self.torch = torch
        self.device = torch.device(f"cuda:{device}")
        torch.cuda.set_device(self.device)  # graphs capture and replay on the current device
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
        self.use_graphs = graphs
        self.models: dict[str, object] = {}
        self.staging: dict[str, tuple[dict, dict]] = {}
        # model -> (device input buffers at max_batch, {bucket: (graph, its output tensors)})
        self.graphs: dict[str, tuple[dict, dict[int, tuple]]] = {}
        torch.backends.cuda.matmul.allow_tf32 = True

    def load(self, spec: ModelSpec, factory: str) -> None:
        torch = self.torch
        module = build_model(factory, spec).eval().to(self.device)
        module.to(self.dtype)  # floating-point weights only; integer buffers stay as they are
        self.models[spec.name] = module

        def pinned(t):
            return torch.empty((spec.max_batch, *t.shape), dtype=getattr(torch, t.dtype), pin_memory=True)

        self.staging[spec.name] = ({t.name: pinned(t) for t in spec.inputs}, {t.name: pinned(t) for t in spec.outputs})
        if self.use_graphs:
            try:
                self.graphs[spec.name] = self._capture(spec, module)
            except Exception as e:  # noqa: BLE001 - any capture failure: the model still runs eagerly
                torch.cuda.synchronize(self.device)
                log.warning("model %s: CUDA graph capture failed (%s: %s); running it eagerly",
                            spec.name, type(e).__name__, e)

    def _forward(self, module, inputs: dict) -> dict:
        return module(**{k: v.to(self.dtype) if v.is_floating_point() else v for k, v in inputs.items()})

    def _capture(self, spec: ModelSpec, module) -> tuple[dict, dict[int, tuple]]:
        torch = self.torch
        static = {t.name: torch.zeros((spec.max_batch, *t.shape), dtype=getattr(torch, t.dtype), device=self.device)
                  for t in spec.inputs}
        sizes = powers_of_two(spec.max_batch)
        with torch.inference_mode():
            # Warm-up runs on a side stream before capture, as PyTorch asks: cuBLAS and the
            # allocator set themselves up per shape outside the graph.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for b in sizes:
                    self._forward(module, {k: v[:b] for k, v in static.items()})
            torch.cuda.current_stream(self.device).wait_stream(side)
            graphs, pool = {}, None
            # Largest first, one memory pool: each smaller graph reuses the largest one's
            # activations (as vLLM captures). Safe because replays never overlap: every batch
            # is copied out and synchronised before the next replay.
            for b in sorted(sizes, reverse=True):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self._forward(module, {k: v[:b] for k, v in static.items()})
                pool = g.pool()
                graphs[b] = (g, out)
        return static, graphs

    def run(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self.torch
        host_in, host_out = self.staging[model]
        n = next(iter(inputs.values())).shape[0]
        with torch.inference_mode():
            for name, arr in inputs.items():
                host_in[name][:n].numpy()[...] = arr  # the one host copy, into pinned memory
            if model in self.graphs:
                static, graphs = self.graphs[model]
                bucket = min(b for b in graphs if b >= n)
                for name in inputs:
                    # Rows n..bucket keep an earlier batch's inputs (zeros before the first):
                    # valid data for the model, and their outputs are never read.
                    static[name][:n].copy_(host_in[name][:n], non_blocking=True)
                graph, out = graphs[bucket]
                graph.replay()
            else:
                tensors = {name: host_in[name][:n].to(self.device, non_blocking=True) for name in inputs}
                out = self._forward(self.models[model], tensors)
            for name, v in out.items():
                host_out[name][:n].copy_(v[:n], non_blocking=True)  # casts back to the spec's dtype
            torch.cuda.current_stream(self.device).synchronize()
        # Copies: the pinned buffers are the next batch's.
        return {name: host_out[name][:n].numpy().copy() for name in out}


class TensorRTExecutor:
    """A TensorRT engine built from ONNX (fp16, one optimisation profile over the batch
    dimension 1..max_batch), cached next to the ONNX file; device buffers are torch tensors."""

    path = "gpu"
    simulated = False

    def __init__(self, onnx: dict[str, str], device: int = 0, fp16: bool = True):
        self.torch = _torch_cuda(device)
        try:
            import tensorrt as trt
        except ImportError as e:
            raise GpuUnavailable(f"TensorRT is not installed: {e}") from None
        self.trt = trt
        self.onnx = onnx  # model name -> path of its ONNX file
        self.fp16 = fp16
        self.device = self.torch.device(f"cuda:{device}")
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engines: dict[str, tuple] = {}
        self.specs: dict[str, ModelSpec] = {}

    def _build(self, spec: ModelSpec) -> bytes:
        trt = self.trt
        src = Path(self.onnx[spec.name])
        cache = src.with_suffix(f".b{spec.max_batch}{'.fp16' if self.fp16 else ''}.plan")
        if cache.exists() and cache.stat().st_mtime >= src.stat().st_mtime:
            return cache.read_bytes()
        builder = trt.Builder(self.logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, self.logger)
        if not parser.parse(src.read_bytes()):
            raise ValueError(f"TensorRT could not parse {src}: {parser.get_error(0)}")
        config = builder.create_builder_config()
        if self.fp16:
            config.set_flag(trt.BuilderFlag.FP16)
        profile = builder.create_optimization_profile()
        for t in spec.inputs:
            profile.set_shape(t.name, (1, *t.shape), (max(1, spec.max_batch // 2), *t.shape), (spec.max_batch, *t.shape))
        config.add_optimization_profile(profile)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise RuntimeError(f"TensorRT failed to build an engine for {spec.name}")
        cache.write_bytes(bytes(plan))
        return bytes(plan)

    def load(self, spec: ModelSpec, factory: str = "") -> None:
        runtime = self.trt.Runtime(self.logger)
        engine = runtime.deserialize_cuda_engine(self._build(spec))
        self.engines[spec.name] = (engine, engine.create_execution_context(), self.torch.cuda.Stream(self.device))
        self.specs[spec.name] = spec

    def run(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self.torch
        engine, ctx, stream = self.engines[model]
        spec = self.specs[model]
        n = next(iter(inputs.values())).shape[0]
        keep = []
        with torch.cuda.stream(stream):
            for t in spec.inputs:
                d = torch.from_numpy(np.ascontiguousarray(inputs[t.name])).to(self.device, non_blocking=True)
                keep.append(d)
                ctx.set_input_shape(t.name, tuple(d.shape))
                ctx.set_tensor_address(t.name, d.data_ptr())
            outs = {}
            for t in spec.outputs:
                o = torch.empty((n, *t.shape), dtype=getattr(torch, t.dtype), device=self.device)
                outs[t.name] = o
                ctx.set_tensor_address(t.name, o.data_ptr())
            if not ctx.execute_async_v3(stream.cuda_stream):
                raise RuntimeError(f"TensorRT execution of {model} failed")
            host = {k: v.to("cpu", non_blocking=True) for k, v in outs.items()}
        stream.synchronize()
        del keep  # inputs must outlive the asynchronous execution
        return {k: v.numpy() for k, v in host.items()}
