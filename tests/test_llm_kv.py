"""KV moved between two real vLLM engines (CPU build) gives the decode engine's own output.

Instance P prefills a prompt (max_tokens=1) and ExampleConnector stores its KV in a shared
directory; instance D, a separate engine process, loads that KV and decodes greedily. D's tokens
must equal, token for token, a fresh D serving the prompt alone; with the stored KV overwritten by
noise they must not (the moved KV is really used). Prompt lengths cross the KV block size (32).

Needs vLLM's CPU build: `make test-llm` (.venv-llm). Each engine runs in its own process (this
file, run as a script, is that process), so no engine can reuse another's prefix cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.llm

BLOCK = 32
PROMPT_LENGTHS = (40, 100, 300)  # 1 block + 8, 3 blocks + 4, 9 blocks + 12
DECODE_TOKENS = 16
ENGINE_ENV = {  # shared/VLLM_CPU.md: steady timings, one process per engine
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def _prompts() -> dict[int, list[int]]:
    import random

    rng = random.Random(13)
    return {n: [rng.randrange(3, 4096) for _ in range(n)] for n in PROMPT_LENGTHS}


def _engine_role(model: str, role: str, storage: str, out: str) -> None:
    """One engine process: 'prefill' (P, with connector), 'decode' (D, with connector) or 'alone' (D without)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if role != "alone":
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": storage})
    llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, max_num_seqs=8, enforce_eager=True,
              skip_tokenizer_init=True, block_size=BLOCK, distributed_executor_backend="uni",
              kv_transfer_config=kv, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=1 if role == "prefill" else DECODE_TOKENS,
                            detokenize=False, ignore_eos=True)
    prompts = _prompts()
    result = {}
    for n, ids in prompts.items():  # one at a time: each prompt's KV is stored/loaded on its own
        [o] = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        result[n] = list(o.outputs[0].token_ids)
    Path(out).write_text(json.dumps(result))


def _run_engine(model: Path, role: str, storage: Path, tmp: Path) -> dict[int, list[int]]:
    out = tmp / f"{role}-{len(list(tmp.glob('*.json')))}.json"
    env = {**os.environ, **ENGINE_ENV}
    proc = subprocess.run([sys.executable, __file__, str(model), role, str(storage), str(out)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    pytest.importorskip("vllm")
    from batchyard.bench.llm_tiny_model import build

    return build(tmp_path_factory.mktemp("model"), "tiny", seed=0)


def _overwrite_with_noise(storage: Path) -> int:
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(storage.rglob("*.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for f in files:
        tensors = load_file(f)
        save_file({k: torch.randn(v.shape, generator=gen).to(v.dtype) * 4 for k, v in tensors.items()}, f)
    return len(files)


def test_decode_with_moved_kv_matches_decode_alone_and_noise_breaks_it(tiny_model, tmp_path):
    storage = tmp_path / "kv"
    storage.mkdir()
    _run_engine(tiny_model, "prefill", storage, tmp_path)
    stored = {p.parent.name for p in storage.rglob("*.safetensors")}
    assert len(stored) == len(PROMPT_LENGTHS), f"P should store one KV entry per prompt, found {stored}"

    moved = _run_engine(tiny_model, "decode", storage, tmp_path)
    alone = _run_engine(tiny_model, "alone", tmp_path / "unused", tmp_path)
    for n in PROMPT_LENGTHS:
        assert len(alone[n]) == DECODE_TOKENS
        assert moved[n] == alone[n], f"{n}-token prompt: decode with moved KV differs from decode alone"

    assert _overwrite_with_noise(storage) > 0
    noisy = _run_engine(tiny_model, "decode", storage, tmp_path)
    for n in PROMPT_LENGTHS:
        assert noisy[n] != alone[n], f"{n}-token prompt: noise in the moved KV changed nothing; is it loaded?"


if __name__ == "__main__":
    _engine_role(*sys.argv[1:5])
