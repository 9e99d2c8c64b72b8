"""Client-side exceptions: one class per reply status, all under BatchyardError."""

from __future__ import annotations

import concurrent.futures

from .protocol import Status


class BatchyardError(Exception):
    status = Status.INTERNAL
    param = ""  # the request field it is about, where its engine named one (an LLM generation's refusal)

    def __init__(self, message: str, status: Status | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"{self.status.name}: {self.message}"


class Cancelled(BatchyardError, concurrent.futures.CancelledError):
    """Also a ``concurrent.futures.CancelledError``: ``Client.submit`` returns such a Future, and
    code written for one catches a cancelled call that way. (Not asyncio's CancelledError, which
    would read as the awaiting task's own cancellation.)"""

    status = Status.CANCELLED


class InvalidArgument(BatchyardError):
    status = Status.INVALID_ARGUMENT


class DeadlineExceeded(BatchyardError):
    status = Status.DEADLINE_EXCEEDED


class UnknownModel(BatchyardError):
    status = Status.UNKNOWN_MODEL


class PermissionDenied(BatchyardError):
    status = Status.PERMISSION_DENIED


class Overloaded(BatchyardError):
    status = Status.OVERLOADED


class InternalError(BatchyardError):
    status = Status.INTERNAL


class Unavailable(BatchyardError):
    status = Status.UNAVAILABLE


_BY_STATUS = {cls.status: cls for cls in
              (Cancelled, InvalidArgument, DeadlineExceeded, UnknownModel, PermissionDenied, Overloaded,
               InternalError, Unavailable)}


def error_for(status: int, message: str, param: str = "") -> BatchyardError:
    try:
        st = Status(status)
    except ValueError:
        return BatchyardError(f"unknown status {status}: {message}")
    e = _BY_STATUS.get(st, BatchyardError)(message)
    if param:
        e.param = param
    return e
