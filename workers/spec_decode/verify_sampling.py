"""A verify step's sampling parameters from one row per request, not one per token.

Each request's k + 1 logits rows share its parameters; only the output index (the random
stream's index: the position the row's token lands at) differs, by the row's offset. A
verify step that the decode graph's head samples (every row plain: no adjustments, so no
per-row bans) needs only the plain fields, so the per-token SamplingRows and the walk over
them (~40 rows at batch 8, k = 4: a tenth of a millisecond of host time on the critical path
of every verify step) are built from the B request rows by numpy indexing
(LOOM_SPEC_FAST_HOST=0: per token, as before, for A/B runs)."""
from __future__ import annotations

import numpy as np

from workers.sampler import SamplingArrays
from workers.spec_decode.verify_layout import SpecLayout


def first_landings(spec: SpecLayout) -> np.ndarray:
    """The position each sampled request's first logits row draws (its lowest output index)."""
    return spec.landing[spec.rows[:, 0]]


def per_token_params(per_request: SamplingArrays[np.ndarray], spec: SpecLayout) -> SamplingArrays[np.ndarray]:
    """The per-request plain parameters (each at its first landing) expanded to the step's logits
    rows: row r takes its request's fields, its output index advanced by its offset."""
    if per_request.adjusts:
        raise ValueError("per-request verify parameters hold no adjustments (per-row bans differ)")
    req = spec.request
    out = object.__new__(SamplingArrays)   # (the fields by name, as HostToDevice copies these structures)
    out.__dict__ = {name: None if v is None else v[req] for name, v in per_request.__dict__.items()}
    out.output_indices += spec.landing - first_landings(spec)[req]
    return out
