"""What an LLM's model folder says about generating with it, read as vLLM reads it: its
end-of-sequence token ids (the vLLM worker's stop tokens) and its sampling defaults, the
generation_config.json values vLLM's OpenAI server samples with where a request leaves a
field out (its ``--generation-config auto``, the default: ``ModelConfig.get_diff_sampling_param``).

Plain JSON reads, no transformers: the front door and ``up``'s config check read them too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import msgspec

from . import protocol as P

GENERATION_CONFIG = "generation_config.json"
# The fields vLLM's server takes from it (get_diff_sampling_param's list), less max_new_tokens,
# which is the default max_tokens.
SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                 "min_p")


class GenerationDefaults(msgspec.Struct, frozen=True):
    """A model's defaults: ``sampling`` (fields of protocol.Sampling) and ``max_tokens`` (its
    ``max_new_tokens``; None: not said)."""

    sampling: dict = {}
    max_tokens: Optional[int] = None


def read_json(path: Path) -> dict:
    """A JSON object from ``path``; {} where it is missing, unreadable or not an object."""
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def eos_token_ids(model_path: str | Path) -> tuple[int, ...]:
    """The model's end-of-sequence token ids, those vLLM stops at: its tokenizer's EOS
    (tokenizer_config.json's ``eos_token``, its id from tokenizer.json), and its
    generation_config.json's ``eos_token_id`` (an id or a list), else its config.json's. A chat
    model's tokenizer often ends a turn with a token its config does not name."""
    folder = Path(model_path)
    ids = (tokenizer_eos_token_id(folder), *config_eos_token_ids(folder))
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def config_eos_token_ids(model_path: str | Path) -> tuple[int, ...]:
    """The model's configured end-of-sequence ids: generation_config.json's ``eos_token_id``
    (an id or a list), else config.json's."""
    folder = Path(model_path)
    for name in (GENERATION_CONFIG, "config.json"):
        found = read_json(folder / name).get("eos_token_id")
        found = [i for i in (found if isinstance(found, list) else [found])
                 if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
        if found:  # (an empty or unreadable one: the next file's)
            return tuple(found)
    return ()


def tokenizer_eos_token_id(model_path: str | Path) -> Optional[int]:
    """The tokenizer's own end-of-sequence id (its ``eos_token``: special_tokens_map.json's, else
    tokenizer_config.json's; its id from tokenizer.json), None where it names none. vLLM stops at it with no ``stop_reason``; at the
    model's other end-of-sequence ids, as at a request's stop_token_ids, with the id as it."""
    folder = Path(model_path)
    eos = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # (the map wins, as in transformers)
        found = read_json(folder / name).get("eos_token")
        found = found.get("content") if isinstance(found, dict) else found
        eos = found if isinstance(found, str) else eos
    if eos is None:
        return None
    tok = read_json(folder / "tokenizer.json")
    added = {t.get("content"): t.get("id") for t in tok.get("added_tokens") or () if isinstance(t, dict)}
    vocab = (tok.get("model") or {}).get("vocab")
    found = added.get(eos, vocab.get(eos) if isinstance(vocab, dict) else None)
    return found if isinstance(found, int) and not isinstance(found, bool) and found >= 0 else None


def generation_defaults(model_path: str | Path) -> GenerationDefaults:
    """The sampling defaults of the model's generation_config.json: each of SAMPLING_KEYS it
    gives (null: not given), and ``max_new_tokens`` (what a chat request that gives no
    max_tokens may decode; /v1/completions' default is 16 whatever it says). As vLLM 0.32 with
    transformers 5 reads it: the file alone (the same fields in config.json are not taken), a
    missing file or one that is no JSON gives nothing. ValueError naming the field when one is
    past vLLM's bounds (vLLM would refuse every request that left it out), or where the file is
    JSON but no object (vLLM does not start)."""
    try:
        config = json.loads((Path(model_path) / GENERATION_CONFIG).read_text())
    except (OSError, ValueError):  # missing, or no JSON: vLLM reads it as nothing too
        config = {}
    if not isinstance(config, dict):  # (vLLM fails to start on one)
        raise ValueError(f"{GENERATION_CONFIG}: not a JSON object")
    given = {k: config[k] for k in SAMPLING_KEYS if config.get(k) is not None}
    try:
        sampling = msgspec.convert(given, P.Sampling)
    except msgspec.ValidationError as e:
        raise ValueError(f"{GENERATION_CONFIG}: {e}") from None
    max_tokens = config.get("max_new_tokens")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"{GENERATION_CONFIG}: max_new_tokens must be a positive integer, got {max_tokens!r:.40}")
    # (the converted values: an integer temperature is a float, as SamplingParams takes it)
    return GenerationDefaults({k: getattr(sampling, k) for k in given}, max_tokens)
