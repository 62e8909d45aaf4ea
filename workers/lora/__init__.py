"""Multi-LoRA serving in the workers: PEFT adapters (peft.py), their GPU slots on the base linears
(layers.py), and the per-worker slot and LRU bookkeeping (manager.py)."""
