"""The front door's gRPC side: Triton's ``inference.GRPCInferenceService`` (KServe v2) on
grpc.aio, translated onto Batchyard through ``KServeCore``. The generated stubs are the ones
tritonclient ships, so the messages are exactly those its clients and perf_analyzer send.

Repository control answers as a Triton in model-control mode NONE does (the index lists the
node's models; load and unload are refused); trace settings are Triton's (kserve_trace); log
settings, which Batchyard does not have, are UNIMPLEMENTED with a message that says so.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Callable, Optional

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from . import __version__
from .addresses import grpc_listen_address
from .client_codec import dtype_name
from .kserve_common import (EXTENSIONS, KSERVE_TO_NP, MALFORMED, NP_TO_KSERVE, SERVER_NAME, KServeCore, KServeError, as_kserve,
                            byte_view, check_declared_input, check_element_count, check_input_name, check_new_input,
                            check_parameter_names,
                            cuda_shm_refused, cuda_shm_status, invalid, model_control_refused, repository_named,
                            in_model_order, model_metadata, np_dtype, output_nbytes, tensor_from_bytes, tensor_from_list, timeout_s)
from .kserve_classify import answer_ranked, check_classifiable, class_count
from .kserve_grpc_wire import InferAnswer, parse_infer_request, serialize_answer
from .kserve_logging import parse_grpc_update
from .kserve_restrict import GrpcRestrictions, Restrictions
from .kserve_shm import OutputRegion, close_outputs
from .kserve_trace import Trace, parse_update
from .llm_generate import DECOUPLED_GRPC, grpc_outputs, grpc_request, llm_config, llm_metadata, read_backend_request
from .tcp_peer import bound_address, grpc_peer, peer_uid
from .validation import item_nbytes

log = logging.getLogger("batchyard.frontend")

# Typed (non-raw) tensor contents: which field of InferTensorContents carries each datatype.
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents"}
# Each field's own datatype, as Triton names it when a request fills the wrong one.
_FIELD_TYPE = {"bool_contents": "BOOL", "int_contents": "INT32", "int64_contents": "INT64", "uint_contents": "UINT32",
               "uint64_contents": "UINT64", "fp32_contents": "FP32", "fp64_contents": "FP64",
               "bytes_contents": "BYTES"}


def uint_param(params, key: str, kinds: tuple[str, ...], cast: bool = False) -> int:
    """An integer request parameter read as Triton reads it: of one of ``kinds``' types (priority:
    int64 or uint64; timeout: int64, as tritonclient sends them), not negative; 0 when absent.
    ``cast``: a negative value is what Triton's cast to uint64 makes of it (its timeout: -5 is
    accepted, as about 584,000 years), not an error."""
    if key not in params:
        return 0
    p = params[key]
    which = p.WhichOneof("parameter_choice")
    if which not in kinds:
        raise invalid(f"invalid value type for '{key}' parameter, expected {' or '.join(kinds)}.")
    value = getattr(p, which)
    if value < 0:
        if cast:
            return value % 2**64
        raise invalid(f"invalid value for '{key}', expected value >= 0.")
    return value


def _class_count(params) -> Optional[int]:
    """An output's ``classification`` parameter (tritonclient's class_count) as Triton's gRPC reads
    it: an int64_param above 0, kept as its uint32 (2**32 asks 0 classes); None when absent."""
    if "classification" not in params:
        return None
    p = params["classification"]
    if p.WhichOneof("parameter_choice") != "int64_param":
        raise invalid("invalid value type for 'classification' parameter, expected int64_param")
    if p.int64_param <= 0:
        raise invalid("invalid value for 'classification' parameter, expected >= 0")
    return class_count(p.int64_param)


# What one ModelStreamInfer stream may hold, of requests read and not yet answered to a client
# that reads its answers, before the front door stops reading it (one segment of the Batchyard
# client's pool).
STREAM_HELD_BYTES = 64 << 20
# Counted for each request besides its tensors' bytes: its messages and task (a million tiny
# ones must count too).
STREAM_ANSWER_OVERHEAD = 1024
_ITEMSIZES = {kind: np.dtype(dtype).itemsize for kind, dtype in KSERVE_TO_NP.items()}


def _held_bytes(answer) -> int:
    """What a finished stream answer holds until it is sent: its outputs' bytes (views of the
    pool, for an InferAnswer) and a little more."""
    return STREAM_ANSWER_OVERHEAD + (sum(map(len, answer.raw)) if type(answer) is InferAnswer else 0)


def _capped_nbytes(shape, itemsize: int) -> int:
    """A tensor's bytes, counted no further than past STREAM_HELD_BYTES (or 0 for a dimension
    below 1): the declared shape is not checked yet, and the product of a shape of 40,000
    dimensions of 2**62 held the loop 3.2 s (a review's request)."""
    nbytes = itemsize
    for d in shape:
        if d < 1:
            return 0
        nbytes *= d
        if nbytes > STREAM_HELD_BYTES:
            return STREAM_HELD_BYTES + 1
    return nbytes


def _stream_reservation(request, specs: dict) -> tuple[int, int]:
    """What a stream request may hold from when it is read until its answer is sent: its inputs'
    bytes and its outputs' at the model's sizes (the Batchyard client's pool takes both when it
    is sent), its id (said back in its answer) and a little more. Counted when read: counted only
    once answered, a slow model's requests, running, reserved their outputs without bound (640
    MiB for 600 of 1 MiB). And what one full batch of its model takes (0 while its spec is not
    known), which a stream may always hold: with 24 MiB outputs and 300 ms batches, a stream
    held to 64 MiB could have 2 requests running, so batches of at most 2, and it served a
    third of the requests a second."""
    # (the message's own size counts its id, parameters and typed contents: strings a model
    # never reads, sent in parameters, were held uncounted: 279 MiB for 40 requests in a review;
    # BYTES tensors have no item size, so their raw contents are counted whole)
    nbytes, items = STREAM_ANSWER_OVERHEAD + request.ByteSize(), 0
    if any(t.datatype == "BYTES" for t in request.inputs):
        nbytes += sum(map(len, request.raw_input_contents))
    for t in request.inputs:
        itemsize = _ITEMSIZES.get(t.datatype)
        if itemsize is not None:
            nbytes += _capped_nbytes(t.shape, itemsize)
        if not items and t.shape:
            items = max(0, t.shape[0])
    batch = 0
    spec = specs.get(request.model_name)
    if spec is not None:
        per_item = sum(item_nbytes(t) for t in spec.outputs)
        nbytes += min(items * per_item, STREAM_HELD_BYTES + 1)
        batch = spec.max_batch * (per_item + sum(item_nbytes(t) for t in spec.inputs))
    return nbytes, batch


# A tensor's shared-memory parameters and the one protobuf field each is read from, as Triton
# 2.51 reads them (ParseSharedMemoryParams): a value in another field is refused. Read from
# whichever field was set, a bool_param offset of true read as offset 1 and served garbage.
_SHM_KINDS = {"shared_memory_region": "string_param", "shared_memory_offset": "int64_param",
              "shared_memory_byte_size": "int64_param"}


def _typed_shm_param(params, key: str, tensor: str):
    """The value of ``params[key]`` from its one allowed field; None when absent."""
    if key not in params:
        return None
    p, kind = params[key], _SHM_KINDS[key]
    if p.WhichOneof("parameter_choice") != kind:
        raise invalid(f"invalid value type for '{key}' parameter for tensor '{tensor}', expected {kind}.")
    return getattr(p, kind)


def _shm_number(params, key: str, tensor: str, has_region: bool) -> Optional[int]:
    """A tensor's shared-memory offset or byte size, None when absent. Without a region it is
    Triton's error (it was ignored, and the tensor's own data read)."""
    if key in params and not has_region:
        raise invalid(f"'{key}' can not be specified without 'shared_memory_region' parameter for tensor '{tensor}'")
    return _typed_shm_param(params, key, tensor)


def _shm_param(params, tensor: str) -> Optional[tuple[str, int, int]]:
    """(region, offset, byte_size) of a tensor in shared memory, None for one that is not, with
    Triton 2.51's errors in its order."""
    region = _typed_shm_param(params, "shared_memory_region", tensor)
    if region == "":  # (the tensor's own data was read instead; Triton refuses it)
        raise invalid("'shared_memory_region' names no region: give a registered region's name")
    offset = _shm_number(params, "shared_memory_offset", tensor, region is not None)
    byte_size = _shm_number(params, "shared_memory_byte_size", tensor, region is not None)
    if region is None:
        return None
    if byte_size is None:  # read as 0 bytes it was INTERNAL
        raise invalid(f"'shared_memory_byte_size' must be specified along with 'shared_memory_region' "
                      f"parameter for tensor '{tensor}'")
    return region, offset or 0, byte_size


def _uses_shm(request) -> bool:
    return any("shared_memory_region" in t.parameters for t in (*request.inputs, *request.outputs))


def _mark_final(response, final: bool = True) -> None:
    # Triton marks every stream response so (is_complete); a model that is not decoupled answers
    # once. Streaming clients (PyTriton's among them) wait for it to end a request.
    response.parameters["triton_final_response"].bool_param = final


def _stream_error(response, e: KServeError) -> service_pb2.ModelStreamInferResponse:
    out = service_pb2.ModelStreamInferResponse(error_message=e.message, infer_response=response)
    if e.ran:  # (one refused before the model ran carries no parameters, as Triton's)
        _mark_final(out.infer_response)
    return out


def _sent_now(order: asyncio.Queue, hold: Callable) -> Callable:
    """-> emit(message): ``message`` queued on a stream to be sent next, in the place of a task,
    held (``hold``) until it is sent, as an answer is."""
    def emit(message) -> None:
        done = asyncio.get_running_loop().create_future()
        done.set_result(message)
        hold(done, _held_bytes(message))
        order.put_nowait(done)
    return emit


def too_large(size: int, limit: int) -> KServeError:
    """An answer past the send limit ([frontend] max_request_bytes), in gRPC's own words for it."""
    return KServeError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"Sent message larger than max ({size} vs. {limit})")


def check_contents_field(t, field: str, model: str) -> None:
    """Typed contents in a field of another datatype than the input's are Triton's error (they
    were ignored, and the input then counted 0 elements)."""
    for other, datatype in _FIELD_TYPE.items():
        if other != field and len(getattr(t.contents, other)):
            raise invalid(f"unexpected explicit tensor data for input tensor '{t.name}' for model '{model}' of "
                          f"type '{datatype}', expected datatype '{t.datatype}'")


class KServeServicer(service_pb2_grpc.GRPCInferenceServiceServicer):

    def __init__(self, core: KServeCore, port: int = 0, host: str = "", max_send_bytes: int = (1 << 31) - 1):
        self.core = core
        self.max_send_bytes = max_send_bytes  # gRPC's limit for a message this server sends
        self.port = port  # ours: a client's uid is found by its connection to it (tcp_peer)
        # where its clients' connections end (None: any address; then the slow, exact lookup)
        self.address = bound_address(host)

    def _uid(self, context) -> Optional[int]:
        """The client's uid, for its shared-memory regions; None for one not on this host."""
        host, port = grpc_peer(context.peer())
        return peer_uid(host, port, self.port, self.address) if host else None

    # ---------------------------------------------------------------- health and metadata
    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=await self.core.server_ready())

    async def ModelReady(self, request, context):
        ready = await self._call(context, self.core.model_ready(request.name, request.version))
        return service_pb2.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context):
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        if await self._sync(context, self.core.llm_model, request.name, request.version):
            return json_format.ParseDict(llm_metadata(request.name), service_pb2.ModelMetadataResponse())
        md = await self._call(context, self.core.spec(request.name, request.version))
        return json_format.ParseDict(model_metadata(md), service_pb2.ModelMetadataResponse())

    async def ModelConfig(self, request, context):
        if await self._sync(context, self.core.llm_model, request.name, request.version):
            cfg = json_format.ParseDict(llm_config(request.name), model_config_pb2.ModelConfig())
            return service_pb2.ModelConfigResponse(config=cfg)
        cfg = json_format.ParseDict(await self._call(context, self.core.config(request.name, request.version)),
                                    model_config_pb2.ModelConfig())
        return service_pb2.ModelConfigResponse(config=cfg)

    async def ModelStatistics(self, request, context):
        out = service_pb2.ModelStatisticsResponse()
        for d in await self._call(context, self.core.model_stats(request.name, request.version)):
            json_format.ParseDict(d, out.model_stats.add())
        return out

    # ---------------------------------------------------------------- repository (control mode NONE)
    async def RepositoryIndex(self, request, context):
        if request.repository_name:
            e = repository_named()
            await context.abort(e.code, e.message)
        index = await self._call(context, self.core.repository_index(request.ready))
        out = service_pb2.RepositoryIndexResponse()
        for m in index:
            out.models.add(**m)
        return out

    async def RepositoryModelLoad(self, request, context):
        await self._refuse_model_control(request, context)

    async def RepositoryModelUnload(self, request, context):
        await self._refuse_model_control(request, context)

    @staticmethod
    async def _refuse_model_control(request, context):
        e = (repository_named() if request.repository_name
             else model_control_refused(request.model_name))
        await context.abort(e.code, e.message)

    async def TraceSetting(self, request, context):
        return await self._call(context, self._trace_setting(request))

    async def _trace_setting(self, request):
        async def changes() -> dict:
            return parse_update({k: list(v.value) for k, v in request.settings.items()}, http=False)
        out = service_pb2.TraceSettingResponse()
        # (no settings: a read)
        for k, v in (await self.core.trace_setting(request.model_name, changes if request.settings else None)).items():
            out.settings[k].value.extend(v if isinstance(v, list) else [v])
        return out

    async def LogSettings(self, request, context):
        setting = await self._sync(context, self.core.log_setting,
                                   (lambda: parse_grpc_update(request.settings)) if request.settings else None)
        out = service_pb2.LogSettingsResponse()
        for key, value in setting.items():
            if isinstance(value, bool):
                out.settings[key].bool_param = value
            elif isinstance(value, int):
                out.settings[key].uint32_param = value
            else:
                out.settings[key].string_param = value
        return out

    # ---------------------------------------------------------------- system shared memory
    async def SystemSharedMemoryRegister(self, request, context):
        if self.address is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                f"failed to register shared memory region '{request.name}': this front door's gRPC port is bound "
                "to every address ([frontend] host), and gRPC does not say which one a connection reached, "
                "without which the client's user cannot be known; bind one address (127.0.0.1), or use HTTP"))
        await self._sync(context, self.core.shm.register, request.name, request.key, request.offset,
                         request.byte_size, self._uid(context))
        return service_pb2.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        self.core.shm.unregister(request.name, self._uid(context))
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    async def SystemSharedMemoryStatus(self, request, context):
        regions = await self._sync(context, self.core.shm.status, request.name, self._uid(context))
        out = service_pb2.SystemSharedMemoryStatusResponse()
        for r in regions:
            out.regions[r.name].CopyFrom(service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
        return out

    # ---------------------------------------------------------------- CUDA shared memory (no GPUs)
    async def CudaSharedMemoryRegister(self, request, context):
        e = cuda_shm_refused(request.name)
        await context.abort(e.code, e.message)

    async def CudaSharedMemoryUnregister(self, request, context):
        return service_pb2.CudaSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):
        await self._sync(context, cuda_shm_status, request.name)
        return service_pb2.CudaSharedMemoryStatusResponse()

    # ---------------------------------------------------------------- inference
    async def ModelInfer(self, request, context):
        traced: list = []  # the request's trace, once its model is known and its setting samples it
        answer = await self._call(context, self._infer(request, context, traced=traced, read=time.monotonic_ns()))
        if traced:
            traced[0].stamp("GRPC_SEND_START")  # (an error's answer: at its call's end, _sent)
        return answer

    def _trace(self, request, read: int) -> Optional[Trace]:
        """The request's trace when its trace setting samples it. gRPC hands the handler a whole
        request (``read``: the handler's start): its wait for it, Triton's GRPC_WAITREAD, is not
        seen here, and both ends are that instant."""
        trace = self.core.tracer.sample(request.model_name, request.id)
        if trace is not None:
            trace.stamp("GRPC_WAITREAD_START", read)
            trace.stamp("GRPC_WAITREAD_END", read)
        return trace

    def _sent(self, trace: Trace) -> None:
        if not any(name == "GRPC_SEND_START" for name, _ in trace.stamps):  # an error's answer
            trace.stamp("GRPC_SEND_START")
        trace.stamp("GRPC_SEND_END")
        self.core.tracer.finish(trace)

    async def ModelStreamInfer(self, request_iterator, context):
        """tritonclient's ``start_stream`` / ``stream_infer``: every request of the stream runs as
        ModelInfer does, all at once, and the answers go back in the order the requests came, as
        Triton answers a stream to a model that is not decoupled (a client may pair them by order:
        tritonclient's default request id is ""); an error answers its request only, in
        ``error_message``, as Triton's stream does; so does an answer past the send limit (gRPC
        ended the stream on it, and the answers behind it were lost). A client that closes the
        stream withdraws what it still has queued. A stream is not read on while its requests
        read and not yet answered may hold more than STREAM_HELD_BYTES, or than one full batch
        of the largest model it asked for (their tensors, at their sizes; gRPC's flow control
        then holds back the client's sends): read on, a client that did not read its answers had
        every one of them held in the front door's pool (704 MiB in a review, kept after the
        stream ended)."""
        order: asyncio.Queue = asyncio.Queue()  # each request's answer, running, in arrival order
        running: set = set()
        reserved: dict = {}  # each request's task -> what it may hold until its answer is sent
        held = 0  # their sum
        limit = STREAM_HELD_BYTES  # or a full batch of the largest model the stream asked for
        room = asyncio.Event()  # set while held is within the limit
        room.set()

        def hold(task, nbytes: int) -> None:
            nonlocal held
            held += nbytes - reserved.get(task, 0)
            reserved[task] = nbytes
            if held > limit:
                room.clear()

        def finished(task) -> None:
            running.discard(task)
            # An answer past what its request reserved (a model whose spec was not known yet)
            # counts at its size, unless it is sent already (this callback may come after the
            # answer went: counted then, it was never given back, and the stream stalled).
            if (task in reserved and not task.cancelled()
                    and (size := _held_bytes(task.result())) > reserved[task]):
                hold(task, size)

        traces: dict = {}  # each request's task -> its trace, once sampled (a list of it)

        async def answer(request, read: int, traced: list, emit=None):
            try:
                return await self._infer(request, context, stream=True, traced=traced, read=read, emit=emit)
            except Exception as e:  # noqa: BLE001 -- answers its own request; the stream goes on
                if not isinstance(e, (KServeError, *MALFORMED)):  # not the request's fault: say so once
                    log.exception("stream request for model %r failed", request.model_name)
                    e = KServeError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")
                return _stream_error(service_pb2.ModelInferResponse(
                    model_name=request.model_name, id=request.id, model_version=request.model_version),
                    as_kserve(e))

        decoupled: set = set()  # LLM requests' tasks (a decoupled model's), queued as they finish

        async def read():
            nonlocal limit
            try:
                async for request in request_iterator:
                    if request is UNPARSABLE:  # the stream's end (_add_servicer)
                        break
                    traced: list = []  # (known from the start: a stream cancelled before the answer lost it)
                    llm = self.core.serves_llm(request.model_name)
                    # A decoupled model's responses before its last are sent as they come (done
                    # futures in the order queue, held until sent: a client that reads none no
                    # longer has more requests read while they pile up; not traced).
                    emit = _sent_now(order, hold) if llm else None
                    task = asyncio.ensure_future(answer(request, time.monotonic_ns(), traced, emit))
                    traces[task] = traced
                    nbytes, batch = _stream_reservation(request, self.core.client.specs)
                    limit = max(limit, batch)
                    hold(task, nbytes)
                    running.add(task)
                    task.add_done_callback(finished)
                    if llm:
                        # As Triton answers a decoupled model: when done, not after the requests
                        # before it (a slow completion held back every answer behind it).
                        decoupled.add(task)
                        task.add_done_callback(lambda t: (decoupled.discard(t), order.put_nowait(t)))
                    else:
                        order.put_nowait(task)
                    await room.wait()
                while decoupled:  # (the stream's end waits for their answers)
                    await asyncio.wait(set(decoupled))
            finally:
                order.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (task := await order.get()) is not None:
                message = await task
                traced = traces.pop(task, None)
                trace = traced[0] if traced else None
                if trace is None:
                    yield message
                else:
                    trace.stamp("GRPC_SEND_START")
                    try:
                        yield message
                    finally:  # (the stream may end here)
                        self._sent(trace)
                held -= reserved.pop(task, 0)
                if held <= limit:
                    room.set()
            await reader  # its failure (a broken stream) is the stream's
        finally:
            for task in (reader, *running):
                task.cancel()
            for traced in traces.values():  # requests the stream ended before answering
                for trace in traced:
                    self.core.tracer.finish(trace)

    async def _infer(self, request, context, stream: bool = False, traced: Optional[list] = None,
                     read: int = 0, emit: Optional[Callable] = None) -> InferAnswer:
        """The answer to ``request`` (``stream``: on ModelStreamInfer); one past the send limit is
        an error, which counts the request failed. ``traced``: gets the request's trace, when its
        setting samples it (``read``: when the handler had it). ``emit``: sends an LLM model's
        responses before its last."""
        if self.core.llm_model(request.model_name, request.model_version):
            if not stream:  # (Triton's answer for a decoupled model)
                raise KServeError(grpc.StatusCode.UNIMPLEMENTED, DECOUPLED_GRPC)
            return await self._llm_infer(request, emit)
        # An unknown model (then version) is the error to report first.
        spec = await self.core.spec(request.model_name, request.model_version)
        trace = None if traced is None else self._trace(request, read)  # (as Triton: known models only)
        if trace is not None:
            traced.append(trace)
            if not stream:
                context.add_done_callback(lambda _: self._sent(trace))  # (an error's answer too)
        shm = self.core.shm
        uid = self._uid(context) if _uses_shm(request) else None
        inputs: dict[str, np.ndarray] = {}
        raw = iter(request.raw_input_contents)  # in the order of the inputs not in shared memory
        for t in request.inputs:
            shape = list(t.shape)
            check_new_input(inputs, t.name, shape, request.model_name)
            check_input_name(spec, t.name)
            region = _shm_param(t.parameters, t.name)
            if region is not None:
                inputs[t.name] = shm.read(*region, t.datatype, shape, t.name, spec, uid, self.core.input_array)
            elif request.raw_input_contents:
                if t.HasField("contents"):
                    raise invalid(f"contents field must not be specified when using raw_input_contents for "
                                  f"'{t.name}' for model '{request.model_name}'")
                data = next(raw, None)
                if data is None:
                    raise invalid(f"expected raw input content for input '{t.name}' "
                                  f"({len(request.raw_input_contents)} given for {len(request.inputs)} inputs)")
                check_declared_input(spec, t.name, t.datatype, shape)
                inputs[t.name] = tensor_from_bytes(t.name, t.datatype, shape, data)
            else:
                # The datatype first: BYTES (no typed field here) in bytes_contents was "of type
                # 'BYTES', expected datatype 'BYTES'".
                np_dtype(t.datatype, f"input '{t.name}'")
                field = _CONTENTS.get(t.datatype, "")
                check_contents_field(t, field, request.model_name)
                values = getattr(t.contents, field) if field else []
                # Checked before the values are turned into Python objects (tens of bytes each):
                # 100 MiB of contents for a [1, 16] input took 1.6-2.8 GB and held the loop 5-12 s.
                check_declared_input(spec, t.name, t.datatype, shape)
                check_element_count(t.name, shape, len(values))
                inputs[t.name] = tensor_from_list(t.name, t.datatype, shape, list(values))
        wanted = self._requested_outputs(request, spec, inputs, uid)
        try:
            check_parameter_names(request.parameters, ("triton_enable_empty_final_response",))
            left = context.time_remaining()
            priority = uint_param(request.parameters, "priority", ("int64_param", "uint64_param"))
            timeout = uint_param(request.parameters, "timeout", ("int64_param",), cast=True)
            limit, by_deadline = timeout_s(timeout, left)

            ranked = [(name, classes, True) for name, classes, _ in wanted if classes is not None]

            def answer(out, labels: dict) -> InferAnswer:
                head = service_pb2.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
                raw = []
                for name, classes, region in wanted:
                    arr = out[name]
                    if region is not None:
                        region.write(arr, name)  # (Triton 2.51 names no region in the answer: nor does this)
                    if classes is not None:  # (with a region too where two mentions asked each, as Triton)
                        shape, data = labels[name]
                        head.outputs.add(name=name, datatype="BYTES", shape=shape)
                        raw.append(data)
                        continue
                    head.outputs.add(name=name, datatype=NP_TO_KSERVE[dtype_name(arr.dtype)], shape=arr.shape)
                    # b"" for a region's keeps later outputs at their index
                    raw.append(b"" if region is not None else byte_view(arr))
                if stream:
                    _mark_final(head)
                message = InferAnswer(head, raw, stream)
                # Counted, not encoded (ByteSize encoded the whole answer: ~450 ms for 256 MiB, on
                # the loop); past 2 GiB protobuf could not even copy it into the stream's message.
                if (size := message.nbytes()) > self.max_send_bytes:
                    raise too_large(size, self.max_send_bytes)
                return message

            _, message = await self.core.infer(
                request.model_name, inputs, priority=priority, timeout=limit, grpc_deadline=by_deadline,
                reply=lambda out: answer_ranked(answer, out, ranked, self.core.ranker), trace=trace)
            return message
        finally:
            close_outputs(wanted)

    async def _llm_infer(self, request, emit: Optional[Callable] = None) -> InferAnswer:
        """An LLM model's answer on a stream, as Triton's vLLM backend answers (llm_generate):
        the whole completion in one response, marked final; under its ``stream`` input, one
        response an engine step, given to ``emit`` but the last, returned marked final."""
        inputs, params = grpc_request(request.model_name, request)

        def response(members: dict, final: bool) -> InferAnswer:
            head = service_pb2.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
            raw = []
            for name, datatype, shape, data in grpc_outputs(members):
                head.outputs.add(name=name, datatype=datatype, shape=shape)
                raw.append(data)
            _mark_final(head, final)
            return InferAnswer(head, raw, stream=True)

        step = None if emit is None else (lambda members: emit(response(members, final=False)))

        async def run() -> dict:  # (a refusal of the backend's counts as the model's failure)
            return await self.core.llm.run(request.model_name, *read_backend_request(inputs, params),
                                           emit=step)

        return response(await self.core.llm_run(request.model_name, run()), final=True)

    def _requested_outputs(self, request, spec, inputs: dict,
                           uid: Optional[int]) -> list[tuple[str, Optional[int], Optional[OutputRegion]]]:
        """(name, its class count or None, its shm region or None) per output to return; all of
        the model's when none named. The regions are held until ``close_outputs``. An output
        named more than once is returned once (Triton 2.51 answers it once; this returned it
        twice), with the region of the first mention that names one and the class count of the
        first that asks one, as Triton keeps each (its infer_handler.h: one map of each,
        ``emplace``): asked plain then classified, it is classified; in a region by one mention
        and classified by another, it is written to the region and answered classified."""
        if not request.outputs:
            return [(t.name, None, None) for t in spec.outputs]
        tensors = {t.name: t for t in spec.outputs}
        found: dict[str, list] = {}  # name -> [class count, region]
        try:
            for o in request.outputs:
                t = tensors.get(o.name)
                if t is None:
                    raise invalid(f"unexpected inference output '{o.name}' for model '{spec.name}'")
                # Every mention's parameters are Triton's to check, in its order; each region
                # named is looked up, as Triton's GetMemoryInfo does for every mention.
                region = _shm_param(o.parameters, o.name)
                classes = _class_count(o.parameters)
                if region is not None and classes is not None:
                    raise invalid("output can't set both 'shared_memory_region' and 'classification'")
                if classes is not None:
                    check_classifiable(NP_TO_KSERVE.get(t.dtype, t.dtype), math.prod(t.shape))
                entry = found.setdefault(o.name, [None, None])
                if region is not None:
                    # A later mention's region is looked up (registered, its range in bounds), not
                    # measured against the output: Triton's allocator sees the first one only.
                    nbytes = output_nbytes(spec, o.name, inputs) if entry[1] is None else None
                    region = self.core.shm.output(*region, o.name, nbytes, uid)
                    if entry[1] is None:
                        entry[1] = region
                    else:
                        region.close()
                if entry[0] is None:
                    entry[0] = classes
        except BaseException:
            close_outputs(list(found.values()))
            raise
        return in_model_order(spec, [(name, classes, region) for name, (classes, region) in found.items()])

    # ---------------------------------------------------------------- errors
    @staticmethod
    async def _call(context, coro):
        # The abort is raised after the except blocks, not in them: raised there, it kept the
        # request's error as its context, and with it the frames of the request's coroutines and
        # their inputs (in the Batchyard client's pool) until the cycle collector ran: requests
        # refused after reading 8 MiB of shared memory grew the pool from 1 segment of 64 MiB to
        # 6 after 200 of them, 7 after 400.
        try:
            return await coro
        except (KServeError, *MALFORMED) as e:
            e = as_kserve(e)
            code, message = e.code, e.message
        except grpc.aio.AbortError:  # aborted already, with its own code
            raise
        except Exception as e:  # noqa: BLE001 -- INTERNAL with its kind, not gRPC's UNKNOWN naming a class
            log.exception("request failed")
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}"
        await context.abort(code, message)

    @staticmethod
    async def _sync(context, fn, *args):
        try:
            return fn(*args)
        except KServeError as e:
            await context.abort(e.code, e.message)


class _Handlers:
    """Takes the handlers tritonclient's generated code registers (its serializers, its method
    names), for two to be changed before they reach the server."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # the same handlers, given again in the form below

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, dict(handlers)


class _Unparsable:
    """A request whose bytes protobuf could not parse (grpc.aio answered the failure UNKNOWN
    "Unexpected <class 'google.protobuf.message.DecodeError'>", naming a class)."""


UNPARSABLE = _Unparsable()


def _parsing(deserializer):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except DecodeError:  # also a string field's invalid UTF-8
            return UNPARSABLE
    return parse


def _refusing_unparsable(behaviour):
    """A unary method that answers an unparsable request as Triton's gRPC server does."""
    async def call(request, context):
        if request is UNPARSABLE:
            await context.abort(grpc.StatusCode.INTERNAL, "Unable to parse request")
        return await behaviour(request, context)
    return call


def _add_servicer(servicer: KServeServicer, server) -> None:
    """``servicer`` on ``server`` as tritonclient's generated code adds it, except ModelInfer's
    and ModelStreamInfer's requests and answers, whose raw tensor bytes stay out of protobuf
    (kserve_grpc_wire), and requests protobuf cannot parse: INTERNAL "Unable to parse request",
    and on a stream its end, after the answers of the requests before it, as Triton's (gRPC
    C++ answers the one and ends the other's reads)."""
    taken = _Handlers()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, taken)
    handlers = taken.handlers
    handlers["ModelInfer"] = handlers["ModelInfer"]._replace(request_deserializer=parse_infer_request,
                                                             response_serializer=serialize_answer)
    handlers["ModelStreamInfer"] = handlers["ModelStreamInfer"]._replace(request_deserializer=parse_infer_request,
                                                                         response_serializer=serialize_answer)
    for name, h in handlers.items():
        h = h._replace(request_deserializer=_parsing(h.request_deserializer))
        if h.unary_unary is not None:
            h = h._replace(unary_unary=_refusing_unparsable(h.unary_unary))
        handlers[name] = h
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(taken.service, handlers),))
    server.add_registered_method_handlers(taken.service, handlers)


async def start_grpc(core: KServeCore, host: str, port: int, max_message_bytes: int = (1 << 31) - 1,
                     idle_timeout_s: float = 75.0, restricted_apis=(),
                     credentials: Optional[grpc.ServerCredentials] = None) -> grpc.aio.Server:
    """A started grpc.aio server on host:port, sharing the port with this node's other front-door
    processes (SO_REUSEPORT: the kernel spreads connections over them). ``idle_timeout_s``: a
    connection with no call in flight for that long is closed (GOAWAY; a client's channel opens
    a new one at its next call), as an idle HTTP connection is. gRPC's default keeps it for ever:
    a client that opened connections and stopped calling held a descriptor each.
    ``restricted_apis``: the config's ``[[frontend.restricted_apis]]`` (kserve_restrict); without
    any for gRPC no interceptor runs. ``credentials``: TLS (server_credentials), or plaintext."""
    restrictions = Restrictions(restricted_apis, "grpc")
    opts = [("grpc.so_reuseport", 1), ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_connection_idle_ms", max(1, round(idle_timeout_s * 1000)))]
    server = grpc.aio.server(options=opts, interceptors=[GrpcRestrictions(restrictions)] if restrictions else None)
    _add_servicer(KServeServicer(core, port, host, max_message_bytes), server)
    try:
        # An IPv6 address in brackets: "::1:8001" read as one address, on port 443.
        address = grpc_listen_address(host, port)
        bound = (server.add_insecure_port(address) if credentials is None
                 else server.add_secure_port(address, credentials))
    except RuntimeError as e:  # grpcio raises where older ones returned 0: one line, not a traceback
        raise OSError(f"cannot bind gRPC to {host}:{port}: {e}") from None
    if bound == 0:
        raise OSError(f"cannot bind gRPC to {host}:{port}")
    await server.start()
    return server
