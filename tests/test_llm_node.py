"""LLM mode end to end on real vLLM engines (CPU build): `batchyard up` runs the dispatcher, a
front door and two vLLM workers — "prefill-cpu" and "gpu" (a CPU engine standing in for the GPU,
as every reply says). Needs .venv-llm: `make test-llm`.

Greedy tokens of a request routed prefill-cpu -> KV moved -> decode on the gpu instance must equal
the gpu instance serving the same prompt alone, over prompt lengths that cross the KV block
size (32); the reply must say the decode took the moved KV (tests/test_llm_kv.py shows, with
the KV overwritten by noise, that the decode really uses it).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from batchyard.client import Client
from batchyard.config import FrontendConfig
from batchyard.errors import DeadlineExceeded

from conftest import free_port

pytestmark = pytest.mark.llm

BLOCK = 32
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
PROMPT_LENGTHS = (40, 100, 300)  # 1 block + 8, 3 blocks + 4, 9 blocks + 12


@pytest.fixture(scope="module")
def node():
    pytest.importorskip("vllm")
    import grpc

    from batchyard.bench.llm_live_vs_sim import start_llm_node
    from batchyard.bench.llm_tiny_model import build

    run_dir = tempfile.mkdtemp(prefix="by-llm-", dir="/tmp")
    model = build(Path(run_dir) / "tiny", "tiny", seed=0)
    (model / "chat_template.jinja").write_text(CHATML)  # (the tiny model has none of its own)
    http_port, grpc_port = free_port(), free_port()
    cfg, up = start_llm_node(Path(run_dir), model, BLOCK, FrontendConfig(grpc_port=grpc_port, http_port=http_port),
                             log_level="INFO")
    try:
        with Client(cfg.dispatcher.frontend) as c:
            assert c.status(min_registrations=2, wait=420, timeout=30).registrations >= 2
        # The front door binds HTTP before gRPC: a ready gRPC channel means HTTP is serving too.
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=60)
        yield cfg, f"http://127.0.0.1:{http_port}"
    finally:
        up.terminate()
        up.wait(timeout=60)
        shutil.rmtree(run_dir, ignore_errors=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4096) for _ in range(n)]


def test_routed_requests_decode_with_the_moved_kv_exactly_as_the_gpu_instance_alone(node):
    cfg, _ = node
    with Client(cfg.dispatcher.frontend) as c:
        for n in PROMPT_LENGTHS:
            prompt = _prompt(n, seed=n)
            alone = c.generate("tiny", prompt, max_tokens=16, route="gpu", timeout=120)
            routed = c.generate("tiny", prompt, max_tokens=16, route="prefill-cpu", timeout=120)
            assert len(alone) == 16
            assert list(routed) == list(alone), f"{n}-token prompt: routed output differs from the gpu instance alone"
            t = routed.timing
            assert (t.route, t.prefill_worker, t.decode_worker, t.stand_in) == ("prefill-cpu", "llm-cpu", "llm-gpu",
                                                                                True)
            # only whole blocks move; the decode instance recomputes the partial last block
            assert t.kv_tokens == (n // BLOCK) * BLOCK, f"{n}-token prompt: {t.kv_tokens} tokens from moved KV"
            assert alone.timing.kv_tokens == 0 and alone.timing.route == "gpu"


def test_a_seeded_sampled_generation_is_the_same_on_either_route_and_each_time(node):
    """vLLM's sampling through the node: the decode instance draws every token (the prefill's
    one is greedy and thrown away), so a seed gives the same tokens routed or not, run again."""
    cfg, _ = node
    prompt = _prompt(100, seed=5)
    sampling = {"temperature": 1.0, "top_p": 0.95, "seed": 11}
    with Client(cfg.dispatcher.frontend) as c:
        greedy = c.generate("tiny", prompt, max_tokens=16, route="gpu", timeout=120, ignore_eos=True)
        alone = c.generate("tiny", prompt, max_tokens=16, route="gpu", timeout=120, ignore_eos=True, sampling=sampling)
        routed = c.generate("tiny", prompt, max_tokens=16, route="prefill-cpu", timeout=120, ignore_eos=True,
                            sampling=sampling)
        again = c.generate("tiny", prompt, max_tokens=16, route="gpu", timeout=120, ignore_eos=True, sampling=sampling)
        other = c.generate("tiny", prompt, max_tokens=16, route="gpu", timeout=120, ignore_eos=True,
                           sampling={**sampling, "seed": 12})
    assert list(alone) == list(routed) == list(again) and routed.timing.kv_tokens == 96
    assert list(alone) != list(greedy) and list(other) != list(alone)  # it samples, and by its seed


def test_stop_token_ids_and_min_tokens_are_the_engines_own(node):
    """vLLM's stop_token_ids and min_tokens, applied by the engine: a generation ends at the
    first of those tokens, on either route (finish_reason "stop"; on /v1/completions its id the
    stop_reason, its text left out); under min_tokens none of them is decoded before then
    (vLLM masks them)."""
    cfg, url = node
    prompt = _prompt(100, seed=7)
    with Client(cfg.dispatcher.frontend) as c:
        greedy = list(c.generate("tiny", prompt, max_tokens=16, route="gpu", timeout=120, ignore_eos=True))
        k = next(i for i in range(2, 16) if greedy[i] not in greedy[:i])  # a token not decoded before it
        for route in ("gpu", "prefill-cpu"):
            out = c.generate("tiny", prompt, max_tokens=16, route=route, timeout=120, ignore_eos=True,
                             sampling={"stop_token_ids": [greedy[k]]})
            assert (list(out), out.finish_reason) == (greedy[:k + 1], "stop"), route
        held = c.generate("tiny", prompt, max_tokens=8, route="gpu", timeout=120, ignore_eos=True,
                          sampling={"stop_token_ids": [greedy[0]], "min_tokens": 8})
        assert len(held) == 8 and greedy[0] not in list(held) and held.finish_reason == "length"
    status, _, body = _post_json(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                           "temperature": 0, "ignore_eos": True,
                                                           "stop_token_ids": [greedy[k]]})
    out = json.loads(body)
    [choice] = out["choices"]
    status, _, plain = _post_json(url + "/detokenize", {"model": "tiny", "tokens": greedy[:k]})
    assert (status, choice["finish_reason"], choice["stop_reason"], out["batchyard"][0]["token_ids"]) == (
        200, "stop", greedy[k], greedy[:k + 1]), out
    assert choice["text"] == json.loads(plain)["prompt"]


def test_logit_bias_and_allowed_token_ids_are_the_engines_own(node):
    """OpenAI's logit_bias and vLLM's allowed_token_ids, applied by the engine: a bias of 100
    makes greedy decoding pick that token at every step; only the allowed tokens come out; an
    id past the vocabulary is the engine's 400."""
    _, url = node
    body = {"model": "tiny", "prompt": _prompt(40, seed=3), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    for extra, check in (({"logit_bias": {"17": 100}}, lambda ids: ids == [17] * 6),
                         ({"allowed_token_ids": [21, 22]}, lambda ids: set(ids) <= {21, 22})):
        status, _, raw = _post_json(url + "/v1/completions", {**body, **extra})
        out = json.loads(raw)
        assert status == 200 and check(out["batchyard"][0]["token_ids"]), (extra, out)
    # The engine's refusals as vLLM's server words them, naming the field (param was null, the
    # text behind "INVALID_ARGUMENT: engine refused the request: VLLMValidationError: ")
    from batchyard.bench.llm_tiny_model import VOCAB

    for field, value, message in (
            ("logit_bias", {"99999999": 1}, f"token_id(s) [99999999] in logit_bias contain out-of-vocab token ids. "
                                            f"Vocabulary size: {VOCAB} (parameter=logit_bias, value=[99999999])"),
            ("allowed_token_ids", [99999999], "allowed_token_ids contains out-of-vocab token id! "
                                              "(parameter=allowed_token_ids, value=[99999999])"),
            ("stop_token_ids", [99999999], f"token_id(s) [99999999] in stop_token_ids contain out-of-vocab token "
                                           f"ids. Vocabulary size: {VOCAB} (parameter=stop_token_ids, value=[99999999])")):
        status, _, raw = _post_json(url + "/v1/completions", {**body, field: value})
        assert status == 400 and json.loads(raw)["error"] == {"message": message, "type": "invalid_request_error",
                                                              "param": field, "code": None}, raw


def test_bad_words_are_tokenized_as_vllm_does_and_banned_by_the_engine(node):
    """vLLM's bad_words: the front door's token sequences are those vLLM's SamplingParams makes
    with the model's tokenizer (update_from_tokenizer), and the engine never decodes them: a
    token of the greedy generation, banned, does not come out."""
    from vllm import SamplingParams
    from vllm.tokenizers import get_tokenizer

    from batchyard.openai_fields import bad_words_token_ids

    cfg, url = node
    hf = get_tokenizer(str(Path(cfg.llm_models[0].path)))  # (vLLM's server's own)
    words = ["the", " cache", "moves from", "engine", "é", "to the other"]
    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(hf)
    stripped = [w.lstrip() for w in words]
    encodings = [hf.encode(text, add_special_tokens=False) for text in (*stripped, *(" " + w for w in stripped))]
    assert bad_words_token_ids(encodings[:len(words)], encodings[len(words):]) == params.bad_words_token_ids
    prompt = _prompt(40, seed=11)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, _, raw = _post_json(url + "/v1/completions", body)
    greedy = json.loads(raw)["batchyard"][0]["token_ids"]
    # a token of it that is a word alone (its text, stripped, tokenizes to it)
    word = next(w for t in greedy if (w := hf.decode([t]).strip()) and hf.encode(w, add_special_tokens=False) == [t])
    status, _, raw = _post_json(url + "/v1/completions", {**body, "bad_words": [word]})
    out = json.loads(raw)["batchyard"][0]["token_ids"]
    banned = hf.encode(word, add_special_tokens=False)[0]
    assert status == 200 and banned in greedy and banned not in out, (word, greedy, out)


class _ScriptedGeneration(list):
    def __init__(self, tokens: list, finish_reason: str, timing):
        super().__init__(tokens)
        self.finish_reason, self.timing, self.logprobs, self.prompt_logprobs = finish_reason, timing, [], []


class _ScriptedClient:
    """The SDK's generate as an engine answers it: ``script`` decoded up to max_tokens, ended by
    a stop token (the request's or the model's EOS, ids 2 and 3) from min_tokens on, given to
    ``on_tokens`` in steps of ``steps`` tokens but the last."""

    def __init__(self, script: list, steps: list):
        self.script, self.steps = script, steps

    async def generate(self, model, ids, max_tokens, on_tokens=None, ignore_eos=False, sampling=None, **_):
        stops = {*sampling.stop_token_ids, *(() if ignore_eos else (2, 3))}
        tokens, reason = [], "length"
        for i, t in enumerate(self.script[:max_tokens]):
            tokens.append(t)
            if t in stops and i >= sampling.min_tokens:
                reason = "stop"
                break
        given = 0
        for n in self.steps:
            if given + n >= len(tokens):
                break
            if on_tokens is not None and on_tokens(tokens[given:given + n]):
                return _ScriptedGeneration(tokens[:given + n], "stop", None)
            given += n
        return _ScriptedGeneration(tokens, reason, object())


def _small_tokenizer(kind: str):
    """A BPE tokenizer of 300 tokens, byte-level (GPT-2's kind: a character of several bytes may
    split over tokens) or "metaspace" (SentencePiece's: a word's first piece holds its space),
    its special tokens <unk>, <s>, </s> and <|eot|> (ids 0-3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "metaspace":
        tok.pre_tokenizer, tok.decoder, alphabet = pre_tokenizers.Metaspace(), decoders.Metaspace(), []
    else:
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(["the cache moves from one engine to the other é 日本語 🙂 stop here"] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|eot|>"],
                                                show_progress=False, initial_alphabet=alphabet))
    return tok


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_a_generations_text_is_what_vllms_detokenizer_makes_of_it(tmp_path, kind):
    """The front door's text of a generation against vLLM's own: its FastIncrementalDetokenizer
    (primed with the prompt) fed a token at a time, ended as its engine's check_stop ends it, on
    random prompts and generations of words with characters of several bytes, special tokens,
    stop strings, stop_token_ids, the model's two EOS ids, min_tokens (the engine masks the stop
    tokens before it), include_stop_str_in_output, skip_special_tokens and ignore_eos, streamed
    in steps of 1-3 tokens or not: the same text, finish_reason, stop_reason and token count."""
    import asyncio
    import types

    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    from batchyard import protocol as P
    from batchyard.openai_http import OpenAiCompletions, TextRule

    tok = _small_tokenizer(kind)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))  # id 2
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))

    def vllms(prompt, script, max_tokens, stops, min_tokens, include, stop_ids, ignore_eos, skip):
        params = types.SimpleNamespace(stop=list(stops), min_tokens=min_tokens, include_stop_str_in_output=include,
                                       skip_special_tokens=skip, spaces_between_special_tokens=True)
        request = types.SimpleNamespace(sampling_params=params, prompt_token_ids=list(prompt), request_id="r")
        detok = FastIncrementalDetokenizer(types.SimpleNamespace(_tokenizer=tok), request)
        stopping = {*stop_ids, *(() if ignore_eos else (3,))}  # (vLLM's stop_token_ids: the extra EOS too)
        for i, t in enumerate(script[:max_tokens]):
            ended = None
            if i >= min_tokens:  # (check_stop: the primary EOS first, then the stop ids)
                ended = ("eos", None) if not ignore_eos and t == 2 else ("id", t) if t in stopping else None
            if found := detok.update([t], ended is not None):
                return detok.get_next_output_text(True, False), "stop", found, len(detok.output_token_ids)
            if ended:
                return detok.get_next_output_text(True, False), "stop", ended[1], len(detok.output_token_ids)
        return detok.get_next_output_text(True, False), "length", None, len(detok.output_token_ids)

    async def ours(prompt, script, max_tokens, stops, min_tokens, include, stop_ids, ignore_eos, skip, steps, stream):
        completions = OpenAiCompletions(_ScriptedClient(script, steps), {"m": str(tmp_path)})
        run = dict(timeout=5, ignore_eos=ignore_eos, sampling=P.Sampling(min_tokens=min_tokens, stop_token_ids=stop_ids))
        pieces = []
        out = await completions.complete("m", prompt, max_tokens, run, TextRule(tuple(stops), include, skip),
                                         on_text=(lambda piece, _n, _last: pieces.append(piece)) if stream else None)
        return ("".join(pieces) + out.rest if stream else out.text), out.finish_reason, out.stop_reason, len(out.tokens)

    rng = random.Random(7)
    words = ["the", " cache", " moves", " from", " one", " engine", " é", " 日本語", " 🙂", " stop", " here", "</s>",
             "<|eot|>"]
    differ = []
    for trial in range(600):
        prompt = tok.encode("".join(rng.choice(words) for _ in range(rng.randrange(1, 4)))).ids
        script = tok.encode("".join(rng.choice(words) for _ in range(12))).ids[:14]
        min_tokens = rng.choice([0, 0, 1, 2, 3, 5])
        stop_ids = rng.sample([2, 3, 4, 5, 100, 150], rng.randrange(0, 3))
        for i in range(min(min_tokens, len(script))):  # the engine masks the stop tokens before min_tokens
            if script[i] in {*stop_ids, 2, 3}:
                script[i] = 50
        case = (prompt, script, rng.randrange(max(1, min_tokens), 15),
                tuple(rng.sample(["e", "he", "ne", " s", "本", "🙂", "ca", "stop", "gine"], rng.randrange(0, 3))),
                min_tokens, rng.random() < 0.3, stop_ids, rng.random() < 0.2, rng.random() < 0.5)
        if tok.decode(prompt).endswith("\ufffd"):
            continue  # (DecodeStream then gives the prompt's last tokens' text too: not a generation's)
        want = vllms(*case)
        got = asyncio.run(ours(*case, [rng.choice([1, 1, 2, 3]) for _ in range(20)], rng.random() < 0.5))
        if got != want:
            differ.append((case, want, got))
    assert differ == [], (len(differ), differ[:3])


def test_the_dispatcher_routes_by_its_curves_and_learns_them(node):
    cfg, _ = node
    lengths = [24, 48, 600, 32, 900, 64]
    with Client(cfg.dispatcher.frontend) as c:
        futures = [c.submit_generate("tiny", _prompt(n, seed=1000 + n), max_tokens=8, timeout=120) for n in lengths]
        outs = [f.result() for f in futures]
        st = c.status()
    assert all(len(o) == 8 for o in outs)
    for n, o in zip(lengths, outs):  # each reply carries both predictions and took the path with the earlier one
        t = o.timing
        assert t.predicted_ttft_cpu_us > 0 and t.predicted_ttft_gpu_us > 0
        if n <= BLOCK:  # no whole block of KV would move: the GPU prefills it whatever the predictions
            assert t.route == "gpu"
        else:
            assert t.route == ("prefill-cpu" if t.predicted_ttft_cpu_us < t.predicted_ttft_gpu_us else "gpu")
    curves = st.curves["tiny/llm"]
    assert curves["cpu_prefill"]["samples"] >= 3 and curves["gpu_decode"]["samples"] >= 2  # calibrated at start
    assert st.decisions["llm_gpu"] + st.decisions["llm_prefill-cpu"] >= len(lengths)


def test_openai_completions_on_the_front_door(node):
    _, url = node
    # (greedy, so that each answer below is the same text; left out, vLLM's temperature 1 samples)
    body = json.dumps({"model": "tiny", "prompt": "the cache moves from one engine", "max_tokens": 6,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 6
    assert isinstance(out["choices"][0]["text"], str) and out["batchyard"][0]["stand_in"] is True
    # streamed: the same text, piece by piece as the engine decodes it
    status, kind, text = _post_json(url + "/v1/completions", {"model": "tiny", "prompt": "the cache moves from one engine",
                                                              "max_tokens": 6, "stream": True, "temperature": 0})
    assert (status, kind) == (200, "text/event-stream; charset=utf-8")
    events = [e[len(b"data: "):] for e in text.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]" and len(events) > 2
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == out["choices"][0]["text"]
    assert [c["finish_reason"] for c in chunks][-1] == "length"
    # a stop string from the middle of that text: cut before it, streamed or not
    text = out["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    for stream in (False, True):
        status, kind, body = _post_json(url + "/v1/completions", {"model": "tiny", "prompt": "the cache moves from one engine",
                                                                  "max_tokens": 6, "stop": stop, "stream": stream,
                                                                  "temperature": 0})
        if stream:
            chunks = [json.loads(e[len(b"data: "):])["choices"][0] for e in body.split(b"\n\n")
                      if e and e != b"data: [DONE]"]
        else:
            chunks = json.loads(body)["choices"]
        assert "".join(c["text"] for c in chunks) == text[:text.find(stop)] and chunks[-1]["finish_reason"] == "stop"


def test_chat_completions_answer_the_conversation_as_its_rendered_prompt(node):
    """/v1/chat/completions on the real engines: the greedy message is the completion of the
    conversation's token ids (the chat template's text, tokenized without special tokens) that
    /v1/completions gives for those ids; streamed, the same message."""
    import jinja2
    from tokenizers import Tokenizer

    cfg, url = node
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cache moves"}]
    folder = Path(cfg.llm_models[0].path)
    text = jinja2.Template(CHATML).render(messages=messages, add_generation_prompt=True)
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, _, chat = _post_json(url + "/v1/chat/completions", body)
    chat = json.loads(chat)
    status, _, plain = _post_json(url + "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 8,
                                                            "temperature": 0, "ignore_eos": True})
    plain = json.loads(plain)
    assert status == 200 and chat["usage"] == plain["usage"] and chat["usage"]["prompt_tokens"] == len(ids)
    assert chat["batchyard"][0]["token_ids"] == plain["batchyard"][0]["token_ids"]
    message = chat["choices"][0]["message"]
    assert message == {"role": "assistant", "content": plain["choices"][0]["text"]}
    status, kind, events = _post_json(url + "/v1/chat/completions", {**body, "stream": True})
    deltas = [json.loads(e[len(b"data: "):])["choices"][0]["delta"] for e in events.split(b"\n\n")
              if e and e != b"data: [DONE]"]
    assert deltas[0]["role"] == "assistant" and "".join(d.get("content", "") for d in deltas) == message["content"]


def _post_json(url: str, body: dict) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def test_the_engines_logprobs_reach_every_route(node):
    """vLLM's logprobs from a real engine: a greedy generation's tokens each the most likely at
    its position (rank 1, the largest logprob), one entry a token counted; the same numbers on
    /v1/completions and from the SDK (the routes' shapes: test_llm_dispatch's scripted engines)."""
    cfg, url = node
    prompt = _prompt(40, seed=77)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3,
            "batchyard_route": "gpu"}
    status, _, raw = _post_json(url + "/v1/completions", body)
    out = json.loads(raw)
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == out["usage"]["completion_tokens"] == 6
    for mine, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert mine <= 0 and mine == max(top.values()) and len(top) <= 3, (mine, top)
    with Client(cfg.dispatcher.frontend) as c:
        g = c.generate("tiny", prompt, 6, route="gpu", ignore_eos=True, sampling={"logprobs": 3}, timeout=120)
    assert [p[0][2] for p in g.logprobs] == [1] * 6 and all(len(p) == 3 for p in g.logprobs)
    assert [p[0][0] for p in g.logprobs] == list(g)
    assert [p[0][1] for p in g.logprobs] == pytest.approx(lp["token_logprobs"], abs=1e-3)
    # lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1; the prompt's computed by the
    # gpu instance's own prefill (a prompt past a block would have taken the prefill-cpu route)
    status, _, raw = _post_json(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                          "temperature": 0, "logprobs": 1, "echo": True})
    out = json.loads(raw)
    assert status == 200 and out["batchyard"][0]["route"] == "gpu", out
    lp, member = out["choices"][0]["logprobs"], out["choices"][0]["prompt_logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and len(member) == len(prompt) and member[0] is None
    # the member's decoded token's logprob is the object's at each prompt position
    assert [p[str(t)]["logprob"] for p, t in zip(member[1:], prompt[1:])] == lp["token_logprobs"][1:len(prompt)]
    with Client(cfg.dispatcher.frontend) as c:
        g = c.generate("tiny", prompt, 1, ignore_eos=True, sampling={"prompt_logprobs": 2}, timeout=120)
    assert [p[0][0] for p in g.prompt_logprobs] == prompt[1:] and g.timing.route == "gpu"
    assert [p[0][1] for p in g.prompt_logprobs] == pytest.approx(lp["token_logprobs"][1:len(prompt)], abs=1e-3)


def test_tritons_generate_answers_as_its_vllm_backend_does(node):
    """A Triton + vLLM client's request: the same greedy text as /v1/completions, after the prompt
    unless it asks for the completion alone, with the outputs it asks for."""
    _, url = node
    prompt = "the cache moves from one engine"
    status, _, text = _post_json(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 6,
                                                           "temperature": 0})
    assert status == 200
    completion = json.loads(text)["choices"][0]["text"]
    status, kind, text = _post_json(url + "/v2/models/tiny/generate", {
        "text_input": prompt, "parameters": {"stream": False, "temperature": 0, "max_tokens": 6}, "id": "q1"})
    assert (status, kind) == (200, "application/json")
    assert json.loads(text) == {"id": "q1", "model_name": "tiny", "model_version": "1", "text_output": prompt + completion}
    status, kind, text = _post_json(url + "/v2/models/tiny/generate_stream", {
        "text_input": prompt, "stream": True, "max_tokens": 6, "temperature": 0, "return_num_output_tokens": True,
        "return_num_input_tokens": True, "return_finish_reason": True})
    assert (status, kind) == (200, "text/event-stream; charset=utf-8")
    events = [json.loads(e[len(b"data: "):]) for e in text.split(b"\n\n") if e]
    assert len(events) > 1  # an event an engine step, as the backend streams
    assert "".join(e["text_output"] for e in events) == completion
    assert sum(e["num_output_tokens"] for e in events) == 6 and all(e["num_input_tokens"] > 0 for e in events)
    assert [e["finish_reason"] for e in events] == ["None"] * (len(events) - 1) + ["length"]
    # a refusal after the body is read: under a stream, an event with its status
    status, kind, text = _post_json(url + "/v2/models/tiny/generate_stream", {"text_input": prompt, "best_of": 2})
    assert (status, kind) == (400, "text/event-stream; charset=utf-8")
    assert b"'best_of' is not supported" in text
    status, _, text = _post_json(url + "/v2/models/tiny/generate", {"text_input": prompt, "stream": True})
    assert status == 200 and b"exactly 1 response" in text  # (several responses: Triton's error, under 200)


def test_a_request_past_its_deadline_is_stopped_in_its_engine(node):
    """Answered DEADLINE_EXCEEDED, the request decoded on to its max_tokens for nobody (seconds
    here), holding an engine slot and KV blocks; now the dispatcher tells the engine to stop it,
    and the job ends at once."""
    cfg, _ = node
    with Client(cfg.dispatcher.frontend) as c:
        with pytest.raises(DeadlineExceeded):
            c.generate("tiny", _prompt(40, seed=7), max_tokens=1900, route="gpu", timeout=1.0)
        t0 = time.monotonic()
        # Each look a round trip; its job ends when the engine has let the request go.
        while [w.inflight for w in c.status().workers if w.name == "llm-gpu"] != [0]:
            assert time.monotonic() - t0 < 5.0, "the engine kept decoding the expired request"
        assert len(c.generate("tiny", _prompt(40, seed=8), max_tokens=8, route="gpu", timeout=60)) == 8


@pytest.mark.parametrize("fields", [
    {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True},
    {"temperature": 1, "top_k": 50, "top_p": 1.0, "max_new_tokens": 100},
    {"do_sample": False, "temperature": 0.0, "min_p": 0.1},
    {"presence_penalty": 0.5, "frequency_penalty": 0.2, "temperature": None},
    {"bos_token_id": 1, "eos_token_id": [2, 3]}])
def test_a_models_sampling_defaults_are_those_vllms_server_takes(tmp_path, fields):
    """llm_model_files.generation_defaults against vLLM's own reader (what its OpenAI server's
    get_diff_sampling_param takes, with --generation-config auto), on the same folder."""
    pytest.importorskip("vllm")
    from vllm.transformers_utils.config import try_get_generation_config

    from batchyard.llm_model_files import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "temperature": 0.3}))
    keys = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p", "min_p")
    theirs = {k: v for k, v in try_get_generation_config(str(tmp_path), False).to_diff_dict().items()
              if k in (*keys, "max_new_tokens") and v is not None}
    mine = generation_defaults(tmp_path)
    assert {**mine.sampling, **({"max_new_tokens": mine.max_tokens} if mine.max_tokens else {})} == theirs


def test_every_field_of_vllms_requests_is_served_refused_or_left_alone_knowingly():
    """Each field of vLLM's completion and chat requests (this build's) is one Batchyard serves,
    refuses unless at its default (vLLM's own default passing), or leaves alone for a stated
    reason: a field vLLM adds, taken and ignored, would change answers silently."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from batchyard import openai_chat as chat
    from batchyard import openai_fields as oa

    for request, served, refused, ignored in (
            (CompletionRequest, oa.SERVED, oa.UNSUPPORTED, oa.IGNORED),
            (ChatCompletionRequest, chat.CHAT_SERVED, chat.CHAT_UNSUPPORTED, chat.CHAT_IGNORED)):
        fields = request.model_fields
        assert set(fields) <= {*served, *refused, *ignored}, (request.__name__, set(fields) - {*served, *refused,
                                                                                                *ignored})
        for name, default in refused.items():
            if name in fields and not fields[name].is_required() and name != "request_id":
                theirs = fields[name].get_default(call_default_factory=True)
                assert oa.asks_nothing(theirs, default), (request.__name__, name, theirs, default)


def test_the_openai_client_reads_every_answer_of_the_openai_routes(node):
    """The `openai` package (vLLM's own dependency) against the front door: models, completions
    and chat, whole and streamed with their usage, and its typed errors for ours."""
    openai = pytest.importorskip("openai")
    _, url = node
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["tiny"]
    same = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt="the cache moves", max_tokens=6, **same)
    assert whole.usage.completion_tokens == 6 and whole.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(prompt="the cache moves", max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, **same))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cache moves"}]
    chat = client.chat.completions.create(messages=messages, max_completion_tokens=6, **same)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    deltas = [c.choices[0].delta for c in client.chat.completions.create(messages=messages, max_completion_tokens=6,
                                                                           stream=True, **same) if c.choices]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=messages, temperature=5)


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_logprobs_read_as_vllms_server_writes_them(tmp_path, kind):
    """The front door's logprobs objects (/v1/completions' and chat's) against vLLM's own: its
    LogprobsProcessor (the engine's logprobs made into Logprob dicts, each token's text as vLLM
    writes it: decoded alone, SentencePiece's leading spaces given back, a byte of a split
    character read after the tokens before it) and its servers' _create_completion_logprobs and
    _create_chat_logprobs, on random generations of words with characters of several bytes and
    special tokens, random likely tokens (the decoded one among them or not), whole and in
    random chunks as a stream writes them; and the prompt's (its _update_prompt_logprobs): vLLM's
    prompt_logprobs member, and echo's object of the prompt's and the generation's; and with
    return_tokens_as_token_ids."""
    import functools
    import types

    import numpy as np
    from transformers import PreTrainedTokenizerFast
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    import torch
    from vllm.entrypoints.generate.base.serving import clamp_prompt_logprobs
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors

    from batchyard.openai_logprobs import (ChatLogprobs, CompletionLogprobs, TokenIds, TokenTexts, joined,
                                           leading_space_marker, prompt_logprobs)

    tok = _small_tokenizer(kind)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    vocab = tok.get_vocab_size()
    serving = types.SimpleNamespace(return_tokens_as_token_ids=False,
                                    _get_decoded_token=GenerateBaseServing._get_decoded_token)
    serving._get_top_logprobs = functools.partial(OpenAIServingChat._get_top_logprobs, serving)
    marker = leading_space_marker(tok)
    assert (marker is not None) == (kind == "metaspace")
    alone: dict = {}  # (tokens' texts alone, kept across the generations as the front door keeps them)

    rng = random.Random(11)
    words = ["the", " cache", " moves", " é", " 日本語", " 🙂", " stop", "</s>", "<s>"]
    def row(t: int, n: int) -> tuple:
        """An engine's logprobs of a position where ``t`` is: its id, then n most likely (t among
        them or not); their logprobs; t's rank."""
        top = rng.sample(range(vocab), n)
        if n and rng.random() < 0.5:
            top[rng.randrange(n)] = t
        values = sorted((rng.uniform(-12, 0) for _ in range(n)), reverse=True)
        rank = top.index(t) + 1 if t in top else n + 1 + rng.randrange(5)
        lp = values[rank - 1] if t in top else rng.uniform(-30, -12) if rng.random() < 0.9 else float("-inf")
        return [t, *top], [lp, *values], rank

    for trial in range(150):
        script = tok.encode("".join(rng.choice(words) for _ in range(8))).ids[:16]
        prompt = tok.encode("".join(rng.choice(words) for _ in range(rng.randrange(1, 5)))).ids[:8]
        n = rng.randrange(0, 6)
        n_prompt = rng.choice([n, rng.randrange(0, 8)])  # (echo's object writes n + 1 a position of them)
        processor = LogprobsProcessor(tokenizer=hf, logprobs=[], prompt_logprobs=[None], cumulative_logprob=0.0,
                                      num_logprobs=n, num_prompt_logprobs=n_prompt)
        if len(prompt) > 1:  # (the prefill's: a row a prompt token but the first)
            rows = [row(t, n_prompt) for t in prompt[1:]]
            processor._update_prompt_logprobs(LogprobsTensors(torch.tensor([r[0] for r in rows]),
                                                              torch.tensor([r[1] for r in rows]),
                                                              torch.tensor([r[2] for r in rows])))
        for t in script:  # one engine step a token: the decoded one, then the n most likely
            ids, values, rank = row(t, n)
            processor._update_sample_logprobs(LogprobsLists(np.array([ids]), np.array([values]), np.array([rank])))
        positions = [[(tid, p.logprob, p.rank) for tid, p in d.items()] for d in processor.logprobs]
        prompt_positions = [[(tid, p.logprob, p.rank) for tid, p in d.items()] for d in processor.prompt_logprobs[1:]]
        cut = (sorted(rng.sample(range(1, len(script)), rng.randrange(0, min(4, len(script) - 1))))
               if len(script) > 1 else [])
        chunks = [positions[a:b] for a, b in zip([0, *cut], [*cut, len(script)])]

        theirs = OpenAIServingCompletion._create_completion_logprobs(serving, script, processor.logprobs, n, hf)
        writer = CompletionLogprobs(TokenTexts(tok, marker, alone))
        parts = [writer.of(c) for c in chunks]
        ours = {k: [v for p in parts for v in p[k]] for k in parts[0]}
        assert ours == theirs.model_dump(), (trial, script, ours, theirs.model_dump())

        # the prompt's, vLLM's member (clamped) and echo's object (theirs of the prompt, then of the generation)
        strings = TokenTexts(tok, marker, alone).of(prompt_positions)
        theirs = CompletionResponseChoice(index=0, text="", prompt_logprobs=clamp_prompt_logprobs(
            [None, *processor.prompt_logprobs[1:]])).model_dump(mode="json")["prompt_logprobs"]
        assert prompt_logprobs(prompt_positions, strings) == theirs, (trial, prompt)
        theirs = OpenAIServingCompletion._create_completion_logprobs(
            serving, [*prompt, *script], [*processor.prompt_logprobs, *processor.logprobs], n, hf)
        writer = CompletionLogprobs(TokenTexts(tok, marker, alone))
        ours = joined(writer.prompt(tok.decode(prompt[:1], skip_special_tokens=False), prompt_positions, strings,
                                    n + 1), writer.of(positions))
        assert ours == theirs.model_dump(), (trial, prompt, script, ours, theirs.model_dump())
        theirs = OpenAIServingCompletion._create_completion_logprobs(  # (return_tokens_as_token_ids)
            serving, [*prompt, *script], [*processor.prompt_logprobs, *processor.logprobs], n, hf,
            return_as_token_id=True)
        writer = CompletionLogprobs(TokenIds())
        ours = joined(writer.prompt(f"token_id:{prompt[0]}", prompt_positions, TokenIds().of(prompt_positions),
                                    n + 1), writer.of(positions))
        assert ours == theirs.model_dump(), (trial, prompt, script)
        theirs = OpenAIServingChat._create_chat_logprobs(serving, script, processor.logprobs, hf,
                                                          num_output_top_logprobs=n, return_as_token_id=True)
        assert ChatLogprobs(TokenTexts(tok, marker, alone), n, as_ids=True).of(positions) == theirs.model_dump(), trial

        theirs = OpenAIServingChat._create_chat_logprobs(serving, script, processor.logprobs, hf,
                                                          num_output_top_logprobs=n)
        writer = ChatLogprobs(TokenTexts(tok, marker, alone), n)
        ours = {"content": [c for chunk in chunks for c in writer.of(chunk)["content"]]}
        assert ours == theirs.model_dump(), (trial, script, ours, theirs.model_dump())
