"""CPU affinity (``batchyard.affinity.pin_cpus``), NUMA memory binding and niceness for a worker process.

Must run *before* torch is imported: oneDNN/OpenMP size their thread pools from the affinity
mask they see at import (measured: pinned before import, the worker came up single-threaded).
Memory binding uses libnuma through ctypes when the host has it; without libnuma the worker
still runs, unbound, and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

from batchyard.affinity import each_thread

log = logging.getLogger("batchyard.worker")


def bind_numa_node(node: int | None) -> str:
    """Run on and allocate from NUMA ``node``. Returns a one-line description for the log."""
    if node is None:
        return "numa: not bound (no numa_node in config)"
    path = ctypes.util.find_library("numa") or "libnuma.so.1"
    try:
        numa = ctypes.CDLL(path, use_errno=True)
    except OSError:
        return f"numa: libnuma not found, node {node} binding skipped"
    if numa.numa_available() < 0:
        return "numa: kernel reports NUMA unavailable, binding skipped"
    max_node = numa.numa_max_node()
    if not 0 <= node <= max_node:
        raise ValueError(f"numa_node {node} does not exist (host has nodes 0..{max_node})")
    numa.numa_set_strict(1)
    allowed = os.sched_getaffinity(0)  # what systemd's CPUAffinity or taskset gave the process
    if numa.numa_run_on_node(node) != 0:
        raise OSError(ctypes.get_errno(), f"numa_run_on_node({node}) failed")
    # numa_run_on_node sets the mask to the whole node, past the one the process was given: a
    # worker under CPUAffinity=2 ran on every core of its node. Kept within both.
    within = allowed & os.sched_getaffinity(0)
    if not within:
        raise ValueError(f"numa_node {node} has none of the cpus this process may use ({sorted(allowed)})")
    each_thread(lambda tid: os.sched_setaffinity(tid, within))
    return f"numa: running on node {node} (of {max_node + 1}), {_bind_memory(numa, node)}"


MPOL_BIND = 2  # <linux/mempolicy.h>
MPOL_MODE = 0xFF  # get_mempolicy's mode without its flags (MPOL_F_STATIC_NODES 0x8000, ...)
MASK_BITS = 1024  # a node mask as wide as libnuma's default


def _bind_memory(numa, node: int) -> str:
    """Allocate only from ``node`` (MPOL_BIND), as the config promises: a preference
    (numa_set_preferred, used before) let memory spill to other nodes once the node filled, and it
    replaced a real bind the unit had set (NUMAPolicy=bind, numactl --membind) with that
    preference. A bind inherited from outside is kept as it is. The policy is this thread's and
    every thread it starts from now (the model's, ZeroMQ's, torch's): set before torch is imported.
    Threads started before it (OpenBLAS's, at numpy's import) keep their policy; they allocate
    little. A node the kernel will not bind to (one without memory, or outside this cpuset's
    memory nodes) leaves memory unbound, said in the log: the worker ran so before."""
    mode, mask = ctypes.c_int(), (ctypes.c_ulong * (MASK_BITS // 64))()
    # The mode comes with its flags (numactl --balancing, MPOL_F_STATIC_NODES): a bind all the same.
    if numa.get_mempolicy(ctypes.byref(mode), mask, MASK_BITS, None, 0) == 0 and mode.value & MPOL_MODE == MPOL_BIND:
        nodes = [n for n in range(MASK_BITS) if mask[n // 64] >> (n % 64) & 1]
        return f"memory bound to nodes {nodes} as inherited"
    mask = (ctypes.c_ulong * (MASK_BITS // 64))()
    mask[node // 64] = 1 << (node % 64)
    if numa.set_mempolicy(MPOL_BIND, mask, MASK_BITS) != 0:
        return (f"memory NOT bound: set_mempolicy(MPOL_BIND, node {node}) failed ({os.strerror(ctypes.get_errno())}: "
                f"a node without memory, or outside this cpuset's memory nodes)")
    return f"memory bound to node {node}"


def lower_priority(nice: int) -> int:
    """Raise the niceness of this process's every thread to ``nice`` (never lower it: that needs
    privilege). On Linux a nice value is per thread, and a thread takes its creator's: threads
    started before this (OpenBLAS's pool, which numpy starts at import) are set one by one, as
    ``pin_cpus`` does for affinity. Returns the niceness now in force."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= current:
        return current
    each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice))
    return nice
