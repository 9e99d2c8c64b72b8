"""``batchyard calibrate``: measure T(B) on each worker of a node and write a profile file.

Each configured worker is started on its own (same config, same pinning) against a private
endpoint and fed batches of B zero-filled items; the worker's own compute time is recorded
(median of ``reps`` after one warm-up call per size, since oneDNN builds kernels per shape).
Run it before `batchyard up`, or on a drained node: it competes for the same cores.
The dispatcher loads the file (``profile = "..."`` in [dispatcher]) and keeps refining the
curves online from every completed batch.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from batchyard.config import NodeConfig
from batchyard.cost_model import CostCurve


# Workers of one path whose times at a size differ by more than this are told apart in a warning.
UNALIKE = 1.25


class CalibrationFailed(RuntimeError):
    """A batch of the calibration failed: no profile is written."""


def _measured(worker: str, model: str, b: int, done) -> int:
    """The batch's compute time in us; CalibrationFailed when it did not run. A failed batch
    reports 0 us, and was taken as a measurement: the profile, written with exit 0, put
    T(4) at 0 ms, and the dispatcher then refused it."""
    bad = next((r for r in done.results if r.status != 0), None)
    if bad is not None or done.compute_us <= 0:
        why = bad.message if bad is not None else "it reported no compute time"
        raise CalibrationFailed(f"{worker} {model} B={b}: the batch failed: {why}")
    return done.compute_us


def calibrate(node: NodeConfig, out: str | Path, sizes: list[int] | None = None, reps: int = 5,
              workers: list[str] | None = None, log=print) -> dict:
    from batchyard.cli import output_problem

    from .harness import DirectWorker
    from .runtime import powers_of_two

    why = output_problem(str(out))
    if why:  # before measuring: the profile was lost after every worker had been measured
        raise CalibrationFailed(f"--out {str(out)!r}: {why}; nothing measured")
    # model -> path -> B -> each worker's median: the dispatcher keeps one curve per (model,
    # path), so workers of one path give one point per size (two AMX workers of node0.toml wrote
    # every size twice, and the dispatcher refused the profile they made)
    times: dict[str, dict[str, dict[int, list[float]]]] = {}
    # (model, path)s a simulated worker measured: their entries say "simulated" (DESIGN.md), so a
    # node that loads the profile can tell made-up times from its hardware's. A path measured
    # on simulated and real workers alike is simulated: its points mix the two.
    simulated: set[tuple[str, str]] = set()
    for w in node.workers:
        if workers and w.name not in workers:
            continue
        with DirectWorker(node, w.name) as dw:
            dw.wait_registered()
            for model in w.models:
                spec = dw.spec[model]
                if w.kind == "sim":  # the one kind whose executor is simulated (it registers so)
                    simulated.add((model, dw.path))
                bs = [b for b in (sizes or powers_of_two(spec.max_batch)) if b <= spec.max_batch]
                if not bs:
                    raise CalibrationFailed(f"{w.name} {model}: no batch size of {sizes} is within its max_batch "
                                            f"({spec.max_batch})")
                for b in bs:
                    req = dw.zeros_request(model, b)
                    _measured(w.name, model, b, dw.run(model, [req])[0])  # warm-up at this shape
                    t = statistics.median(_measured(w.name, model, b, dw.run(model, [req])[0])
                                          for _ in range(reps)) / 1e6
                    times.setdefault(model, {}).setdefault(dw.path, {}).setdefault(b, []).append(t)
                    log(f"{w.name} {model} [{dw.path}] B={b:<4d} {t * 1e3:8.3f} ms")
    profile: dict = {"models": {}}
    for model, by_path in times.items():
        for path, by_size in by_path.items():
            apart = [(b, min(ts), max(ts)) for b, ts in sorted(by_size.items()) if max(ts) > UNALIKE * min(ts)]
            if apart:
                # One curve a (model, path): it predicts the same time on each, the median, and
                # requests with short deadlines sent to the slower one failed there while the
                # faster one was idle. Nothing written tells them apart; the user must know.
                b, lo, hi = apart[0]
                log(f"warning: {model} [{path}]: its workers take different times ({lo * 1e3:.3f} to "
                    f"{hi * 1e3:.3f} ms at B={b}); the dispatcher keeps one cost curve a (model, path), the "
                    f"median of them, and predicts it for each worker (docs/policy.md)")
            pts = [(b, statistics.median(ts)) for b, ts in sorted(by_size.items())]
            curve = CostCurve.from_points(pts, simulated=(model, path) in simulated)
            profile["models"].setdefault(model, {})[path] = {"points": pts, **curve.describe()}
            log(f"{model} [{path}]: T(B) = {curve.launch_s * 1e3:.3f} ms + {curve.per_item_s * 1e3:.4f} ms*B, "
                f"R^2 {curve.r2:.3f}, using the {curve.mode} fit{' (SIMULATED device)' if curve.simulated else ''}")
    Path(out).write_text(json.dumps(profile, indent=1))
    return profile

