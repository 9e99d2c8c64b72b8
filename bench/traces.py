"""Arrival traces for the simulator: arrival times (s), priority class, timeout (s; inf = none)."""

from __future__ import annotations

import csv
from dataclasses import dataclass

import numpy as np


@dataclass
class Trace:
    name: str
    arrivals: np.ndarray  # float64, sorted, seconds
    priority: np.ndarray  # int8: 0 high, 1 normal, 2 low
    timeout: np.ndarray  # float64 seconds, inf = no deadline

    def __len__(self) -> int:
        return len(self.arrivals)

    @property
    def duration(self) -> float:
        return float(self.arrivals[-1] - self.arrivals[0]) if len(self) > 1 else 0.0


def _trace(name, t) -> Trace:
    t = np.sort(np.asarray(t, dtype=np.float64))
    return Trace(name, t, np.ones(len(t), np.int8), np.full(len(t), np.inf))


def poisson(rate: float, n: int, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    return _trace(f"poisson {rate:.0f}/s", np.cumsum(rng.exponential(1.0 / rate, n)))


def _thinned(rate_fn, rate_max: float, duration: float, rng) -> np.ndarray:
    """Non-homogeneous Poisson by thinning (Lewis-Shedler)."""
    n = int(rate_max * duration * 1.2) + 100
    t = np.cumsum(rng.exponential(1.0 / rate_max, n))
    t = t[t < duration]
    keep = rng.random(len(t)) < rate_fn(t) / rate_max
    return t[keep]


def steps(levels: list[tuple[float, float]], duration: float, seed: int = 0) -> Trace:
    """Piecewise-constant rate: levels = [(start_s, rate), ...]."""
    starts = np.array([s for s, _ in levels])
    rates = np.array([r for _, r in levels])
    fn = lambda t: rates[np.searchsorted(starts, t, side="right") - 1]
    return _trace("steps " + "/".join(f"{r:.0f}" for r in rates), _thinned(fn, rates.max(), duration,
                                                                             np.random.default_rng(seed)))


def diurnal(mean: float, amplitude: float, period_s: float, duration: float, seed: int = 0) -> Trace:
    fn = lambda t: mean + amplitude * np.sin(2 * np.pi * t / period_s)
    return _trace(f"sine {mean:.0f}+-{amplitude:.0f}/s", _thinned(fn, mean + amplitude, duration,
                                                                   np.random.default_rng(seed)))


def bursts(low: float, high: float, mean_low_s: float, mean_high_s: float, duration: float, seed: int = 0) -> Trace:
    """Markov-modulated Poisson: alternates low/high rate with exponential sojourns."""
    rng = np.random.default_rng(seed)
    out, t, high_state = [], 0.0, False
    while t < duration:
        span = rng.exponential(mean_high_s if high_state else mean_low_s)
        rate = high if high_state else low
        k = rng.poisson(rate * span)
        out.append(t + rng.random(k) * span)
        t += span
        high_state = not high_state
    arr = np.concatenate(out)
    return _trace(f"bursts {low:.0f}/{high:.0f}/s", arr[arr < duration])


def with_classes(trace: Trace, probs=(0.2, 0.6, 0.2), timeouts=(np.inf, np.inf, np.inf), seed: int = 0) -> Trace:
    """Assign priority classes with ``probs`` and per-class timeouts (seconds)."""
    rng = np.random.default_rng(seed)
    prio = rng.choice(3, size=len(trace), p=probs).astype(np.int8)
    return Trace(trace.name + " +classes", trace.arrivals, prio, np.asarray(timeouts, np.float64)[prio])


def merge(*traces: Trace, name: str = "") -> Trace:
    order = np.argsort(np.concatenate([t.arrivals for t in traces]), kind="stable")
    cat = lambda attr: np.concatenate([getattr(t, attr) for t in traces])[order]
    return Trace(name or " + ".join(t.name for t in traces), cat("arrivals"), cat("priority"), cat("timeout"))


def replay(path: str) -> Trace:
    """CSV with a header: arrival_s[,priority][,timeout_s] (e.g. recorded by the bench harness)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    t = np.array([float(r["arrival_s"]) for r in rows])
    p = np.array([int(r.get("priority") or 1) for r in rows], np.int8)
    to = np.array([float(r.get("timeout_s") or "inf") for r in rows])
    order = np.argsort(t, kind="stable")
    return Trace(f"replay {path}", t[order], p[order], to[order])
