"""Whisper (encoder-decoder) through the whole engine matches HF transformers (greedy, fp32,
CPU): one clip, a stereo clip (made mono), a clip at 44.1 kHz (resampled with soxr), a prompt
through <|startofprev|>, and the translate task; the features equal HF's WhisperFeatureExtractor's
and the decoder prompt its tokenizer's. Each request's encoder runs once and its
cross-attention K/V fill its own rows of the pool (workers/cross_kv.py)."""
from __future__ import annotations

import numpy as np
import pytest

from frontend import LLM, SamplingParams
from tests.tiny_audio_models import speech_like
from tests.tiny_whisper import hf_whisper_greedy, make_tiny_whisper, whisper_prompt

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)

MAX_NEW = 8
RATE = 16000

CASES = [(speech_like(1, 3.0, RATE), RATE, {}),
         (speech_like(2, 12.0, RATE), RATE, {}),
         (speech_like(3, 2.0, RATE, channels=2), RATE, {}),
         (speech_like(4, 2.5, 44100), 44100, {}),
         (speech_like(5, 4.0, RATE), RATE, {"prompt": " hello there"}),
         (speech_like(6, 4.0, RATE), RATE, {"task": "translate", "language": "fr"})]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_whisper(str(tmp_path_factory.mktemp("whisper")))


def test_whisper_matches_hf(model_dir, monkeypatch):
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")   # the decode graphs' path (uncaptured on the CPU)
    with LLM(model_dir, max_num_seqs=4, block_size=8, mm_processor_cache_gb=0.02) as llm:
        prompts = [{"prompt": whisper_prompt(**kw), "multi_modal_data": {"audio": (clip, rate)}}
                   for clip, rate, kw in CASES]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
        assert len({tuple(o.outputs[0].token_ids) for o in outs}) >= len(outs) - 1   # the audio matters
        for (clip, rate, kw), o in zip(CASES, outs):
            ids, ref, _ = hf_whisper_greedy(model_dir, clip, rate, MAX_NEW, **kw)
            assert o.prompt_token_ids == ids
            assert o.outputs[0].token_ids == ref, kw
        # again, one at a time (other rows of the pool), and sampled: seeded runs agree
        again = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
        assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids
        sampled = [llm.generate([prompts[0]], SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_NEW),
                                use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
        assert sampled[0] == sampled[1] and len(sampled[0]) >= 1


def test_whisper_features_match_hf(model_dir):
    """The processor's features (what travels through the store) are HF's, one placeholder per clip."""
    from multimodal.audio import as_audio
    from transformers import AutoFeatureExtractor
    from workers.models.whisper import WhisperAudio
    fe = AutoFeatureExtractor.from_pretrained(model_dir)
    info = WhisperAudio()
    for clip, rate, _ in CASES[:4]:
        audio = info.prepare((clip, rate), model_dir)
        arrays = info.arrays(info.run_processor(fe, audio, {}))
        _, _, ref = hf_whisper_greedy(model_dir, clip, rate, 1)
        np.testing.assert_allclose(arrays["input_features"], ref, rtol=0, atol=1e-5)
        import json
        import os
        with open(os.path.join(model_dir, "config.json")) as f:
            assert info.placeholder_tokens(json.load(f), arrays) == 1
    assert as_audio((CASES[0][0], RATE), RATE).samples.shape == CASES[0][0].shape


def _write_rows(cross, rows: list[int], kv) -> None:
    """Keys and values [len(rows), frames, heads, head_dim] per layer into the pool's rows."""
    for layer, (k, v) in enumerate(kv):
        kc, vc = cross.row_view(layer)
        kc[rows, :cross.frames], vc[rows, :cross.frames] = k, v


_KERNEL_CHECK = r"""
import torch
from types import SimpleNamespace
from kernels.jit import runs_triton
from kernels.paged_attention import _paged_attention_kernel
from workers.cross_kv import CrossKV
torch.manual_seed(0)
cross = CrossKV(2, 3, 20, 2, 16, 8, torch.float32, torch.device("cpu"))
for layer in range(2):   # rows 0-2 of each layer: random keys and values
    kc, vc = cross.row_view(layer)
    kc[[0, 1, 2], :20], vc[[0, 1, 2], :20] = torch.randn(3, 20, 2, 16), torch.randn(3, 20, 2, 16)
import numpy as np
cross.begin_step(np.array([2, 0, 1]))
q = torch.randn(3, 2, 16)
meta = SimpleNamespace(max_query_len=1, backend="triton")
assert runs_triton(_paged_attention_kernel, q)
got = cross.attend(1, q, 0.25, meta)
want = cross.attend(1, q, 0.25, SimpleNamespace(max_query_len=1, backend="torch"))
torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
print("ok")
"""


def test_cross_attention_decode_kernel_matches_torch():
    """The decode path's Triton paged attention over the cross pool (the GPU's, in decode
    graphs) equals the gathered SDPA path, in the Triton interpreter."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_clips_joining_decodes_keep_the_steps_in_decode_graphs(model_dir, monkeypatch):
    """A clip's 4-token decoder prompt goes one token per step beside running requests
    (stepwise_prompt_tokens): after the first step (a whole prompt, and the next clip's first
    token beside it) every step is a decode graph's, clips joining included; the outputs are
    the same as one clip at a time."""
    import workers.model_runner as runner
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    steps, prepare = [], runner.ModelRunner.prepare

    def spy(self, so, prev):
        batch = prepare(self, so, prev)
        if batch is not None:
            steps.append((batch.decode_graph_size is not None, [int(n) for n in batch.num_scheduled]))
        return batch

    monkeypatch.setattr(runner.ModelRunner, "prepare", spy)
    prompts = [{"prompt": whisper_prompt(), "multi_modal_data": {"audio": (clip, rate)}} for clip, rate, _ in CASES[:4]]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    with LLM(model_dir, max_num_seqs=2, block_size=8, mm_processor_cache_gb=0.02) as llm:
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert steps[0] == (False, [4, 1])
        assert all(graph for graph, _ in steps[1:]) and sum(len(n) == 2 for _, n in steps) > 2 * MAX_NEW
        alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_whisper_turns_prefix_caching_off(model_dir):
    from ipc.config import EngineConfig
    from workers.models.registry import multimodal_info
    config = EngineConfig(model=model_dir)
    config.resolve(multimodal_info)
    assert config.enable_prefix_caching is False and config.mm_modality == "audio"


def test_whisper_prompt_chunked_before_its_placeholder(model_dir):
    """A <|startofprev|> prompt longer than the step's token budget is prefilled in chunks before
    <|startoftranscript|>: those tokens cross-attend too, so the clip is encoded before them and
    the output is still HF's."""
    clip = speech_like(9, 3.0, RATE)
    prompt = " the quick brown fox jumps over the lazy dog, again and again and again"
    with LLM(model_dir, max_num_seqs=2, block_size=8, max_num_batched_tokens=8, mm_processor_cache_gb=0.02) as llm:
        out = llm.generate([{"prompt": whisper_prompt(prompt=prompt), "multi_modal_data": {"audio": (clip, RATE)}}],
                           SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
    ids, ref, _ = hf_whisper_greedy(model_dir, clip, RATE, MAX_NEW, prompt=prompt)
    assert len(ids) > 16 and out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == ref


def test_whisper_large_v3_preset(tmp_path):
    """`loom bench preset whisper-large-v3 DIR` writes Whisper-large-v3's shapes, its feature
    extractor (128 mel bins) and a tokenizer with the special tokens at their real ids."""
    from transformers import AutoConfig, AutoFeatureExtractor, AutoTokenizer

    from bench.presets import write_preset
    from workers.models.whisper import WhisperAudio
    d = write_preset("whisper-large-v3", str(tmp_path))
    c = AutoConfig.from_pretrained(d)
    assert (c.d_model, c.encoder_layers, c.decoder_layers, c.decoder_attention_heads, c.vocab_size) == \
        (1280, 32, 32, 20, 51866)
    assert AutoFeatureExtractor.from_pretrained(d).feature_size == 128
    ids = AutoTokenizer.from_pretrained(d)(WhisperAudio().transcription_prompt("translate", "de", ""),
                                           add_special_tokens=False)["input_ids"]
    assert ids == [50258, 50261, 50359, 50364]


def test_cross_attention_mixed_step_matches_reference():
    """A mixed step (two decodes, then prompts of 3 and 2 tokens): every token attends over all
    frames of its own request's row, as plain softmax attention computes it."""
    from types import SimpleNamespace

    import torch

    from workers.cross_kv import CrossKV
    torch.manual_seed(0)
    cross = CrossKV(1, 5, 20, 2, 16, 8, torch.float32, torch.device("cpu"))
    keys, values = torch.randn(5, 20, 2, 16), torch.randn(5, 20, 2, 16)
    _write_rows(cross, [0, 1, 2, 3, 4], [(keys, values)])
    rows = [3, 0, 4, 1]
    cross.begin_step(np.array(rows))
    lens = [1, 1, 3, 2]
    q = torch.randn(sum(lens), 2, 16)
    meta = SimpleNamespace(max_query_len=3, num_decodes=2, backend="torch", seq_lens=torch.tensor([9, 9, 3, 2]),
                           query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32))
    got = cross.attend(0, q, 0.25, meta)
    request = np.repeat(np.arange(4), lens)
    for t in range(len(q)):
        r = rows[request[t]]
        w = torch.softmax(torch.einsum("hd,fhd->hf", q[t], keys[r]) * 0.25, dim=-1)
        torch.testing.assert_close(got[t], torch.einsum("hf,fhd->hd", w, values[r]).reshape(-1))


def test_cross_kv_projection_fills_every_layer_of_its_rows():
    """CrossKV.project (one batched GEMM per clip over the stacked projections, written in place)
    equals each layer's linear projection written with fill(), and leaves the other rows alone."""
    import torch

    from workers.cross_kv import CrossKV
    torch.manual_seed(0)
    layers, d, frames = 3, 32, 20
    k_w, v_w, v_b = torch.randn(layers, d, d), torch.randn(layers, d, d), torch.randn(layers, d)
    encoded = [torch.randn(frames, d) for _ in range(2)]
    got = CrossKV(layers, 4, frames, 2, 16, 8, torch.float32, torch.device("cpu"))
    got.project([3, 1], encoded, k_w, v_w, v_b)
    want = CrossKV(layers, 4, frames, 2, 16, 8, torch.float32, torch.device("cpu"))
    x = torch.stack(encoded)
    _write_rows(want, [3, 1], [((x @ k_w[i].T).view(2, frames, 2, 16), (x @ v_w[i].T + v_b[i]).view(2, frames, 2, 16))
                               for i in range(layers)])
    for (gk, gv), (wk, wv) in zip(got.caches, want.caches):
        torch.testing.assert_close(gk, wk)
        torch.testing.assert_close(gv, wv)
    assert got.row_view(2)[0][3, :frames].abs().sum() > 0 and got.row_view(2)[0][0].abs().sum() == 0


def test_encoder_graphs_pad_and_slice_as_the_eager_encoder(model_dir):
    """EncoderGraphs (uncaptured on the CPU: the padded batch run as the graph would) gives each
    clip the eager encoder's output, at 1 clip, between sizes (3, padded to 4), at the largest
    size, and past it (eager), with stale rows from an earlier batch in the padding."""
    import torch
    from transformers import WhisperConfig

    from workers.encoder_graphs import EncoderGraphs
    from workers.models.whisper import WhisperForConditionalGeneration
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(WhisperConfig.from_pretrained(model_dir)).eval()
    shape = (model.config.num_mel_bins, 2 * model.config.max_source_positions)
    graphs = EncoderGraphs(model.audio_tower, shape, torch.float32, torch.device("cpu"), capture=False)
    with torch.inference_mode():
        for n in (8, 1, 3, 9):
            feats = torch.randn(n, *shape)
            torch.testing.assert_close(graphs(feats), model.audio_tower(feats), rtol=1e-5, atol=1e-5)
    assert graphs.size_for(3) == 4 and graphs.size_for(9) is None
