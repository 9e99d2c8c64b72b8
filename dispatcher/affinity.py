"""CPU affinity of a node process: every thread of it, including the ones already started."""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional


def pin_cpus(cpus: tuple[int, ...]) -> list[int]:
    """Restrict this process, every thread of it, to ``cpus`` (empty: leave as is). Returns the
    effective set."""
    if cpus:
        available = os.sched_getaffinity(0)
        bad = set(cpus) - available
        if bad:
            raise ValueError(f"cpus {sorted(bad)} are not available to this process (have {sorted(available)})")
        # An affinity set through pid 0 binds the calling thread only. Threads started before
        # this (OpenBLAS's pool, which numpy starts at import; ZeroMQ's I/O thread) kept every
        # core of the mask the process inherited: seen on a worker started with two cores and
        # pinned to one.
        each_thread(lambda tid: os.sched_setaffinity(tid, cpus))
    return sorted(os.sched_getaffinity(0))


def each_thread(apply: Callable[[int], object]) -> None:
    """``apply(tid)`` for every thread of this process (affinity and niceness are per thread on
    Linux, and a thread takes its creator's only when it starts); one that ends meanwhile is
    skipped."""
    for tid in os.listdir("/proc/self/task"):
        try:
            apply(int(tid))
        except (ProcessLookupError, FileNotFoundError):
            pass


def pin_node_process(cpus: tuple[int, ...], table: str, log: logging.Logger) -> Optional[list[int]]:
    """``pin_cpus`` for the dispatcher or a front door (``table``: the config table that names
    ``cpus``), before it starts threads, which inherit the mask. None, said in one line, when a
    cpu is online but outside the mask the process was started with (systemd's CPUAffinity):
    the caller exits EX_CONFIG."""
    try:
        return pin_cpus(cpus)
    except ValueError as e:
        log.error("[%s] cpus: %s", table, e)
        return None
    except OSError as e:  # sched_setaffinity refused (a seccomp filter, a container's policy)
        log.error("[%s] cpus: pinning to %s refused: %s", table, list(cpus), e.strerror or e)
        return None
