"""The floating-point precision a CPU worker runs its model in (``[[workers]] precision``).

bf16 halves the weights' memory traffic, and where the CPU multiplies bf16 natively (AMX tiles,
``amx_bf16``; AVX-512 ``avx512_bf16``; Arm's ``bf16``) oneDNN runs the matrix multiplies in it.
Without one of those, PyTorch's bf16 matrix multiplies are far slower than its fp32 ones: on an
AMD EPYC with AVX2 only, a 512×512 matmul took 220 ms in bf16 against 1.9 ms in fp32, and one
thread ran MiniLM-L6 at 3.2 items/s. ``auto`` (the default) takes bf16 only where it is native.
"""

from __future__ import annotations

from typing import Optional

NATIVE_BF16 = frozenset({"amx_bf16", "avx512_bf16", "bf16"})  # x86 flags; Arm's feature name


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty where the file is not."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def resolve(precision: str, flags: Optional[frozenset] = None) -> str:
    """``bf16`` or ``fp32``: the one asked for, or for ``auto`` bf16 where the CPU has it natively."""
    if precision != "auto":
        return precision
    return "bf16" if NATIVE_BF16 & (cpu_flags() if flags is None else flags) else "fp32"


def torch_dtype(precision: str):
    import torch  # only in the processes that run a model, after they pinned themselves

    return {"bf16": torch.bfloat16, "fp32": torch.float32}[resolve(precision)]
