"""A model for tests/test_failures.py: it kills its worker process on an input holding NaN (a
crash in native code, which no exception handler sees) and is slow enough that requests sent
together queue into one batch."""

import os
import time

import torch
from torch import nn


class Poisoned(nn.Module):
    def forward(self, x):
        if torch.isnan(x).any():
            os._exit(70)
        time.sleep(0.2)
        return {"y": x[:, :2] * 2}


def model(spec=None) -> nn.Module:
    return Poisoned()
