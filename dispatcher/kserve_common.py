"""What the KServe v2 front door's gRPC and HTTP sides share: datatype names, Triton's error
codes, request parameters, model metadata, per-model statistics (the system shared-memory
registry is kserve_shm.py), and ``KServeCore``, which runs an inference through the front door's
Batchyard ``AsyncClient``.

Error codes and messages follow what Triton returns for the same case, so code written against
Triton (which often matches on the code, sometimes on the text) behaves the same here.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, Optional

import grpc
import numpy as np

from . import kserve_stats as S
from . import protocol as P
from .client_codec import dtype_name
from .errors import BatchyardError
from .kserve_stats import NodeStats
from .llm_routing import PREFILL_CPU

log = logging.getLogger("batchyard.frontend")

# KServe datatype <-> numpy dtype name. Model configs write the same names with a TYPE_ prefix.
KSERVE_TO_NP = {"BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
                "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
                "FP16": "float16", "FP32": "float32", "FP64": "float64"}
NP_TO_KSERVE = {v: k for k, v in KSERVE_TO_NP.items()}
_NP_DTYPES = {k: np.dtype(v) for k, v in KSERVE_TO_NP.items()}
PLATFORM = "batchyard"
SERVER_NAME = "batchyard"
# Triton's names (its core's server.cc) of the protocol extensions this front door serves: a
# KServe client may look here before it sends binary tensors or shared-memory references.
EXTENSIONS = ["classification", "model_repository", "model_configuration", "system_shared_memory", "cuda_shared_memory",
              "binary_tensor_data", "parameters", "statistics", "trace", "logging"]
VERSION = 1  # the one version of every model


# What a request still waiting on the node when the front door stops is answered (UNAVAILABLE).
STOPPING_MESSAGE = "the server is stopping: the request was not answered in time (it may still run)"


class KServeError(Exception):
    """An error as Triton reports it: a gRPC status code, an HTTP status and a message."""

    HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
            grpc.StatusCode.ALREADY_EXISTS: 400, grpc.StatusCode.CANCELLED: 400,
            grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.UNIMPLEMENTED: 501,
            grpc.StatusCode.DEADLINE_EXCEEDED: 408,  # an HTTP body that stalled (http_body)
            grpc.StatusCode.INTERNAL: 500}

    # A message is cut past this many characters: gRPC sends it in a trailer of at most 16 KiB,
    # percent-encoded (a character up to 12 bytes), and a message echoing a long name the client
    # chose (a region, key, input, datatype or version) reached the client as RESOURCE_EXHAUSTED
    # instead of the error.
    MAX_MESSAGE = 1000
    # Raised by the model's run (the dispatcher's answer, an LLM backend's refusal), not before the
    # request reached the model: Triton answers the first through its response callback, which
    # on a stream marks it final; a request it refuses before (an unknown model, a bad input) it
    # answers with the error alone (its stream handler's Process).
    ran = False

    def __init__(self, code: grpc.StatusCode, message: str, headers: dict | None = None):
        if len(message) > self.MAX_MESSAGE:
            message = message[:self.MAX_MESSAGE] + "..."
        super().__init__(message)
        self.code = code
        self.message = message
        self.headers = headers or {}  # an HTTP answer's own headers (Accept-Encoding for a 501)

    @property
    def http_status(self) -> int:
        return self.HTTP.get(self.code, 500)


def invalid(message: str) -> KServeError:
    return KServeError(grpc.StatusCode.INVALID_ARGUMENT, message)


# Triton refuses request parameters named so (its http_server.cc and grpc/infer_handler.cc),
# except the one its own stream clients send.
RESERVED_PREFIX = "triton_"


def check_parameter_names(names, allowed: tuple = ()) -> None:
    for k in names:
        if k.startswith(RESERVED_PREFIX) and k not in allowed:
            raise invalid(f"parameter keys starting with '{RESERVED_PREFIX}' are reserved for Triton usage "
                          f"and should not be specified ('{k}')")


def cuda_shm_refused(name: str) -> KServeError:
    """The CUDA shared-memory extension as a Triton built without GPUs serves it: registering is
    refused (INVALID_ARG, HTTP 400), unregistering succeeds (nothing is registered), the status
    lists nothing. perf_analyzer and tritonclient's ``unregister_*_shared_memory()`` call the
    CUDA half even for system shared memory; a missing endpoint failed their runs."""
    return invalid(f"failed to register CUDA shared memory region: '{name}', GPUs not supported")


def cuda_shm_status(name: str) -> list:
    if name:
        raise KServeError(grpc.StatusCode.NOT_FOUND, f"Unable to find cuda shared memory region: '{name}'")
    return []


def _shown(model: str) -> str:
    # A name past 200 characters is cut: echoed whole, a 10 KB one made gRPC's trailer too big
    # for the client (RESOURCE_EXHAUSTED instead of the error).
    return model if len(model) <= 200 else model[:200] + "..."


LLM_ROUTE = "an LLM model: POST /v1/completions"


def unknown_model(model: str, llm: bool = False) -> KServeError:
    """Triton 2.51 (nvidia-pytriton's tritonserver, asked the same): NOT_FOUND, HTTP 404, for an
    infer, metadata or config request naming a model it does not have. This answered
    INVALID_ARGUMENT / 400, the code of older Tritons. An LLM model of the node (``llm``) is none
    of the KServe routes': the words say where it is served."""
    where = f" ({LLM_ROUTE})" if llm else ""
    return KServeError(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{_shown(model)}' is not found{where}")


def stats_unavailable(model: str, version_given: bool) -> KServeError:
    """Triton's statistics of a model (or version) it does not have: INVALID_ARGUMENT, HTTP 400,
    in words of their own."""
    if version_given:
        return invalid(f"requested model version is not available for model '{_shown(model)}'")
    return invalid(f"requested model '{_shown(model)}' is not available")


def from_batchyard(err: BatchyardError, model: str, grpc_deadline: bool = False) -> KServeError:
    """Batchyard's status -> the code Triton gives the same case. Triton reports a request whose
    ``timeout`` parameter expired in its queue, and a full queue, as UNAVAILABLE (HTTP 503).
    Where the limit was the gRPC call's own deadline (``grpc_deadline``: sooner than any
    ``timeout`` parameter), Triton's client gets DEADLINE_EXCEEDED, as gRPC ends the call: answered
    UNAVAILABLE, retry policies and tritonclient users read it as a passing fault and sent the same
    call again at once, to be refused again."""
    st = err.status
    if st == P.Status.UNKNOWN_MODEL:
        return unknown_model(model)
    if st == P.Status.DEADLINE_EXCEEDED:
        if grpc_deadline:
            return KServeError(grpc.StatusCode.DEADLINE_EXCEEDED, f"Deadline Exceeded: {err.message}")
        return KServeError(grpc.StatusCode.UNAVAILABLE, f"Request timeout expired: {err.message}")
    if st == P.Status.OVERLOADED:
        return KServeError(grpc.StatusCode.UNAVAILABLE, f"Exceeds maximum queue size: {err.message}")
    code = {P.Status.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
            P.Status.PERMISSION_DENIED: grpc.StatusCode.INVALID_ARGUMENT,
            P.Status.CANCELLED: grpc.StatusCode.CANCELLED,
            P.Status.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE}.get(st, grpc.StatusCode.INTERNAL)
    return KServeError(code, err.message)


# What a field of the wrong type or value raises while a request is read (a string priority, a
# JSON list where an object belongs): the request's fault, INVALID_ARGUMENT / 400, on both sides.
# OverflowError: an offset of inf; RecursionError: JSON nested a thousand deep.
MALFORMED = (ValueError, TypeError, AttributeError, OverflowError, RecursionError)


def as_kserve(e: Exception, what: str = "inference request") -> KServeError:
    """A KServeError as it is; one of MALFORMED as Triton's INVALID_ARGUMENT with the reason
    (escaping, it became gRPC's UNKNOWN naming an internal exception, or an HTTP 500)."""
    return e if isinstance(e, KServeError) else invalid(f"malformed {what}: {type(e).__name__}: {e}")


def parse_version(version: str) -> int:
    """A model version string as Triton reads it (``GetModelVersionFromString``, with
    ``std::stol``): "" is the latest (-1); leading blanks and a leading integer count ("01" is
    1); no integer, one past a signed 64-bit integer, or a negative one, is INVALID_ARG."""
    if not version:
        return -1
    m = re.match(r"\s*([+-]?)0*(\d+)", version)
    # Digits counted before int() reads them: past 4300 of them, int() raised ValueError, which
    # the metadata, config, ready and statistics calls answered as an internal error.
    v = int(m[1] + m[2]) if m is not None and len(m[2]) <= 19 else None
    if v is None or not -(1 << 63) <= v < 1 << 63:
        raise invalid(f"failed to get model version from specified version string '{_shown(version)}' "
                      "(details: stol), version should be an integral value > 0")
    if v < 0:
        raise invalid(f"invalid model version specified '{version}' , version should be an integral value > 0")
    return v


def unknown_version(model: str, version: int) -> KServeError:
    # Triton's wording for a version it does not serve; Batchyard serves one, "1". The number
    # read, as Triton names it ("007" is version 7, "0x1" version 0): the string was echoed.
    return KServeError(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{model}' version {version} is not found")


def model_control_refused(model: str) -> KServeError:
    """Load and unload, as a Triton whose model control mode is NONE answers them: a Batchyard
    node's models are the ones its config gives its workers."""
    return KServeError(grpc.StatusCode.UNAVAILABLE,
                       f"explicit model load / unload is not allowed (asked for '{model}'): a model is served while a "
                       "worker of the node's config serves it (start or stop that worker instead)")


def repository_named() -> KServeError:
    """Triton's answer to repository index, load or unload naming a repository (its HTTP index
    does not read the name, and answers)."""
    return KServeError(grpc.StatusCode.UNIMPLEMENTED, "'repository_name' specification is not supported")


def np_dtype(datatype: str, what: str) -> str:
    dt = KSERVE_TO_NP.get(datatype)
    if dt is None:
        hint = " (strings are not supported by Batchyard)" if datatype == "BYTES" else ""
        raise invalid(f"{what}: datatype '{datatype}' is not supported{hint}; "
                      f"one of {sorted(KSERVE_TO_NP)}")
    return dt


UINT64_MAX = (1 << 64) - 1


def uint64_param(value, name: str) -> int:
    """A request parameter Triton reads as an unsigned 64-bit integer (priority, timeout). A value
    past that range is the request's fault; unchecked, it failed deep in the SDK's encoder as an
    internal error."""
    v = int(value)
    if not 0 <= v <= UINT64_MAX:
        raise invalid(f"parameter '{name}' must be an unsigned 64-bit integer, got {value}")
    return v


def priority_class(value: int) -> str:
    """Triton's priority: 1 is the highest, 0 the model's default; Batchyard has three classes."""
    value = uint64_param(value, "priority")
    return {0: "normal", 1: "high", 2: "normal"}.get(value, "low")


def timeout_s(timeout_us: Optional[int], grpc_left_s: Optional[float] = None) -> tuple[Optional[float], bool]:
    """Triton's ``timeout`` parameter (microseconds, 0 = none) and a gRPC deadline, whichever is
    sooner, as Batchyard's timeout in seconds (None: the dispatcher's default), and whether the
    gRPC deadline is the one that limits it."""
    timeout_us = uint64_param(timeout_us, "timeout") if timeout_us else 0
    # Any uint64 is a valid Triton timeout; past Batchyard's longest one it means the same: never.
    t = min(timeout_us / 1e6, P.MAX_TIMEOUT_S) if timeout_us else None
    if grpc_left_s is not None and grpc_left_s > 0 and (t is None or grpc_left_s < t):
        return grpc_left_s, True
    return t, False


def check_byte_size(name: str, datatype: str, shape: list[int], nbytes: int) -> np.dtype:
    """The input's numpy dtype, once ``nbytes`` is what its datatype and shape take."""
    dt = _NP_DTYPES.get(datatype)
    if dt is None:
        np_dtype(datatype, f"input '{name}'")  # raises Triton's error
    want = math.prod(shape) * dt.itemsize
    if nbytes != want:
        raise invalid(f"unexpected total byte size {nbytes} for input '{name}', expecting {want}")
    return dt


def check_element_count(name: str, shape: list[int], count: int) -> None:
    if count != math.prod(shape):
        raise invalid(f"unexpected number of elements {count} for input '{name}', expecting "
                      f"{math.prod(shape)} for shape {list(shape)}")


def byte_view(arr: np.ndarray) -> memoryview:
    """``arr``'s bytes in C order, without a copy where it is contiguous (and writable where
    ``arr`` is). The view keeps the array, and so the memory it is in (an output in the Batchyard
    client's pool is freed with its last view), until it is let go."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def tensor_from_bytes(name: str, datatype: str, shape: list[int], data) -> np.ndarray:
    dt = check_byte_size(name, datatype, shape, len(data))
    return np.frombuffer(data, dtype=dt).reshape(shape)


# The JSON value kinds (as numpy infers them) each tensor kind takes, as Triton's JSON parser
# takes them: numbers for floats, integers for integers, true/false for BOOL. Converting straight
# to the tensor's dtype would read null as NaN, true as 1.0 and 1.5 as the integer 1.
_JSON_KINDS = {"f": "iuf", "i": "iu", "u": "iu", "b": "b"}


def tensor_from_list(name: str, datatype: str, shape: list[int], data) -> np.ndarray:
    dt = _NP_DTYPES.get(datatype) or np.dtype(np_dtype(datatype, f"input '{name}'"))
    try:
        try:
            parsed = np.asarray(data)
        except ValueError:  # ragged, or nested unlike the shape: Triton reads the values in order
            data = _flattened(data)
            parsed = np.asarray(data)
        if parsed.size and dt.kind in "iu" and parsed.dtype.kind not in "iub":
            parsed = _json_integers(data, parsed, dt)
        if parsed.size and parsed.dtype.kind not in _JSON_KINDS.get(dt.kind, ""):
            raise ValueError(f"got {_json_kind(parsed)}")
        # numpy reads true/false beside numbers as 1/0: [true, 2, 3, 4] ran as FP32 [1, 2, 3, 4]
        if parsed.size and dt.kind != "b" and parsed.dtype.kind in "iuf" and _holds_bool(data):
            raise ValueError("got true/false")
        # Triton reads unsigned tensors' values as JSON unsigned integers and signed ones as int64,
        # and refuses what does not read so; within those, it narrows as astype does. astype
        # alone wrapped -1 to 255 in a UINT8 tensor and 2**63 to its lowest value in an INT64 one.
        if parsed.size and dt.kind == "u" and parsed.dtype.kind == "i" and parsed.min() < 0:
            raise ValueError(_NOT_UNSIGNED)
        if parsed.size and dt.kind == "i" and parsed.dtype.kind == "u":  # a value past int64
            raise ValueError(_NOT_SIGNED)
        arr = parsed.astype(dt, copy=False)
        # 1e39 became inf in FP32 (NaN and Infinity, which Triton's JSON reader takes, stay)
        if arr.size and dt.kind == "f" and arr is not parsed and (np.isinf(arr) & np.isfinite(parsed)).any():
            raise ValueError(f"a value past {datatype}'s range")
    except (TypeError, ValueError, OverflowError) as e:
        raise invalid(f"input '{name}': data is not {datatype}: {e}") from None
    check_element_count(name, shape, arr.size)
    return arr.reshape(shape)


def _flattened(data) -> list:
    """``data``'s values in row-major order, whatever its nesting: Triton's JSON reader walks the
    arrays and counts elements, so [[0, 1, 2, 3], [4, 5, 6], [7]] is a [2, 4] tensor to it (numpy
    refused it as inhomogeneous, a 400 in numpy's words)."""
    if type(data) is not list:
        return data
    out: list = []
    stack = [iter(data)]
    while stack:  # (a stack, not recursion: JSON nests deeper than Python's recursion limit)
        for v in stack[-1]:
            if type(v) is list:
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


def _holds_bool(data) -> bool:
    if type(data) is not list:
        return type(data) is bool
    todo = [data]
    while todo:
        for v in todo.pop():
            t = type(v)
            if t is bool:
                return True
            if t is list:
                todo.append(v)
    return False


_NOT_UNSIGNED = "attempt to access JSON non-unsigned-integer as unsigned-integer"  # Triton's words
_NOT_SIGNED = "attempt to access JSON non-signed-integer as signed-integer"


def _json_integers(data, parsed: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Integers numpy read as floats or objects: the ones past int64 beside smaller ones (a
    UINT64 tensor's 2**64-1 beside 1, which Triton takes). Returned as uint64 when all are in its
    range; a value past int64 in a signed tensor, or negative in an unsigned one, is Triton's
    error; anything but integers is returned as it is, for the caller's check."""
    if parsed.dtype.kind not in "fO":
        return parsed
    values = np.asarray(data, dtype=object).ravel()
    if values.size != parsed.size or not all(type(v) is int for v in values):
        return parsed
    low, high = min(values), max(values)
    if dt.kind == "i" or low < 0:
        raise ValueError(_NOT_SIGNED if dt.kind == "i" else _NOT_UNSIGNED)
    if high > UINT64_MAX:
        raise ValueError(_NOT_UNSIGNED)
    return np.array(values.tolist(), dtype=np.uint64).reshape(parsed.shape)


def _json_kind(parsed: np.ndarray) -> str:
    return {"b": "true/false", "i": "integers", "u": "integers", "f": "non-integral numbers",
            "U": "strings"}.get(parsed.dtype.kind, "null, mixed or out-of-range values")


def in_model_order(spec, wanted: list) -> list:
    """The outputs to answer (tuples, the name first) in the order of the model's outputs, as
    Triton answers them: a client that asked for [w, y] got them so, and one that reads
    ``outputs[i]`` or ``raw_output_contents[i]`` by position read another output."""
    order = {t.name: i for i, t in enumerate(spec.outputs)}
    return sorted(wanted, key=lambda w: order[w[0]])


def output_nbytes(spec: P.ModelSpec, name: str, inputs: dict) -> Optional[int]:
    """Bytes of output ``name`` for this request, known before it runs: Batchyard's tensors have a
    fixed shape per item, and the batch is the inputs' first dimension (None without one)."""
    first = next(iter(inputs.values()), None)
    if first is None or first.ndim == 0:
        return None
    t = next(t for t in spec.outputs if t.name == name)
    dt = _NP_DTYPES.get(NP_TO_KSERVE.get(t.dtype, ""))
    return None if dt is None else first.shape[0] * math.prod(t.shape) * dt.itemsize


def check_new_input(inputs: dict, name: str, shape: list[int], model: str) -> None:
    """Triton's errors for an input given twice (it kept the last one silently) and for a
    dimension left unspecified (-1, which made the element count negative)."""
    if name in inputs:
        raise invalid(f"input '{name}' already exists in request")
    if any(d < 0 for d in shape):
        raise invalid(f"All input dimensions should be specified for input '{name}' for model '{model}', got {shape}")


def batch_input_bytes(spec: P.ModelSpec) -> int:
    """The bytes of every input of a whole batch of the model: the most tensor data a request can
    carry."""
    return spec.max_batch * sum(math.prod(t.shape) * np.dtype(t.dtype).itemsize for t in spec.inputs)


def check_input_name(spec: P.ModelSpec, name: str) -> P.TensorSpec:
    """The model's input of that name. The front door asks before an input's data is converted:
    1.2 million unknown inputs of one byte each were all converted first, holding its loop 8.5 s."""
    t = next((t for t in spec.inputs if t.name == name), None)
    if t is None:
        raise invalid(f"unexpected inference input '{name}' for model '{spec.name}'")
    return t


def check_input(spec: P.ModelSpec, name: str, dtype: str, shape: list[int]) -> None:
    """One input's name, dtype (numpy's name) and shape against the model, with Triton's wording.
    Also checked on a shared-memory input's declaration before its bytes are read: the read
    copies as many bytes as the client claims (2 GiB took 7 s of the front door's loop)."""
    t = check_input_name(spec, name)
    if dtype != t.dtype:
        raise invalid(f"inference input '{name}' data-type is '{NP_TO_KSERVE.get(dtype, dtype)}', but model "
                      f"'{spec.name}' expects '{NP_TO_KSERVE.get(t.dtype, t.dtype)}'")
    item_fits = bool(shape) and tuple(shape[1:]) in (tuple(t.shape), dims(t))
    if item_fits and shape[0] > spec.max_batch:
        raise invalid(f"inference request batch-size must be <= {spec.max_batch} for '{spec.name}'")
    if not item_fits or shape[0] < 1:
        raise invalid(f"unexpected shape for input '{name}' for model '{spec.name}'. Expected "
                      f"{[-1, *t.shape]} (batch 1..{spec.max_batch}), got {list(shape)}")


def check_declared_input(spec: P.ModelSpec, name: str, datatype: str, shape: list[int]) -> None:
    """An input as the request declares it (a KServe datatype), checked against the model before
    its data is converted: a shape whose element count overflows ([2**32, 2**32, 0] counts no
    element, as its data) failed numpy's reshape, a "malformed inference request"."""
    check_input(spec, name, np_dtype(datatype, f"input '{name}'"), shape)


def check_inputs(spec: P.ModelSpec, inputs: dict[str, np.ndarray]) -> None:
    """The model's inputs, dtypes and shapes, with Triton's wording; the dispatcher checks the
    same again (it trusts no client)."""
    want = {t.name: t for t in spec.inputs}
    batch = None
    for name, arr in inputs.items():
        check_input(spec, name, dtype_name(arr.dtype), list(arr.shape))
        # Triton refuses this before inference, counted nowhere; left to the dispatcher, it
        # was counted a failure in ModelStatistics.
        if batch is not None and arr.shape[0] != batch:
            raise invalid(f"input '{name}' batch size does not match other inputs for '{spec.name}'")
        batch = arr.shape[0]
    missing = sorted(set(want) - set(inputs))
    if missing:
        raise invalid(f"expected {len(want)} inputs but got {len(inputs)} inputs for model '{spec.name}'; "
                      f"missing required input(s) {missing}")


def dims(t: P.TensorSpec) -> tuple:
    """A tensor's per-item shape as Triton's config states it: one value an item is ``[1]``
    (with ``reshape: {shape: []}``), as ``dims: []`` is no Triton's (it refuses such a config,
    and perf_analyzer stopped on it: "unable to set shape for the input")."""
    return tuple(t.shape) or (1,)


def unreshaped(spec: P.ModelSpec, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inputs of one value an item sent as ``[B, 1]``, as ``model_config``'s ``dims: [1]`` says,
    taken as the ``[B]`` the model has (Triton's reshape); ``[B]`` itself as before."""
    one = {t.name for t in spec.inputs if not t.shape}
    if not one:
        return inputs
    return {n: a.reshape(a.shape[0]) if n in one and a.ndim == 2 and a.shape[1] == 1 else a
            for n, a in inputs.items()}


def model_metadata(spec: P.ModelSpec) -> dict:
    """KServe's model metadata: the batch dimension is -1 (variable), as Triton shows it, then
    the config's ``dims`` (perf_analyzer sizes its inputs from these)."""
    conv = lambda ts: [{"name": t.name, "datatype": NP_TO_KSERVE[t.dtype], "shape": [-1, *dims(t)]} for t in ts]
    return {"name": spec.name, "versions": ["1"], "platform": PLATFORM,
            "inputs": conv(spec.inputs), "outputs": conv(spec.outputs)}


def model_config(spec: P.ModelSpec, instances: Optional[dict] = None) -> dict:
    """Triton's model configuration, the fields tritonclient and perf_analyzer read (``dims``
    without the batch dimension, as with max_batch_size > 0), its one version's policy, and an
    instance group a path of the workers serving it (``instances``: path -> registered workers;
    KIND_GPU for the gpu path), as Triton fills them in (they were left out)."""
    def conv(ts):
        return [{"name": t.name, "data_type": "TYPE_" + NP_TO_KSERVE[t.dtype], "dims": list(dims(t)),
                 **({} if t.shape else {"reshape": {"shape": []}})} for t in ts]
    groups = [{"name": f"{spec.name}_{i}", "kind": "KIND_GPU" if path == "gpu" else "KIND_CPU", "count": n}
              for i, (path, n) in enumerate(sorted((instances or {}).items()))]
    return {"name": spec.name, "platform": PLATFORM, "backend": PLATFORM,
            "version_policy": {"latest": {"num_versions": 1}}, "max_batch_size": spec.max_batch,
            "input": conv(spec.inputs), "output": conv(spec.outputs), **({"instance_group": groups} if groups else {})}


# ------------------------------------------------------------------ statistics
def stats_json(name: str, c) -> dict:
    """Triton's ModelStatistics in its JSON form, from the node's counters (kserve_stats). The
    execution count is the batches the front door's requests ran in (each request adds its share
    of its batch), so inference_count / execution_count is the mean batch, as with Triton; a batch
    shared with SDK clients counts only the front door's share of it."""
    dur = lambda n, ns: {"count": int(n), "ns": int(ns)}  # noqa: E731
    ok = c[S.SUCCESS]
    return {"name": name, "version": "1", "last_inference": int(c[S.LAST_MS]), "inference_count": int(c[S.ITEMS]),
            "execution_count": int(round(c[S.EXEC_PPM] / S.PPM)),
            "inference_stats": {"success": dur(ok, c[S.SUCCESS_NS]), "fail": dur(c[S.FAIL], c[S.FAIL_NS]),
                                "queue": dur(ok, c[S.QUEUE_NS]), "compute_input": dur(ok, 0),
                                "compute_infer": dur(ok, c[S.COMPUTE_NS]), "compute_output": dur(ok, 0),
                                # no response cache: zeros, as Triton writes them (perf_analyzer's
                                # HTTP parser reads cache_hit without looking for it first)
                                "cache_hit": dur(0, 0), "cache_miss": dur(0, 0)},
            "batch_stats": [], "response_stats": {}, "memory_usage": []}


# ------------------------------------------------------------------ the core
def _count_success(c: np.ndarray, t0: int, items: int, timing, all_compute: bool = False) -> None:
    """A request of ``items`` served; ``timing``: the dispatcher's (P.Timing, or None). An LLM
    request (``all_compute``) is one item of one execution, its whole time compute, as the
    dispatcher's metrics count a generate request."""
    took = time.perf_counter_ns() - t0
    c[S.SUCCESS] += 1
    c[S.SUCCESS_NS] += took
    c[S.ITEMS] += items
    c[S.LAST_MS] = int(time.time() * 1000)
    if timing is not None:
        c[S.QUEUE_NS] += timing.queue_us * 1000
        c[S.COMPUTE_NS] += timing.compute_us * 1000
    if all_compute:
        c[S.COMPUTE_NS] += took
    c[S.EXEC_PPM] += round(S.PPM * items / timing.batch_size) if timing is not None and timing.batch_size else S.PPM


def _count_failure(c: np.ndarray, t0: int) -> None:
    c[S.FAIL] += 1
    c[S.FAIL_NS] += time.perf_counter_ns() - t0


class KServeCore:
    """The protocol-independent half of the front door: specs, readiness, inference, stats."""

    def __init__(self, client, shm=None, default_timeout_s: Optional[float] = None, strict_readiness: bool = True,
                 llm_models: frozenset = frozenset(), tracer=None, logs=None):
        from .kserve_shm import ShmRegions  # it imports this module's errors
        from .kserve_trace import Tracer  # it imports this module's errors

        self.client = client  # batchyard.AsyncClient
        # A request with no `timeout` parameter (and no gRPC deadline) gets the node's
        # [dispatcher] default_timeout_s, not the Python SDK's own default: the operator who
        # sets that key (Triton has no default deadline at all) means it for the front door too.
        self.default_timeout_s = default_timeout_s
        self.strict_readiness = strict_readiness
        self.shm = shm if shm is not None else ShmRegions()  # default: this process's own registry
        self.stats = NodeStats(self.shm.dir_fd)
        # Triton's trace extension: the node's trace setting, and the traces this process takes.
        self.tracer = tracer if tracer is not None else Tracer(dir_fd=self.shm.dir_fd)
        # The node's log setting (kserve_logging.LogSettings), None: Triton's logging extension
        # is not served (a core in a test, whose process's logging is not the front door's).
        self.logs = logs
        self._models: frozenset = frozenset()  # every model of the node, as of the last status
        # The node's LLM models: served by the OpenAI routes, and through Triton's protocols as
        # Triton's vLLM backend is (llm_generate: metadata, config, generate, ModelStreamInfer),
        # by ``llm`` (an llm_generate.LlmGenerate, set by the front door of a node that has them).
        self.llm_models = frozenset(llm_models)
        self.llm = None
        self._refresh: Optional[asyncio.Future] = None
        self.stopping = False  # set by stop_waiting: requests in flight are answered UNAVAILABLE
        # Classified outputs ranked off the event loop, one at a time (kserve_classify); its
        # thread starts at the first such ranking.
        self.ranker = ThreadPoolExecutor(1, thread_name_prefix="ranking")

    def input_array(self, shape: list[int], dtype: np.dtype) -> np.ndarray:
        """An array to read a shared-memory input into: in the Batchyard client's pool when the
        client sends one that big through it, which then goes on by reference (read into plain
        memory, it was copied into the pool again), else plain memory."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes and nbytes >= self.client.shm_threshold:
            try:
                return self.client.alloc_array(shape, dtype)
            except BatchyardError:
                # A full pool, or a client closed by a stop: plain memory, and the request then
                # fails as it did before (a stop's UNAVAILABLE; here it was an INTERNAL error).
                pass
        return np.empty(shape, dtype)

    def stop_waiting(self) -> None:
        """At the end of a stop's grace: every request still waiting on the node is answered
        UNAVAILABLE (its client closed: each fails Cancelled, read as that here), before the
        connections close; closed with requests running, HTTP clients got no answer at all."""
        self.stopping = True
        self.client.close()

    def _stopped(self, e: BatchyardError) -> Optional[KServeError]:
        """UNAVAILABLE for a request failed by stop_waiting (its client closed), else None."""
        if self.stopping and e.status == P.Status.CANCELLED:
            return KServeError(grpc.StatusCode.UNAVAILABLE, STOPPING_MESSAGE)
        return None

    async def spec(self, model: str, version: str = "") -> P.ModelSpec:
        """The model's spec; Triton's errors for an unknown model, then for a version other than
        the one Batchyard serves ("1"; "" is the latest, as Triton reads it). A version string
        that is no integer is refused first, as Triton parses it before it looks the model up."""
        v = parse_version(version)
        spec = self.client.specs.get(model)
        if spec is None and (model in self.llm_models or not 1 <= len(model) <= 128):  # (128: protocol.Name)
            raise unknown_model(model, model in self.llm_models)
        if spec is None:
            try:
                spec = await self.client.model_info(model, timeout=5.0)
            except BatchyardError as e:
                raise self._stopped(e) or from_batchyard(e, model) from None
        if v not in (-1, VERSION):
            raise unknown_version(model, v)
        return spec

    def serves_llm(self, model: str) -> bool:
        """Whether ``model`` is an LLM model this front door serves through Triton's protocols."""
        return self.llm is not None and model in self.llm_models

    def llm_model(self, model: str, version: str = "") -> bool:
        """serves_llm(), a version other than the one served being Triton's NOT_FOUND, as for
        any model."""
        if not self.serves_llm(model):
            return False
        if (v := parse_version(version)) not in (-1, VERSION):
            raise unknown_version(model, v)
        return True

    async def llm_run(self, model: str, run: Awaitable[dict]) -> dict:
        """An LLM model's run through Triton's protocols (llm_generate), counted in its
        statistics: a success, or a failure whatever failed it (the backend's refusals are the
        model's, in Triton)."""
        c = self.stats.counters(model)
        t0 = time.perf_counter_ns()
        try:
            members = await run
        except BaseException as e:
            _count_failure(c, t0)
            if isinstance(e, KServeError):
                e.ran = True
            raise
        _count_success(c, t0, 1, None, all_compute=True)
        return members

    async def ready_models(self) -> Optional[frozenset]:
        """Models served by at least one registered worker (None when the dispatcher does not
        answer). A caller that arrives while a status request is in flight takes its answer,
        which bounds the dispatcher's work under a storm of probes; no answer is kept once it
        came, so a probe made after the dispatcher's status shows a worker's loss or
        registration sees it (tests wait on that status, then probe once). The status asked is
        the brief one: a probe costs the dispatcher about what a model-info request does."""
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._fetch_ready())
        return await asyncio.shield(self._refresh)  # one caller's cancellation spares the others

    async def _fetch_ready(self) -> Optional[frozenset]:
        try:
            st = await self.client.status(timeout=1.0, brief=True)
            # An LLM model's prefill-cpu engine serves nothing alone (the decode runs on its gpu
            # one): counted, the node said ready while every completion failed 503.
            ready = frozenset(m for w in st.workers if w.path != PREFILL_CPU for m in w.models)
            self._models = frozenset(st.models)
        except BatchyardError:
            ready = None
        return ready

    async def config(self, model: str, version: str = "") -> dict:
        """The model's configuration (model_config), its instance groups as of a status asked now
        (none where the dispatcher does not answer)."""
        spec = await self.spec(model, version)
        try:
            st = await self.client.status(timeout=1.0, brief=True)
        except BatchyardError:
            return model_config(spec)
        return model_config(spec, collections.Counter(w.path for w in st.workers if model in w.models))

    async def server_ready(self) -> bool:
        """Triton's default readiness (``--strict-readiness=true``): ready while every model of
        the node has a registered worker; with ``strict`` off, while any has. Readiness used to
        be the second alone: a node whose only worker of one model was gone stayed ready, and a
        load balancer that probes /v2/health/ready kept sending that model's requests there."""
        ready = await self.ready_models()
        if not ready:
            return False
        return not self.strict_readiness or self._models <= ready

    async def model_ready(self, model: str, version: str = "") -> bool:
        """A version string that is no integer, or a negative one, is Triton's INVALID_ARGUMENT
        here too (it answered "not ready"); the HTTP routes take digits only."""
        served = parse_version(version) in (-1, VERSION)
        return served and model in ((await self.ready_models()) or ())

    async def repository_index(self, ready_only: bool = False) -> list[dict]:
        """Triton's repository index: every model of the node, READY while a worker serves it
        (the index of a Triton in model-control mode NONE lists its models the same way)."""
        ready = await self.ready_models()
        if ready is None:
            raise KServeError(grpc.StatusCode.UNAVAILABLE, "the dispatcher does not answer")
        # An LLM model is ready as its OpenAI route serves it (a probe of /v2/models/{m}/ready
        # tells whether completions can run); the reason says it is none of the KServe routes'.
        def reason(m: str) -> str:
            why = "" if m in ready else "no worker serving it is registered"
            if m in self.llm_models:
                why = f"{why} ({LLM_ROUTE})" if why else LLM_ROUTE
            return why

        # (no "reason" where there is none, as Triton writes the index)
        index = [{"name": m, "version": "1", "state": "READY" if m in ready else "UNAVAILABLE",
                  **({"reason": why} if (why := reason(m)) else {})} for m in sorted(self._models | ready)]
        return [i for i in index if i["state"] == "READY"] if ready_only else index

    async def infer(self, model: str, inputs: dict[str, np.ndarray], priority: int = 0,
                    timeout: Optional[float] = None, grpc_deadline: bool = False,
                    reply: Optional[Callable] = None, trace=None) -> tuple[P.ModelSpec, object]:
        """-> (spec, outputs by name) or KServeError with Triton's code (``grpc_deadline``: the
        timeout is the gRPC call's deadline, ``from_batchyard``). ``reply``: makes the answer of
        the outputs, returned in their place; its KServeError (an answer too large to send)
        counts the request failed, as its client gets no answer: counted a success, it was
        one in the statistics. It may return an awaitable of the answer. ``trace``: the
        request's (kserve_trace), given the times of its way through the node."""
        spec = await self.spec(model)
        inputs = unreshaped(spec, inputs)
        check_inputs(spec, inputs)
        items = next(iter(inputs.values())).shape[0]
        c = self.stats.counters(model)
        t0 = time.perf_counter_ns()
        if trace is not None:
            trace.stamp("REQUEST_START")
        out = None
        try:
            out = await self.client.infer(model, inputs, priority=priority_class(priority),
                                          timeout=self.default_timeout_s if timeout is None else timeout)
        except BatchyardError as e:
            _count_failure(c, t0)
            if log.isEnabledFor(logging.DEBUG):  # (Triton's verbose log; kserve_logging)
                log.debug("infer %s: %s after %.3f ms", model, type(e).__name__, (time.perf_counter_ns() - t0) / 1e6)
            err = self._stopped(e) or from_batchyard(e, model, grpc_deadline)
            err.ran = True
            try:
                raise err from None
            finally:
                # Kept as a local, the error's traceback holds this frame and the frame the error:
                # a cycle that kept the inputs (the pool's memory) until the cycle collector ran.
                del err
        except asyncio.CancelledError:  # the client went away: Triton counts it a failure (CANCELED)
            _count_failure(c, t0)
            raise
        finally:
            if trace is not None:
                # (the dispatcher's times, where they are on this host's clock)
                trace.stamp_reply(out.timing if out is not None and self.tracer.node_clock else None)
                trace.stamp("REQUEST_END")
        if reply is None:
            answer = out
        else:
            try:
                answer = reply(out)
                if inspect.isawaitable(answer):  # one that ranks classes off the loop (kserve_classify)
                    answer = await answer
            except asyncio.CancelledError:
                # The client left while its classes were ranked: the model had served it, and
                # Triton counts that a success (its backend reports before the ranking).
                _count_success(c, t0, items, out.timing)
                raise
            except Exception:  # a KServeError (too large to send), an output region's OSError: no answer
                _count_failure(c, t0)
                raise
        _count_success(c, t0, items, out.timing)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("infer %s: %d item(s) served in %.3f ms", model, items,
                      (time.perf_counter_ns() - t0) / 1e6)
        if trace is not None:
            trace.stamp("INFER_RESPONSE_COMPLETE")
        return spec, answer

    async def trace_setting(self, model: str, changes: Optional[Callable[[], Awaitable[dict]]] = None) -> dict:
        """Triton's trace setting of ``model`` ("": the global one), after the changes that
        ``changes`` reads from the request (kserve_trace.parse_update; None: a read). A model the
        node does not serve, or not yet, is Triton's INVALID_ARGUMENT, and its first error: the
        changes are read after that check, as Triton reads them."""
        if model and not await self.model_ready(model):
            raise invalid(f"Request for unknown model : {model}")
        if changes is not None:
            self.tracer.update(model, await changes())
        return self.tracer.settings(model)

    def log_setting(self, changes: Optional[Callable[[], dict]] = None) -> dict:
        """Triton's log settings after the changes ``changes`` reads from the request
        (kserve_logging.parse_*_update; None: a read); UNIMPLEMENTED where this core serves none."""
        if self.logs is None:
            raise KServeError(grpc.StatusCode.UNIMPLEMENTED, "this front door serves no log settings")
        if changes is not None:
            self.logs.update(changes())
        return self.logs.settings()

    async def model_stats(self, model: str, version: str = "") -> list[dict]:
        """Triton's statistics of ``model``, or of every model of the node (zeros for those not
        asked for yet), summed over the node's front-door processes. A model or version the node
        does not have is Triton's error for statistics (``stats_unavailable``)."""
        if model:
            v = parse_version(version)
            try:
                if not self.serves_llm(model):
                    await self.spec(model)
            except KServeError as e:
                raise (stats_unavailable(model, False) if e.code == grpc.StatusCode.NOT_FOUND else e) from None
            if v not in (-1, VERSION):
                raise stats_unavailable(model, True)
        else:
            await self.ready_models()
        totals = self.stats.totals()
        zero = np.zeros(len(S.FIELDS), np.int64)
        # (an LLM model counts its requests through Triton's protocols; with no front door that
        # serves it so, it has no statistics)
        names = [model] if model else sorted(m for m in set(totals) | self._models
                                             if m not in self.llm_models or self.serves_llm(m))
        return [stats_json(n, totals.get(n, zero)) for n in names]

    def close(self) -> None:
        # Those queued never start. One running has been abandoned by the servers' stop before
        # this (their calls cancelled): it ends at its next item or chunk (kserve_classify), and
        # the interpreter's exit waits for that.
        self.ranker.shutdown(wait=False, cancel_futures=True)
        self.tracer.close()
        if self.logs is not None:
            self.logs.close()
        self.stats.close()
        self.shm.close()
