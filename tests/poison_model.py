"""Models for tests/test_failures.py: one kills its worker process on an input holding NaN (a
crash in native code, which no exception handler sees)."""

import os

import torch
from torch import nn


class Poisoned(nn.Module):
    def forward(self, x):
        if torch.isnan(x).any():
            os._exit(70)
        return {"y": x[:, :2] * 2}


def model(spec=None) -> nn.Module:
    return Poisoned()


class SmallBatchesOnly(nn.Module):
    """Raises on a batch of 4 items or more (tests/test_failures.py, calibrate)."""

    def forward(self, x):
        if len(x) >= 4:
            raise RuntimeError("batch too big for this model")
        return {"y": x[:, :2] * 2}


def small_batches_only(spec=None) -> nn.Module:
    return SmallBatchesOnly()


class ReturnsATuple(nn.Module):
    """Its forward returns a tuple, not the dict of tensors by output name a worker answers from."""

    def forward(self, x):
        return (x[:, :2],)


def returns_a_tuple(spec=None) -> nn.Module:
    return ReturnsATuple()
