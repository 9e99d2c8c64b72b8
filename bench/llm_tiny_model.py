"""Build a small Llama and a byte-level BPE tokenizer on disk, for vLLM runs without a model hub.

Random weights (seeded, so every build is the same model): outputs are gibberish, timings and KV
handling are real (shared/VLLM_CPU.md, "A model without a hub"). Needs torch, transformers and
tokenizers: run it from .venv-llm (`make llm-env`).

    .venv-llm/bin/python -m batchyard.bench.llm_tiny_model /tmp/tiny-llama [--size 98m]
"""

from __future__ import annotations

import argparse
from pathlib import Path

VOCAB = 4096
SIZES = {
    # 6.3 M parameters: seconds to build and to load
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, intermediate_size=1024),
    # 98.6 M parameters: the model VLLM_CPU.md's timings (and llm_sim's CPU curve) are for
    "98m": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, intermediate_size=2816),
}


def _corpus() -> list[str]:
    # Any fixed text: the tokenizer only needs to exist and be deterministic.
    words = "the cache moves from one engine to the other while the scheduler decides where each prefill runs".split()
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 8


def build(out: str | Path, size: str = "tiny", seed: int = 0, max_positions: int = 2048) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                         **SIZES[size])
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: match the config's bos/eos
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    # pad the vocabulary to the model's, so every id the model can emit decodes
    tok.add_tokens([f"<extra_{i}>" for i in range(VOCAB - tok.get_vocab_size())])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print(build(args.out, args.size, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
