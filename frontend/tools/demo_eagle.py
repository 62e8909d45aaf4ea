"""An EAGLE head for the demo model (frontend/tools/demo_model.py), trained on the CPU in about a
minute on the demo model's own hidden states, saved in EAGLE-1's public layout
(yuhuili/EAGLE-LLaMA3-Instruct-8B: config.json, pytorch_model.bin with fc.weight and layers.0.*),
so that `--speculative-config '{"method": "eagle", "model": OUT_DIR, ...}'` serves it.

    python -m frontend.tools.demo_eagle DEMO_DIR OUT_DIR [--seconds S] [--steps N]

EagleReference is the head's math in plain torch over whole sequences (no paged cache): the
training model here, and the oracle tests hold the serving head (workers/models/llama_eagle.py)
to. Training distils the target's greedy choices: at position i the head reads (token i + 1,
the target's hidden state h_i) and learns the target's argmax at i + 1, plus EAGLE's regression
of its output onto h_{i+1}. It is unrolled over the draft steps as serving runs them (EAGLE-3's
training-time test): pass m at position p reads pass m - 1's output at p - 1 and attends to the
target-fed pass's keys up to p - m and to each later pass's key on its own diagonal."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., T, heads, d] rotated by the default (NeoX-style, rotate-half) rotary embedding."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions.float()[..., None] * inv                      # [..., T, d/2]
    cos, sin = torch.cat((ang, ang), -1).cos()[..., None, :], torch.cat((ang, ang), -1).sin()[..., None, :]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return (x * cos + torch.cat((-x2, x1), -1) * sin).to(x.dtype)


class EagleReference(nn.Module):
    """One EAGLE head in plain torch, parameters under the checkpoint's names (EAGLE-1:
    fc, layers.0.*; EAGLE-3: fc, midlayer.*, norm, lm_head, d2t)."""

    def __init__(self, cfg: dict, method: str = "eagle", draft_vocab: int | None = None,
                 norm_before_residual: bool = False):
        super().__init__()
        self.method, self.eps = method, cfg.get("rms_norm_eps", 1e-6)
        self.norm_before_residual = norm_before_residual
        params = cfg.get("rope_parameters") or {}
        self.theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads") or self.heads
        self.d = cfg.get("head_dim") or h // self.heads
        attn_in = 2 * h if method == "eagle3" else h
        p = "midlayer" if method == "eagle3" else "layers.0"
        self.p = p

        def lin(o, i, std=0.02):
            return nn.Parameter(torch.randn(o, i) * std)
        w = {f"{p}.self_attn.q_proj.weight": lin(self.heads * self.d, attn_in),
             f"{p}.self_attn.k_proj.weight": lin(self.kv_heads * self.d, attn_in),
             f"{p}.self_attn.v_proj.weight": lin(self.kv_heads * self.d, attn_in),
             f"{p}.self_attn.o_proj.weight": lin(h, self.heads * self.d),
             f"{p}.mlp.gate_proj.weight": lin(inter, h), f"{p}.mlp.up_proj.weight": lin(inter, h),
             f"{p}.mlp.down_proj.weight": lin(h, inter),
             f"{p}.post_attention_layernorm.weight": nn.Parameter(torch.ones(h))}
        if method == "eagle3":
            w.update({f"{p}.input_layernorm.weight": nn.Parameter(torch.ones(h)),
                      f"{p}.hidden_norm.weight": nn.Parameter(torch.ones(h)), "fc.weight": lin(h, 3 * h),
                      "norm.weight": nn.Parameter(torch.ones(h)),
                      "lm_head.weight": lin(draft_vocab or cfg["vocab_size"], h)})
        else:
            w["fc.weight"] = lin(h, 2 * h)
        self.w = nn.ParameterDict({k.replace(".", "__"): v for k, v in w.items()})
        self.register_buffer("d2t", torch.zeros(draft_vocab or cfg["vocab_size"], dtype=torch.long))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.w[name.replace(".", "__")]

    def checkpoint(self) -> dict[str, torch.Tensor]:
        out = {k.replace("__", "."): v.detach().clone().contiguous() for k, v in self.w.items()}
        if self.method == "eagle3":
            out["d2t"] = self.d2t.clone()
        return out

    def load_checkpoint(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k, v in tensors.items():
                if k == "d2t":
                    self.d2t.copy_(v)
                elif k.replace(".", "__") in self.w:
                    self[k].copy_(v)

    def layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the attention's input, the residual) of one position's (embedding, h)."""
        p = self.p
        if self.method == "eagle3":
            normed = rms_norm(hidden, self[f"{p}.hidden_norm.weight"], self.eps)
            x = torch.cat((rms_norm(embeds, self[f"{p}.input_layernorm.weight"], self.eps), normed), -1)
            return x, normed if self.norm_before_residual else hidden
        x = F.linear(torch.cat((embeds, hidden), -1), self["fc.weight"])
        return x, x

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        p = self.p
        shape = x.shape[:-1]
        q = F.linear(x, self[f"{p}.self_attn.q_proj.weight"]).view(*shape, self.heads, self.d)
        k = F.linear(x, self[f"{p}.self_attn.k_proj.weight"]).view(*shape, self.kv_heads, self.d)
        v = F.linear(x, self[f"{p}.self_attn.v_proj.weight"]).view(*shape, self.kv_heads, self.d)
        return rope(q, positions, self.theta), rope(k, positions, self.theta), v

    def attend_out(self, q, keys, values, mask, residual):
        """Attention of q [B, T, heads, d] over keys/values [B, S, kv, d] (mask [T, S]), then
        o_proj, the MLP and the output pair (for the lm_head, for the next h)."""
        p = self.p
        rep = self.heads // self.kv_heads
        k, v = keys.repeat_interleave(rep, dim=2), values.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(self.d)
        scores = scores.masked_fill(~mask, float("-inf"))
        a = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).flatten(-2)
        h = F.linear(a, self[f"{p}.self_attn.o_proj.weight"]) + residual
        n = rms_norm(h, self[f"{p}.post_attention_layernorm.weight"], self.eps)
        m = F.linear(F.silu(F.linear(n, self[f"{p}.mlp.gate_proj.weight"])) * F.linear(n, self[f"{p}.mlp.up_proj.weight"]),
                     self[f"{p}.mlp.down_proj.weight"])
        out = m + h
        if self.method == "eagle3":
            return rms_norm(out, self["norm.weight"], self.eps), out
        return out, out

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return F.linear(aux, self["fc.weight"])

    def logits(self, rows: torch.Tensor, target_lm_head: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary (EAGLE-3's draft vocabulary scattered into it)."""
        if self.method != "eagle3":
            return F.linear(rows, target_lm_head)
        draft = F.linear(rows, self["lm_head.weight"])
        ids = torch.arange(draft.shape[-1]) + self.d2t
        out = draft.new_full(draft.shape[:-1] + (target_lm_head.shape[0],), float("-inf"))
        out[..., ids] = draft
        return out

    def unrolled(self, embeds: torch.Tensor, hidden: torch.Tensor, depth: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The head over whole sequences [B, T] (embeds: of tokens 1..T, hidden: the target's at
        0..T-1), then depth - 1 passes fed with its own outputs, as serving's draft steps run:
        [(lm_head rows, next h)] per pass, each [B, T, H] (pass m valid from position m)."""
        t = embeds.shape[1]
        pos = torch.arange(t)
        idx = torch.arange(t)
        keys, values, outs = [], [], []
        h = hidden
        for m in range(depth):
            if m:
                prev = outs[-1][1]
                h = torch.cat((torch.zeros_like(prev[:, :1]), prev[:, :-1]), 1)   # pass m - 1's output at p - 1
            x, residual = self.layer_input(embeds, h)
            q, k, v = self.qkv(x, pos)
            keys.append(k)
            values.append(v)
            masks = [idx[None, :] <= idx[:, None] - m]                          # the target-fed pass: up to p - m
            masks += [idx[None, :] == idx[:, None] - (m - j) for j in range(1, m + 1)]   # later passes: diagonals
            outs.append(self.attend_out(q, torch.cat(keys, 1), torch.cat(values, 1), torch.cat(masks, 1), residual))
        return outs


def target_states(target, ids: torch.Tensor, aux_layers: tuple[int, ...] | None = None):
    """The HF target over a batch: (last hidden states [B, T, H] after the final norm, greedy
    choices [B, T], EAGLE-3's auxiliary streams [B, T, 3H] or None). hidden_states[i] (i below
    the layer count) is the stream entering layer i."""
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=bool(aux_layers))
        last = out.last_hidden_state
        aux = torch.cat([out.hidden_states[i] for i in aux_layers], -1) if aux_layers else None
    return last, target.lm_head(last).argmax(-1), aux


def _corpus(tokenizer) -> list[list[int]]:
    from frontend.tools.demo_model import _documents, zen_text
    completions, chats = _documents(zen_text())
    return [tokenizer.encode(d) for d in completions + chats]


def train_demo_eagle(demo_dir: str, out_dir: str, seconds: float = 60.0, steps: int | None = None, depth: int = 3,
                     seed: int = 0, batch: int = 16, window: int = 64) -> dict:
    """Train an EAGLE-1 head for the demo model (for `seconds` of CPU time, or `steps` optimizer
    steps: deterministic) and save it in EAGLE-1's layout. Returns the training summary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(demo_dir)
    with open(os.path.join(demo_dir, "config.json")) as f:
        cfg = json.load(f)
    docs = [d for d in _corpus(tok) if len(d) > 2]
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    # the target's states, once: [docs] of (ids, last hidden, greedy choices)
    data = []
    for d in docs:
        ids = torch.tensor([d])
        last, greedy, _ = target_states(target, ids)
        data.append((ids[0], last[0], greedy[0]))
    head = EagleReference(cfg, "eagle")
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    t0, step, losses = time.process_time(), 0, []
    while (steps is not None and step < steps) or (steps is None and time.process_time() - t0 < seconds):
        ids, last, greedy, valid = _windows(data, batch, window, g)
        outs = head.unrolled(embed[ids[:, 1:]], last[:, :-1], depth)
        loss = 0.0
        for m, (rows, nxt) in enumerate(outs):
            mask = valid[:, 1 + m:]
            logits = head.logits(rows[:, m:][mask], lm_head)
            loss = loss + F.cross_entropy(logits, greedy[:, 1 + m:][mask]) / depth
            loss = loss + 0.1 * F.smooth_l1_loss(nxt[:, m:][mask], last[:, 1 + m:][mask]) / depth
        for group in opt.param_groups:
            group["lr"] = 3e-3 * min(1.0, (step + 1) / 20)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 25 == 0:
            logger.info("demo eagle: step %d loss %.3f (%.0f s)", step, losses[-1], time.process_time() - t0)
    save_eagle1(head, cfg, out_dir)
    return {"steps": step, "loss": sum(losses[-10:]) / max(1, len(losses[-10:])), "cpu_s": time.process_time() - t0}


def _windows(data, batch: int, window: int, g: torch.Generator):
    """A batch of random windows of `window` tokens (shorter documents padded; `valid` marks
    the real tokens): (ids, last hidden, greedy choices, valid)."""
    ids = torch.zeros(batch, window, dtype=torch.long)
    last = torch.zeros(batch, window, data[0][1].shape[-1])
    greedy = torch.zeros(batch, window, dtype=torch.long)
    valid = torch.zeros(batch, window, dtype=torch.bool)
    for b, i in enumerate(torch.randint(len(data), (batch,), generator=g).tolist()):
        d_ids, d_last, d_greedy = data[i]
        start = int(torch.randint(max(1, len(d_ids) - window + 1), (1,), generator=g))
        n = min(window, len(d_ids) - start)
        ids[b, :n], last[b, :n], greedy[b, :n] = (d_ids[start:start + n], d_last[start:start + n],
                                                  d_greedy[start:start + n])
        valid[b, :n] = True
    return ids, last, greedy, valid


def save_eagle1(head: EagleReference, target_cfg: dict, out_dir: str) -> None:
    """EAGLE-1's public layout: a Llama config of one layer, pytorch_model.bin."""
    os.makedirs(out_dir, exist_ok=True)
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "max_position_embeddings", "vocab_size", "rope_parameters", "rope_theta", "head_dim")
    cfg = {k: target_cfg[k] for k in keys if k in target_cfg}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, bias=False)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    torch.save(head.checkpoint(), os.path.join(out_dir, "pytorch_model.bin"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("demo_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--seconds", type=float, default=60.0, help="CPU seconds of training")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps instead (deterministic)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    print(json.dumps(train_demo_eagle(args.demo_dir, args.out_dir, args.seconds, args.steps)))


if __name__ == "__main__":
    main()
