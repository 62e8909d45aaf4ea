"""The generic transformers path (workers/models/transformers.py, --model-impl): Llama served by
it equals HF and Loom's native Llama; the choice of implementation; the start-up refusals; the
Triton KV-cache write it uses under CUDA graphs; dummy weights and the KV shape it learns from
its attention modules. (tests/test_arch_parity.py checks every generic architecture vs HF.)"""
from __future__ import annotations

import json
import os

import pytest
import torch

from frontend import LLM, SamplingParams
from ipc.config import ConfigError, EngineConfig
from tests.hf_oracle import hf_greedy
from tests.test_engine_parity import _prompts
from workers.models.registry import check_architecture

ENGINE_IN_PROCESS = True   # outputs only: the engine in the test process (tests/conftest.py engine_in_process)

MAX_NEW = 16


def _greedy(model_dir: str, prompts, max_tokens: int = MAX_NEW, **options) -> list[list[int]]:
    with LLM(model_dir, block_size=4, max_num_seqs=2, max_model_len=128, **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]


def test_llama_generic_equals_native_and_hf(model_factory):
    model_dir = model_factory("llama")
    prompts = _prompts(300, 3, seed=2)
    generic = _greedy(model_dir, prompts, model_impl="transformers")
    assert generic == _greedy(model_dir, prompts, model_impl="loom")
    assert generic == [hf_greedy(model_dir, p, MAX_NEW) for p in prompts]


def test_generic_path_on_triton_kernels_and_decode_graphs(model_factory, monkeypatch):
    """The Triton KV write and paged attention (interpreted on the CPU) and the decode graphs'
    work (uncaptured on the CPU): the same tokens as the eager torch path."""
    model_dir = model_factory("llama", num_hidden_layers=1)   # its RMSNorms on the Triton kernel too
    prompts = [p[:8] for p in _prompts(300, 2, seed=3)]   # (the interpreter is slow: a short run)
    eager = _greedy(model_dir, prompts, 4, model_impl="transformers")
    monkeypatch.setenv("LOOM_DECODE_GRAPHS_ON_CPU", "1")
    assert _greedy(model_dir, prompts, 4, model_impl="transformers", attention_backend="triton") == eager


def _config_dir(tmp_path, **hf) -> str:
    d = tmp_path / hf["architectures"][0]
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"vocab_size": 64, **hf}))
    return str(d)


def _check(model_dir: str, **options) -> None:
    check_architecture(EngineConfig(model=model_dir, **options))


def test_model_impl_choice_and_refusals(tmp_path):
    llama = _config_dir(tmp_path, architectures=["LlamaForCausalLM"], model_type="llama")
    neox = _config_dir(tmp_path, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    for impl in ("auto", "loom", "transformers"):
        _check(llama, model_impl=impl)
    _check(neox)   # auto: no native file, served generically
    with pytest.raises(ConfigError, match="no native implementation"):
        _check(neox, model_impl="loom")
    with pytest.raises(ConfigError, match="one GPU only"):
        _check(neox, tensor_parallel_size=2)
    _check(llama, tensor_parallel_size=2)   # native Llama splits
    with pytest.raises(ConfigError, match="one GPU only"):
        _check(llama, model_impl="transformers", tensor_parallel_size=2)
    refused = {
        "MambaForCausalLM": ("mamba", "recurrent state"),
        "FalconForCausalLM": ("falcon", "attention interface"),
        "T5ForConditionalGeneration": ("t5", "encoder-decoder"),
        "BertModel": ("bert", "no causal LM"),
        "LlavaForConditionalGeneration": ("llava", "multimodal"),
    }
    for arch, (model_type, why) in refused.items():
        d = _config_dir(tmp_path, architectures=[arch], model_type=model_type,
                        is_encoder_decoder=model_type == "t5")
        with pytest.raises(ConfigError, match=f"unsupported architecture: .*{why}"):
            _check(d, model_impl="transformers")


def test_llm_refuses_at_start_up_in_one_line(tmp_path):
    d = _config_dir(tmp_path, architectures=["MambaForCausalLM"], model_type="mamba", max_position_embeddings=64)
    with pytest.raises(ConfigError) as e:
        LLM(d)
    assert "\n" not in str(e.value) and "MambaForCausalLM" in str(e.value)


def test_kv_write_kernel_matches_reference():
    from kernels.kv_cache_write import write_kv_cache
    from kernels.paged_attention import write_kv_cache_ref
    torch.manual_seed(0)
    key = torch.randn(2, 5, 8).transpose(0, 1)   # [T, H, D] with a head stride, as HF's [1, H, T, D] gives
    value = torch.randn(5, 2, 8)
    slots = torch.tensor([3, -1, 9, 0, 14])
    caches = [torch.full((4, 4, 2, 8), float("nan")) for _ in range(4)]
    write_kv_cache(key, value, caches[0], caches[1], slots)
    write_kv_cache_ref(key, value, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True)
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True)


def test_dummy_weights_and_learned_kv_shape(model_factory):
    """Multi-query GPTBigCode: the KV cache has the modules' one KV head (the config names
    none); dummy weights fill every parameter (norms with 1), deterministically."""
    from workers.model_loader import kv_cache_shape, load_model
    model_dir = model_factory("gpt_bigcode")
    a = load_model(model_dir, torch.float32, "cpu", "dummy", model_impl="transformers")
    b = load_model(model_dir, torch.float32, "cpu", "dummy", model_impl="transformers")
    assert kv_cache_shape(a) == (2, 1, 16)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
        if name.endswith("ln_f.weight"):
            assert bool((p == 1).all())
    real = load_model(model_dir, torch.float32, "cpu", model_impl="transformers")
    assert set(dict(real.named_parameters())) == set(dict(a.named_parameters()))
    assert os.path.isfile(os.path.join(model_dir, "model.safetensors"))


def test_weight_update_names_are_the_checkpoints(model_factory):
    """A trainer sends HF's names: a dummy generic model (its gated MLPs fused, FusedGatedMLP)
    expects exactly the checkpoint's tensors, and loading them all as an update (partial) gives
    the model loaded from the checkpoint."""
    from safetensors.torch import load_file

    from workers.model_loader import load_model
    from workers.weight_update import expected_shapes
    model_dir = model_factory("llama")
    dummy = load_model(model_dir, torch.float32, "cpu", "dummy", model_impl="transformers")
    real = load_model(model_dir, torch.float32, "cpu", model_impl="transformers")
    ckpt = load_file(os.path.join(model_dir, "model.safetensors"))
    assert type(dummy.model.layers[0].mlp).__name__ == "FusedGatedMLP"
    assert expected_shapes(dummy, model_dir, "dummy") == {n: tuple(t.shape) for n, t in ckpt.items()}
    assert dummy.load_weights(list(ckpt.items()), partial=True) == set(ckpt)
    for (name, p), (_, q) in zip(dummy.named_parameters(), real.named_parameters()):
        assert torch.equal(p, q), name


def _generic_model(model_dir: str):
    from transformers import AutoConfig

    from workers.models.transformers import TransformersForCausalLM
    return TransformersForCausalLM(AutoConfig.from_pretrained(model_dir))


def test_fused_decoder_layers_taken_for_llama_refused_otherwise(model_factory, monkeypatch):
    """Llama's pre-norm layers run fused (transformers_fused.py), equal to HF's forward on the
    same weights; sandwich norms (Gemma 2), post-norms (OLMo-2), a forward that is not Llama's
    behind Llama's children, and LOOM_GENERIC_FUSED_LAYERS=0 keep HF's."""
    from transformers.models.llama import modeling_llama

    llama = model_factory("llama")
    model = _generic_model(llama)
    assert model.fused_layers == model.config.num_hidden_layers > 0
    decoder = model._decoder
    assert all("forward" in layer.__dict__ for layer in decoder.layers)
    ids = torch.tensor([[3, 17, 5, 9, 2, 11]])
    model.step.echo = True
    try:
        fused = decoder(input_ids=ids, position_ids=torch.arange(6)[None], use_cache=False).last_hidden_state
        monkeypatch.setenv("LOOM_GENERIC_FUSED_LAYERS", "0")
        plain_model = _generic_model(llama)
        assert plain_model.fused_layers == 0
        plain_model.load_state_dict(model.state_dict())
        plain_model.step.echo = True
        plain = plain_model._decoder(input_ids=ids, position_ids=torch.arange(6)[None],
                                     use_cache=False).last_hidden_state
    finally:
        model.step.echo = False
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-5)
    monkeypatch.delenv("LOOM_GENERIC_FUSED_LAYERS")
    for arch in ("gemma2", "olmo2"):
        assert _generic_model(model_factory(arch)).fused_layers == 0, arch
    original = modeling_llama.LlamaDecoderLayer.forward

    def shifted(self, hidden_states, **kwargs):   # Llama's children, another forward
        return original(self, hidden_states, **kwargs) + 0.1
    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", shifted)
    assert _generic_model(llama).fused_layers == 0


def test_fused_layers_check_does_not_read_unloaded_weights(model_factory, monkeypatch):
    """The start-up check runs before the weights load, when the fused q/k/v and gate/up
    projections hold whatever torch.empty's memory held: with NaN there, Llama's layers are still
    fused (the check seeds the weights first; before, it refused them at random: a CI flake)."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", nan_empty)
    model = _generic_model(model_factory("llama"))
    assert model.fused_layers == model.config.num_hidden_layers > 0
