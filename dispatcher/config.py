"""Configuration: one typed place for a node (dispatcher + its workers + the models they serve).

Every process of a node reads the same TOML file, so a worker started by `batchyard up`, by
systemd or by hand sees the same model specs as the dispatcher. The file is decoded into frozen
msgspec Structs that refuse unknown keys (`forbid_unknown_fields`) and carry their ranges as
`msgspec.Meta` constraints; `NodeConfig.validate()` then checks the rules that span fields.
Every error names the file, the table and the key, and suggests the closest known name:

    node.toml: [dispatcher] unknown key 'max_queu' (did you mean 'max_queue'?)
    node.toml: [[workers]] #2 (name 'amx1'): cpus[0]: expected int >= 0, got -1
"""

from __future__ import annotations

import difflib
import itertools
import os
import re
import stat
import tempfile
import tomllib
import typing
from pathlib import Path
from typing import Annotated, Literal, Optional

import msgspec
import msgspec.inspect as mi
import tomli_w

from .addresses import host_port
from .llm_model_files import generation_defaults
from .protocol import DTYPES, MAX_TIMEOUT_S, ModelSpec, Name, TensorSpec
from .validation import validate_spec


class ConfigError(ValueError):
    pass


# Frozen (configs are shared between processes and threads as values), unknown keys refused,
# defaults left out when written back so a written config says only what differs.
class _Table(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


# The node's processes are separate: an inproc:// address never reaches the workers.
Address = Annotated[str, msgspec.Meta(pattern=r"^(tcp|ipc)://.+")]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
# Finite: inf passed as a duration or a cost (per_item_us = inf failed every request INTERNAL,
# "timestamp out of range"); no setting of a node needs more than 1e9 (of s or of us).
FLOAT_MAX = 1e9
PositiveFloat = Annotated[float, msgspec.Meta(gt=0, le=FLOAT_MAX)]
TimeoutS = Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT_S)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0, le=FLOAT_MAX)]
# A duration the node hands a C API in whole milliseconds (zmq_poll, gRPC's channel options take
# an int): past 2**31 - 1 ms, about 24.8 days, the worker's heartbeat thread died of an
# OverflowError (the worker never registered again) and the front door failed to start.
MS_INT_MAX_S = ((1 << 31) - 1) / 1000
MsSeconds = Annotated[float, msgspec.Meta(gt=0, le=MS_INT_MAX_S)]
GrpcBytes = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]  # gRPC's message lengths are C ints
MIN_HEARTBEAT_S = 0.01  # [dispatcher] heartbeat_interval_s
MIN_DEAD_AFTER_S = 0.5  # [dispatcher] worker_dead_after_s
Dtype = Literal[tuple(sorted(DTYPES))]  # type: ignore[valid-type]
# Empty (a model no worker of this node builds itself) or "package.module:function".
# A model's or tensor's name: no control characters (a NUL or a newline was taken, and went into
# logs, metric labels and the front door's paths as it was).
ConfigName = Annotated[Name, msgspec.Meta(pattern=r"^[^\x00-\x1f\x7f]*\Z")]
Factory = Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z_][\w.]*:[A-Za-z_]\w*)?\Z")]
# Worker names end up in process titles and Triton region names.
WorkerName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")]


class TensorConfig(_Table):
    name: ConfigName
    dtype: Dtype
    shape: tuple[Annotated[int, msgspec.Meta(ge=0, le=2**31)], ...]


class ModelConfig(_Table):
    name: ConfigName
    inputs: tuple[TensorConfig, ...]
    outputs: tuple[TensorConfig, ...]
    # "module:function" building the model for an amx or cuda worker (workers/models.py).
    # Workers that do not build the model themselves (sim, triton, tensorrt) do not need it.
    factory: Factory = ""
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 64

    def spec(self) -> ModelSpec:
        conv = lambda ts: tuple(TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in ts)
        return ModelSpec(self.name, conv(self.inputs), conv(self.outputs), self.max_batch)


class SimConfig(_Table):
    """Simulated device: service time launch_us + per_item_us * B, times (1 +- jitter)."""

    launch_us: NonNegFloat = 150.0
    per_item_us: NonNegFloat = 20.0
    jitter: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    device: Literal["gpu", "cpu"] = "gpu"  # which path it stands in for (replies say simulated)


class TritonConfig(_Table):
    """GPU worker backed by a Triton server (workers/triton_executor.py)."""

    url: Annotated[str, msgspec.Meta(min_length=1)] = "127.0.0.1:8001"  # gRPC
    models: dict[str, str] = {}  # Batchyard model -> Triton model name (default: the same)
    # Batchyard model -> {spec tensor: Triton tensor} where names differ (e.g. TorchScript's INPUT__0)
    tensor_names: dict[str, dict[str, str]] = {}
    # Batches in flight to Triton at once. Each holds a shared-memory slot of two open segments:
    # 40,000 ran the worker out of file descriptors at start (a traceback, exit 1); the bound keeps
    # far from the units' LimitNOFILE and from any gain (a few hide the gRPC round trip).
    inflight: Annotated[int, msgspec.Meta(ge=1, le=256)] = 2
    # Where tensors travel: "auto" = CUDA shared memory when this worker sees GPU `device`, else
    # system shared memory; "cuda"; "system"; "none" = in gRPC message bodies (for comparison).
    shm: Literal["auto", "cuda", "system", "none"] = "auto"
    device: NonNeg = 0  # GPU of the CUDA shared-memory regions
    max_grpc_message_bytes: GrpcBytes = 0  # cap on gRPC messages (0: gRPC's default); proves shm carries the data
    start_timeout_s: PositiveFloat = 60.0  # at start, how long to retry an unreachable Triton before exiting 69


class CudaConfig(_Table):
    """GPU worker without Triton (workers/cuda_executors.py): kind "cuda" runs the model
    factory with PyTorch on the GPU; kind "tensorrt" runs an engine built from ONNX."""

    device: NonNeg = 0
    # "" is the kind's own: bf16 for cuda, fp16 for tensorrt (CudaConfig.precision_for)
    precision: Literal["", "bf16", "fp16", "fp32"] = ""
    # cuda: replay each model as CUDA graphs captured at start (batch sizes 1, 2, 4, ... max_batch);
    # false runs PyTorch eagerly, one Python launch per kernel
    graphs: bool = True
    onnx: dict[str, str] = {}  # tensorrt: model -> ONNX file

    def precision_for(self, kind: str) -> str:
        return self.precision or ("fp16" if kind == "tensorrt" else "bf16")


class LlmModelConfig(_Table):
    """An LLM served by vLLM workers (LLM mode, workers/llm_worker.py): a Hugging Face model folder."""

    name: ConfigName
    path: str  # model folder (config, safetensors, tokenizer)
    block_size: Annotated[int, msgspec.Meta(ge=32, multiple_of=32)] = 32  # vLLM's CPU attention: multiples of 32
    max_model_len: Annotated[int, msgspec.Meta(ge=64)] = 2048
    # where the prefill instance stores KV for the decode instance (vLLM's ExampleConnector);
    # empty: a folder under the system temp dir, per node and model. A worker's start removes
    # the connector's entries there (hash-named folders of safetensors files) older than 10
    # minutes, and nothing else.
    kv_dir: str = ""
    # vLLM's --generation-config: "auto" samples /v1/completions requests with the folder's
    # generation_config.json where they leave a field out, as vLLM's server does; "vllm" with
    # vLLM's own defaults (temperature 1). (Triton's routes take vLLM's own either way, as its
    # vLLM backend does; the SDK is greedy unless asked.)
    generation_config: Literal["auto", "vllm"] = "auto"


class VllmConfig(_Table):
    """A vLLM engine worker (kind "vllm")."""

    role: Literal["prefill-cpu", "gpu"]
    # A CPU engine standing in for the GPU instance on a host without one: every reply and
    # report says so.
    stand_in: bool = False
    python: str = ""  # interpreter with vLLM installed (.venv-llm/bin/python); empty: this one
    kv_cache_gib: PositiveFloat = 1.0
    max_num_seqs: Positive = 8
    calibrate_tokens: tuple[Positive, ...] = (32, 128, 512)  # prefill lengths measured at start


class WorkerConfig(_Table):
    name: WorkerName
    kind: Literal["amx", "sim", "triton", "cuda", "tensorrt", "vllm"]
    models: tuple[str, ...]
    cpus: tuple[NonNeg, ...] = ()  # CPU affinity; empty = leave as inherited
    numa_node: Optional[NonNeg] = None  # bind memory here when libnuma is present
    threads: Positive = 1  # intra-op threads of the executor
    # Scheduling niceness of the worker's threads (0-19: raising it needs no privilege). Where
    # the worker shares a core with the dispatcher or the front door, a nice worker lets them
    # take an arrival or a completion at once instead of after the model's timeslice: one AMX
    # core with the whole node on it (MiniLM, 92.8 req/s, half its limit), p99 76.7 ms at nice
    # 10 against 88.5 at 0, median of 4 interleaved runs (bench/results/vs_triton_amx).
    nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 0
    # kind amx: the model's weights in bf16 or fp32; auto = bf16 where the CPU multiplies it
    # natively (amx_bf16, avx512_bf16), fp32 elsewhere (workers/precision.py)
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    max_inflight: Positive = 1
    warmup_sizes: tuple[Positive, ...] = ()  # empty: powers of two up to the model's max_batch
    sim: SimConfig = SimConfig()
    triton: TritonConfig = TritonConfig()
    cuda: CudaConfig = CudaConfig()
    vllm: Optional[VllmConfig] = None


class DispatcherConfig(_Table):
    frontend: Address  # where clients connect, e.g. "tcp://127.0.0.1:7755" or "ipc:///run/..."
    backend: Address  # where workers connect
    policy: str = "mcb"  # see dispatcher/policy.py: mcb, three-segment, gpu-only, greedy, fixed:N, window:US,N
    profile: str = ""  # cost-curve profile written by `batchyard calibrate` (JSON); empty: learn online
    max_queue: Positive = 10_000  # queued requests per model before OVERLOADED
    # larger payloads must come through shared memory (at most 1 TiB: ZeroMQ's size limit is an int64)
    max_inline_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 4 << 20
    default_timeout_s: TimeoutS = 30.0
    # At least 10 ms: every process of the node wakes this often (a worker's heartbeat, the
    # dispatcher's housekeeping), and at 1e-9 s a node of one simulated worker spun 72 % of a core.
    heartbeat_interval_s: Annotated[float, msgspec.Meta(ge=MIN_HEARTBEAT_S, le=MS_INT_MAX_S)] = 0.2
    # Generous: on a starved host (load average ~10) healthy workers went 1.6 s without being
    # heard. A worker that dies is noticed sooner anyway: `up` or systemd restarts it at once
    # (SIGCHLD) and its re-registration fails its batches over (a vLLM engine registers again only
    # after its 10-20 s start, so this bounds its lost generations too); and a hung one.
    # At least half a second (and two heartbeats, checked in validate): at 1 ms a healthy worker
    # left rotation and came back many times a second, its batches failed over each time.
    worker_dead_after_s: Annotated[float, msgspec.Meta(ge=MIN_DEAD_AFTER_S, le=FLOAT_MAX)] = 10.0
    janitor_interval_s: PositiveFloat = 5.0  # sweep orphaned shared memory of dead clients
    # On SIGTERM, how long the requests already taken (queued or running) may still be served.
    drain_timeout_s: NonNegFloat = 5.0
    # Circuit breaker: a worker whose batch comes back all UNAVAILABLE (its backend is down)
    # leaves rotation for a back-off that doubles on each further failure, up to the maximum;
    # its requests are retried on another worker serving the model.
    breaker_backoff_s: PositiveFloat = 0.5
    breaker_backoff_max_s: PositiveFloat = 30.0
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # Prometheus /metrics (0: off)
    metrics_host: str = "127.0.0.1"
    # Transport security (docs/protocol.md, "Trust model"). tcp endpoints are encrypted and
    # authenticated with CURVE when a secret key file (`batchyard keygen`) is named; clients
    # must then hold a public key found in curve_authorized_keys (a folder of `*.key` files,
    # or "*" for any key: encryption without client authentication).
    curve_secret_key: str = ""
    curve_authorized_keys: str = ""
    # Shared-memory references over tcp name files on *this* host: refused unless the network
    # is trusted to the same degree as the host.
    allow_shm_over_tcp: bool = False
    # ipc socket files: mode and group (empty: the process's own), so only that group connects.
    ipc_mode: Annotated[str, msgspec.Meta(pattern=r"^0?[0-7]{3}\Z")] = "0660"
    ipc_group: str = ""
    # ZMQ_MAXMSGSIZE on the frontend: a peer sending a larger frame is disconnected by ZeroMQ
    # before the dispatcher reads it. 0: max_inline_bytes + 1 MiB.
    max_message_bytes: NonNeg = 0
    # LLM mode: weight of the decode stall a GPU prefill causes the running streams, against
    # TTFT, when choosing the route (dispatcher/llm_routing.py); 0 = TTFT only
    llm_interference_weight: NonNegFloat = 0.0
    # CPU affinity of the dispatcher process (its loop and ZeroMQ's I/O thread); empty = as
    # inherited. Cores apart from the workers' keep its per-request work off the model's cores.
    cpus: tuple[NonNeg, ...] = ()


Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class RestrictedApisConfig(_Table):
    """One ``[[frontend.restricted_apis]]`` table, as tritonserver's
    ``--http-restricted-api=<apis>:<header>=<value>`` and ``--grpc-restricted-protocol=``: the
    APIs named answer only requests that carry ``header`` with ``value`` (docs/frontend.md,
    "Restricted APIs")."""

    apis: tuple[Literal["health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
                        "statistics", "trace", "logging"], ...]
    header: str
    value: str  # (checked by _check_restricted_apis, whose messages never show it)
    protocols: tuple[Literal["grpc", "http"], ...] = ("grpc", "http")


class FrontendConfig(_Table):
    """The KServe v2 / Triton-protocol front door (dispatcher/frontend_main.py); 0 = that side off."""

    host: str = "127.0.0.1"  # one address, a name, or every address: "::", "*" or "" (IPv4 and IPv6 alike)
    grpc_port: Port = 8001
    http_port: Port = 8000
    processes: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1  # all on the same ports (SO_REUSEPORT)
    # The largest request (and gRPC answer) in bytes. Triton's gRPC limit is the same 2 GiB - 1;
    # over HTTP the JSON part is bounded apart (http_body.MAX_JSON_BYTES), binary tensors are not.
    max_request_bytes: Annotated[int, msgspec.Meta(ge=1 << 16, le=(1 << 31) - 1)] = (1 << 31) - 1
    # As Triton's --strict-readiness (its default too): the server is ready while every model of
    # the node has a registered worker; false: while any has.
    strict_readiness: bool = True
    # An HTTP connection that sends nothing of a request for this long is closed: idle between
    # requests, its headers unfinished, or its body stalled (that request answers 408); so is a
    # gRPC connection with no call in flight. Without it a client that opened connections and
    # sent nothing held a descriptor each for an hour (HTTP) or for ever (gRPC).
    idle_timeout_s: MsSeconds = 75.0
    # CPU affinity of every front-door process (its loop, gRPC's and ZeroMQ's threads); empty =
    # as inherited. A request costs a front door ~1.5 ms of CPU in Python's gRPC: on a worker's
    # core that is time its model does not get (docs/frontend.md, "Cost").
    cpus: tuple[NonNeg, ...] = ()
    # Triton's trace extension (docs/frontend.md, "Traces"): the file traces are written to, and
    # the node's trace setting at its start, as tritonserver's --trace-config file=, level=,
    # rate=, count= and log-frequency=. Clients may change the setting, never the file.
    trace_file: str = ""
    trace_level: Literal["OFF", "TIMESTAMPS"] = "OFF"
    trace_rate: Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)] = 1000  # one request in this many
    trace_count: Annotated[int, msgspec.Meta(ge=-1, le=(1 << 31) - 1)] = -1  # traces to take; -1: no limit
    trace_log_frequency: Annotated[int, msgspec.Meta(ge=0, le=(1 << 32) - 1)] = 0
    restricted_apis: tuple[RestrictedApisConfig, ...] = ()
    # gRPC over TLS, as tritonserver's --grpc-use-ssl with --grpc-server-cert / --grpc-server-key
    # (PEM files, absolute paths, read at the front door's start); with grpc_tls_client_ca, as
    # --grpc-use-ssl-mutual with --grpc-root-cert: a client must present a certificate that CA
    # signed. Empty: plaintext. HTTP stays plaintext, as Triton's (a proxy in front gives it TLS).
    grpc_tls_cert: str = ""
    grpc_tls_key: str = ""
    grpc_tls_client_ca: str = ""


# The engines workers/cuda_executors.py's TensorRTExecutor builds (kind "tensorrt").
TENSORRT_PRECISIONS = ("fp16", "fp32")

# Factory names the workers of these kinds call (workers/main.py); sim, triton and tensorrt don't.
_BUILDS_MODEL = ("amx", "cuda")


class NodeConfig(_Table):
    dispatcher: DispatcherConfig
    models: tuple[ModelConfig, ...] = ()
    workers: tuple[WorkerConfig, ...] = ()
    frontend: Optional[FrontendConfig] = None
    llm_models: tuple[LlmModelConfig, ...] = ()

    def llm_model(self, name: str) -> LlmModelConfig:
        for m in self.llm_models:
            if m.name == name:
                return m
        names = [m.name for m in self.llm_models]
        raise ConfigError(f"no [[llm_models]] named {name!r}; have {names}{_did_you_mean(name, names)}")

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def worker(self, name: str) -> WorkerConfig:
        for w in self.workers:
            if w.name == name:
                return w
        raise ConfigError(f"no worker named {name!r} in config; have {[w.name for w in self.workers]}"
                          f"{_did_you_mean(name, [w.name for w in self.workers])}")

    def validate(self) -> "NodeConfig":
        """Check the rules that span fields; raise ConfigError naming the table and key."""
        # Struct constructors do not check types or ranges; a config built in code gets the
        # same checks as a loaded one by passing through the decoder once.
        data = msgspec.to_builtins(self)
        try:
            msgspec.convert(data, NodeConfig)
        except msgspec.ValidationError as e:
            raise ConfigError(_explain(e, data)) from None
        d = self.dispatcher
        if _same_endpoint(d.frontend, d.backend):
            raise ConfigError(f"[dispatcher] frontend and backend must differ (both {d.frontend!r}"
                              + ("" if d.frontend == d.backend else f" and {d.backend!r}") + ")")
        if d.curve_secret_key and not d.curve_authorized_keys:
            raise ConfigError("[dispatcher] curve_secret_key is set but curve_authorized_keys is not: name a "
                              "folder of client public keys, or \"*\" to accept any client key")
        if d.max_message_bytes and d.max_message_bytes <= d.max_inline_bytes:
            raise ConfigError(f"[dispatcher] max_message_bytes ({d.max_message_bytes}) must exceed "
                              f"max_inline_bytes ({d.max_inline_bytes})")
        if int(d.ipc_mode, 8) & 0o600 != 0o600:
            # Connecting to a unix socket takes write permission: without the owner's read and
            # write, the node's own user (the front door, `status`, its clients) could not connect.
            raise ConfigError(f"[dispatcher] ipc_mode {d.ipc_mode!r} must give the owner read and write (0600 at "
                              "least): the node's own processes and clients connect as its user")
        for key in ("frontend", "backend"):
            _check_address(f"[dispatcher] {key}", getattr(d, key))
        if d.backend.startswith("tcp://") and not d.curve_secret_key:
            # Without CURVE anyone who reached the port registered as a worker, was handed clients'
            # tensors and answered for the model (docs/protocol.md, "Trust model").
            raise ConfigError(f"[dispatcher] backend {d.backend!r} is tcp without curve_secret_key: any peer that "
                              "reaches it could register as a worker, read clients' tensors and answer for the "
                              "model; name a key (`batchyard keygen`), or use ipc:// for workers on this host")
        # Things on the host the dispatcher needs at start: named here, not by its traceback.
        for key in ("profile", "curve_secret_key"):
            path = getattr(d, key)
            if path and not os.path.isfile(path):
                raise ConfigError(f"[dispatcher] {key}: no file {path!r}")
        if d.profile:
            from .cost_model import load_profile

            try:
                curves = load_profile(d.profile, {m.name for m in self.models})
            except ValueError as e:
                raise ConfigError(f"[dispatcher] profile: {e}") from None
            for model in sorted({m for m, _ in curves}):
                # One item slower than the default timeout on every path: every request without
                # a timeout of its own was refused on arrival, for good (a profile in ms, read as s).
                fastest = min(c.predict(1) for (m, _), c in curves.items() if m == model)
                if fastest >= d.default_timeout_s:
                    raise ConfigError(f"[dispatcher] profile: profile {d.profile}: models.{model}: one item takes "
                                      f"{fastest:g} s on its fastest path, past default_timeout_s "
                                      f"({d.default_timeout_s:g} s): are its times in seconds?")
        if d.curve_authorized_keys not in ("", "*") and not os.path.isdir(d.curve_authorized_keys):
            raise ConfigError(f"[dispatcher] curve_authorized_keys: no folder {d.curve_authorized_keys!r} "
                              f"(or \"*\" for any client key)")
        _check_curve_keys(d)
        if d.ipc_group:
            import grp

            try:
                grp.getgrnam(d.ipc_group)
            except KeyError:
                raise ConfigError(f"[dispatcher] ipc_group: no group {d.ipc_group!r} on this host") from None
        if d.breaker_backoff_max_s < d.breaker_backoff_s:
            raise ConfigError(f"[dispatcher] breaker_backoff_max_s ({d.breaker_backoff_max_s}) must not be below "
                              f"breaker_backoff_s ({d.breaker_backoff_s})")
        if d.worker_dead_after_s < 2 * d.heartbeat_interval_s:  # one late heartbeat took a worker out
            raise ConfigError(f"[dispatcher] worker_dead_after_s ({d.worker_dead_after_s}) must be at least twice "
                              f"heartbeat_interval_s ({d.heartbeat_interval_s})")
        from .policy import make_policy  # late: only validation needs the policy module

        try:
            make_policy(d.policy)
        except ValueError as e:
            raise ConfigError(f"[dispatcher] policy: {e}") from None
        if not self.models and not self.llm_models:
            raise ConfigError("no [[models]] and no [[llm_models]]: a node serves at least one model")
        _check_unique("models", [m.name for m in self.models])
        _check_unique("llm_models", [m.name for m in self.llm_models])
        both = {m.name for m in self.models} & {m.name for m in self.llm_models}
        if both:
            raise ConfigError(f"[[llm_models]] {sorted(both)[0]!r} is also a [[models]] name; names must differ")
        for i, m in enumerate(self.models):
            try:
                validate_spec(m.spec())
            except (ValueError, msgspec.ValidationError) as e:
                raise ConfigError(f"{_item('models', i, m.name)}: {e}") from None
        _check_unique("workers", [w.name for w in self.workers])
        for i, w in enumerate(self.workers):
            self._check_worker(_item("workers", i, w.name), w)
        f = self.frontend
        if f is not None and (f.grpc_port == f.http_port or not (f.grpc_port or f.http_port)):
            raise ConfigError(f"[frontend] grpc_port ({f.grpc_port}) and http_port ({f.http_port}) must differ, "
                              f"and at least one be set")
        if f is not None and f.trace_file:
            if not os.path.isabs(f.trace_file):
                # A front door started by systemd runs in /: a relative name wrote traces there.
                raise ConfigError(f"[frontend] trace_file {f.trace_file!r} must be an absolute path")
        if f is not None and f.trace_level != "OFF" and not (f.trace_file and f.trace_rate):
            raise ConfigError(f"[frontend] trace_level {f.trace_level!r} needs a trace_file and a trace_rate "
                              "above 0 (as tritonserver refuses a trace level without a file)")
        if f is not None:
            _check_restricted_apis(f.restricted_apis)
            _check_grpc_tls(f)
        _check_ports_apart(self._tcp_ports())
        self._check_triton_urls()
        return self

    def unserved_models(self) -> list[str]:
        """The [[models]] and [[llm_models]] no worker of the config lists. Allowed (a config for
        the dispatcher alone, a model whose worker is still to be added), but said at start: no
        worker outside the config can serve it, and its requests wait out their timeout."""
        listed = {m for w in self.workers for m in w.models}
        return [m.name for m in (*self.models, *self.llm_models) if m.name not in listed]

    def _check_triton_urls(self) -> None:
        """A Triton worker's url: HOST:PORT with a port of 1-65535 (gRPC wraps a larger one:
        8001 + 65536 reached port 8001), and not one of the node's own ports (both default to
        8001: the front door's gRPC port and Triton's), in any spelling of this host: such a
        worker talked to the node itself, never registered, and its requests timed out."""
        ours = self._tcp_ports()
        for i, w in enumerate(self.workers):
            if w.kind != "triton":
                continue
            where = f"{_item('workers', i, w.name)}: triton.url {w.triton.url!r}"
            # gRPC's own target syntax for a name, dns:///HOST:PORT, is what tritonclient passes on
            url = w.triton.url
            parsed = host_port(url[len("dns:///"):] if url.startswith("dns:///") else url)
            if parsed is None:
                scheme = (" (no URL scheme: write HOST:PORT, or gRPC's dns:///HOST:PORT)" if "://" in url or
                          url.startswith(("ipv4:", "ipv6:", "unix:")) else "")
                raise ConfigError(f"{where} is not HOST:PORT with a port of 1-65535{scheme}")
            host, port = parsed
            for key, listen_host, listen_port in ours:
                if port == listen_port and _is_this_host(host) and (
                        _listen_address(listen_host) == "*" or _same_host(host, listen_host)):
                    raise ConfigError(f"{where} is this node's own {key}; point it at the Triton server")

    def _tcp_ports(self) -> list[tuple[str, str, int]]:
        """(key, host, port) of every TCP port the node listens on."""
        d, f = self.dispatcher, self.frontend
        ports = []
        for key in ("frontend", "backend"):
            scheme, _, rest = getattr(d, key).partition("://")
            host, _, port = rest.rpartition(":")
            if scheme == "tcp" and port.isdigit() and int(port):
                ports.append((f"[dispatcher] {key}", host, int(port)))
        if d.metrics_port:
            ports.append(("[dispatcher] metrics_port", d.metrics_host, d.metrics_port))
        if f is not None:
            ports += [(f"[frontend] {key}", f.host, getattr(f, key)) for key in ("grpc_port", "http_port")
                      if getattr(f, key)]
        return ports

    def check_host(self, workers: tuple[str, ...] | None = None, control: bool = False,
                   binds: bool = True) -> "NodeConfig":
        """Check what the named workers (all: None) need of this host: their cpus online, their
        numa_node present, the packages of the model factories they build (found, not imported);
        with ``control`` (or all workers) also the dispatcher's and the front door's cpus and the
        hosts they listen on, and, with ``binds`` too (not the front door alone, which binds none
        of them), that the dispatcher's endpoints can be bound. Not part
        of ``validate``: a config may be written and checked on another host than the one it runs
        on. The processes that start workers call it, so a worker pinned to a cpu the host lacks is
        one line at start, not a restart loop."""
        unknown = sorted(set(workers or ()) - {w.name for w in self.workers})
        if unknown:  # `batchyard worker --name` (a traceback and exit 1, restarted by systemd for ever)
            raise ConfigError(f"no [[workers]] entry named {unknown[0]!r}; have {[w.name for w in self.workers]}")
        online = _online_cpus()
        nodes = _numa_nodes()

        def check_online(where: str, cpus: tuple[int, ...]) -> None:
            missing = sorted(set(cpus) - online) if online else []
            if missing:
                raise ConfigError(f"{where}cpus: cpu {missing[0]} is not online on this host "
                                  f"(online: {_ranges(online)})")

        if control or workers is None:
            check_online("[dispatcher] ", self.dispatcher.cpus)
            if self.frontend is not None:
                check_online("[frontend] ", self.frontend.cpus)
                for m in self.llm_models:
                    _check_generation_defaults(m)
                    _check_chat_template(m)
        for i, w in enumerate(self.workers):
            if workers is not None and w.name not in workers:
                continue
            check_online(f"{_item('workers', i, w.name)}: ", w.cpus)
            if w.vllm is not None:
                self._check_vllm_host(_item('workers', i, w.name), w)
            if w.numa_node is not None and nodes and w.numa_node not in nodes:
                raise ConfigError(f"{_item('workers', i, w.name)}: numa_node: node {w.numa_node} does not exist "
                                  f"on this host (nodes: {_ranges(nodes)})")
            if w.kind in _BUILDS_MODEL:
                for m in w.models:
                    _check_factory_package(self.model(m))
        if control:  # not for calibrate (workers=None): it binds its own endpoints
            d = self.dispatcher
            listeners = []
            if binds:
                # The front door's process binds none of them, and its unit may not write their
                # folder (ProtectSystem=strict, no RuntimeDirectory): probed there, it exited 78.
                for key in ("frontend", "backend"):  # the folders the dispatcher binds its ipc files in
                    _check_ipc_folder(f"[dispatcher] {key}", getattr(d, key))
                    _check_tcp_bindable(f"[dispatcher] {key}", getattr(d, key))
                if d.metrics_port:
                    listeners.append(("[dispatcher] metrics_host", d.metrics_host))
            if self.frontend is not None:
                listeners.append(("[frontend] host", self.frontend.host))
            for key, host in listeners:
                _check_listen_host(key, host)
        return self

    def _check_worker(self, where: str, w: WorkerConfig) -> None:
        # Keys and tables of one kind set on another, taken and ignored: precision = "fp32" on a
        # cuda worker ran it in bf16 (its precision is cuda.precision); a vllm worker's sim or
        # triton table. Here, those not at their defaults (a config built in code); parse_config
        # also refuses one written at its default (max_inflight = 1 on a triton worker).
        for key, kinds, _ in KIND_KEYS:
            if w.kind not in kinds and getattr(w, key) != getattr(_WORKER_DEFAULTS, key):
                raise ConfigError(_another_kinds_key(where, key, w.kind))
        if w.kind == "cuda" and w.cuda.onnx:
            raise ConfigError(f"{where}: cuda.onnx is set but kind is 'cuda'; it is for kind \"tensorrt\"")
        if w.kind == "tensorrt":
            self._check_tensorrt_cuda(where, w.cuda)
        if len(set(w.models)) != len(w.models):
            twice = next(m for m in w.models if w.models.count(m) > 1)
            raise ConfigError(f"{where}: models: {twice!r} is listed twice")
        if w.kind == "vllm":
            self._check_vllm_worker(where, w)
            return
        if w.vllm is not None:
            raise ConfigError(f"{where}: vllm is set but kind is {w.kind!r}; it is for kind \"vllm\"")
        names = [m.name for m in self.models]
        if not w.models:
            raise ConfigError(f"{where}: models is empty; name at least one of {names}")
        for m in w.models:
            if m not in names:
                raise ConfigError(f"{where}: models: {m!r} is not a [[models]] name{_did_you_mean(m, names)}")
        served = list(w.models)
        for m in w.models:  # each model is warmed at every size: none may be past its max batch
            too_big = [b for b in w.warmup_sizes if b > self.model(m).max_batch]
            if too_big:
                raise ConfigError(f"{where}: warmup_sizes: {too_big[0]} is above model {m!r}'s max_batch "
                                  f"({self.model(m).max_batch})")
        if w.kind in _BUILDS_MODEL:
            for m in w.models:
                if not self.model(m).factory:
                    raise ConfigError(f"{where}: kind {w.kind!r} builds model {m!r} itself, so that model "
                                      f"needs factory = \"module:function\" in [[models]]")
        if w.kind == "triton":
            _check_keys(where, "triton.models", w.triton.models, served)
            _check_keys(where, "triton.tensor_names", w.triton.tensor_names, served)
            for m, renames in w.triton.tensor_names.items():
                spec = self.model(m)
                tensors = [t.name for t in spec.inputs + spec.outputs]
                _check_keys(where, f"triton.tensor_names.{m}", renames, tensors, what="tensors of the model")
                for kind, ts in (("inputs", spec.inputs), ("outputs", spec.outputs)):
                    # Two of them on one Triton tensor: every batch failed at Triton ("input 'x'
                    # already exists in request"), the worker restarted for ever.
                    named: dict[str, str] = {}
                    for t in ts:
                        theirs = renames.get(t.name, t.name)
                        if theirs in named:
                            raise ConfigError(f"{where}: triton.tensor_names.{m}: {kind} {named[theirs]!r} and "
                                              f"{t.name!r} both name Triton's {theirs!r}")
                        named[theirs] = t.name
        if w.kind == "tensorrt":
            _check_keys(where, "cuda.onnx", w.cuda.onnx, served)
            for m in w.models:
                if m not in w.cuda.onnx:
                    raise ConfigError(f"{where}: cuda.onnx has no ONNX file for model {m!r}; a tensorrt "
                                      f"worker builds its engine from one")


    @staticmethod
    def _check_tensorrt_cuda(where: str, cuda: CudaConfig) -> None:
        """What a TensorRT engine cannot honour (workers/cuda_executors.py builds fp16 or fp32
        engines, fp16 unless told, and captures no CUDA graphs): precision "bf16" built an fp16
        engine, and graphs = false was taken and ignored."""
        default = CudaConfig()
        if cuda.precision_for("tensorrt") not in TENSORRT_PRECISIONS:
            raise ConfigError(f"{where}: cuda.precision {cuda.precision!r}: a tensorrt worker builds "
                              + " or ".join(TENSORRT_PRECISIONS) + " engines; set cuda.precision = "
                              + " or ".join(f'"{p}"' for p in TENSORRT_PRECISIONS) + " (fp16 when not set)")
        if cuda.graphs != default.graphs:
            raise ConfigError(f"{where}: cuda.graphs is set but kind is 'tensorrt'; it is for kind \"cuda\"")

    def _check_vllm_host(self, where: str, w: WorkerConfig) -> None:
        """Its interpreter and its model's folder exist (a missing one was Popen's traceback in `up`)."""
        python = w.vllm.python
        if python and not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ConfigError(f"{where}: vllm.python: {python!r} is not an executable file")
        for m in self.llm_models:
            if m.name not in w.models:
                continue
            if not os.path.isdir(m.path):
                raise ConfigError(f"[[llm_models]] {m.name!r}: path: no folder {m.path!r}")
            _check_generation_defaults(m)

    def _check_vllm_worker(self, where: str, w: WorkerConfig) -> None:
        names = [m.name for m in self.llm_models]
        if w.vllm is None:
            raise ConfigError(f"{where}: kind \"vllm\" needs a vllm table (role = \"prefill-cpu\" or \"gpu\")")
        if len(w.models) != 1:
            raise ConfigError(f"{where}: models: a vllm worker serves exactly one of [[llm_models]] {names}")
        if w.models[0] not in names:
            raise ConfigError(f"{where}: models: {w.models[0]!r} is not an [[llm_models]] name"
                              f"{_did_you_mean(w.models[0], names)}")


UNIX_PATH_MAX = 107  # bytes of a unix socket's path (sun_path, less its terminating NUL)


def _check_generation_defaults(m: LlmModelConfig) -> None:
    """The sampling defaults of the model's folder, which its front door applies: one past
    vLLM's bounds would make it refuse every request that left that field out."""
    if m.generation_config == "auto" and os.path.isdir(m.path):
        try:
            generation_defaults(m.path)
        except ValueError as e:
            raise ConfigError(f"[[llm_models]] {m.name!r}: path: {os.path.join(m.path, str(e))} (or set "
                              'generation_config = "vllm": vLLM\'s own defaults)') from None


def _check_chat_template(m: LlmModelConfig) -> None:
    """The model folder's chat template, which the front door's chat route renders, compiles."""
    from .chat_template import ChatTemplate, ChatTemplateError

    try:
        ChatTemplate.load(m.path)
    except ChatTemplateError as e:
        raise ConfigError(f"[[llm_models]] {m.name!r}: path: {m.path}: {e}") from None


def _check_address(key: str, address: str) -> None:
    """tcp://HOST:PORT with a port of 1-65535, or ipc://PATH short enough for a unix socket.
    Unchecked, port 70000 was bound as 4464 (70000 mod 65536), and "tcp://127.0.0.1" or a path
    past 107 bytes stopped the node at start with a ZeroMQ error that named no key. The same
    address is bound by the dispatcher and connected to by workers and clients, so neither a
    wildcard host nor port (* or 0: any port) can be connected to: a worker never registered."""
    scheme, _, rest = address.partition("://")
    if scheme == "tcp":
        parsed = host_port(rest)
        if parsed is None or parsed[0] == "*":
            raise ConfigError(f"{key}: {address!r} is not tcp://HOST:PORT with a host to connect to and a port "
                              "of 1-65535")
    elif rest.startswith("@"):
        # Linux's abstract namespace: no file, so no permissions. Any local user connected, took
        # a restarting worker's name on the backend (its own connection was then dropped, and it
        # never registered again) or was served on a frontend set to ipc_mode 0600.
        raise ConfigError(f"{key}: {address!r} is an abstract unix socket, which has no file and so no permissions: "
                          "any local user could connect; give it a path (its folder's and the socket's modes "
                          "decide who may)")
    elif not rest.startswith("/"):
        # A process started by systemd runs in /: a relative path named another socket for each
        # process started elsewhere (a status or a worker run by hand waited for an answer for ever).
        raise ConfigError(f"{key}: the ipc path of {address!r} must be absolute (ipc:///run/batchyard/fe): each "
                          "process would find a relative one from its own working folder")
    elif len(rest.encode()) > UNIX_PATH_MAX:
        raise ConfigError(f"{key}: the ipc path of {address!r} is {len(rest.encode())} bytes; a unix socket's "
                          f"path has at most {UNIX_PATH_MAX}")


def _check_ipc_folder(key: str, address: str) -> None:
    scheme, _, path = address.partition("://")
    if scheme == "ipc" and not path.startswith("@"):
        folder = os.path.dirname(path) or "."
        if not os.path.isdir(folder):
            raise ConfigError(f"{key}: no folder {folder!r} for the socket {address!r}")
        try:
            # What binding the socket does to the folder, by this process's user: a folder it may
            # not write (or one no file is made in, such as /sys) stopped the dispatcher at start
            # with ZeroMQ's traceback, exit 1, which systemd restarts for ever.
            os.rmdir(tempfile.mkdtemp(prefix=".batchyard-probe-", dir=folder))
        except OSError as e:
            raise ConfigError(f"{key}: cannot make the socket {address!r} in {folder!r} as uid {os.geteuid()}: "
                              f"{e.strerror or e}") from None
        if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
            # Bound over, it was deleted: a typo naming the config file removed the config.
            raise ConfigError(f"{key}: {path!r} exists and is not a socket; a socket cannot be bound there")


def _check_curve_keys(d: "DispatcherConfig") -> None:
    """The key files hold keys: a public key given as the secret one, or a stray file among the
    authorized keys, stopped the dispatcher at start with pyzmq's traceback (exit 1, restarted
    for ever)."""
    if not d.curve_secret_key:
        return
    import zmq.auth
    from zmq.utils import z85

    from .transport import read_keypair

    try:
        for key in read_keypair(d.curve_secret_key):
            if len(z85.decode(key)) != 32:  # a truncated key file: ZeroMQ refused it at start
                raise ValueError(f"{d.curve_secret_key}: a key is not 32 bytes")
    except (ValueError, OSError) as e:
        raise ConfigError(f"[dispatcher] curve_secret_key: {e}") from None
    if d.curve_authorized_keys not in ("", "*"):
        try:
            zmq.auth.load_certificates(d.curve_authorized_keys)
        except (ValueError, OSError) as e:
            raise ConfigError(f"[dispatcher] curve_authorized_keys: {d.curve_authorized_keys!r}: {e}") from None


def _check_tcp_bindable(key: str, address: str) -> None:
    """A tcp endpoint's host is one of this host's addresses (a typo, or another machine's
    address, stopped the dispatcher at start with ZeroMQ's traceback, exit 1: restarted for
    ever). IPv6 hosts are refused: the node's sockets speak IPv4 (ZeroMQ's default)."""
    import socket

    scheme, _, rest = address.partition("://")
    if scheme != "tcp":
        return
    host = rest.rpartition(":")[0]
    if host.startswith("[") or ":" in host:
        raise ConfigError(f"{key}: {address!r}: IPv6 hosts are not supported; use an IPv4 address or a name")
    try:
        _bind_any_port(host, socket.AF_INET)
    except (OSError, UnicodeError) as e:
        raise ConfigError(f"{key}: cannot listen on {host!r} ({address!r}): {e}") from None


def _bind_any_port(host: str, family: int = 0) -> None:
    """Bind a socket to ``host``'s first address on any port, and close it: whether the host is
    one of this machine's (OSError, socket.gaierror among them, or UnicodeError if not)."""
    import socket

    fam, _, _, _, addr = socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)[0]
    with socket.socket(fam, socket.SOCK_STREAM) as probe:
        probe.bind((addr[0], 0, *addr[2:]))


def _check_listen_host(key: str, host: str) -> None:
    """A host to listen on: a wildcard, an address, or a name this host resolves (a typo such as
    "localhsot" stopped the process at start with socket.gaierror), of this machine (another
    machine's passed, and the front door or the metrics server failed to bind at start, exit 1,
    restarted for ever)."""
    import socket

    if host in ("", "*"):
        return
    try:
        _bind_any_port(host.strip("[]"))
    except socket.gaierror as e:
        if e.errno == socket.EAI_AGAIN:
            # The resolver failed for now: no fault of the config's. Refused here, a front door
            # restarted during a DNS hiccup exited 78 and stopped its node for good; its bind
            # fails instead (exit 1), and it is started again.
            return
        raise ConfigError(f"{key}: cannot listen on {host!r}: {e}") from None
    except (OSError, UnicodeError) as e:
        raise ConfigError(f"{key}: cannot listen on {host!r}: {e.strerror if isinstance(e, OSError) else e}") from None


def _check_ports_apart(ports: list[tuple[str, str, int]]) -> None:
    """Two listeners on one port: the second process failed to bind at start, after the first
    had started (the metrics port on the front door's HTTP port stopped the node half-way up)."""
    for i, (key_a, host_a, port_a) in enumerate(ports):
        for key_b, host_b, port_b in ports[:i]:
            if port_a == port_b and _same_host(host_a, host_b):
                raise ConfigError(f"{key_a} and {key_b} both use port {port_a}; give each its own")


def _same_host(a: str, b: str) -> bool:
    """Whether two listen hosts take one port: the same address in any spelling ("vm" resolving
    to 127.0.0.1 passed beside "127.0.0.1", and the second listener failed at start), or a
    wildcard beside anything."""
    a, b = _listen_address(a), _listen_address(b)
    return a == b or "*" in (a, b)


def _listen_address(host: str) -> str:
    """The IPv4 address a listener on ``host`` binds, "*" for a wildcard; a name that does not
    resolve stays as written (the processes that bind it refuse it, `check_host`). Called only
    for hosts that share a port, and for a Triton url's host on one of the node's ports
    (``_is_this_host``: the one lookup a valid config may cost, of a host its worker looks up
    anyway); a name is looked up as the listener itself will (/etc/hosts, then DNS)."""
    import ipaddress
    import socket

    host = host.strip("[]")
    if host in ("", "*", "0.0.0.0", "::"):
        return "*"
    if host in ("localhost", "::1"):  # loopback in either family: one port as far as a person means it
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))  # an address: no lookup
    except ValueError:
        pass
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError, IndexError):
        return host
    return "*" if address == "0.0.0.0" else address


def _is_this_host(host: str) -> bool:
    """Whether ``host`` is an address of this machine (a socket can be bound to it), a wildcard
    or loopback included; a name that does not resolve is not."""
    import ipaddress
    import socket

    address = _listen_address(host)
    if address == "*":
        return True
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def _online_cpus() -> set[int]:
    """The host's online cpus (empty when it cannot say)."""
    try:
        text = Path("/sys/devices/system/cpu/online").read_text()
    except OSError:
        return set(range(os.cpu_count() or 0))
    return _parse_ranges(text)


def _numa_nodes() -> set[int]:
    """The host's NUMA nodes (empty when the kernel does not say: no check then)."""
    try:
        return _parse_ranges(Path("/sys/devices/system/node/online").read_text())
    except OSError:
        return set()


def _parse_ranges(text: str) -> set[int]:
    """The kernel's list form: "0-3,8,10-11"."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _ranges(values: set[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    out = []
    for _, run in itertools.groupby(enumerate(sorted(values)), lambda p: p[1] - p[0]):  # consecutive values
        first, *rest = [v for _, v in run]
        out.append(f"{first}-{rest[-1]}" if rest else str(first))
    return ",".join(out)


# Worker keys (and tables) for some kinds only: (key, its kinds, what each other kind takes instead).
# Tables first: on every kind, one for another kind is named before its keys.
KIND_KEYS = (("sim", ("sim",), {}), ("triton", ("triton",), {}), ("cuda", ("cuda", "tensorrt"), {}),
             ("precision", ("amx",), {"cuda": "cuda.precision", "tensorrt": "cuda.precision"}),
             ("threads", ("amx", "vllm"), {}),
             # sim starts serving at once; vllm measures vllm.calibrate_tokens
             ("warmup_sizes", ("amx", "triton", "cuda", "tensorrt"), {}),
             ("max_inflight", ("amx", "sim", "cuda", "tensorrt"),
              {"triton": "triton.inflight", "vllm": "vllm.max_num_seqs"}))
_WORKER_DEFAULTS = WorkerConfig(name="defaults", kind="sim", models=())


def _another_kinds_key(where: str, key: str, kind: str) -> str:
    kinds, instead = next((k, i) for name, k, i in KIND_KEYS if name == key)
    hint = f"; kind {kind!r} takes {instead[kind]}" if kind in instead else ""
    return f"{where}: {key} is set but kind is {kind!r}; it is for kind " + " or ".join(f'"{k}"' for k in kinds) + hint


def _keys_of_another_kind(data: dict) -> None:
    """A worker key for other kinds, written, is refused even at its default: compared with the
    default, ``max_inflight = 1`` on a triton worker (whose limit is triton.inflight, 2) and
    ``threads = 1`` on a sim one were taken and ignored."""
    workers = data.get("workers")
    for i, w in enumerate(workers if isinstance(workers, list) else ()):
        if not isinstance(w, dict) or not isinstance(w.get("kind"), str):
            continue
        for key, kinds, _ in KIND_KEYS:
            if key in w and w["kind"] not in kinds:
                raise ConfigError(_another_kinds_key(_item("workers", i, w.get("name")), key, w["kind"]))


def _check_factory_package(model: ModelConfig) -> None:
    """The package of a model's factory can be found, without importing it (`up` would import
    torch): a misspelt one made the worker's start fail, a line that named no file among
    `up`'s seven. Its working folder counts, as for the worker (`python -m`, started there)."""
    import importlib.machinery
    import importlib.util

    top = model.factory.partition(":")[0].partition(".")[0]
    if top and importlib.util.find_spec(top) is None and \
            importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is None:
        raise ConfigError(f"[[models]] {model.name!r}: factory {model.factory!r}: no module named {top!r} "
                          "for this Python")


def _item(table: str, i: int, name: str | None) -> str:
    """`[[workers]] #2 (name 'amx1')`: position as a person counts it, plus the name if any."""
    return f"[[{table}]] #{i + 1}" + (f" (name {name!r})" if isinstance(name, str) else "")


def _did_you_mean(word: str, candidates, shown=repr) -> str:
    by_lower = {str(c).lower(): str(c) for c in candidates}  # case slips count as close too
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1)
    return f" (did you mean {shown(by_lower[close[0]])}?)" if close else ""


def _check_grpc_tls(f: "FrontendConfig") -> None:
    """The TLS keys' rules that span them; the files themselves are read at the front door's
    start (a host that runs only the node's workers, or `status`, need not hold them)."""
    for key in ("grpc_tls_cert", "grpc_tls_key", "grpc_tls_client_ca"):
        path = getattr(f, key)
        if path and not os.path.isabs(path):  # (a front door started by systemd runs in /)
            raise ConfigError(f"[frontend] {key} {path!r} must be an absolute path")
    if bool(f.grpc_tls_cert) != bool(f.grpc_tls_key):
        raise ConfigError("[frontend] grpc_tls_cert and grpc_tls_key go together: set both (TLS) or neither")
    if f.grpc_tls_client_ca and not f.grpc_tls_cert:
        raise ConfigError("[frontend] grpc_tls_client_ca needs grpc_tls_cert and grpc_tls_key: clients are "
                          "asked for a certificate only over TLS")
    if f.grpc_tls_cert and not f.grpc_port:
        raise ConfigError("[frontend] grpc_tls_cert is set but grpc_port is 0 (gRPC off)")


_HEADER_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # gRPC's metadata key (in any case: HTTP's are), within HTTP's token
_HEADER_VALUE = re.compile(r"[!-~]([ -~]*[!-~])?")  # visible ASCII, spaces inside only


def _check_restricted_apis(rules: tuple[RestrictedApisConfig, ...]) -> None:
    """Each API restricted by one table at most on each protocol (tritonserver refuses an API in
    two groups too): with two headers, which one opens it?"""
    first: dict[tuple[str, str], int] = {}
    for i, rule in enumerate(rules):
        where = f"[frontend] restricted_apis[{i}]"
        for key in ("apis", "protocols"):
            if not getattr(rule, key):
                raise ConfigError(f"{where}: {key} is empty: the table restricts nothing")
        if any(c in rule.header for c in "=:"):  # tritonserver's <header>=<value>, in one key
            raise ConfigError(f"{where}: header holds '=' or ':': name the header alone, and its value in "
                              "value (the header is not shown here: it may hold the value)")
        if not _HEADER_NAME.fullmatch(rule.header) or rule.header.lower().endswith("-bin"):
            raise ConfigError(f"{where}: header {rule.header!r} is no name both HTTP and gRPC carry as text "
                              "(letters, digits, '-', '_' and '.'; not ending '-bin', gRPC's binary headers)")
        if not _HEADER_VALUE.fullmatch(rule.value):
            what = "printable ASCII, spaces only inside" if rule.value else "set"
            raise ConfigError(f"{where}: value must be {what} (what HTTP and gRPC both carry unchanged; "
                              "the value is not shown here)")
        for protocol in rule.protocols:
            for api in rule.apis:
                j = first.setdefault((protocol, api), i)
                if j != i:
                    raise ConfigError(f"{where}: apis: {api!r} is restricted over {protocol} by "
                                      f"restricted_apis[{j}] already; an API has one header")


def _check_unique(table: str, names: list[str]) -> None:
    for i, n in enumerate(names):
        if n in names[:i]:
            raise ConfigError(f"{_item(table, i, n)}: name {n!r} is already used by "
                              f"{_item(table, names.index(n), n)}")


def _check_keys(where: str, key: str, mapping: dict, allowed: list[str], what: str = "models it serves") -> None:
    for k in mapping:
        if k not in allowed:
            raise ConfigError(f"{where}: {key}: {k!r} is not one of the {what} {allowed}"
                              f"{_did_you_mean(k, allowed)}")


# ------------------------------------------------------------------ decoding errors, explained
_ERROR = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.(\w+)|\[(\d+|\.\.\.)\]")


def _explain(err: msgspec.ValidationError, data: dict) -> str:
    """Turn msgspec's "Object contains unknown field `x` - at `$.workers[1]`" into
    "[[workers]] #2 (name 'amx1') unknown key 'x' (did you mean ...?)"."""
    m = _ERROR.match(str(err))
    msg, steps = m["msg"], _keys_named([a or b for a, b in _STEP.findall(m["path"] or "")], data)
    # Split the path into the table a person would look for and the key inside it.
    if steps[:1] in (["models"], ["workers"], ["llm_models"]) and len(steps) > 1 and steps[1].isdigit():
        item = _value_at(data, steps[:2])
        where, inner = _item(steps[0], int(steps[1]), item.get("name") if isinstance(item, dict) else None), steps[2:]
    elif steps[:1] in (["dispatcher"], ["frontend"]):
        where, inner = f"[{steps[0]}]", steps[1:]
    else:
        where, inner = "", steps
    if unknown := re.fullmatch(r"Object contains unknown field `(.+)`", msg):
        field = unknown[1]
        typ = _type_at(steps)
        known = [f.name for f in typ.fields] if isinstance(typ, mi.StructType) else []
        if not steps:  # top level: these are tables
            header = _header(field, data.get(field))
            kind = "table" if header.startswith("[") else "key"
            if field in {f.name for f in mi.type_info(WorkerConfig).fields
                         if isinstance(_optional_removed(f.type), mi.StructType)}:
                return f"unknown table [{field}]: a worker's is written [workers.{field}] after its [[workers]]"
            return f"unknown {kind} {header}" + _did_you_mean(field, known, shown=_header)
        prefix = _dotted(inner) + "." if inner else ""
        hint = _did_you_mean(field, known, shown=lambda k: repr(prefix + k))
        return f"{where} unknown key {prefix + field!r}{hint}"
    if missing := re.fullmatch(r"Object missing required field `(.+)`", msg):
        if not steps:
            return f"missing table {_header(missing[1])}"
        return f"{where} missing required key {_dotted(inner + [missing[1]])!r}"
    value, typ = _value_at(data, steps), _type_at(steps)
    if len(steps) == 1 and steps[0] in ("models", "workers", "llm_models") and isinstance(value, dict):
        return f"[{steps[0]}] must be an array of tables: write [[{steps[0]}]] for each"
    text = msg.replace("`", "").replace("Invalid enum value", "Invalid value")
    text = re.sub(r"\bobject( \| null)?", "table", text[0].lower() + text[1:])  # TOML's word for it
    if ", got" not in text and value is not None and repr(value) not in text:
        text += f", got {value!r}"
    if isinstance(typ, mi.LiteralType) and isinstance(value, str):
        text += _did_you_mean(value, typ.values) or f" (one of {list(typ.values)})"
    if not inner:  # the table itself: "[dispatcher]: expected table, got int"
        return f"{where or _dotted(steps)}: {text}"
    # "[dispatcher] max_queue: ..." but "[[workers]] #2 (name 'amx1'): cpus[0]: ..."
    sep = ": " if where.startswith("[[") else " "
    return f"{where + sep if where else ''}{_dotted(inner)}: {text}"


class _Key(str):
    """A key of a dict (triton.models, cuda.onnx) in an error's path, not a field or an index."""


def _keys_named(steps: list[str], data) -> list[str]:
    """The path with each dict key msgspec writes as `[...]` named: the first key whose value
    does not decode as the dict's values (msgspec decodes in order and stops there). Unnamed,
    "triton.tensor_names[...]: expected object" did not say which model's entry was wrong."""
    out, typ = [], NodeConfig
    for s in steps:
        if s == "..." and isinstance(data, dict):
            value_type = _field_type(typ, s)
            s = next((_Key(k) for k, v in data.items() if not _decodes(v, value_type)), s)
        out.append(s)
        typ = _field_type(typ, s)
        data = _value_at(data, [s])
    return out


def _decodes(value, typ) -> bool:
    try:
        msgspec.convert(value, typ)
    except msgspec.ValidationError:
        return False
    return True


def _field_type(typ, step: str):
    """The Python type one step (a field name, an index or a key) below ``typ``; None past what
    a config holds."""
    while typing.get_origin(typ) is Annotated or _is_optional(typ):
        typ = typing.get_args(typ)[0]
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        return next((f.type for f in msgspec.structs.fields(typ) if f.encode_name == step), None)
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (tuple, list) and args:
        return args[0]
    if origin is dict:
        return args[1]
    return None


def _is_optional(typ) -> bool:
    """Optional[X], with X first (the only optional form the config uses)."""
    args = typing.get_args(typ)
    return typing.get_origin(typ) is typing.Union and len(args) == 2 and args[1] is type(None)


def _dotted(steps: list[str]) -> str:
    """["triton", "models"] -> "triton.models"; ["inputs", "1", "dtype"] -> "inputs[1].dtype";
    a dict key as TOML writes it: "triton.models.sum", or quoted where it is not a bare key."""
    def step(s: str) -> str:
        if isinstance(s, _Key):
            bare = re.fullmatch(r"[A-Za-z0-9_-]+", s) and not s.isdigit()  # digits alone read as an index
            return f".{s}" if bare else f"[{s!r}]"
        return f"[{s}]" if s.isdigit() or s == "..." else f".{s}"
    return "".join(step(s) for s in steps).lstrip(".")


def _header(name: str, value=None) -> str:
    """How a top-level entry is written: [dispatcher], [[workers]], or a bare key."""
    if value is None:
        value = [{}] if name in ("models", "workers", "llm_models") else {}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return f"[[{name}]]"
    return f"[{name}]" if isinstance(value, dict) else repr(name)


def _value_at(data, steps: list[str]):
    for s in steps:
        if isinstance(data, dict) and s in data:
            data = data[s]
        elif isinstance(data, list) and s.isdigit() and int(s) < len(data):
            data = data[int(s)]
        else:
            return None
    return data


def _type_at(steps: list[str]):
    """The msgspec type at a path, optional wrappers removed (an unknown key in [frontend] or
    [workers.vllm], both optional tables, got no suggestion)."""
    typ = _optional_removed(mi.type_info(NodeConfig))
    for s in steps:
        typ = _optional_removed(_step_type(typ, s))
    return typ


def _optional_removed(typ):
    if isinstance(typ, mi.UnionType):
        rest = [t for t in typ.types if not isinstance(t, mi.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return typ


def _step_type(typ, step: str):
    """The msgspec type one step (a field name or an index) below `typ`."""
    if isinstance(typ, mi.StructType):
        return next((f.type for f in typ.fields if f.name == step), None)
    if isinstance(typ, (mi.VarTupleType, mi.ListType)):
        return typ.item_type
    if isinstance(typ, mi.DictType):
        return typ.value_type
    return None


# ------------------------------------------------------------------ reading and writing TOML
def parse_config(data: dict, source: str = "config") -> NodeConfig:
    """Decode and validate a config from its TOML tables; errors start with `source`."""
    try:
        cfg = msgspec.convert(data, NodeConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {_explain(e, data)}") from None
    try:
        _keys_of_another_kind(data)
        return cfg.validate()
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _same_endpoint(a: str, b: str) -> bool:
    """Whether two addresses name one socket: "ipc://d//fe" is "ipc://d/fe" (the second bind
    replaced the first one's socket file, and clients' messages reached the workers' socket),
    and "tcp://vm:7755" is "tcp://127.0.0.1:7755" where vm resolves to 127.0.0.1."""
    scheme_a, _, rest_a = a.partition("://")
    scheme_b, _, rest_b = b.partition("://")
    if scheme_a != scheme_b:
        return False
    if scheme_a == "ipc":
        # realpath: a folder reached through a symlink is the same folder (frontend in d/real and
        # backend in d/link -> d/real passed, and the dispatcher failed to bind its second socket)
        return os.path.realpath(rest_a) == os.path.realpath(rest_b)
    host_a, _, port_a = rest_a.rpartition(":")
    host_b, _, port_b = rest_b.rpartition(":")
    same_port = int(port_a) == int(port_b) if port_a.isdigit() and port_b.isdigit() else port_a == port_b
    return same_port and _same_host(host_a, host_b)


# The first line of the copy of a config `up` hands its children (supervisor.run_up), so that
# their errors name the file the user wrote, not the copy in a private temp folder.
SNAPSHOT_HEADER = "# {path} as `batchyard up` (pid {pid}) validated it at start: its children run this copy\n"
_SNAPSHOT_HEADER = re.compile(r"# (/.*) as `batchyard up` \(pid \d+\) validated it at start: "
                              r"its children run this copy")


def config_source(path: str | Path, first_line: Optional[str] = None) -> str:
    """The config file ``path`` stands for: the one `up` validated where ``path`` is its copy,
    else ``path`` itself. ``first_line``: the file's, where the caller has read it."""
    if first_line is None:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                first_line = f.readline(4096)
        except OSError:
            return str(path)
    found = _SNAPSHOT_HEADER.fullmatch(first_line.rstrip("\n"))
    return found.group(1) if found else str(path)


def load_config(path: str | Path) -> NodeConfig:
    try:
        # A UTF-8 byte-order mark (some editors write one) is taken and dropped: tomllib refused
        # it as "Invalid statement (at line 1, column 1)", a message that did not name it.
        text = Path(path).read_bytes().decode("utf-8-sig")
        data = tomllib.loads(text)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from None
    except UnicodeDecodeError as e:  # TOML is UTF-8
        raise ConfigError(f"{path}: not UTF-8 (byte {e.start}: {e.object[e.start:e.start + 1]!r})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return parse_config(data, source=config_source(path, text.partition("\n")[0]))


def to_toml(cfg: NodeConfig) -> str:
    """The config as TOML (the demo and tests hand configs to child processes this way);
    fields at their defaults are left out, and `load_config` of the text gives `cfg` back."""
    return tomli_w.dumps(msgspec.to_builtins(cfg))
