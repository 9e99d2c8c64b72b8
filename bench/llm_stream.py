"""What streaming a completion gives a client, on real vLLM engines (CPU build; the "gpu" instance is
a CPU engine standing in for a GPU): one request at a time through the front door's
``/v1/completions``, with ``"stream": true`` and without, alternating, the same prompts.

Reports, p50 and p99 over the requests: the time to the first chunk holding text (what a user
of a chat window waits for), the time to the whole answer streamed and not (what streaming costs:
a message an engine step from the worker, through the dispatcher, to the front door), and the
chunks a stream had. With ``--chat``, instead: ``/v1/chat/completions`` of a conversation of
``--messages`` messages (a ChatML template in the model folder) against ``/v1/completions`` of the
same token ids (from ``/tokenize``), unstreamed, alternating: what the chat route's rendering and
tokenizing add. Run from .venv-llm (`make llm-env`):

    .venv-llm/bin/python -m batchyard.bench.llm_stream --n 40 --max-tokens 64 [--size 98m] [--chat]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from batchyard.bench.vs_triton import free_port
from batchyard.client import Client
from batchyard.config import FrontendConfig


async def _one(session, url: str, body: dict) -> tuple[float, float, int]:
    """-> (seconds to the first chunk with text, or to the answer; seconds to the whole answer;
    chunks with text)."""
    t0 = time.perf_counter()
    first, chunks = None, 0
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            await r.read()
            t = time.perf_counter() - t0
            return t, t, 1
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if json.loads(line[6:])["choices"][0]["text"]:
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
    return first, time.perf_counter() - t0, chunks


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = "the cache moves from one engine to the other while a request waits".split()


async def _run_chat(url: str, n: int, max_tokens: int, messages: int, seed: int) -> dict:
    import aiohttp

    rng = np.random.default_rng(seed)
    rows: dict = {"chat": [], "plain": []}
    same = {"model": "tiny", "max_tokens": max_tokens, "batchyard_route": "gpu", "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        for i in range(n + 2):  # the first two warm up
            conversation = [{"role": ("user", "assistant")[k % 2], "content": " ".join(rng.choice(WORDS, 12))}
                            for k in range(messages)]
            async with session.post(url + "/tokenize", json={"messages": conversation}) as r:
                ids = (await r.json())["tokens"]
            for kind in (("chat", "plain") if i % 2 else ("plain", "chat")):
                got = await (_one(session, url + "/v1/chat/completions", {**same, "messages": conversation})
                             if kind == "chat" else _one(session, url + "/v1/completions", {**same, "prompt": ids}))
                if i >= 2:
                    rows[kind].append(got)
    return rows


async def _run(url: str, n: int, max_tokens: int, prompt_tokens: int, seed: int) -> dict:
    import aiohttp

    rng = np.random.default_rng(seed)
    rows: dict = {"stream": [], "plain": []}
    async with aiohttp.ClientSession() as session:
        for i in range(n + 2):  # the first two warm up
            prompt = [int(x) for x in rng.integers(3, 4000, prompt_tokens)]
            order = ("stream", "plain") if i % 2 else ("plain", "stream")
            for kind in order:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": kind == "stream",
                        "batchyard_route": "gpu", "ignore_eos": True, "temperature": 0}  # (greedy, as before)
                got = await _one(session, url + "/v1/completions", body)
                if i >= 2:
                    rows[kind].append(got)
    return rows


def _pct(values: list, q: float) -> float:
    return float(np.percentile(values, q)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="the chat route against /v1/completions of the same ids")
    ap.add_argument("--messages", type=int, default=8, help="with --chat: messages a conversation")
    args = ap.parse_args()
    from batchyard.bench.llm_live_vs_sim import start_llm_node
    from batchyard.bench.llm_tiny_model import build

    run_dir = Path(tempfile.mkdtemp(prefix="by-llm-stream-", dir="/tmp"))
    up = None
    try:
        model = build(run_dir / "model", args.size, seed=0)
        (model / "chat_template.jinja").write_text(CHATML)
        import grpc

        port, grpc_port = free_port(), free_port()
        cfg, up = start_llm_node(run_dir, model, 32, FrontendConfig(grpc_port=grpc_port, http_port=port))
        with Client(cfg.dispatcher.frontend) as c:
            assert c.status(min_registrations=2, wait=600, timeout=30).registrations >= 2
        # The front door binds HTTP before gRPC: a ready gRPC channel means HTTP is serving too.
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=120)
        url = f"http://127.0.0.1:{port}"
        rows = asyncio.run(_run_chat(url, args.n, args.max_tokens, args.messages, args.seed) if args.chat else
                           _run(url, args.n, args.max_tokens, args.prompt_tokens, args.seed))
    finally:
        if up is not None:
            up.terminate()
            up.wait(timeout=60)
        shutil.rmtree(run_dir, ignore_errors=True)
    what = (f"/v1/chat/completions of {args.messages} messages against /v1/completions of its token ids" if args.chat
            else f"/v1/completions, {args.prompt_tokens} prompt tokens")
    print(f"{what}, one request at a time, {args.n} each way, max_tokens {args.max_tokens}, model {args.size}, "
          "route gpu (a CPU stand-in); ms, p50 / p99:")
    for kind, got in rows.items():
        first, whole, chunks = zip(*got)
        print(f"  {kind:6s}  first text {_pct(first, 50):8.1f} / {_pct(first, 99):8.1f}   "
              f"whole answer {_pct(whole, 50):8.1f} / {_pct(whole, 99):8.1f}   chunks with text "
              f"{int(np.median(chunks))}")


if __name__ == "__main__":
    main()
