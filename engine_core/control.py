"""Control state: pause and sleep. Owned by the engine core, so every API server
and attached client sees the same answer."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable


class PauseState(enum.Enum):
    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"   # new requests queue; running ones keep stepping
    PAUSED_ALL = "paused_all"   # everything frozen


@dataclass
class ControlState:
    pause: PauseState = PauseState.UNPAUSED
    asleep: set[str] = field(default_factory=set)   # parts put to sleep: a subset of SLEEP_TAGS
    sleep_level: int = 0

    @property
    def can_step(self) -> bool:
        return not self.asleep and self.pause != PauseState.PAUSED_ALL

    @property
    def admits_new(self) -> bool:
        return self.pause == PauseState.UNPAUSED

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)


@dataclass
class Deferred:
    """A utility result that is ready only once `done()` holds (pause in wait mode, a trainer's
    group forming). An exception from `done()` is the call's failure."""
    done: Callable[[], bool]
    result: Any = None
