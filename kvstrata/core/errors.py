"""Errors a request is refused with before anything is queued: the caller's input to change."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request that can never run, and which of its inputs the caller should change: "prompt"
    (or its messages) or "max_tokens". Raised before anything is queued."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param
