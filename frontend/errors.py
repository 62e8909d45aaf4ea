"""Errors the frontend maps to HTTP status codes."""
from frontend.engine_client import EngineDeadError  # noqa: F401  (503)
from ipc.validation import RequestError  # noqa: F401  (400)


def engine_dead_message(reason) -> str:
    """What a client is told about a dead engine: the reason's last line, never a traceback (a
    worker's failure reaches the engine core as one, with file paths)."""
    lines = [ln.strip() for ln in str(reason or "").splitlines() if ln.strip()]
    return f"The engine is dead: {lines[-1] if lines else 'unknown reason'}"
