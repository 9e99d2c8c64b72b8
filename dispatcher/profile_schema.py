"""The calibration profile's shape (``batchyard calibrate --out``; ``[dispatcher] profile``),
checked by msgspec as the file is read. Keys ``calibrate`` writes beside the points (the fit's
description) are allowed; the points and the simulated mark are what is read. Each (model, path) entry is decoded on
its own so an error names them (msgspec writes a dict key as ``[...]``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

BatchSize = Annotated[int, msgspec.Meta(ge=1)]
# One batch's compute time. At most an hour: no batch of a served model takes longer (a request
# waits default_timeout_s, 30 s, by default), so a larger number is a unit slip or a broken
# file, and 1e300 overflowed the curve's least-squares fit (its squares pass float's range):
# a traceback at config load and exit 1, which systemd restarts, instead of this key's message.
MAX_BATCH_SECONDS = 3600.0
Seconds = Annotated[float, msgspec.Meta(gt=0, le=MAX_BATCH_SECONDS)]


class PathProfile(msgspec.Struct):
    points: Annotated[list[tuple[BatchSize, Seconds]], msgspec.Meta(min_length=1)]
    # Measured on a simulated device (calibrate marks it); absent in profiles written before: false.
    simulated: bool = False


class Profile(msgspec.Struct):
    models: dict[str, dict[str, msgspec.Raw]]
