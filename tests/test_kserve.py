"""The KServe v2 front door, driven the way a Triton user drives Triton: tritonclient's gRPC and
HTTP clients and their asyncio variants, against a node run by `batchyard up` with a [frontend]."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gzip
import http.client
import importlib.util
import json
import os
import queue
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
import shutil
import warnings
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
import tritonclient.http as thttp
import tritonclient.http.aio as thttp_aio
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from batchyard.addresses import free_port as _free_port
from batchyard import protocol as P
from batchyard.client import Client
from batchyard.config import DispatcherConfig, FrontendConfig, ModelConfig, NodeConfig, TensorConfig, to_toml
from batchyard.kserve_common import KServeCore, KServeError, tensor_from_list
from batchyard.kserve_shm import ShmRegions
from batchyard.kserve_trace import Tracer

from conftest import ROOT, SUM_MODEL, Node, perf_analyzer_ran, ready_notify_socket, said_ready, sim_worker

SLOW_MODEL = ModelConfig(name="slow", max_batch=16, inputs=(TensorConfig("x", "float32", (4,)),),
                         outputs=(TensorConfig("y", "float32", (2,)),))
SOLO_MODEL = ModelConfig(name="solo", max_batch=16, inputs=(TensorConfig("x", "float32", (4,)),),
                         outputs=(TensorConfig("y", "float32", (2,)),))
HUGE_MODEL = ModelConfig(name="huge", max_batch=32, inputs=(TensorConfig("x", "float32", (1024, 1024)),),
                         outputs=(TensorConfig("y", "float32", (2,)),))  # 4 MiB an item
X = np.arange(12, dtype=np.float32).reshape(3, 4)


class FrontDoor:
    def __init__(self, node: Node, grpc_port: int, http_port: int):
        self.node = node
        self.grpc_url = f"127.0.0.1:{grpc_port}"
        self.http_url = f"127.0.0.1:{http_port}"

    def sdk(self, model: str, x: np.ndarray) -> np.ndarray:
        with Client(self.node.address) as c:
            return c.infer(model, {"x": x})["y"]


@pytest.fixture(scope="module")
def front_door():
    """One node for the module: `sum` (fast), `slow` (300 ms a batch) and `solo` (its own worker,
    which the readiness test stops), plus two front-door processes sharing free ports."""
    with _node_with_front_door(processes=2) as fd:
        yield fd


@contextlib.contextmanager
def _node_with_front_door(dispatcher=None, models=None, workers=None, **frontend):
    """``models`` and ``workers``: the node's, where not this module's own."""
    run_dir = tempfile.mkdtemp(prefix="by-", dir="/tmp")
    grpc_port, http_port = _free_port(), _free_port()
    cfg = NodeConfig(
        dispatcher=DispatcherConfig(**{"frontend": f"ipc://{run_dir}/fe", "backend": f"ipc://{run_dir}/be",
                                       "heartbeat_interval_s": 0.1, "worker_dead_after_s": 0.6, **(dispatcher or {})}),
        models=models or (SUM_MODEL, SLOW_MODEL, SOLO_MODEL, HUGE_MODEL),
        workers=workers or (sim_worker("sim0", models=("sum", "huge")),
                            sim_worker("slow0", models=("slow",), launch_us=300_000.0),
                            sim_worker("solo0", models=("solo",))),
        frontend=FrontendConfig(grpc_port=grpc_port, http_port=http_port, **frontend)).validate()
    path = Path(run_dir) / "node.toml"
    path.write_text(to_toml(cfg))
    # `up` says READY=1 the systemd way once every worker has registered and every front-door
    # process serves its ports: wait for that datagram, or for `up` to exit.
    notify, env = ready_notify_socket(run_dir)
    up = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "up", "--config", str(path)], cwd=ROOT,
                          stdout=subprocess.DEVNULL, env=env)
    node = Node(cfg, up, run_dir)
    try:
        assert said_ready(notify, up), f"`up` did not become ready (exit code {up.poll()})"
        n = cfg.frontend.processes
        assert len(_listeners(up.pid, grpc_port)) == n and len(_listeners(up.pid, http_port)) == n
        yield FrontDoor(node, grpc_port, http_port)
    finally:
        node.stop()
        notify.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _listeners(root_pid: int, port: int) -> set[int]:
    """The processes under ``root_pid`` listening on ``port``."""
    pids = set()
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")):
                pids.add(p.pid)
        except psutil.Error:
            pass
    return pids


def _grpc_input(x, dtype="FP32", name="x"):
    i = tgrpc.InferInput(name, list(x.shape), dtype)
    i.set_data_from_numpy(x)
    return i


def _http_input(x, dtype="FP32", binary=True):
    i = thttp.InferInput("x", list(x.shape), dtype)
    i.set_data_from_numpy(x, binary_data=binary)
    return i


def _shm_io(mod, region_in: str, region_out: str, out_bytes: int = 24):
    """The input x of X and the output y of ``mod`` (tritonclient.grpc or .http), in these regions."""
    i = mod.InferInput("x", [3, 4], "FP32")
    i.set_shared_memory(region_in, X.nbytes)
    o = mod.InferRequestedOutput("y")
    o.set_shared_memory(region_out, out_bytes)
    return i, o


# ---------------------------------------------------------------- the calls a Triton user makes
def test_grpc_metadata_config_and_infer_equal_the_sdk(front_door):
    c = tgrpc.InferenceServerClient(front_door.grpc_url)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("sum")
    md = c.get_model_metadata("sum", as_json=True)
    assert md["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "4"]}]
    cfg = c.get_model_config("sum", as_json=True)["config"]
    assert cfg["max_batch_size"] == 16 and cfg["input"][0]["data_type"] == "TYPE_FP32"
    # as Triton fills them in: one version; an instance group of the workers serving it, by path
    assert cfg["version_policy"] == {"latest": {"num_versions": 1}}
    assert cfg["instance_group"] == [{"name": "sum_0", "kind": "KIND_GPU", "count": 1}], cfg
    assert thttp.InferenceServerClient(front_door.http_url).get_model_config("sum")["instance_group"] == [
        {"name": "sum_0", "kind": "KIND_GPU", "count": 1}]
    out = c.infer("sum", [_grpc_input(X)], priority=1, timeout=5_000_000).as_numpy("y")
    np.testing.assert_array_equal(out, front_door.sdk("sum", X))
    stats = c.get_inference_statistics("sum", as_json=True)["model_stats"][0]
    assert int(stats["inference_stats"]["success"]["count"]) >= 1


@pytest.mark.parametrize("binary", [True, False])
def test_http_infer_equals_the_sdk_json_and_binary(front_door, binary):
    c = thttp.InferenceServerClient(front_door.http_url)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("sum")
    assert c.get_model_config("sum")["output"][0]["dims"] == [2]
    res = c.infer("sum", [_http_input(X, binary=binary)], outputs=[thttp.InferRequestedOutput("y", binary_data=binary)])
    np.testing.assert_array_equal(res.as_numpy("y"), front_door.sdk("sum", X))


def test_aio_clients_equal_the_sdk(front_door):
    want = front_door.sdk("sum", X)

    async def run():
        g = tgrpc_aio.InferenceServerClient(front_door.grpc_url)
        h = thttp_aio.InferenceServerClient(front_door.http_url)
        try:
            assert await g.is_model_ready("sum") and await h.is_model_ready("sum")
            hi = thttp_aio.InferInput("x", [3, 4], "FP32")
            hi.set_data_from_numpy(X)
            res = await asyncio.gather(*[g.infer("sum", [_grpc_input(X)]) for _ in range(8)],
                                       *[h.infer("sum", [hi]) for _ in range(8)])
            return [r.as_numpy("y") for r in res]
        finally:
            await g.close()
            await h.close()

    for out in asyncio.run(run()):
        np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_http_requests_are_served(front_door, algorithm):
    """tritonclient's request/response compression (Content-Encoding): a compressed request
    got a 500 when the body was decompressed a second time."""
    c = thttp.InferenceServerClient(front_door.http_url)
    res = c.infer("sum", [_http_input(X)], request_compression_algorithm=algorithm,
                  response_compression_algorithm=algorithm)
    np.testing.assert_array_equal(res.as_numpy("y"), front_door.sdk("sum", X))


def test_a_body_that_does_not_decompress_is_a_bad_request(front_door):
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://{front_door.http_url}/v2/models/sum/infer", data=b"not gzip",
                                 headers={"Content-Encoding": "gzip"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "cannot be read" in json.loads(e.value.read())["error"]
    # An encoding it does not take: Triton's UNSUPPORTED, 501, saying which it takes (it was 400).
    # Triton 2.51 compares the names as they are: "GZIP", "Identity", "x-gzip" or an empty value is
    # one (they were taken here).
    body = json.dumps({"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": X.ravel().tolist()}]})
    for encoding, data in (("br", b"x"), ("GZIP", gzip.compress(body.encode())), ("x-gzip", gzip.compress(body.encode())),
                           ("Identity", body.encode()), ("", body.encode())):
        req = urllib.request.Request(f"http://{front_door.http_url}/v2/models/sum/infer", data=data,
                                     headers={"Content-Encoding": encoding}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 501 and e.value.headers["Accept-Encoding"] == "gzip, deflate", encoding


def test_a_compressed_body_inflates_only_up_to_the_limit():
    """aiohttp inflated a body on the event loop, bounded only by the body-size limit: a 1 MiB
    gzip upload that expands to 1 GiB took 2 GB and held every client of the process for 16 s.
    Bodies are now inflated on a thread (http_body) and refused past the limit."""
    import gzip
    import zlib

    from batchyard.http_body import _WBITS, inflate
    from batchyard.kserve_common import KServeError

    bomb = gzip.compress(bytes(64 << 20))  # 64 KiB that inflate to 64 MiB
    with pytest.raises(KServeError, match="decompresses to more than 1048576 bytes"):
        inflate(bomb, _WBITS["gzip"], 1 << 20)
    assert inflate(gzip.compress(b"abc"), _WBITS["gzip"], 3) == b"abc"
    assert inflate(zlib.compress(b"abc"), _WBITS["deflate"], 3) == b"abc"
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert inflate(raw.compress(b"abc") + raw.flush(), _WBITS["deflate"], 3) == b"abc"  # raw deflate too
    with pytest.raises(KServeError, match="ends early"):
        inflate(gzip.compress(b"abc" * 100)[:-12], _WBITS["gzip"], 1000)
    with pytest.raises(KServeError, match="data follows"):  # a second member was dropped silently
        inflate(gzip.compress(b"abc") + gzip.compress(b"def"), _WBITS["gzip"], 1000)


def test_a_client_that_hangs_up_while_its_body_inflates_keeps_its_inflation_slot_until_it_ends(monkeypatch):
    """A hang-up cancels the handler, which let go of its slot of the INFLATING (2) bodies inflated
    at once while its thread went on inflating: 16 clients that sent gzip bodies and hung up ran
    5-6 inflations at once, each up to a route's limit of memory (an outside review)."""
    from batchyard import http_body

    entered, go = threading.Semaphore(0), threading.Event()

    def inflate(raw, wbits, limit):
        entered.release()
        go.wait(30)
        return raw

    async def raw_body(request, raw_limit=0):
        return b"{}"

    monkeypatch.setattr(http_body, "inflate", inflate)
    monkeypatch.setattr(http_body, "_read_raw", raw_body)
    monkeypatch.setattr(http_body, "_inflating", None)
    request = types.SimpleNamespace(headers={"Content-Encoding": "gzip"}, client_max_size=1 << 20)

    async def main():
        gone = [asyncio.ensure_future(http_body.read_body(request)) for _ in range(http_body.INFLATING)]
        for _ in gone:
            await asyncio.to_thread(entered.acquire, timeout=30)  # both inflating
        for handler in gone:
            handler.cancel()  # their clients hang up
        waiting = asyncio.ensure_future(http_body.read_body(request))
        for _ in range(5):
            await asyncio.sleep(0)  # (the loop's steps that the cancellations take)
        queued = len(http_body._inflating._waiters or ())
        go.set()
        return queued, await waiting

    try:
        assert asyncio.run(main()) == (1, b"{}")  # the third waited for a slot
    finally:
        go.set()


_any_json = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 80, 2 ** 80) | st.floats() | st.text(),
                         lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                     max_size=4), max_leaves=12)


@given(_any_json)
@settings(max_examples=300, deadline=None)
def test_request_json_is_read_as_json_loads_reads_it(value):
    """Request bodies are decoded by msgspec (3x less time holding the front door's loop for a
    62 MiB tensor, `kserve_bench stall`), falling back to ``json`` for what msgspec refuses:
    every body reads exactly as ``json.loads`` read it, NaN and Infinity (which Triton takes)
    and integers past 64 bits included."""
    from batchyard.kserve_http import decode_json

    raw = json.dumps(value).encode()
    assert json.dumps(decode_json(raw)) == json.dumps(json.loads(raw))


@given(st.lists(st.floats(width=32), min_size=1, max_size=20), st.text(max_size=4))
@settings(max_examples=200, deadline=None)
def test_an_infer_reply_reads_as_json_dumps_wrote_it(values, rid):
    """Replies are encoded by msgspec unless they hold a NaN or an Infinity, which ``json`` writes
    as Triton does (msgspec would write null): whichever writes it, the reply reads back the same
    as ``json.dumps`` of it."""
    from batchyard.kserve_http import encode_json

    arr = np.asarray(values, np.float32)
    reply = {"model_name": "m", "model_version": "1", "id": rid,
             "outputs": [{"name": "y", "datatype": "FP32", "shape": [arr.size], "data": arr.tolist()}]}
    text = encode_json(reply, bool(np.isfinite(arr).all()))
    assert json.dumps(json.loads(text)) == json.dumps(reply)


def test_a_reply_with_a_nan_output_says_nan_as_triton(front_door):
    """Triton writes a NaN output as NaN in its JSON; tritonclient reads it back as NaN."""
    h = thttp.InferenceServerClient(front_door.http_url)
    x = np.full((3, 4), np.nan, np.float32)
    r = h._post("v2/models/sum/infer", json.dumps({"inputs": [
        {"name": "x", "shape": [3, 4], "datatype": "FP32", "data": x.ravel().tolist()}]}), None, None)
    text = r.read()
    assert r.status_code == 200 and b"NaN" in text and b"null" not in text, text
    assert np.isnan(h.infer("sum", [_http_input(x, binary=False)]).as_numpy("y")).all()


@pytest.mark.parametrize("datatype, data, want", [
    ("UINT8", [-1, 2], "non-unsigned-integer as unsigned-integer"),
    ("UINT64", [-1, 2**64 - 1], "non-unsigned-integer as unsigned-integer"),
    ("UINT64", [2**64, 1], "non-unsigned-integer as unsigned-integer"),
    ("INT64", [2**63, 1], "non-signed-integer as signed-integer"),
    ("INT32", [2**63, 2**64 - 1], "non-signed-integer as signed-integer"),
    ("UINT64", [2**64 - 1, 1], [2**64 - 1, 1]),
    ("INT8", [300, -1], [44, -1]),  # within int64 Triton narrows, as astype does
])
def test_json_integers_a_tensor_cannot_hold_are_tritons_error_not_wrapped(datatype, data, want):
    """Triton reads an unsigned tensor's JSON values as unsigned integers and a signed one's as
    int64, refusing what does not read so: -1 in a UINT8 tensor was served as 255, and 2**63 in
    an INT64 one as its lowest value. A UINT64 of 2**64-1 beside a small value, which Triton takes,
    was refused."""
    if isinstance(want, str):
        with pytest.raises(KServeError, match=want) as e:
            tensor_from_list("x", datatype, [1, 2], data)
        assert e.value.code.name == "INVALID_ARGUMENT"
    else:
        assert tensor_from_list("x", datatype, [1, 2], data).tolist() == [want]


@pytest.mark.parametrize("raw", [b'"\\ud800"', b"[NaN, -Infinity]", b'{"a": 1, "a": 2}', b"{}x", b"", b"[1,"])
def test_request_json_edge_cases_read_or_fail_as_json_loads(raw):
    """(Not a number past a double, which json reads as inf: Triton refuses it, and so does the
    front door, test_a_json_number_past_a_double_is_refused_not_read_as_infinity.)"""
    from batchyard.kserve_http import decode_json

    try:
        want = json.dumps(json.loads(raw))
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e))):
            decode_json(raw)
    else:
        assert json.dumps(decode_json(raw)) == want


def test_a_compressed_infer_body_inflates_no_further_than_the_model_can_use(front_door):
    """The limit was the 2 GiB body limit: 1.5 MB of gzip held 3 GB. An infer body inflates to at
    most the JSON limit (64 MiB) plus a whole batch of the model's inputs."""
    import gzip
    import http.client

    bomb = gzip.compress(b" " * (65 << 20), 1)
    host, port = front_door.http_url.split(":")

    c = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        c.request("POST", "/v2/models/sum/infer", body=bomb, headers={"Content-Encoding": "gzip"})
        r = c.getresponse()
        status, text = r.status, r.read()
    finally:
        c.close()
    assert status == 400 and b"decompresses to more than" in text, text
    np.testing.assert_array_equal(thttp.InferenceServerClient(front_door.http_url).infer(
        "sum", [_http_input(X)]).as_numpy("y"), front_door.sdk("sum", X))


def test_a_long_unknown_model_name_is_not_found_over_grpc(front_door):
    """Echoed whole, a 10 KB name made the gRPC trailer too big: RESOURCE_EXHAUSTED."""
    c = tgrpc.InferenceServerClient(front_door.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        c.infer("m" * 10_000, [_grpc_input(X)])
    assert e.value.status() == "StatusCode.NOT_FOUND" and "..." in e.value.message(), e.value


def test_errors_naming_any_long_string_the_client_chose_keep_their_code_over_grpc(front_door):
    """A region, key, input, output, datatype or version of 20,000 characters, echoed whole in the
    error, made the gRPC trailer too big: the client saw RESOURCE_EXHAUSTED instead."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    n = "n" * 20_000

    def infer(**tensor):
        r = service_pb2.ModelInferRequest(model_name="sum")
        t = r.inputs.add(**({"name": "x", "datatype": "FP32", "shape": [3, 4]} | tensor))
        r.raw_input_contents.append(X.tobytes())
        return t, r

    with_output = infer()[1]
    with_output.outputs.add(name=n)
    region_input, with_region = infer()
    region_input.parameters["shared_memory_region"].string_param = n
    region_input.parameters["shared_memory_byte_size"].int64_param = X.nbytes
    with grpc.insecure_channel(front_door.grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        for call, request, code in (
                (stub.SystemSharedMemoryStatus, service_pb2.SystemSharedMemoryStatusRequest(name=n), "NOT_FOUND"),
                (stub.SystemSharedMemoryRegister, service_pb2.SystemSharedMemoryRegisterRequest(
                    name="long_key", key=n, byte_size=8), "INVALID_ARGUMENT"),
                (stub.ModelInfer, infer(name=n)[1], "INVALID_ARGUMENT"),
                (stub.ModelInfer, with_output, "INVALID_ARGUMENT"),
                (stub.ModelInfer, with_region, "NOT_FOUND"),
                (stub.ModelInfer, infer(datatype="FP32" + n)[1], "INVALID_ARGUMENT"),
                (stub.ModelMetadata, service_pb2.ModelMetadataRequest(name="sum", version="9" * 20_000),
                 "INVALID_ARGUMENT")):
            with pytest.raises(grpc.RpcError) as e:
                call(request, timeout=30)
            assert e.value.code().name == code, (call, e.value.code(), e.value.details()[:200])


_names = st.text(st.characters(codec="utf-8"), max_size=5)


@st.composite
def _infer_requests(draw):
    """ModelInferRequests with every top-level field, raw contents of 0 to 300 bytes."""
    r = service_pb2.ModelInferRequest(model_name=draw(_names), model_version=draw(_names), id=draw(_names))
    for key in draw(st.lists(_names, max_size=3, unique=True)):
        r.parameters[key].int64_param = draw(st.integers(-2 ** 63, 2 ** 63 - 1))
    for _ in range(draw(st.integers(0, 3))):
        r.inputs.add(name=draw(_names), datatype="FP32", shape=draw(st.lists(st.integers(-1, 2 ** 40), max_size=3)))
    for _ in range(draw(st.integers(0, 2))):
        r.outputs.add(name=draw(_names))
    r.raw_input_contents.extend(draw(st.lists(st.binary(max_size=300), max_size=4)))
    return r


@settings(max_examples=300, deadline=None)
@given(_infer_requests(), st.randoms())
def test_a_grpc_request_is_read_as_protobuf_reads_it_with_its_raw_contents_as_views(request, rnd):
    """ModelInfer's deserializer leaves the raw contents in the bytes received (protobuf copied
    them twice: 4 MiB in and out cost ~20 ms of the front door's CPU a request, ~2 over HTTP):
    every other field as protobuf reads it, in any order of the fields on the wire."""
    from batchyard import kserve_grpc_wire
    from batchyard.kserve_grpc_wire import parse_infer_request

    fields = [bytes([t]) + v for t, v in _top_level_fields(request.SerializeToString())]
    rnd.shuffle(fields)  # a peer may send a message's fields in any order (raw contents in theirs)
    wire = b"".join(sorted(fields, key=lambda f: f[0] == 0x3A)) if rnd.random() < 0.5 else b"".join(fields)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kserve_grpc_wire, "SCAN_FROM_BYTES", 0)  # scanned whatever its size
        got = parse_infer_request(wire)
    assert type(got) is not service_pb2.ModelInferRequest or not request.raw_input_contents
    want = service_pb2.ModelInferRequest.FromString(wire)
    for name in ("model_name", "model_version", "id", "parameters", "inputs", "outputs"):
        assert getattr(got, name) == getattr(want, name), name
    assert [bytes(d) for d in got.raw_input_contents] == list(want.raw_input_contents)


def _top_level_fields(wire: bytes) -> list:
    """(tag byte, the rest of the field) of each top-level field: every field of these requests
    has a one-byte tag and is length-delimited or a varint."""
    from batchyard.kserve_grpc_wire import _read_varint

    out, i = [], 0
    while i < len(wire):
        tag, j = wire[i], i + 1
        length, k = _read_varint(wire, j)
        end = k + length if tag & 7 == 2 else k
        out.append((tag, wire[j:end]))
        i = end
    return out


@pytest.mark.parametrize("wire", [b"\x3a\x05abc", b"\x3a", b"\x0a\xff", b"\x0b\x00", b"\xff" * 11,
                                  b"\x3a\x01x" * 1100,
                                  b"\xba\x80\x80\x80\x00\x01x",  # field 7's tag in 5 bytes: protobuf reads it
                                  b"\xba\x80\x80\x80\x80\x00\x01x"])  # in 6: protobuf refuses it
def test_a_grpc_request_on_the_edge_is_read_or_refused_as_protobuf_does(wire, monkeypatch):
    """Truncated, malformed, or of more fields than the scan takes: protobuf parses the whole of
    it, refusing what it refuses (gRPC then answers the call UNKNOWN, as before). A tag in 6 bytes
    was read by the scan, and served, where protobuf refuses it (a review's run)."""
    from google.protobuf.message import DecodeError

    from batchyard import kserve_grpc_wire
    from batchyard.kserve_grpc_wire import parse_infer_request

    monkeypatch.setattr(kserve_grpc_wire, "SCAN_FROM_BYTES", 0)  # scanned whatever its size
    try:
        want = service_pb2.ModelInferRequest.FromString(wire)
    except DecodeError:
        with pytest.raises(DecodeError):
            parse_infer_request(wire)
    else:
        got = parse_infer_request(wire)
        assert got.model_name == want.model_name and got.inputs == want.inputs
        assert [bytes(d) for d in got.raw_input_contents] == list(want.raw_input_contents)


@settings(max_examples=200, deadline=None)
@given(_infer_requests(), st.lists(st.binary(max_size=300), max_size=4), st.booleans())
def test_a_grpc_answer_encodes_as_protobuf_would_with_its_raw_outputs_written_once(request, raw, stream):
    """The answer's raw outputs are appended to the rest of its encoding: protobuf reads the same
    message, the stream's wrapping included, and its size is counted without encoding it."""
    from batchyard.kserve_grpc_wire import InferAnswer, serialize_answer

    head = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
    for t in request.inputs:
        head.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
    want = service_pb2.ModelInferResponse()
    want.CopyFrom(head)
    want.raw_output_contents.extend(raw)
    answer = InferAnswer(head, [memoryview(b) for b in raw], stream)
    wire = serialize_answer(answer)
    if stream:
        want = service_pb2.ModelStreamInferResponse(infer_response=want)
        assert service_pb2.ModelStreamInferResponse.FromString(wire) == want
    else:
        assert service_pb2.ModelInferResponse.FromString(wire) == want
    assert answer.nbytes() == len(wire) == want.ByteSize()


def test_a_stream_request_that_raises_answers_alone_and_the_stream_goes_on(front_door):
    """An offset of inf raised OverflowError, which no handler caught: the stream ended with
    UNKNOWN and the requests after it got no answer. (Such an offset, a double_param, is now
    refused by its type, as Triton refuses it.)"""
    got, done = [], threading.Event()

    def callback(result, error):
        got.append(error.message() if error else result.as_numpy("y"))
        if len(got) == 3:
            done.set()

    bad = _grpc_input(X)
    bad.set_shared_memory("nowhere", X.nbytes)
    bad._input.parameters["shared_memory_offset"].double_param = float("inf")
    c = tgrpc.InferenceServerClient(front_door.grpc_url)
    c.start_stream(callback=callback)
    try:
        for inputs in ([_grpc_input(X)], [bad], [_grpc_input(X)]):
            c.async_stream_infer("sum", inputs)
        assert done.wait(30), got
    finally:
        c.stop_stream()
    want = front_door.sdk("sum", X)
    np.testing.assert_array_equal(got[0], want)
    assert "invalid value type for 'shared_memory_offset' parameter for tensor 'x'" in got[1], got[1]
    np.testing.assert_array_equal(got[2], want)
    with pytest.raises(InferenceServerException) as e:  # the same as a unary call: INVALID_ARGUMENT
        c.infer("sum", [bad])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT", e.value


class _Outputs(dict):
    timing = None  # (an AsyncClient's result says how long its batch queued and ran)


def test_an_answer_past_the_send_limit_answers_alone_and_counts_as_failed():
    """A stream answer larger than gRPC's send limit ([frontend] max_request_bytes) ended the
    whole stream, and the answers queued behind it were lost; it counted as a success. Now it is
    that request's error_message, in gRPC's words, and the stream goes on; a unary call gets it
    as RESOURCE_EXHAUSTED; both count as failures. (The dispatcher's side is a stand-in whose
    answer is as wide as the request's first value asks.)"""
    spec = SUM_MODEL.spec()

    class Dispatcher:
        specs = {"sum": spec}

        async def infer(self, model, inputs, priority, timeout):
            return _Outputs(y=np.ones((1, int(inputs["x"][0, 0])), np.float32))

    def request(width: int, rid: str) -> dict:
        i = tgrpc_aio.InferInput("x", [1, 4], "FP32")
        i.set_data_from_numpy(np.full((1, 4), width, np.float32))
        return {"model_name": "sum", "inputs": [i], "request_id": rid}

    async def run():
        from batchyard.kserve_grpc import start_grpc

        core = KServeCore(Dispatcher())
        port = _free_port()
        server = await start_grpc(core, "127.0.0.1", port, max_message_bytes=1 << 16)
        c = tgrpc_aio.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            async def requests():
                for width, rid in ((2, "a"), (1 << 15, "b"), (2, "c")):  # b: 128 KiB of output
                    yield request(width, rid)

            got = []
            async for result, error in c.stream_infer(requests()):
                got.append(error.message() if error else (result.get_response().id, result.as_numpy("y").shape))
            with pytest.raises(InferenceServerException) as unary:
                await c.infer(**request(1 << 15, "d"))
            return got, unary.value, (await core.model_stats("sum"))[0]
        finally:
            await c.close()
            await server.stop(0)
            core.close()

    got, unary, stats = asyncio.run(asyncio.wait_for(run(), 60))
    assert len(got) == 3 and got[0] == ("a", (1, 2)) and got[2] == ("c", (1, 2)), got
    assert re.fullmatch(r"Sent message larger than max \(\d+ vs\. 65536\)", got[1]), got[1]
    assert unary.status() == "StatusCode.RESOURCE_EXHAUSTED" and "Sent message larger than max" in unary.message()
    assert stats["inference_stats"]["success"]["count"] == 2 and stats["inference_stats"]["fail"]["count"] == 2, stats


def test_stream_infer_answers_every_request_of_the_stream(front_door):
    """start_stream / async_stream_infer: each request answered once, by its id, marked final as
    Triton marks it (streaming clients wait for the mark); a bad one answers with its error and
    the stream goes on."""
    got, done, final = {}, threading.Event(), []

    def callback(result, error):
        if result is not None:
            final.append(result.get_response().parameters["triton_final_response"].bool_param)
        rid = result.get_response().id if result is not None else None
        got[rid if error is None else f"error {len(got)}"] = error.message() if error else result.as_numpy("y")
        if len(got) == 4:
            done.set()

    c = tgrpc.InferenceServerClient(front_door.grpc_url)
    c.start_stream(callback=callback)
    try:
        for rid, model, version in [("a", "sum", ""), ("b", "nope", ""), ("c", "sum", "7"), ("d", "sum", "1")]:
            c.async_stream_infer(model, [_grpc_input(X)], request_id=rid, model_version=version)
        assert done.wait(30), got
    finally:
        c.stop_stream()
    # A stream closed with a request still running: the front door withdraws it and serves on.
    c.start_stream(callback=lambda result, error: None)
    c.async_stream_infer("slow", [_grpc_input(X)], request_id="gone")
    c.stop_stream(cancel_requests=True)
    want = front_door.sdk("sum", X)
    np.testing.assert_array_equal(c.infer("sum", [_grpc_input(X)]).as_numpy("y"), want)
    np.testing.assert_array_equal(got.pop("a"), want)
    np.testing.assert_array_equal(got.pop("d"), want)
    assert final == [True, True]
    assert sorted(got.values()) == ["Request for unknown model: 'nope' is not found",
                                    "Request for unknown model: 'sum' version 7 is not found"]


def test_a_stream_error_is_marked_final_only_when_the_model_ran_as_triton_marks_it(front_door):
    """Triton answers a request it refuses before the model (an unknown model) with the error
    alone, and one that failed in its run through the response callback, marked final: every
    error carried triton_final_response."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    def request(model, rid, timeout_us=0):
        r = service_pb2.ModelInferRequest(model_name=model, id=rid)
        r.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        r.raw_input_contents.append(np.zeros(4, np.float32).tobytes())
        if timeout_us:
            r.parameters["timeout"].int64_param = timeout_us
        return r

    with grpc.insecure_channel(front_door.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        got = {r.infer_response.id: (r.error_message, dict(r.infer_response.parameters))
               for r in stub.ModelStreamInfer(iter([request("nope", "early"), request("slow", "late", timeout_us=1),
                                                    request("sum", "ok")]), timeout=60)}
    assert got["early"] == ("Request for unknown model: 'nope' is not found", {})
    message, params = got["late"]
    assert message and params["triton_final_response"].bool_param, got["late"]
    assert not got["ok"][0] and got["ok"][1]["triton_final_response"].bool_param


def test_json_data_nested_unlike_its_shape_is_read_in_order_as_triton_reads_it(front_door):
    """Triton's JSON reader counts the values of any nesting in row-major order: a ragged list
    for a [2, 4] input was a 400 in numpy's words ("inhomogeneous shape")."""
    want = front_door.sdk("sum", np.arange(8, dtype=np.float32).reshape(2, 4))
    for data in ([[0, 1, 2, 3], [4, 5, 6], [7]], [0, [1, 2], 3, [4, [5, 6]], 7], [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]):
        status, _, body = _post_infer(front_door, json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": data}]}).encode())
        assert status == 200, body
        np.testing.assert_array_equal(np.array(json.loads(body)["outputs"][0]["data"]).reshape(want.shape), want)
    status, _, body = _post_infer(front_door, json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4], "data": [[0, 1, 2, 3], [4, 5, 6]]}]}).encode())
    assert status == 400 and "unexpected number of elements" in json.loads(body)["error"].lower(), body


def _half_closed_exchange(front_door, request: bytes) -> bytes:
    """``request`` sent whole, the sending side shut (a FIN), then everything the server sends
    until it closes."""
    host, port = front_door.http_url.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_client_that_half_closes_after_its_request_gets_its_answer(front_door):
    """As Triton 2.51 answers it (nc -N, socat, some probes and proxies half-close): the answer
    comes, and the connection closes after it, with or without keep-alive. aiohttp closed the
    connection on the FIN and cancelled the request: 0 bytes came back. A body cut short by the FIN
    still closes the connection unanswered at once (it is not held for the body's stall timeout)."""
    body = json.dumps({"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": X.ravel().tolist()}]})
    for model in ("sum", "slow"):
        for connection in (b"Connection: close\r\n", b""):
            answer = _half_closed_exchange(front_door, b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: x\r\n%s"
                                           b"Content-Length: %d\r\n\r\n%s" % (model.encode(), connection, len(body),
                                                                            body.encode()))
            head, _, rest = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), (model, connection, answer)
            assert json.loads(rest)["outputs"][0]["data"] == front_door.sdk(model, X).ravel().tolist()
    assert _half_closed_exchange(front_door, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
        b"HTTP/1.1 200")
    assert _half_closed_exchange(front_door, b"POST /v2/models/sum/infer HTTP/1.1\r\nHost: x\r\n"
                                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:10].encode())) == b""


def test_a_stream_answers_in_the_order_its_requests_came(front_door):
    """Triton answers a stream to a non-decoupled model in request order, and tritonclient's
    default request id is "": a client may pair answers with requests by order. A slow request
    sent first must come back first (it came back after the fast one)."""
    got, done = [], threading.Event()

    def callback(result, error):
        got.append(error.message() if error else result.get_response().model_name)
        if len(got) == 3:
            done.set()

    c = tgrpc.InferenceServerClient(front_door.grpc_url)
    c.start_stream(callback=callback)
    try:
        for model in ("slow", "sum", "nope"):
            c.async_stream_infer(model, [_grpc_input(X)])
        assert done.wait(30), got
    finally:
        c.stop_stream()
    assert got == ["slow", "sum", "Request for unknown model: 'nope' is not found"]


@pytest.mark.parametrize("model", ["fast", "slow"])
def test_a_stream_whose_client_reads_no_answers_stops_being_read_then_answers_all_in_order(monkeypatch, model):
    """A stream client that sent on without reading its answers had all of them held by the
    front door (answers hold their outputs in its pool: 704 MiB in a review, kept after the
    stream). Requests are now counted when read, at their tensors' sizes, until their answers
    are sent: past STREAM_HELD_BYTES the stream is not read on (gRPC's flow control holds the
    client back), whether its answers wait to be sent ("fast") or its model has not answered
    yet ("slow": counted only once answered, 600 running requests reserved 640 MiB). Reading
    its answers lets the rest through, in order."""
    import types

    from batchyard import kserve_grpc
    from batchyard.kserve_grpc_wire import InferAnswer

    monkeypatch.setattr(kserve_grpc, "STREAM_HELD_BYTES", 64 << 10, raising=False)
    answer_bytes = 4 << 10
    spec = P.ModelSpec("sum", (P.TensorSpec("x", "float32", (4,)),), (P.TensorSpec("y", "float32", (1024,)),),
                       max_batch=4)  # a full batch (16 KiB) within the limit
    pulled = 0

    async def requests():  # a client with requests to send for ever
        nonlocal pulled
        while True:
            await asyncio.sleep(0)  # (gives the loop a turn, as a read from the network does)
            pulled += 1
            request = service_pb2.ModelInferRequest(model_name="sum", id=str(pulled))
            request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
            yield request

    async def main():
        model_done = asyncio.Event()
        if model == "fast":
            model_done.set()

        async def infer(request, context, stream=False, **_):  # outputs in the pool
            await model_done.wait()
            head = service_pb2.ModelInferResponse(model_name="sum", id=request.id)
            return InferAnswer(head, [memoryview(bytearray(answer_bytes))], stream)

        servicer = kserve_grpc.KServeServicer(types.SimpleNamespace(client=types.SimpleNamespace(specs={"sum": spec}),
                                                                    tracer=Tracer(), serves_llm=lambda model: False))
        servicer._infer = infer
        answers = servicer.ModelStreamInfer(requests(), None)
        first = asyncio.ensure_future(anext(answers))
        for _ in range(5_000):  # every turn the reader could take; no time passes
            await asyncio.sleep(0)
        read_unanswered = pulled
        model_done.set()
        ids = [(await first).head.id] + [(await anext(answers)).head.id for _ in range(4 * read_unanswered)]
        await answers.aclose()
        return read_unanswered, ids

    read_unanswered, ids = asyncio.run(main())
    assert read_unanswered <= (64 << 10) // answer_bytes + 2  # it read ~5,000 before
    assert ids == [str(i) for i in range(1, len(ids) + 1)]


def test_a_stream_may_always_hold_a_full_batch_of_its_model_and_counts_shapes_without_multiplying_them_out():
    """Held to 64 MiB, a stream to a model of 24 MiB outputs could have 2 requests running, so
    batches of at most 2 (with 300 ms batches it served a third of the requests a second); and
    the declared shape, not checked yet, was multiplied out whole (40,000 dimensions of 2**62
    held the loop 3.2 s)."""
    import types

    from batchyard import kserve_grpc

    big = P.ModelSpec("seg", (P.TensorSpec("x", "float32", (4,)),), (P.TensorSpec("y", "float32", (6, 1024, 1024)),),
                      max_batch=16)
    specs = {"seg": big}
    request = service_pb2.ModelInferRequest(model_name="seg", id="r1")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    nbytes, batch = kserve_grpc._stream_reservation(request, specs)
    assert nbytes == kserve_grpc.STREAM_ANSWER_OVERHEAD + request.ByteSize() + 16 + (24 << 20)
    assert batch == 16 * (16 + (24 << 20)) > kserve_grpc.STREAM_HELD_BYTES

    for shape in ([1, 2**62, 2**62, 3], [2**62, 4]):  # refused later; counted up to the limit now
        huge = service_pb2.ModelInferRequest(model_name="seg")
        huge.inputs.add(name="x", datatype="FP32", shape=shape)
        nbytes, _ = kserve_grpc._stream_reservation(huge, specs)
        assert nbytes <= kserve_grpc.STREAM_ANSWER_OVERHEAD + huge.ByteSize() + 2 * (kserve_grpc.STREAM_HELD_BYTES + 1), shape
    # what a request holds beyond its tensors counts too: a parameter no model reads (a review
    # held 279 MiB in 40 requests so), a BYTES tensor's raw contents (no item size to count by)
    padded = service_pb2.ModelInferRequest(model_name="tiny")
    padded.parameters["sequence_id"].string_param = "x" * (1 << 20)
    padded.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    padded.raw_input_contents.append(b"y" * (1 << 20))
    assert kserve_grpc._stream_reservation(padded, specs)[0] >= 2 << 20

    pulled = 0

    async def requests():
        nonlocal pulled
        while True:
            await asyncio.sleep(0)
            pulled += 1
            yield request

    async def main():
        never = asyncio.Event()

        async def infer(request, context, stream=False, **_):  # a slow model: nothing answered yet
            await never.wait()

        servicer = kserve_grpc.KServeServicer(types.SimpleNamespace(client=types.SimpleNamespace(specs=specs),
                                                                    tracer=Tracer(), serves_llm=lambda model: False))
        servicer._infer = infer
        answers = servicer.ModelStreamInfer(requests(), None)
        first = asyncio.ensure_future(anext(answers))
        for _ in range(2_000):
            await asyncio.sleep(0)
        first.cancel()  # the client goes away
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await answers.aclose()
        return pulled

    assert 16 <= asyncio.run(main()) <= 18  # a full batch, not 2 (nor all)


def test_repository_index_lists_the_models_and_load_is_refused(front_door):
    """As a Triton in model-control mode NONE: the index lists the node's models and their
    state; load and unload are refused with UNAVAILABLE (HTTP 503)."""
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    h = thttp.InferenceServerClient(front_door.http_url)
    index = {m["name"]: m for m in g.get_model_repository_index(as_json=True)["models"]}
    assert index["sum"]["state"] == "READY" and set(index) >= {"sum", "slow"}
    assert {m["name"] for m in h.get_model_repository_index()} == set(index)
    assert "reason" not in {m["name"]: m for m in h.get_model_repository_index()}["sum"]  # none, as Triton's
    for c, code in ((g, "StatusCode.UNAVAILABLE"), (h, "503")):
        for call in (c.load_model, c.unload_model):
            with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed") as e:
                call("sum")
            assert e.value.status() == code


def test_versions_and_unknown_paths_answer_as_triton(front_door):
    """Batchyard serves version 1 of each model: another version is not found (Triton's
    wording), and is not ready. An unknown HTTP path answers in JSON, so tritonclient reports
    the status instead of failing to parse aiohttp's text."""
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    h = thttp.InferenceServerClient(front_door.http_url)
    text = "Request for unknown model: 'sum' version 7 is not found"
    assert g.is_model_ready("sum", "1") and not g.is_model_ready("sum", "7") and not h.is_model_ready("sum", "7")
    for call in (lambda: g.get_model_metadata("sum", "7"), lambda: g.infer("sum", [_grpc_input(X)], model_version="7"),
                 lambda: h.get_model_config("sum", "7"), lambda: h.infer("sum", [_http_input(X)], model_version="7")):
        with pytest.raises(InferenceServerException, match=text) as e:
            call()
        assert e.value.status() in ("StatusCode.NOT_FOUND", "404")
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{front_door.http_url}/v2/nope", timeout=30)
    assert e.value.code == 404 and json.loads(e.value.read()) == {"error": "Not Found: GET /v2/nope"}


def test_version_strings_are_read_as_triton_reads_them(front_door):
    """Triton reads a gRPC version with std::stol: "01" is version 1; no integer, or a negative
    one, is INVALID_ARG (both were "not found")."""
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    h = thttp.InferenceServerClient(front_door.http_url)
    want = front_door.sdk("sum", X)
    np.testing.assert_array_equal(g.infer("sum", [_grpc_input(X)], model_version="01").as_numpy("y"), want)
    np.testing.assert_array_equal(h.infer("sum", [_http_input(X)], model_version="01").as_numpy("y"), want)
    for version, text in (("abc", "failed to get model version from specified version string 'abc'"),
                          ("-1", "invalid model version specified '-1'")):
        with pytest.raises(InferenceServerException, match=text) as e:
            g.infer("sum", [_grpc_input(X)], model_version=version)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        # Over HTTP Triton's routes take a version of digits only: anything else is no route.
        with pytest.raises(InferenceServerException, match="Not Found") as e:
            h.get_model_metadata("sum", version)
        assert e.value.status() == "404"
    # Past a signed 64-bit integer std::stol fails: INVALID_ARG. Past 4300 digits Python's int()
    # raised, and the metadata, config, ready and statistics calls answered 500.
    for version in ("9" * 20, "9" * 5000):
        with pytest.raises(InferenceServerException, match="failed to get model version") as e:
            g.get_model_metadata("sum", version)
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        for call in (h.get_model_metadata, h.get_model_config, h.get_inference_statistics):
            with pytest.raises(InferenceServerException, match="failed to get model version") as e:
                call("sum", version)
            assert e.value.status() == "400"
    assert list(g.get_model_metadata("sum", "0" * 30 + "1").versions) == ["1"]  # leading zeros count for nothing
    # An unknown one is named by the number read, as Triton names it (the string was echoed)
    for version, read in (("007", 7), ("7x", 7), (" +7", 7), ("0x1", 0)):
        with pytest.raises(InferenceServerException, match=f"'sum' version {read} is not found$") as e:
            g.get_model_metadata("sum", version)
        assert e.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="'sum' version 7 is not found$") as e:
        h.get_model_metadata("sum", "007")
    assert e.value.status() == "404"


def test_json_nested_past_the_parsers_depth_is_a_bad_request_on_every_path(front_door):
    """On the repository index such a body was a 500 (RecursionError)."""
    deep = b"[" * 100_000 + b"]" * 100_000
    for path in ("/v2/repository/index", "/v2/models/sum/infer", "/v2/systemsharedmemory/region/deep/register"):
        host, port = front_door.http_url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request("POST", path, deep, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            body = json.loads(resp.read())
        finally:
            conn.close()
        assert resp.status == 400 and "JSON" in body["error"], (path, resp.status, body)


def test_bench_finds_the_front_door_answering_as_a_triton_target(front_door):
    from batchyard.bench.bench_cli import node_answers

    assert node_answers(front_door.grpc_url, {}, "triton")


def test_server_metadata_lists_every_extension_served(front_door):
    """A KServe client may look for binary_tensor_data before it sends binary tensors."""
    served = {"binary_tensor_data", "classification", "system_shared_memory", "cuda_shared_memory",
              "model_repository", "model_configuration", "parameters", "statistics", "trace", "logging"}
    assert set(tgrpc.InferenceServerClient(front_door.grpc_url).get_server_metadata(as_json=True)["extensions"]) == served
    assert set(thttp.InferenceServerClient(front_door.http_url).get_server_metadata()["extensions"]) == served


def _post_infer(front_door, body: bytes, header_length=None, model="sum"):
    import http.client

    host, port = front_door.http_url.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.request("POST", f"/v2/models/{model}/infer", body=body,
                  headers={} if header_length is None else {"Inference-Header-Content-Length": str(header_length)})
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


def _binary_body(header: dict, *chunks: bytes) -> tuple[bytes, int]:
    text = json.dumps(header).encode()
    return b"".join([text, *chunks]), len(text)


def test_http_binary_data_is_used_exactly_as_triton_uses_it(front_door):
    """Binary bytes no input takes, and an input that gives its data two ways, are 400s (the
    extra bytes were ignored, and the binary data won over the JSON data)."""
    x = {"name": "x", "datatype": "FP32", "shape": [3, 4]}
    cases = [
        (_binary_body({"inputs": [{**x, "parameters": {"binary_data_size": X.nbytes}}]}, X.tobytes(), b"extra"),
         "unexpected additional input data for model 'sum'"),
        (_binary_body({"inputs": [{**x, "data": X.ravel().tolist()}]}, X.tobytes()),
         "unexpected additional input data for model 'sum'"),
        (_binary_body({"inputs": [{**x, "data": X.ravel().tolist(), "parameters": {"binary_data_size": X.nbytes}}]},
                      X.tobytes()),
         "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
         "'shared_memory_region' in 'parameters'. But set 'data' 'binary_data_size'"),
        (_binary_body({"inputs": [x]}), "But no field is set"),
        (_binary_body({"inputs": [{**x, "data": X.ravel().tolist()}], "parameters": {"priority": "1"}}),
         "Unable to parse 'priority'"),
        (_binary_body({"inputs": [{**x, "data": X.ravel().tolist()}], "parameters": {"binary_data_output": 1}}),
         "Unable to parse 'binary_data_output'"),
        (_binary_body({"id": 7, "inputs": [{**x, "data": X.ravel().tolist()}]}), "Unable to parse 'id'"),
    ]
    for (body, n), text in cases:
        status, _, answer = _post_infer(front_door, body, n)
        assert status == 400 and text in json.loads(answer)["error"], (text, answer)


def test_http_outputs_id_and_the_raw_binary_request_answer_as_triton(front_door):
    want = front_door.sdk("sum", X)
    x = {"name": "x", "datatype": "FP32", "shape": [3, 4], "data": X.ravel().tolist()}
    # A named output without binary_data is JSON: binary_data_output is for the outputs not named.
    body, _ = _binary_body({"id": "", "inputs": [x], "outputs": [{"name": "y"}],
                            "parameters": {"binary_data_output": True}})
    status, _, answer = _post_infer(front_door, body)
    reply = json.loads(answer)
    assert status == 200 and "id" not in reply  # Triton leaves an empty id out
    np.testing.assert_array_equal(np.asarray(reply["outputs"][0]["data"], np.float32).reshape(3, 2), want)
    # Inference-Header-Content-Length: 0 -- the body is the one input, one item; outputs binary.
    status, headers, answer = _post_infer(front_door, X[1].tobytes(), 0)
    assert status == 200, answer
    n = int(headers["Inference-Header-Content-Length"])
    out = json.loads(answer[:n])["outputs"][0]
    assert out["shape"] == [1, 2] and out["parameters"] == {"binary_data_size": 8}
    np.testing.assert_array_equal(np.frombuffer(answer[n:], np.float32), want[1])
    status, _, answer = _post_infer(front_door, X.tobytes(), 0)  # three items: not one item's bytes
    assert status == 400 and "unexpected total byte size 48 for input 'x', expecting 16" in json.loads(answer)["error"]


def test_grpc_contents_beside_raw_contents_is_an_invalid_argument(front_door):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name="sum")
    t = req.inputs.add(name="x", datatype="FP32", shape=[3, 4])
    t.contents.fp32_contents.extend(np.zeros(12))
    req.raw_input_contents.append(X.tobytes())
    with grpc.insecure_channel(front_door.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "contents field must not be specified when using raw_input_contents for 'x' for model 'sum'"


@pytest.mark.parametrize("proto", ["grpc", "http"])
def test_a_request_past_64_mib_is_served(front_door, proto):
    """Triton takes gRPC messages up to 2 GiB and does not bound binary tensors over HTTP; both
    sides here refused anything past 64 MiB (RESOURCE_EXHAUSTED, 413)."""
    x = np.random.default_rng(0).random((17, 1024, 1024), dtype=np.float32)  # 68 MiB
    mod, url = (tgrpc, front_door.grpc_url) if proto == "grpc" else (thttp, front_door.http_url)
    i = mod.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    got = mod.InferenceServerClient(url).infer("huge", [i]).as_numpy("y")
    np.testing.assert_array_equal(got, front_door.sdk("huge", x))


def test_a_front_door_at_a_tcp_endpoint_takes_tensors_past_the_inline_limit_where_the_node_allows_shm():
    """The front door reached a tcp dispatcher endpoint without shared memory, also where the
    node allows it there (allow_shm_over_tcp): every tensor went inline, and a request past
    max_inline_bytes (4 MiB) was refused INVALID_ARGUMENT, short of [frontend] max_request_bytes."""
    address = f"tcp://127.0.0.1:{_free_port()}"
    x = np.random.default_rng(0).random((2, 1024, 1024), dtype=np.float32)  # 8 MiB
    with _node_with_front_door(dispatcher={"frontend": address, "allow_shm_over_tcp": True}) as fd:
        i = thttp.InferInput("x", list(x.shape), "FP32")
        i.set_data_from_numpy(x, binary_data=True)
        got = thttp.InferenceServerClient(fd.http_url).infer("huge", [i]).as_numpy("y")
        with Client(address, shared_memory=True) as c:
            np.testing.assert_array_equal(got, c.infer("huge", {"x": x})["y"])


# ---------------------------------------------------------------- system shared memory
@pytest.mark.parametrize("proto", ["grpc", "http"])
def test_shm_register_infer_unregister(front_door, proto):
    mod, url = (tgrpc, front_door.grpc_url) if proto == "grpc" else (thttp, front_door.http_url)
    c = mod.InferenceServerClient(url)
    # The client's own POSIX regions, made by tritonclient.utils.shared_memory, as a Triton user
    # makes them (it needs pkg_resources: the project venv keeps setuptools < 81 for it; with
    # 84 the import failed).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "pkg_resources is deprecated"
        import tritonclient.utils.shared_memory as tshm
    tag = f"by_kserve_{os.getpid()}_{proto}"
    shm_in = tshm.create_shared_memory_region("in", f"/{tag}_in", X.nbytes)
    shm_out = tshm.create_shared_memory_region("out", f"/{tag}_out", 24)
    try:
        tshm.set_shared_memory_region(shm_in, [X])
        c.register_system_shared_memory("in", f"/{tag}_in", X.nbytes)
        c.register_system_shared_memory("out", f"/{tag}_out", 24)
        i, o = _shm_io(mod, "in", "out")
        result = c.infer("sum", [i], outputs=[o])
        np.testing.assert_array_equal(tshm.get_contents_as_numpy(shm_out, np.float32, [3, 2]), front_door.sdk("sum", X))
        # As Triton 2.51's, over either protocol: the output names no region (gRPC's named it)
        if proto == "http":  # tritonclient's C++ client takes any parameters for binary data
            assert result.get_output("y") == {"name": "y", "datatype": "FP32", "shape": [3, 2]}
        else:
            assert not result.get_output("y").parameters
        status = c.get_system_shared_memory_status(**({"as_json": True} if proto == "grpc" else {}))
        names = set(status["regions"]) if proto == "grpc" else {r["name"] for r in status}
        assert names == {"in", "out"}
        c.unregister_system_shared_memory()
        with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'in'"):
            c.infer("sum", [i], outputs=[o])
    finally:
        c.unregister_system_shared_memory()
        for region in (shm_in, shm_out):
            tshm.destroy_shared_memory_region(region)


@pytest.mark.parametrize("proto", ["grpc", "http"])
def test_large_shm_inputs_refilled_between_calls_are_each_read_as_they_are(front_door, proto):
    """An input in a region, past the SDK's shared-memory threshold, is read straight into the
    front door's pool and sent on from there: each call computes on what the region holds at
    that call, and the answers of calls at once are their own."""
    mod, url = (tgrpc, front_door.grpc_url) if proto == "grpc" else (thttp, front_door.http_url)
    c = mod.InferenceServerClient(url)
    xs = [np.random.default_rng(seed).random((2, 1024, 1024), dtype=np.float32) for seed in range(4)]  # 8 MiB
    tag = f"by_kserve_big_{os.getpid()}_{proto}"
    region = shared_memory.SharedMemory(tag, create=True, size=2 * xs[0].nbytes)
    try:
        c.register_system_shared_memory("big_in", f"/{tag}", 2 * xs[0].nbytes)
        i = mod.InferInput("x", list(xs[0].shape), "FP32")
        for x in xs[:2]:  # refilled, one call after another
            np.ndarray(x.shape, x.dtype, buffer=region.buf)[...] = x
            i.set_shared_memory("big_in", x.nbytes)
            np.testing.assert_array_equal(c.infer("huge", [i]).as_numpy("y"), front_door.sdk("huge", x))
        ins = []
        for k, x in enumerate(xs[2:]):  # two at once, each from its own half of the region
            np.ndarray(x.shape, x.dtype, buffer=region.buf, offset=k * x.nbytes)[...] = x
            ins.append(mod.InferInput("x", list(x.shape), "FP32"))
            ins[-1].set_shared_memory("big_in", x.nbytes, offset=k * x.nbytes)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda i: mod.InferenceServerClient(url).infer("huge", [i]).as_numpy("y"), ins))
        for y, x in zip(got, xs[2:]):
            np.testing.assert_array_equal(y, front_door.sdk("huge", x))
    finally:
        c.unregister_system_shared_memory("big_in")
        region.close()
        region.unlink()


def test_a_client_of_another_user_cannot_name_reach_or_drop_a_users_memory(front_door):
    """Any client could register any segment the front door can open (another user's tensors),
    then read it back through a model or write outputs over it; and use, list or unregister other
    users' regions by name. Now a region is its user's (the segment must be the client's own)."""
    import shutil

    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root to run a client as another user")
    tag = f"by_kserve_victim_{os.getpid()}"
    mine = shared_memory.SharedMemory(tag, create=True, size=X.nbytes)
    c = thttp.InferenceServerClient(front_door.http_url)
    try:
        np.ndarray(X.shape, X.dtype, buffer=mine.buf)[...] = X
        c.register_system_shared_memory("victim_in", f"/{tag}", X.nbytes)
        code = f"""
import json, urllib.request, urllib.error
def post(path, body=None):
    req = urllib.request.Request("http://{front_door.http_url}" + path, method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
print(json.dumps([
    post("/v2/systemsharedmemory/region/evil/register", {{"key": "/{tag}", "offset": 0, "byte_size": {X.nbytes}}}),
    post("/v2/models/sum/infer", {{"inputs": [{{"name": "x", "shape": [3, 4], "datatype": "FP32", "parameters":
          {{"shared_memory_region": "victim_in", "shared_memory_byte_size": {X.nbytes}}}}}]}}),
    post("/v2/systemsharedmemory/status"),
    post("/v2/systemsharedmemory/unregister", {{}}),
]))
"""
        r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c",
                            code], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        register, infer, status, unregister = json.loads(r.stdout)
        assert register[0] == 400 and "belongs to uid 0, not to this client's uid 65534" in register[1], register
        assert infer[0] == 404 and "Unable to find shared memory region: 'victim_in'" in infer[1], infer
        assert status == [200, "[]"] and unregister[0] == 200
        assert [r["name"] for r in c.get_system_shared_memory_status()] == ["victim_in"]  # still there, still mine
        out = c.infer("sum", [_shm_io(thttp, "victim_in", "unused")[0]]).as_numpy("y")
        np.testing.assert_array_equal(out, front_door.sdk("sum", X))
    finally:
        c.unregister_system_shared_memory()
        mine.close()
        mine.unlink()


@pytest.mark.parametrize("proto", ["grpc", "http"])
def test_one_segment_under_two_names_and_an_output_region_too_small(front_door, proto):
    """Triton refuses only a second use of a name: one segment may be registered as an input half
    and an output half (it was refused). An output region too small for the output is Triton's
    INTERNAL / 500 with its message (it was INVALID_ARGUMENT, after the model had run)."""
    mod, url = (tgrpc, front_door.grpc_url) if proto == "grpc" else (thttp, front_door.http_url)
    c = mod.InferenceServerClient(url)
    tag = f"by_kserve_halves_{os.getpid()}_{proto}"
    seg = shared_memory.SharedMemory(tag, create=True, size=128)
    stats = lambda: c.get_inference_statistics("sum", **({"as_json": True} if proto == "grpc" else {}))[  # noqa: E731
        "model_stats"][0]["inference_stats"]["success"].get("count", 0)
    try:
        np.ndarray(X.shape, X.dtype, buffer=seg.buf)[...] = X
        c.register_system_shared_memory("in", f"/{tag}", X.nbytes, 0)
        c.register_system_shared_memory("out", f"/{tag}", 64, 64)
        i, o = _shm_io(mod, "in", "out")
        c.infer("sum", [i], outputs=[o])
        np.testing.assert_array_equal(np.ndarray((3, 2), np.float32, buffer=seg.buf, offset=64),
                                      front_door.sdk("sum", X))
        served = stats()
        o.set_shared_memory("out", 8)
        with pytest.raises(InferenceServerException, match=r"shared memory size specified with the request for "
                           r"output 'y' \(8 bytes\) should be at least 24 bytes to hold the results") as e:
            c.infer("sum", [i], outputs=[o])
        assert e.value.status() == ("StatusCode.INTERNAL" if proto == "grpc" else "500")
        assert stats() == served  # refused before it ran
    finally:
        c.unregister_system_shared_memory()
        seg.close()
        seg.unlink()


@pytest.mark.parametrize("proto", ["grpc", "http"])
def test_an_output_region_shrunk_while_its_request_ran_counts_a_failure(front_door, proto):
    """Over HTTP the outputs were written to their region after the statistics had counted the
    request a success: a region its client shrank while the request ran answered 400 "Invalid
    offset + byte size", and ModelStatistics counted a success (gRPC counted a failure)."""
    mod, url = (tgrpc, front_door.grpc_url) if proto == "grpc" else (thttp, front_door.http_url)
    c = mod.InferenceServerClient(url)
    tag = f"by_kserve_shrunk_{os.getpid()}_{proto}"
    seg = shared_memory.SharedMemory(tag, create=True, size=64)
    counts = lambda: {k: int(v.get("count", 0)) for k, v in c.get_inference_statistics(  # noqa: E731
        "slow", **({"as_json": True} if proto == "grpc" else {}))["model_stats"][0]["inference_stats"].items()
        if k in ("success", "fail")}
    try:
        c.register_system_shared_memory("shrinks", f"/{tag}", 64)
        before = counts()
        i = mod.InferInput("x", [1, 4], "FP32")
        i.set_data_from_numpy(np.ones((1, 4), np.float32))
        o = mod.InferRequestedOutput("y")
        o.set_shared_memory("shrinks", 8)
        got = []

        def infer():  # (a client of its own: tritonclient.http's greenlets keep to the thread that made them)
            try:
                got.append(mod.InferenceServerClient(url).infer("slow", [i], outputs=[o]))
            except Exception as e:  # noqa: BLE001 - the test reads what it raised
                got.append(e)

        call = threading.Thread(target=infer)
        call.start()
        with front_door.node.client() as sdk:  # its 300 ms batch is running: the region shrinks under it
            while call.is_alive() and not any(w.name == "slow0" and w.inflight for w in sdk.status().workers):
                pass
        os.truncate(f"/dev/shm/{tag}", 0)
        call.join(30)
        assert isinstance(got[0], InferenceServerException) and "Invalid offset + byte size" in str(got[0])
        after = counts()
        assert (after["success"] - before["success"], after["fail"] - before["fail"]) == (0, 1)
    finally:
        with contextlib.suppress(InferenceServerException):
            c.unregister_system_shared_memory("shrinks")
        seg.close()
        seg.unlink()


def test_an_output_region_named_without_a_byte_size_is_the_requests_fault(front_door):
    """Triton 2.51: a region named without ``shared_memory_byte_size`` is INVALID_ARGUMENT / 400
    (gRPC says the key must be given). Read as 0 bytes, it was "too small", INTERNAL / 500: a
    server fault, which invites retries."""
    tag = f"by_kserve_nosize_{os.getpid()}"
    seg = shared_memory.SharedMemory(tag, create=True, size=64)
    h = thttp.InferenceServerClient(front_door.http_url)
    try:
        h.register_system_shared_memory("o_nosize", f"/{tag}", 64)
        from tritonclient.grpc import service_pb2, service_pb2_grpc
        r = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(front_door.grpc_url))
        req = service_pb2.ModelInferRequest(model_name="sum")
        req.inputs.add(name="x", datatype="FP32", shape=list(X.shape))
        req.raw_input_contents.append(X.tobytes())
        req.outputs.add(name="y").parameters["shared_memory_region"].string_param = "o_nosize"
        with pytest.raises(grpc.RpcError) as e:
            r.ModelInfer(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'shared_memory_byte_size' must be specified" in e.value.details()
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(X.shape), "data": X.ravel().tolist()}],
                "outputs": [{"name": "y", "parameters": {"shared_memory_region": "o_nosize"}}]}
        resp = h._post("v2/models/sum/infer", json.dumps(body), None, None)
        assert resp.status_code == 400, resp.read()
        assert "Invalid offset + byte size for shared memory region: 'o_nosize'" in json.loads(resp.read())["error"]
    finally:
        h.unregister_system_shared_memory()
        seg.close()
        seg.unlink()


# gRPC shared-memory parameters of another protobuf type than Triton reads them from, on the
# input x or the output y: (tensor, its parameters as (field, value), Triton 2.51's message).
_REGION, _IN_BYTES = ("string_param", "typed"), ("int64_param", X.nbytes)
WRONGLY_TYPED_SHM_PARAMS = [
    ("x", {"shared_memory_region": _REGION, "shared_memory_byte_size": _IN_BYTES,
           "shared_memory_offset": ("bool_param", True)},
     "invalid value type for 'shared_memory_offset' parameter for tensor 'x', expected int64_param."),
    ("x", {"shared_memory_region": _REGION, "shared_memory_byte_size": ("string_param", "48")},
     "invalid value type for 'shared_memory_byte_size' parameter for tensor 'x', expected int64_param."),
    ("x", {"shared_memory_region": _REGION, "shared_memory_byte_size": ("double_param", 48.9)},
     "invalid value type for 'shared_memory_byte_size' parameter for tensor 'x', expected int64_param."),
    ("x", {"shared_memory_region": ("int64_param", 5), "shared_memory_byte_size": _IN_BYTES},
     "invalid value type for 'shared_memory_region' parameter for tensor 'x', expected string_param."),
    ("x", {"shared_memory_offset": ("int64_param", 4)},
     "'shared_memory_offset' can not be specified without 'shared_memory_region' parameter for tensor 'x'"),
    ("y", {"shared_memory_region": _REGION, "shared_memory_byte_size": ("int64_param", 24),
           "shared_memory_offset": ("bool_param", True)},
     "invalid value type for 'shared_memory_offset' parameter for tensor 'y', expected int64_param."),
    ("y", {"shared_memory_region": ("bool_param", True), "shared_memory_byte_size": ("int64_param", 24)},
     "invalid value type for 'shared_memory_region' parameter for tensor 'y', expected string_param."),
]


def test_grpc_shm_parameters_of_the_wrong_type_are_tritons_invalid_argument(front_door):
    """Triton 2.51 reads a region only from string_param, an offset and a byte size only from
    int64_param, and refuses any other. Read from whichever field was set, an offset of bool true
    was offset 1 (the model ran on misaligned bytes, status OK), a region of int64 failed with a
    Python exception's text, and an offset without a region was ignored."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    tag = f"by_kserve_typed_{os.getpid()}"
    seg = shared_memory.SharedMemory(tag, create=True, size=64)
    np.ndarray(X.shape, X.dtype, buffer=seg.buf)[...] = X
    h = thttp.InferenceServerClient(front_door.http_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(front_door.grpc_url))

    def infer(tensor: str, params: dict):
        req = service_pb2.ModelInferRequest(model_name="sum")
        x = req.inputs.add(name="x", datatype="FP32", shape=list(X.shape))
        named = x if tensor == "x" else req.outputs.add(name="y")
        for key, (field, value) in params.items():
            setattr(named.parameters[key], field, value)
        if "shared_memory_region" not in x.parameters:
            req.raw_input_contents.append(X.tobytes())
        return stub.ModelInfer(req, timeout=30)

    try:
        h.register_system_shared_memory("typed", f"/{tag}", 64)
        served = infer("x", {"shared_memory_region": _REGION, "shared_memory_byte_size": _IN_BYTES})
        np.testing.assert_array_equal(np.frombuffer(served.raw_output_contents[0], np.float32).reshape(3, 2),
                                      front_door.sdk("sum", X))
        for tensor, params, text in WRONGLY_TYPED_SHM_PARAMS:
            with pytest.raises(grpc.RpcError) as e:
                infer(tensor, params)
            assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, text), params
    finally:
        h.unregister_system_shared_memory()
        seg.close()
        seg.unlink()


@pytest.mark.parametrize("outputs", [{}, "", 0, False, None, {"name": "y"}, "y", 1])
def test_http_outputs_that_are_not_an_array_are_a_bad_request(front_door, outputs):
    """Triton 2.51 refuses an ``outputs`` member that is not an array, null included; only one
    left out (or []) means all of the model's outputs. {} "" 0 false and null were served as if
    no output were named."""
    body = {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": X.ravel().tolist()}],
            "outputs": outputs}
    status, _, answer = _post_infer(front_door, json.dumps(body).encode())
    assert status == 400 and json.loads(answer)["error"].startswith("Unable to parse 'outputs'"), answer


def test_http_outputs_left_out_or_empty_are_all_of_them(front_door):
    x = {"name": "x", "shape": [3, 4], "datatype": "FP32", "data": X.ravel().tolist()}
    for body in ({"inputs": [x]}, {"inputs": [x], "outputs": []}):
        status, _, answer = _post_infer(front_door, json.dumps(body).encode())
        assert status == 200 and [o["name"] for o in json.loads(answer)["outputs"]] == ["y"], answer


@pytest.mark.parametrize("proto", ["grpc", "http"])
def test_an_output_region_unregistered_in_flight_takes_the_output_and_no_other_region_does(front_door, proto):
    """While a request runs, another client unregisters its output region and registers its own
    segment under that name. The output lands in the region the request named, as Triton holds a
    request's regions while it runs; the front door looked the name up again after the inference,
    and wrote the output into the other client's memory."""
    mod, url = (tgrpc, front_door.grpc_url) if proto == "grpc" else (thttp, front_door.http_url)
    a, b = mod.InferenceServerClient(url), mod.InferenceServerClient(url)
    tag = f"by_kserve_{os.getpid()}_{proto}_inflight"
    segs = {n: shared_memory.SharedMemory(f"{tag}_{n}", create=True, size=64) for n in ("in", "out", "other")}
    try:
        np.ndarray(X.shape, X.dtype, buffer=segs["in"].buf)[...] = X
        segs["other"].buf[:] = b"\xaa" * 64
        a.register_system_shared_memory("inflight_in", f"/{tag}_in", X.nbytes)
        a.register_system_shared_memory("inflight_out", f"/{tag}_out", 24)
        i, o = _shm_io(mod, "inflight_in", "inflight_out")
        done: queue.Queue = queue.Queue()
        with Client(front_door.node.address) as c:
            if proto == "grpc":
                a.async_infer("slow", [i], outputs=[o], callback=lambda result, error: done.put(error))
            else:  # tritonclient.http's calls run on gevent, which this wait would not let run
                threading.Thread(target=lambda: done.put(_http_post(front_door, "slow", {
                    "inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "parameters": {
                        "shared_memory_region": "inflight_in", "shared_memory_byte_size": X.nbytes}}],
                    "outputs": [{"name": "y", "parameters": {"shared_memory_region": "inflight_out",
                                                             "shared_memory_byte_size": 24}}]}))).start()
            give_up = time.monotonic() + 30  # the wait ends in ms; this only keeps a broken run from hanging
            while not any(w.inflight for w in c.status().workers if w.name == "slow0"):
                assert time.monotonic() < give_up
        b.unregister_system_shared_memory("inflight_out")
        b.register_system_shared_memory("inflight_out", f"/{tag}_other", 64)
        assert done.get(timeout=30) in (None, 200)
        assert bytes(segs["other"].buf) == b"\xaa" * 64
        np.testing.assert_array_equal(np.frombuffer(bytes(segs["out"].buf[:24]), np.float32).reshape(3, 2),
                                      front_door.sdk("slow", X))
    finally:
        a.unregister_system_shared_memory()
        for seg in segs.values():
            seg.close()
            seg.unlink()


def _http_post(front_door, model: str, body: dict) -> int:
    """POST an infer request's JSON with the standard library (thread-safe); the HTTP status."""
    host, port = front_door.http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", f"/v2/models/{model}/infer", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_an_http_request_refused_after_its_output_region_was_taken_leaks_no_fd(front_door):
    """The output region is held (a duplicate fd) as the request is read; an output parameter
    refused after that (binary_data "yes") left the fd open, and with it the client's memory."""
    c = thttp.InferenceServerClient(front_door.http_url)
    tag = f"by_kserve_{os.getpid()}_fdleak"
    seg = shared_memory.SharedMemory(tag, create=True, size=64)
    fronts = [p for p in psutil.Process(front_door.node.up.pid).children(recursive=True)
              if "frontend" in " ".join(p.cmdline())]
    try:
        c.register_system_shared_memory("fdleak_out", f"/{tag}", 64)
        body = {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": X.ravel().tolist()}],
                "outputs": [{"name": "y", "parameters": {"shared_memory_region": "fdleak_out",
                                                         "shared_memory_byte_size": 24, "binary_data": "yes"}}]}
        assert _http_post(front_door, "sum", body) == 400
        before = sum(p.num_fds() for p in fronts)
        for _ in range(40):
            assert _http_post(front_door, "sum", body) == 400
        assert sum(p.num_fds() for p in fronts) < before + 10
    finally:
        c.unregister_system_shared_memory()
        seg.close()
        seg.unlink()


def test_a_region_registered_once_serves_every_connection(front_door):
    """Two front-door processes share the port: fresh connections land on either, and each must
    find the region registered through the first one (Triton's registry is server-wide)."""
    tag = f"by_kserve_{os.getpid()}_spread"
    shm_in = shared_memory.SharedMemory(f"{tag}_in", create=True, size=X.nbytes)
    c = tgrpc.InferenceServerClient(front_door.grpc_url)
    try:
        np.ndarray(X.shape, X.dtype, buffer=shm_in.buf)[...] = X
        c.register_system_shared_memory("spread", f"/{tag}_in", X.nbytes)
        want = front_door.sdk("sum", X)
        for _ in range(12):  # each its own TCP connection: all 12 on one process has odds 2**-11
            # (gRPC shares one connection among channels to one target unless told not to)
            other = tgrpc.InferenceServerClient(front_door.grpc_url,
                                                channel_args=[("grpc.use_local_subchannel_pool", 1)])
            i = tgrpc.InferInput("x", [3, 4], "FP32")
            i.set_shared_memory("spread", X.nbytes)
            np.testing.assert_array_equal(other.infer("sum", [i]).as_numpy("y"), want)
            other.close()
    finally:
        c.unregister_system_shared_memory()
        c.close()
        shm_in.close()
        shm_in.unlink()


def test_statistics_count_the_whole_node_whichever_process_answers(front_door):
    """Two front-door processes: each request, and each statistics call, lands on either; the
    counts must be the node's (perf_analyzer failed windows whose counts it read on the process
    that had not carried them)."""
    def count(client) -> int:
        st = client.get_inference_statistics("sum", as_json=True)["model_stats"][0]
        return int(st.get("inference_count", 0))

    fresh = lambda: tgrpc.InferenceServerClient(  # noqa: E731 -- own TCP connection each
        front_door.grpc_url, channel_args=[("grpc.use_local_subchannel_pool", 1)])
    before = [count(fresh()) for _ in range(8)]
    for _ in range(12):
        c = fresh()
        c.infer("sum", [_grpc_input(X)])
        c.close()
    after = [count(fresh()) for _ in range(8)]
    assert len(set(before)) == 1 and len(set(after)) == 1, (before, after)
    assert after[0] - before[0] == 12 * len(X)
    # Over HTTP the keys Triton always writes are there (perf_analyzer reads cache_hit unchecked)
    st = thttp.InferenceServerClient(front_door.http_url).get_inference_statistics("sum")["model_stats"][0]
    assert st["inference_stats"]["cache_hit"] == {"count": 0, "ns": 0} == st["inference_stats"]["cache_miss"]
    assert st["response_stats"] == {} and st["memory_usage"] == []


def test_a_request_the_client_cancels_counts_as_a_failure(front_door):
    """Triton counts a cancelled request in inference_stats.fail; a gRPC call the client cancelled
    mid-run was counted neither a success nor a failure."""
    def fails() -> int:
        st = tgrpc.InferenceServerClient(front_door.grpc_url).get_inference_statistics("slow", as_json=True)
        return int(st["model_stats"][0]["inference_stats"].get("fail", {}).get("count", 0))

    async def cancel_one():
        g = tgrpc_aio.InferenceServerClient(front_door.grpc_url)
        try:
            with Client(front_door.node.address) as c:
                busy = lambda: [w.inflight for w in c.status().workers if w.name == "slow0"] != [0]  # noqa: E731
                while busy():  # an earlier test's request (each look a round trip): not the one to cancel
                    pass
                t = asyncio.ensure_future(g.infer("slow", [_grpc_input(X)]))
                while not busy():  # each look a round trip to the dispatcher: until the call runs
                    await asyncio.wait([t], timeout=0)
                t.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await t
            # Behind the cancel on the same connection: by its answer the cancel was handled.
            return (await g.infer("slow", [_grpc_input(X)])).as_numpy("y")
        finally:
            await g.close()

    before = fails()
    np.testing.assert_array_equal(asyncio.run(cancel_one()), front_door.sdk("slow", X))
    assert fails() == before + 1


def test_execution_count_counts_batches_not_requests(front_door):
    """perf_analyzer's "Execution count" and a dashboard's inference_count / execution_count read
    the mean batch, as with Triton. Eight requests at once to `slow` (a 300 ms launch) share
    batches; each used to count as an execution of its own."""
    def counts() -> tuple[int, int]:
        c = tgrpc.InferenceServerClient(front_door.grpc_url)
        st = c.get_inference_statistics("slow", as_json=True)["model_stats"][0]
        return int(st.get("inference_count", 0)), int(st.get("execution_count", 0))

    async def burst():
        g = tgrpc_aio.InferenceServerClient(front_door.grpc_url)
        try:
            res = await asyncio.gather(*[g.infer("slow", [_grpc_input(X)]) for _ in range(8)])
            return [r.as_numpy("y") for r in res]
        finally:
            await g.close()

    items0, execs0 = counts()
    want = front_door.sdk("slow", X)
    items1, execs1 = counts()  # the SDK's request is not the front door's: not counted
    assert (items1, execs1) == (items0, execs0)
    for out in asyncio.run(burst()):
        np.testing.assert_array_equal(out, want)
    items2, execs2 = counts()
    assert items2 - items1 == 8 * len(X)
    assert 2 <= execs2 - execs1 <= 4  # 3-item requests, max batch 16: at most 5 a batch


@pytest.mark.parametrize("proto", ["grpc", "http"])
def test_cuda_shm_answers_as_a_triton_without_gpus(front_door, proto):
    """tritonclient's unregister-all and perf_analyzer call the CUDA half too; a GPU-less Triton
    unregisters nothing successfully, lists nothing and refuses to register."""
    mod, url = (tgrpc, front_door.grpc_url) if proto == "grpc" else (thttp, front_door.http_url)
    c = mod.InferenceServerClient(url)
    c.unregister_cuda_shared_memory()
    c.unregister_cuda_shared_memory("never-registered")
    status = c.get_cuda_shared_memory_status(**({"as_json": True} if proto == "grpc" else {}))
    assert not (status.get("regions") if proto == "grpc" else status)
    with pytest.raises(InferenceServerException, match="GPUs not supported") as e:
        c.register_cuda_shared_memory("gpu", b"\0" * 64, 0, 64)
    assert e.value.status() == ("StatusCode.INVALID_ARGUMENT" if proto == "grpc" else "400")


@pytest.mark.parametrize("proto", ["grpc", "http", "grpc-streaming"])
@pytest.mark.parametrize("shm", ["none", "system"])
def test_perf_analyzer_drives_the_front_door(front_door, proto, shm):
    """Triton's own load tool, unchanged: its run ends 0, it reads the server-side statistics, and
    its shared-memory set-up and clean-up go through (it unregisters CUDA regions as well); with
    --streaming its requests go over one ModelStreamInfer stream. Any window is accepted as stable
    (-s 1000): this is about the protocol, not the numbers."""
    url = front_door.http_url if proto == "http" else front_door.grpc_url
    args = ["-m", "sum", "-u", url, "-i", proto.split("-")[0], "--concurrency-range", "2", "--measurement-mode",
            "count_windows", "--measurement-request-count", "50", "-s", "1000", "--max-trials", "3",
            "--shared-memory", shm] + (["--output-shared-memory-size", "64"] if shm != "none" else []) \
        + (["--streaming"] if proto == "grpc-streaming" else [])
    out = perf_analyzer_ran(args)
    assert float(re.search(r"Throughput: ([\d.]+) infer/sec", out).group(1)) > 0, out


def test_shm_of_batchyard_itself_cannot_be_registered(front_door):
    c = tgrpc.InferenceServerClient(front_door.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        c.register_system_shared_memory("steal", "/batchyard_1_abc", 64)
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"


# ---------------------------------------------------------------- errors, as Triton reports them
# Each code is what Triton 2.51 (nvidia-pytriton's tritonserver) answered the same request.
BAD_CASES = {
    "unknown model": ("nope", X, "FP32", "unknown model: 'nope'", "NOT_FOUND", "404"),
    # no model can have it: the SDK's own 'malformed header: Expected `str` of length <= 128' before
    "name too long": ("m" * 129, X, "FP32", "unknown model: 'm{129}' is not found", "NOT_FOUND", "404"),
    "wrong shape": ("sum", np.zeros((2, 5), np.float32), "FP32", "unexpected shape for input 'x'", "INVALID_ARGUMENT",
                    "400"),
    "wrong dtype": ("sum", X.astype(np.float64), "FP64", "data-type is 'FP64', but model 'sum' expects 'FP32'",
                    "INVALID_ARGUMENT", "400"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_requests_get_tritons_codes(front_door, case):
    """An unknown model answered INVALID_ARGUMENT / 400, the code of older Tritons; 2.51 says
    NOT_FOUND / 404."""
    model, x, dtype, text, grpc_code, http_code = BAD_CASES[case]
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    with pytest.raises(InferenceServerException, match=text) as e:
        g.infer(model, [_grpc_input(x, dtype)])
    assert e.value.status() == f"StatusCode.{grpc_code}"
    h = thttp.InferenceServerClient(front_door.http_url)
    with pytest.raises(InferenceServerException, match=text) as e:
        h.infer(model, [_http_input(x, dtype)])
    assert e.value.status() == http_code


def test_model_calls_on_an_unknown_model_or_version_answer_as_triton_2_51(front_door):
    """Metadata and config of an unknown model are NOT_FOUND / 404 (they were INVALID_ARGUMENT /
    400); statistics are INVALID_ARGUMENT / 400 in words of their own, for an unknown model and
    for a version the node does not serve; readiness of a version string that is no integer is
    INVALID_ARGUMENT over gRPC (it answered "not ready"), and no route over HTTP (404), as
    Triton's routes take digits only; a model that is not ready says so in JSON."""
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    h = thttp.InferenceServerClient(front_door.http_url)
    for call, code in ((lambda: g.get_model_metadata("nope"), "StatusCode.NOT_FOUND"),
                       (lambda: g.get_model_config("nope"), "StatusCode.NOT_FOUND"),
                       (lambda: h.get_model_metadata("nope"), "404"), (lambda: h.get_model_config("nope"), "404")):
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found") as e:
            call()
        assert e.value.status() == code
    for call, text in ((lambda: g.get_inference_statistics("nope"), "requested model 'nope' is not available"),
                       (lambda: h.get_inference_statistics("nope"), "requested model 'nope' is not available"),
                       (lambda: g.get_inference_statistics("sum", "3"),
                        "requested model version is not available for model 'sum'"),
                       (lambda: h.get_inference_statistics("sum", "3"),
                        "requested model version is not available for model 'sum'")):
        with pytest.raises(InferenceServerException, match=text) as e:
            call()
        assert e.value.status() in ("StatusCode.INVALID_ARGUMENT", "400")
    with pytest.raises(InferenceServerException, match="failed to get model version from specified version string"):
        g.is_model_ready("sum", "x")
    r = h._get("v2/models/sum/versions/x/ready", None, None)
    assert r.status_code == 404 and json.loads(r.read())["error"].startswith("Not Found")
    r = h._get("v2/models/nope/ready", None, None)
    assert r.status_code == 400 and json.loads(r.read()) == {"error": "Model version not ready"}
    # Digits past an int64: 400 as the other model routes and Triton 2.51 answer (readiness said
    # 500 "internal error: KServeError", with a traceback in the front door's log)
    for path in ("v2/models/sum/versions/9223372036854775808/ready", "v2/models/sum/versions/9223372036854775808"):
        r = h._get(path, None, None)
        assert r.status_code == 400, (path, r.status_code)
        assert json.loads(r.read())["error"].startswith("failed to get model version from specified version string")


@pytest.mark.parametrize("proto", ["grpc", "http"])
def test_an_output_named_twice_comes_back_once(front_door, proto):
    """Triton 2.51 answers a repeated requested output once; this answered it twice."""
    mod, inp = (tgrpc, _grpc_input(X)) if proto == "grpc" else (thttp, _http_input(X))
    c = mod.InferenceServerClient(front_door.grpc_url if proto == "grpc" else front_door.http_url)
    res = c.infer("sum", [inp], outputs=[mod.InferRequestedOutput("y"), mod.InferRequestedOutput("y")])
    outputs = res.get_response(as_json=True)["outputs"] if proto == "grpc" else res.get_response()["outputs"]
    assert [o["name"] for o in outputs] == ["y"]
    np.testing.assert_array_equal(res.as_numpy("y"), front_door.sdk("sum", X))


def test_typed_contents_in_another_types_field_are_tritons_error(front_door):
    """FP32 data sent in ``int_contents`` was ignored, and the input then counted 0 elements."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name="sum")
    req.inputs.add(name="x", datatype="FP32", shape=[3, 4]).contents.int_contents.extend(range(12))
    with grpc.insecure_channel(front_door.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == ("unexpected explicit tensor data for input tensor 'x' for model 'sum' of type "
                                 "'INT32', expected datatype 'FP32'")
    # Strings in bytes_contents: the datatype is the error (it said "of type 'BYTES', expected 'BYTES'").
    req = service_pb2.ModelInferRequest(model_name="sum")
    req.inputs.add(name="x", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(b"a")
    with grpc.insecure_channel(front_door.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "datatype 'BYTES' is not supported (strings are not supported by Batchyard)" in e.value.details()


def test_a_parameter_of_the_wrong_type_is_an_invalid_argument(front_door):
    """A raw ModelInfer whose priority is a string: INVALID_ARGUMENT with the reason, as the HTTP
    side answers, not UNKNOWN with an internal exception's name."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name="sum")
    req.inputs.add(name="x", datatype="FP32", shape=[3, 4])
    req.raw_input_contents.append(X.tobytes())
    req.parameters["priority"].string_param = "urgent"
    with grpc.insecure_channel(front_door.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "invalid value type for 'priority' parameter, expected int64_param or uint64_param."


# Requests tritonclient would not build but a hand-written client sends: (the input entries as
# (name, shape, JSON data), the request parameters (gRPC's, HTTP's), Triton's message).
_X = ("x", [3, 4], X.ravel().tolist())
RAW_CASES = {
    "an input given twice": ([_X, _X], {}, {}, "input 'x' already exists in request"),
    "a dimension left unspecified": ([("x", [-1, 4], X.ravel().tolist())], {}, {},
                                     r"All input dimensions should be specified for input 'x' for model 'sum', got \[-1, 4\]"),
    # (over gRPC, an int64 timeout of -1 is what Triton 2.51's cast to uint64 makes of it: accepted)
    "a timeout outside 64 bits": ([_X], None, {"timeout": 2 ** 64},
                                  "parameter 'timeout' must be an unsigned 64-bit integer"),
    "a priority outside 64 bits": ([_X], {"priority": -1}, {"priority": 2 ** 64},
                                   "invalid value for 'priority', expected value >= 0|"
                                   "parameter 'priority' must be an unsigned 64-bit integer"),
    "a parameter name Triton reserves": ([_X], {"triton_foo": 1}, {"triton_foo": 1},
                                         "parameter keys starting with 'triton_' are reserved for Triton usage"),
    "JSON null as FP32 data": ([("x", [3, 4], [None] * 12)], None, {}, "data is not FP32"),
    "JSON true as FP32 data": ([("x", [3, 4], [True] * 12)], None, {}, "data is not FP32"),
    # numpy read these as numbers: 200, the model computing on 1.0 / on infinity
    "JSON true beside numbers as FP32 data": ([("x", [3, 4], [True] + [2] * 11)], None, {}, "data is not FP32: got true/false"),
    "FP32 data past FP32's range": ([("x", [3, 4], [1e39] + [2.0] * 11)], None, {}, "data is not FP32: a value past FP32's range"),
}


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_malformed_tensors_and_parameters_get_tritons_errors(front_door, case):
    """Each was accepted with a silently wrong reading (the last of two inputs, null as NaN, true as
    1.0), or failed as an internal error (a negative element count, a timeout the SDK could not
    encode): now INVALID_ARGUMENT / 400 with the reason, and nothing reaches a worker."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    tensors, grpc_params, http_params, text = RAW_CASES[case]
    if grpc_params is not None:  # JSON's null and true have no typed gRPC field for FP32
        req = service_pb2.ModelInferRequest(model_name="sum")
        for name, shape, data in tensors:
            req.inputs.add(name=name, datatype="FP32", shape=shape)
            req.raw_input_contents.append(np.asarray(data, np.float32).tobytes())
        for key, value in grpc_params.items():
            req.parameters[key].int64_param = value
        with grpc.insecure_channel(front_door.grpc_url) as ch:
            with pytest.raises(grpc.RpcError) as e:
                service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and re.search(text, e.value.details()), \
            e.value.details()
    body = {"inputs": [{"name": n, "shape": shape, "datatype": "FP32", "data": data} for n, shape, data in tensors],
            "parameters": http_params}
    r = thttp.InferenceServerClient(front_door.http_url)._post("v2/models/sum/infer", json.dumps(body), None, None)
    assert r.status_code == 400 and re.search(text, json.loads(r.read())["error"]), r.read()


@pytest.mark.parametrize("number", ["1e400", "-1e400"])
def test_a_json_number_past_a_double_is_refused_not_read_as_infinity(front_door, number):
    """msgspec refuses such a literal and ``json``, read after it, made it inf: the model ran on
    infinity (200). Triton's reader refuses the number; the words Infinity and NaN stay taken."""
    data = ", ".join([number] + ["2.0"] * 11)
    body = f'{{"inputs": [{{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": [{data}]}}]}}'.encode()
    status, _, text = _post_infer(front_door, body)
    assert (status, json.loads(text)["error"]) == (
        400, f"failed to parse the request JSON buffer: the number {number} is past a double's range")
    status, _, text = _post_infer(front_door, body.replace(number.encode(), number.replace("1e400", "Infinity").encode()))
    assert status == 200, text


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_batch_past_the_models_max_batch_is_refused_in_tritons_words(front_door, protocol):
    """perf_analyzer -b 17 against a max_batch_size 16 model: Triton says "inference request
    batch-size must be <= 16 for 'sum'"; the front door said its shape words."""
    client = (tgrpc if protocol == "grpc" else thttp).InferenceServerClient(
        front_door.grpc_url if protocol == "grpc" else front_door.http_url)
    mod = tgrpc if protocol == "grpc" else thttp
    try:
        x = mod.InferInput("x", [17, 4], "FP32")
        x.set_data_from_numpy(np.ones((17, 4), np.float32))
        with pytest.raises(InferenceServerException) as e:
            client.infer("sum", [x])
        assert e.value.message().endswith("inference request batch-size must be <= 16 for 'sum'"), e.value.message()
        assert e.value.status() in ("StatusCode.INVALID_ARGUMENT", "400")
    finally:
        client.close()


def test_a_shape_whose_element_count_overflows_gets_the_shape_check(front_door):
    """[2**32, 2**32, 0] counts no element, as its (empty) data: numpy's reshape then failed, and
    the answer was "malformed inference request: ValueError: cannot reshape ...". The declared
    shape is checked against the model before the data is converted: gRPC raw contents, HTTP JSON
    and HTTP binary data."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    shape = [2 ** 32, 2 ** 32, 0]
    want = f"unexpected shape for input 'x' for model 'sum'. Expected [-1, 4] (batch 1..16), got {shape}"
    req = service_pb2.ModelInferRequest(model_name="sum")
    req.inputs.add(name="x", datatype="FP32", shape=shape)
    req.raw_input_contents.append(b"")
    with grpc.insecure_channel(front_door.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == want, e.value.details()
    tensor = {"name": "x", "shape": shape, "datatype": "FP32"}
    status, _, text = _post_infer(front_door, json.dumps({"inputs": [tensor | {"data": []}]}).encode())
    assert (status, json.loads(text)["error"]) == (400, want)
    body, n = _binary_body({"inputs": [tensor | {"parameters": {"binary_data_size": 0}}]})
    status, _, text = _post_infer(front_door, body, header_length=n)
    assert (status, json.loads(text)["error"]) == (400, want)


_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=False),
                         st.text(max_size=6))
_json = st.recursive(_json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                     max_leaves=8)
_edge_ints = st.sampled_from([-1, 0, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64])  # Triton reads these as uint64
_maybe = lambda good: st.one_of(st.just(good), st.just(good), _json)  # noqa: E731  mostly right, sometimes anything


@st.composite
def _fuzzed_http_infer(draw) -> tuple[str, bytes, dict]:
    """A JSON (or binary-extension) infer body: each field the valid one or any JSON value, one to
    three inputs (so an input can come twice), request and tensor parameters of any value."""
    def tensor():
        t = {"name": draw(_maybe("x")), "shape": draw(_maybe([3, 4])), "datatype": draw(_maybe("FP32")),
             "data": draw(_maybe(X.ravel().tolist()))}
        if draw(st.booleans()):
            t["parameters"] = draw(st.dictionaries(st.sampled_from(
                ["binary_data_size", "shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"]),
                _json, max_size=2))
        return t
    body = {"inputs": [tensor() for _ in range(draw(st.integers(1, 3)))],
            "parameters": draw(st.dictionaries(st.sampled_from(["priority", "timeout", "binary_data_output"]),
                                               _json | _edge_ints, max_size=3))}
    if draw(st.booleans()):
        body["outputs"] = [{"name": draw(_maybe("y")),
                            "parameters": draw(st.dictionaries(st.sampled_from(["binary_data", "classification"]),
                                                               _json, max_size=2))}]
    raw, headers = json.dumps(body).encode(), {}
    if draw(st.booleans()):  # the binary tensor extension, its header length anywhere near the truth
        headers["Inference-Header-Content-Length"] = str(len(raw) + draw(st.integers(-3, 3)))
        raw += draw(st.binary(max_size=48))
    return draw(st.sampled_from(["sum", "sum", "nope"])), raw, headers


@given(st.lists(_fuzzed_http_infer(), min_size=1, max_size=10))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_http_infer_gets_a_json_answer_never_a_500_and_the_node_serves_on(front_door, batch):
    """Whatever the body, the answer is 200 or a 4xx / 503 with a JSON error: a request's own fault
    is never an internal error (an HTTP timeout of 2**64 was a 500), and the node serves on."""
    c = thttp.InferenceServerClient(front_door.http_url)
    for model, raw, headers in batch:
        r = c._post(f"v2/models/{model}/infer", raw, headers, None)
        body = r.read()
        assert r.status_code in (200, 400, 404, 503), (r.status_code, body[:300], raw[:300])
        if r.status_code != 200:
            assert isinstance(json.loads(body)["error"], str)
    np.testing.assert_array_equal(c.infer("sum", [_http_input(X)]).as_numpy("y"), front_door.sdk("sum", X))


_FUZZ_SEGMENT = f"by_kserve_fuzz_{os.getpid()}"


@st.composite
def _fuzzed_http_call(draw) -> tuple[str, str, bytes]:
    """A call of the HTTP API beside infer: shared-memory registration (its body's fields of any
    JSON value), unregistration and status, metadata, config, statistics, repository index, with
    any region or model name in the path."""
    from urllib.parse import quote

    name = quote(draw(st.sampled_from(["sum", "r1", "..", "x" * 300]) | st.text(max_size=10)), safe="")
    kind = draw(st.sampled_from(["register", "register", "unregister", "status", "metadata", "config", "stats",
                                 "index"]))
    if kind == "register":
        body = {"key": draw(_maybe(f"/{_FUZZ_SEGMENT}")), "offset": draw(_maybe(0)), "byte_size": draw(_maybe(64))}
        return "POST", f"v2/systemsharedmemory/region/{name}/register", json.dumps(body).encode()
    if kind in ("unregister", "status"):
        return ("POST" if kind == "unregister" else "GET"), f"v2/systemsharedmemory/region/{name}/{kind}", b""
    if kind == "index":
        return "POST", "v2/repository/index", json.dumps({"ready": draw(_json)}).encode()
    return "GET", f"v2/models/{name}" + {"metadata": "", "config": "/config", "stats": "/stats"}[kind], b""


@given(st.lists(_fuzzed_http_call(), min_size=1, max_size=10))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_http_api_calls_get_a_json_answer_never_a_500(front_door, batch):
    """A registration body with a null key or a non-numeric offset was a 500. The 500s left are
    Triton's own answers: for a key no segment has, INTERNAL "Unable to open shared memory region";
    for a region of 0 bytes or past its segment's end, "Invalid shared memory region"."""
    c = thttp.InferenceServerClient(front_door.http_url)
    segment = shared_memory.SharedMemory(_FUZZ_SEGMENT, create=True, size=64)
    try:
        for method, path, body in batch:
            r = c._post(path, body, None, None) if method == "POST" else c._get(path, None, None)
            out = r.read()
            assert r.status_code in (200, 400, 404, 503) or (
                r.status_code == 500 and json.loads(out)["error"].startswith(
                    ("Unable to open shared memory region", "Invalid shared memory region"))), \
                (r.status_code, out[:300], path, body[:200])
            if r.status_code != 200:
                assert isinstance(json.loads(out)["error"], str)
    finally:
        c.unregister_system_shared_memory()
        segment.close()
        segment.unlink()


@st.composite
def _fuzzed_grpc_infer(draw):
    """A ModelInferRequest: each field the valid one or anything of its type, typed or raw
    contents in any number, parameters of every type."""
    from tritonclient.grpc import service_pb2

    ints = st.integers(-2 ** 63, 2 ** 63 - 1)
    r = service_pb2.ModelInferRequest(model_name=draw(st.sampled_from(["sum", "sum", "nope"])),
                                      model_version=draw(st.sampled_from(["", "1", "7"])))
    for _ in range(draw(st.integers(0, 3))):
        t = r.inputs.add(name=draw(st.sampled_from(["x", "x", "z"])),
                         datatype=draw(st.sampled_from(["FP32", "FP32", "INT32", "BYTES", "BF16", "nope"])),
                         shape=draw(st.just([3, 4]) | st.lists(st.integers(-2, 20) | ints, max_size=3)))
        contents = draw(st.sampled_from(["raw", "raw", "fp32", "int", "bytes", "shm", "none"]))
        if contents == "raw":
            r.raw_input_contents.append(draw(st.just(X.tobytes()) | st.binary(max_size=64)))
        elif contents == "fp32":
            t.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=12)))
        elif contents == "int":
            t.contents.int_contents.extend(draw(st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), max_size=12)))
        elif contents == "bytes":
            t.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=4), max_size=3)))
        elif contents == "shm":
            t.parameters["shared_memory_region"].string_param = draw(st.text(max_size=4))
            t.parameters["shared_memory_byte_size"].int64_param = draw(ints)
            t.parameters["shared_memory_offset"].int64_param = draw(ints)
    for _ in range(draw(st.integers(0, 2))):
        o = r.outputs.add(name=draw(st.sampled_from(["y", "x"])))
        if draw(st.booleans()):
            o.parameters["classification"].int64_param = draw(st.integers(-1, 3))
    for key in draw(st.lists(st.sampled_from(["priority", "timeout", "binary_data_output"]), max_size=3)):
        p = r.parameters[key]
        kind = draw(st.sampled_from(["int64", "uint64", "bool", "string", "double"]))
        if kind == "int64":
            p.int64_param = draw(ints)
        elif kind == "uint64":
            p.uint64_param = draw(st.integers(0, 2 ** 64 - 1) | st.just(2 ** 64 - 1))
        elif kind == "bool":
            p.bool_param = draw(st.booleans())
        elif kind == "string":
            p.string_param = draw(st.text(max_size=4))
        else:
            p.double_param = draw(st.floats())
    return r


@given(st.lists(_fuzzed_grpc_infer(), min_size=1, max_size=10))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_grpc_infer_gets_tritons_codes_never_an_internal_one_and_the_node_serves_on(front_door, batch):
    """Whatever the request, the answer is OK or the code Triton gives a request's own fault
    (INVALID_ARGUMENT, NOT_FOUND) or an unavailable model: never UNKNOWN or INTERNAL."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE}
    with grpc.insecure_channel(front_door.grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        for r in batch:
            try:
                stub.ModelInfer(r, timeout=30)
            except grpc.RpcError as e:
                assert e.code() in allowed, (e.code(), e.details(), r)
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    np.testing.assert_array_equal(g.infer("sum", [_grpc_input(X)]).as_numpy("y"), front_door.sdk("sum", X))


def test_a_request_protobuf_cannot_parse_is_internal_as_tritons_and_ends_a_stream_after_the_answers_before_it(
        front_door):
    """Bytes that are not the method's message (or a string field of invalid UTF-8) get Triton
    2.51's INTERNAL "Unable to parse request" on every unary method (grpc.aio answered UNKNOWN
    naming protobuf's DecodeError class); on a stream, as Triton's, the requests before it are
    answered and the stream ends OK there (it failed, UNKNOWN)."""
    import grpc
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="sum")
    request.inputs.add(name="x", datatype="FP32", shape=[3, 4])
    request.raw_input_contents.append(X.tobytes())
    good = request.SerializeToString()
    with grpc.insecure_channel(front_door.grpc_url) as ch:
        # (field 1 is a string in the first three: its bytes are not UTF-8; ServerLive's request has no fields)
        for method, junks in (("ModelInfer", 2), ("ModelMetadata", 2), ("SystemSharedMemoryStatus", 2), ("ServerLive", 1)):
            call = ch.unary_unary(f"/inference.GRPCInferenceService/{method}")
            for junk in (b"\xff\xff\xff", b"\x0a\x03\xff\xfe\xfd")[:junks]:
                with pytest.raises(grpc.RpcError) as e:
                    call(junk, timeout=30)
                assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INTERNAL, "Unable to parse request")
        stream = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        answers = stream(iter([good, b"\xff\xff\xff", good]), timeout=30)
        got = [service_pb2.ModelStreamInferResponse.FromString(a) for a in answers]
        assert answers.code() == grpc.StatusCode.OK
    assert len(got) == 1 and got[0].error_message == ""
    want = front_door.sdk("sum", X)
    np.testing.assert_array_equal(np.frombuffer(got[0].infer_response.raw_output_contents[0], want.dtype), want.ravel())


def test_bad_shm_region_is_not_found(front_door):
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    i = tgrpc.InferInput("x", [3, 4], "FP32")
    i.set_shared_memory("never_registered", X.nbytes)
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region") as e:
        g.infer("sum", [i])
    assert e.value.status() == "StatusCode.NOT_FOUND"
    h = thttp.InferenceServerClient(front_door.http_url)
    i = thttp.InferInput("x", [3, 4], "FP32")
    i.set_shared_memory("never_registered", X.nbytes)
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region") as e:
        h.infer("sum", [i])
    assert e.value.status() == "404"


def test_a_registration_without_key_or_size_or_of_no_bytes_is_refused(front_door):
    """As Triton 2.51: over HTTP a body without ``key`` or ``byte_size`` is a 400 naming the field
    (a missing size registered a region of 0 bytes); a region of 0 bytes, or past its segment's
    end, is refused over either protocol as a real tritonserver 2.51 refuses it, side by side:
    INVALID_ARGUMENT, 400 (this said INTERNAL, 500, a server fault a client may retry), and
    nothing is registered."""
    h = thttp.InferenceServerClient(front_door.http_url)
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    segment = shared_memory.SharedMemory(f"by_kserve_nosize_{os.getpid()}", create=True, size=64)
    try:
        for missing in ("key", "byte_size"):
            body = {k: v for k, v in {"key": f"/{segment.name}", "offset": 0, "byte_size": 16}.items() if k != missing}
            r = h._post("v2/systemsharedmemory/region/r0/register", json.dumps(body).encode(), None, None)
            assert r.status_code == 400, r.status_code
            assert json.loads(r.read())["error"] == f"Shared memory register request has no '{missing}' field"
        for size, offset, says in ((0, 0, "unable to process address space"), (65, 0, "invalid args"),
                                   (16, 60, "invalid args")):
            says = f"failed to register shared memory region 'r0': {says}"
            with pytest.raises(InferenceServerException, match=says) as e:
                h.register_system_shared_memory("r0", f"/{segment.name}", size, offset)
            assert e.value.status() == "400"
            with pytest.raises(InferenceServerException, match=says) as e:
                g.register_system_shared_memory("r0", f"/{segment.name}", size, offset)
            assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert h.get_system_shared_memory_status() == []
    finally:
        segment.close()
        segment.unlink()


def _with_output(parameters: dict) -> dict:
    """An infer body for ``sum`` of X, asking its output ``y`` with these parameters."""
    return {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": X.ravel().tolist()}],
            "outputs": [{"name": "y", "parameters": parameters}]}


MALFORMED_BODIES = {
    "inputs not an array": ({"inputs": {"x": 1}}, "Unable to parse 'inputs': expected an array"),
    "no inputs member": ({"outputs": []}, "Unable to parse 'inputs': the object has no member 'inputs'"),
    "an input that is no object": ({"inputs": ["x"]}, "Unable to parse 'name': it belongs to an object"),
    "an input without a name": ({"inputs": [{"shape": [3, 4], "datatype": "FP32", "data": [0] * 12}]},
                                "Unable to parse 'name': the object has no member 'name'"),
    "a shape that is a string": ({"inputs": [{"name": "x", "shape": "3,4", "datatype": "FP32", "data": [0] * 12}]},
                                 "Unable to parse 'shape': expected an array"),
    "a shape of fractions": ({"inputs": [{"name": "x", "shape": [3.0, 4], "datatype": "FP32", "data": [0] * 12}]},
                             "Unable to parse 'shape': expected an array of integers"),
    "outputs not an array": ({"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": [0] * 12}],
                              "outputs": {"y": 1}}, "Unable to parse 'outputs': expected an array"),
    "a name that is null": ({"inputs": [{"name": None, "shape": [3, 4], "datatype": "FP32", "data": [0] * 12}]},
                            "Unable to parse 'name': it is null"),
    # It was turned into a string and looked up: 5 used the region named "5", true "True".
    "a region named by a number": ({"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "parameters": {
        "shared_memory_region": 5, "shared_memory_byte_size": 48}}]},
        "Unable to parse 'shared_memory_region': expected a string, got 5"),
    # Triton refuses both pairs before it looks the region up; they were served (binary_data ignored).
    "an output in a region and binary": (_with_output({"shared_memory_region": "unregistered",
                                                       "shared_memory_byte_size": 48, "binary_data": True}),
                                         "Output can't set both 'shared_memory_region' and 'binary_data'"),
    "an output in a region and classified": (_with_output({"shared_memory_region": "unregistered",
                                                           "shared_memory_byte_size": 48, "classification": 1}),
                                             "Output can't set both 'shared_memory_region' and 'classification'"),
    "a classification that is no count": (_with_output({"classification": "2"}),
                                          "Unable to parse 'classification': expected an unsigned integer"),
}


def test_an_http_output_asking_zero_classes_is_the_tensor(front_door):
    """Triton's HTTP reads ``"classification": 0`` as no classification asked; it was refused."""
    r = thttp.InferenceServerClient(front_door.http_url)._post(
        "v2/models/sum/infer", json.dumps(_with_output({"classification": 0})), None, None)
    assert r.status_code == 200, r.read()
    np.testing.assert_allclose(json.loads(r.read())["outputs"][0]["data"], front_door.sdk("sum", X).ravel())


def test_classification_answers_each_items_top_classes_as_triton_does(front_door):
    """tritonclient's ``class_count`` (Triton's classification extension) was refused: each batch
    item's top k, largest first, as "value:index" strings in a BYTES tensor of [B, min(k, classes)],
    over gRPC, its aio client, and HTTP in binary and in JSON. (``sum`` answers [s, s] an item:
    equal values, ranked by index.)"""
    x = np.array([[1, 2, 3, 4], [0, 0, 0, 1], [9, 9, 9, 9]], np.float32)
    y = front_door.sdk("sum", x)[:, 0]
    want = {k: np.array([[f"{v:f}:{j}".encode() for j in range(min(k, 2))] for v in y], dtype=object) for k in (1, 5)}
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    for k in (1, 5):
        r = g.infer("sum", [_grpc_input(x)], outputs=[tgrpc.InferRequestedOutput("y", class_count=k)])
        assert r.get_output("y").datatype == "BYTES"
        np.testing.assert_array_equal(r.as_numpy("y"), want[k])

    async def aio():
        async with tgrpc_aio.InferenceServerClient(front_door.grpc_url) as c:
            return await c.infer("sum", [_grpc_input(x)], outputs=[tgrpc_aio.InferRequestedOutput("y", class_count=1)])

    np.testing.assert_array_equal(asyncio.run(aio()).as_numpy("y"), want[1])
    h = thttp.InferenceServerClient(front_door.http_url)
    for binary in (True, False):
        r = h.infer("sum", [_http_input(x)], outputs=[thttp.InferRequestedOutput("y", binary_data=binary, class_count=5)])
        assert r.get_output("y")["datatype"] == "BYTES" and r.get_output("y")["shape"] == [3, 2]
        got = r.as_numpy("y")
        np.testing.assert_array_equal(got if binary else np.vectorize(str.encode, otypes=[object])(got), want[5])


@pytest.mark.parametrize("params, says", [
    ({"classification": ("string_param", "2")},
     "invalid value type for 'classification' parameter, expected int64_param"),
    ({"classification": ("int64_param", 0)}, "invalid value for 'classification' parameter, expected >= 0"),
    ({"classification": ("int64_param", -3)}, "invalid value for 'classification' parameter, expected >= 0"),
    # (tritonclient refuses to ask it; Triton checks it before it looks the region up)
    ({"classification": ("int64_param", 1), "shared_memory_region": ("string_param", "unregistered"),
      "shared_memory_byte_size": ("int64_param", 24)},
     "output can't set both 'shared_memory_region' and 'classification'"),
])
def test_a_grpc_classification_asked_wrong_is_refused_in_tritons_words(front_door, params, says):
    from tritonclient.grpc import service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name="sum")
    req.inputs.add(name="x", datatype="FP32", shape=[3, 4])
    req.raw_input_contents.append(X.tobytes())
    o = req.outputs.add(name="y")
    for key, (field, value) in params.items():
        setattr(o.parameters[key], field, value)
    with grpc.insecure_channel(front_door.grpc_url) as ch, pytest.raises(grpc.RpcError) as e:
        service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == says, e.value.details()


def _classified_grpc(front_door, *mentions):
    """ModelInfer of ``sum`` on X, output ``y`` asked once per mention (its parameters: name ->
    (field, value)); the answer's y (datatype, shape, raw bytes)."""
    from tritonclient.grpc import service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name="sum")
    req.inputs.add(name="x", datatype="FP32", shape=[3, 4])
    req.raw_input_contents.append(X.tobytes())
    for params in mentions:
        o = req.outputs.add(name="y")
        for key, (field, value) in params.items():
            setattr(o.parameters[key], field, value)
    with grpc.insecure_channel(front_door.grpc_url) as ch:
        r = service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    (y,), (raw,) = r.outputs, r.raw_output_contents
    return y.datatype, list(y.shape), raw


def test_a_grpc_class_count_keeps_its_low_32_bits_as_tritons_does(front_door):
    """Triton keeps the count as a uint32: 2**32 + 1 asks 1 class, and 2**32 none, a [B, 0] tensor
    (tritonserver 2.51's answers; the front door ranked min(count, classes))."""
    y = front_door.sdk("sum", X)[:, 0]
    one = b"".join(struct.pack("<I", len(s)) + s for s in (f"{v:f}:0".encode() for v in y))
    assert _classified_grpc(front_door, {"classification": ("int64_param", 2**32 + 1)}) == ("BYTES", [3, 1], one)
    assert _classified_grpc(front_door, {"classification": ("int64_param", 2**32)}) == ("BYTES", [3, 0], b"")


@contextlib.contextmanager
def _registered_output_region(front_door, name: str):
    """A 24-byte region of this process's (``sum``'s output for X), registered with the front door
    over gRPC as ``name``: (tritonclient's shared-memory utilities, the region's handle)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "pkg_resources is deprecated"
        import tritonclient.utils.shared_memory as tshm
    tag = f"by_kserve_{os.getpid()}_{name}"
    out = tshm.create_shared_memory_region(name, f"/{tag}", 24)
    c = tgrpc.InferenceServerClient(front_door.grpc_url)
    try:
        c.register_system_shared_memory(name, f"/{tag}", 24)
        yield tshm, out
    finally:
        c.unregister_system_shared_memory(name)
        tshm.destroy_shared_memory_region(out)


def test_an_output_named_twice_over_grpc_is_classified_if_either_mention_asks_as_tritons(front_door):
    """Triton keeps, of an output named twice, the first mention's class count that has one and
    the first mention's region that names one: asked plain and then classified, it is classified
    (the front door answered the plain tensor); in a region by one mention and classified by the
    other, either way round, it is written to the region and answered classified (the front door
    answered the plain tensor, or left the region unwritten)."""
    datatype, shape, _ = _classified_grpc(front_door, {}, {"classification": ("int64_param", 1)})
    assert (datatype, shape) == ("BYTES", [3, 1])
    with _registered_output_region(front_door, "twice") as (tshm, out):
        region = {"shared_memory_region": ("string_param", "twice"), "shared_memory_byte_size": ("int64_param", 24)}
        classified = {"classification": ("int64_param", 1)}
        for mentions in ((region, classified), (classified, region)):
            tshm.set_shared_memory_region(out, [np.zeros((3, 2), np.float32)])
            datatype, shape, _ = _classified_grpc(front_door, *mentions)
            assert (datatype, shape) == ("BYTES", [3, 1])
            np.testing.assert_array_equal(tshm.get_contents_as_numpy(out, np.float32, [3, 2]), front_door.sdk("sum", X))


def test_a_later_mention_of_an_output_has_its_region_looked_up_not_measured_as_in_triton(front_door):
    """Triton looks up the region of every mention of an output (an unregistered one is refused,
    over gRPC and HTTP; the front door took the first mention alone over HTTP) but measures only
    the one it writes, the first (a later mention's region too small for the output was refused
    INTERNAL over gRPC, where Triton answers)."""
    with _registered_output_region(front_door, "later") as (tshm, out):
        whole = {"shared_memory_region": ("string_param", "later"), "shared_memory_byte_size": ("int64_param", 24)}
        four = {"shared_memory_region": ("string_param", "later"), "shared_memory_byte_size": ("int64_param", 4)}
        assert _classified_grpc(front_door, whole, four)[:2] == ("FP32", [3, 2])
        np.testing.assert_array_equal(tshm.get_contents_as_numpy(out, np.float32, [3, 2]), front_door.sdk("sum", X))
        nowhere = {"shared_memory_region": ("string_param", "nowhere"), "shared_memory_byte_size": ("int64_param", 24)}
        with pytest.raises(grpc.RpcError, match="Unable to find shared memory region: 'nowhere'"):
            _classified_grpc(front_door, whole, nowhere)
        body = _with_output({})
        body["outputs"].append({"name": "y", "parameters": {"shared_memory_region": "nowhere",
                                                            "shared_memory_byte_size": 24}})
        r = thttp.InferenceServerClient(front_door.http_url)._post("v2/models/sum/infer", json.dumps(body), None, None)
        assert r.status_code == 404 and b"Unable to find shared memory region: 'nowhere'" in r.read()


@pytest.mark.parametrize("count, classified", [(2**32 + 1, True), (2**32, False)])
def test_an_http_class_count_keeps_its_low_32_bits_as_tritons_does(front_door, count, classified):
    """2**32 + 1 asks 1 class; 2**32, like 0, none: the tensor as usual (tritonserver 2.51's answers)."""
    r = thttp.InferenceServerClient(front_door.http_url)._post(
        "v2/models/sum/infer", json.dumps(_with_output({"classification": count})), None, None)
    assert r.status_code == 200, r.read()
    (y,) = json.loads(r.read())["outputs"]
    assert (y["datatype"], y["shape"]) == (("BYTES", [3, 1]) if classified else ("FP32", [3, 2]))


def test_an_http_class_count_past_uint64_is_refused(front_door):
    r = thttp.InferenceServerClient(front_door.http_url)._post(
        "v2/models/sum/infer", json.dumps(_with_output({"classification": 2**64})), None, None)
    assert r.status_code == 400 and b"expected an unsigned 64-bit integer" in r.read()


def test_a_tensors_null_parameters_read_as_absent_and_the_requests_own_id_and_parameters_may_not_be_null(
        front_door):
    """As Triton 2.51 reads them, side by side: ``"parameters": null`` on an input or an output
    means none, as leaving it out; on the request, and a null ``id``, are refused (Triton: 500
    "Unable to parse 'id': attempt to access JSON non-string as string"; here 400, as every
    member of the wrong kind: docs/frontend.md). Both were served."""
    tensors = {"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32", "data": X.ravel().tolist(),
                           "parameters": None}], "outputs": [{"name": "y", "parameters": None}]}
    client = thttp.InferenceServerClient(front_door.http_url)
    r = client._post("v2/models/sum/infer", json.dumps(tensors), None, None)
    assert r.status_code == 200, r.read()
    np.testing.assert_allclose(json.loads(r.read())["outputs"][0]["data"], front_door.sdk("sum", X).ravel())
    for member in ("id", "parameters"):
        r = client._post("v2/models/sum/infer", json.dumps({**tensors, member: None}), None, None)
        assert r.status_code == 400 and json.loads(r.read())["error"].startswith(f"Unable to parse '{member}'"), member


def test_repository_calls_naming_a_repository_answer_as_tritons(front_door):
    """Triton 2.51, side by side: gRPC's index, load and unload naming a repository are
    UNIMPLEMENTED "'repository_name' specification is not supported" (the index was answered);
    over HTTP, load and unload under /v2/repository/<name>/ are 501 with those words, and the index
    there is answered, as Triton's HTTP index does not read the name (all three were 404s)."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    says = "'repository_name' specification is not supported"
    with grpc.insecure_channel(front_door.grpc_url) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        for call, request in ((stub.RepositoryIndex, service_pb2.RepositoryIndexRequest(repository_name="r")),
                              (stub.RepositoryModelLoad,
                               service_pb2.RepositoryModelLoadRequest(repository_name="r", model_name="sum")),
                              (stub.RepositoryModelUnload,
                               service_pb2.RepositoryModelUnloadRequest(repository_name="r", model_name="sum"))):
            with pytest.raises(grpc.RpcError) as e:
                call(request, timeout=30)
            assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNIMPLEMENTED, says)
    client = thttp.InferenceServerClient(front_door.http_url)
    for action in ("load", "unload"):
        r = client._post(f"v2/repository/r/models/sum/{action}", "{}", None, None)
        assert (r.status_code, json.loads(r.read())) == (501, {"error": says})
    r = client._post("v2/repository/r/index", "{}", None, None)
    assert r.status_code == 200 and "sum" in {m["name"] for m in json.loads(r.read())}


@pytest.mark.parametrize("case", list(MALFORMED_BODIES))
def test_a_malformed_json_body_is_named_by_its_field(front_door, case):
    """Each answered 400 naming a Python exception ("AttributeError: 'str' object has no attribute
    'get'"); now the field, in Triton's words. (Triton answers these 500; a body the client got
    wrong is a 400 here, docs/frontend.md.)"""
    body, text = MALFORMED_BODIES[case]
    r = thttp.InferenceServerClient(front_door.http_url)._post("v2/models/sum/infer", json.dumps(body), None, None)
    error = json.loads(r.read())["error"]
    assert r.status_code == 400 and error.startswith(text) and "Error" not in error, error


def test_http_shm_registration_takes_only_unsigned_integers(front_door):
    """Triton reads offset and byte_size as unsigned integers; "8" and 1.9 were taken as 8 and 1."""
    c = thttp.InferenceServerClient(front_door.http_url)
    segment = shared_memory.SharedMemory(f"by_kserve_uint_{os.getpid()}", create=True, size=64)
    try:
        for field, value in (("offset", "8"), ("offset", 1.9), ("byte_size", "16"), ("byte_size", None)):
            body = {"key": f"/{segment.name}", "offset": 0, "byte_size": 16, field: value}
            r = c._post("v2/systemsharedmemory/region/r/register", json.dumps(body).encode(), None, None)
            assert r.status_code == 400 and f"Unable to parse '{field}'" in json.loads(r.read())["error"]
        assert c.get_system_shared_memory_status() == []
    finally:
        c.unregister_system_shared_memory()
        segment.close()
        segment.unlink()


def test_timeout_parameter_becomes_the_deadline(front_door):
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    with pytest.raises(InferenceServerException, match="Request timeout expired") as e:
        g.infer("slow", [_grpc_input(X)], timeout=1000, client_timeout=30)  # 1 ms on a 300 ms model
    assert e.value.status() == "StatusCode.UNAVAILABLE"


@pytest.mark.parametrize("timeout_us, client_timeout_s", [(None, 0.1), (10_000_000, 0.1)])
def test_a_grpc_deadline_the_model_cannot_meet_is_deadline_exceeded(front_door, timeout_us, client_timeout_s):
    """Triton 2.51 lets the call's own gRPC deadline run out: DEADLINE_EXCEEDED. Mapped as the
    ``timeout`` parameter's expiry (UNAVAILABLE), clients and retry policies took a passing fault
    and retried at once. The ``timeout`` parameter, when it is the sooner limit, stays UNAVAILABLE
    (test above)."""
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        g.infer("slow", [_grpc_input(X)], timeout=timeout_us, client_timeout=client_timeout_s)  # a 300 ms model
    assert e.value.status() == "StatusCode.DEADLINE_EXCEEDED", e.value


@pytest.mark.parametrize("given, sent", [(None, 3600.0), (0.25, 0.25)])
def test_a_request_without_timeout_gets_the_nodes_default_deadline(tmp_path, given, sent):
    # Triton sets no deadline on a request without `timeout`; Batchyard's front door gives it the
    # node's [dispatcher] default_timeout_s. It gave the Python SDK's 30 s instead, whatever the
    # config said: a saturated perf_analyzer run lost requests at 30 s with the key at 3600.
    spec = P.ModelSpec("m", (P.TensorSpec("x", "float32", (2,)),), (P.TensorSpec("y", "float32", (2,)),))
    seen = []

    class FakeClient:
        specs = {"m": spec}

        async def infer(self, model, inputs, priority, timeout):
            seen.append(timeout)
            return type("Out", (), {"timing": None})()

    core = KServeCore(FakeClient(), ShmRegions(str(tmp_path / "registry")), default_timeout_s=3600.0)
    try:
        asyncio.run(core.infer("m", {"x": np.zeros((1, 2), np.float32)}, timeout=given))
    finally:
        core.close()
    assert seen == [sent]


def test_a_request_the_dispatcher_refuses_lets_go_of_its_inputs_with_its_answer(tmp_path):
    """The front door's error, kept as a local, held the frame that held it: the request's inputs
    (read into the Batchyard client's pool from the caller's shared memory) lived on until the
    cycle collector ran; 200 requests refused for their timeout held 24-44 MiB, and a second
    pool segment of 64 MiB over gRPC (an outside review)."""
    import gc
    import weakref

    from batchyard.errors import DeadlineExceeded

    spec = P.ModelSpec("m", (P.TensorSpec("x", "float32", (2,)),), (P.TensorSpec("y", "float32", (2,)),))

    class FakeClient:
        specs = {"m": spec}

        async def infer(self, model, inputs, priority, timeout):
            raise DeadlineExceeded("Request timeout expired: no path can finish 1 item(s) in time")

    async def refused(core):
        x = np.zeros((1, 2), np.float32)
        kept = weakref.ref(x)
        try:
            await core.infer("m", {"x": x}, timeout=1e-6)
        except KServeError as e:  # the answer, as the servicers give it
            assert e.code == grpc.StatusCode.UNAVAILABLE  # (Triton's for a timeout in the queue)
        del x
        return kept() is None

    core = KServeCore(FakeClient(), ShmRegions(str(tmp_path / "registry")))
    gc.disable()
    try:
        assert asyncio.run(refused(core)), "the refused request's inputs outlive its answer"
    finally:
        gc.enable()
        core.close()


def test_a_client_that_leaves_while_its_classes_are_ranked_counts_a_success_as_in_triton(tmp_path):
    """The model served it; Triton counts it a success (its backend reports before the frontend
    ranks). The ranking, awaited off the loop, counted it a failure when its caller was cancelled."""
    spec = P.ModelSpec("m", (P.TensorSpec("x", "float32", (2,)),), (P.TensorSpec("y", "float32", (2,)),))

    class FakeClient:
        specs = {"m": spec}

        async def infer(self, model, inputs, priority, timeout):
            return type("Out", (), {"timing": None})()

    async def run(core):
        ranking = asyncio.get_running_loop().create_future()  # a ranking that has not ended

        def reply(out):
            async def ranked():
                ranking.set_result(None)
                await asyncio.get_running_loop().create_future()
            return ranked()
        call = asyncio.ensure_future(core.infer("m", {"x": np.zeros((3, 2), np.float32)}, reply=reply))
        await ranking
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    from batchyard import kserve_stats as S

    core = KServeCore(FakeClient(), ShmRegions(str(tmp_path / "registry")))
    try:
        asyncio.run(run(core))
        c = core.stats.counters("m")
        assert (c[S.SUCCESS], c[S.FAIL], c[S.ITEMS]) == (1, 0, 3)
    finally:
        core.close()


def test_a_tensor_of_one_value_an_item_is_tritons_dims_1_with_a_reshape_and_takes_b_by_1(tmp_path):
    """Its config said dims [] (no Triton's: tritonserver refuses it at load) and its metadata
    [-1]: perf_analyzer stopped at once, "unable to set shape for the input", over gRPC and HTTP.
    Now dims [1] with reshape [] and metadata [-1, 1], as Triton's; [B, 1] is taken as the
    model's [B], and [B] still is."""
    from batchyard.kserve_common import check_declared_input, model_config, model_metadata

    spec = P.ModelSpec("s", (P.TensorSpec("x", "float32", ()),), (P.TensorSpec("y", "int64", ()),), max_batch=8)
    cfg = model_config(spec)
    assert cfg["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [1], "reshape": {"shape": []}}]
    assert cfg["output"][0]["dims"] == [1] and cfg["output"][0]["reshape"] == {"shape": []}
    assert model_metadata(spec)["inputs"][0]["shape"] == [-1, 1]
    check_declared_input(spec, "x", "FP32", [2, 1])  # a shared-memory input, as declared
    with pytest.raises(KServeError, match="unexpected shape"):
        check_declared_input(spec, "x", "FP32", [2, 2])
    seen = []

    class FakeClient:
        specs = {"s": spec}

        async def infer(self, model, inputs, priority, timeout):
            seen.append(inputs["x"].shape)
            return type("Out", (), {"timing": None})()

    core = KServeCore(FakeClient(), ShmRegions(str(tmp_path / "registry")))
    try:
        for x in (np.zeros((3, 1), np.float32), np.zeros(3, np.float32)):
            asyncio.run(core.infer("s", {"x": x}))
    finally:
        core.close()
    assert seen == [(3,), (3,)]


def test_inputs_of_different_batch_sizes_are_refused_at_the_door_in_tritons_words(tmp_path):
    """Each shape fine alone, the batch sizes apart: the dispatcher refused it, and the front
    door counted a failure in ModelStatistics, where Triton refuses it before inference and
    counts nothing."""
    from batchyard.errors import InvalidArgument
    from batchyard.kserve_common import KServeError

    spec = P.ModelSpec("two", (P.TensorSpec("a", "float32", (2,)), P.TensorSpec("b", "float32", (2,))),
                       (P.TensorSpec("y", "float32", (2,)),), max_batch=8)
    asked = []

    class Client:
        specs = {"two": spec}

        async def infer(self, *args, **kw):
            asked.append(args)
            raise InvalidArgument("inputs[1] ('b'): batch dimension 2 differs from other inputs' 1")  # the dispatcher's

    core = KServeCore(Client(), ShmRegions(str(tmp_path / "registry")))
    try:
        with pytest.raises(KServeError) as e:
            asyncio.run(core.infer("two", {"a": np.zeros((1, 2), np.float32), "b": np.zeros((2, 2), np.float32)}))
    finally:
        core.close()
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and not asked
    assert e.value.message == "input 'b' batch size does not match other inputs for 'two'"


@pytest.mark.parametrize("waiting_on", ["spec", "infer"])
def test_a_request_the_stop_cuts_off_is_unavailable_whether_it_waited_on_its_spec_or_its_batch(tmp_path, waiting_on):
    """The stop fails what still waits on the node (its client closed: Cancelled); an infer
    was answered UNAVAILABLE (503), but a model's first request, waiting on the model's spec,
    got CANCELLED (HTTP 400, a client error nobody retries)."""
    from batchyard.errors import Cancelled
    from batchyard.kserve_common import KServeError

    spec = P.ModelSpec("m", (P.TensorSpec("x", "float32", (2,)),), (P.TensorSpec("y", "float32", (2,)),))

    class ClosedByTheStop:
        specs = {} if waiting_on == "spec" else {"m": spec}

        async def model_info(self, model, timeout):
            raise Cancelled("client closed")

        async def infer(self, model, inputs, priority, timeout):
            raise Cancelled("client closed")

        def close(self):
            pass

    core = KServeCore(ClosedByTheStop(), ShmRegions(str(tmp_path / "registry")))
    core.stop_waiting()
    try:
        with pytest.raises(KServeError) as e:
            asyncio.run(core.infer("m", {"x": np.zeros((1, 2), np.float32)}))
    finally:
        core.close()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.http_status == 503, e.value.message
    assert "the server is stopping" in e.value.message


def test_a_shared_memory_input_read_during_the_stop_is_answered_unavailable_too(tmp_path):
    """Inputs in a region are read into the Batchyard client's pool: with the client closed by the
    stop, that failed (Cancelled) before the request reached the node, and the answer was an
    INTERNAL error instead of the stop's UNAVAILABLE."""
    from batchyard.errors import Cancelled

    spec = P.ModelSpec("m", (P.TensorSpec("x", "float32", (2,)),), (P.TensorSpec("y", "float32", (2,)),))

    class ClosedByTheStop:
        specs = {"m": spec}
        shm_threshold = 0  # every input through the pool

        def alloc_array(self, shape, dtype):
            raise Cancelled("client closed")

        async def infer(self, model, inputs, priority, timeout):
            raise Cancelled("client closed")

        def close(self):
            pass

    seg = shared_memory.SharedMemory(f"by_kserve_stop_{os.getpid()}", create=True, size=8)
    core = KServeCore(ClosedByTheStop(), ShmRegions(str(tmp_path / "registry")))
    try:
        core.shm.register("in", f"/{seg.name}", 0, 8)
        core.stop_waiting()

        async def request():
            x = core.shm.read("in", 0, 8, "FP32", [1, 2], "x", spec, 0, core.input_array)
            return await core.infer("m", {"x": x})
        with pytest.raises(KServeError) as e:
            asyncio.run(request())
    finally:
        core.close()
        seg.close()
        seg.unlink()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "the server is stopping" in e.value.message


@pytest.mark.parametrize("strict, served, want", [(True, {"a", "b"}, True), (True, {"a"}, False),
                                                  (False, {"a"}, True), (False, set(), False)])
def test_server_readiness_is_strict_as_tritons_unless_configured_not(tmp_path, strict, served, want):
    """Strict (Triton's default): ready while every model of the node has a worker; the server
    stayed ready with one model's last worker gone. ``strict_readiness = false``: while any has."""
    class FakeClient:
        specs = {}

        async def status(self, timeout, brief):
            workers = [type("W", (), {"models": [m], "path": "cpu"})() for m in sorted(served)]
            return type("Status", (), {"workers": workers, "models": ["a", "b"]})()

    core = KServeCore(FakeClient(), ShmRegions(str(tmp_path / "registry")), strict_readiness=strict)
    try:
        assert asyncio.run(core.server_ready()) is want
    finally:
        core.close()


# ---------------------------------------------------------------- disconnects and readiness
def test_client_that_disconnects_mid_request_loses_nothing_for_others(front_door):
    want = front_door.sdk("slow", X)

    async def run():
        quitter = tgrpc_aio.InferenceServerClient(front_door.grpc_url)
        patient = tgrpc_aio.InferenceServerClient(front_door.grpc_url)
        h = thttp_aio.InferenceServerClient(front_door.http_url)
        try:
            others = [asyncio.ensure_future(patient.infer("slow", [_grpc_input(X)])) for _ in range(6)]
            gave_up = [quitter.infer("slow", [_grpc_input(X)], client_timeout=0.05) for _ in range(6)]
            hi = thttp_aio.InferInput("x", [3, 4], "FP32")
            hi.set_data_from_numpy(X)
            http_quits = [asyncio.ensure_future(h.infer("slow", [hi])) for _ in range(3)]
            # The gRPC quitters give up at their 50 ms deadline; by then the HTTP requests sent
            # before them are at the front door too: hang those up now.
            quit_results = await asyncio.gather(*gave_up, return_exceptions=True)
            for t in http_quits:
                t.cancel()
            await h.close()
            assert all(isinstance(r, InferenceServerException) for r in quit_results)
            return [r.as_numpy("y") for r in await asyncio.gather(*others)]
        finally:
            await quitter.close()
            await patient.close()

    outs = asyncio.run(run())
    assert len(outs) == 6
    for out in outs:
        np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(
        tgrpc.InferenceServerClient(front_door.grpc_url).infer("sum", [_grpc_input(X)]).as_numpy("y"),
        front_door.sdk("sum", X))


def test_an_http_client_that_hangs_up_withdraws_its_request(front_door):
    """Requests queued behind a running batch whose HTTP clients close the connection leave the
    queue while that batch still runs: they are withdrawn, not run for nobody (aiohttp, left to
    its default, let the handler run on and the request took a place in the next batch)."""
    body = json.dumps({"inputs": [{"name": "x", "shape": [3, 4], "datatype": "FP32",
                                   "data": X.ravel().tolist()}]}).encode()
    head = (f"POST /v2/models/slow/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    with Client(front_door.node.address) as c:
        done: queue.Queue = queue.Queue()
        g.async_infer("slow", [_grpc_input(X)], callback=lambda result, error: done.put((result, error)))
        give_up = time.monotonic() + 30  # the waits below end in ms; this only keeps a broken run from hanging
        while not any(w.inflight for w in c.status().workers if w.name == "slow0"):
            assert time.monotonic() < give_up
        started = time.monotonic()  # the slow worker's batch runs 300 ms from about now
        hung_up = [socket.create_connection(("127.0.0.1", int(front_door.http_url.rsplit(":", 1)[1])))
                   for _ in range(6)]
        for s in hung_up:
            s.sendall(head + body)
        while c.status().queued < len(hung_up):  # all six are queued behind the running batch
            assert time.monotonic() < give_up
        for s in hung_up:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, as a killed client
            s.close()
        while c.status().queued:
            assert time.monotonic() < give_up
        emptied_after = time.monotonic() - started
    # Run, they would leave the queue only when the running batch ends, 300 ms after it started
    # (a few ms before `started`: the bound leaves room on both sides).
    assert emptied_after < 0.2, f"the queue emptied {emptied_after:.3f} s in: the hung-up requests were run"
    result, error = done.get(timeout=30)
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("y"), front_door.sdk("slow", X))


def test_readiness_follows_the_models_last_worker(front_door):
    g = tgrpc.InferenceServerClient(front_door.grpc_url)
    h = thttp.InferenceServerClient(front_door.http_url)
    with Client(front_door.node.address) as c:
        st = c.status()
    pid = next(w.pid for w in st.workers if w.name == "solo0")
    assert g.is_model_ready("solo") and h.is_model_ready("solo")
    os.kill(pid, signal.SIGSTOP)  # silent: the dispatcher declares it dead after worker_dead_after_s
    try:
        with Client(front_door.node.address) as c:  # long poll: answered when a worker leaves rotation
            gone = c.status(min_departures=st.departures + 1, wait=30)
        assert gone.departures > st.departures and "solo0" not in {w.name for w in gone.workers}
        # The front door asks the dispatcher on every probe: no stale "ready" after the loss.
        assert not g.is_model_ready("solo") and not h.is_model_ready("solo")
        assert g.is_model_ready("sum"), "other models stay ready"
        # The server is not, as Triton's default strict readiness has it (it stayed ready).
        assert not g.is_server_ready() and not h.is_server_ready()
    finally:
        os.kill(pid, signal.SIGCONT)
    with Client(front_door.node.address) as c:  # it registers again once it heartbeats
        assert c.status(min_registrations=st.registrations + 1, wait=30).registrations > st.registrations
    assert g.is_model_ready("solo") and h.is_model_ready("solo")
    assert g.is_server_ready() and h.is_server_ready()


def test_connections_that_send_nothing_of_a_request_are_closed_and_others_served():
    """[frontend] idle_timeout_s: a connection that sends nothing, one whose headers never end,
    and one whose body stalls are closed after it (the last with a 408 that says so); each held
    a descriptor for aiohttp's hour before. A body that trickles is answered 408 too, and an
    idle gRPC connection is closed. Clients that keep sending are served meanwhile."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with _node_with_front_door(idle_timeout_s=0.5) as fd:
        host, port = fd.http_url.split(":")
        head = b"POST /v2/models/sum/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 200\r\n\r\n"
        conns = []
        for sent in (b"", b"POST /v2/models/sum/infer HTTP/1.1\r\nHost: x\r\n", head + b'{"inputs": ['):
            c = socket.create_connection((host, int(port)), timeout=30)  # well past the 0.5 s: a hang fails
            c.sendall(sent)
            conns.append(c)
        h = thttp.InferenceServerClient(fd.http_url)
        np.testing.assert_array_equal(h.infer("sum", [_http_input(X)]).as_numpy("y"), fd.sdk("sum", X))
        answers = []
        for c in conns:
            with c:
                got = b""
                while chunk := c.recv(65536):  # until the server closes the connection
                    got += chunk
                answers.append(got)
        assert answers[:2] == [b"", b""]
        assert answers[2].startswith(b"HTTP/1.1 408") and b"the request body stalled" in answers[2], answers[2]

        # A body that trickles (a byte every 50 ms, never a 0.5 s stall) is cut off too, once it
        # falls below MIN_BODY_RATE after the first idle_timeout_s; before, it was never answered.
        with socket.create_connection((host, int(port)), timeout=30) as c:
            c.sendall(head.replace(b"Content-Length: 200", b"Content-Length: 100000"))
            c.settimeout(0.05)  # the pace of the trickle: one byte per wait for the answer
            got = b""
            for _ in range(600):  # 30 s of trickling at most, far past the ~0.5 s it may take
                try:
                    chunk = c.recv(65536)
                except TimeoutError:
                    c.sendall(b" ")
                    continue
                if not chunk:
                    break
                got += chunk
        assert got.startswith(b"HTTP/1.1 408") and b"the request body arrives too slowly" in got, got
        np.testing.assert_array_equal(h.infer("sum", [_http_input(X)]).as_numpy("y"), fd.sdk("sum", X))

        # A gRPC connection with no call in flight is closed too (GOAWAY: the channel goes idle),
        # and the channel's next call opens a new one; gRPC's default kept it for ever.
        states: queue.Queue = queue.Queue()
        with grpc.insecure_channel(fd.grpc_url) as ch:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
            assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=30).live
            ch.subscribe(states.put)
            while (state := states.get(timeout=30)) != grpc.ChannelConnectivity.IDLE:  # 30 s: a hang fails
                assert state != grpc.ChannelConnectivity.SHUTDOWN
            assert stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=30).live


def test_a_body_past_max_request_bytes_is_refused_413():
    """The body is read by the front door's own loop (http_body._read_raw, which bounds each wait
    for the next bytes), so the size limit aiohttp's ``read()`` applied is its to apply too."""
    with _node_with_front_door(max_request_bytes=1 << 16) as fd:
        h = thttp.InferenceServerClient(fd.http_url)
        x = np.zeros((16, 4), np.float32)
        big = json.dumps({"inputs": [{"name": "x", "shape": [16, 4], "datatype": "FP32", "data": x.ravel().tolist()}],
                          "id": "x" * (1 << 16)})
        r = h._post("v2/models/sum/infer", big, None, None)
        assert r.status_code == 413 and "Request Entity Too Large" in json.loads(r.read())["error"]
        np.testing.assert_array_equal(h.infer("sum", [_http_input(X)]).as_numpy("y"), fd.sdk("sum", X))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin to one of them")
def test_the_dispatcher_and_the_front_door_run_on_their_configured_cpus():
    """[dispatcher] cpus and [frontend] cpus: every thread of those processes (gRPC's and
    ZeroMQ's too) on the cpus named, the workers on theirs (here, as inherited), and the node
    serving. Without them the front door's and the dispatcher's per-request work ran on the
    model's cores."""
    mine = sorted(os.sched_getaffinity(0))
    cpu = mine[-1]
    with _node_with_front_door(dispatcher={"cpus": (cpu,)}, cpus=(cpu,), processes=2) as fd:
        g = tgrpc.InferenceServerClient(fd.grpc_url)
        np.testing.assert_array_equal(g.infer("sum", [_grpc_input(X)]).as_numpy("y"), fd.sdk("sum", X))
        procs = {p.pid: " ".join(p.cmdline()) for p in psutil.Process(fd.node.up.pid).children(recursive=True)}
        masks = {}
        for pid, title in procs.items():
            role = "dispatcher" if "::dispatcher" in title else "frontend" if "::frontend" in title else "worker"
            for tid in os.listdir(f"/proc/{pid}/task"):
                masks.setdefault(role, set()).add(tuple(sorted(os.sched_getaffinity(int(tid)))))
    assert masks["dispatcher"] == {(cpu,)} and masks["frontend"] == {(cpu,)}, masks
    assert masks["worker"] == {tuple(mine)}, masks
    assert sum("::frontend" in t for t in procs.values()) == 2


def test_a_header_length_is_read_as_tritons_atoi_reads_it(front_door):
    """Triton 2.51 reads Inference-Header-Content-Length with std::atoi (side by side with a
    tritonserver): digits after blanks and a sign, up to the first other character ("104abc" and
    "+104" are 104, and were 400s here), wrapping past int32 as glibc's atoi does; no digits is
    0, a raw binary request (so is another script's digit, "\u0663", once read as 3)."""
    body, n = _binary_body({"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 4],
                                        "parameters": {"binary_data_size": X.nbytes}}]}, X.tobytes())
    want = front_door.sdk("sum", X)
    for value in (f"{n}abc", f"+{n}", f" {n}", f"0{n}", str(n + (1 << 32))):
        status, headers, text = _post_infer(front_door, body, header_length=value)
        assert status == 200, (value, text)
        assert json.loads(text)["outputs"][0]["data"] == want.ravel().tolist(), (value, text)
    item = X[:1]
    for value in ("abc", "\u0663".encode().decode("latin-1"), "-0"):  # the body: one item's raw bytes
        status, headers, text = _post_infer(front_door, item.tobytes(), header_length=value)
        assert status == 200, (value, text)
        n_head = int(headers["Inference-Header-Content-Length"])  # (a raw request's answer is binary)
        want = front_door.sdk("sum", item)
        assert np.frombuffer(text[n_head:], want.dtype).tolist() == want.ravel().tolist(), (value, text)
    status, _, text = _post_infer(front_door, body, header_length=f"{n // 10}_{n % 10}")  # 10: JSON cut short
    assert status == 400 and b"failed to parse the request JSON buffer" in text, text


# ---------------------------------------------------------------- against Triton itself
_TRITON_SUM = {
    "config.pbtxt": 'name: "sum"\nbackend: "python"\nmax_batch_size: 16\n'
                    'input [ { name: "x", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
                    'output [ { name: "y", data_type: TYPE_FP32, dims: [ 2 ] } ]\n'
                    'instance_group [ { kind: KIND_CPU, count: 1 } ]\n',
    "1/model.py": "import numpy as np\nimport triton_python_backend_utils as pb_utils\n\n\n"
                  "class TritonPythonModel:\n    def execute(self, requests):\n"
                  "        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor('y', np.zeros(\n"
                  "            (pb_utils.get_input_tensor_by_name(r, 'x').as_numpy().shape[0], 2), np.float32))])\n"
                  "                for r in requests]\n",
}


@pytest.fixture(scope="module")
def triton_sum(tmp_path_factory):
    """A real tritonserver (nvidia-pytriton's) serving a python-backend `sum` of the front door's
    inputs and outputs."""
    with triton_serving_sum(tmp_path_factory) as tl:
        yield tl


@contextlib.contextmanager
def triton_serving_sum(tmp_path_factory, extra_args: tuple = ()):
    """A started tritonserver serving `sum` (skips the test where the wheel is missing), with
    more tritonserver options; always stopped."""
    if importlib.util.find_spec("pytriton") is None:
        pytest.skip("needs nvidia-pytriton's tritonserver")
    from batchyard.workers.triton_local import TritonLocal

    repo = tmp_path_factory.mktemp("triton-repo")
    for rel, text in _TRITON_SUM.items():
        (repo / "sum" / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / "sum" / rel).write_text(text)
    tl = TritonLocal(repo, models=["sum"], extra_args=extra_args).start(ready_timeout_s=120)
    try:
        yield tl
    finally:
        tl.close()


_XJ = {"name": "x", "shape": [3, 4], "datatype": "FP32", "data": X.ravel().tolist()}
# (method, path, JSON body): requests a Triton user's code sends, right and wrong. Left out, as
# docs/frontend.md says: bodies Batchyard cannot read (Triton 500, Batchyard 400), trace and log
# settings, a `timeout` (Triton's applies to its batcher's queue only), and model control (this
# Triton runs in explicit mode; a node's models are its config's, as in mode NONE).
PARITY_HTTP = [
    ("POST", "v2/models/nope/infer", {"inputs": [_XJ]}), ("GET", "v2/models/nope", None),
    ("GET", "v2/models/nope/config", None), ("GET", "v2/models/nope/stats", None),
    ("GET", "v2/models/nope/ready", None), ("GET", "v2/models/sum/versions/3", None),
    ("GET", "v2/models/sum/versions/3/stats", None), ("GET", "v2/models/sum/versions/x", None),
    ("GET", "v2/models/sum/versions/-1/ready", None), ("GET", "v2/models/sum/versions/01", None),
    ("POST", "v2/models/sum/infer", {"inputs": [_XJ], "outputs": [{"name": "z"}]}),
    ("POST", "v2/models/sum/infer", {"inputs": [_XJ], "outputs": [{"name": "y"}, {"name": "y"}]}),
    ("POST", "v2/models/sum/infer", {"inputs": []}),
    ("POST", "v2/models/sum/infer", {"inputs": [dict(_XJ, shape=[17, 4], data=[0.0] * 68)]}),
    ("POST", "v2/models/sum/infer", {"inputs": [dict(_XJ, shape=[12])]}),
    ("POST", "v2/models/sum/infer", {"inputs": [dict(_XJ, datatype="INT32", data=list(range(12)))]}),
    ("POST", "v2/models/sum/infer", {"inputs": [dict(_XJ, datatype="BYTES", data=["a"] * 12)]}),
    ("POST", "v2/models/sum/infer", {"inputs": [_XJ, _XJ]}),
    ("POST", "v2/models/sum/infer", {"inputs": [dict(_XJ, data=None, parameters={
        "shared_memory_region": "nope", "shared_memory_byte_size": 48})]}),
    ("POST", "v2/models/sum/infer", {"id": "a", "inputs": [_XJ], "parameters": {"priority": 5, "other": 1}}),
    ("GET", "v2/systemsharedmemory/region/nope/status", None),
    ("POST", "v2/systemsharedmemory/region/nope/unregister", None),
    ("POST", "v2/systemsharedmemory/region/r/register", {"offset": 0, "byte_size": 16}),
    # Triton's classification extension (classes asked, 2**32 + 1 of them: 1, and in a region too)
    ("POST", "v2/models/sum/infer", {"inputs": [_XJ], "outputs": [{"name": "y", "parameters": {"classification": 2}}]}),
    ("POST", "v2/models/sum/infer", {"inputs": [_XJ], "outputs": [{"name": "y", "parameters": {
        "classification": 2**32 + 1}}]}),
    ("POST", "v2/models/sum/infer", {"inputs": [_XJ], "outputs": [{"name": "y", "parameters": {
        "classification": 1, "shared_memory_region": "nope", "shared_memory_byte_size": 8}}]}),
]


def _http_status(url: str, method: str, path: str, body) -> int:
    import urllib.error
    import urllib.request
    data = None if body is None else json.dumps(body).encode()
    try:
        request = urllib.request.Request(f"http://{url}/{path}", data, method=method)
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_http_answers_with_tritons_status_codes(front_door, triton_sum):
    """The same requests to Triton 2.51 and to the front door get the same HTTP status."""
    triton_url = f"127.0.0.1:{triton_sum.http_port}"
    got = [(m, p, _http_status(triton_url, m, p, b), _http_status(front_door.http_url, m, p, b))
           for m, p, b in PARITY_HTTP]
    assert [g for g in got if g[2] != g[3]] == [], "(method, path, Triton, Batchyard)"


def test_grpc_answers_with_tritons_status_codes(front_door, triton_sum):
    """The same gRPC requests to Triton 2.51 and to the front door get the same status code."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb, service_pb2_grpc

    def infer(model="sum", version="", outputs=(), shape=(3, 4), raw=X.tobytes(), **params):
        r = pb.ModelInferRequest(model_name=model, model_version=version)
        r.inputs.add(name="x", datatype="FP32", shape=list(shape))
        r.raw_input_contents.append(raw)
        for o in outputs:
            r.outputs.add(name=o)
        for k, v in params.items():
            r.parameters[k].int64_param = v
        return r

    typed = pb.ModelInferRequest(model_name="sum")
    typed.inputs.add(name="x", datatype="FP32", shape=[3, 4]).contents.int_contents.extend(range(12))

    def classified(field, value):  # Triton's classification extension
        r = infer()
        setattr(r.outputs.add(name="y").parameters["classification"], field, value)
        return r

    calls = [("ModelInfer", infer("nope")), ("ModelInfer", infer("")), ("ModelInfer", infer(version="3")),
             ("ModelInfer", infer(version="x")), ("ModelInfer", infer(outputs=["z"])),
             ("ModelInfer", infer(outputs=["y", "y"])), ("ModelInfer", infer(shape=(17, 4), raw=bytes(272))),
             ("ModelInfer", infer(raw=X.tobytes()[:-4])), ("ModelInfer", infer(priority=5, sequence_id=3)),
             ("ModelInfer", typed), ("ModelMetadata", pb.ModelMetadataRequest(name="nope")),
             ("ModelConfig", pb.ModelConfigRequest(name="nope")),
             ("ModelConfig", pb.ModelConfigRequest(name="sum", version="2")),
             ("ModelStatistics", pb.ModelStatisticsRequest(name="nope")),
             ("ModelStatistics", pb.ModelStatisticsRequest(name="sum", version="2")),
             ("ModelReady", pb.ModelReadyRequest(name="sum", version="x")),
             ("ModelReady", pb.ModelReadyRequest(name="nope")),
             ("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(name="nope")),
             ("SystemSharedMemoryRegister",
              pb.SystemSharedMemoryRegisterRequest(name="r", key="/by_none", byte_size=8)),
             ("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest(name="nope")),
             *[("ModelInfer", classified(field, value)) for field, value in (
                 ("int64_param", 2), ("int64_param", 2**32), ("int64_param", 0), ("string_param", "2"),
                 ("bool_param", True))]]

    def code(url, fn, req):
        with grpc.insecure_channel(url) as ch:
            try:
                getattr(service_pb2_grpc.GRPCInferenceServiceStub(ch), fn)(req, timeout=30)
                return "OK"
            except grpc.RpcError as e:
                return e.code().name

    got = [(fn, str(req)[:60], code(triton_sum.grpc_url, fn, req), code(front_door.grpc_url, fn, req))
           for fn, req in calls]
    assert [g for g in got if g[2] != g[3]] == [], "(call, request, Triton, Batchyard)"


# Trace settings, right and wrong, as tritonclient sends them (Triton's trace extension). Neither
# server has a trace file; every update that succeeds is made on both, and undone at the end.
PARITY_TRACE = [
    ("", {}), ("sum", {}), ("nope", {}), ("", {"trace_rate": "x"}), ("", {"trace_rate": "-1"}),
    ("", {"trace_count": "-2"}), ("", {"trace_count": "3"}), ("", {"trace_count": "99999999999"}),
    ("", {"trace_file": "/tmp/elsewhere"}), ("", {"trace_level": ["TIMESTAMPS"]}),
    ("", {"trace_level": ["OFF", "TIMESTAMPS"]}), ("sum", {"trace_rate": "7", "log_frequency": "2"}),
    ("sum", {"trace_rate": None}), ("sum", {}), ("", {"log_frequency": "12abc", "other": "1"}),
    ("", {"trace_rate": None, "trace_count": None, "log_frequency": None})]


def test_trace_settings_answer_as_tritons(front_door, triton_sum):
    """The same trace settings asked of Triton 2.51 and of the front door, over HTTP and gRPC:
    the same answers, or the same status and words."""
    def ask(mod, url, model, settings):
        c = mod.InferenceServerClient(url)
        try:
            got = c.update_trace_settings(model, settings) if settings else c.get_trace_settings(model)
            got = got if mod is thttp else {k: list(v["value"]) for k, v in
                                           c.get_trace_settings(model, as_json=True)["settings"].items()}
            return {k: v for k, v in got.items() if k != "trace_file"} if mod is thttp else \
                {k: v if k == "trace_level" else v[0] for k, v in got.items() if k != "trace_file"}
        except InferenceServerException as e:
            return e.status(), e.message()

    got = [(mod.__name__, model, settings, ask(mod, f"127.0.0.1:{triton_sum.http_port if mod is thttp else triton_sum.grpc_port}",
                                                model, settings),
            ask(mod, front_door.http_url if mod is thttp else front_door.grpc_url, model, settings))
           for mod in (thttp, tgrpc) for model, settings in PARITY_TRACE]
    assert [g for g in got if g[3] != g[4]] == [], "(client, model, settings, Triton, Batchyard)"


# Log settings, right and wrong (Triton's logging extension), ending where both servers started.
PARITY_LOG_HTTP = [b"", b"{}", b'{"log_file": "/tmp/x"}', b'{"log_file": null}', b'{"log_file": ""}',
                   b'{"log_info": "true"}', b'{"log_info": false}', b'{"log_warning": false, "log_error": false}',
                   b'{"log_verbose_level": -1}', b'{"log_verbose_level": 1.5}', b'{"log_verbose_level": 4294967299}',
                   b'{"log_verbose_level": 2147483653}', b"  ", b'{"log_info": false, "log_info": true}',
                   b'{"log_format": "iso8601"}', b'{"log_format": 1}', b'{"log_format": "ISO8601"}', b"[]", b"null",
                   b'{"other": 1, "log_error": null}',
                   b'{"log_info": true, "log_warning": true, "log_error": true, "log_verbose_level": 0, '
                   b'"log_format": "default"}']
PARITY_LOG_GRPC = [{}, {"log_file": ("string_param", "")}, {"log_info": ("string_param", "true")},
                   {"log_info": ("bool_param", False)}, {"log_verbose_level": ("bool_param", True)},
                   {"log_verbose_level": ("uint32_param", 3)}, {"log_verbose_level": ("uint32_param", 2147483653)},
                   {"log_format": ("string_param", "bad")},
                   {"log_format": ("uint32_param", 1)}, {"log_format": ("string_param", "ISO8601"), "x": ("bool_param", 1)},
                   {"log_info": ("bool_param", True), "log_verbose_level": ("uint32_param", 0),
                    "log_format": ("string_param", "default")}]


def test_log_settings_answer_as_tritons(front_door, triton_sum):
    """The same log settings asked of Triton 2.51 and of the front door, over HTTP and gRPC: the
    same answers, or the same status and words."""
    import urllib.error
    import urllib.request

    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    def http(port, body):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/logging", data=body, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def grpc_call(url, settings):
        req = service_pb2.LogSettingsRequest()
        for key, (kind, value) in settings.items():
            setattr(req.settings[key], kind, value)
        with grpc.insecure_channel(url) as ch:
            try:
                answer = service_pb2_grpc.GRPCInferenceServiceStub(ch).LogSettings(req, timeout=30)
                return "OK", {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in answer.settings.items()}
            except grpc.RpcError as e:
                return e.code().name, e.details()

    fd_http = int(front_door.http_url.rsplit(":", 1)[1])
    got = [("http", body, http(triton_sum.http_port, body), http(fd_http, body)) for body in PARITY_LOG_HTTP]
    got += [("grpc", settings, grpc_call(triton_sum.grpc_url, settings), grpc_call(front_door.grpc_url, settings))
            for settings in PARITY_LOG_GRPC]
    assert [g for g in got if g[2] != g[3]] == [], "(protocol, request, Triton, Batchyard)"
    assert got[-1][3][1]["log_verbose_level"] == 0 and got[-1][3][1]["log_info"] is True  # (as both started)
    deep = b"[" * 100_000 + b"]" * 100_000  # (json's RecursionError was a 400 naming it)
    assert http(fd_http, deep) == (500, {"error": "failed to parse the request JSON buffer: invalid JSON"})
    # The setting is the node's: made through one connection, every front-door process answers it
    # (8 connections: SO_REUSEPORT spreads them over the two processes).
    try:
        assert http(fd_http, b'{"log_warning": false}')[1]["log_warning"] is False
        assert {grpc_call(front_door.grpc_url, {})[1]["log_warning"] for _ in range(8)} == {False}
    finally:
        assert http(fd_http, b'{"log_warning": true}')[1]["log_warning"] is True


def test_an_input_the_model_lacks_is_refused_before_its_data_is_read(front_door):
    # Every input was converted before any was checked against the model: 1.2 million unknown
    # one-byte inputs held a front-door process 8.5 s (and 1.1 GiB) before the answer.
    body = json.dumps({"inputs": [{"name": "nope", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3]}]})
    status, _, text = _post_infer(front_door, body.encode())
    assert status == 400 and b"unexpected inference input 'nope' for model 'sum'" in text, text
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name="sum")
    req.inputs.add(name="nope", datatype="FP32", shape=[1, 4])
    req.raw_input_contents.append(b"\0" * 3)  # not even 4 items' bytes: never read now
    with grpc.insecure_channel(front_door.grpc_url) as ch:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unexpected inference input 'nope' for model 'sum'" in e.value.details()


def test_outputs_come_in_the_models_order_and_protocol_quirks_as_tritons():
    """Triton 2.51 answers outputs in the model's order: asked for [w, y], the front door answered
    [w, y], and a client reading ``outputs[i]`` or ``raw_output_contents[i]`` by position read the
    other output. A negative gRPC ``timeout`` is what Triton's cast to uint64 makes of it (refused
    here before); a ``shared_memory_region`` of "" is refused (its tensor's own data was read)."""
    from tritonclient.grpc import service_pb2

    from batchyard.kserve_grpc import KServeServicer, _shm_param, uint_param
    from batchyard.kserve_http import KServeHttp

    spec = ModelConfig(name="two", max_batch=4, inputs=(TensorConfig("x", "float32", (4,)),),
                       outputs=(TensorConfig("y", "float32", (2,)), TensorConfig("w", "float32", (1,)))).spec()
    request = service_pb2.ModelInferRequest(model_name="two")
    for name in ("w", "y"):
        request.outputs.add(name=name)
    servicer = KServeServicer.__new__(KServeServicer)
    assert [n for n, _, _ in servicer._requested_outputs(request, spec, {}, None)] == ["y", "w"]
    http = KServeHttp.__new__(KServeHttp)
    header = {"outputs": [{"name": "w"}, {"name": "y", "parameters": {"binary_data": True}}]}
    assert [(n, b) for n, b, _, _ in http._requested_outputs(header, spec, False, {}, None)] == [("y", True), ("w", False)]
    params = service_pb2.ModelInferRequest().parameters
    params["timeout"].int64_param = -5
    assert uint_param(params, "timeout", ("int64_param",), cast=True) == 2**64 - 5
    params["shared_memory_region"].string_param = ""
    with pytest.raises(KServeError, match="names no region"):
        _shm_param(params, "x")


def test_a_grpc_port_in_use_stops_the_front_door_in_one_line(tmp_path):
    """grpcio raises RuntimeError for a port it cannot bind (it used to return 0): a 26-line
    traceback, where the HTTP port in use was one line."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        http_port = _free_port()
        node = NodeConfig(DispatcherConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"ipc://{tmp_path}/be"),
                          (SUM_MODEL,), (sim_worker("w0", ("sum",)),),
                          frontend=FrontendConfig(grpc_port=port, http_port=http_port)).validate()
        path = tmp_path / "node.toml"
        path.write_text(to_toml(node))
        r = subprocess.run([sys.executable, "-m", "batchyard.cli", "frontend", "--config", str(path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"front door cannot start: cannot bind gRPC to 127.0.0.1:{port}" in r.stderr, r.stderr


def _other_node_config(tmp_path, name: str, grpc_port: int, http_port: int) -> Path:
    """The config of another node (a dispatcher endpoint of its own) with a front door on these ports."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be"),
                      (SUM_MODEL,), (sim_worker("w0", ("sum",)),),
                      frontend=FrontendConfig(grpc_port=grpc_port, http_port=http_port)).validate()
    path = run_dir / "node.toml"
    path.write_text(to_toml(node))
    return path


def _start_front_door(path: Path, notify: socket.socket, env: dict = {}) -> tuple[subprocess.Popen, bool]:
    """`batchyard frontend` of the config at ``path``, once it said READY=1 (True) or exited (False)."""
    p = subprocess.Popen([sys.executable, "-m", "batchyard.cli", "frontend", "--config", str(path)], cwd=ROOT,
                         stderr=subprocess.PIPE, text=True,
                         env=os.environ | {"NOTIFY_SOCKET": notify.getsockname()} | env)
    return p, said_ready(notify, p, 120)


def test_a_second_node_on_a_running_nodes_ports_exits_naming_them(front_door, tmp_path):
    """SO_REUSEPORT, which lets a node's front-door processes share its ports, let another node's
    front door bind them too: both nodes served, the kernel splitting new connections between
    them, and both took the one shared-memory registry of those ports (statistics mixed). As
    Triton refuses a second server on a bound port, the other node's front door now exits in one
    line naming the port and the node's front doors, also when it shares one port only; the two
    front-door processes of the fixture's node share them, and it serves on."""
    grpc_port, http_port = (int(url.rsplit(":", 1)[1]) for url in (front_door.grpc_url, front_door.http_url))
    pids = _listeners(front_door.node.up.pid, grpc_port)
    assert len(pids) == 2
    notify, _ = ready_notify_socket(tmp_path)
    with notify:
        for ports, what, port in (((grpc_port, http_port), "gRPC", grpc_port), ((0, http_port), "HTTP", http_port)):
            p, ready = _start_front_door(_other_node_config(tmp_path, f"other-{what}", *ports), notify)
            if ready:
                p.terminate()
            _, err = p.communicate(timeout=60)
            assert not ready and p.returncode == 1 and "Traceback" not in err, err
            m = re.search(rf"front door cannot start: cannot bind {what} to 127\.0\.0\.1:{port}: address already in "
                          r"use: another Batchyard node \(front door pid ([\d, ]+), dispatcher (\S+)\) serves it", err)
            assert m is not None, err
            assert {int(p) for p in m[1].split(", ")} == pids and m[2] == front_door.node.address, err
    assert _listeners(front_door.node.up.pid, grpc_port) == pids == _listeners(front_door.node.up.pid, http_port)
    want = front_door.sdk("sum", X)
    np.testing.assert_array_equal(tgrpc.InferenceServerClient(front_door.grpc_url).infer("sum", [_grpc_input(X)])
                                  .as_numpy("y"), want)
    np.testing.assert_array_equal(thttp.InferenceServerClient(front_door.http_url).infer("sum", [_http_input(X)])
                                  .as_numpy("y"), want)


@pytest.fixture
def started_front_door(tmp_path):
    """Starts `batchyard frontend` of a config (with extra environment), returned once it said
    READY=1; every one it started is killed at the end."""
    notify, _ = ready_notify_socket(tmp_path)
    procs = []

    def start_ready(path: Path, env: dict = {}) -> subprocess.Popen:
        p, ready = _start_front_door(path, notify, env)
        procs.append(p)
        assert ready, p.communicate(timeout=60)[1]
        return p

    yield start_ready
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()
    notify.close()


def test_a_killed_nodes_claim_on_its_ports_does_not_stop_the_next_node(tmp_path, started_front_door):
    """A node's claim on its ports is a flock, which the kernel lets go of with its process: a
    front door killed outright (it gave nothing back) does not keep another node off its ports,
    and that one, stopped, leaves no claim behind."""
    from batchyard.kserve_shm import ports_dir

    grpc_port, http_port = _free_port(), _free_port()
    first = started_front_door(_other_node_config(tmp_path, "first", grpc_port, http_port))
    first.kill()
    first.communicate()
    second = started_front_door(_other_node_config(tmp_path, "second", grpc_port, http_port))
    assert tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}").is_server_live()
    second.terminate()
    second.communicate(timeout=30)
    assert second.returncode == 0
    left = os.listdir(ports_dir()) if os.path.isdir(ports_dir()) else []
    assert not [n for n in left if n.startswith((f"{grpc_port}-", f"{http_port}-"))], left


def test_a_front_door_restarted_within_its_node_keeps_the_clients_regions(tmp_path, started_front_door):
    """With one front-door process (the default), `up` restarting it (killed, or hung and
    aborted) took every client's shared-memory regions with it: the new process, alone in the
    registry, took itself for the node's first and started it afresh (the client's next infer
    got NOT_FOUND), where with two processes the regions survived. `up` names its run of the
    node to its front doors; a front door restarted within that run keeps the registry, and the
    node's next run starts afresh."""
    from batchyard.kserve_shm import NODE_INSTANCE_ENV, registry_dir

    grpc_port, http_port = _free_port(), _free_port()
    path = _other_node_config(tmp_path, "node", grpc_port, http_port)
    seg = shared_memory.SharedMemory(f"krestart_{os.getpid()}", create=True, size=64)

    def start_ready(run: str) -> subprocess.Popen:
        return started_front_door(path, {NODE_INSTANCE_ENV: run})

    def regions() -> list:
        return list(tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
                    .get_system_shared_memory_status(as_json=True).get("regions", {}))

    try:
        first = start_ready("run-1")
        tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}").register_system_shared_memory(
            "mine", "/" + seg.name, 64)
        first.kill()
        first.communicate()
        restarted = start_ready("run-1")
        assert regions() == ["mine"], "a front door restarted within its node lost the clients' regions"
        restarted.kill()
        restarted.communicate()
        next_run = start_ready("run-2")
        assert regions() == [], "the node's next run kept the last run's regions"
        next_run.terminate()  # the last one out removes the registry
        next_run.communicate(timeout=30)
    finally:
        seg.close()
        seg.unlink()
        registry = registry_dir("127.0.0.1", grpc_port, http_port)
        if os.path.isdir(registry):
            ShmRegions(registry).close()


@pytest.mark.parametrize("first, second", [("127.0.0.1", "localhost"), ("localhost", "127.0.0.1"),
                                           ("0.0.0.0", "localhost")])
def test_a_port_claimed_under_one_name_of_an_address_is_refused_under_another(tmp_path, first, second):
    """Two nodes on one port, one on "127.0.0.1" and one on "localhost": by the names as written
    they were two hosts, both front doors served, and the kernel split connections between them.
    The claim compares the addresses each name binds."""
    from batchyard.kserve_shm import PortClaim, PortsTaken

    port = _free_port()
    claim = PortClaim("ipc:///node-a", first, [("gRPC", port)], directory=str(tmp_path / "ports"))
    try:
        with pytest.raises(PortsTaken, match=rf"cannot bind gRPC to {re.escape(second)}:{port}: address already in use"):
            PortClaim("ipc:///node-b", second, [("gRPC", port)], directory=str(tmp_path / "ports"))
        PortClaim("ipc:///node-a", second, [("gRPC", port)], directory=str(tmp_path / "ports")).close()  # its own
    finally:
        claim.close()


def test_a_port_another_server_listens_on_with_so_reuseport_is_refused(tmp_path):
    """The claims saw only other Batchyard nodes: a server of the same user listening with
    SO_REUSEPORT (grpcio sets it by default) was joined on its port, and the kernel split new
    connections between it and the front door. tritonserver binds without it, and is refused."""
    import socket

    from batchyard.kserve_shm import PortClaim, PortsTaken

    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(PortsTaken, match=rf"cannot bind gRPC to 127.0.0.1:{port}: address already in use"):
            PortClaim("ipc:///node-a", "127.0.0.1", [("gRPC", port)], directory=str(tmp_path / "ports"))
    finally:
        other.close()
    PortClaim("ipc:///node-a", "127.0.0.1", [("gRPC", port)], directory=str(tmp_path / "ports")).close()


def test_an_ipv4_listener_is_not_in_the_way_of_a_front_door_on_ipv6s_wildcard(tmp_path):
    """The front door's servers bind "::" IPv6-only, beside an IPv4 listener on the port; the
    probe bound it dual-stack and refused them."""
    import socket

    from batchyard.kserve_shm import PortClaim

    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
    except OSError:
        pytest.skip("no IPv6 on this host")
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        other.bind(("0.0.0.0", 0))
        other.listen()
        PortClaim("ipc:///node-a", "::", [("HTTP", other.getsockname()[1])], directory=str(tmp_path / "ports")).close()
    finally:
        other.close()


def test_a_claim_made_while_the_last_one_out_removes_the_folder_is_made(tmp_path, monkeypatch):
    """Another node's last front door may remove the claims folder between this one's mkdir and
    its open: the FileNotFoundError made the front door serve with no claim at all (a later node
    on its ports was not refused). It tries again."""
    from batchyard import kserve_shm
    from batchyard.kserve_shm import PortClaim, PortsTaken

    opened = kserve_shm._open_private_dir
    raced = []

    def removed_once(path):
        if not raced:
            raced.append(path)
            raise FileNotFoundError(2, "No such file or directory", path)
        return opened(path)

    monkeypatch.setattr(kserve_shm, "_open_private_dir", removed_once)
    port, folder = _free_port(), str(tmp_path / "ports")
    claim = PortClaim("ipc:///node-a", "127.0.0.1", [("gRPC", port)], directory=folder)
    try:
        assert raced
        with pytest.raises(PortsTaken):
            PortClaim("ipc:///node-b", "127.0.0.1", [("gRPC", port)], directory=folder)
    finally:
        claim.close()


def test_a_claim_of_a_release_that_wrote_only_its_host_is_compared_by_that_hosts_addresses(tmp_path):
    """A claim written without its addresses was read as every address: a node on 127.0.0.2
    was refused beside one on 127.0.0.1 (two nodes of that release had served side by side)."""
    import fcntl

    from batchyard.kserve_shm import PortClaim, PortsTaken

    port, folder = _free_port(), tmp_path / "ports"
    folder.mkdir(mode=0o700)
    old = folder / f"{port}-0123456789abcdef"
    old.write_text(json.dumps({"node": "ipc:///old-node", "host": "127.0.0.1", "pids": [os.getpid()]}) + "\n")
    with open(old) as held:
        fcntl.flock(held, fcntl.LOCK_SH)  # the old node's front door, serving
        PortClaim("ipc:///new-node", "127.0.0.2", [("gRPC", port)], directory=str(folder)).close()
        with pytest.raises(PortsTaken):
            PortClaim("ipc:///new-node", "localhost", [("gRPC", port)], directory=str(folder))


def test_a_node_in_another_network_namespace_has_its_own_ports(tmp_path, monkeypatch):
    """Containers that share /dev/shm (--ipc=host) but not the network each have their own port
    8001: the second node was refused a port nothing held in its namespace."""
    from batchyard import kserve_shm
    from batchyard.kserve_shm import PortClaim, PortsTaken

    port, folder = _free_port(), str(tmp_path / "ports")
    monkeypatch.setattr(kserve_shm, "network_namespace", lambda: 1)
    first = PortClaim("ipc:///node-a", "127.0.0.1", [("gRPC", port)], directory=folder)
    try:
        monkeypatch.setattr(kserve_shm, "network_namespace", lambda: 2)
        PortClaim("ipc:///node-b", "127.0.0.1", [("gRPC", port)], directory=folder).close()
        monkeypatch.setattr(kserve_shm, "network_namespace", lambda: 1)
        with pytest.raises(PortsTaken):  # in its own namespace the first node's claim stands
            PortClaim("ipc:///node-c", "127.0.0.1", [("gRPC", port)], directory=folder)
    finally:
        first.close()


def test_a_claims_folder_that_cannot_be_made_is_an_error_not_a_spin(tmp_path):
    """Without /dev/shm the claim retried for ever at 100 % CPU (it took the missing folder for
    one another node's last front door had just removed); claim_ports then serves unchecked."""
    from batchyard.kserve_shm import PortClaim

    with pytest.raises(FileNotFoundError):
        PortClaim("ipc:///node-a", "127.0.0.1", [("gRPC", _free_port())], directory=str(tmp_path / "no" / "ports"))


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_a_front_door_on_an_ipv6_host_serves(tmp_path, host):
    """gRPC was given "::1:8001" (read as one address, on port 443) and aiohttp "[::1]" (no host
    to it): a front door on IPv6 never started."""
    from batchyard.kserve_common import KServeCore
    from batchyard.kserve_grpc import start_grpc
    from batchyard.kserve_http import start_http
    from batchyard.kserve_shm import ShmRegions

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    grpc_port, http_port = _free_port(), _free_port()

    async def serve():
        core = KServeCore(None, ShmRegions(str(tmp_path / "registry")))
        server = await start_grpc(core, host, grpc_port)
        runner = await start_http(core, host, http_port)
        try:
            for port in (grpc_port, http_port):
                _, writer = await asyncio.open_connection("::1", port)  # listening there
                writer.close()
        finally:
            await server.stop(0)
            await runner.cleanup()
            core.close()

    asyncio.run(serve())
