"""Open-loop Poisson load through the asyncio SDK, recording each request's outcome."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Callable

from batchyard.client import AsyncClient
from batchyard.errors import BatchyardError


@dataclass
class Record:
    sent: float  # monotonic seconds
    latency_s: float  # client-observed, send to reply
    status: str  # "OK" or the error status name
    path: str = ""  # "cpu" | "gpu" for served requests; "gpu*" when the device was simulated
    batch_size: int = 0
    queue_us: int = 0
    compute_us: int = 0


async def poisson_load(address: str, model: str, make_inputs: Callable[[int], dict], rate: float,
                       duration: float, seed: int = 0, timeout: float = 10.0) -> list[Record]:
    """Send requests at exponential inter-arrival times (open loop: a slow reply never delays
    the next send) for ``duration`` seconds; return one record per request."""
    rng = random.Random(seed)
    records: list[Record] = []
    tasks = []
    async with AsyncClient(address) as client:
        await client.model_info(model)

        async def one(i: int) -> None:
            t0 = time.monotonic()
            try:
                res = await client.infer(model, make_inputs(i), timeout=timeout)
            except BatchyardError as e:
                records.append(Record(t0, time.monotonic() - t0, e.status.name))
                return
            tm = res.timing
            records.append(Record(t0, time.monotonic() - t0, "OK", tm.path + ("*" if tm.simulated else ""), tm.batch_size,
                                  tm.queue_us, tm.compute_us))

        start = time.monotonic()
        next_at = start
        i = 0
        while next_at < start + duration:
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the open-loop schedule, not synchronisation
            tasks.append(asyncio.ensure_future(one(i)))
            i += 1
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return records
