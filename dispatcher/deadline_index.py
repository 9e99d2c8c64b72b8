"""The tightest deadline among a queue's requests, in O(log n) amortised per request.

A lazy-deletion min-heap kept beside a ``ModelQueue`` by the policy (the queue itself stays
plain FIFOs). New requests are found without scanning: arrivals are appended at a class's
tail and retries pushed at its head, so ``sync`` walks each class from both ends only until
it meets a request it already knows. ``sync`` must run before aging moves requests between
classes (an aged request appended behind unseen arrivals would stop the walk early).
Requests leave the index when the policy dispatches them (``discard``) or when their
deadline passes; a request cancelled out of the queue (or dispatched by another path) stays
until its deadline passes or the heap holds more such entries than live ones (it can only make
the policy flush early, never late), and everything is forgotten whenever the queue is empty
(MCB syncs an empty queue's index too).
"""

from __future__ import annotations

import heapq
import math

from .state import ModelQueue, Request


class DeadlineIndex:
    __slots__ = ("queue", "_heap", "_known", "_tie")

    def __init__(self, queue: ModelQueue):
        self.queue = queue
        self._heap: list = []  # (deadline, tiebreak, request)
        self._known: set = set()  # requests seen in the queue and not dispatched since
        self._tie = 0

    def sync(self) -> None:
        """Index the requests pushed since the last call."""
        if self.queue.requests == 0:
            self._heap.clear()
            self._known.clear()
            return
        for dq in self.queue.by_priority:
            for r in reversed(dq):  # arrivals, at the tail
                if r in self._known:
                    break
                self._add(r)
            for r in dq:  # retries, at the head
                if r in self._known:
                    break
                self._add(r)

    def _add(self, r: Request) -> None:
        self._known.add(r)
        if r.deadline < math.inf:
            self._tie += 1
            heapq.heappush(self._heap, (r.deadline, self._tie, r))

    def discard(self, reqs: list[Request]) -> None:
        for r in reqs:
            self._known.discard(r)
        if len(self._heap) > 2 * len(self._known) + 64:
            # Entries of requests gone below a live one with a nearer deadline never reach the
            # top: with 1-hour timeouts, every request served stayed, and its payload with it.
            self._heap = [e for e in self._heap if e[2] in self._known]
            heapq.heapify(self._heap)

    def tightest(self, now: float) -> float:
        """Earliest deadline still ahead among the indexed requests (inf if none). A passed
        deadline is dropped: that request is expired, the caller's to remove."""
        h = self._heap
        while h and (h[0][0] <= now or h[0][2] not in self._known):
            # Forgotten as well: a queue that never empties (sustained overload) kept every
            # expired request, and with it the payload its frames hold (451 MiB in 10 s of
            # 64 KiB requests). Still queued, it is at most walked again by ``sync``.
            self._known.discard(heapq.heappop(h)[2])
        return h[0][0] if h else math.inf

    def tightest_request(self, now: float):
        """The request of ``tightest``'s deadline (None if none)."""
        return self._heap[0][2] if self.tightest(now) < math.inf else None
