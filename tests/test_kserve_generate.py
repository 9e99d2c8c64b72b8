"""Triton's generate extension on the front door (kserve_generate): plain JSON members in, each
output by name out, from /generate and as one Server-Sent Event from /generate_stream; matched
request by request against a real tritonserver 2.51."""

from __future__ import annotations

import http.client
import json

import numpy as np
import pytest
from hypothesis import given, strategies as st

from batchyard import protocol as P
from batchyard.config import ModelConfig, TensorConfig
from batchyard.kserve_common import KServeError
from batchyard.kserve_generate import generate_answer, generate_inputs, generate_shape, parse_body, request_id

from conftest import SUM_MODEL, sim_worker

# One value an item in, one float and two booleans an item out: the answer's lone values.
ONE_MODEL = ModelConfig(name="one", max_batch=16, inputs=(TensorConfig("x", "int32", (2,)),),
                        outputs=(TensorConfig("s", "float32", (1,)), TensorConfig("a", "bool", (2,))))
# Served by no worker: its requests run out their time (the node's default, 1 s), which Triton
# answers UNAVAILABLE ("Request timeout expired").
ORPHAN_MODEL = ModelConfig(name="orphan", max_batch=16, inputs=(TensorConfig("x", "float32", (4,)),),
                           outputs=(TensorConfig("y", "float32", (2,)),))


def _spec(model: ModelConfig) -> P.ModelSpec:
    return P.ModelSpec(name=model.name, max_batch=model.max_batch,
                       inputs=[P.TensorSpec(t.name, t.dtype, list(t.shape)) for t in model.inputs],
                       outputs=[P.TensorSpec(t.name, t.dtype, list(t.shape)) for t in model.outputs])


def _refused(fn, *args) -> str:
    with pytest.raises(KServeError) as e:
        fn(*args)
    assert e.value.http_status == 400
    return e.value.message


# ---------------------------------------------------------------- the conversion, alone
@pytest.mark.parametrize("shape,count,want", [
    ([-1, 4], 4, [1, 4]), ([-1, 4], 8, [2, 4]), ([-1, 1], 1, [1, 1]), ([-1, 2, -1], 4, [1, 2, 2]),
    ([-1, 3, 2], 12, [2, 3, 2]), ([-1, 4], 0, [0, 4])])
def test_values_are_shaped_from_the_metadata_as_tritons(shape, count, want):
    assert generate_shape("x", shape, count) == want


@pytest.mark.parametrize("shape,count", [([-1, 4], 3), ([-1, 4], 1), ([-1, 3, 2], 8)])
def test_values_the_metadata_cannot_shape_are_refused_in_tritons_words(shape, count):
    assert _refused(generate_shape, "x", shape, count) == \
        "The schema can not convert input 'x' to tensor with proper shape"


@given(fixed=st.lists(st.integers(1, 6), max_size=3), varying=st.integers(1, 3), count=st.integers(0, 400))
def test_a_shape_holds_every_value_keeps_the_fixed_dimensions_and_fails_only_on_a_remainder(fixed, varying, count):
    shape = [-1] * varying + fixed
    whole = int(np.prod(fixed)) if fixed else 1
    if count % whole:
        with pytest.raises(KServeError):
            generate_shape("x", shape, count)
        return
    got = generate_shape("x", shape, count)
    assert int(np.prod(got)) == count and got[varying:] == fixed
    assert got[:varying - 1] == [1] * (varying - 1)  # the innermost varying one takes the rest


def test_members_name_inputs_parameters_or_nothing_a_model_reads():
    spec = _spec(SUM_MODEL)
    body = parse_body(b'{"id": "7", "parameters": {"x": [1, 2, 3, 4, 5, 6, 7, 8], "temperature": 0.5},'
                      b' "priority": 1, "flag": true}')
    assert request_id(body) == "7"
    got = generate_inputs(spec, body)
    assert list(got) == ["x"] and got["x"].dtype == np.float32 and got["x"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    for raw, words in [
            (b'{"x": [1, 2, 3, 4], "parameters": {"x": [1, 2, 3, 4]}}',
             "Converting keyword: 'parameters': input 'x' already exists in request"),
            (b'{"x": [1, 2, 3, 4], "parameters": 3}',
             "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as object"),
            (b'{"x": [1, 2, 3, 4], "foo": [1]}',
             "parameter 'foo' has invalid type. It should be either 'int', 'bool', or 'string'."),
            (b'{"x": [1, 2, 3, 4], "parameters": {"sub": {"a": 1}}}', "Converting keyword: 'parameters': parameter "
             "'sub' has invalid type. It should be either 'int', 'bool', or 'string'."),
            (b'{"x": [1, 2, 3, 4], "foo": null}',
             "parameter 'foo' has invalid type. It should be either 'int', 'bool', or 'string'."),
            (b'{"x": 5}', "The schema can not convert input 'x' to tensor with proper shape")]:
        assert _refused(generate_inputs, spec, parse_body(raw)) == words, raw
    assert "data is not FP32" in _refused(generate_inputs, spec, parse_body(b'{"x": [1, 2, 3, "4"]}'))


def test_a_batch_past_the_models_is_refused_before_its_values_are_converted():
    # Converted first, 60 MiB of values took the front door's loop 2.9 s to be refused for its size.
    values = [1.0] * (17 * 4 - 1) + ["a"]
    assert _refused(generate_inputs, _spec(SUM_MODEL), parse_body(json.dumps({"x": values}).encode())) == \
        "inference request batch-size must be <= 16 for 'sum'"


def test_a_key_written_twice_has_its_last_value():
    """A documented difference: Triton's reader finds a key's first value (and refuses an input
    written twice); Batchyard reads the body as infer's JSON, with msgspec, which keeps the last."""
    body = parse_body(b'{"id": "a", "id": "b", "x": [1, 2, 3, 4], "x": [5, 6, 7, 8]}')
    assert request_id(body) == "b"
    assert generate_inputs(_spec(SUM_MODEL), body)["x"].tolist() == [[5, 6, 7, 8]]


def test_an_input_named_parameters_cannot_also_be_the_nested_members():
    clash = ModelConfig(name="clash", max_batch=4, inputs=(TensorConfig("parameters", "float32", (1,)),),
                        outputs=(TensorConfig("y", "float32", (1,)),))
    assert _refused(generate_inputs, _spec(clash), parse_body(b'{"parameters": {"a": 1}}')) == \
        "Keyword 'parameters' for nested schema also given as input tensor name"


@pytest.mark.parametrize("raw,words", [
    (b"", "failed to parse the request JSON buffer: The document is empty. at 0"),
    (b"[1, 2]", "attempt to get members for non-object"),
    (b"  ", "failed to parse the request JSON buffer: The document is empty. at 2"),
    (b"[]", "attempt to get members for non-object"), (b"null", "attempt to get members for non-object")])
def test_a_body_that_is_no_object_is_refused_in_tritons_words(raw, words):
    assert _refused(parse_body, raw) == words


@pytest.mark.parametrize("rid", [b"42", b"null", b"[]"])
def test_an_id_must_be_a_string(rid):
    assert _refused(request_id, parse_body(b'{"id": ' + rid + b'}')) == \
        "Unable to parse 'id': attempt to access JSON non-string as string"


def test_the_answer_names_outputs_in_order_and_strips_a_lone_value():
    members, finite = generate_answer("one", "", {"s": np.array([[3.0]], np.float32),
                                                  "a": np.array([[True, False]])})
    assert json.dumps(members) == '{"a": [true, false], "model_name": "one", "model_version": "1", "s": 3.0}'
    assert finite
    members, finite = generate_answer("m", "r1", {"model_name": np.zeros(1), "y": np.array([np.nan, 1.0])})
    assert members == {"id": "r1", "model_name": "m", "model_version": "1", "y": [pytest.approx(np.nan, nan_ok=True), 1.0]}
    assert not finite


# ---------------------------------------------------------------- on a node
@pytest.fixture(scope="module")
def generate_node():
    from test_kserve import _node_with_front_door

    with _node_with_front_door(models=(SUM_MODEL, ONE_MODEL, ORPHAN_MODEL),
                               workers=(sim_worker("sim0", models=("sum", "one")),),
                               dispatcher={"default_timeout_s": 1.0}) as fd:
        yield fd


def _post(url: str, path: str, body, headers=None, method="POST") -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection(*url.split(":"), timeout=30)
    try:
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, "/" + path, data, headers or {})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type", ""), r.read()
    finally:
        conn.close()


def test_generate_answers_as_the_sdk_does(generate_node):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    want = generate_node.sdk("sum", x)
    status, kind, text = _post(generate_node.http_url, "v2/models/sum/generate", {"x": x.ravel().tolist(), "id": "a"})
    assert (status, kind) == (200, "application/json")
    assert json.loads(text) == {"id": "a", "model_name": "sum", "model_version": "1", "y": want.ravel().tolist()}
    status, kind, text = _post(generate_node.http_url, "v2/models/sum/versions/1/generate_stream",
                               {"parameters": {"x": x[0].tolist()}})
    assert (status, kind) == (200, "text/event-stream; charset=utf-8")
    assert text.startswith(b"data: ") and text.endswith(b"\n\n") and text.count(b"data: ") == 1
    assert json.loads(text[6:]) == {"model_name": "sum", "model_version": "1", "y": want[0].tolist()}


def test_an_output_of_one_value_is_that_value(generate_node):
    status, _, text = _post(generate_node.http_url, "v2/models/one/generate", {"x": [3, -1]})
    assert status == 200
    # (the simulated worker fills every output of an item with the sum of its inputs)
    assert json.loads(text) == {"a": [True, True], "model_name": "one", "model_version": "1", "s": 2.0}


def test_a_stream_whose_run_fails_says_so_in_an_event_under_the_errors_status(generate_node):
    status, kind, text = _post(generate_node.http_url, "v2/models/orphan/generate_stream", {"x": [1, 2, 3, 4]})
    assert (status, kind) == (503, "text/event-stream; charset=utf-8")
    assert text.startswith(b"data: {") and text.endswith(b"\n\n") and text.count(b"data: ") == 1
    streamed = json.loads(text[6:])
    status, kind, text = _post(generate_node.http_url, "v2/models/orphan/generate", {"x": [1, 2, 3, 4]})
    assert (status, kind) == (503, "application/json")
    for answer in (streamed, json.loads(text)):
        assert list(answer) == ["error"] and "no worker serves 'orphan'" in answer["error"]
    # refused before it runs: a JSON error from the stream route too
    status, kind, text = _post(generate_node.http_url, "v2/models/sum/generate_stream", {"x": [1, 2, 3]})
    assert (status, kind) == (400, "application/json")


def test_generate_requests_count_in_the_models_statistics(generate_node):
    def successes() -> int:
        _, _, text = _post(generate_node.http_url, "v2/models/one/stats", None, method="GET")
        return json.loads(text)["model_stats"][0]["inference_stats"]["success"]["count"]

    before = successes()
    for _ in range(3):
        assert _post(generate_node.http_url, "v2/models/one/generate", {"x": [1, 2]})[0] == 200
    assert successes() == before + 3


def test_a_body_past_the_json_limit_is_refused_before_it_is_read(generate_node):
    import socket

    with socket.create_connection(tuple(generate_node.http_url.split(":"))) as s:
        s.sendall(b"POST /v2/models/sum/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 70000000\r\n\r\n{\"x\": [")
        s.settimeout(30)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400")
    assert b"request JSON size of 70000000 bytes exceeds the maximum allowed input size of 67108864 bytes" in answer


def test_a_chunked_body_past_the_json_limit_is_refused_as_it_passes_it(generate_node):
    import socket

    chunk = b"[" + b"1," * (1 << 19) + b"1]"  # 1 MiB a chunk, of no length announced
    with socket.create_connection(tuple(generate_node.http_url.split(":"))) as s:
        s.sendall(b"POST /v2/models/sum/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        s.settimeout(30)
        sent = 0
        try:
            while sent <= 80 << 20:  # (it must be refused before the client has sent 80 MiB)
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"request JSON size of at least" in answer and b"67108864 bytes" in answer


def test_head_is_not_served_on_get_routes_as_tritons(generate_node):
    for path in ("v2/health/live", "v2/models/sum", "v2/models/sum/generate"):
        assert _post(generate_node.http_url, path, None, method="HEAD")[0] == 405, path


# ---------------------------------------------------------------- against Triton 2.51
# (body, headers, same words): requests right and wrong; Triton's `sum` answers zeros, so a
# success is compared by its members and their lengths. Where "same words" is false, Batchyard's
# message differs (documented in docs/frontend.md); a body Batchyard cannot read is its 400
# where Triton says 500, as for infer.
_X = [1, 2, 3, 4]
PARITY = [
    ({"x": _X}, None, True), ({"x": _X * 2, "id": "42"}, None, True), ({"x": [1, 2, 3]}, None, True),
    ({"x": 5}, None, True), ({"x": [_X]}, None, True), ({"x": None}, None, True), ({"x": "1234"}, None, True),
    ({"x": _X, "foo": 3, "bar": "s", "baz": True, "q": 1.5}, None, True), ({"x": _X, "foo": [1, 2]}, None, True),
    ({"x": _X, "foo": {"a": 1}}, None, True), ({"x": _X, "foo": None}, None, True),
    ({"x": _X, "parameters": {"x": _X}}, None, True), ({"parameters": {"x": _X, "priority": 1}}, None, True),
    ({"x": _X, "parameters": {"sub": {"x": 1}}}, None, True), ({"x": _X, "parameters": {}}, None, True),
    ({"x": _X, "parameters": {"parameters": 1}}, None, True), ({"x": _X, "id": ""}, None, True),
    ({"x": list(range(68))}, None, True),
    ({"x": _X, "priority": 5, "timeout": -3, "triton_foo": 1, "sequence_id": 5}, None, True),
    ({"x": _X}, {"Content-Encoding": "gzip"}, True), ({}, None, False), ({"text_input": "hi"}, None, False),
    ({"x": []}, None, False), ({"x": [1, 2, 3, "4"]}, None, False), ({"x": [True, False, 1, 2]}, None, False),
    ({"x": _X, "id": 42}, None, True), ({"x": _X, "parameters": None}, None, True), ("", None, True),
    ({"x": _X}, {"Content-Encoding": "Identity"}, True), ({"x": _X}, {"Content-Encoding": "identity"}, True),
    ("[]", None, True), ("nope", None, False)]
PATHS = ["v2/models/sum/generate", "v2/models/sum/generate_stream", "v2/models/nope/generate",
         "v2/models/sum/versions/2/generate", "v2/models/sum/versions/1/generate_stream"]


def _shape_of(answer: dict) -> dict:
    return {k: (len(v) if isinstance(v, list) else type(v).__name__) for k, v in answer.items()}


def _message(kind: str, text: bytes) -> str:
    answer = json.loads(text[6:] if kind.startswith("text/event-stream") else text)
    return answer.get("error", "")


def test_generate_answers_as_tritons(generate_node, triton_sum):
    triton_url = f"127.0.0.1:{triton_sum.http_port}"
    differ = []
    cases = [(p, b, h, words) for p in PATHS[:1] for b, h, words in PARITY]
    cases += [(p, {"x": _X}, None, True) for p in PATHS[1:]] + [(PATHS[1], {"x": [1, 2]}, None, True)]
    for path, body, headers, words in cases:
        (ts, tk, tt), (bs, bk, bt) = (_post(u, path, body, headers) for u in (triton_url, generate_node.http_url))
        unreadable = ts == 500 and bs == 400
        if (ts != bs and not unreadable) or tk != bk:
            differ.append((path, body, (ts, tk, tt), (bs, bk, bt)))
        elif ts == 200:
            t = json.loads(tt[6:] if tk.startswith("text/event-stream") else tt)
            b = json.loads(bt[6:] if bk.startswith("text/event-stream") else bt)
            if _shape_of(t) != _shape_of(b) or list(t) != list(b) or (tk.startswith("text/") and not
                                                                       (tt.startswith(b"data: ") and bt.startswith(b"data: "))):
                differ.append((path, body, tt, bt))
        elif words and _message(tk, tt).replace("[request id: <id_unknown>] ", "") != _message(bk, bt):
            differ.append((path, body, tt, bt))
    assert differ == [], "(path, body, Triton, Batchyard)"


@pytest.fixture(scope="module")
def triton_sum(tmp_path_factory):
    from test_kserve import triton_serving_sum

    with triton_serving_sum(tmp_path_factory) as tl:
        yield tl


# ---------------------------------------------------------------- LLM models (llm_generate)
def test_an_llm_models_metadata_and_config_are_the_vllm_backends_in_tritons_messages():
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2, service_pb2

    from batchyard.llm_generate import llm_config, llm_metadata

    cfg = json_format.ParseDict(llm_config("tiny"), model_config_pb2.ModelConfig())
    assert cfg.model_transaction_policy.decoupled and cfg.max_batch_size == 0
    assert [(i.name, i.optional) for i in cfg.input][:2] == [("text_input", False), ("stream", True)]
    md = json_format.ParseDict(llm_metadata("tiny"), service_pb2.ModelMetadataResponse())
    assert md.inputs[0].datatype == "BYTES" and md.outputs[0].name == "text_output"


def test_an_llm_streams_tensors_read_raw_or_typed():
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import serialize_byte_tensor

    from batchyard.llm_generate import grpc_outputs, grpc_request

    r = service_pb2.ModelInferRequest(model_name="tiny")
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    r.inputs.add(name="stream", datatype="BOOL", shape=[1])
    r.raw_input_contents.append(serialize_byte_tensor(np.array(["héllo".encode()], dtype=object)).item())
    r.raw_input_contents.append(b"\x01")
    r.parameters["max_tokens"].int64_param = 3
    r.parameters["priority"].int64_param = 1  # Triton's own, not the model's
    assert grpc_request("tiny", r) == ({"text_input": ["héllo"], "stream": [True]}, {"max_tokens": 3})
    typed = service_pb2.ModelInferRequest(model_name="tiny")
    typed.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hi")
    assert grpc_request("tiny", typed)[0] == {"text_input": ["hi"]}
    for build, words in [
            (lambda q: q.inputs.add(name="text_input", datatype="FP32", shape=[1]), "data-type is 'FP32'"),
            (lambda q: q.inputs.add(name="nope", datatype="BYTES", shape=[1]), "unexpected inference input 'nope'"),
            (lambda q: (q.inputs.add(name="text_input", datatype="BYTES", shape=[1]),
                        q.raw_input_contents.append(b"\x09\x00\x00\x00ab")), "one element of 9 bytes declared, 6 bytes"),
            (lambda q: (q.inputs.add(name="text_input", datatype="BYTES", shape=[1]),
                        q.raw_input_contents.append(b"\x02\x00\x00\x00\xff\xfe")), "is not UTF-8 text"),
            (lambda q: q.inputs.add(name="text_input", datatype="BYTES", shape=[2, 1]), "Expected [1], got [2, 1]"),
            (lambda q: q.inputs.add(name="stream", datatype="BOOL", shape=[1]).contents.bool_contents.extend(
                [True, False]), "unexpected number of elements 2 for input 'stream', expecting 1"),
            (lambda q: (q.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1]),
                        q.raw_input_contents.append(serialize_byte_tensor(np.array([b"{" * 70_000], dtype=object)).item())),
             "input 'sampling_parameters' of 70000 bytes: at most 65536")]:
        q = service_pb2.ModelInferRequest(model_name="tiny")
        build(q)
        assert words in _refused(grpc_request, "tiny", q)
    assert grpc_outputs({"text_output": "ab", "num_output_tokens": 2, "num_input_tokens": 5}) == [
        ("text_output", "BYTES", [1], b"\x02\x00\x00\x00ab"),
        ("num_input_tokens", "UINT32", [], b"\x05\x00\x00\x00"),  # (0-d in the backend, as Triton sends it)
        ("num_output_tokens", "UINT32", [1], b"\x02\x00\x00\x00")]


def test_an_llm_request_reads_as_tritons_vllm_backend_reads_it():
    from batchyard.llm_generate import read_generate_body as read_request

    prompt, switches, max_tokens = read_request(
        {"text_input": "hi", "parameters": {"max_tokens": 5, "temperature": 0}, "return_num_output_tokens": True})
    assert (prompt, max_tokens) == ("hi", 5)
    assert switches.pop("sampling").temperature == 0.0  # greedy
    assert switches == {"return_num_output_tokens": True, "exclude_input_in_output": False,  # the prompt comes first
                        "ignore_eos": False, "stop": (), "include_stop_str_in_output": False,
                        "skip_special_tokens": True, "bad_words": []}
    switches = read_request({"text_input": ["hi"], "stream": [True]})[1]
    assert switches.pop("sampling") == P.Sampling(temperature=1.0)  # none given: vLLM's default, it samples
    assert switches == {"stream": True, "exclude_input_in_output": True, "ignore_eos": False, "stop": (),
                        "include_stop_str_in_output": False, "skip_special_tokens": True, "bad_words": []}
    assert read_request({"text_input": "hi", "ignore_eos": "false"})[1]["ignore_eos"] is True  # bool(), as the backend
    assert read_request({"text_input": "hi", "id": "7"})[2] == 16  # vLLM's default
    # converted as the backend converts them: int("4"), int(4.0), float("0")
    assert read_request({"text_input": "hi", "max_tokens": "4", "temperature": "0"})[2] == 4
    assert read_request({"text_input": "hi", "parameters": {"max_tokens": 4.0, "temperature": False}})[2] == 4
    # sampling_parameters, a JSON object in a string, in place of the parameters (its nulls: vLLM's defaults)
    assert read_request({"text_input": "hi", "max_tokens": 9,
                         "sampling_parameters": '{"max_tokens": "3", "top_p": null}'})[2] == 3
    for body, words in [
            ({"parameters": {"max_tokens": 5}}, "missing required input(s) ['text_input']"),
            ({"text_input": 5}, "input 'text_input' must be a string"),
            ({"text_input": "hi", "stream": True, "exclude_input_in_output": False},
             "When streaming, `exclude_input_in_output` = False is not allowed."),
            ({"text_input": "hi", "temperature": 2.7}, "Expected `float` <= 2.0 - at `$.temperature`"),
            ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be a positive integer"),
            ({"text_input": "hi", "max_tokens": "4.0"}, "max_tokens must be an integer, got '4.0'"),
            ({"text_input": "hi", "max_tokens": [4] * 10**6}, "parameter 'max_tokens' has invalid type"),
            ({"text_input": "hi", "sampling_parameters": "{\"max_tokens\": [4, 4]}"}, "got an array of 2 items"),
            ({"text_input": "hi", "best_of": 2}, "sampling parameter 'best_of' is not supported"),
            ({"text_input": "hi", "top_p": "0.9x"}, "top_p must be a number, got '0.9x'"),
            ({"text_input": "hi", "sampling_parameters": "[1]"}, "'sampling_parameters' must be a JSON object"),
            ({"text_input": "hi", "sampling_parameters": "{"}, "'sampling_parameters' is not JSON"),
            ({"text_input": "hi", "image": "x"}, "input 'image' is not supported"),
            ({"text_input": "hi", "max_tokens": 3, "parameters": {"max_tokens": 4}},
             "parameter 'max_tokens' is given twice"),
            ({"text_input": "hi", "parameters": {"text_input": "ho"}}, "input 'text_input' already exists")]:
        with pytest.raises(KServeError) as e:
            read_request(body)
        assert words in e.value.message, body
