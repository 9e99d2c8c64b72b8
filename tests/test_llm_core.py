"""LLM mode's request lifecycle (dispatcher/llm_core.py) on a fake clock: routing, prefill jobs,
KV hand-off, completion, deadlines, lost workers, curves learned online. No vLLM, no sockets."""

from __future__ import annotations

import functools
import json
import random
import re

import msgspec
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from batchyard import protocol as P
from batchyard.llm_core import TOKEN_BUDGET, LlmCore
from batchyard.llm_routing import GPU, PREFILL_CPU, take_prefill_batch
from batchyard.protocol import Status

# calibrations shaped like the rule: the CPU starts at once but is slow per token,
# the GPU is fast per token (numbers chosen, not measured)
CPU = P.LlmEngine(model="m", role="prefill-cpu", block_size=32, max_model_len=2048, max_num_seqs=8,
                  prefill=[P.PrefillSample([32], 0.005), P.PrefillSample([512], 0.053),
                           P.PrefillSample([32, 32, 32, 32], 0.0146)])
GPU_ENGINE = P.LlmEngine(model="m", role="gpu", stand_in=True, block_size=32, max_model_len=2048, max_num_seqs=8,
                         prefill=[P.PrefillSample([32], 0.0103), P.PrefillSample([512], 0.0151)],
                         decode=[(1, 0.004), (4, 0.0043)])


class Harness:
    def __init__(self, cpu=True, gpu=True, **kw):
        self.failed: list = []
        self.core = LlmCore(lambda r, s, m, param="": self.failed.append((r.req_id, s, m)), **kw)
        self.now = 0.0
        self.ids = iter(range(1, 10**6))
        if cpu:
            self.core.add_worker("cpu0", b"cpu0", CPU, self.now)
        if gpu:
            self.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, self.now)

    def submit(self, tokens: int, max_tokens: int = 4, route: str = "", timeout_s: float = 30.0,
               sampling: P.Sampling = None):
        rid = next(self.ids)
        msg = P.GenerateRequest(v=1, id=rid, model="m", prompt=[7] * tokens, max_tokens=max_tokens, route=route,
                                timeout_us=int(timeout_s * 1e6), sampling=sampling)
        return rid, self.core.admit(msg, b"client", self.now)

    def jobs(self):
        return self.core.decide(self.now)

    def done(self, send, first_token_s=0.001, compute_s=0.01, status=Status.OK, kv_tokens=0):
        job = send.job
        results = [P.LlmResult(seq=s, status=int(status), tokens=[1] * (1 if job.kind == "prefill" else m),
                               first_token_s=first_token_s, kv_tokens=kv_tokens)
                   for s, m in zip(job.seqs, job.max_tokens)]
        return self.core.complete(P.LlmDone(job_id=job.job_id, worker=send.worker.name, compute_s=compute_s,
                                            results=results), self.now)


def test_idle_gpu_takes_a_short_prompt_and_the_reply_says_so():
    h = Harness()
    rid, why = h.submit(64)
    assert why is None
    [send] = h.jobs()
    assert send.worker.name == "gpu0" and send.job.kind == "generate" and send.job.kv_from == ""
    [f] = h.done(send)
    assert f.request.req_id == rid and f.timing.route == GPU and f.timing.stand_in
    assert f.timing.decode_worker == "gpu0" and not f.timing.prefill_worker


def test_busy_gpu_sends_short_prompts_to_the_cpu_then_their_kv_to_the_gpu():
    h = Harness()
    for _ in range(8):  # long prompts keep the GPU's prefill queue busy
        h.submit(1500, route=GPU)
    h.jobs()
    _, why = h.submit(48)
    assert why is None
    [prefill] = h.jobs()
    assert prefill.worker.name == "cpu0" and prefill.job.kind == "prefill" and prefill.job.max_tokens == [1]
    assert h.done(prefill) == []  # not finished: handed on
    [gen] = h.jobs()
    assert gen.worker.name == "gpu0" and gen.job.kv_from == "cpu0" and gen.job.prompts == [[7] * 48]
    # the gpu instance schedules it by its arrival at the dispatcher, ahead of later arrivals
    assert gen.job.order == prefill.job.order == prefill.job.seqs and gen.job.order[0] > 8
    [f] = h.done(gen, kv_tokens=32)
    assert f.timing.route == PREFILL_CPU and f.timing.prefill_worker == "cpu0" and f.timing.kv_tokens == 32
    assert f.timing.predicted_ttft_cpu_us < f.timing.predicted_ttft_gpu_us


def test_a_request_for_its_prompts_logprobs_takes_the_gpu_route_whose_prefill_computes_them():
    """An engine gives no logprobs of the prompt KV it loads: a short prompt the busy GPU would
    have sent to the CPU prefills on the GPU instead; forcing the CPU route with them is refused;
    a reply of more logprobs entries than the dispatcher decodes at once is refused up front."""
    h = Harness()
    for _ in range(8):  # long prompts keep the GPU's prefill queue busy
        h.submit(1500, route=GPU)
    h.jobs()
    _, why = h.submit(48, sampling=P.Sampling(prompt_logprobs=0))
    assert why is None
    [gen] = h.jobs()
    assert gen.worker.name == "gpu0" and gen.job.kind == "generate" and gen.job.kv_from == ""
    _, why = h.submit(48, route=PREFILL_CPU, sampling=P.Sampling(prompt_logprobs=1))
    assert why[0] == Status.INVALID_ARGUMENT and "prefill-cpu" in why[1]
    big = Harness(gpu=False)
    big.core.add_worker("gpu0", b"gpu0", msgspec.structs.replace(GPU_ENGINE, max_model_len=1 << 17), big.now)
    _, why = big.submit(13000, sampling=P.Sampling(prompt_logprobs=20))  # 12,999 x 21 entries
    assert why[0] == Status.INVALID_ARGUMENT and f"at most {P.MAX_LOGPROB_ENTRIES}" in why[1]
    _, why = big.submit(13000, sampling=P.Sampling(prompt_logprobs=19))  # 12,999 x 20
    assert why is None
    _, why = big.submit(10, max_tokens=13000, sampling=P.Sampling(logprobs=20))
    assert why[0] == Status.INVALID_ARGUMENT


def test_triton_generates_cumulative_logprob_is_the_float32_the_backend_writes():
    """The backend's cumulative_logprob is vLLM's float sum in a float32 tensor: so written, not
    the float64 sum (-0.1 three times: -0.30000001192092896, not -0.30000000447034836)."""
    from batchyard.llm_generate import BackendLogprobs
    from batchyard.openai_logprobs import TokenIds

    class Completions:
        def token_texts(self, model):
            return TokenIds()

    lp = BackendLogprobs(Completions(), "m", {"sampling": P.Sampling(logprobs=0), "return_cumulative_logprob": True})
    x = float(np.float32(-0.1))  # (a logprob from the engine: a float32's value)
    text, total = lp.of([[(5, x, 1)]] * 3)
    assert total == float(np.float32(x + x + x)) and total != x + x + x
    assert json.loads(text) == [{"5": {"logprob": x, "rank": 1, "decoded_token": "token_id:5"}}] * 3


def test_queued_prefills_go_as_jobs_sized_by_marginal_cost_one_job_at_a_time():
    h = Harness()
    for _ in range(5):
        h.submit(40, route=PREFILL_CPU)
    curve = h.core.curves["m"].prefill(PREFILL_CPU)
    expect = take_prefill_batch([40] * 5, curve, TOKEN_BUDGET)
    assert 1 < expect < 5  # the calibration makes a fixed cost worth sharing, not by all five
    [first] = h.jobs()
    assert first.job.kind == "prefill" and len(first.job.seqs) == expect
    assert h.jobs() == []  # the CPU instance is busy with the first job
    h.done(first)
    sends = h.jobs()
    assert sorted(s.job.kind for s in sends) == ["generate"] * expect + ["prefill"]
    assert all(s.job.kv_from == "cpu0" for s in sends if s.job.kind == "generate")


def test_forced_route_without_a_cpu_instance_is_refused_and_a_long_prompt_is_invalid():
    h = Harness(cpu=False)
    _, why = h.submit(40, route=PREFILL_CPU)
    assert why[0] == Status.UNAVAILABLE and "prefill-cpu" in why[1]
    _, why = h.submit(2040, max_tokens=16)
    assert why[0] == Status.INVALID_ARGUMENT and "max_model_len 2048" in why[1]
    no_gpu = Harness(gpu=False)
    _, why = no_gpu.submit(40)
    assert why[0] == Status.UNAVAILABLE and "'gpu'" in why[1]


def test_a_request_past_its_deadline_fails_once_and_its_late_result_is_dropped():
    h = Harness()
    rid, _ = h.submit(40, route=PREFILL_CPU, timeout_s=0.5)
    [prefill] = h.jobs()
    h.now = 0.6
    # The engine is told to stop it: left, it ran to its max_tokens for nobody, holding a slot
    # and KV blocks the requests behind it waited for.
    [abort] = h.jobs()
    assert abort.worker.name == "cpu0" and abort.job == P.LlmAbort(job_id=prefill.job.job_id, seqs=prefill.job.seqs)
    assert h.failed == [(rid, Status.DEADLINE_EXCEEDED, h.failed[0][2])]
    assert h.done(prefill) == [] and h.jobs() == []  # nothing handed on for a failed request
    assert len(h.failed) == 1 and h.core.next_wake() == float("inf")


def test_losing_the_cpu_instance_fails_its_job_and_reroutes_its_queue_to_the_gpu():
    h = Harness()
    running, _ = h.submit(40, route=PREFILL_CPU)
    h.jobs()
    queued, _ = h.submit(40, route=PREFILL_CPU)
    h.core.requests[max(h.core.requests)].forced = ""  # routed to the CPU, not forced there
    h.core.worker_lost("cpu0", "test", h.now)
    assert [(f[0], f[1]) for f in h.failed] == [(running, Status.UNAVAILABLE)]
    [gen] = h.jobs()
    assert gen.worker.name == "gpu0" and gen.job.kv_from == "" and gen.job.seqs
    [f] = h.done(gen)
    assert f.request.req_id == queued


def test_cpu_prefill_curve_follows_what_the_worker_measures():
    h = Harness()
    before = h.core.curves["m"].prefill(PREFILL_CPU).time(256)
    for _ in range(12):  # the machine got twice as slow as calibrated
        h.submit(256, route=PREFILL_CPU)
        [send] = h.jobs()
        h.done(send, compute_s=2 * before)
        h.core.decide(h.now)  # hand-offs
        for g in list(h.core.jobs.values()):
            h.core.complete(P.LlmDone(job_id=g.job_id, worker="gpu0", compute_s=0.02,
                                      results=[P.LlmResult(seq=g.requests[0].seq, status=0, tokens=[1, 1],
                                                           first_token_s=0.01)]), h.now)
    after = h.core.curves["m"].prefill(PREFILL_CPU).time(256)
    assert after == pytest.approx(2 * before, rel=0.25)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["submit", "decide", "done", "lose", "tick"]), st.integers(0, 10**6)),
                max_size=60))
@example([("submit", 0), ("submit", 0), ("done", 10), ("decide", 0), ("done", 0)])  # an llm_abort among the sends
def test_every_admitted_request_ends_exactly_once(ops):
    h = Harness()
    rng = random.Random(0)
    admitted, finished = set(), []
    for op, x in ops:
        if op == "submit":
            rid, why = h.submit(16 + x % 900, max_tokens=1 + x % 8, route=["", PREFILL_CPU, GPU][x % 3],
                                timeout_s=0.05 + (x % 7) / 10)
            if why is None:
                admitted.add(rid)
        elif op == "decide":
            # An llm_abort names requests already answered: their job still ends as the others do
            h.pending = getattr(h, "pending", []) + [s for s in h.jobs() if type(s.job) is P.LlmJob]
        elif op == "done" and getattr(h, "pending", None):
            send = h.pending.pop(rng.randrange(len(h.pending)))
            finished += [f.request.req_id for f in h.done(send)]
        elif op == "lose":
            name = ["cpu0", "gpu0"][x % 2]
            h.core.worker_lost(name, "test", h.now)
            h.core.add_worker(name, name.encode(), CPU if name == "cpu0" else GPU_ENGINE, h.now)
        else:
            h.now += (x % 100) / 200
    h.now += 100
    h.jobs()  # everything still open is past its deadline now
    ended = finished + [f[0] for f in h.failed]
    assert sorted(ended) == sorted(admitted), "each admitted request ends exactly once"


def test_an_answer_from_another_worker_leaves_the_job_to_its_own():
    """A done message naming a job of another worker (a stale one from before a dispatcher
    restart: job ids repeated) popped the job, so its own worker's answer was ignored and the
    request waited for its deadline."""
    h = Harness()
    rid, _ = h.submit(64)
    [send] = h.jobs()
    job = send.job
    stray = P.LlmDone(job_id=job.job_id, worker="cpu0", compute_s=0.01,
                      results=[P.LlmResult(seq=s, status=int(Status.OK), tokens=[9], first_token_s=0.001, kv_tokens=0)
                               for s in job.seqs])
    assert h.core.complete(stray, h.now) == []
    [f] = h.done(send)
    assert f.request.req_id == rid and not h.failed


def test_the_same_worker_registering_again_keeps_its_jobs_and_its_calibration_once():
    """A registration retry of a live worker (sent while an engine step outlasted the retry
    period, or queued while the dispatcher was down) was taken for a restart: its running
    requests failed UNAVAILABLE and their answers were dropped, and its calibration samples were
    added again each time (1000 registrations: 2000 seed rows, outweighing what was learnt)."""
    h = Harness()
    rid, _ = h.submit(64)
    [send] = h.jobs()
    for _ in range(50):
        assert h.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, h.now) == []
    assert not h.failed
    [f] = h.done(send)
    assert f.request.req_id == rid
    h.core.add_worker("gpu0", b"gpu0-restarted", GPU_ENGINE, h.now, pid=2)  # a real restart re-seeds
    assert sum(len(rows) for rows in h.core.curves["m"].gpu_prefill.seed.values()) == len(GPU_ENGINE.prefill)


def test_a_generate_request_cancelled_while_waiting_for_a_cpu_prefill_does_not_run():
    """The client's cancel reached only the tensor requests: a cancelled generate request ran."""
    h = Harness()
    running, _ = h.submit(40, route=PREFILL_CPU)
    h.jobs()
    queued, _ = h.submit(40, route=PREFILL_CPU)
    assert h.core.cancel(b"client", queued)
    assert h.failed == [(queued, Status.CANCELLED, "cancelled by the client while queued")]
    assert not h.core.cancel(b"client", queued)
    assert h.jobs() == []
    # One a job runs is stopped in its engine (it ran on, for nobody).
    assert h.core.cancel(b"client", running) and not h.core.cancel(b"client", running)
    assert h.failed[-1] == (running, Status.CANCELLED, "cancelled by the client while it ran")
    [abort] = h.jobs()
    assert type(abort.job) is P.LlmAbort and abort.worker.name == "cpu0"


def test_a_worker_whose_connection_is_gone_leaves_rotation_at_the_first_job_sent_there():
    """The send's failure was swallowed: the job was lost unsaid, and routing kept choosing the
    worker until its heartbeats were missed (about 10 s), each request sent there failing then."""
    from batchyard.llm_server import LlmDesk

    replies = []
    desk = LlmDesk(lambda identity, header: identity != b"gpu0", lambda c, h: replies.append(h), 30.0, 1.0, 10.0)
    desk.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 0.0)
    msg = P.GenerateRequest(v=1, id=1, model="m", prompt=[7] * 64, max_tokens=4, timeout_us=30_000_000)
    desk.on_generate(msg, b"client", 0.0, lambda m: "")
    assert desk.decide(0.0) == 1
    assert "gpu0" not in desk.core.workers and len(replies) == 1


@pytest.mark.parametrize("route", ["", PREFILL_CPU])
def test_a_prefill_job_that_never_reached_its_lost_engine_is_routed_again_not_failed_as_lost(route):
    """A job sent to a CPU engine whose connection was gone never ran: its request failed
    UNAVAILABLE "lost while running this request", the GPU instance up (live: one of three
    auto-routed prompts sent just after the CPU engine was killed; the two still queued moved to
    the GPU). Now it goes to the GPU, or, where it forced the CPU route, is refused as a request
    admitted now is."""
    from batchyard.llm_server import LlmDesk

    replies = []
    desk = LlmDesk(lambda identity, header: identity != b"cpu0", lambda c, h: replies.append(h), 30.0, 1.0, 10.0)
    desk.core.add_worker("cpu0", b"cpu0", CPU, 0.0)
    desk.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 0.0)
    sent = []
    desk._send_worker = lambda identity, header, send=desk._send_worker: (
        sent.append((identity, msgspec.msgpack.decode(header))) or send(identity, header))
    msg = P.GenerateRequest(v=1, id=1, model="m", prompt=[7] * 48, max_tokens=4, timeout_us=30_000_000,
                            route=route or PREFILL_CPU)
    desk.on_generate(msg, b"client", 0.0, lambda m: "")
    if not route:
        desk.core.requests[next(iter(desk.core.requests))].forced = ""  # routed to the CPU, not forced there
    assert desk.decide(0.0) == 1 and "cpu0" not in desk.core.workers
    if route:
        [reply] = [msgspec.msgpack.decode(r) for r in replies]
        assert reply["status"] == Status.UNAVAILABLE
        assert reply["message"] == "route 'prefill-cpu' asked, but no prefill-cpu instance of 'm' is up"
    else:
        assert replies == []
        assert [(identity, m["kind"]) for identity, m in sent] == [(b"cpu0", "prefill"), (b"gpu0", "generate")]
        assert sent[-1][1].get("kv_from", "") == ""


def test_every_job_of_one_decision_for_a_lost_engine_is_routed_again():
    """Two jobs for a GPU instance whose connection was gone, in one decision: the first one's
    failed send took the instance out of rotation, which failed the second as "lost while
    running", though it never left the dispatcher, the other GPU instance up."""
    from batchyard.llm_server import LlmDesk

    replies, sent = [], []
    desk = LlmDesk(lambda identity, header: sent.append(identity) or identity != b"gpu0",
                   lambda c, h: replies.append(h), 30.0, 1.0, 10.0)
    desk.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 0.0)
    desk.core.add_worker("gpu1", b"gpu1", GPU_ENGINE, 0.0)
    for i, n in enumerate([64, 1500, 64, 64], 1):
        desk.on_generate(P.GenerateRequest(v=1, id=i, model="m", prompt=[7] * n, max_tokens=4,
                                           timeout_us=30_000_000), b"client", 0.0, lambda m: "")
    assert len(desk.core.workers["gpu0"].jobs) == 2
    assert desk.decide(0.0) == 1
    assert replies == [] and sorted(r.req_id for r in desk.core.requests.values()) == [1, 2, 3, 4]
    assert sent.count(b"gpu0") == 1 and all(len(j.requests) == 1 for j in desk.core.workers["gpu1"].jobs.values())
    assert len(desk.core.workers["gpu1"].jobs) == 4


def test_a_request_that_forced_the_cpu_route_is_refused_when_the_last_cpu_instance_goes_not_served_on_the_gpu():
    """Queued for the CPU instance when it went, a request that forced route prefill-cpu was
    served on the GPU and answered OK with route "gpu": a client comparing the paths got the
    other one's answer. Admitted now, it is refused; so it is when the instance goes."""
    h = Harness()
    h.submit(40, route=PREFILL_CPU)
    h.jobs()
    forced, _ = h.submit(40, route=PREFILL_CPU)
    h.core.requests[max(h.core.requests)].forced = PREFILL_CPU
    h.core.worker_lost("cpu0", "test", h.now)
    assert (forced, Status.UNAVAILABLE, "route 'prefill-cpu' asked, but no prefill-cpu instance of 'm' is up") in h.failed
    assert h.jobs() == [] and h.core.next_wake() == float("inf")


@pytest.mark.parametrize("key, value", [("truncate_prompt_tokens", 2), ("suffix", "x"), ("logit_bias", {"six": -100}),
                                        ("presence_penalty", 2.5), ("frequency_penalty", "1"),
                                        ("temperature", False), ("n", True), ("best_of", True)])
def test_openai_fields_that_would_change_the_answer_are_refused_not_ignored(key, value):
    """Taken and ignored, a stop sequence answered 200 with the very text asked to stop at (and
    booleans, equal to 0 and 1, passed for a temperature of 0 and n of 1)."""
    from batchyard.openai_fields import OpenAiError, check_supported

    with pytest.raises(OpenAiError) as e:
        check_supported({key: value}, {})
    assert e.value.status == 400 and e.value.param == key
    check_supported({key: {"truncate_prompt_tokens": None, "suffix": None, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0,
                            "temperature": 0, "n": 1, "best_of": 1}[key]}, {})  # the defaults pass


def test_a_model_folders_sampling_defaults_are_read_as_vllms_server_reads_them(tmp_path):
    """generation_config.json's sampling fields (null: not given) and max_new_tokens, as vLLM
    0.32 with transformers 5 reads them (checked against its get_diff_sampling_param on these
    files); config.json's are not taken, a file that is no JSON gives nothing, and JSON that
    is no object is refused (vLLM does not start on it)."""
    from batchyard.llm_model_files import GenerationDefaults, generation_defaults

    assert generation_defaults(tmp_path) == GenerationDefaults()  # no file
    (tmp_path / "config.json").write_text(json.dumps({"temperature": 0.5, "top_p": 0.9}))
    assert generation_defaults(tmp_path) == GenerationDefaults()
    gc = tmp_path / "generation_config.json"
    gc.write_text(json.dumps({"temperature": 1, "top_k": 20, "top_p": None, "min_p": 0.05, "presence_penalty": 0.5,
                              "repetition_penalty": 1.05, "do_sample": True, "max_new_tokens": 64, "eos_token_id": 2}))
    got = generation_defaults(tmp_path)
    assert got == GenerationDefaults({"temperature": 1.0, "top_k": 20, "min_p": 0.05, "presence_penalty": 0.5,
                                      "repetition_penalty": 1.05}, 64)
    assert type(got.sampling["temperature"]) is float
    for text in ("{", ""):  # no JSON: nothing, as vLLM reads it
        gc.write_text(text)
        assert generation_defaults(tmp_path) == GenerationDefaults()
    for fields, words in (({"top_k": -2}, "$.top_k"), ({"temperature": "0.5"}, "$.temperature"),
                          ({"max_new_tokens": True}, "max_new_tokens"), ([1], "not a JSON object")):
        gc.write_text(json.dumps(fields))
        with pytest.raises(ValueError, match=re.escape(words)):
            generation_defaults(tmp_path)


def test_an_openai_request_takes_each_field_it_leaves_out_from_the_model_then_vllm():
    from batchyard.openai_fields import OpenAiError, check_supported

    assert check_supported({}, {}) == (P.Sampling(temperature=1.0), 1)  # vLLM samples at 1
    model = {"temperature": 0.7, "top_k": 20}
    assert check_supported({"top_p": 0.5, "top_k": None, "n": 2}, model) == (
        P.Sampling(temperature=0.7, top_k=20, top_p=0.5), 2)
    assert check_supported({"temperature": 0}, model)[0] == P.Sampling(temperature=0.0, top_k=20)  # greedy
    with pytest.raises(OpenAiError, match="needs a temperature above 0"):
        check_supported({"temperature": 0, "n": 2}, model)


def test_generate_requests_are_counted_in_the_metrics_as_tensor_requests_are():
    """Triton's families had no sample for an LLM model, however many requests it served or
    failed; a request for a model not served added a series under the client's name."""
    from prometheus_client.parser import text_string_to_metric_families

    from batchyard.bench.harness import sample_total as total
    from batchyard.llm_server import LlmDesk
    from batchyard.metrics import Metrics

    metrics, sent = Metrics(), []
    desk = LlmDesk(lambda identity, header: sent.append(header) or True, lambda c, h: None, 30.0, 1.0, 10.0, metrics)
    desk.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 0.0)
    for rid in (1, 2):
        desk.on_generate(P.GenerateRequest(v=1, id=rid, model="m", prompt=[7] * 64, max_tokens=2, priority=2,
                                           timeout_us=1_000_000), b"client", 0.0, lambda m: "")
    desk.on_generate(P.GenerateRequest(v=1, id=3, model="ghost", prompt=[7], max_tokens=2), b"client", 0.0,
                     lambda m: "unknown")
    desk.decide(0.0)
    first = next(iter(desk.core.jobs.values()))
    desk.on_done(P.LlmDone(job_id=first.job_id, worker="gpu0", compute_s=0.01,
                           results=[P.LlmResult(seq=r.seq, status=0, tokens=[1, 1], first_token_s=0.001)
                                    for r in first.requests]), 0.5)
    desk.decide(2.0)  # the other passed its deadline
    samples = [s for fam in text_string_to_metric_families(metrics.render(
        desk.pending(), {}, {}, {}, desk.in_flight())) for s in fam.samples]
    assert total(samples, "nv_inference_request_success", model="m", priority="low", path="gpu") == 1
    assert total(samples, "nv_inference_count", model="m") == 1
    assert total(samples, "nv_inference_request_failure", model="m", reason="REJECTED") == 1
    assert total(samples, "batchyard_unknown_model_requests_total") == 1
    assert not [s for s in samples if s.labels.get("model") == "ghost"]


def test_an_engine_stuck_past_its_requests_deadlines_is_declared_hung_and_told_to_restart():
    # Its heartbeats come from a thread of their own and kept coming: the stuck engine stayed in
    # rotation and every request routed to it ran out its deadline.
    h = Harness(cpu=False, worker_dead_after_s=10.0)
    rid, _ = h.submit(64, timeout_s=2.0)
    [send] = h.jobs()
    for t in (1.0, 5.0, 11.0, 11.9):
        h.now = t
        h.core.heartbeat("gpu0", t)
        h.jobs()  # the deadline passes at 2 s: answered, the abort sent, never acknowledged
        assert h.core.check_liveness(t) == []
    assert [f[:2] for f in h.failed] == [(rid, Status.DEADLINE_EXCEEDED)]
    h.now = 12.1
    h.core.heartbeat("gpu0", h.now)
    [(name, reason, failed)] = h.core.check_liveness(h.now)
    assert name == "gpu0" and "never came back" in reason and failed == []
    assert "gpu0" in h.core.hung and "gpu0" not in h.core.workers
    # a fresh process of it registers: in rotation again, no restart asked any more
    h.core.add_worker("gpu0", b"gpu0-new", GPU_ENGINE, h.now, pid=2)
    assert "gpu0" not in h.core.hung
    _, why = h.submit(64)
    assert why is None and [s.worker.name for s in h.jobs()] == ["gpu0"]


def test_an_engine_that_acknowledges_its_aborts_stays_in_rotation():
    h = Harness(cpu=False, worker_dead_after_s=10.0)
    h.submit(64, timeout_s=2.0)
    [send] = h.jobs()
    h.now = 2.5
    [abort] = h.jobs()
    assert type(abort.job) is P.LlmAbort
    h.core.complete(P.LlmDone(job_id=send.job.job_id, worker="gpu0", compute_s=2.5, results=[
        P.LlmResult(seq=send.job.seqs[0], status=int(Status.CANCELLED))]), h.now)
    h.now = 30.0
    h.core.heartbeat("gpu0", h.now)
    assert h.core.check_liveness(h.now) == [] and "gpu0" in h.core.workers


def test_a_prompt_with_no_whole_block_to_move_is_prefilled_on_the_gpu_even_when_it_is_busy():
    # Prefilled on the CPU, no KV moved (only whole blocks do, never the last token): the GPU
    # computed the whole prompt again, after the CPU's work and the hand-off.
    h = Harness()
    for _ in range(8):
        h.submit(1500, route=GPU)
    h.jobs()
    _, why = h.submit(48)  # one whole block moves: the busy GPU's queue is worth skipping
    assert why is None and [s.job.kind for s in h.jobs()] == ["prefill"]
    for n in (20, 32, 33):
        h.submit(n)
    assert [s.worker.name for s in h.jobs()] == ["gpu0", "gpu0"]
    assert [len(r.prompt) for r in h.core.cpu_queue["m"]] == [33]  # behind the CPU's job in hand


def test_an_engine_in_a_step_predicted_long_is_not_declared_hung_before_it_could_end():
    # A long prefill on the CPU, predicted to end well after its request's deadline: the abort
    # is seen only after the step, and the engine was declared hung before it could have ended.
    h = Harness(worker_dead_after_s=1.0)
    h.submit(1900, route=PREFILL_CPU, timeout_s=0.05)
    [prefill] = h.jobs()
    end = prefill.worker.busy_until
    assert end > 0.15
    h.now = 0.1
    h.jobs()  # the deadline passed: answered, the abort sent
    for t in (1.06, end + 0.99):
        h.core.heartbeat("cpu0", t)
        h.core.heartbeat("gpu0", t)
        assert h.core.check_liveness(t) == [], t
    t = end + 1.01
    h.core.heartbeat("cpu0", t)
    h.core.heartbeat("gpu0", t)
    assert [name for name, _, _ in h.core.check_liveness(t)] == ["cpu0"]


def test_a_new_request_goes_to_the_gpu_instance_running_fewer_streams_when_both_are_idle():
    # Their predicted prefill ends, both past, were compared as they were: the instance whose
    # last prefill ended earlier took every new request however many streams it was decoding.
    h = Harness(cpu=False)
    h.core.add_worker("gpu1", b"gpu1", GPU_ENGINE, h.now)
    for _ in range(12):
        h.submit(64, max_tokens=1900, route=GPU)
    first = h.jobs()
    assert {s.worker.name for s in first} == {"gpu0", "gpu1"}
    h.now = 5.0
    quiet = first[-1].worker.name
    for s in first:
        if s.worker.name == quiet:  # its streams ended early; the other instance's keep decoding
            h.done(s)
    busy = "gpu0" if quiet == "gpu1" else "gpu1"
    streams = len(h.core.workers[busy].jobs)
    assert streams == 6 and not h.core.workers[quiet].jobs
    placed = []
    for _ in range(12):
        h.now += 0.5
        h.submit(64, max_tokens=1900, route=GPU)
        placed += [s.worker.name for s in h.jobs()]
    assert placed[:streams] == [quiet] * streams  # it catches up, then they take turns
    assert len(h.core.workers[quiet].jobs) == len(h.core.workers[busy].jobs) == 9


def test_requests_served_behind_a_long_open_one_do_not_pile_up_in_the_deadline_heap():
    # Only ended entries at the heap's top were dropped: behind one long generation with a later
    # deadline, every request served kept its entry until its own deadline (200,000 of them
    # held 30 MiB).
    h = Harness(cpu=False)
    h.submit(8, max_tokens=1024, timeout_s=3600)
    h.jobs()
    for _ in range(2000):
        h.submit(8, timeout_s=3600)
        [send] = h.jobs()
        [_] = h.done(send)
        h.now += 0.001
        h.core.next_wake()
    assert len(h.core.requests) == 1
    assert len(h.core._deadlines) <= 2 * len(h.core.requests) + 65
    assert h.core.next_wake() == pytest.approx(3600.0)  # the open one's deadline is kept


def test_while_draining_an_unknown_model_is_counted_as_unknown_not_under_its_name():
    """Refused for the drain first, each name a client sent became a failure series of its own."""
    from prometheus_client.parser import text_string_to_metric_families

    from batchyard.bench.harness import sample_total as total
    from batchyard.llm_server import LlmDesk
    from batchyard.metrics import Metrics

    metrics, replies = Metrics(), []
    desk = LlmDesk(lambda identity, header: True, lambda c, h: replies.append(h), 30.0, 1.0, 10.0, metrics)
    desk.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 0.0)
    desk.core.begin_drain()
    for rid in range(3):
        desk.on_generate(P.GenerateRequest(v=1, id=rid, model=f"junk-{rid}", prompt=[7], max_tokens=1), b"client",
                         0.0, lambda m: f"unknown model {m!r}")
    desk.on_generate(P.GenerateRequest(v=1, id=9, model="m", prompt=[7], max_tokens=1), b"client", 0.0,
                     lambda m: "")
    answers = [P.reply_decoder.decode(r) for r in replies]
    assert [a.status for a in answers] == [Status.UNKNOWN_MODEL] * 3 + [Status.UNAVAILABLE]
    assert "junk-0" in answers[0].message and "shutting down" in answers[3].message
    samples = [s for fam in text_string_to_metric_families(metrics.render(
        desk.pending(), {}, {}, {}, desk.in_flight())) for s in fam.samples]
    assert total(samples, "batchyard_unknown_model_requests_total") == 3
    assert not [s for s in samples if s.labels.get("model", "").startswith("junk")]
    assert total(samples, "nv_inference_request_failure", model="m") == 1


class _Generated(list):
    timing = P.LlmTiming(ttft_us=1, total_us=2, route="gpu", decode_worker="gpu0")
    finish_reason = "length"
    logprobs: list = []
    prompt_logprobs: list = []


class _FakeClient:
    """The SDK's AsyncClient as the front door uses it: records what it is asked to generate."""

    def __init__(self):
        self.asked: list = []

    async def generate(self, model, prompt, max_tokens=16, *, priority="normal", timeout=None, route="",
                       on_tokens=None, ignore_eos=False, sampling=None):
        self.asked.append((model, list(prompt), max_tokens))
        return _Generated([5] * max_tokens)


class _Encoding:
    def __init__(self, ids):
        self.ids = ids


class _ProseTokenizer:
    """Stands in for tokenizer.json: 4 characters a token, as prose; records the text handed to it."""

    def __init__(self):
        self.handed: list = []

    def encode_batch(self, texts, add_special_tokens=True):
        self.handed.append(sum(map(len, texts)))
        return [_Encoding([1] * max(1, len(t) // 4)) for t in texts]

    def decode(self, ids, skip_special_tokens=True):
        return "x" * len(ids)


def _openai_calls(bodies: list, client=None, stopping=lambda: False,
                  models: tuple = ("m",)) -> tuple[list, _FakeClient, _ProseTokenizer]:
    """Each body POSTed to /v1/completions of a front door serving model "m" (and ``models``'
    others): [(status, json)]."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from batchyard.http_body import BODY_STALL_S
    from batchyard.openai_http import OpenAiCompletions

    client, tok = client or _FakeClient(), _ProseTokenizer()
    oa = OpenAiCompletions(client, {m: "/nonexistent" for m in models}, stopping=stopping)
    oa._tokenizers["m"] = tok

    async def run():
        app = web.Application(client_max_size=1 << 26)
        app[BODY_STALL_S] = 10.0
        app.add_routes(oa.routes())
        out = []
        async with TestClient(TestServer(app)) as c:
            for body in bodies:
                r = await c.post("/v1/completions", json=body)
                out.append((r.status, await r.json()))
        return out

    return asyncio.run(run()), client, tok


def test_an_openai_completion_the_front_doors_stop_cuts_off_is_unavailable_not_cancelled_by_its_client():
    """The stop fails what still waits on the node (its client closed): answered 499, "request
    cancelled", as if the caller had gone; it is 503, the server's."""
    from batchyard.errors import Cancelled

    class ClosedByTheStop(_FakeClient):
        async def generate(self, *args, **kw):
            raise Cancelled("client closed")

    [(status, body)], _, _ = _openai_calls([{"model": "m", "prompt": "hi"}], ClosedByTheStop(), lambda: True)
    assert status == 503 and "the server is stopping" in body["error"]["message"], body


def test_openai_text_past_what_the_token_limit_allows_is_refused_before_it_is_tokenized():
    # Each prompt was bounded at 32 characters a token, the request not at all: a list of them
    # handed 63 MB to the tokenizer (GBs of memory, a minute of CPU) before the token limit said no.
    from batchyard.protocol import MAX_PROMPT_TOKENS

    prose = "a b " * (MAX_PROMPT_TOKENS - 64)  # within the token limit at 4 characters a token
    many = ["a b " * (MAX_PROMPT_TOKENS * 3 // 4)] * 4  # 3 characters a token each, 12 together
    outs, client, tok = _openai_calls([{"model": "m", "prompt": prose, "max_tokens": 1},
                                       {"model": "m", "prompt": "a" * (8 * MAX_PROMPT_TOKENS + 1)},
                                       {"model": "m", "prompt": many}])
    assert outs[0][0] == 200 and tok.handed[0] == len(prose) and len(client.asked[0][1]) == len(prose) // 4
    for status, out in outs[1:]:
        assert status == 400 and out["error"]["param"] == "prompt", out
        assert f"{MAX_PROMPT_TOKENS} a prompt may have" in out["error"]["message"]
    assert "4 prompts" in outs[2][1]["error"]["message"]
    assert len(tok.handed) == 1  # neither refused text was tokenized


def test_openai_statuses_for_a_missing_model_and_a_null_max_tokens_are_openais():
    # No model named is the server's only one, as vLLM's server takes it (a 400 before)
    outs, client, _ = _openai_calls([{"prompt": [1, 2]}, {"model": 7, "prompt": [1, 2]},
                                     {"model": "nope", "prompt": [1, 2]},
                                     {"model": "m", "prompt": [1, 2], "max_tokens": None}])
    status, out = outs[1]
    assert status == 400 and out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == "model"
    status, out = outs[2]
    assert status == 404 and out["error"]["code"] == "model_not_found" and "nope" in out["error"]["message"]
    assert outs[0][0] == 200 and outs[3][0] == 200, outs
    assert client.asked == [("m", [1, 2], 16)] * 2 and outs[3][1]["usage"]["completion_tokens"] == 16
    # Where the server has several, one must be named
    outs, client, _ = _openai_calls([{"prompt": [1, 2]}], models=("m", "m2"))
    status, out = outs[0]
    assert status == 400 and out["error"]["param"] == "model" and "required" in out["error"]["message"], out
    assert client.asked == []


@pytest.mark.parametrize("case", ["configured, no engine yet", "every engine lost"])
def test_a_known_model_with_no_engine_up_is_unavailable_not_unknown(case):
    """With no engine of a configured model up (still loading, or lost and restarting), every
    request was UNKNOWN_MODEL (the front door's 404 "model_not_found") while /v1/models listed
    the model: a permanent-looking error for a passing state."""
    if case == "configured, no engine yet":
        h = Harness(cpu=False, gpu=False, models=("m",))
    else:
        h = Harness(models=("m",))
        for name in ("cpu0", "gpu0"):
            h.core.worker_lost(name, "test", h.now)
    _, why = h.submit(32)
    assert why[0] == Status.UNAVAILABLE and "no 'gpu' LLM instance of 'm' is up" in why[1]
    assert h.core.admit(P.GenerateRequest(v=1, id=99, model="nope", prompt=[7], max_tokens=1), b"client",
                        h.now) == (Status.UNKNOWN_MODEL, "")


def test_a_model_only_a_departed_engine_named_is_forgotten():
    """An engine of a model the config does not name (a stray one of an old config) counts
    while it is up; kept after it left, the model held the node's strict readiness down."""
    h = Harness(cpu=False, gpu=False, models=("m",))
    h.core.add_worker("old0", b"old0", msgspec.structs.replace(GPU_ENGINE, model="old"), h.now)
    assert h.core.models() == {"m", "old"}
    h.core.worker_lost("old0", "test", h.now)
    assert h.core.models() == {"m"}


def test_requests_answered_at_the_end_of_a_drain_are_stopped_in_their_engine():
    """The drain's end answered running generations UNAVAILABLE but never aborted them: an
    engine that outlives the dispatcher (a separate unit, or one that registers with the next
    dispatcher) decoded them to max_tokens for nobody."""
    h = Harness(cpu=False)
    rid, why = h.submit(32, max_tokens=64)
    assert why is None
    [send] = h.jobs()
    h.core.begin_drain()
    h.core.fail_all(Status.UNAVAILABLE, "dispatcher shut down before the request finished")
    assert [r for r, s, _ in h.failed] == [rid]
    aborts = [s.job for s in h.jobs() if isinstance(s.job, P.LlmAbort)]
    assert [(a.job_id, a.seqs) for a in aborts] == [(send.job.job_id, send.job.seqs)]


def test_max_queue_bounds_a_models_open_generations():
    """[dispatcher] max_queue bounded the tensor path only: 200 generations sent at once to a
    node of max_queue 5 were all taken. The sixth open one is OVERLOADED; one that ends makes room."""
    h = Harness(max_queue=5)
    for _ in range(5):
        assert h.submit(64, route="prefill-cpu")[1] is None
    assert h.submit(64)[1] == (Status.OVERLOADED, "queue for 'm' is full (5 requests)")
    h.core.fail_all(Status.UNAVAILABLE, "drained")  # every open one ends
    assert h.submit(64)[1] is None


def test_an_engine_restarted_with_the_same_pid_is_a_new_registration():
    """pid 1 in its container: the restarted engine has the old one's pid and identity but a new
    connection (on ipc; over tcp the same address) and a new start token. Taken for a retry of the
    old registration, its jobs' loss went unseen and its own messages were dropped as another
    connection's."""
    h = Harness(cpu=False, gpu=False)
    h.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 0.0, pid=1, peer="conn-1")
    assert h.submit(64)[1] is None
    (send,) = h.jobs()
    assert h.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 1.0, pid=1, peer="conn-1") == []  # a retry
    lost = h.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 2.0, pid=1, peer="conn-2")  # a restart
    assert [r.req_id for r in lost] == [1] and h.core.workers["gpu0"].peer == "conn-2"
    # Over tcp the peer is the address alone, the same after a restart: the start token tells.
    h.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 3.0, pid=1, peer="10.0.0.7", started="a1")
    assert h.submit(64)[1] is None
    h.jobs()
    assert h.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 4.0, pid=1, peer="10.0.0.7", started="a1") == []
    lost = h.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 5.0, pid=1, peer="10.0.0.7", started="b2")
    assert [r.req_id for r in lost] == [2]


def test_a_streamed_requests_tokens_reach_its_client_only_while_its_own_generate_job_runs_it():
    """The dispatcher passes a streamed request's decoded tokens on to its client: not a
    request that did not ask to stream, not from a worker that does not run the job (one
    declared lost, or a stray), not a prefill job's, and not once the request was answered."""
    from batchyard.llm_server import LlmDesk

    sent, replies = [], []
    desk = LlmDesk(lambda identity, header: sent.append(header) or True,
                   lambda client, header: replies.append((client, P.reply_decoder.decode(header))), 30.0, 1.0, 10.0)
    desk.core.add_worker("cpu0", b"cpu0", CPU, 0.0)
    desk.core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 0.0)
    for rid, stream, route in ((1, True, "prefill-cpu"), (2, False, "gpu"), (3, True, "gpu")):
        desk.on_generate(P.GenerateRequest(v=1, id=rid, model="m", prompt=[7] * 64, max_tokens=4, route=route,
                                           stream=stream, timeout_us=1_000_000), b"c%d" % rid, 0.0, lambda m: "")
    desk.decide(0.0)
    jobs = {r.req_id: job for job in desk.core.jobs.values() for r in job.requests}
    asked = sorted((m.kind, m.seqs[0] == jobs[3].requests[0].seq, m.stream)
                   for m in map(P.to_worker_decoder.decode, sent))
    assert asked == [("generate", False, False), ("generate", True, True), ("prefill", False, False)]
    prefill, plain, streamed = jobs[1], jobs[2], jobs[3]
    seq = {rid: job.requests[0].seq for rid, job in jobs.items()}
    desk.on_tokens(P.LlmTokens(job_id=prefill.job_id, worker="cpu0", seq=seq[1], start=0, tokens=[5]))  # a prefill's
    desk.on_tokens(P.LlmTokens(job_id=plain.job_id, worker="gpu0", seq=seq[2], start=0, tokens=[5]))  # not streamed
    desk.on_tokens(P.LlmTokens(job_id=streamed.job_id, worker="cpu0", seq=seq[3], start=0, tokens=[5]))  # not its worker
    assert replies == []
    desk.on_tokens(P.LlmTokens(job_id=streamed.job_id, worker="gpu0", seq=seq[3], start=0, tokens=[5, 6]))
    assert replies == [(b"c3", P.GenerateTokens(v=1, id=3, start=0, tokens=[5, 6]))]
    # answered (its deadline): the engine's next tokens go nowhere, and no second reply comes
    desk.decide(2.0)
    assert [(c, type(m).__name__, m.status) for c, m in replies[1:]] == [
        (b"c1", "GenerateReply", Status.DEADLINE_EXCEEDED), (b"c2", "GenerateReply", Status.DEADLINE_EXCEEDED),
        (b"c3", "GenerateReply", Status.DEADLINE_EXCEEDED)]
    desk.on_tokens(P.LlmTokens(job_id=streamed.job_id, worker="gpu0", seq=seq[3], start=0, tokens=[7]))
    assert len(replies) == 4


@given(st.text(alphabet="abc", min_size=1, max_size=30), st.lists(st.text(alphabet="abc", min_size=1, max_size=3),
                                                                   min_size=1, max_size=3),
       st.lists(st.integers(1, 4), min_size=30, max_size=30), st.booleans(), st.sampled_from([0, 0, 1, 3, 8]))
@settings(max_examples=400, deadline=None)
def test_a_text_stream_ends_at_the_first_stop_string_as_vllm_finds_it(text, stops, steps, include, min_tokens):
    """Characters pushed a few at a time (one token a character): the pieces joined are the text
    cut before the stop string that ends first (then the first listed), or after it with
    ``include`` (vLLM's include_stop_str_in_output), wherever the steps split it. Under vLLM's
    ``min_tokens``, only a stop string that ends past the first min_tokens tokens counts."""
    from batchyard.llm_text import TextStream

    tokens = [ord(c) for c in text]
    stream = TextStream(lambda t: "".join(map(chr, t)), tuple(stops), include, min_tokens)
    pieces, at = [], 0
    for n in steps:
        if at >= len(tokens) or stream.stopped:
            break
        pieces.append(stream.push(tokens[at:at + n]))
        at += n
    pieces.append(stream.finish(tokens))
    found = [(text.find(s, max(0, min_tokens - len(s) + 1)), i, s) for i, s in enumerate(stops)]
    hits = sorted((start + len(s), i, start, s) for start, i, s in found if start >= 0)
    if hits:
        end, _, start, stop = hits[0]
        assert "".join(pieces) == text[:end if include else start] and (stream.stopped, stream.stop_at) == (stop, start)
    else:
        assert "".join(pieces) == text and not stream.stopped


@functools.lru_cache(maxsize=None)
def _trained_tokenizer(kind: str):
    """A small tokenizer of SentencePiece's kind (Metaspace: a word's first piece holds its
    space) or of GPT-2's (byte-level: a character of several UTF-8 bytes spans tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "metaspace":
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        alphabet = []
    else:
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(["the cache moves from one engine to the other, héllo wörld 日本語"] * 4,
                            trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"],
                                                show_progress=False, initial_alphabet=alphabet))
    return tok


@given(st.sampled_from(["metaspace", "bytelevel"]), st.lists(st.integers(0, 10_000), min_size=1, max_size=12),
       st.lists(st.integers(0, 10_000), min_size=1, max_size=24), st.lists(st.integers(1, 4), min_size=24,
                                                                          max_size=24))
@settings(max_examples=300, deadline=None)
def test_a_generation_reads_as_vllms_detokenizer_primed_with_the_prompt_reads_it(kind, prompt, generated, steps):
    """The text of a generation, streamed a few tokens at a time or whole, is what vLLM's fast
    detokenizer makes of it: tokenizers' DecodeStream primed with the prompt's tokens, a token a
    step, special tokens skipped. Decoded alone, a SentencePiece generation lost the space its
    first word begins with (" from" after "moves" was "from")."""
    from tokenizers.decoders import DecodeStream

    from batchyard.llm_text import TextStream, decoding_after, whole_text

    tok = _trained_tokenizer(kind)
    prompt, generated = [t % tok.get_vocab_size() for t in prompt], [t % tok.get_vocab_size() for t in generated]
    # (a prompt that ends inside a character: DecodeStream's first step then gives the prompt's
    # last tokens' text as well, "#\ufffd!" after [#, \xe6], which is no generation's text)
    assume(not tok.decode(prompt, skip_special_tokens=True).endswith("\ufffd"))
    primed = DecodeStream(ids=prompt, skip_special_tokens=True)
    vllms = "".join(primed.step(tok, t) or "" for t in generated)
    decode = decoding_after(lambda t: tok.decode(t, skip_special_tokens=True), prompt)
    stream, pieces, at = TextStream(decode), [], 0
    for n in steps:
        if at >= len(generated):
            break
        pieces.append(stream.push(generated[at:at + n]))
        at += n
    pieces.append(stream.finish(generated))
    assert "".join(pieces) == whole_text(decode, generated) == vllms, (prompt, generated)


def test_bytes_that_make_no_character_are_decoded_a_bounded_window_at_a_time():
    """Tokens whose bytes never make a character (a client may ask for only such tokens with
    allowed_token_ids) each decode to U+FFFD: the text held back while it ends inside one, and
    the generation's last tokens taken back to a whole character, were windows that grew with
    the generation (4000 tokens held the loop 0.6 s, 32k tokens about 40 s)."""
    from batchyard.llm_text import MAX_HELD, TextStream, whole_text

    widths: list = []

    def decode(tokens: list) -> str:
        widths.append(len(tokens))
        return "\ufffd" * len(tokens)

    generated = [7] * 4000
    assert whole_text(decode, generated) == "" and len(widths) == MAX_HELD + 1
    widths.clear()
    stream = TextStream(decode, ("x",))
    for t in generated:
        stream.push([t])
    assert max(widths) <= 2 * MAX_HELD + 2, max(widths)  # (the window from the last piece given, and its held tokens)


def test_losing_the_last_gpu_instance_fails_the_cpu_paths_requests_at_once_and_stops_their_prefills():
    """They failed only once their prefill ended, each a prefill for nobody (and its KV left on
    disk until the sweep)."""
    h = Harness()
    rids = [h.submit(1500, route=PREFILL_CPU)[0] for _ in range(3)]  # (one a prefill job: the rest queued)
    [prefill] = h.jobs()
    assert prefill.worker.name == "cpu0" and len(prefill.job.seqs) < 3
    h.core.worker_lost("gpu0", "connection closed", h.now)
    assert sorted(rid for rid, status, _ in h.failed if status == Status.UNAVAILABLE) == rids
    assert "no 'gpu' LLM instance of 'm'" in h.failed[0][2]
    [abort] = h.jobs()
    assert abort.worker.name == "cpu0" and type(abort.job) is P.LlmAbort and abort.job.seqs == prefill.job.seqs
    assert h.done(prefill) == [] and not h.core.requests and len(h.failed) == 3  # (its end answers nothing again)


@pytest.mark.parametrize("restarted", ["gpu0", "cpu0"])
def test_an_engine_that_registers_again_fails_only_what_it_was_running(restarted):
    """An engine's restart (same name, new pid) was counted as its model's loss of that role
    before the new process was added in the same call: a GPU instance's restart failed the CPU
    prefill path's requests, queued and prefilling, UNAVAILABLE "no 'gpu' instance is up" (and
    aborted their prefills); the CPU instance's sent its queued requests to the GPU path (an
    outside review). Now only what ran on the old process fails."""
    failed = []
    core = LlmCore(lambda r, s, m, param="": failed.append(r.req_id))
    core.add_worker("cpu0", b"cpu0", CPU, 0.0, pid=10, started="a")
    core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 0.0, pid=20, started="b")
    for i in (1, 2, 3):
        assert core.admit(P.GenerateRequest(v=1, id=i, model="m", prompt=[7] * 64, max_tokens=4, route="prefill-cpu",
                                            timeout_us=30_000_000), b"client", 0.0) is None
    core.decide(0.0)
    running = sorted(r.req_id for job in core.jobs.values() for r in job.requests)
    queued = sorted(r.req_id for q in core.cpu_queue.values() for r in q)
    assert running and queued  # cpu0 prefills some, the rest wait for it
    engine = GPU_ENGINE if restarted == "gpu0" else CPU
    core.add_worker(restarted, restarted.encode(), engine, 1.0, pid=99, started="c")
    assert failed == ([] if restarted == "gpu0" else running)
    assert sorted(r.req_id for q in core.cpu_queue.values() for r in q) == queued
    assert all(r.route == PREFILL_CPU for q in core.cpu_queue.values() for r in q)


def test_an_idle_gpu_instance_is_not_predicted_busy_by_jobs_that_ended_early():
    """Each generate job adds its predicted prefill to the GPU's backlog (busy_until); one that
    ended early (cancelled, past its deadline) never gave it back: 300 long prompts cancelled at
    once left the idle GPU predicted busy for 13 s, and a short prompt went to the slower CPU
    prefill path (an outside review)."""
    core = LlmCore(lambda r, s, m, param="": None)
    core.add_worker("cpu0", b"cpu0", CPU, 0.0)
    core.add_worker("gpu0", b"gpu0", GPU_ENGINE, 0.0)

    def request(i, n, route=""):
        return P.GenerateRequest(v=1, id=i, model="m", prompt=[7] * n, max_tokens=1, route=route,
                                 timeout_us=30_000_000)

    assert core.admit(request(0, 48), b"c", 0.0) is None
    assert core.requests[next(iter(core.requests))].route == GPU  # a short prompt, the GPU idle
    for s in core.decide(0.0):
        core.complete(P.LlmDone(job_id=s.job.job_id, worker="gpu0", compute_s=0.01, results=[
            P.LlmResult(seq=s.job.seqs[0], status=0, tokens=[1], first_token_s=0.005)]), 0.0)
    for i in range(1, 301):
        assert core.admit(request(i, 1500, route=GPU), b"c", 0.0) is None
        core.cancel(b"c", i)
    for s in core.decide(0.0):  # the engine ends each (aborted): nothing runs on the GPU
        if type(s.job) is P.LlmJob:
            core.complete(P.LlmDone(job_id=s.job.job_id, worker="gpu0", compute_s=0.0, results=[
                P.LlmResult(seq=q, status=int(Status.CANCELLED)) for q in s.job.seqs]), 0.0)
    assert not core.workers["gpu0"].jobs and core.workers["gpu0"].busy_until <= 0.0
    assert core.admit(request(1000, 48), b"c", 0.5) is None
    assert max(core.requests.values(), key=lambda r: r.seq).route == GPU
