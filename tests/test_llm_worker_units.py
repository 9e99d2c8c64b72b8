"""The vLLM worker's pure helpers (workers/llm_engine.py), without vLLM: what moves, what is
refused before it can reach the engine, where the KV lives and what gets swept."""

from __future__ import annotations

import os
import time
from pathlib import Path

from batchyard import protocol as P
from batchyard.workers.llm_engine import check_job, kv_root, moved_tokens, sampling_kwargs, sweep_stale


def test_only_whole_blocks_move_and_never_the_last_token():
    assert [moved_tokens(n, 32) for n in (1, 32, 33, 40, 64, 65, 100, 300)] == [0, 0, 32, 32, 32, 64, 96, 288]


def test_requests_the_engine_cannot_run_are_refused_with_a_reason():
    job = P.LlmJob(job_id=1, kind="generate", seqs=[1, 2, 3, 4], prompts=[[1, 2], [], [5] * 60, [1, 9999]],
                   max_tokens=[4, 4, 8, 4])
    ok, empty, too_long, bad_id = check_job(job, max_model_len=64, vocab=4096)
    assert ok == "" and "empty" in empty and "max_model_len 64" in too_long and "[0, 4096)" in bad_id
    mismatched = P.LlmJob(job_id=2, kind="prefill", seqs=[1, 2], prompts=[[1]], max_tokens=[1, 1])
    assert all("must match" in why for why in check_job(mismatched, 64, 4096))


def test_both_instances_of_a_node_compute_the_same_kv_folder_and_greedy_params():
    a, b = kv_root("ipc:///run/n0/be", "tiny"), kv_root("ipc:///run/n0/be", "tiny")
    assert a == b and a != kv_root("ipc:///run/n1/be", "tiny") and kv_root("x", "tiny", "/srv/kv") == a.__class__("/srv/kv")
    kw = sampling_kwargs(8, kv="load")
    assert kw["temperature"] == 0.0 and kw["max_tokens"] == 8 and kw["extra_args"]["kv_transfer_params"]["batchyard"] == "load"
    assert "extra_args" not in sampling_kwargs(8)


def _entry(folder, name: str, past: float = 0.0, files=("layer0.safetensors", "complete")):
    entry = folder / name
    entry.mkdir()
    for f in files:
        (entry / f).write_bytes(b"x")
        if past:
            os.utime(entry / f, (past, past))
    if past:
        os.utime(entry, (past, past))
    return entry


def test_stale_kv_entries_are_swept_fresh_ones_kept(tmp_path):
    past = time.time() - 3600
    _entry(tmp_path, "0" * 32, past)
    _entry(tmp_path, "1" * 32)
    # Stored again (the same prompt): its files are new, its folder's time is not.
    rewritten = _entry(tmp_path, "2" * 32)
    os.utime(rewritten, (past, past))
    in_use = _entry(tmp_path, "3" * 32, past)
    assert sweep_stale(tmp_path, older_than_s=600, keep={str(in_use)}) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1" * 32, "2" * 32, "3" * 32]


def test_the_sweep_removes_only_the_connectors_entries(tmp_path):
    """A kv_dir set to a folder of the user's had every entry older than 10 minutes removed,
    files and folders alike."""
    past = time.time() - 3600
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    os.utime(notes, (past, past))
    _entry(tmp_path, "sub", past)  # (not a hash's name)
    _entry(tmp_path, "a" * 32, past, files=("layer0.safetensors", "thesis.tex"))  # (another file in it)
    _entry(tmp_path, "b" * 32, past, files=())
    (tmp_path / ("b" * 32) / "inner").mkdir()  # (a folder in it)
    (tmp_path / ("c" * 32)).symlink_to(_entry(tmp_path, "elsewhere", past))
    _entry(tmp_path, "d" * 64, past)  # (a longer digest: the connector's)
    _entry(tmp_path, "e" * 32, past, files=("layer0.safetensors", ".tmp5UsP2T"))  # (a crash mid-write: its)
    assert sweep_stale(tmp_path, older_than_s=600) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a" * 32, "b" * 32, "c" * 32, "elsewhere", "notes.txt", "sub"]


def test_the_default_kv_folder_is_one_path_component_under_the_temp_dir_per_model_name():
    import tempfile

    roots = {name: kv_root("ipc:///run/n0/be", name) for name in ("tiny", "x/../../home/u", "..", "a/b", "a_b")}
    assert all(r.parent == Path(tempfile.gettempdir()) and r.name.startswith("batchyard-kv-") for r in roots.values())
    assert len(set(roots.values())) == len(roots) and roots["tiny"].name.endswith("-tiny")


def test_a_worker_sweeps_stale_kv_while_it_serves_and_a_stop_before_registering_ends_it(tmp_path, monkeypatch):
    # KV a prefill stored for a request that ended meanwhile is never loaded, so never removed
    # by the decode instance; it was swept only at the next start. And stopped before the
    # dispatcher answered, the worker's unstarted heartbeat socket kept ZeroMQ's context from
    # closing: it hung until the stop grace killed it.
    from batchyard.config import DispatcherConfig, LlmModelConfig, NodeConfig, VllmConfig, WorkerConfig
    from batchyard.workers import llm_worker, runtime

    monkeypatch.setattr(runtime, "exit_after_grace", lambda: None)
    swept = []

    class IdleEngine:
        def has_unfinished_requests(self):
            return False

    def sweep(root, keep=()):
        swept.append(root)
        server.request_stop()
        return 0

    monkeypatch.setattr(llm_worker, "sweep_stale", sweep)
    monkeypatch.setattr(llm_worker, "KV_SWEEP_S", 0.0)
    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"ipc://{tmp_path}/be"),
                      llm_models=(LlmModelConfig(name="tiny", path=str(tmp_path)),),
                      workers=(WorkerConfig(name="v0", kind="vllm", models=("tiny",), vllm=VllmConfig(role="prefill-cpu")),))
    engine = P.LlmEngine(model="tiny", role="prefill-cpu", block_size=32, max_model_len=512, max_num_seqs=8)
    server = llm_worker.LlmServer(node, node.workers[0], IdleEngine(), tmp_path, engine, vocab=4096)
    assert server.serve(time.monotonic()) == 0
    assert swept == [tmp_path]


def test_an_engine_error_of_any_text_fails_its_requests_not_the_worker(tmp_path, monkeypatch):
    # The engine's own words went into the reply as they were: one holding a lone surrogate (a
    # path read with os.fsdecode) could not be encoded, and the worker died with every other
    # client's generation; a 300,000-character one reached the client whole.
    _stub_vllm(monkeypatch)

    class Engine:
        def add_request(self, rid, prompt, params, priority=0):
            if prompt[0] == 1:
                raise ValueError("cannot read /models/\udcff/config.json")
            if prompt[0] == 2:
                raise ValueError("prompt " + "x" * 300_000)

        def step(self):
            raise RuntimeError("device failure in \udcff")

        def abort_request(self, rids):
            pass

    server = _gpu_server(tmp_path, Engine())
    server._start_job(P.LlmJob(job_id=1, kind="generate", seqs=[1, 2, 3], prompts=[[1, 5], [2, 5], [3, 5]],
                               max_tokens=[4, 4, 4]))
    assert not server._step()  # the engine failed: the job's running request fails with it
    [done] = server.sock.sent
    by_seq = {r.seq: r for r in done.results}
    assert by_seq[1].status == P.Status.INVALID_ARGUMENT and "\\udcff" in by_seq[1].message
    assert by_seq[2].status == P.Status.INVALID_ARGUMENT and len(by_seq[2].message) < 5000
    assert by_seq[3].status == P.Status.INTERNAL and "device failure in \\udcff" in by_seq[3].message


def _stub_vllm(monkeypatch) -> None:
    """The names the LLM worker imports from vLLM, as plain stand-ins."""
    import sys
    import types

    vllm = types.ModuleType("vllm")
    class SamplingParams(types.SimpleNamespace):
        def update_from_generation_config(self, config: dict, eos_token_id=None) -> None:
            self.masked_eos = config["eos_token_id"]  # (what min_tokens holds back beside stop_token_ids)

    vllm.SamplingParams = SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = types.SimpleNamespace(DELTA="delta")
    exceptions = types.ModuleType("vllm.exceptions")
    exceptions.VLLMClientError = type("VLLMClientError", (Exception,), {})
    for name, module in (("vllm", vllm), ("vllm.inputs", inputs), ("vllm.sampling_params", sampling),
                         ("vllm.exceptions", exceptions)):
        monkeypatch.setitem(sys.modules, name, module)


class _Sent:
    """The worker's socket to the dispatcher: what it sent, decoded."""

    def __init__(self):
        self.sent = []

    def send(self, data, *flags):
        self.sent.append(P.worker_message_decoder.decode(data))


def _gpu_server(tmp_path, engine):
    """An LLM worker's server (role gpu) around ``engine``, its sends kept in ``.sock.sent``."""
    from batchyard.config import DispatcherConfig, LlmModelConfig, NodeConfig, VllmConfig, WorkerConfig
    from batchyard.workers import llm_worker

    node = NodeConfig(DispatcherConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"ipc://{tmp_path}/be"),
                      llm_models=(LlmModelConfig(name="tiny", path=str(tmp_path)),),
                      workers=(WorkerConfig(name="v0", kind="vllm", models=("tiny",), vllm=VllmConfig(role="gpu")),))
    info = P.LlmEngine(model="tiny", role="gpu", block_size=32, max_model_len=512, max_num_seqs=8)
    server = llm_worker.LlmServer(node, node.workers[0], engine, tmp_path, info, vocab=4096)
    server.sock = _Sent()
    return server


def test_a_moved_kv_entry_shared_by_two_prompts_is_neither_lost_to_one_nor_fatal_to_the_engine(tmp_path, monkeypatch):
    # Prompts of the same whole KV blocks share one entry (vLLM names it by those tokens). The
    # decode instance removed it when its last user there ended, though the prefill instance had
    # stored it again for another request whose decode job was on its way: that job's KV load
    # raised inside engine.step(), and the worker failed every request it held and exited.
    import os
    import types

    from batchyard.workers import llm_worker

    _stub_vllm(monkeypatch)
    entries = tmp_path / "kv"
    monkeypatch.setattr(llm_worker, "kv_entry", lambda root, prompt, block: str(entries / f"p{prompt[0]}"))

    class Engine:
        """Finishes every request at the next step, loading its moved KV as vLLM's connector does."""

        def __init__(self):
            self.reqs = {}

        def add_request(self, rid, prompt, params, priority=0):
            self.reqs[rid] = (prompt, getattr(params, "extra_args", None))

        def step(self):
            outs = []
            for rid, (prompt, extra) in self.reqs.items():
                if extra and not any((entries / f"p{prompt[0]}").glob("*")):
                    raise FileNotFoundError(f"{entries}/p{prompt[0]}/layer.0.safetensors")
                outs.append(types.SimpleNamespace(request_id=rid, finished=True, num_cached_tokens=0,
                                                  prompt_logprobs=None, outputs=[
                    types.SimpleNamespace(token_ids=[7], finish_reason="length", logprobs=None)]))
            self.reqs.clear()
            return outs

        def abort_request(self, rids):
            pass

    def decode_job(job_id: int, first: int):
        return P.LlmJob(job_id=job_id, kind="generate", seqs=[1], prompts=[[first] * 40], max_tokens=[1],
                        kv_from="cpu0")

    server = _gpu_server(tmp_path, Engine())
    shared = entries / "p5"
    shared.mkdir(parents=True)
    (shared / "layer.0.safetensors").write_bytes(b"kv of the first request")
    os.utime(shared / "layer.0.safetensors", (1_000_000, 1_000_000))
    server._start_job(decode_job(1, 5))
    (shared / "layer.0.safetensors").write_bytes(b"stored again for the second request")  # newer now
    assert server._step()
    assert any(shared.glob("*")), "removed though stored again for a request still to come"
    server._start_job(decode_job(2, 6))  # its entry is gone (or never came): prefilled here instead
    assert server._step()
    assert [(m.job_id, [r.status for r in m.results]) for m in server.sock.sent] == [(1, [0]), (2, [0])]


def test_a_streamed_generate_job_sends_each_steps_tokens_but_the_last_which_its_done_holds(tmp_path, monkeypatch):
    import types

    _stub_vllm(monkeypatch)

    class Engine:
        """Decodes two tokens a step (DELTA outputs: the new ones only), max_tokens in all; with
        logprobs asked, each token t's as vLLM's Logprob dicts: t at -t, rank 2, after t + 100."""

        def __init__(self):
            self.reqs = {}

        def add_request(self, rid, prompt, params, priority=0):
            self.reqs[rid] = [params.max_tokens, 0, getattr(params, "logprobs", None)]

        def step(self):
            outs = []
            for rid, left in list(self.reqs.items()):
                n = min(2, left[0] - left[1])
                tokens = list(range(left[1], left[1] + n))
                left[1] += n
                finished = left[1] == left[0]
                if finished:
                    del self.reqs[rid]
                logprobs = None if left[2] is None else [
                    {t: types.SimpleNamespace(logprob=-t, rank=2), t + 100: types.SimpleNamespace(logprob=0.0, rank=1)}
                    for t in tokens]
                outs.append(types.SimpleNamespace(request_id=rid, finished=finished, num_cached_tokens=0,
                                                  prompt_logprobs=None, outputs=[
                    types.SimpleNamespace(token_ids=tokens, finish_reason="length" if finished else None,
                                          logprobs=logprobs)]))
            return outs

        def has_unfinished_requests(self):
            return bool(self.reqs)

        def abort_request(self, rids):
            pass

    server = _gpu_server(tmp_path, Engine())
    server._start_job(P.LlmJob(job_id=1, kind="generate", seqs=[4], prompts=[[3] * 8], max_tokens=[5], stream=True,
                               sampling=P.Sampling(logprobs=1)))
    server._start_job(P.LlmJob(job_id=2, kind="generate", seqs=[5], prompts=[[3] * 8], max_tokens=[3]))
    while server.engine.has_unfinished_requests():
        assert server._step()
    tokens = [(m.job_id, m.seq, m.start, m.tokens) for m in server.sock.sent if type(m) is P.LlmTokens]
    assert tokens == [(1, 4, 0, [0, 1]), (1, 4, 2, [2, 3])]  # the job that did not ask sends none
    done = {m.job_id: m.results[0].tokens for m in server.sock.sent if type(m) is P.LlmDone}
    assert done == {1: [0, 1, 2, 3, 4], 2: [0, 1, 2]}
    # each token's logprobs with it, the decoded one first (vLLM's order), where asked
    want = [[(t, -t, 2), (t + 100, 0.0, 1)] for t in range(5)]
    # (relayed by the dispatcher unread: P.logprobs_raw)
    assert [P.decode_logprobs(m.logprobs) for m in server.sock.sent if type(m) is P.LlmTokens] == [want[:2], want[2:4]]
    assert {m.job_id: P.decode_logprobs(m.results[0].logprobs)
            for m in server.sock.sent if type(m) is P.LlmDone} == {1: want, 2: []}
    assert type(server.sock.sent[-1]) is P.LlmDone and server.sock.sent[-1].job_id == 1  # its tokens came first


def test_a_generate_job_stops_at_the_models_end_of_sequence_ids_unless_it_ignores_them(tmp_path, monkeypatch):
    import json

    from batchyard.llm_model_files import eos_token_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert eos_token_ids(tmp_path) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, None, True]}))
    assert eos_token_ids(tmp_path) == (2, 7)  # the generation config's, as transformers reads it
    assert eos_token_ids(tmp_path / "nowhere") == ()
    # a chat model's tokenizer ends a turn with a token its configs do not name
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 9, "content": "<|im_end|>"}],
                                                         "model": {"vocab": {"a": 3}}}))
    assert eos_token_ids(tmp_path) == (9, 2, 7)

    _stub_vllm(monkeypatch)

    class Engine:
        def __init__(self):
            self.params = {}

        def add_request(self, rid, prompt, params, priority=0):
            self.params[rid.split("-")[0]] = params

    server = _gpu_server(tmp_path, Engine())
    server.eos = (2, 7)
    server._start_job(P.LlmJob(job_id=1, kind="generate", seqs=[1], prompts=[[3] * 8], max_tokens=[5]))
    server._start_job(P.LlmJob(job_id=2, kind="generate", seqs=[2], prompts=[[3] * 8], max_tokens=[5], ignore_eos=True))
    server._start_job(P.LlmJob(job_id=3, kind="prefill", seqs=[3], prompts=[[3] * 8], max_tokens=[1]))
    stops = {job: getattr(p, "stop_token_ids", None) for job, p in server.engine.params.items()}
    assert stops == {"1": [2, 7], "2": None, "3": None}
    assert all(p.ignore_eos for p in server.engine.params.values())  # (vLLM knows no EOS of its own here)
    # sampling: a generate job's, as vLLM's parameters; a prefill's one token stays greedy
    sampling = P.Sampling(temperature=0.8, top_k=40, seed=3)
    server._start_job(P.LlmJob(job_id=4, kind="generate", seqs=[4], prompts=[[3] * 8], max_tokens=[5],
                               sampling=sampling))
    server._start_job(P.LlmJob(job_id=5, kind="prefill", seqs=[5], prompts=[[3] * 8], max_tokens=[1],
                               sampling=sampling))
    p4, p5 = server.engine.params["4"], server.engine.params["5"]
    assert (p4.temperature, p4.top_k, p4.seed, p4.top_p, p4.max_tokens) == (0.8, 40, 3, 1.0, 5)
    assert (p5.temperature, getattr(p5, "seed", None)) == (0.0, None)
    assert not hasattr(server.engine.params["1"], "seed")  # greedy: vLLM's defaults
    # a request's stop_token_ids beside the model's EOS (alone under ignore_eos); min_tokens holds
    # the model's EOS back either way, as vLLM's server masks it whatever ignore_eos says
    stopping = P.Sampling(min_tokens=2, stop_token_ids=[11, 2])
    for job, ignore in ((6, False), (7, True)):
        server._start_job(P.LlmJob(job_id=job, kind="generate", seqs=[job], prompts=[[3] * 8], max_tokens=[5],
                                   sampling=stopping, ignore_eos=ignore))
    p6, p7 = server.engine.params["6"], server.engine.params["7"]
    assert (p6.stop_token_ids, p6.min_tokens, p6.masked_eos) == ([11, 2, 7], 2, [2, 7])
    assert (p7.stop_token_ids, p7.min_tokens, p7.masked_eos) == ([11, 2], 2, [2, 7])
    assert not hasattr(p4, "masked_eos")  # (no min_tokens: nothing to hold back)
    # bad_words' token sequences go where vLLM's update_from_tokenizer puts them (no argument takes ids)
    server._start_job(P.LlmJob(job_id=8, kind="generate", seqs=[8], prompts=[[3] * 8], max_tokens=[5],
                               sampling=P.Sampling(bad_words_token_ids=[[4, 5], [6]])))
    p8 = server.engine.params["8"]
    assert p8._bad_words_token_ids == [[4, 5], [6]] and not hasattr(p8, "bad_words_token_ids")


def test_requests_in_the_engine_are_stopped_when_the_dispatcher_asks_the_worker_to_register_again(tmp_path,
                                                                                               monkeypatch):
    """A dispatcher that restarted (or took the worker out of rotation) knows none of the jobs
    the engine runs: they decoded on up to their max_tokens for nobody, holding its slots."""
    _stub_vllm(monkeypatch)

    class Engine:
        def __init__(self):
            self.added, self.aborted = [], []

        def add_request(self, rid, prompt, params, priority=0):
            self.added.append(rid)

        def abort_request(self, rids):
            self.aborted.extend(rids)

    engine = Engine()
    server = _gpu_server(tmp_path, engine)
    server.registered = True
    server._start_job(P.LlmJob(job_id=1, kind="generate", seqs=[1, 2], prompts=[[1, 5], [2, 5]], max_tokens=[400, 400]))
    assert len(engine.added) == 2 and len(server.reqs) == 2
    server._on_message(P.encode(P.Reregister(worker="v0")))
    assert sorted(engine.aborted) == sorted(engine.added) and not server.reqs and not server.registered
