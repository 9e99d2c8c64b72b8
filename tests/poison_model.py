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


class ReturnsArrays(nn.Module):
    """Returns numpy arrays, not tensors: the error named the dict, not the output."""

    def forward(self, x):
        return {"y": x[:, :2].float().numpy()}


def returns_arrays(spec=None) -> nn.Module:
    return ReturnsArrays()


class RaisesAlways(nn.Module):
    """Its layer does not fit its spec's 4 input features: every call raises (as PyTorch does)."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 2)

    def forward(self, x):
        return {"y": self.layer(x)}


def raises_always(spec=None) -> nn.Module:
    return RaisesAlways()


class ScalesItsInputInPlace(nn.Module):
    """Writes into its input (x.mul_), as in-place normalising does."""

    def forward(self, x):
        x.mul_(100)
        return {"y": x[:, :2]}


def scales_its_input_in_place(spec=None) -> nn.Module:
    return ScalesItsInputInPlace()


class OutOfMemoryOnce(nn.Module):
    """Its first call finds no memory (a killed predecessor's not yet freed), as
    torch.cuda.OutOfMemoryError says it."""

    def forward(self, x):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def out_of_memory(spec=None) -> nn.Module:
    return OutOfMemoryOnce()


def store_down(spec=None) -> nn.Module:
    """Its weights store refuses the connection: a failure a restart may not meet again."""
    raise ConnectionRefusedError("the weights store refused the connection")


def fails_while_flagged(spec=None) -> nn.Module:
    """Raises while the file BATCHYARD_TEST_FAIL_FLAG names exists (a factory failing for a while:
    tests/test_up_lifecycle.py); else ``Poisoned``."""
    if os.path.exists(os.environ.get("BATCHYARD_TEST_FAIL_FLAG", "")):
        raise RuntimeError("the test's flag is up")
    return Poisoned()
