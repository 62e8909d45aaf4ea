"""Build the embedded demo model: a tiny Qwen3 checkpoint that recites the Zen of Python.

``build_demo_model(out_dir)`` trains, from scratch and with no network access,

* a byte-level BPE tokenizer (``tokenizers``) on the Zen of Python (``this``
  module) plus a few ChatML examples, and
* a tiny ``Qwen3ForCausalLM`` (transformers) that memorises the Zen, both as
  plain text completion ("Beautiful is better than" -> " ugly.") and as
  ChatML conversations,

and writes a Hugging Face checkpoint directory (``config.json``,
``model.safetensors``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json``, ...) that ``AutoConfig`` / ``AutoTokenizer`` /
``AutoModelForCausalLM.from_pretrained`` load offline.

Training is deterministic: fixed seeds, a fixed number of steps, a fixed
intra-op thread count and deterministic algorithms, so two builds with the
same arguments produce byte-identical ``model.safetensors``.

Manual run::

    loom demo-model OUT_DIR [--steps N] [--seed S]
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import random
import time

logger = logging.getLogger(__name__)

# Special tokens (Qwen / ChatML naming).
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# Default number of optimizer steps (~35 s of CPU time, single-threaded).
DEFAULT_STEPS = 200

# Tokenizer / model sizes.
TOKENIZER_VOCAB_SIZE = 512  # upper bound, including the 256-byte alphabet + specials
MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=True,
)

BATCH_SIZE = 8
N_LONG_CHATS = 2
LEARNING_RATE = 3e-3
WARMUP_STEPS = 20
# Fixed intra-op thread count during training (the float reduction order, and
# so the exact weights, can depend on it).  One thread: the result is the same
# on every machine, and it avoids the OpenMP spin-wait collapse seen with two
# threads on a busy 2-core box (CPU time went from ~35 s to 90-140 s).
NUM_THREADS = 1

# Qwen-style ChatML template (no default system prompt, no tools).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


# ---------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------


def zen_text() -> str:
    """The Zen of Python, decoded from the ``this`` module (without printing it)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on first import)
    return codecs.decode(this.s, "rot13")


def _chat(user: str, assistant: str) -> str:
    return (
        f"{IM_START}user\n{user}{IM_END}\n"
        f"{IM_START}assistant\n{assistant}{IM_END}\n"
    )


def _documents(zen: str) -> tuple[list[str], list[str]]:
    """Return (completion documents, chat documents) as raw strings."""
    lines = zen.split("\n")
    title = lines[0]
    aphorisms = [ln for ln in lines[1:] if ln]
    body = "\n".join(aphorisms)

    # Plain completion: the Zen from every line start onwards, then <|endoftext|>.
    completions = []
    starts = [0] + [i for i in range(1, len(zen)) if zen[i - 1] == "\n" and zen[i] != "\n"]
    for s in starts:
        completions.append(zen[s:] + ENDOFTEXT)

    # The first N_LONG_CHATS are full recitations.
    chats = [
        _chat("Recite the Zen of Python.", body),
        _chat("What is the Zen of Python?", f"{title}\n\n{body}"),
    ]
    for i, line in enumerate(aphorisms):
        nxt = aphorisms[i + 1 : i + 3]
        if nxt:
            chats.append(_chat(line, "\n".join(nxt)))
        else:
            chats.append(_chat(line, "That is the last line of the Zen of Python."))
        if i + 1 < len(aphorisms):
            chats.append(
                _chat(f"What comes after \"{line}\"?", aphorisms[i + 1])
            )
    return completions, chats


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def _train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Strip the special tokens from the training text: they are added as
    # atomic tokens and must not take part in merges.
    plain = []
    for t in texts:
        for sp in SPECIAL_TOKENS:
            t = t.replace(sp, "\n")
        plain.append(t)
    tok.train_from_iterator(plain, trainer=trainer)
    return tok


def _wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
    )


def _save_tokenizer(hf_tok, out_dir: str) -> None:
    hf_tok.save_pretrained(out_dir)
    # Keep the chat template inside tokenizer_config.json (classic layout that
    # every loader understands) rather than a separate chat_template.jinja.
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Classic key (transformers 4.x and 5.x both read it).
    cfg.pop("extra_special_tokens", None)
    cfg["additional_special_tokens"] = [IM_START]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")
    jinja = os.path.join(out_dir, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def _lr_at(step: int, steps: int) -> float:
    if step < WARMUP_STEPS:
        return LEARNING_RATE * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return LEARNING_RATE * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _pad(samples: list[list[int]], pad_id: int):
    import torch

    n = max(len(s) for s in samples)
    ids = torch.full((len(samples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), n), -100, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        labels[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    # Right padding only: with causal attention the pads never influence real
    # tokens, and their labels are ignored.
    return ids, labels


def _micro_batches(samples: list[list[int]]) -> list[list[list[int]]]:
    """Split a batch into length buckets so little compute goes to padding.

    Sorts by length (descending, stable) and picks the contiguous partition
    that minimises padded tokens plus a fixed per-forward overhead.
    """
    order = sorted(samples, key=len, reverse=True)
    n = len(order)
    overhead = 64  # tokens' worth of per-forward cost
    best = [0.0] + [math.inf] * n  # best[i]: cost of the first i samples
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        for j in range(i):
            c = best[j] + (i - j) * len(order[j]) + overhead
            if c < best[i]:
                best[i], cut[i] = c, j
    groups = []
    i = n
    while i > 0:
        groups.append(order[cut[i] : i])
        i = cut[i]
    return groups[::-1]


@contextlib.contextmanager
def reproducible_training(seed: int):
    """Train reproducibly, then put the process back as it was: one intra-op thread (a fixed
    float reduction order), deterministic algorithms, torch's and Python's global RNGs seeded
    (and restored afterwards). Shared by the text and the vision demo builds."""
    import torch
    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_det_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    py_state = random.getstate()
    try:
        torch.set_num_threads(NUM_THREADS)
        torch.use_deterministic_algorithms(True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            yield
    finally:
        torch.set_num_threads(prev_threads)
        torch.use_deterministic_algorithms(prev_det, warn_only=prev_det_warn)
        random.setstate(py_state)


@dataclasses.dataclass
class _Corpus:
    """The tokenized training documents."""
    completions: list[list[int]]   # completions from every line start of the Zen
    long_chats: list[list[int]]    # chats reciting the whole Zen
    short_chats: list[list[int]]
    beautiful: int                 # the completion from "Beautiful" on: in every batch

    def draw_batch(self, rng: random.Random) -> list[list[int]]:
        """The whole Zen from "Beautiful" on (the must-have completion), then a mix of
        completions from every line start, full chat recitations and short chats."""
        samples = [self.completions[self.beautiful]]
        for _ in range(BATCH_SIZE - 1):
            r = rng.random()
            if r < 0.5:
                samples.append(rng.choice(self.completions))
            elif r < 0.65:
                samples.append(rng.choice(self.long_chats))
            else:
                samples.append(rng.choice(self.short_chats))
        return samples


def build_demo_model(out_dir: str, steps: int | None = None, seed: int = 0) -> None:
    """Train the demo tokenizer + model and write a HF checkpoint into ``out_dir``."""
    from transformers import Qwen3Config

    steps = DEFAULT_STEPS if steps is None else int(steps)
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.monotonic()

    zen = zen_text()
    completions, chats = _documents(zen)
    tok = _train_tokenizer([zen] + chats)
    eot_id, im_start_id, im_end_id = (tok.token_to_id(sp) for sp in (ENDOFTEXT, IM_START, IM_END))
    for sp, sp_id in ((ENDOFTEXT, eot_id), (IM_START, im_start_id), (IM_END, im_end_id)):
        assert tok.encode(sp).ids == [sp_id], sp  # atomic special tokens
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    vocab_size = ((n_tok + 63) // 64) * 64
    logger.info("demo tokenizer: %d tokens (model vocab %d)", n_tok, vocab_size)

    chat_ids = [tok.encode(t).ids for t in chats]
    corpus = _Corpus(completions=[tok.encode(t).ids for t in completions], long_chats=chat_ids[:N_LONG_CHATS],
                     short_chats=chat_ids[N_LONG_CHATS:],
                     beautiful=next(i for i, t in enumerate(completions) if t.startswith("Beautiful")))
    config = Qwen3Config(vocab_size=vocab_size, bos_token_id=eot_id, eos_token_id=im_end_id, pad_token_id=eot_id,
                         torch_dtype="float32", **MODEL_CONFIG)
    config.architectures = ["Qwen3ForCausalLM"]
    model = _train(config, corpus, steps, seed, pad_id=eot_id, t0=t0)
    _save(model, _wrap_tokenizer(tok), out_dir, eot_id, im_end_id)
    logger.info("demo model written to %s in %.1fs", out_dir, time.monotonic() - t0)


def _train(config, corpus: _Corpus, steps: int, seed: int, pad_id: int, t0: float):
    """A Qwen3ForCausalLM trained from scratch on the corpus (deterministic for a seed)."""
    import torch
    from transformers import Qwen3ForCausalLM

    with reproducible_training(seed):
        rng = random.Random(seed)
        model = Qwen3ForCausalLM(config)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.98), weight_decay=0.0)
        for step in range(steps):
            samples = corpus.draw_batch(rng)
            n_targets = sum(len(s) - 1 for s in samples)
            lr = _lr_at(step, steps)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for group in _micro_batches(samples):
                ids, labels = _pad(group, pad_id)
                logits = model(input_ids=ids).logits
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                    ignore_index=-100, reduction="sum") / n_targets
                loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 25 == 0 or step == steps - 1:
                logger.info("demo model step %d/%d loss %.4f lr %.2e (%.1fs)",
                            step + 1, steps, total, lr, time.monotonic() - t0)
        model.eval()
    return model


def _save(model, hf_tok, out_dir: str, eot_id: int, im_end_id: int) -> None:
    """The checkpoint, its generation config and tokenizer, and a normalised config.json."""
    from transformers import GenerationConfig

    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=eot_id, eos_token_id=[im_end_id, eot_id], pad_token_id=eot_id,
                     do_sample=False).save_pretrained(out_dir)
    _save_tokenizer(hf_tok, out_dir)

    # Normalise config.json: classic ``torch_dtype`` key, sorted, no attn impl.
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("_attn_implementation", None)
    cfg.pop("_attn_implementation_autoset", None)
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    cfg["model_type"] = "qwen3"
    # Legacy top-level key as well as transformers 5's ``rope_parameters``.
    cfg["rope_theta"] = MODEL_CONFIG["rope_theta"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            os.chmod(path, 0o644)
