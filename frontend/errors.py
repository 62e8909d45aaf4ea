"""Errors the frontend maps to HTTP status codes."""
from engine_core.client import EngineDeadError  # noqa: F401  (503)
from ipc.validation import RequestError  # noqa: F401  (400)
