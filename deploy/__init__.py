"""Run-time assets shipped in the wheel: example node configs, systemd units, Triton model
repositories. ``asset("triton", "cpu")`` is their path whether Batchyard runs from a checkout or
from an installed wheel."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent


def asset(*parts: str) -> Path:
    return ROOT.joinpath(*parts)
