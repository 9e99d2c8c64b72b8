"""Restricted APIs (tritonserver's --grpc-restricted-protocol / --http-restricted-api): a request to
a restricted category answers only with its header's value; the rest of the front door serves
everyone, and the refusals are Triton 2.51's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from batchyard.config import ConfigError, RestrictedApisConfig
from batchyard.kserve_restrict import CATEGORIES, GRPC_CATEGORY, Restrictions, http_category

ADMIN = RestrictedApisConfig(apis=("trace", "inference", "model-config"), header="admin-key", value="s3cret")
STATS = RestrictedApisConfig(apis=("statistics",), header="Stats-Key", value="v 1", protocols=("http",))
# The same restrictions as tritonserver's options.
TRITON_ARGS = ("--http-restricted-api=trace,inference,model-config:admin-key=s3cret",
               "--grpc-restricted-protocol=trace,inference,model-config:admin-key=s3cret",
               "--http-restricted-api=statistics:Stats-Key=v 1")
X = np.arange(12, dtype=np.float32).reshape(3, 4)


# ---------------------------------------------------------------- which request is which API
def test_every_grpc_method_and_http_route_has_tritons_category():
    from tritonclient.grpc import service_pb2

    from batchyard.kserve_http import KServeHttp
    from batchyard.openai_http import OpenAiCompletions

    methods = {m.name for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    assert set(GRPC_CATEGORY) == methods  # a method added later has a category, or this fails
    assert set(GRPC_CATEGORY.values()) == set(CATEGORIES)
    routes = [r.path for r in KServeHttp.__new__(KServeHttp).routes()]
    routes += [r.path for r in OpenAiCompletions.__new__(OpenAiCompletions).routes()]
    assert [r for r in routes if http_category(r) is None] == []
    assert {http_category(r) for r in routes} == set(CATEGORIES)
    for path, category in [
            ("/v2/health/live", "health"), ("/v2/health/ready", "health"), ("/v2/models/m/ready", "health"),
            ("/v2/models/m/versions/1/ready", "health"), ("/v2", "metadata"), ("/v2/models/m", "metadata"),
            ("/v2/models/m/versions/1", "metadata"), ("/v2/models/m/infer", "inference"),
            ("/v2/models/m/versions/1/infer", "inference"), ("/v2/models/m/generate", "inference"),
            ("/v1/completions", "inference"), ("/v2/systemsharedmemory/status", "shared-memory"),
            ("/v2/cudasharedmemory/region/r/register", "shared-memory"), ("/v2/models/m/config", "model-config"),
            ("/v2/repository/index", "model-repository"), ("/v2/repository/models/m/load", "model-repository"),
            ("/v2/models/stats", "statistics"), ("/v2/models/m/stats", "statistics"),
            ("/v2/models/m/versions/1/stats", "statistics"), ("/v2/trace/setting", "trace"),
            ("/v2/models/m/trace/setting", "trace"), ("/v2/logging", "logging"),
            ("/v2/models/stats/infer", "inference"), ("/metrics", None), ("/v2/nope", None),
            ("/v2/models/m/nope", None)]:
        assert http_category(path) == category, path


def test_a_request_passes_only_with_its_apis_header_and_value():
    r = Restrictions((ADMIN, STATS), "http")
    headers = {"admin-key": "s3cret", "stats-key": "v 1"}
    assert r.refusal("trace", headers.get) is None
    assert r.refusal("statistics", headers.get) is None
    assert r.refusal("metadata", {}.get) is None and r.refusal(None, {}.get) is None
    assert r.refusal("trace", {}.get) == "admin-key"
    assert r.refusal("trace", {"admin-key": "s3cret "}.get) == "admin-key"
    assert r.refusal("trace", {"admin-key": "S3CRET"}.get) == "admin-key"
    assert r.refusal("trace", {"admin-key": "s3cre"}.get) == "admin-key"
    assert r.refusal("trace", {"admin-key": "s3cret\udcff"}.get) == "admin-key"  # (undecodable bytes)
    assert r.refusal("statistics", {}.get) == "Stats-Key"  # the name as the config writes it
    g = Restrictions((ADMIN, STATS), "grpc")
    assert g.refusal("statistics", {}.get) is None  # restricted over HTTP only
    assert g.refusal("trace", headers.get) == "triton-grpc-protocol-admin-key"  # (Triton's gRPC name)
    assert g.refusal("trace", {"triton-grpc-protocol-admin-key": "s3cret"}.get) is None
    assert not Restrictions((STATS,), "grpc") and Restrictions((STATS,), "http")


@pytest.mark.parametrize("table, message", [
    ({"apis": ["trace", "tracing"]}, "restricted_apis[0].apis[1]: invalid value 'tracing' (did you mean 'trace'?)"),
    ({"apis": []}, "restricted_apis[0]: apis is empty"),
    ({"protocols": []}, "restricted_apis[0]: protocols is empty"),
    ({"protocols": ["rest"]}, "restricted_apis[0].protocols[0]: invalid value 'rest'"),
    ({"header": "admin key"}, "restricted_apis[0]: header 'admin key' is no name both HTTP and gRPC carry"),
    ({"header": "shm!key"}, "restricted_apis[0]: header 'shm!key' is no name both HTTP and gRPC carry"),
    ({"header": "key-bin"}, "restricted_apis[0]: header 'key-bin' is no name both HTTP and gRPC carry"),
    ({"header": "admin-key=s3cret"}, "restricted_apis[0]: header holds '=' or ':'"),
    ({"header": "admin-key: s3cret"}, "restricted_apis[0]: header holds '=' or ':'"),
    ({"value": " s3cret"}, "restricted_apis[0]: value must be printable ASCII, spaces only inside"),
    ({"value": "sécret"}, "restricted_apis[0]: value must be printable ASCII"),
    ({"value": ""}, "restricted_apis[0]: value must be set"),
    ({"secret": "x"}, "unknown key 'restricted_apis[0].secret'"),
])
def test_a_restriction_the_front_door_cannot_apply_is_a_config_error_that_names_its_key(tmp_path, table, message):
    from batchyard.config import load_config

    rule = {"apis": ["trace"], "header": "admin-key", "value": "s3cret"} | table
    lines = [f"{k} = {_toml(v)}" for k, v in rule.items()]
    path = tmp_path / "node.toml"
    path.write_text('[dispatcher]\nfrontend = "ipc:///tmp/by-r/fe"\nbackend = "ipc:///tmp/by-r/be"\n'
                    '[[models]]\nname = "m"\nmax_batch = 4\n'
                    'inputs = [{name = "x", dtype = "float32", shape = [4]}]\n'
                    'outputs = [{name = "y", dtype = "float32", shape = [4]}]\n'
                    '[frontend]\n[[frontend.restricted_apis]]\n' + "\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert f"node.toml: [frontend] {message}" in str(e.value)
    assert "s3cret" not in str(e.value)  # a secret is never echoed into a log


def test_an_api_restricted_twice_on_one_protocol_is_a_config_error():
    import msgspec

    from batchyard.config import DispatcherConfig, FrontendConfig, NodeConfig

    from conftest import SUM_MODEL

    def node(*rules):
        return NodeConfig(dispatcher=DispatcherConfig(frontend="ipc:///tmp/by-r/fe", backend="ipc:///tmp/by-r/be"),
                          models=(SUM_MODEL,), frontend=FrontendConfig(restricted_apis=rules)).validate()

    other = RestrictedApisConfig(apis=("health", "trace"), header="b", value="c", protocols=("http",))
    with pytest.raises(ConfigError, match=r"\[frontend\] restricted_apis\[1\]: apis: 'trace' is restricted over "
                                          r"http by restricted_apis\[0\] already"):
        node(ADMIN, other)
    node(STATS, msgspec.structs.replace(other, protocols=("grpc",)))  # apart: one protocol each


def _toml(v) -> str:
    import json

    return json.dumps(v)


# ---------------------------------------------------------------- a node
@pytest.fixture(scope="module")
def restricted_front_door():
    import msgspec

    from conftest import SUM_MODEL, sim_worker
    from test_kserve import _node_with_front_door

    team = msgspec.structs.replace(SUM_MODEL, name="team/sum")  # a name aiohttp routes as one segment, %2F
    with _node_with_front_door(models=(SUM_MODEL, team), workers=(sim_worker("sim0", models=("sum", "team/sum")),),
                               restricted_apis=(ADMIN, STATS)) as fd:
        yield fd


def _http(fd, method: str, path: str, headers=None, body=b"") -> tuple:
    import http.client

    conn = http.client.HTTPConnection(*fd.http_url.split(":"), timeout=30)
    try:
        conn.request(method, path, body, headers or {})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def test_a_restricted_route_is_refused_however_its_path_is_spelled(restricted_front_door):
    # Classified by the request's decoded path, /v2/models/team%2Fsum/infer was no route (aiohttp
    # routes on the path with %2F encoded, one model segment) and passed without the header.
    fd = restricted_front_door
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
    for method, path in [("POST", "/v2/models/team%2Fsum/infer"), ("POST", "/v2/models/team%2Fsum/versions/1/infer"),
                         ("GET", "/v2/models/team%2Fsum/config"), ("GET", "/v2/models/x%2Fversions/config"),
                         ("GET", "/v2/models/%73um/config"), ("POST", "/v2/models/sum/infer?x=1")]:
        status, text = _http(fd, method, path, body=body.encode() if method == "POST" else b"")
        assert (status, json.loads(text)) == (403, {"error": "This API is restricted, expecting header 'admin-key'"}), path
    status, text = _http(fd, "POST", "/v2/models/team%2Fsum/infer", {"admin-key": "s3cret"}, body.encode())
    assert status == 200 and json.loads(text)["model_name"] == "team/sum"
    # Paths the front door does not serve answer 404 whoever asks, as Triton's
    for method, path in [("POST", "/v2/models/sum/infer/"), ("POST", "//v2/models/sum/infer"), ("GET", "/v1/models")]:
        assert _http(fd, method, path)[0] == 404, path


def test_a_refused_client_is_not_told_to_send_its_body(restricted_front_door):
    # aiohttp answered "Expect: 100-continue" before any check ran: the client sent its body.
    import socket

    host, port = restricted_front_door.http_url.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/sum/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 403"), head
    status, _ = _http(restricted_front_door, "POST", "/v2/models/sum/infer",
                      {"admin-key": "s3cret", "Expect": "100-continue"},
                      json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                              "data": [1, 2, 3, 4]}]}).encode())
    assert status == 200  # (with the header: told to go on, and served)


def test_a_refused_grpc_call_is_refused_before_its_request_is_read(restricted_front_door):
    # The refusal was a unary handler: grpc.aio read the whole request first (300 MiB took the
    # front door to 966 MiB), from any client. A request that never comes is refused at once now.
    import threading

    import grpc

    never_sent = threading.Event()

    def requests():
        never_sent.wait(30)
        return
        yield

    with grpc.insecure_channel(restricted_front_door.grpc_url) as ch:
        call = ch.stream_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=bytes,
                               response_deserializer=bytes)
        try:
            with pytest.raises(grpc.RpcError) as e:
                call(requests(), timeout=20)
        finally:
            never_sent.set()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # (not the deadline)
        # a method of another service is no restricted one: gRPC's own UNIMPLEMENTED, as Triton's
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/x.Y/ModelInfer", request_serializer=bytes, response_deserializer=bytes)(b"", timeout=20)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _outcome(fn):
    try:
        fn()
        return "OK"
    except InferenceServerException as e:
        return e.status(), e.message()


def _calls(mod, url: str, sent: dict) -> list:
    """What a Triton user's code calls, with the headers ``sent``: (what, its outcome)."""
    c = mod.InferenceServerClient(url)
    # (each call a copy: tritonclient.http's infer adds Inference-Header-Content-Length to the
    # dict it is given, and the next call sent that too)
    x = mod.InferInput("x", [3, 4], "FP32")
    x.set_data_from_numpy(X)

    def stream() -> tuple:
        got = []
        c.start_stream(callback=lambda result, error: got.append(error), headers=dict(sent))
        try:
            c.async_stream_infer("sum", [x])
        except InferenceServerException:  # the stream was refused already: its callback has the error
            pass
        finally:
            c.stop_stream()
        return got[0] and (got[0].status(), got[0].message())

    return [("trace settings", _outcome(lambda: c.get_trace_settings(headers=dict(sent)))),
            ("infer", _outcome(lambda: c.infer("sum", [x], headers=dict(sent)))),
            ("config", _outcome(lambda: c.get_model_config("sum", headers=dict(sent)))),
            ("statistics", _outcome(lambda: c.get_inference_statistics("sum", headers=dict(sent)))),
            ("metadata", _outcome(lambda: c.get_model_metadata("sum", headers=dict(sent)))),
            ("live", _outcome(lambda: c.is_server_live(headers=dict(sent)))),
            *([("stream", stream() or "OK")] if mod is tgrpc else [])]


HEADERS = [{}, {"admin-key": "s3cret"}, {"admin-key": "wrong"}, {"admin-key": "s3cret", "stats-key": "v 1"},
           {"admin-key": "s3cre"}, {"triton-grpc-protocol-admin-key": "s3cret"},
           {"triton-grpc-protocol-admin-key": "s3cret", "stats-key": "v 1", "admin-key": "s3cret"},
           {"triton-grpc-protocol-admin-key": "wrong"}]


def test_restricted_apis_answer_only_with_their_header(restricted_front_door):
    fd = restricted_front_door
    refused_http = ("403", "This API is restricted, expecting header 'admin-key'")
    refused_grpc = ("StatusCode.UNAVAILABLE",
                    "This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'")
    stats_refused = ("403", "This API is restricted, expecting header 'Stats-Key'")
    assert _calls(thttp, fd.http_url, {}) == [
        ("trace settings", refused_http), ("infer", refused_http), ("config", refused_http),
        ("statistics", stats_refused), ("metadata", "OK"), ("live", "OK")]
    assert _calls(tgrpc, fd.grpc_url, {}) == [
        ("trace settings", refused_grpc), ("infer", refused_grpc), ("config", refused_grpc),
        ("statistics", "OK"), ("metadata", "OK"), ("live", "OK"), ("stream", refused_grpc)]
    assert _calls(thttp, fd.http_url, {"Admin-Key": "s3cret", "STATS-KEY": "v 1"}) == [
        (what, "OK") for what in ("trace settings", "infer", "config", "statistics", "metadata", "live")]
    assert _calls(tgrpc, fd.grpc_url, {"admin-key": "s3cret"}) == _calls(tgrpc, fd.grpc_url, {})  # (Triton's too)
    assert _calls(tgrpc, fd.grpc_url, {"triton-grpc-protocol-admin-key": "s3cret"}) == [
        (what, "OK") for what in ("trace settings", "infer", "config", "statistics", "metadata", "live", "stream")]
    assert _calls(thttp, fd.http_url, {"admin-key": "S3CRET"})[1] == ("infer", refused_http)
    # The answer, with the header, is the model's
    c = thttp.InferenceServerClient(fd.http_url)
    x = thttp.InferInput("x", [3, 4], "FP32")
    x.set_data_from_numpy(X)
    y = c.infer("sum", [x], headers={"admin-key": "s3cret"}).as_numpy("y")
    assert np.array_equal(y, fd.sdk("sum", X))


def test_a_refused_request_is_answered_before_its_body_is_read(restricted_front_door):
    # 64 MiB refused at once, not read first (the body would take the front door's memory).
    import http.client

    conn = http.client.HTTPConnection(*restricted_front_door.http_url.split(":"), timeout=30)
    try:
        conn.putrequest("POST", "/v2/models/sum/infer")
        conn.putheader("Content-Length", str(64 << 20))
        conn.putheader("Content-Type", "application/json")
        conn.endheaders()
        conn.send(b"{" * 4096)
        answer = conn.getresponse()
        assert answer.status == 403 and b"expecting header 'admin-key'" in answer.read()
    finally:
        conn.close()


# ---------------------------------------------------------------- against Triton 2.51
@pytest.fixture(scope="module")
def triton_restricted(tmp_path_factory):
    from test_kserve import triton_serving_sum

    with triton_serving_sum(tmp_path_factory, TRITON_ARGS) as tl:
        yield tl


def test_restricted_apis_answer_as_tritons(restricted_front_door, triton_restricted):
    """The same calls, with each set of headers, to tritonserver 2.51 started with the same
    restrictions and to the front door: the same refusals, and the same calls served."""
    fd, tri = restricted_front_door, triton_restricted
    got = [(mod.__name__, headers, _calls(mod, f"127.0.0.1:{tri.http_port if mod is thttp else tri.grpc_port}",
                                          headers),
            _calls(mod, fd.http_url if mod is thttp else fd.grpc_url, headers))
           for mod in (thttp, tgrpc) for headers in HEADERS]
    assert [g for g in got if g[2] != g[3]] == [], "(client, headers, Triton, Batchyard)"
