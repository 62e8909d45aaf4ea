"""EagleProposer: an EAGLE-1 or EAGLE-3 head (workers/models/llama_eagle.py) drafts k tokens per
request right behind each step, on the device (vLLM's v1/spec_decode/eagle.py).

After the target's forward and sampling (ModelRunner.launch calls on_sampled), the head runs
over every token the step computed, its input at position i being (token i + 1, the target's
hidden state at i): the next token is the step's next input, the prompt's next token at the
end of a prompt chunk, and the sampled token (on the device) after a request's last accepted
token. That writes the head's own KV cache (one layer, the target's block layout and block
ids, so the persistent batch's block tables and the scheduler's lookahead slots serve both),
and gives d_1 at each sampled request's last accepted position; k - 1 one-token steps follow,
each feeding the head its own output. Rejected positions' KV is rewritten by the next step's
pass before anything reads it. Nothing waits for the host: the accepted count, the sampled
tokens and the drafts stay on the device, and the drafts travel back with the step's tokens
(PendingStep.spec_drafts, in the copy that finish() waits for). The k - 1 draft steps replay as
one CUDA graph per batch size (workers/spec_decode/eagle_graphs.py), captured with the decode graphs.

EAGLE-3's input is three of the target's residual streams (AuxHiddenStates), captured by hooks
into one persistent buffer, so that the target's CUDA graphs capture the copies too."""
from __future__ import annotations

import functools

import numpy as np
import torch

from workers.attention import AttentionMetadata
from workers.host_to_device import HostToDevice
from workers.kv_cache_memory import KVCacheSpec
from workers.models.llama_eagle import default_aux_layers, load_eagle_head, target_language_model
from workers.step_inputs import num_decodes


class AuxHiddenStates:
    """EAGLE-3's auxiliary hidden states: the residual stream entering each auxiliary layer
    (vLLM's hidden_states + residual before the layer), side by side in `buffer` [rows, 3H].
    A forward hook on the layer's self-attention reads it there: its second output is that sum
    (the input norm is fused into the qkv projection, so the sum exists on every path)."""

    def __init__(self, layers, layer_ids: tuple[int, ...], rows: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        bad = [i for i in layer_ids if not 0 <= i < len(layers) or not hasattr(layers[i], "self_attn")]
        if bad:
            raise ValueError(f"EAGLE-3: auxiliary layers {bad} are not decoder layers of the target "
                             f"({len(layers)} layers)")
        self.hidden_size = hidden_size
        self.buffer = torch.zeros(rows, len(layer_ids) * hidden_size, dtype=dtype, device=device)
        self.handles = [layers[i].self_attn.register_forward_hook(functools.partial(self._capture, j))
                        for j, i in enumerate(layer_ids)]

    def _capture(self, j: int, module, args, output) -> None:
        stream = output[1]
        t = stream.shape[0]
        if t > self.buffer.shape[0]:   # (an eager step above the sizes planned for; never during capture)
            self.buffer = torch.zeros(t, self.buffer.shape[1], dtype=self.buffer.dtype, device=self.buffer.device)
        h = self.hidden_size
        self.buffer[:t, j * h:(j + 1) * h].copy_(stream)


class EagleProposer:
    on_device = True   # drafts inside launch(): ModelRunner.propose picks them from the step

    def __init__(self, spec, runner):
        cfg = runner.config
        self.k = spec.num_speculative_tokens
        self.limit = spec.disable_by_batch_size
        self.max_model_len = cfg.max_model_len
        self.head = load_eagle_head(spec.model, spec.method, runner.model, runner.dtype, runner.device,
                                    cfg.load_format, cfg.max_model_len + self.k)
        self.kv_spec = KVCacheSpec(*self.head.kv_cache_shape, cfg.block_size, runner.dtype)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.h2d = HostToDevice(runner.device)   # its own pinned buffers: the runner's alternate per step
        self.aux = None
        if spec.method == "eagle3":
            lm = target_language_model(runner.model)
            ids = self.head.hc.aux_layer_ids or default_aux_layers(len(lm.model.layers))
            rows = -(-max(cfg.max_num_batched_tokens, cfg.max_num_seqs * (self.k + 1)) // 16) * 16
            self.aux = AuxHiddenStates(lm.model.layers, ids, rows, self.head.hc.target_hidden_size, runner.dtype,
                                       runner.device)
        self.deferred: dict[int, tuple] = {}   # id(step) -> (batch, hidden, aux) while its sampling waits
        self.backend = runner.backend
        self.graphs = None   # DraftGraphs, captured with the decode graphs (capture())

    def allocate(self, num_blocks: int, device: torch.device) -> None:
        s = self.kv_spec
        shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=s.dtype, device=device),
                           torch.zeros(shape, dtype=s.dtype, device=device))]

    @torch.inference_mode()
    def on_sampled(self, runner, step, batch=None, hidden: torch.Tensor | None = None) -> None:
        """After the step's sampling (launch), or its deferred sampling (batch None): the head's
        pass over the step's tokens, and the drafts for its sampled requests."""
        if batch is None:
            if id(step) not in self.deferred:
                return
            batch, hidden, aux = self.deferred.pop(id(step))
        else:
            t = int(batch.num_scheduled.sum())
            aux = self.aux.buffer[:t] if self.aux is not None else None
            hidden = hidden[:t]
            if step.unsampled is not None:   # the next forward rewrites the graphs' outputs and the aux buffer
                self.deferred[id(step)] = (batch, hidden.clone(), None if aux is None else aux.clone())
                return
        self._run(runner, step, batch, hidden, aux)

    def propose(self, runner, states, step) -> dict[str, list[int]]:
        """The drafts of the requests in `states`, from the copy that came back with the step."""
        if step.spec_drafts is None:
            return {}
        rows = {id(step.states[i]): j for j, i in enumerate(step.sample_rows.tolist())}
        drafts = step.spec_drafts.tolist()
        return {st.req_id: drafts[rows[id(st)]] for st in states if id(st) in rows}

    def _run(self, runner, step, batch, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        host, ns = batch.host, batch.num_scheduled
        t = int(ns.sum())
        last = np.cumsum(ns).astype(np.int64) - 1   # each request's last token (a verify step in the decode
        # graphs has one sequence per token in `host`: workers/spec_decode/verify_graph.py)
        q_lens = np.diff(host.query_start_loc)
        slots = np.fromiter((s.slot for s in batch.states), dtype=np.int64, count=len(batch.states))
        # each token's next token: the step's next input (within a request), the prompt's next token
        # after a chunk; a sampled request's is its sampled token, put in on the device below
        nxt = np.zeros(t, dtype=np.int64)
        nxt[:-1] = host.input_ids[1:t]
        mid = np.ones(len(ns), dtype=bool)
        mid[batch.sample_rows] = False
        nxt[last[mid]] = runner.batch.token_ids[slots[mid], batch.computed_after[mid]]
        srows = batch.sample_rows
        # the row of each sampled request's first verified token (its last token without drafts)
        base = last[srows] if batch.spec is None else batch.spec.token_rows[batch.spec.rows[:, 0]]
        positions = host.positions if host.positions.ndim == 1 else host.positions[0]
        n = len(srows)
        drafting = n > 0 and step.tokens is not None and (self.limit is None or len(step.req_ids) < self.limit)
        # the drafts' own steps: each sampled request's block table, wide enough for its last draft
        s_slots = slots[srows]
        upper = positions[last[srows]] + self.k       # past the last position a draft step writes
        width = int(min(-(-int(upper.max(initial=1)) // runner.block_size), runner.max_blocks_per_req))
        room = np.fromiter((min(batch.states[i].num_blocks * runner.block_size, self.max_model_len) for i in srows),
                           dtype=np.int64, count=n)
        ids, base_d, pos, slot_mapping, qsl, seq_lens, table, d_table, d_room = self.h2d([
            nxt, base.astype(np.int64), positions[:t].astype(np.int64), host.slot_mapping, host.query_start_loc,
            host.seq_lens, host.block_table, runner.batch.block_table[s_slots, :width], room])
        if n and step.tokens is not None:
            rows = base_d if step.num_accepted is None or step.spec is None else base_d + step.num_accepted
            ids.index_copy_(0, rows, step.tokens[:n].clamp(min=0).to(ids.dtype))
        else:
            rows = base_d
        meta = AttentionMetadata(qsl, seq_lens, table, slot_mapping, max_query_len=int(q_lens.max()),
                                 max_seq_len=int(host.seq_lens.max()), backend=runner.backend,
                                 num_decodes=num_decodes(q_lens))
        h_in = hidden if aux is None else self.head.combine(aux)
        lm_rows, h_next = self.head(ids, pos, h_in, self.kv_caches[0], meta)
        if not drafting:
            return
        step.spec_drafts = self._draft(runner, lm_rows.index_select(0, rows), h_next.index_select(0, rows),
                                       pos.index_select(0, rows), d_table, d_room, width, int(upper.max()))

    def _draft(self, runner, lm_rows: torch.Tensor, h: torch.Tensor, p0: torch.Tensor, table: torch.Tensor,
               room: torch.Tensor, width: int, max_seq: int) -> torch.Tensor:
        """d_1 from the last accepted positions' rows, then the k - 1 draft steps (in the draft
        graphs where a size fits)."""
        d = self.head.draft_tokens(lm_rows)
        rest = self.graphs.run(d, h, p0, table, room) if self.graphs is not None and self.k > 1 else None
        if rest is None:
            rest = self.draft_steps(d, h, p0, table, room, width, min(max_seq, width * runner.block_size))
        return torch.stack([d] + rest, dim=1)

    def draft_steps(self, d: torch.Tensor, h: torch.Tensor, p0: torch.Tensor, table: torch.Tensor,
                    room: torch.Tensor, width: int, max_seq: int, kv_splits: int | None = None) -> list[torch.Tensor]:
        """The k - 1 one-token steps: d_i goes in at position p0 + i (its token sits at p0 + 1 + i),
        with the head's previous output as h. A slot past the request's blocks (at max_model_len)
        is -1: nothing written, and the scheduler cuts those drafts anyway. No host sync (the
        draft graphs capture it)."""
        n, bs = len(p0), self.kv_spec.block_size
        rows = torch.arange(n, device=p0.device)
        qsl = torch.arange(n + 1, dtype=torch.int32, device=p0.device)
        drafts = []
        for i in range(1, self.k):
            p = p0 + i
            block = table[rows, (p // bs).clamp(max=width - 1)].long()
            slot = torch.where(p < room, block * bs + p % bs, torch.full_like(p, -1))
            seq_lens = (p + 1).clamp(max=max_seq).to(torch.int32)
            meta = AttentionMetadata(qsl, seq_lens, table, slot, max_query_len=1, max_seq_len=max_seq,
                                     backend=self.backend, num_decodes=n, num_kv_splits=kv_splits)
            lm, h = self.head(d, p, h, self.kv_caches[0], meta)
            d = self.head.draft_tokens(lm)
            drafts.append(d)
        return drafts

    def capture(self, runner) -> None:
        """With the decode graphs (after the warm-up): the draft steps' graphs."""
        from workers.spec_decode.eagle_graphs import DraftGraphs, enabled
        self.graphs = None
        if enabled() and self.k > 1:
            self.graphs = DraftGraphs(self, runner)
            self.graphs.capture()
