"""Triton's trace extension in the front door (dispatcher/kserve_trace.py): the settings as
Triton reads and answers them, sampling, the node-wide count and settings, and the trace file."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from tritonclient.utils import InferenceServerException

from batchyard import protocol as P
from batchyard.kserve_common import KServeError
from batchyard.kserve_trace import Setting, Trace, Tracer, parse_update

X = np.arange(12, dtype=np.float32).reshape(3, 4)
ON = {"level": ("TIMESTAMPS",), "rate": 1}


@pytest.fixture
def shared_dir(tmp_path):
    """A registry directory as the node's front doors share it."""
    (tmp_path / "registry").mkdir()
    fd = os.open(tmp_path / "registry", os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def _tracer(tmp_path, dir_fd=None, **default) -> Tracer:
    return Tracer(Setting(**default), str(tmp_path / "trace.json"), dir_fd)


def _error(fn) -> tuple[str, str]:
    with pytest.raises(KServeError) as e:
        fn()
    return e.value.code.name, e.value.message


# ------------------------------------------------------------------ parsing
@pytest.mark.parametrize("http", [True, False])
def test_settings_are_parsed_with_tritons_rules_and_words(http):
    """As tritonserver 2.51's http_server.cc / grpc_server.cc read them (std::stoi, a uint32 cast)."""
    v = (lambda s: s) if http else (lambda s: [s])
    parse = lambda d: parse_update(d, http)  # noqa: E731
    assert parse({"trace_rate": v("-1")}) == {"rate": 2**32 - 1}  # Triton answers 4294967295
    assert parse({"trace_rate": v(" 12abc"), "log_frequency": v("3")}) == {"rate": 12, "log_frequency": 3}
    assert parse({"trace_count": v("-1"), "trace_level": ["TIMESTAMPS"]}) == {"count": -1, "level": ("TIMESTAMPS",)}
    assert parse({"trace_level": ["OFF"], "trace_mode": v("x"), "other": v("1")}) == {"level": ("OFF",)}
    assert _error(lambda: parse({"trace_rate": v("x")})) == ("INVALID_ARGUMENT", "Unable to parse 'trace_rate', got: x")
    assert _error(lambda: parse({"trace_count": v("-2")})) == (
        "INVALID_ARGUMENT", f"Unable to parse 'trace_count'. Expecting value >= -1, got:{'' if http else ' '}-2")
    assert _error(lambda: parse({"log_frequency": v("99999999999")})) == (
        "INVALID_ARGUMENT", "Unable to parse 'log_frequency', value is out of range [ 0, 4294967295 ], got: 99999999999")
    assert _error(lambda: parse({"trace_file": v("/etc/passwd")})) == (
        "UNIMPLEMENTED", "trace file location can not be updated through network protocol")
    assert _error(lambda: parse({"trace_level": ["OFF", "TIMESTAMPS"]}))[1] == \
        "Expect only one trace level 'OFF' is specified"
    # Triton ignores a level it does not know, and changed nothing; TENSORS is not Batchyard's.
    assert _error(lambda: parse({"trace_level": ["TIMESTAMP"]}))[0] == "INVALID_ARGUMENT"
    assert _error(lambda: parse({"trace_level": ["TENSORS"]}))[0] == "UNIMPLEMENTED"


def test_clearing_a_setting_is_null_over_http_and_no_values_over_grpc():
    assert parse_update({"trace_rate": None, "trace_level": None}, True) == {"rate": None, "level": None}
    assert parse_update({"trace_rate": [], "trace_level": []}, False) == {"rate": None, "level": None}
    assert _error(lambda: parse_update({"trace_rate": ["1", "2"]}, False))[1] == "expect only 1 value for 'trace_rate'"
    # Triton answers 500 "attempt to access JSON non-string as string": the request's fault.
    assert _error(lambda: parse_update({"trace_rate": 5}, True))[0] == "INVALID_ARGUMENT"


# ------------------------------------------------------------------ settings
def test_a_model_follows_the_global_setting_where_it_sets_nothing(tmp_path, shared_dir):
    t = _tracer(tmp_path, shared_dir)
    assert t.settings() == {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "log_frequency": "0",
                            "trace_file": str(tmp_path / "trace.json"), "trace_mode": "triton"}
    t.update("m", {"rate": 2})
    t.update("", {"level": ("TIMESTAMPS",), "count": 5})
    assert (t.settings("m")["trace_rate"], t.settings("m")["trace_level"], t.settings("m")["trace_count"]) == \
        ("2", ["TIMESTAMPS"], "5")
    assert t.settings("other")["trace_rate"] == "1000"
    t.update("m", {"rate": None})  # nothing of its own left: the global setting whole
    assert t.settings("m") == t.settings()
    t.update("", {"count": None, "level": None})  # back to the node's config
    assert t.settings()["trace_count"] == "-1" and t.settings()["trace_level"] == ["OFF"]
    t.close()


def test_a_setting_that_would_trace_and_cannot_is_refused_as_triton_refuses_it(tmp_path):
    """Triton 2.51's reasons; a count of 0 (set, or spent) has none."""
    nowhere = Tracer(Setting(), "")
    assert _error(lambda: nowhere.update("", {"level": ("TIMESTAMPS",)}))[1] == \
        "Attempting to set invalid trace setting :trace file name is not given"
    t = _tracer(tmp_path)
    assert _error(lambda: t.update("m", {"level": ("TIMESTAMPS",), "rate": 0}))[1] == \
        "Attempting to set invalid trace setting :sample rate must be non-zero"
    t.update("", {"rate": 0})  # allowed while it traces nothing
    assert t.settings()["trace_rate"] == "0" and t.settings("m")["trace_level"] == ["OFF"]
    assert _error(lambda: t.update("", {"level": ("TIMESTAMPS",), "rate": 1, "count": 0}))[1] == \
        "Attempting to set invalid trace setting :"
    t.update("", {"level": ("TIMESTAMPS",), "rate": 1, "count": 1})
    t.sample("m")  # the count spent: the setting, and a model's that follows it, cannot change now but to trace again
    assert _error(lambda: t.update("", {"rate": 2}))[0] == _error(lambda: t.update("m", {"rate": 3}))[0] == \
        "INVALID_ARGUMENT"
    t.update("", {"count": 5})
    nowhere.close()
    t.close()


# ------------------------------------------------------------------ sampling
def test_every_rate_th_request_is_traced_while_the_count_lasts(tmp_path):
    t = _tracer(tmp_path, **ON)
    t.update("", {"rate": 3, "count": 2})
    got = [t.sample("m", f"r{i}") for i in range(12)]
    assert [i for i, tr in enumerate(got) if tr is not None] == [2, 5]  # the 3rd and 6th, then the count is spent
    assert t.settings()["trace_count"] == "0" and [got[2].id, got[5].id] == [1, 2]
    t.update("", {"count": -1, "level": ("OFF",)})
    assert t.sample("m") is None
    t.close()


def test_off_costs_a_read_and_takes_no_lock(tmp_path, monkeypatch):
    t = _tracer(tmp_path)
    t.sample("m")  # its first look at the settings
    import fcntl
    monkeypatch.setattr(fcntl, "flock", lambda *a: pytest.fail("locked with tracing off"))
    assert all(t.sample("m") is None for _ in range(100))
    monkeypatch.undo()
    t.close()


def test_the_settings_count_and_ids_are_the_nodes_across_front_door_processes(tmp_path, shared_dir):
    a = _tracer(tmp_path, shared_dir, **ON)
    b = _tracer(tmp_path, shared_dir, **ON)  # a second process joining: it keeps the node's setting
    a.update("", {"count": 3})
    assert b.settings()["trace_count"] == "3"
    traces = [a.sample("m"), b.sample("m"), a.sample("m"), b.sample("m"), a.sample("m")]
    assert [tr.id if tr else None for tr in traces] == [1, 2, 3, None, None]
    assert a.settings()["trace_count"] == b.settings()["trace_count"] == "0"
    b.update("m", {"count": 1})  # the model's own count, seen by the other process
    assert a.sample("m").id == 4 and a.sample("m") is None
    a.close()
    b.close()


# ------------------------------------------------------------------ the trace file
def _trace(tracer: Tracer, model: str = "m", rid: str = "") -> Trace:
    tr = tracer.sample(model, rid)
    tr.stamp("REQUEST_START", 10_000)
    tr.stamp_reply(P.Timing(queue_us=5, compute_us=2, total_us=9, batch_size=1, path="cpu", worker="w",
                            arrival_ns=15_000, dispatched_ns=20_000, done_ns=29_000, compute_end_ns=26_000))
    tr.stamp("REQUEST_END", 30_000)
    return tr


def test_a_trace_is_tritons_records_and_the_file_a_json_array_after_each(tmp_path, shared_dir):
    (tmp_path / "trace.json").write_text("an earlier run's")
    a, b = _tracer(tmp_path, shared_dir, **ON), _tracer(tmp_path, shared_dir, **ON)
    a.finish(_trace(a, rid="r1"))
    records = json.loads((tmp_path / "trace.json").read_text())  # the node's first trace started it afresh
    assert records == [{"id": 1, "model_name": "m", "model_version": 1, "request_id": "r1"},
                       *({"id": 1, "timestamps": [{"name": n, "ns": ns}]} for n, ns in (
                           ("REQUEST_START", 10_000), ("QUEUE_START", 15_000), ("COMPUTE_START", 20_000),
                           ("COMPUTE_INPUT_END", 24_000), ("COMPUTE_OUTPUT_START", 26_000), ("COMPUTE_END", 29_000),
                           ("REQUEST_END", 30_000)))]
    b.finish(_trace(b))
    records = json.loads((tmp_path / "trace.json").read_text())
    assert len(records) == 16 and records[8] == {"id": 2, "model_name": "m", "model_version": 1}  # no empty id
    a.close()
    b.close()


def test_the_dispatchers_times_are_never_placed_before_the_front_doors():
    """Its arrival is the start of the step that read the request, which may precede its send."""
    tr = Trace(1, "m", "", 0, "")
    tr.stamp("REQUEST_START", 100)
    tr.stamp_reply(P.Timing(queue_us=0, compute_us=50, total_us=0, batch_size=1, path="cpu", worker="w",
                            arrival_ns=90, dispatched_ns=95, done_ns=120, compute_end_ns=400))
    assert [ns for _, ns in tr.stamps] == [100, 100, 100, 100, 120, 120]
    tr = Trace(2, "m", "", 0, "")
    tr.stamp_reply(P.Timing(queue_us=0, compute_us=0, total_us=0, batch_size=1, path="cpu", worker="w"))
    assert tr.stamps == []  # a dispatcher that sends no times


def test_log_frequency_writes_every_n_traces_to_the_next_index_and_the_rest_at_close(tmp_path, shared_dir):
    t = _tracer(tmp_path, shared_dir, **ON)
    t.update("", {"log_frequency": 2})
    for _ in range(5):
        t.finish(_trace(t))
    assert sorted(os.listdir(tmp_path)) == ["registry", "trace.json.0", "trace.json.1"]
    t.close()
    assert [len(json.loads((tmp_path / f"trace.json.{i}").read_text())) for i in range(3)] == [16, 16, 8]


def test_a_trace_that_cannot_be_written_is_logged_not_raised(tmp_path, caplog):
    t = Tracer(Setting(("TIMESTAMPS",), 1), str(tmp_path / "no-such-folder" / "trace.json"))
    t.finish(_trace(t))
    assert "could not be written" in caplog.text
    late = _trace(t)
    t.close()
    t.finish(late)  # a request that ended after the front door closed this: dropped, not raised
    assert t.sample("m") is None


def test_a_front_door_with_a_registry_of_its_own_writes_traces_no_other_can_overwrite(tmp_path):
    """Its registry its own (another user made the node's first), its setting is its own too:
    sharing the file, two such processes each truncated it and numbered traces from 1."""
    t = _tracer(tmp_path, **ON)
    t.finish(_trace(t))
    assert t.settings()["trace_file"] == str(tmp_path / f"trace.json.pid-{os.getpid()}")
    assert len(json.loads((tmp_path / f"trace.json.pid-{os.getpid()}").read_text())) == 8
    t.close()


def test_numbers_are_read_as_c_reads_them_not_as_python_reads_unicode():
    for text in ("\u0663", "\xa05"):  # Arabic-Indic 3; a no-break space then 5: Triton refuses both
        assert _error(lambda: parse_update({"trace_rate": text}, True))[0] == "INVALID_ARGUMENT"


# ------------------------------------------------------------------ through a node
@pytest.fixture(scope="module")
def traced_front_door(tmp_path_factory):
    from test_kserve import _node_with_front_door

    trace_file = tmp_path_factory.mktemp("trace") / "trace.json"
    with _node_with_front_door(processes=2, trace_file=str(trace_file)) as fd:
        fd.trace_file = trace_file
        yield fd


def _records(path) -> dict[int, dict]:
    """The trace file's traces by id: {"head": its first record, "stamps": {name: ns}}."""
    out: dict[int, dict] = {}
    for r in json.loads(path.read_text()):
        t = out.setdefault(r["id"], {"stamps": {}})
        if "model_name" in r:
            t["head"] = r
        for s in r.get("timestamps", ()):
            t["stamps"][s["name"]] = s["ns"]
    return out


def test_traced_requests_over_grpc_http_and_a_stream_carry_the_nodes_times_in_order(traced_front_door):
    """Updated through one front-door process, the setting holds in the other too (each client
    below is a new connection, which SO_REUSEPORT spreads over both)."""
    fd = traced_front_door
    g, h = tgrpc.InferenceServerClient(fd.grpc_url), thttp.InferenceServerClient(fd.http_url)
    assert g.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}, as_json=True)
    for _ in range(4):
        s = thttp.InferenceServerClient(fd.http_url).get_trace_settings()
        assert (s["trace_level"], s["trace_rate"], s["trace_file"]) == (["TIMESTAMPS"], "1", str(fd.trace_file))
    gi, hi = tgrpc.InferInput("x", [3, 4], "FP32"), thttp.InferInput("x", [3, 4], "FP32")
    gi.set_data_from_numpy(X)
    hi.set_data_from_numpy(X)
    g.infer("sum", [gi], request_id="grpc")
    h.infer("sum", [hi], request_id="http")
    answers = []
    g.start_stream(callback=lambda result, error: answers.append((result, error)))
    g.async_stream_infer("sum", [gi], request_id="stream")
    g.stop_stream()  # (waits for the stream's answers)
    assert answers and answers[0][1] is None
    wrong = thttp.InferInput("x", [3, 5], "FP32")
    wrong.set_data_from_numpy(np.zeros((3, 5), np.float32))
    with pytest.raises(InferenceServerException):
        h.infer("sum", [wrong])
    assert h.is_server_live()  # (on the refused request's connection: answered once its trace was written)
    g.update_trace_settings(settings={"trace_level": ["OFF"]})
    traces = {t["head"].get("request_id", ""): t for t in _records(fd.trace_file).values()}
    assert set(traces) == {"grpc", "http", "stream", ""} and {t["head"]["model_name"] for t in traces.values()} == {"sum"}
    node = ("REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
            "COMPUTE_END", "REQUEST_END", "INFER_RESPONSE_COMPLETE")
    for rid, proto in (("grpc", "GRPC"), ("stream", "GRPC"), ("http", "HTTP")):
        first, last = (("GRPC_WAITREAD_END",) if proto == "GRPC" else ("HTTP_RECV_START", "HTTP_RECV_END"),
                       (f"{proto}_SEND_START", f"{proto}_SEND_END"))
        stamps = traces[rid]["stamps"]
        order = [*first, *node, *last]
        assert [stamps[n] for n in order] == sorted(stamps[n] for n in order), (rid, stamps)
        assert stamps[order[-1]] - stamps[order[0]] < 60e9
    # The refused request: its front door's times, none of the node's.
    assert {"HTTP_RECV_START", "HTTP_SEND_END"} <= set(traces[""]["stamps"]) and \
        "QUEUE_START" not in traces[""]["stamps"]


def test_generate_requests_are_traced_as_infers(traced_front_door):
    """Triton traces its generate extension's requests; they were left out here."""
    import http.client

    fd = traced_front_door
    g = tgrpc.InferenceServerClient(fd.grpc_url)
    g.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    conn = http.client.HTTPConnection(*fd.http_url.split(":"), timeout=30)
    try:
        for path, rid in (("generate", "gen"), ("generate_stream", "gen-stream")):
            conn.request("POST", f"/v2/models/sum/{path}", json.dumps({"x": X.ravel().tolist(), "id": rid}))
            r = conn.getresponse()
            assert r.status == 200 and r.read()
        # A trace is written once its answer's last byte is sent, after the client may have read
        # it; a connection's next request is handled only once the one before it was, written.
        conn.request("GET", "/v2/health/live")
        assert conn.getresponse().status == 200
    finally:
        conn.close()
        g.update_trace_settings(settings={"trace_level": ["OFF"]})
    traces = {t["head"].get("request_id", ""): t for t in _records(fd.trace_file).values()}
    order = ("HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END",
             "REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END")
    for rid in ("gen", "gen-stream"):
        stamps = traces[rid]["stamps"]
        assert traces[rid]["head"]["model_name"] == "sum"
        assert [stamps[n] for n in order] == sorted(stamps[n] for n in order), (rid, stamps)


def test_requests_for_a_model_the_node_lacks_are_not_traced(traced_front_door):
    """As Triton: they spent the node's trace count, and wrote any name a client chose."""
    fd = traced_front_door
    g, h = tgrpc.InferenceServerClient(fd.grpc_url), thttp.InferenceServerClient(fd.http_url)
    g.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "2"})
    gi, hi = tgrpc.InferInput("x", [3, 4], "FP32"), thttp.InferInput("x", [3, 4], "FP32")
    gi.set_data_from_numpy(X)
    hi.set_data_from_numpy(X)
    for call in (lambda: g.infer("nope", [gi]), lambda: h.infer("nope", [hi])):
        with pytest.raises(InferenceServerException):
            call()
    assert h.get_trace_settings()["trace_count"] == "2"
    g.infer("sum", [gi], request_id="after-nope")
    g.update_trace_settings(settings={"trace_level": ["OFF"], "trace_count": "-1"})
    assert "nope" not in {t["head"]["model_name"] for t in _records(fd.trace_file).values()}


def test_trace_settings_of_a_model_the_node_lacks_are_tritons_error(traced_front_door):
    fd = traced_front_door
    with pytest.raises(InferenceServerException, match="Request for unknown model : nope") as e:
        thttp.InferenceServerClient(fd.http_url).get_trace_settings("nope")
    assert e.value.status() == "400"
    with pytest.raises(InferenceServerException, match="Request for unknown model : nope") as e:
        tgrpc.InferenceServerClient(fd.grpc_url).update_trace_settings("nope", {"trace_rate": "2"})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="can not be updated") as e:
        thttp.InferenceServerClient(fd.http_url).update_trace_settings(settings={"trace_file": "/tmp/elsewhere"})
    assert e.value.status() == "501"


@pytest.mark.parametrize("node_clock", [True, False])
def test_the_dispatchers_times_are_left_out_when_they_come_from_another_hosts_clock(tmp_path, node_clock):
    """A front door that reaches its dispatcher over tcp: the dispatcher's CLOCK_MONOTONIC is
    another host's, and placed beside the front door's its times said nothing."""
    import asyncio

    from batchyard.kserve_common import KServeCore
    from batchyard.kserve_shm import ShmRegions

    spec = P.ModelSpec("m", (P.TensorSpec("x", "float32", (2,)),), (P.TensorSpec("y", "float32", (2,)),))
    timing = P.Timing(queue_us=1, compute_us=1, total_us=3, batch_size=1, path="cpu", worker="w",
                      arrival_ns=10**15, dispatched_ns=10**15 + 1000, done_ns=10**15 + 3000, compute_end_ns=10**15 + 2000)

    class FakeClient:
        specs = {"m": spec}

        async def infer(self, model, inputs, priority, timeout):
            return type("Out", (), {"timing": timing, "__getitem__": lambda self, k: np.zeros((1, 2))})()

    tracer = Tracer(Setting(("TIMESTAMPS",), 1), str(tmp_path / "trace.json"), node_clock=node_clock)
    core = KServeCore(FakeClient(), ShmRegions(str(tmp_path / "registry")), tracer=tracer)
    try:
        trace = tracer.sample("m")
        asyncio.run(core.infer("m", {"x": np.zeros((1, 2), np.float32)}, trace=trace))
    finally:
        core.close()
    names = [n for n, _ in trace.stamps]
    assert names[:1] + names[-2:] == ["REQUEST_START", "REQUEST_END", "INFER_RESPONSE_COMPLETE"]
    assert ("QUEUE_START" in names) == ("COMPUTE_INPUT_END" in names) == node_clock


def test_a_dispatcher_reaching_its_workers_over_tcp_sends_no_worker_clock():
    from batchyard.config import DispatcherConfig
    from batchyard.server import Dispatcher

    for backend, on_host in (("ipc:///tmp/x", True), ("tcp://127.0.0.1:5555", False)):
        cfg = DispatcherConfig(frontend="ipc:///tmp/fe", backend=backend)
        assert Dispatcher._workers_on_host(cfg) is on_host, backend


def test_the_nodes_setting_is_replaced_whole_so_a_process_killed_writing_it_leaves_the_last_one(tmp_path, shared_dir,
                                                                                             monkeypatch):
    a = _tracer(tmp_path, shared_dir, **ON)
    a.update("", {"rate": 7})

    def killed(*args, **kw):  # the process dies between writing the new setting and putting it in place
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        a.update("", {"rate": 9})
    monkeypatch.undo()
    b = _tracer(tmp_path, shared_dir, **ON)
    assert b.settings()["trace_rate"] == "7"
    a.close()
    b.close()


# ------------------------------------------------------------------ failures (a second review's)
def test_a_full_disk_leaves_the_trace_file_a_json_array_and_is_logged(tmp_path, shared_dir, monkeypatch, caplog):
    t = _tracer(tmp_path, shared_dir, **ON)
    t.finish(_trace(t))
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, at: real(fd, data[:10], at))  # ENOSPC part-way
    t.finish(_trace(t))
    monkeypatch.undo()
    assert "could not be written" in caplog.text
    t.finish(_trace(t))
    assert [r["id"] for r in json.loads((tmp_path / "trace.json").read_text()) if "model_name" in r] == [1, 3]
    t.close()


def test_a_setting_that_cannot_be_written_leaves_requests_untraced_not_failed(tmp_path, shared_dir, monkeypatch,
                                                                              caplog):
    """Clients' shared-memory regions fill /dev/shm, where the node's setting lives: each traced
    request failed INTERNAL with a traceback."""
    t = _tracer(tmp_path, shared_dir, **ON)
    t.update("", {"count": 5})

    def full(*a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full)
    assert [t.sample("m") for _ in range(3)] == [None] * 3
    assert caplog.text.count("requests go untraced") == 1
    assert _error(lambda: t.update("", {"count": 4})) == (
        "INTERNAL", "the node's trace setting could not be read or written: [Errno 28] No space left on device")
    monkeypatch.undo()
    assert t.sample("m") is not None
    t.close()


def test_a_setting_missing_from_the_nodes_folder_is_the_configs_not_every_requests_failure(tmp_path, shared_dir):
    """A front door killed between making the header and the setting left the header alone, and
    the next one of the run failed every request on it."""
    t = _tracer(tmp_path, shared_dir, rate=7)
    os.unlink("trace-setting.json", dir_fd=shared_dir)
    u = _tracer(tmp_path, shared_dir, rate=7)
    assert u.sample("m") is None and u.settings()["trace_rate"] == "7"
    t.close()
    u.close()


@pytest.mark.parametrize("planted", ["null", '{"global": {}, "models": {}}', "fifo"])
def test_a_setting_no_front_door_wrote_is_the_configs_not_every_requests_failure(tmp_path, shared_dir, planted):
    # A setting of another shape raised TypeError out of every request's sampling; a FIFO held
    # the loop in open().
    t = _tracer(tmp_path, shared_dir, rate=7)
    os.unlink("trace-setting.json", dir_fd=shared_dir)
    if planted == "fifo":
        os.mkfifo("trace-setting.json", dir_fd=shared_dir)
    else:
        with open(os.open("trace-setting.json", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=shared_dir), "w") as f:
            f.write(planted)
    t._header[0] += 1  # (as a change published by another process)
    assert t.sample("m") is None and t.settings()["trace_rate"] == "7"
    t.update("", {"rate": 3})
    assert t.settings()["trace_rate"] == "3"
    t.close()


def test_a_link_planted_where_traces_go_is_not_followed(tmp_path, shared_dir, caplog):
    (tmp_path / "precious").write_text("precious")
    (tmp_path / "trace.json").symlink_to(tmp_path / "precious")
    (tmp_path / "trace.json.0").symlink_to(tmp_path / "precious")
    t = _tracer(tmp_path, shared_dir, **ON)
    t.finish(_trace(t))  # the node's first trace: a file of its own in the link's place
    t.update("", {"log_frequency": 1})
    t.finish(_trace(t))  # through the link: refused
    assert (tmp_path / "precious").read_text() == "precious" and caplog.text.count("could not be written") == 1
    assert not (tmp_path / "trace.json").is_symlink() and len(json.loads((tmp_path / "trace.json").read_text())) == 8
    t.close()


def test_a_first_trace_that_cannot_be_written_leaves_the_old_file_whole(tmp_path, shared_dir, monkeypatch):
    (tmp_path / "trace.json").write_text('[{"id":1}]')
    t = _tracer(tmp_path, shared_dir, **ON)

    def full(*a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full)
    t.finish(_trace(t))
    monkeypatch.undo()
    assert (tmp_path / "trace.json").read_text() == '[{"id":1}]' and sorted(os.listdir(tmp_path)) == [
        "registry", "trace.json"]
    t.close()


def test_a_setting_healed_from_the_config_reaches_every_process(tmp_path, shared_dir):
    a, b = _tracer(tmp_path, shared_dir), _tracer(tmp_path, shared_dir)
    a.update("m", {"level": ("TIMESTAMPS",), "rate": 1})
    assert b.sample("m") is not None
    os.unlink("trace-setting.json", dir_fd=shared_dir)
    assert a.settings("m")["trace_level"] == ["OFF"]  # the config's
    assert b.sample("m") is None  # (it traced on, by what it held)
    a.close()
    b.close()


@pytest.mark.parametrize("where, says", [("/", "is a folder"), ("/no/such/folder/trace.json", "there is no folder"),
                                         ("/tmp/trace.json", "")])
def test_a_trace_file_that_cannot_be_written_here_is_said_at_the_front_doors_start(where, says, monkeypatch):
    """Said, not a config error: a unit's view of the file system may differ from where the
    config is checked (PrivateTmp), and the node serves on."""
    from batchyard.kserve_trace import trace_file_problem

    assert says in trace_file_problem(where) and bool(says) == bool(trace_file_problem(where))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only folder (as root, none is)
    assert "is not writable here" in trace_file_problem("/tmp/trace.json")


def test_a_cancelled_stream_writes_the_traces_of_the_requests_it_had_read(tmp_path, shared_dir):
    """Its requests' traces were known only when each answered: cancelled first, their traces
    were lost, their count spent."""
    import asyncio
    import types

    from tritonclient.grpc import service_pb2

    from batchyard import kserve_grpc

    tracer = _tracer(tmp_path, shared_dir, **ON)
    spec = P.ModelSpec("sum", (P.TensorSpec("x", "float32", (4,)),), (P.TensorSpec("y", "float32", (2,)),))
    servicer = kserve_grpc.KServeServicer(types.SimpleNamespace(client=types.SimpleNamespace(specs={"sum": spec}),
                                                                tracer=tracer, serves_llm=lambda model: False))

    async def infer(request, context, stream=False, traced=None, read=0, **_):  # sampled as the real one; never answers
        traced.append(servicer._trace(request, read))
        await asyncio.get_running_loop().create_future()
    servicer._infer = infer

    async def requests():
        for i in range(3):
            yield service_pb2.ModelInferRequest(model_name="sum", id=f"r{i}")
        await asyncio.get_running_loop().create_future()  # a client that sends no more

    async def main():
        answers = servicer.ModelStreamInfer(requests(), None)
        first = asyncio.ensure_future(anext(answers))
        for _ in range(100):  # every turn the reader and the requests could take; no time passes
            await asyncio.sleep(0)
        first.cancel()  # the client cancels the stream
        with pytest.raises(asyncio.CancelledError):
            await first

    asyncio.run(main())
    heads = [r for r in json.loads((tmp_path / "trace.json").read_text()) if "model_name" in r]
    assert sorted(h["request_id"] for h in heads) == ["r0", "r1", "r2"]
    tracer.close()


def test_a_post_of_json_that_is_no_object_makes_the_setting_anew_as_tritons(traced_front_door):
    """Triton 2.51 answers `[]`, `null` and `{}` alike: a setting made anew, refused once the
    count is spent ("Attempting to set invalid trace setting :"); `[]` and `null` were 200 here."""
    import urllib.error
    import urllib.request

    fd = traced_front_door
    h = thttp.InferenceServerClient(fd.http_url)
    h.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1"})
    hi = thttp.InferInput("x", [3, 4], "FP32")
    hi.set_data_from_numpy(X)
    h.infer("sum", [hi])  # the count spent
    for body in (b"[]", b"null", b"{}"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(f"http://{fd.http_url}/v2/trace/setting", body,
                                                          method="POST"), timeout=30)
        assert (e.value.code, json.loads(e.value.read())) == (400, {"error": "Attempting to set invalid trace setting :"})
    h.update_trace_settings(settings={"trace_level": ["OFF"], "trace_count": "-1"})


def test_the_span_bench_reads_a_front_doors_trace_file(tmp_path, shared_dir):
    """bench/traced_hops.py measures Batchyard and Triton from their trace files alike."""
    from batchyard.bench.traced_hops import SPANS, spans

    t = _tracer(tmp_path, shared_dir, **ON)
    whole = _trace(t)
    whole.stamps[:0] = [("GRPC_WAITREAD_START", 9_000), ("GRPC_WAITREAD_END", 9_000)]
    whole.stamps += [("GRPC_SEND_START", 31_000), ("GRPC_SEND_END", 33_000)]
    t.finish(whole)
    t.finish(_trace(t))  # no protocol timestamps: not a whole one
    got = spans(tmp_path / "trace.json")
    assert got.shape == (1, len(SPANS)) and list(got[0]) == [1, 5, 5, 4, 2, 3, 1, 1, 2, 24]
    t.close()
