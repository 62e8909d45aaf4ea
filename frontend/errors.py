"""Errors the frontend maps to HTTP status codes."""
from engine_core.client import EngineDeadError  # noqa: F401  (503)


class RequestError(ValueError):
    """A bad request (400), naming the offending parameter when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
