"""DraftModelProposer: a small model with the target's tokenizer drafts k tokens greedily
(vLLM's draft_model method), run by the worker with a KV cache of its own.

The draft's cache has the target's block layout (same block ids, same block size), so the
persistent batch's block tables serve both; the scheduler allocates k slots past the verified
ones (Scheduler.num_lookahead) for the draft's own k - 1 steps. After each step the draft
first catches up over the request's tokens it has not run (its whole prompt for a new or
resumed request; then the accepted tokens and the sampled one), drafting d_1 from the last
of them, then runs k - 1 one-token steps. Its KV past the known tokens (the drafts) is
recomputed next time, so rejected drafts leave nothing behind."""
from __future__ import annotations

import numpy as np
import torch

from workers.kv_cache_memory import KVCacheSpec
from workers.step_inputs import attention_metadata, host_inputs


class DraftModelProposer:
    collective = True   # propose() (in finish()) runs the draft model: TP collectives, in step order on every rank

    def __init__(self, spec, runner):
        from workers.model_loader import kv_cache_shape, load_model
        cfg = runner.config
        self.k = spec.num_speculative_tokens
        self.model = load_model(spec.model, runner.dtype, runner.device, cfg.load_format, False, cfg.model_impl)
        self.kv_spec = KVCacheSpec(*kv_cache_shape(self.model), cfg.block_size, runner.dtype)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.computed: dict[str, tuple[int, int]] = {}   # req id -> (id of its state, tokens whose KV the draft holds)

    def allocate(self, num_blocks: int, device: torch.device) -> None:
        s = self.kv_spec
        shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=s.dtype, device=device), torch.zeros(shape, dtype=s.dtype,
                                                                                          device=device))
                          for _ in range(s.num_layers)]

    def _run(self, runner, states, start: np.ndarray, num: np.ndarray,
             input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The draft over each request's tokens start .. start + num - 1 (runner.batch.token_ids,
        or input_ids on the device): the argmax of its last token's logits, per request."""
        slots = np.fromiter((s.slot for s in states), dtype=np.int64, count=len(states))
        host = host_inputs(runner.batch, num, start, slots, runner.block_size)
        device = runner.h2d.upload(host)
        attn = attention_metadata(host, device, num, runner.backend)
        ids = device.input_ids if input_ids is None else input_ids
        hidden = self.model(ids, device.positions, self.kv_caches, attn)
        last = torch.from_numpy(host.query_start_loc[1:].astype(np.int64) - 1).to(hidden.device)
        return self.model.compute_logits(hidden.index_select(0, last)).argmax(dim=-1)

    @torch.inference_mode()
    def propose(self, runner, states) -> dict[str, list[int]]:
        live = {st.req_id for st in runner.batch.requests.values()}
        self.computed = {r: v for r, v in self.computed.items() if r in live}
        n_tok = np.fromiter((s.num_tokens for s in states), dtype=np.int64, count=len(states))
        done = np.fromiter((self.computed.get(s.req_id, (0, 0))[1] if self.computed.get(s.req_id, (0,))[0] == id(s)
                            else 0 for s in states), dtype=np.int64, count=len(states))
        room = np.fromiter((s.num_blocks * runner.block_size for s in states), dtype=np.int64, count=len(states))
        k = int(min(self.k, (np.minimum(room, runner.config.max_model_len) - n_tok).min() + 1))   # the lookahead
        # slots the scheduler allocated (and the persistent batch's width)
        if k < 1:
            return {}
        drafts = [self._run(runner, states, done, n_tok - done)]
        for st, n in zip(states, n_tok.tolist()):
            self.computed[st.req_id] = (id(st), n)
        ones = np.ones(len(states), dtype=np.int64)
        for j in range(1, k):   # d_j goes in at position N - 1 + j, straight from the device (no sync)
            drafts.append(self._run(runner, states, n_tok - 1 + j, ones, drafts[-1]))
        out = torch.stack(drafts, dim=1).tolist()
        return {st.req_id: d for st, d in zip(states, out)}
