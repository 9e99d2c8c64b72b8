"""Cost curves of the LLM mode, learned from measured engine steps. Pure, no I/O.

Each curve is linear in a few features (prefill: a + b·Σtokens + c·Σtokens²; decode step:
a + b·streams; KV move: a + b·tokens), so one small least-squares fit serves all of them.
Calibration samples (measured by the worker before it registers) seed the fit and stay in it;
online samples from every completion are kept in a bounded window, so the curve follows the
machine (another tenant, thermal state) without forgetting the shape the calibration pinned.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .llm_routing import DecodeCurve, KvLink, LlmCurves, PrefillCurve

ONLINE_WINDOW = 64  # recent samples kept per curve
REFIT_EVERY = 4  # a refit costs ~50 us; prefill completions come a few per second
MIN_SECONDS = 1e-9  # a sample below this is no measurement


class LinearFit:
    """y ≈ features · coef, coef ≥ 0 (a negative launch cost or slope is noise, not physics)."""

    def __init__(self, n_features: int, fallback: tuple[float, ...]):
        self.n = n_features
        self.coef = np.array(fallback, dtype=float)
        self.seed: dict[str, list[tuple[tuple[float, ...], float]]] = {}  # by the worker that measured them
        self.recent: deque = deque(maxlen=ONLINE_WINDOW)
        self._since_fit = 0
        self.samples = 0

    def add(self, x: tuple[float, ...], y: float, calibration: bool = False, source: str = "") -> None:
        # Under a nanosecond is no engine step: 1/y, the row's weight, overflowed (5e-324 s from
        # a worker's calibration), the fit raised at every refit, and the requests of each job
        # whose completion refitted were stranded.
        if not (MIN_SECONDS <= y and np.isfinite(y) and all(np.isfinite(v) for v in x)):
            return
        (self.seed.setdefault(source, []) if calibration else self.recent).append((tuple(x), float(y)))
        self.samples += 1
        self._since_fit += 1
        if calibration or self._since_fit >= REFIT_EVERY:
            self.refit()

    def refit(self) -> None:
        self._since_fit = 0
        rows = [row for rows in self.seed.values() for row in rows] + list(self.recent)
        if len(rows) < 2:
            if rows:  # one sample: keep the shape, scale to it
                x, y = rows[0]
                pred = float(np.dot(x, self.coef))
                if pred > 0:
                    self.coef = self.coef * (y / pred)
            return
        X = np.array([r[0] for r in rows], dtype=float)
        y = np.array([r[1] for r in rows], dtype=float)
        # Relative error matters (a 5 ms prefill and a 2 s one): weight rows by 1/y.
        w = 1.0 / y
        try:
            coef = _nonneg_lstsq(X * w[:, None], y * w)
        except np.linalg.LinAlgError:  # degenerate rows: keep the coefficients there are
            coef = None
        if coef is not None:
            self.coef = coef

    def predict(self, x: tuple[float, ...]) -> float:
        return float(np.dot(x, self.coef))


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray):
    """Least squares with coef ≥ 0: drop the most negative feature and refit (few features,
    so this small active-set loop ends in at most n passes)."""
    active = list(range(X.shape[1]))
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef = np.zeros(X.shape[1])
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return None


def kv_link(latency_s: float, s_per_token: float) -> KvLink:
    # KvLink speaks bytes and bandwidth; the learned curve is seconds per token.
    return KvLink(bytes_per_token=1.0, bandwidth_Bps=1.0 / s_per_token if s_per_token > 0 else float("inf"),
                  latency_s=latency_s)


def curves_from_describe(desc: dict) -> LlmCurves:
    """The routing curves back from ``LearnedCurves.describe()`` (e.g. a dispatcher's status)."""
    c = {name: [float(v) for v in entry["coef"]] for name, entry in desc.items()}
    return LlmCurves(PrefillCurve(*c["cpu_prefill"]), PrefillCurve(*c["gpu_prefill"]), DecodeCurve(*c["gpu_decode"]),
                     kv_link(*c["kv"]))


def prefill_features(prompts) -> tuple[float, float, float]:
    return (1.0, float(sum(prompts)), float(sum(n * n for n in prompts)))


class LearnedCurves:
    """The four curves of one LLM model, as llm_routing's dataclasses on demand."""

    def __init__(self):
        # Fallbacks only until the first calibration arrives: the shape of VLLM_CPU.md's tiny model.
        self.cpu_prefill = LinearFit(3, (4e-3, 1e-4, 0.0))
        self.gpu_prefill = LinearFit(3, (4e-3, 1e-4, 0.0))
        self.gpu_decode = LinearFit(2, (4e-3, 1e-4))
        self.kv = LinearFit(2, (1e-3, 1e-6))

    def seed_engine(self, role: str, prefill, decode, source: str = "") -> None:
        """The calibration of engine ``source``, replacing any it sent before."""
        target = self.cpu_prefill if role == "prefill-cpu" else self.gpu_prefill
        for fit in (self.cpu_prefill, self.gpu_prefill, self.gpu_decode):
            fit.seed.pop(source, None)
        for s in prefill:
            target.add(prefill_features(s.prompts), s.seconds, calibration=True, source=source)
        if role == "gpu":
            for streams, seconds in decode:
                self.gpu_decode.add((1.0, float(streams)), seconds, calibration=True, source=source)
        for fit in (self.cpu_prefill, self.gpu_prefill, self.gpu_decode):
            fit.refit()  # also where its new calibration added nothing

    def prefill(self, role: str) -> PrefillCurve:
        return PrefillCurve(*map(float, (self.cpu_prefill if role == "prefill-cpu" else self.gpu_prefill).coef))

    def decode(self) -> DecodeCurve:
        return DecodeCurve(*map(float, self.gpu_decode.coef))

    def kv_link(self) -> KvLink:
        return kv_link(*map(float, self.kv.coef))

    def routing(self) -> LlmCurves:
        return LlmCurves(self.prefill("prefill-cpu"), self.prefill("gpu"), self.decode(), self.kv_link())

    def describe(self) -> dict:
        # Six significant digits, not nine decimals of a second: a prefill's per-token-squared term
        # (4e-10 s) read 0 on /metrics and in status.
        return {name: {"coef": [float(f"{float(v):.6g}") for v in fit.coef], "samples": fit.samples}
                for name, fit in (("cpu_prefill", self.cpu_prefill), ("gpu_prefill", self.gpu_prefill),
                                  ("gpu_decode", self.gpu_decode), ("kv", self.kv))}
