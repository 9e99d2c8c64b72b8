"""Executors: what actually runs a batch inside a worker process.

An executor is built once per worker, loads each model it serves, and then runs
``run(model, inputs) -> outputs`` on numpy arrays with a leading batch dimension.
- ``TorchCpuExecutor`` (the AMX worker): PyTorch on CPU, weights converted to bf16 *once*
  (bf16 autocast re-casts on every call and measured ~10x slower for the MLP here), so
  oneDNN picks its bf16 kernels — AMX tiles where the CPU has them (``ONEDNN_VERBOSE=1``
  prints ``brg_matmul:avx10_1_512_amx`` on Sapphire Rapids), avx512_core_bf16 otherwise;
  fp32 on a CPU with neither (workers/precision.py).
- ``SimulatedExecutor``: no model; sleeps ``launch + per_item * B`` and returns a
  deterministic function of the inputs (``sim_outputs``) so correctness is still checked.
"""

from __future__ import annotations

import importlib
import random
import time
from typing import Callable

import numpy as np

from batchyard.config import SimConfig
from batchyard.protocol import ModelSpec

from .runtime import error_text, out_of_memory


def load_factory(path: str) -> Callable:
    """The factory a model config names; ValueError (the worker's one line and exit 78) for a
    name that is no module's attribute, or names something that is no function."""
    module, _, attr = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, SyntaxError) as e:
        raise ValueError(f"cannot load model factory {path!r}: {e}") from None
    if not callable(factory):
        raise ValueError(f"cannot load model factory {path!r}: it is a {type(factory).__name__}, not a function")
    return factory


# A factory's OS errors that a restart meets again (the weights file missing): the one line and
# exit 78. Its other OS errors (a weights store down for a moment, a timeout, a full disk) and
# memory errors may pass: the worker exits 1 and is restarted; its other exceptions (a bug, a
# spec it refuses) meet a restart alike: 78.
SETTLED_OS_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def build_model(factory: str, spec: ModelSpec):
    """``factory(spec)``; a failure a restart meets again is a ValueError (a factory that raised
    anything was a traceback and exit 1, restarted every second for good)."""
    fn = load_factory(factory)
    try:
        return fn(spec)
    except Exception as e:  # noqa: BLE001 -- sorted below
        if out_of_memory(e) or (isinstance(e, OSError) and not isinstance(e, SETTLED_OS_ERRORS)):
            raise
        raise ValueError(f"model factory {factory!r} failed: {error_text(e)}") from None


class TorchCpuExecutor:
    path = "cpu"
    simulated = False

    def __init__(self, threads: int = 1, precision: str = "auto"):
        import torch  # imported here, after the worker pinned itself (see pinning.py)

        from .precision import resolve, torch_dtype

        torch.set_num_threads(threads)
        self.torch = torch
        self.precision = resolve(precision)
        self.dtype = torch_dtype(self.precision)
        self.models: dict[str, object] = {}

    def load(self, spec: ModelSpec, factory: str) -> None:
        module = build_model(factory, spec)
        module.eval()
        module.to(self.dtype)  # floating-point weights only; integer buffers stay as they are
        self.models[spec.name] = module

    def run(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self.torch
        tensors = {}
        for name, arr in inputs.items():
            if not arr.flags.writeable:
                # Views of shared memory or ZeroMQ frames are read-only; torch wants writable
                # buffers even though inference never writes to inputs. Copy only if needed.
                arr = arr.copy()
            t = torch.from_numpy(arr)
            tensors[name] = t.to(self.dtype) if t.is_floating_point() else t
        with torch.inference_mode():
            out = self.models[model](**tensors)
        if not isinstance(out, dict):
            raise ModelContractError(f"model {model!r}: forward must return a dict of tensors by output name, "
                                     f"got {type(out).__name__}")
        for name, value in out.items():
            if not isinstance(value, torch.Tensor):  # the container's type said nothing of which one
                raise ModelContractError(f"model {model!r}: forward must return a dict of tensors by output name; "
                                         f"output {name!r} is {type(value).__name__}")
        return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in out.items()}


class ModelContractError(TypeError):
    """A model's forward returned what no batch of it can be answered from (not a dict of
    tensors): the model's code, not the batch, is wrong."""


def sim_outputs(inputs: dict[str, np.ndarray], spec: ModelSpec) -> dict[str, np.ndarray]:
    """Each item's outputs are filled with the sum of that item's input elements (mod 2**16,
    so integer outputs do not overflow). Cheap, deterministic and input-dependent."""
    n = next(iter(inputs.values())).shape[0]
    s = np.zeros(n, dtype=np.float64)
    for arr in inputs.values():
        s += arr.reshape(n, -1).sum(axis=1, dtype=np.float64)
    s = np.mod(s, 65536.0)
    return {t.name: np.broadcast_to(s.reshape((n,) + (1,) * len(t.shape)), (n, *t.shape)).astype(t.dtype)
            for t in spec.outputs}


class SimulatedExecutor:
    simulated = True

    def __init__(self, sim: SimConfig, seed: int = 0):
        self.sim = sim
        self.path = sim.device
        self.specs: dict[str, ModelSpec] = {}
        self.rng = random.Random(seed)

    def load(self, spec: ModelSpec, factory: str) -> None:
        self.specs[spec.name] = spec  # the factory is not called: nothing real is loaded

    def service_time(self, n_items: int) -> float:
        t = (self.sim.launch_us + self.sim.per_item_us * n_items) * 1e-6
        if self.sim.jitter:
            t *= max(0.0, 1.0 + self.rng.gauss(0.0, self.sim.jitter))
        return t

    def run(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        spec = self.specs[model]
        n = next(iter(inputs.values())).shape[0]
        end = time.perf_counter() + self.service_time(n)
        out = sim_outputs(inputs, spec)
        remaining = end - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)  # the simulated device's service time, not synchronisation
        return out
