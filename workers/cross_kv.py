"""CrossKV: an encoder-decoder model's cross-attention keys and values, one fixed set per
request, in their own paged pool beside the decoder's self-attention cache.

Whisper's encoder output (1500 frames) is projected into each decoder layer's cross-attention
keys and values once per request, in the step that computes the request's first placeholder
token (the <|startoftranscript|> the encoder output hangs on), and written into the blocks of the
request's persistent-batch row: row r owns blocks [r * blocks_per_row, (r + 1) * blocks_per_row).
The pool is allocated with the worker, before the KV cache is sized (so its bytes come out of
the self-attention budget), and a row's blocks are reused by the next request in that row: the
allocation at admission and the free at finish are the persistent batch's own.

Decode steps read the pool through the paged-attention kernel with a fixed context of
`frames` keys: `rows` (the step's request rows) is a static buffer, so a decode CUDA graph
replays the cross-attention of whatever requests the step holds. Steps with prompt tokens
(eager) gather their requests' keys and attend with SDPA (no causal mask: every decoder token
sees every frame)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from workers.host_to_device import pinned


class CrossKV:
    def __init__(self, num_layers: int, rows: int, frames: int, heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.frames, self.heads, self.head_dim = frames, heads, head_dim
        self.blocks_per_row = -(-frames // block_size)
        self.row_len = self.blocks_per_row * block_size
        # one tensor of keys and one of values for all layers ([layers, blocks, block, heads,
        # head_dim]): project() writes a clip's every layer in one batched GEMM; each layer's
        # cache is a contiguous slice of them
        shape = (num_layers, rows * self.blocks_per_row, block_size, heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.caches = [(self.keys[i], self.values[i]) for i in range(num_layers)]
        self.table = torch.arange(rows * self.blocks_per_row, dtype=torch.int32,
                                  device=device).view(rows, self.blocks_per_row)
        self.seq_lens = torch.full((rows,), frames, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.rows = torch.zeros(rows, dtype=torch.int64, device=device)   # the step's requests' rows (static)
        self._rows_set: np.ndarray | None = None   # what `rows` holds (begin_step's last upload)
        self.filled_for: dict[int, str] = {}   # row -> the request whose keys and values it holds

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.caches)

    def row_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer's keys and values as [rows, blocks_per_row * block_size, heads, head_dim]."""
        k, v = self.caches[layer]
        rows = self.table.shape[0]
        return k.view(rows, -1, self.heads, self.head_dim), v.view(rows, -1, self.heads, self.head_dim)

    def project(self, rows: list[int], encoded: list[torch.Tensor], k_weight: torch.Tensor, v_weight: torch.Tensor,
                v_bias: torch.Tensor | None) -> None:
        """Clips' encoder outputs [frames, d] (one per row) projected into every layer's keys and
        values of their rows in place: per clip one bmm for the keys and one baddbmm for the
        values over the layers' stacked weights [layers, d_out, d_in] (v_bias [layers, d_out]).
        Layer by layer (a linear, a view and an indexed write for each of K and V, 32 layers) it
        was ~200 launches per step a clip joins, nearly every step of a c64 run."""
        layers, width = k_weight.shape[0], self.heads * self.head_dim
        keys, values = self.keys.view(layers, -1, width), self.values.view(layers, -1, width)
        kt, vt = k_weight.transpose(1, 2), v_weight.transpose(1, 2)
        for row, x in zip(rows, encoded):
            x = x.expand(layers, *x.shape)   # (batch stride 0: no copy)
            at = row * self.row_len
            torch.bmm(x, kt, out=keys[:, at:at + self.frames])
            if v_bias is None:
                torch.bmm(x, vt, out=values[:, at:at + self.frames])
            else:
                torch.baddbmm(v_bias.unsqueeze(1), x, vt, out=values[:, at:at + self.frames])

    def begin_step(self, rows: np.ndarray) -> None:
        """The step's request rows, uploaded from a pinned copy without a host sync (the
        caching host allocator keeps it alive until the copy is done); nothing to upload when
        they are the previous step's (a batch that only decodes)."""
        if self._rows_set is not None and np.array_equal(self._rows_set, rows):
            return
        self._rows_set = np.array(rows, dtype=np.int64)
        self.rows[:len(rows)].copy_(pinned(torch.from_numpy(self._rows_set), self.rows.device), non_blocking=True)

    def attend(self, layer: int, q: torch.Tensor, scale: float, meta) -> torch.Tensor:
        """q [T, heads, head_dim] of this step's tokens (meta: the step's AttentionMetadata) ->
        [T, heads * head_dim]. Decodes (the step's leading one-token sequences) read the pool in
        place; the prompt tokens of a mixed step attend over their requests' gathered rows."""
        t = q.shape[0]
        if meta.max_query_len == 1:   # decodes only (a decode graph's padding rows too)
            return self._decodes(layer, q, self.rows[:t], scale, meta.backend)
        nd = meta.num_decodes
        out = q.new_empty(t, self.heads * self.head_dim)
        if nd:
            out[:nd] = self._decodes(layer, q[:nd], self.rows[:nd], scale, meta.backend)
        out[nd:] = self._prompts(layer, q[nd:], scale, meta, nd)
        return out

    def _decodes(self, layer: int, q: torch.Tensor, rows: torch.Tensor, scale: float, backend: str) -> torch.Tensor:
        """One query per request: the paged kernel over the requests' rows (fixed length)."""
        t = q.shape[0]
        if backend == "triton":
            from kernels.paged_attention import paged_attention
            k, v = self.caches[layer]
            out = paged_attention(q, k, v, self.query_start_loc[:t + 1], self.seq_lens[:t],
                                  self.table.index_select(0, rows), scale, 1, self.frames, num_decodes=t)
            return out.reshape(t, -1)
        kc, vc = self.row_view(layer)
        k, v = kc.index_select(0, rows)[:, :self.frames], vc.index_select(0, rows)[:, :self.frames]
        out = F.scaled_dot_product_attention(q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), scale=scale)
        return out.reshape(t, -1)

    def _prompts(self, layer: int, q: torch.Tensor, scale: float, meta, first: int) -> torch.Tensor:
        """Sequences first.. of the step (their tokens q): queries padded per request, keys
        gathered per request; each token's place comes from query_start_loc on the device (no
        host sync)."""
        n, b, width = q.shape[0], meta.seq_lens.shape[0] - first, meta.max_query_len
        qsl = meta.query_start_loc[first:].long()
        request = torch.repeat_interleave(torch.arange(b, device=q.device), qsl[1:] - qsl[:-1], output_size=n)
        offset = torch.arange(n, device=q.device) + first - qsl.index_select(0, request)
        kc, vc = self.row_view(layer)
        rows = self.rows[first:first + b]
        k, v = kc.index_select(0, rows)[:, :self.frames], vc.index_select(0, rows)[:, :self.frames]
        padded = q.new_zeros(b, width, self.heads, self.head_dim)
        padded[request, offset] = q
        out = F.scaled_dot_product_attention(padded.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             scale=scale)
        return out.transpose(1, 2)[request, offset].reshape(n, -1)


def make_cross_kv(model, max_num_seqs: int, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> CrossKV | None:
    """The pool of an encoder-decoder model (one that declares `cross_attention_frames`),
    handed to the model, which reads it in its forward; None for any other model."""
    frames = getattr(model, "cross_attention_frames", None)
    if not frames:
        return None
    layers, heads, head_dim = model.kv_cache_shape
    model.cross_kv = CrossKV(layers, max_num_seqs, frames, heads, head_dim, block_size, dtype, device)
    return model.cross_kv


@torch.inference_mode()
def fill_scheduled(cross: CrossKV, model, mm, states, slots: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
    """The requests whose clip's placeholder this step computes get their cross keys and values
    (from the encoder output the worker just cached), then the step's rows (`slots`: each
    request's persistent-batch row) are set. A request whose encoder output is missing has been
    failed by MultimodalInputs.spans.

    A decoder prompt chunked before its placeholder (a long <|startofprev|> prompt in a full
    step) has tokens that cross-attend before the scheduler encodes the clip: the clip is
    encoded here, out of schedule, from the store (the scheduled encode later writes the same
    values again)."""
    rows, encoded = [], []
    for st, lo, hi in zip(states, start.tolist(), end.tolist()):   # (Python ints: 64 rows a step)
        for it in st.mm_items:
            at = it.offset
            if lo <= at < hi and it.hash in mm.encoder_cache:
                encoded.append(mm.encoder_cache[it.hash][0])
            elif lo < at and at >= hi and cross.filled_for.get(st.slot) != st.req_id:
                encoded.append(model.encode_images([mm.store.get(it.store_name, it.store_addr)])[0][0])
            else:
                continue
            rows.append(st.slot)
            cross.filled_for[st.slot] = st.req_id
    if rows:   # every new request's projections, every layer's at once per clip
        cross.project(rows, encoded, *model.cross_kv_weights())
    cross.begin_step(slots)
