"""The engine core: one busy-loop process with the scheduler, the KV block
manager and the control state."""
