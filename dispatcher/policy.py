"""Batching policies: ``decide(state, now) -> Decision``. Pure: no I/O, no wall clock.

The live dispatcher calls ``decide`` after every drain of its sockets and arms its one-shot
timer for ``Decision.wake_at``; the simulator (bench/simulator.py) calls the same objects on
a virtual clock. ``decide`` takes requests off the queues and reserves worker slots in the
state (``state.on_dispatch``); the caller sends the batches.

Policies, by config/CLI name:
- ``mcb``                 Marginal Cost Batching (the default; policy_mcb.py, docs/policy.md)
- ``three-segment``       the seeds' literal rule, B1/B2 derived from the learned curves
- ``gpu-only``            the GPU path alone, greedy: a free GPU takes all queued, up to max batch
- ``greedy``              any free worker takes all queued, up to its max batch
- ``escape:K``            a free GPU takes all queued (up to max batch); a free CPU at most K requests
- ``fixed:N``             wait for N items (or ``FIXED_MAX_WAIT_S``), then any free worker
- ``window:US,N``         Triton's dynamic batcher: N items or US microseconds, any free worker
"""

from __future__ import annotations

import re

from .policy_baselines import (FIXED_MAX_WAIT_S, Escape, FixedBatch, GpuOnly, Greedy, ThreeSegment, TimeWindow,
                               crossover_sizes, marginal_wait_pays)
from .policy_core import AGING_S, Decision, Dispatch, PerModelPolicy, feasible, servers_for
from .policy_mcb import RESERVE_BLOCKING, URGENT_RATE, MarginalCost, plan

__all__ = ["AGING_S", "FIXED_MAX_WAIT_S", "RESERVE_BLOCKING", "URGENT_RATE", "Decision", "Dispatch", "Escape",
           "FixedBatch", "GpuOnly", "Greedy", "MarginalCost", "PerModelPolicy", "ThreeSegment", "TimeWindow",
           "crossover_sizes", "feasible", "make_policy", "marginal_wait_pays", "plan", "servers_for"]

USAGE = "'window:<max_delay_us>,<max_batch>', 'fixed:<N>' or 'escape:<K>'"


def make_policy(spec: str):
    """Build a policy from its config/CLI name (see the module docstring)."""
    name, sep, args = spec.partition(":")
    simple = {"greedy": Greedy, "gpu-only": GpuOnly, "mcb": MarginalCost, "three-segment": ThreeSegment}
    if name in simple:
        if sep:  # "mcb:" was taken as mcb: a typo, or a setting it has not, swallowed
            raise ValueError(f"{spec!r}: policy {name!r} takes no ':' setting; write {name!r}")
        return simple[name]()

    def number(text: str) -> int:
        # ASCII digits only: int() takes "1_0", " 2" and other scripts' digits, which no config means.
        if not re.fullmatch(r"[0-9]+", text):
            raise ValueError
        return int(text)

    try:
        if name == "window":
            delay_us, max_batch = (number(x) for x in args.split(","))
            if delay_us < 0 or max_batch < 1:
                raise ValueError
            return TimeWindow(delay_us / 1e6, max_batch)
        if name in ("fixed", "escape"):
            n = number(args)
            if n < 1:
                raise ValueError
            return FixedBatch(n) if name == "fixed" else Escape(n)
    except (ValueError, OverflowError):  # (a delay of 400 digits: no float holds it)
        raise ValueError(f"{spec!r}: expected {USAGE}") from None
    raise ValueError(f"unknown policy {spec!r}; expected one of {sorted(simple)}, {USAGE}")
