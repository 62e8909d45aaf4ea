"""Whisper (WhisperForConditionalGeneration): an encoder-decoder speech recognizer.

The encoder (two convolutions, stored sinusoidal positions, pre-norm layers, a final norm) runs
once per request through the multimodal encoder path, like an image tower: each clip is one
item whose single placeholder is the decoder prompt's <|startoftranscript|>, so the scheduler
schedules the encoder under its budget and the worker keeps its output [1, 1500, d] in the
encoder cache. In the step that computes that token the worker (workers/cross_kv.py) projects
the output into every decoder layer's cross-attention keys and values, once, into the
request's own blocks; the decoder then steps through the normal scheduler with paged
self-attention, and its decode steps replay CUDA graphs (cross-attention reads a fixed 1500
frames through the static row buffer).

Decoder prompt: [<|startofprev|> prompt] <|startoftranscript|> <|lang|> <|task|> <|notimestamps|>
(timestamps off), as vLLM builds it. The tokens keep their own embeddings: the encoder output
is never scattered into the decoder's input. Tensor parallelism is not supported (a rank holds
the whole model)."""
from __future__ import annotations

import logging
import re
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from multimodal.audio_info import AudioInfo
from multimodal.media import MediaError
from workers.attention import Attention, AttentionMetadata
from workers.host_to_device import to_device
from workers.models.layers import KVCache, replicated, replicated_loader
from workers.models.qwen2_audio import AudioEncoderLayer

logger = logging.getLogger(__name__)

# Whisper's language tokens (<|en|> ... <|yue|>), as its tokenizer lists them
LANGUAGES = ("en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr "
             "bg lt la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km "
             "sn yo so af oc ka be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba "
             "jw su yue").split()


class WhisperAudio(AudioInfo):
    """A clip is one encoder input whose placeholder is the decoder's <|startoftranscript|>."""

    # Every decoder token cross-attends to the audio, those of a <|startofprev|> prompt before the
    # placeholder too, so no block of a decoder prompt may be shared by hash (vLLM turns prefix
    # caching off for encoder-decoder models as well).
    prefix_caching = False

    # A step that holds a prompt chunk runs eagerly (cross-attention over its prompt tokens has no
    # graph): ~110 aten calls a layer, ~3,500 for large-v3's 32, tens of ms of host time. Under
    # load about one clip joins per step (64 running, 64 tokens each), so nearly every step was
    # such a step (the likely cause of the GPU's ~70% idle time in a c64 run). Fed one token per
    # step beside the decodes, the 4-token prompt (<|startoftranscript|><|en|><|transcribe|>
    # <|notimestamps|>) keeps every step a decode graph's; a longer (<|startofprev|>) prompt
    # still goes in chunks.
    stepwise_prompt_tokens = 8

    def image_token_id(self, hf: dict) -> int:
        return int(hf.get("decoder_start_token_id", 50258))

    def transcription_prompt(self, task: str, language: str | None, prompt: str) -> str:
        language = (language or "en").lower()
        if language not in LANGUAGES:
            raise MediaError(f"language {language!r} is not one of Whisper's languages")
        prev = f"<|startofprev|>{prompt}" if prompt else ""
        return f"{prev}<|startoftranscript|><|{language}|><|{task}|><|notimestamps|>"

    def max_item_tokens(self, model_dir: str, hf: dict) -> int:
        return 1

    def placeholder_tokens(self, hf: dict, arrays: dict[str, np.ndarray]) -> int | None:
        frames = 2 * int(hf.get("max_source_positions", 1500))
        if arrays["input_features"].shape != (1, int(hf.get("num_mel_bins", 80)), frames):
            return None
        return 1


class WhisperEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.d_model
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(AudioEncoderLayer(d, config.encoder_attention_heads, config.encoder_ffn_dim)
                                    for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """[clips, mels, 2 * positions] (padded to the 30 s window) -> [clips, positions, d]."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(feats)))).transpose(1, 2)
        x = x + self.embed_positions.weight[None, :x.shape[1]]
        for layer in self.layers:
            x = layer(x, None)   # every frame, the padding too (Whisper has no encoder mask)
        return self.layer_norm(x)


def _projections(d: int, cross: bool = False) -> nn.Module:
    """An attention's projections; cross-attention's keys and values are the model's stacked
    ones (WhisperForConditionalGeneration.cross_k_proj), not the layer's."""
    m = nn.Module()
    m.q_proj, m.out_proj = nn.Linear(d, d), nn.Linear(d, d)
    if not cross:
        m.k_proj, m.v_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d)
    return m


# a decoder layer's cross-attention key / value projection in the checkpoint (after hf_to_loom)
_CROSS_KV = re.compile(r"layers\.(\d+)\.encoder_attn\.([kv])_proj\.(weight|bias)")


class WhisperDecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, index: int):
        super().__init__()
        self.index, self.heads, self.head_dim = index, heads, d // heads
        self.scale = self.head_dim ** -0.5
        self.self_attn, self.encoder_attn = _projections(d), _projections(d, cross=True)
        self.attn = Attention(heads, heads, self.head_dim, self.scale)
        self.self_attn_layer_norm, self.encoder_attn_layer_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, ffn), nn.Linear(ffn, d)

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata, cross) -> torch.Tensor:
        from kernels.kv_cache_write import write_kv_cache
        t = x.shape[0]
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        q, k, v = (p(h).view(t, self.heads, self.head_dim) for p in (a.q_proj, a.k_proj, a.v_proj))
        write_kv_cache(k, v, kv_cache[0], kv_cache[1], meta.slot_mapping)
        x = x + a.out_proj(self.attn(q, kv_cache, meta))
        c = self.encoder_attn
        q = c.q_proj(self.encoder_attn_layer_norm(x)).view(t, self.heads, self.head_dim)
        x = x + c.out_proj(cross.attend(self.index, q, self.scale, meta))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperForConditionalGeneration(nn.Module):
    multimodal = WhisperAudio()
    stacked_params: list = []

    def __init__(self, config, language_model_only: bool = False):
        super().__init__()
        from workers.distributed import tp_size
        if tp_size() > 1:
            raise ValueError("Whisper runs on one rank (--tensor-parallel-size 1)")
        self.hf_config = self.config = config
        d = config.d_model
        self.audio_tower = WhisperEncoder(config)   # (the encoder: the multimodal path's name)
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.embed_positions = nn.Embedding(config.max_target_positions, d)
        self.layers = nn.ModuleList(WhisperDecoderLayer(d, config.decoder_attention_heads, config.decoder_ffn_dim, i)
                                    for i in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(d)
        # every decoder layer's cross-attention key / value projection (the checkpoint's
        # layers.i.encoder_attn.{k,v}_proj), stacked [layers, d_out, d_in]: workers/cross_kv.py
        # projects a clip's encoder output into all layers with one batched GEMM each
        n = config.decoder_layers
        self.cross_k_proj = nn.Parameter(torch.empty(n, d, d), requires_grad=False)
        self.cross_v_proj = nn.Parameter(torch.empty(n, d, d), requires_grad=False)
        self.cross_v_bias = nn.Parameter(torch.empty(n, d), requires_grad=False)
        self.kv_cache_shape = (config.decoder_layers, config.decoder_attention_heads, d // config.decoder_attention_heads)
        self.cross_attention_frames = config.max_source_positions   # the pool's row length (workers/cross_kv.py)
        self.cross_kv = None   # the runner's CrossKV, set before the first step
        self.encoder_graphs = None   # small batches of clips replayed whole (workers/encoder_graphs.py)
        for p in self.parameters():
            replicated(p)

    # ------------------------------------------------------------ decoder (the engine's model)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)   # (HF scales neither)
        x = x + self.embed_positions.weight.index_select(0, positions)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, kv, meta, self.cross_kv)
        return self.layer_norm(x)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor, plain: bool = False) -> torch.Tensor:
        return F.linear(hidden, self.embed_tokens.weight)   # proj_out is tied to the embeddings

    # ------------------------------------------------------------ encoder (the multimodal contract)

    def encode_images(self, items: list[dict[str, np.ndarray]]) -> list[torch.Tensor]:
        """Processed clips (input_features [1, mels, 3000] each) -> the encoder's output
        [1, 1500, d] each: one "embedding" per clip (its one placeholder), which fill_scheduled
        turns into the request's cross-attention keys and values."""
        w = self.audio_tower.conv1.weight
        clips = [torch.from_numpy(np.asarray(it["input_features"])) for it in items]
        feats = to_device(clips, w.device, w.dtype)
        tower = self.audio_tower if self.encoder_graphs is None else self.encoder_graphs
        return list(tower(feats).unsqueeze(1))

    def capture_encoder_graphs(self, capture: bool) -> None:
        """The encoder's graphs for small batches of clips (capture False: run uncaptured, on the CPU)."""
        from workers.encoder_graphs import EncoderGraphs
        w = self.audio_tower.conv1.weight
        self.encoder_graphs = None   # (the old graphs' memory goes first)
        item = (self.config.num_mel_bins, 2 * self.config.max_source_positions)   # every clip: the 30 s window
        try:
            self.encoder_graphs = EncoderGraphs(self.audio_tower, item, w.dtype, w.device, capture)
        except RuntimeError:   # (the encoder still runs, eagerly: a capture failure costs speed, not the server)
            logger.exception("the encoder's CUDA graphs could not be captured; it runs eagerly")
            self.encoder_graphs = None

    def cross_kv_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacked cross-attention projections: keys' and values' weights [layers, d, d], and
        the values' bias [layers, d] (the keys have none)."""
        return self.cross_k_proj, self.cross_v_proj, self.cross_v_bias

    def dummy_image(self, num_tokens: int) -> dict[str, np.ndarray]:
        frames = 2 * self.config.max_source_positions
        return {"input_features": np.zeros((1, self.config.num_mel_bins, frames), np.float32),
                "feature_attention_mask": np.ones((1, frames), np.int32)}

    # ------------------------------------------------------------ weights

    def hf_to_loom(self, name: str) -> str | None:
        if name == "proj_out.weight":
            return None   # tied to model.decoder.embed_tokens
        for old, new in (("model.encoder.", "audio_tower."), ("model.decoder.", "")):
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> set[str]:
        params = dict(self.named_parameters())
        seen: set[str] = set()
        stacked = {("k", "weight"): "cross_k_proj", ("v", "weight"): "cross_v_proj", ("v", "bias"): "cross_v_bias"}
        layers_seen: dict[str, set[int]] = {name: set() for name in stacked.values()}
        for hf_name, t in weights:
            name = self.hf_to_loom(hf_name)
            if name is None:
                continue
            if name in seen:
                raise ValueError(f"weight {name!r} appears twice in the checkpoint")
            seen.add(name)
            if (m := _CROSS_KV.fullmatch(name)) and (m[2], m[3]) in stacked:   # one layer of a stacked tensor
                into = stacked[m[2], m[3]]
                layer = int(m[1])
                if layer >= len(self.layers):
                    raise ValueError(f"weight {name!r}: the model has {len(self.layers)} decoder layers")
                try:
                    replicated_loader(params[into].data[layer], t)
                except ValueError as e:
                    raise ValueError(f"weight {name!r}: {e}") from None
                layers_seen[into].add(layer)
                continue
            if name not in params:
                raise ValueError(f"checkpoint weight {hf_name!r} has no matching parameter")
            try:
                params[name].weight_loader(params[name], t)
            except ValueError as e:
                raise ValueError(f"weight {name!r}: {e}") from None
        seen.update(into for into, got in layers_seen.items() if len(got) == len(self.layers))
        missing = [n for n in params if n not in seen]
        if missing and not partial:
            raise ValueError(f"parameters not loaded from the checkpoint: {missing[:10]}")
        return seen
