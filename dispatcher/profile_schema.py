"""The calibration profile's shape (``batchyard calibrate --out``; ``[dispatcher] profile``),
checked by msgspec as the file is read. Keys ``calibrate`` writes beside the points (the fit's
description) are allowed; the points are what is read. Each (model, path) entry is decoded on
its own so an error names them (msgspec writes a dict key as ``[...]``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

BatchSize = Annotated[int, msgspec.Meta(ge=1)]
Seconds = Annotated[float, msgspec.Meta(gt=0)]


class PathProfile(msgspec.Struct):
    points: Annotated[list[tuple[BatchSize, Seconds]], msgspec.Meta(min_length=1)]


class Profile(msgspec.Struct):
    models: dict[str, dict[str, msgspec.Raw]]
