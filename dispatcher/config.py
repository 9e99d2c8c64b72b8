"""Configuration: one typed place for a node (dispatcher + its workers + the models they serve).

Loaded from TOML, converted with type checks (msgspec.convert reports the field path), then
validated for cross-field rules. Every process of a node reads the same file, so a worker
started by `batchyard up`, by systemd or by hand sees the same model specs as the dispatcher.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import msgspec

from .protocol import ModelSpec, TensorSpec
from .validation import validate_spec


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class TensorConfig:
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    name: str
    # "module:function" building the model for an amx worker; see workers/models.py. Workers
    # that do not build the model themselves (sim, triton) do not need it.
    factory: str
    inputs: tuple[TensorConfig, ...]
    outputs: tuple[TensorConfig, ...]
    max_batch: int = 64

    def spec(self) -> ModelSpec:
        conv = lambda ts: tuple(TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in ts)
        return ModelSpec(self.name, conv(self.inputs), conv(self.outputs), self.max_batch)


@dataclass(frozen=True)
class SimConfig:
    """Simulated device: service time launch_us + per_item_us * B, times (1 +- jitter)."""

    launch_us: float = 150.0
    per_item_us: float = 20.0
    jitter: float = 0.0
    device: Literal["gpu", "cpu"] = "gpu"  # which path it stands in for (replies say simulated)


@dataclass(frozen=True)
class TritonConfig:
    """GPU worker backed by a Triton server (workers/triton_executor.py)."""

    url: str = "127.0.0.1:8001"  # gRPC
    models: dict[str, str] = field(default_factory=dict)  # Batchyard model -> Triton model name
    # Batchyard model -> {spec tensor: Triton tensor} where names differ (e.g. TorchScript's INPUT__0)
    tensor_names: dict[str, dict[str, str]] = field(default_factory=dict)
    inflight: int = 2  # batches in flight to Triton at once
    # Where tensors travel: "auto" = CUDA shared memory when this worker sees GPU `device`, else
    # system shared memory; "cuda"; "system"; "none" = in gRPC message bodies (for comparison).
    shm: Literal["auto", "cuda", "system", "none"] = "auto"
    device: int = 0  # GPU of the CUDA shared-memory regions
    max_grpc_message_bytes: int = 0  # cap on gRPC messages (0: gRPC's default); proves shm carries the data


@dataclass(frozen=True)
class CudaConfig:
    """GPU worker without Triton (workers/cuda_executors.py): kind "cuda" runs the model
    factory with PyTorch on the GPU; kind "tensorrt" runs an engine built from ONNX."""

    device: int = 0
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    onnx: dict[str, str] = field(default_factory=dict)  # tensorrt: model -> ONNX file


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    kind: Literal["amx", "sim", "triton", "cuda", "tensorrt"]
    models: tuple[str, ...]
    cpus: tuple[int, ...] = ()  # CPU affinity; empty = leave as inherited
    numa_node: Optional[int] = None  # bind memory here when libnuma is present
    threads: int = 1  # intra-op threads of the executor
    max_inflight: int = 1
    warmup_sizes: tuple[int, ...] = ()  # empty: powers of two up to the model's max_batch
    sim: SimConfig = field(default_factory=SimConfig)
    triton: TritonConfig = field(default_factory=TritonConfig)
    cuda: CudaConfig = field(default_factory=CudaConfig)


@dataclass(frozen=True)
class DispatcherConfig:
    frontend: str  # where clients connect, e.g. "tcp://127.0.0.1:7755" or "ipc:///run/..."
    backend: str  # where workers connect
    policy: str = "mcb"  # see dispatcher/policy.py: mcb, three-segment, gpu-only, greedy, fixed:N, window:US,N
    profile: str = ""  # cost-curve profile written by `batchyard calibrate` (JSON); empty: learn online
    max_queue: int = 10_000  # queued requests per model before OVERLOADED
    max_inline_bytes: int = 4 << 20  # larger payloads must come through shared memory
    default_timeout_s: float = 30.0
    heartbeat_interval_s: float = 0.2
    worker_dead_after_s: float = 1.5
    janitor_interval_s: float = 5.0  # sweep orphaned shared memory of dead clients
    drain_timeout_s: float = 5.0  # on SIGTERM, how long in-flight batches may finish
    metrics_port: int = 0  # Prometheus /metrics on this port (0: off), served from the dispatcher's loop
    metrics_host: str = "127.0.0.1"


@dataclass(frozen=True)
class NodeConfig:
    dispatcher: DispatcherConfig
    models: tuple[ModelConfig, ...]
    workers: tuple[WorkerConfig, ...] = ()

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def worker(self, name: str) -> WorkerConfig:
        for w in self.workers:
            if w.name == name:
                return w
        raise ConfigError(f"no worker named {name!r} in config; have {[w.name for w in self.workers]}")

    def validate(self) -> "NodeConfig":
        d = self.dispatcher
        for key in ("frontend", "backend"):
            addr = getattr(d, key)
            if not addr.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"dispatcher.{key} = {addr!r}: must start with tcp://, ipc:// or inproc://")
        if d.frontend == d.backend:
            raise ConfigError("dispatcher.frontend and dispatcher.backend must differ")
        if d.max_queue < 1 or d.max_inline_bytes < 0 or d.default_timeout_s <= 0:
            raise ConfigError("dispatcher: max_queue >= 1, max_inline_bytes >= 0, default_timeout_s > 0")
        if not 0 < d.heartbeat_interval_s < d.worker_dead_after_s:
            raise ConfigError("dispatcher: need 0 < heartbeat_interval_s < worker_dead_after_s")
        from .policy import make_policy  # late: policy imports state which is pure
        try:
            make_policy(d.policy)
        except ValueError as e:
            raise ConfigError(f"dispatcher.policy: {e}") from None
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate model names {names}")
        for m in self.models:
            try:
                validate_spec(m.spec())
            except (ValueError, msgspec.ValidationError) as e:
                raise ConfigError(str(e)) from None
        wnames = [w.name for w in self.workers]
        if len(set(wnames)) != len(wnames):
            raise ConfigError(f"duplicate worker names {wnames}")
        for w in self.workers:
            unknown = set(w.models) - set(names)
            if unknown or not w.models:
                raise ConfigError(f"worker {w.name!r}: models {sorted(unknown) or '[]'} not defined in [[models]]")
            for m in w.models if w.kind in ("amx", "cuda") else ():
                if ":" not in self.model(m).factory:
                    raise ConfigError(f"model {m!r}: an amx worker ({w.name!r}) runs it, so its factory "
                                      f"{self.model(m).factory!r} must be 'module:function'")
            for m, renames in w.triton.tensor_names.items() if w.kind == "triton" else ():
                spec = self.model(m).spec() if m in w.models else None
                known = {t.name for t in spec.inputs + spec.outputs} if spec else set()
                if spec is None or set(renames) - known:
                    raise ConfigError(f"worker {w.name!r}: triton.tensor_names[{m!r}] must name tensors of a model "
                                      f"it serves; unknown {sorted(set(renames) - known) if spec else m!r}")
            if w.threads < 1 or w.max_inflight < 1:
                raise ConfigError(f"worker {w.name!r}: threads and max_inflight must be >= 1")
        return self


def parse_config(data: dict) -> NodeConfig:
    try:
        cfg = msgspec.convert(data, NodeConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"config: {e}") from None
    return cfg.validate()


def load_config(path: str | Path) -> NodeConfig:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    return parse_config(data)


def to_toml(cfg: NodeConfig) -> str:
    """Write a config back as TOML (used by the demo and tests to hand a config to children)."""
    out: list[str] = []

    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{val(k)} = {val(x)}" for k, x in v.items()) + " }"
        return repr(v)

    def table(header: str, obj) -> None:
        out.append(f"\n{header}")
        nested = []
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if v is None:
                continue
            if dataclasses.is_dataclass(v):
                nested.append((f.name, v))
            elif isinstance(v, tuple) and v and dataclasses.is_dataclass(v[0]):
                nested.append((f.name, v))
            else:
                out.append(f"{f.name} = {val(v)}")
        for name, v in nested:
            base = header.strip("[]")
            if isinstance(v, tuple):
                for item in v:
                    table(f"[[{base}.{name}]]", item)
            else:
                table(f"[{base}.{name}]", v)

    table("[dispatcher]", cfg.dispatcher)
    for m in cfg.models:
        table("[[models]]", m)
    for w in cfg.workers:
        table("[[workers]]", w)
    return "\n".join(out).lstrip() + "\n"
