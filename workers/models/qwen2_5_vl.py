"""Qwen2.5-VL: a ViT (windowed attention, 2-D rotary, patch merger) in front of the Qwen2
language model, whose rotary takes three position rows (M-RoPE: temporal, height, width).

The vision tower is self-contained plain torch (fused attention through
F.scaled_dot_product_attention); the language model is our Llama/Qwen2 stack, fed
`inputs_embeds` where image placeholders sit. Weight names: the Hub's (`model.layers.*`,
`visual.*`) and transformers 5's (`model.language_model.*`, `model.visual.*`)."""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.rotary_apply import apply_rotary, apply_rotary_ref
from multimodal.info import MultiModalInfo, preprocessor_config
from workers.attention import AttentionMetadata
from workers.distributed import LogitsShard
from workers.host_to_device import to_device
from workers.models import layers
from workers.models.layers import KVCache, VocabParallelEmbedding, replicated
from workers.models.llama import LlamaModel
from workers.models.weights import STACKED_PARAMS, load_weights


class Qwen2_5_VLImages(MultiModalInfo):
    """Dynamic resolution: an image of t x h x w patches (its `image_grid_thw`) makes
    t*h*w / merge^2 placeholder tokens, up to the processor's max_pixels, which a request's
    mm_processor_kwargs may lower (vLLM's Qwen-VL clients send min_pixels / max_pixels)."""
    accepted_kwargs = ("min_pixels", "max_pixels")

    def image_token_id(self, hf: dict) -> int:
        return int(hf["image_token_id"])

    def max_pixels(self, model_dir: str, hf: dict) -> int:
        pp = preprocessor_config(model_dir)
        return int(pp.get("max_pixels") or (pp.get("size") or {}).get("longest_edge") or 12845056)

    def max_item_tokens(self, model_dir: str, hf: dict) -> int:
        pp = preprocessor_config(model_dir)
        unit = int(pp.get("patch_size", 14)) * int(pp.get("merge_size", 2))
        return self.max_pixels(model_dir, hf) // (unit * unit)

    def call_kwargs(self, kwargs: dict, image_processor) -> dict:
        """transformers 5 deprecates min_pixels / max_pixels in the call and reads
        size = {"shortest_edge", "longest_edge"}."""
        size = dict(image_processor.size)
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if key in kwargs:
                size[edge] = kwargs[key]
        return {"size": size}

    def arrays(self, out) -> dict[str, np.ndarray]:
        arrays = super().arrays(out)
        arrays["image_grid_thw"] = np.asarray(out["image_grid_thw"], dtype=np.int64).reshape(-1)
        return arrays

    def placeholder_tokens(self, hf: dict, arrays: dict[str, np.ndarray]) -> int | None:
        vc = hf.get("vision_config") or {}
        grid, pixels = arrays["image_grid_thw"], arrays["pixel_values"]
        merge = int(vc.get("spatial_merge_size", 2))
        dim = int(vc.get("in_channels", vc.get("in_chans", 3))) * int(vc.get("temporal_patch_size", 2)) \
            * int(vc.get("patch_size", 14)) ** 2
        ok = (grid.shape == (3,) and (grid >= 1).all() and grid[1] % merge == 0 and grid[2] % merge == 0
              and pixels.shape == (int(grid.prod()), dim))
        return int(grid.prod()) // (merge * merge) if ok else None


class VisionRMSNorm(nn.Module):
    """HF's Qwen2RMSNorm (variance in fp32, the weight times the input dtype), through the models'
    norm op: one kernel on the GPU (workers/models/layers.py), with the residual add fused in."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return layers.rms_norm(x, self.weight, self.eps)
        return layers.fused_add_rms_norm(x, residual, self.weight, self.eps)   # (norm(x + residual), x + residual)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotary(q, k, cos, sin)
        return self.proj(segments.attention(q, k, v).reshape(n, -1))


def _rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF's rotation of q, k [N, H, D] by cos, sin [N, D]: in fp32, rounded once to their dtype
    (kernels/rotary_apply.py: one launch on the GPU, where HF's ops were about twenty)."""
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
    if q.is_cuda:
        qh, kh = apply_rotary(qh, kh, cos[None], sin[None])
    else:
        qh, kh = apply_rotary_ref(qh.float(), kh.float(), cos[None], sin[None])
        qh, kh = qh.to(q.dtype), kh.to(k.dtype)
    return qh[0].transpose(0, 1), kh[0].transpose(0, 1)


class Segments:
    """Packed segments (the windows, or whole frames) of the tower's tokens, which attend within
    themselves. On the GPU in fp16/bf16 one flash-attention call takes them all (cumulative
    lengths); otherwise segments are grouped by length and each group is one batched SDPA call,
    with no N x N mask (the CPU, fp32)."""

    def __init__(self, lens: list[int], dev: torch.device, dtype: torch.dtype):
        self.packed = dev.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
        if self.packed:
            self.cu = to_device(torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)), dev)
            self.max_len = max(lens)
        else:
            self.groups = segment_groups(lens, dev)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention within each segment: q, k, v [N, H, D] -> [N, H, D]."""
        if self.packed:
            # aten's flash kernel itself: torch.nn.attention.varlen_attn wraps it in a custom op
            # (an autograd node and one more launch), ~200 us of host time a call, 32 calls an encode
            return torch.ops.aten._flash_attention_forward(q, k, v, self.cu, self.cu, self.max_len, self.max_len,
                                                           0.0, False, False)[0]
        return varlen_attention(q, k, v, self.groups)


def segment_groups(lens: list[int], device) -> list[tuple[torch.Tensor, int, int]]:
    """Packed segments grouped by length: (token index [G*L], G, L) per length, so that attention
    runs as a few batched fused calls."""
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    groups = []
    for length in sorted(set(lens)):
        first = starts[np.asarray(lens) == length]
        idx = (first[:, None] + np.arange(length)[None, :]).reshape(-1)
        groups.append((to_device(torch.from_numpy(idx), device), len(first), int(length)))
    return groups


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list) -> torch.Tensor:
    """Bidirectional attention within each segment (segment_groups): q, k, v [N, H, D] -> [N, H, D]."""
    out = torch.empty_like(q)
    h, d = q.shape[1], q.shape[2]
    for idx, g, length in groups:
        qs, ks, vs = (t.index_select(0, idx).view(g, length, h, d).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(g * length, h, d))
    return out


class VisionMLP(layers.ReplicatedGatedMLP):
    """The tower's SwiGLU: its width, 3,420, is padded to 3,456 (layers.ReplicatedGatedMLP: a bf16
    row of 3,420 is not 16-byte aligned, and cuBLAS ran sm80 kernels on it, ~3x slower on an H200:
    22 of the 35 ms of GPU time of an HD + 448 encode)."""


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int):
        super().__init__()
        self.norm1 = VisionRMSNorm(dim)
        self.norm2 = VisionRMSNorm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = VisionMLP(dim, hidden)

    def forward(self, x, residual, cos, sin, segments):
        """(this block's MLP output, its residual stream before that output): the adds are fused
        into the next norm, vLLM's layout."""
        if residual is None:
            h, residual = self.norm1(x), x
        else:
            h, residual = self.norm1(x, residual)
        h, residual = self.norm2(self.attn(h, cos, sin, segments), residual)
        return self.mlp(h), residual


class PatchEmbed(nn.Module):
    """Conv3d with stride = kernel over pre-cut patches: one matmul."""

    def __init__(self, patch: int, temporal: int, in_ch: int, dim: int):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(dim, in_ch, temporal, patch, patch), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, dim: int, merge: int):
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = VisionRMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, vc):
        super().__init__()
        self.merge = vc.spatial_merge_size
        self.patch_size = vc.patch_size
        self.window_size = vc.window_size
        self.fullatt = set(vc.fullatt_block_indexes)
        self.head_dim = vc.hidden_size // vc.num_heads
        rope = getattr(vc, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0))
        half = self.head_dim // 2
        inv = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device="cpu") / half))
        self.inv_freq = inv   # (on the host, in fp32: the positions' frequencies are made there, one copy up)
        self.patch_embed = PatchEmbed(vc.patch_size, vc.temporal_patch_size, vc.in_channels, vc.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(vc.hidden_size, vc.num_heads, vc.intermediate_size)
                                    for _ in range(vc.depth))
        self.merger = PatchMerger(vc.out_hidden_size, vc.hidden_size, vc.spatial_merge_size)

    def _positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """(h, w) of every patch, in the processor's order (merge-blocks first)."""
        m, out = self.merge, []
        for t, h, w in grids:
            hp = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
            wp = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
            out.append(torch.stack([hp, wp], -1).repeat(t, 1))
        return torch.cat(out)

    def _windows(self, grids) -> tuple[torch.Tensor, list[int]]:
        """The permutation of merged patches into windows, and each window's patch count."""
        m, win = self.merge, self.window_size // self.merge // self.patch_size
        index, counts, base = [], [], 0
        for t, h, w in grids:   # per image, whole-array ops: a loop per window cost ~3 ms an HD image
            gh, gw = h // m, w // m
            idx = torch.arange(base, base + t * gh * gw).view(t, gh, gw)
            ph, pw = -gh % win, -gw % win
            idx = F.pad(idx, (0, pw, 0, ph), value=-1)
            nh, nw = (gh + ph) // win, (gw + pw) // win
            idx = idx.view(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, win * win)
            valid = idx >= 0
            index.append(idx[valid])            # row-major: each window's patches in order, windows in order
            counts.append(valid.sum(1))
            base += t * gh * gw
        counts = torch.cat(counts)
        return torch.cat(index), (counts[counts > 0] * (m * m)).tolist()

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        dev = pixels.device
        unit = self.merge * self.merge
        x = self.patch_embed(pixels)
        n = x.shape[0]
        win_index, win_lens = self._windows(grids)
        win_index = to_device(win_index, dev)
        x = x.view(n // unit, unit, -1)[win_index].reshape(n, -1)
        freqs = to_device(self._positions(grids)[..., None].float() * self.inv_freq, dev)  # [n, 2, d/4]
        freqs = freqs.view(n // unit, unit, -1)[win_index].reshape(n, -1)
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos(), emb.sin()
        # the windows, and whole frames for the full-attention blocks: each contiguous in the
        # window order (an image's windows fill its frames in turn)
        full = Segments([h * w for t, h, w in grids for _ in range(t)], dev, x.dtype)
        windows = Segments(win_lens, dev, x.dtype)
        residual = None
        for i, blk in enumerate(self.blocks):
            x, residual = blk(x, residual, cos, sin, full if i in self.fullatt else windows)
        return self.merger(x + residual)[torch.argsort(win_index)]


class Qwen2_5_VLForConditionalGeneration(nn.Module):
    uses_mrope = True
    multimodal = Qwen2_5_VLImages()
    stacked_params = STACKED_PARAMS

    def __init__(self, config, language_model_only: bool = False):
        super().__init__()
        self.hf_config = config
        self.config = text = config.get_text_config()
        self.image_token_id = config.image_token_id
        self.model = LlamaModel(text, qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)
        self.visual = None
        if not language_model_only:
            self.visual = Qwen2_5_VisionTransformer(config.vision_config)
            for p in self.visual.parameters():  # replicated on every tensor-parallel rank
                if not hasattr(p, "weight_loader"):   # (the MLPs' padded weights have theirs)
                    replicated(p)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)
                                        or getattr(text, "tie_word_embeddings", False))
        self.lm_head = self.model.embed_tokens if self.tie_word_embeddings else \
            VocabParallelEmbedding(text.vocab_size, text.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, plain: bool = False) -> torch.Tensor | LogitsShard:
        return self.lm_head.logits(hidden, plain)

    # ------------------------------------------------------------ vision

    def encode_images(self, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Processed images (pixel_values [patches, C*T*P*P], image_grid_thw [3]) -> each one's
        embeddings [placeholder tokens, hidden], in one pass of the tower."""
        w = self.visual.patch_embed.proj.weight
        dev, dtype = w.device, w.dtype
        grids = [tuple(int(v) for v in np.asarray(it["image_grid_thw"]).reshape(3)) for it in items]
        # the items gathered from the store into one pinned buffer in the tower's dtype (bf16: half
        # the bytes of the processor's fp32 to write and to copy up), then one copy
        pixels = to_device([torch.from_numpy(np.asarray(it["pixel_values"])) for it in items], dev, dtype)
        out = self.visual(pixels, grids)
        unit = self.visual.merge ** 2
        return list(out.split([t * h * w // unit for t, h, w in grids]))

    def dummy_image(self, num_tokens: int) -> dict[str, np.ndarray]:
        """Processed arrays of an image of about num_tokens placeholders (memory profiling)."""
        vc = self.hf_config.vision_config
        m = vc.spatial_merge_size
        side = max(int(num_tokens ** 0.5), 1)
        h, w = side * m, max(num_tokens // side, 1) * m
        dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        return {"pixel_values": np.zeros((h * w, dim), np.float32), "image_grid_thw": np.array([1, h, w])}

    def mrope_positions(self, prompt_ids: np.ndarray, items: list[tuple[int, int, dict]]) -> tuple[np.ndarray, int]:
        """M-RoPE positions of a prompt ([3, n]) and the delta that later tokens add to their
        index. items: (placeholder offset, length, processed arrays) sorted by offset. Text
        advances all three rows by one per token; an image's tokens take (t, h, w) of its merged
        grid from where the text stopped, after which text resumes at max(h, w) further on."""
        n = len(prompt_ids)
        out = np.empty((3, n), dtype=np.int64)
        cur = pos = 0
        m = self.hf_config.vision_config.spatial_merge_size
        for off, length, arrays in items:
            out[:, cur:off] = np.arange(off - cur) + pos
            pos += off - cur
            t, h, w = (int(v) for v in np.asarray(arrays["image_grid_thw"]).reshape(3))
            h, w = h // m, w // m
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            out[:, off:off + length] = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + pos
            pos += max(h, w)
            cur = off + length
        out[:, cur:] = np.arange(n - cur) + pos
        return out, int(out.max()) + 1 - n if n else 0

    # ------------------------------------------------------------ weights

    def hf_to_loom(self, name: str) -> str | None:
        """The Hub's names (`model.layers.*`, `visual.*`) and transformers 5's
        (`model.language_model.*`, `model.visual.*`) alike."""
        name = name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
        if name.startswith("visual.") and self.visual is None:
            return None
        if "rotary_emb." in name or (self.tie_word_embeddings and name == "lm_head.weight"):
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> set[str]:
        """`partial`: only some weights (a weight update), none required."""
        return load_weights(self, weights, partial)
