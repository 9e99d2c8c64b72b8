"""Prometheus metrics with Triton's names, from the dispatcher's own loop."""

from __future__ import annotations

import socket
import urllib.request

import numpy as np
import pytest

from prometheus_client.parser import text_string_to_metric_families

from batchyard.addresses import free_port
from batchyard.bench.harness import sample_total as total
from batchyard.bench.harness import exposition_samples, scrape
from batchyard.errors import DeadlineExceeded, InvalidArgument, UnknownModel
from batchyard.metrics import Metrics
from batchyard.protocol import Status

from conftest import sim_worker
from test_request_path import X1, header, raw_roundtrip


def scrape_port(port: int) -> list:
    return scrape(f"http://127.0.0.1:{port}/metrics")


def test_metrics_count_a_known_load(start_node):
    port = free_port()
    node = start_node([sim_worker()], metrics_port=port)
    with node.client() as c:
        futs = [c.submit("sum", {"x": np.ones((n, 4), np.float32)}, priority="high" if n == 1 else "normal")
                for n in (1, 2, 3, 1, 2, 3, 1, 2, 3, 4)]
        for f in futs:
            f.result()
        for _ in range(2):
            with pytest.raises(InvalidArgument):
                c.infer("sum", {"x": np.ones((1, 4), np.float64)})
        with pytest.raises(UnknownModel):  # the SDK asks model_info first: not an inference failure
            c.infer("ghost", {"x": np.ones((1, 4), np.float32)})
        # an infer for an unknown model, sent raw, is counted, but under no model's name: as in
        # Triton, a model not served has no series, and each name a client sends made one for good
        for ghost in ("ghost", "ghost2"):
            assert raw_roundtrip(node.address, [header(model=ghost), X1]).status == 5
        with pytest.raises(DeadlineExceeded):  # 1 us: no path finishes it in time, refused on arrival
            c.infer("sum", {"x": np.ones((1, 4), np.float32)}, timeout=1e-6)
        c.status()  # every reply above has been sent
    m = scrape_port(port)
    assert total(m, "nv_inference_request_success") == 10
    assert total(m, "nv_inference_request_success", priority="high") == 3
    assert total(m, "nv_inference_request_success", path="gpu") == 10
    assert total(m, "nv_inference_count") == 22  # items
    # Triton's four reasons (a dashboard's {reason="REJECTED"}), Batchyard's status beside them
    assert total(m, "nv_inference_request_failure", reason="OTHER", status="invalid_argument") == 2
    assert total(m, "batchyard_unknown_model_requests_total") == 3  # the SDK's lookup, and two raw infers
    assert not [x for x in m if x.labels.get("model", "").startswith("ghost")]
    assert total(m, "nv_inference_request_failure", reason="REJECTED", status="deadline_exceeded") == 1
    assert total(m, "nv_inference_request_failure") == 3
    assert 1 <= total(m, "nv_inference_exec_count") <= 10
    assert total(m, "nv_inference_queue_duration_us") > 0
    # HEAD, a probe's, is GET without the body (it was a 404 beside GET's 200)
    head = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/metrics", method="HEAD"), timeout=30)
    assert head.status == 200 and int(head.headers["Content-Length"]) > 0 and head.read() == b""
    assert total(m, "nv_inference_compute_infer_duration_us") > 0
    assert total(m, "nv_inference_request_duration_us") >= total(m, "nv_inference_queue_duration_us")
    assert total(m, "nv_inference_pending_request_count") == 0
    # Triton 2.51's families, each labelled model and version as Triton labels them (dashboards
    # select {model=..., version="1"}; there was no version label, and no input/output time).
    triton = {"nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
              "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
              "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
              "nv_inference_compute_output_duration_us", "nv_inference_pending_request_count"}
    assert triton <= {s.name for s in m}
    assert all(s.labels.get("version") == "1" and "model" in s.labels for s in m if s.name in triton)
    assert total(m, "nv_inference_request_success", model="sum", version="1") == 10
    assert total(m, "batchyard_request_latency_seconds_count", model="sum") == 10
    assert total(m, "batchyard_request_latency_seconds_bucket", model="sum", le="+Inf") == 10
    assert total(m, "batchyard_decisions_total") >= 1
    # The learned curve is exported (its value is a least-squares fit of a few noisy batches: on a
    # loaded machine its slope can even come out negative, so only its presence is checked).
    assert [x for x in m if x.name == "batchyard_cost_per_item_us" and x.labels.get("model") == "sum"]
    assert total(m, "batchyard_arrival_rate", model="sum") > 0
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=10)


def test_idle_metrics_connections_cannot_use_up_the_dispatchers_descriptors(start_node):
    """Connections that never finish a request were all kept open by the endpoint, which shares
    the dispatcher's thread and descriptors: now at most METRICS_MAX_CONNECTIONS, the oldest
    closed first, so a scrape still gets through and the node serves on."""
    import psutil

    from batchyard.metrics import METRICS_MAX_CONNECTIONS

    port = free_port()
    node = start_node([sim_worker()], metrics_port=port)
    with node.client() as c:
        dispatcher = psutil.Process(c.status().dispatcher_pid)
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4 * METRICS_MAX_CONNECTIONS)]
        try:
            for s in idle:
                s.sendall(b"GET /metr")  # and never the rest
            assert total(scrape_port(port), "nv_inference_pending_request_count") == 0
            held = [k for k in dispatcher.net_connections("tcp")
                    if k.laddr.port == port and k.status == psutil.CONN_ESTABLISHED]
            assert len(held) <= METRICS_MAX_CONNECTIONS
            np.testing.assert_array_equal(c.infer("sum", {"x": np.ones((1, 4), np.float32)})["y"], [[4.0, 4.0]])
        finally:
            for s in idle:
                s.close()


def test_failures_carry_tritons_reasons_and_batchyards_status():
    """Triton 2.51 labels a failure REJECTED, CANCELED, BACKEND or OTHER; the reason was
    Batchyard's status name ("overloaded"), which no Triton dashboard selects."""
    m = Metrics()
    want = {Status.OVERLOADED: "REJECTED", Status.DEADLINE_EXCEEDED: "REJECTED", Status.CANCELLED: "CANCELED",
            Status.INTERNAL: "BACKEND", Status.UNAVAILABLE: "BACKEND", Status.INVALID_ARGUMENT: "OTHER",
            Status.UNKNOWN_MODEL: "OTHER", Status.PERMISSION_DENIED: "OTHER", 99: "OTHER"}
    for status in want:
        m.request_failed("m", status, 0)
    samples = [s for s in exposition_samples(m.render({}, {}, {}, {})) if s.name == "nv_inference_request_failure"]
    got = {s.labels["status"]: s.labels["reason"] for s in samples}
    assert got == {(Status(k).name.lower() if k != 99 else "status_99"): v for k, v in want.items()}
    assert all(s.value == 1 and s.labels["version"] == "1" and s.labels["priority"] == "high" for s in samples)


def test_failures_carry_the_class_the_client_asked_for():
    """The README promised path/priority labels; failures had no priority, so a per-class error
    ratio (sum by (priority) of failures over requests) split nothing."""
    m = Metrics()
    m.model_served("m", "cpu")
    m.request_failed("m", Status.DEADLINE_EXCEEDED, 0)
    for _ in range(3):
        m.request_failed("m", Status.DEADLINE_EXCEEDED, 2)
    samples = exposition_samples(m.render({}, {}, {}, {}))
    by_class = {p: total(samples, "nv_inference_request_failure", model="m", status="deadline_exceeded", priority=p)
                for p in ("high", "normal", "low")}
    assert by_class == {"high": 1, "normal": 0, "low": 3}  # the normal class's series exists at 0 from the start


def test_label_values_are_escaped_and_the_exposition_parses():
    """A model name with a quote, a backslash and a newline comes back from a Prometheus parser
    exactly, and Triton's metric names are kept as they are (no ``_total`` added)."""
    odd = 'bert "large"\\v2\nfinal'
    m = Metrics()
    for _ in range(3):
        m.request_ok(odd, "cpu", 0, items=4, queue_us=100, compute_us=2000, total_us=2500)
    m.request_failed(odd, Status.OVERLOADED, 1)
    m.batch_done(odd, "cpu")
    text = m.render({odd: 2}, {"cpu_now": 3}, {f"{odd}/cpu": {"launch_us": 900.0, "per_item_us": 50.0}}, {odd: 12.5})
    samples = exposition_samples(text)
    assert total(samples, "nv_inference_request_success", model=odd, path="cpu", priority="high") == 3
    assert total(samples, "nv_inference_count", model=odd) == 12
    assert total(samples, "nv_inference_request_failure", model=odd, reason="REJECTED", status="overloaded") == 1
    assert total(samples, "nv_inference_exec_count", model=odd, path="cpu") == 1
    assert total(samples, "nv_inference_pending_request_count", model=odd) == 2
    assert total(samples, "batchyard_request_latency_seconds_bucket", model=odd, le="0.005") == 3
    assert total(samples, "batchyard_request_latency_seconds_sum", model=odd) == pytest.approx(0.0075)
    assert total(samples, "batchyard_decisions_total", reason="cpu_now") == 3
    assert total(samples, "batchyard_cost_per_item_us", model=odd, path="cpu") == 50.0
    assert total(samples, "batchyard_arrival_rate", model=odd) == 12.5


def test_pending_counts_the_queue_and_in_flight_the_requests_running(start_node):
    """Triton's pending count leaves out a request its backend has started (an autoscaler reads
    it as the backlog); it counted the running ones too. Those are Batchyard's own gauge."""
    port = free_port()
    node = start_node([sim_worker(launch_us=3_000_000.0)], policy="greedy", metrics_port=port)
    with node.client() as c:
        running = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=60)
        c.status()  # answered after the step that sent it to the (only, free) worker
        queued = c.submit("sum", {"x": np.ones((1, 4), np.float32)}, timeout=60)
        c.status()
        m = scrape_port(port)
        assert total(m, "nv_inference_pending_request_count", model="sum") == 1
        assert total(m, "batchyard_inflight_request_count", model="sum") == 1
        for f in (running, queued):
            f.cancel()


def test_the_priority_label_is_the_one_asked_for_not_the_class_aging_raised_it_to(start_node):
    """Requests sent low that waited long enough to move up a class (aging) were counted as
    normal or high: a dashboard of the low class missed them."""
    port = free_port()
    node = start_node([sim_worker(launch_us=20_000.0, per_item_us=100.0)], metrics_port=port)
    with node.client() as c:
        futs = [c.submit("sum", {"x": np.ones((1, 4), np.float32)}, priority="low", timeout=30) for _ in range(400)]
        for f in futs:
            f.result()
        c.status()
    m = scrape_port(port)
    assert total(m, "nv_inference_request_success", model="sum") == 400
    assert total(m, "nv_inference_request_success", model="sum", priority="low") == 400


TRITON_COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
                   "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                   "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                   "nv_inference_compute_output_duration_us")


def test_cumulative_families_are_counters_as_tritons_and_keep_their_names():
    """Triton declares its nv_inference_* families ``counter`` (names without ``_total``); here
    they were ``untyped``, so Prometheus and Grafana took them for no counters at all."""
    m = Metrics()
    m.model_served("sum", "gpu")
    m.request_ok("sum", "gpu", 1, items=2, queue_us=10, compute_us=20, total_us=40)
    m.request_failed("sum", Status.OVERLOADED, 1)
    m.batch_done("sum", "gpu")
    text = m.render({"sum": 1}, {"cpu_now": 2}, {}, {"sum": 3.0})
    types = {fam.name: fam.type for fam in text_string_to_metric_families(text)}
    assert {name: types[name] for name in TRITON_COUNTERS} == dict.fromkeys(TRITON_COUNTERS, "counter")
    assert types["nv_inference_pending_request_count"] == "gauge"
    assert types["batchyard_request_latency_seconds"] == "histogram"
    assert "untyped" not in text
    # Under the names written, as Prometheus stores them (the parser's own view adds _total).
    samples = exposition_samples(text)
    assert {s.name for s in samples} >= set(TRITON_COUNTERS)
    assert total(samples, "nv_inference_request_success", model="sum") == 1
    assert total(samples, "nv_inference_count", model="sum") == 2
    assert total(samples, "nv_inference_request_failure", model="sum", reason="REJECTED") == 1
    assert total(samples, "nv_inference_exec_count", model="sum") == 1
    assert total(samples, "batchyard_decisions_total", reason="cpu_now") == 2


def test_a_model_name_with_a_slash_keeps_it_in_the_curve_labels():
    text = Metrics().render({}, {}, {"org/bert/gpu": {"launch_us": 900.0, "per_item_us": 50.0}}, {})
    samples = exposition_samples(text)
    assert total(samples, "batchyard_cost_per_item_us", model="org/bert", path="gpu") == 50.0


def test_a_batch_in_which_every_request_failed_is_no_execution(start_node):
    # As Triton's backends report a batch only if some response in it succeeded: exec_count
    # counted failed batches too, so count / exec_count (the mean batch, as the bench and the
    # docs read it) read 0.8 with every successful batch of one item, and the front door's
    # ModelStatistics execution_count disagreed with it.
    from batchyard.config import ModelConfig, TensorConfig, WorkerConfig
    from batchyard.errors import InternalError

    small = ModelConfig(name="small", factory="tests.poison_model:small_batches_only", max_batch=8,
                        inputs=(TensorConfig("x", "float32", (4,)),), outputs=(TensorConfig("y", "float32", (2,)),))
    port = free_port()
    node = start_node([WorkerConfig(name="w0", kind="amx", models=("small",), threads=1, warmup_sizes=(1,))],
                      models=(small,), metrics_port=port)
    with node.client() as c:
        for _ in range(3):
            c.infer("small", {"x": np.ones((1, 4), np.float32)})
        for _ in range(2):
            with pytest.raises(InternalError):  # the model raises on 4 items or more
                c.infer("small", {"x": np.ones((4, 4), np.float32)})
        c.status()
    m = scrape_port(port)
    assert total(m, "nv_inference_exec_count", model="small") == 3
    assert total(m, "nv_inference_count", model="small") == 3


def test_a_served_models_series_exist_at_zero_before_its_first_request(start_node):
    # As Triton creates a model's counters when it loads: born at its first increment, a failure
    # series appeared already at its burst's count, and rate()/increase() read that burst as 0.
    port = free_port()
    start_node([sim_worker()], metrics_port=port)
    m = scrape_port(port)
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        assert [x.value for x in m if x.name == "nv_inference_request_failure" and x.labels["model"] == "sum"
                and x.labels["reason"] == reason] and total(m, "nv_inference_request_failure", reason=reason) == 0
    for name in ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count"):
        assert [x for x in m if x.name == name and x.labels["model"] == "sum"], name
        assert total(m, name) == 0


# ---------------------------------------------------------------- LLM mode, front door, scrape cost
def _parse(text: str) -> list:
    return exposition_samples(text)


@pytest.fixture
def llm_dispatcher(bare_dispatcher):
    """bare_dispatcher, driven by calling its LLM desk (no engine process: a job sent is taken as
    sent)."""
    def make(**kw):
        d = bare_dispatcher(**kw)
        d.llm._send_worker = lambda identity, header: True
        return d

    return make


def _register_gpu_engine(d) -> None:
    from batchyard import protocol as P
    from test_llm_core import GPU_ENGINE  # model "m", role "gpu"

    d.llm.on_register(P.Register(v=P.PROTOCOL_VERSION, worker="gpu0", pid=1, path="gpu", models=[], llm=GPU_ENGINE),
                      b"gpu0", 0.0)


def _generate(d, n: int, now: float = 0.0) -> None:
    """n generate requests for "m", each run to the end by the engine."""
    from batchyard import protocol as P

    for rid in range(n):
        d.llm.on_generate(P.GenerateRequest(v=P.PROTOCOL_VERSION, id=rid, model="m", prompt=[7] * 64, max_tokens=2,
                                            timeout_us=30_000_000), b"client", now, lambda m: "")
    d.llm.decide(now)
    for job in list(d.llm.core.jobs.values()):
        d.llm.on_done(P.LlmDone(job_id=job.job_id, worker="gpu0", compute_s=0.01,
                                results=[P.LlmResult(seq=r.seq, status=0, tokens=[1, 1], first_token_s=0.001)
                                         for r in job.requests]), now + 0.05)


def test_an_llm_models_series_exist_from_its_engines_registration_and_each_generation_is_an_execution(
        llm_dispatcher):
    # Its series were born at its first request (a burst's count read as 0 by rate()), and
    # nv_inference_exec_count never had one: count / exec_count, the mean batch, was undefined.
    d = llm_dispatcher()
    _register_gpu_engine(d)
    m = _parse(d.render_metrics())
    for name in ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count"):
        assert [s for s in m if s.name == name and s.labels["model"] == "m" and s.labels["path"] == "gpu"], name
        assert total(m, name, model="m") == 0
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        assert [s for s in m if s.name == "nv_inference_request_failure" and s.labels["model"] == "m"
                and s.labels["reason"] == reason]
    _generate(d, 3)
    m = _parse(d.render_metrics())
    assert total(m, "nv_inference_request_success", model="m", path="gpu") == 3
    assert total(m, "nv_inference_exec_count", model="m", path="gpu") == 3  # one execution a generation
    assert total(m, "nv_inference_count", model="m") == 3


def test_an_llm_model_named_at_start_up_has_its_series_before_any_engine_registers(llm_dispatcher):
    d = llm_dispatcher(llm_models=("m",))
    m = _parse(d.render_metrics())
    assert len([s for s in m if s.name == "nv_inference_request_failure" and s.labels["model"] == "m"]) >= 4
    assert total(m, "nv_inference_request_failure", model="m") == 0


def test_metrics_carry_the_llm_decisions_and_curves_that_status_shows(llm_dispatcher):
    # `batchyard status` showed the llm_* decision counters and each LLM model's learned curves;
    # /metrics had neither.
    from batchyard import status_report

    d = llm_dispatcher()
    _register_gpu_engine(d)
    _generate(d, 2)
    st = status_report.status_reply(d, 1)
    m = _parse(d.render_metrics())
    assert st.decisions["llm_gpu"] == 2
    for reason, n in st.decisions.items():
        assert total(m, "batchyard_decisions_total", reason=reason) == n, reason
    llm = {k.rsplit("/", 1)[0]: v for k, v in st.curves.items() if k.endswith("/llm")}
    assert set(llm) == {"m"}
    for curve, c in llm["m"].items():
        assert total(m, "batchyard_llm_cost_launch_us", model="m", curve=curve) == pytest.approx(c["coef"][0] * 1e6)
        assert total(m, "batchyard_llm_cost_per_item_us", model="m", curve=curve) == pytest.approx(c["coef"][1] * 1e6)


def _registry_of(n_models: int, **metrics_args) -> tuple:
    m = Metrics(**metrics_args)
    for i in range(n_models):
        m.model_served(f"model_{i}")
        for path in ("cpu", "gpu"):
            m.model_served(f"model_{i}", path)
            m.request_ok(f"model_{i}", path, 1, 1, 100, 200, 400)
            m.batch_done(f"model_{i}", path)
    names = {f"model_{i}": 0 for i in range(n_models)}
    curves = {f"{k}/{p}": {"launch_us": 1.0, "per_item_us": 2.0} for k in names for p in ("cpu", "gpu")}
    return m, (names, {"cpu_now": 1}, curves, names, names)


def test_a_scrape_storm_takes_a_bounded_share_of_the_dispatchers_thread():
    # Each scrape rendered on the dispatcher's one thread (33 ms at 100 models): a scraper in a
    # loop held it all the time, and every client's round trip waited. The clocks are the test's:
    # a render takes 33 ms of them and the thread's other work 1 ms between two scrapes, so the
    # share does not depend on how loaded the machine running the test is (on a busy CI host the
    # wall-clock version of this test measured preemption, not the rule).
    from batchyard.metrics import RENDER_CREDIT_S, RENDER_SHARE

    now = [0.0]
    m = Metrics(clock=lambda: now[0], cpu_clock=lambda: now[0])
    _, state = _registry_of(0)
    m.model_served("model_0", "cpu")
    write = m._write

    def rendering_33_ms(s):
        now[0] += 0.033
        return write(s)

    m._write = rendering_33_ms
    spent, fresh_at, oldest = 0.0, 0.0, 0.0
    while now[0] < 10.0:
        m.request_ok("model_0", "cpu", 1, 1, 100, 200, 400)  # every scrape finds a count changed
        now[0] += 0.001
        t = now[0]
        text = m.render(*state)
        if now[0] > t:
            spent += now[0] - t
            fresh_at = now[0]
        oldest = max(oldest, now[0] - fresh_at)
        assert "nv_inference_request_success" in text
    assert spent / now[0] <= RENDER_SHARE + RENDER_CREDIT_S / now[0] + 1e-9
    # ...and the text a scrape gets is never long stale: one render's cost over the share, and a bit
    assert oldest < 0.033 / RENDER_SHARE + 0.05


def test_a_storm_of_scrapes_of_an_unchanged_text_takes_a_bounded_share_too():
    """Gathering and comparing the scrape's state went uncharged: at 100 models ~1.1 ms a scrape
    of an unchanged text, and a scraper in a loop took half of the thread (an outside review).
    Now they count in the share, and a scrape while it is spent asks the state nothing."""
    from batchyard.metrics import RENDER_CREDIT_S, RENDER_SHARE

    now = [0.0]
    m = Metrics(clock=lambda: now[0], cpu_clock=lambda: now[0])
    _, state = _registry_of(0)
    m.model_served("model_0", "cpu")
    asked = [0]

    def gathering_1_ms():
        asked[0] += 1
        now[0] += 0.001
        return (*state, None)

    text, scrapes = m.render_from(gathering_1_ms), 0
    while now[0] < 10.0:
        now[0] += 0.0002  # the scraper's next request, at once: the thread's other work between two
        assert m.render_from(gathering_1_ms) == text  # nothing changed
        scrapes += 1
    assert asked[0] * 0.001 / now[0] <= RENDER_SHARE + RENDER_CREDIT_S / now[0] + 1e-9
    assert scrapes > 10 * asked[0]


def test_a_render_the_host_preempted_does_not_make_the_next_scrapes_stale():
    # The render share was charged in wall-clock time: a render preempted for 200 ms on a busy
    # host spent the whole credit, and the scrapes of the next ~2 s got its text, counts missing.
    wall, cpu = [0.0], [0.0]
    m, state = _registry_of(1, clock=lambda: wall[0], cpu_clock=lambda: cpu[0])
    write = m._write

    def preempted(s):
        wall[0] += 0.2
        cpu[0] += 0.001
        return write(s)

    m._write = preempted
    before = total(_parse(m.render(*state)), "nv_inference_request_success", model="model_0")
    m.request_ok("model_0", "cpu", 1, 1, 100, 200, 400)
    wall[0] += 0.001
    assert total(_parse(m.render(*state)), "nv_inference_request_success", model="model_0") == before + 1


def test_an_occasional_scrape_shows_every_count_so_far():
    # Scrapes 15 s apart (Prometheus' default) on the test's clock: on the wall clock a loaded CI
    # host made the first render spend the credit, and the second scrape, at once, got its text.
    now = [0.0]
    m, state = _registry_of(100, clock=lambda: now[0])
    before = total(_parse(m.render(*state)), "nv_inference_request_success", model="model_7")
    m.request_ok("model_7", "gpu", 1, 1, 100, 200, 400)
    m.request_failed("model_7", Status.OVERLOADED, 1)
    now[0] += 15
    after = _parse(m.render(*state))
    assert total(after, "nv_inference_request_success", model="model_7") == before + 1
    assert total(after, "nv_inference_request_failure", model="model_7", reason="REJECTED") == 1
    state[0]["model_7"] = 5  # a queue grew, no counter moved
    now[0] += 15
    assert total(_parse(m.render(*state)), "nv_inference_pending_request_count", model="model_7") == 5


def test_a_metrics_port_in_use_stops_the_dispatcher_in_one_line_leaving_no_socket_files(run_dir):
    """Bound after the dispatcher had started (and said READY=1), a metrics port held by another
    program was a 20-line traceback, and the ipc socket files were left behind."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from batchyard.config import DispatcherConfig, NodeConfig, to_toml

    from conftest import ROOT, SUM_MODEL

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = NodeConfig(DispatcherConfig(frontend=f"ipc://{run_dir}/fe", backend=f"ipc://{run_dir}/be",
                                           metrics_port=port), (SUM_MODEL,), (sim_worker("w0", ("sum",)),)).validate()
        path = Path(run_dir) / "node.toml"
        path.write_text(to_toml(node))
        r = subprocess.run([sys.executable, "-m", "batchyard.cli", "dispatcher", "--config", str(path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"[dispatcher] metrics_port {port}: cannot listen on 127.0.0.1" in r.stderr, r.stderr
    assert sorted(os.listdir(run_dir)) == ["node.toml"]


def test_an_llm_curves_small_terms_keep_their_digits():
    """describe() rounded coefficients to nine decimals of a second: a GPU prefill's per-token^2
    term (4e-10 s) read 0 on /metrics and in status."""
    from batchyard import protocol as P
    from batchyard.llm_fit import LearnedCurves

    a, b, c2 = 5e-3, 2.8e-5, 4e-10
    lc = LearnedCurves()
    lc.seed_engine("gpu", [P.PrefillSample([n], a + b * n + c2 * n * n) for n in (128, 512, 1024, 2048, 4096, 8192)],
                   [(1, 0.004), (4, 0.0043)], source="g0")
    coef = lc.describe()["gpu_prefill"]["coef"]
    assert coef[2] == pytest.approx(c2, rel=1e-3)


def test_a_scrape_shows_a_curve_changed_in_place():
    """The text is re-used while nothing changed; the state it was made from was copied one level
    deep, so a curve's own dict changed in place still showed its old value."""
    m = Metrics()
    curves = {"m/cpu": {"launch_us": 10.0, "per_item_us": 1.0}}
    assert 'batchyard_cost_launch_us{model="m",path="cpu"} 10.0' in m.render({}, {}, curves, {})
    curves["m/cpu"]["launch_us"] = 99.0
    assert 'batchyard_cost_launch_us{model="m",path="cpu"} 99.0' in m.render({}, {}, curves, {})
