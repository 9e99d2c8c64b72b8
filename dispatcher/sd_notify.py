"""sd_notify(3) without a dependency: readiness and watchdog pings to systemd.

systemd (``Type=notify``) passes ``NOTIFY_SOCKET``, the path of a unix datagram socket (or an
abstract name written with a leading '@'); one datagram of ``KEY=VALUE`` lines is a message.
With ``WatchdogSec=`` it also passes ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``): a process that
does not send ``WATCHDOG=1`` within that time is killed and restarted. Outside systemd the
variables are absent and every call here does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Mapping, Optional

log = logging.getLogger("batchyard.sd_notify")

# What systemd set for this process only: a child (a worker started by `up`) must not inherit
# it, or its READY=1 is refused ("reception only permitted for main PID") and logged each time.
# `up` gives its dispatcher and front doors a socket and watchdog of its own instead.
NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def notify(message: str, env: Mapping[str, str] = os.environ) -> bool:
    """Send ``message`` (e.g. "READY=1") to systemd. False when not under systemd or when the
    send failed: a missing notification must never take a node down."""
    address = env.get("NOTIFY_SOCKET")
    if not address or address[0] not in "/@":  # vsock: addresses are not used by Batchyard
        return False
    if address[0] == "@":
        address = "\0" + address[1:]  # the Linux abstract namespace
    try:
        # Non-blocking: a receiver that does not read (net.unix.max_dgram_qlen is 10 here) made
        # sendto block, and an event loop pinging its watchdog froze.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as s:
            s.sendto(message.encode(), address)
    except OSError as e:
        log.warning("sd_notify %r to %s failed: %s", message, env.get("NOTIFY_SOCKET"), e)
        return False
    return True


def watchdog_interval_s(env: Mapping[str, str] = os.environ) -> Optional[float]:
    """How often to send WATCHDOG=1 (half the timeout, as sd_watchdog_enabled(3) advises), or
    None when no watchdog is armed for this process."""
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
        pid = int(env.get("WATCHDOG_PID", "0"))
    except ValueError:
        return None
    if usec <= 0 or (pid and pid != os.getpid()):
        return None
    return usec / 2e6


def child_env(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``env`` without systemd's notification variables, for the processes this one starts."""
    return {k: v for k, v in env.items() if k not in NOTIFY_ENV}


class LoopWatchdog:
    """WATCHDOG=1 from an asyncio event loop: a ping is sent only when the loop gets to run
    its callbacks, so a wedged loop stops the pings and systemd restarts the process."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: Optional[float], env: Mapping[str, str]):
        self._loop = loop
        self._interval_s = interval_s
        self._env = env
        self._handle: Optional[asyncio.TimerHandle] = None
        if interval_s is not None:
            self._handle = loop.call_soon(self._ping)

    def _ping(self) -> None:
        notify("WATCHDOG=1", self._env)
        self._handle = self._loop.call_later(self._interval_s, self._ping)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def announce_ready(loop: asyncio.AbstractEventLoop, env: Mapping[str, str] = os.environ) -> LoopWatchdog:
    """READY=1 now, then WATCHDOG=1 from ``loop`` at half of WATCHDOG_USEC. Call once the
    sockets are bound; ``close()`` the result before closing the loop."""
    notify("READY=1", env)
    return LoopWatchdog(loop, watchdog_interval_s(env), env)
