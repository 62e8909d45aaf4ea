"""Incremental detokenization against the `tokenizers` API it needs: DecodeStream primed with the
prompt's last ids (`ids=`, tokenizers >= 0.22; 0.21 raises TypeError, which broke every stream)."""
from __future__ import annotations

import re

import pytest
import tokenizers
from transformers import AutoTokenizer

from frontend.detokenizer import IncrementalDetokenizer, TokenTexts
from ipc.sampling_params import SamplingParams
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def test_pinned_tokenizers_is_the_one_installed_or_older():
    """pyproject.toml's lowest tokenizers is what the code is written for: the installed one may not be older."""
    with open(f"{ROOT}/pyproject.toml") as f:
        pin = re.search(r'"tokenizers>=([\d.]+)"', f.read())
    assert pin, "pyproject.toml must pin tokenizers>=X"
    assert _version(tokenizers.__version__) >= _version(pin.group(1))


@pytest.mark.parametrize("text", ["Hello world! How are you today?", "Tell me a story about a cat and a dog."])
def test_stream_primed_with_prompt_ids_matches_a_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > 8
    prompt, output = ids[:5], ids[5:]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams(max_tokens=len(output)))
    for t in output:
        assert detok.add(t) is None
    detok.flush()
    streamed = detok.take_delta(finished=True)
    # the prompt's text followed by the streamed text is the full text: spacing comes from the primed ids
    assert tokenizer.decode(prompt) + streamed == tokenizer.decode(ids)


def test_decode_stream_takes_prefill_ids(tokenizer):
    """The exact call frontend/detokenizer.py makes (fails with TypeError on tokenizers < 0.22)."""
    from tokenizers.decoders import DecodeStream
    ids = tokenizer.encode("Hello world! How are you", add_special_tokens=False)
    stream = DecodeStream(ids=ids[:3], skip_special_tokens=True)
    pieces = [stream.step(tokenizer._tokenizer, t) for t in ids[3:]]
    assert tokenizer.decode(ids[:3]) + "".join(p for p in pieces if p) == tokenizer.decode(ids)


def test_token_texts_equal_the_tokenizers_decode_of_each_id(tokenizer):
    """Logprobs name their tokens through TokenTexts (the Rust decode where it is the same):
    every id, special tokens included, as tokenizer.decode([id]) names it; and where HF would
    clean up spaces, HF's decode itself."""
    texts = TokenTexts(tokenizer)
    assert [texts[i] for i in range(len(tokenizer))] == [tokenizer.decode([i]) for i in range(len(tokenizer))]
    assert texts._decode.__qualname__.startswith("_rust_decode")
    tokenizer.clean_up_tokenization_spaces = True
    try:
        cleaned = TokenTexts(tokenizer)
        assert not cleaned._decode.__qualname__.startswith("_rust_decode")
        assert [cleaned[i] for i in range(len(tokenizer))] == [tokenizer.decode([i]) for i in range(len(tokenizer))]
    finally:
        tokenizer.clean_up_tokenization_spaces = False
