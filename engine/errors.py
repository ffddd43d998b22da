"""Errors the engine raises to its callers (torch-free, so the server can import them before the model loads)."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request that can never be served as asked; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can make progress."""


class WorkerDied(RuntimeError):
    """A worker rank (tensor- or pipeline-parallel) exited or stopped answering: the engine cannot run without it."""


class AdapterError(ValueError):
    """A LoRA adapter that cannot serve: unreadable, for another base model, or a feature the engine does not run."""
