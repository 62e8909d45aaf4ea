"""Weight updates (from disk, from tensors) under pause, and the torch profiler, through the
offline LLM. The oracle for "a fresh engine on the new weights" is HF transformers.

One engine serves the module; every test leaves it on checkpoint A, unpaused and awake."""
from __future__ import annotations

import glob
import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from frontend import LLM, SamplingParams
from ipc.sockets import free_tcp_port
from tests.conftest import shm_entries
from tests.hf_oracle import hf_greedy

ENGINE_IN_PROCESS = True   # weights and outputs only: the engine in the test process (tests/conftest.py engine_in_process)

PROMPTS = [[11, 12, 13, 14], [50, 60, 70], [101, 102, 103, 104, 105, 106]]
LONG = 40
GREEDY = SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True)
K_PROJ = "model.layers.0.self_attn.k_proj.weight"   # a part of the fused qkv_proj


@pytest.fixture(scope="module")
def ckpt(model_factory):
    """Two checkpoints of one architecture: A (served first) and B (another seed)."""
    return model_factory("qwen3"), model_factory("qwen3", seed=1)


JOIN_TIMEOUT_S = 2   # a trainer that never joins fails init_weights_update_group after this


@pytest.fixture(scope="module")
def llm(ckpt, tmp_path_factory):
    os.environ["LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S"] = str(JOIN_TIMEOUT_S)   # the workers read it at start
    try:
        engine = LLM(ckpt[0], max_model_len=128, block_size=4, enable_sleep_mode=True,
                     profiler_dir=str(tmp_path_factory.mktemp("traces")))
    finally:
        del os.environ["LOOM_WEIGHT_UPDATE_JOIN_TIMEOUT_S"]
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def ref(ckpt):
    """Greedy outputs of A and of B, per prompt (HF)."""
    return {d: [hf_greedy(d, p, LONG) for p in PROMPTS] for d in ckpt}


def _gen(llm) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _restore(llm, a: str) -> None:
    llm.pause("wait")   # returns once nothing runs: updates are allowed then too
    llm.update_weights_from_disk(a)
    llm.resume()


def _pause_keep_mid_flight(llm) -> None:
    """Enqueue the prompts and freeze them once they are decoding."""
    llm.enqueue([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    while llm.debug_info()["output_tokens"] < 4 * len(PROMPTS):   # a few tokens on the old weights
        time.sleep(0.002)
    llm.pause("keep")
    assert llm.debug_info()["output_tokens"] < (LONG - 4) * len(PROMPTS)   # and more to come


def test_update_from_disk_under_pause_keep(llm, ckpt, ref):
    """Tokens after the update equal a fresh engine's on B, continuing from the tokens made before it."""
    a, b = ckpt
    assert all(x[0] != y[0] for x, y in zip(ref[a], ref[b]))   # B differs from the first token on
    assert _gen(llm) == ref[a]
    _pause_keep_mid_flight(llm)
    assert llm.update_weights_from_disk(b) > 0
    llm.resume()
    outs = [o.outputs[0].token_ids for o in llm.wait_for_completion()]
    split_points = []
    for prompt, out, old in zip(PROMPTS, outs, ref[a]):
        assert len(out) == LONG
        # the tokens before the pause are A's; B continues from prompt + those (some k must fit)
        k = next((k for k in range(LONG, -1, -1) if out[:k] == old[:k]
                  and out[k:] == hf_greedy(b, prompt + out[:k], LONG - k)), None)
        assert k is not None, (out, old)
        split_points.append(k)
    assert any(0 < k < LONG for k in split_points), split_points   # it was updated mid-request
    assert _gen(llm) == ref[b]
    # the same checkpoint again, mid-flight: the output equals an uninterrupted run
    _pause_keep_mid_flight(llm)
    llm.update_weights_from_disk(b)
    llm.resume()
    assert [o.outputs[0].token_ids for o in llm.wait_for_completion()] == ref[b]
    _restore(llm, a)
    assert _gen(llm) == ref[a]


def test_update_from_tensor(llm, ckpt, ref):
    a, b = ckpt
    new = load_file(os.path.join(b, "model.safetensors"))
    llm.pause("abort")
    assert llm.update_weights_from_tensor(new) == len(new)
    llm.resume()
    assert _gen(llm) == ref[b]
    # a fused part reads back as sent; the first N rows (SGLang's truncate_size)
    got = torch.tensor(llm.get_weights_by_name(K_PROJ, 3))
    assert torch.equal(got, new[K_PROJ][:3])
    # some tensors only, in bfloat16 (cast to the model's dtype), through a list of pairs
    old = load_file(os.path.join(a, "model.safetensors"))
    llm.pause("keep")
    llm.update_weights_from_tensor([(K_PROJ, old[K_PROJ].bfloat16())])
    llm.resume()
    assert torch.equal(torch.tensor(llm.get_weights_by_name(K_PROJ, 2)), old[K_PROJ][:2].bfloat16().float())
    _restore(llm, a)
    assert _gen(llm) == ref[a]
    assert not [n for n in shm_entries() if n.startswith("loom-tensors-")]   # the segments are unlinked


def test_update_while_asleep_with_weights_awake(llm, ckpt, ref):
    a, b = ckpt
    llm.sleep(1)
    with pytest.raises(RuntimeError, match="weights are asleep"):
        llm.update_weights_from_disk(b)
    with pytest.raises(RuntimeError, match="weights are asleep"):   # (their parameters are empty)
        llm.get_weights_by_name("model.norm.weight", 3)
    llm.wake_up(["weights"])
    llm.update_weights_from_disk(b)
    llm.wake_up()
    assert _gen(llm) == ref[b]
    llm.sleep(2)        # level 2 discards the weights: waking reloads the checkpoint last loaded (B)
    llm.wake_up()
    assert _gen(llm) == ref[b]
    llm.sleep(0)        # scheduling asleep: no request steps, so updates are allowed
    llm.update_weights_from_disk(a)
    llm.wake_up()
    assert _gen(llm) == ref[a]


def test_weights_discarded_by_sleep_2_load_from_disk_as_they_wake(llm, ckpt, ref, tmp_path):
    """update_weights_from_disk while level 2 has discarded the weights loads them as they wake:
    also the way out when the checkpoint they would reload from no longer loads (here cut short
    on disk after it was loaded), where every wake-up fails and requests would wait for ever."""
    a, b = ckpt
    broken = tmp_path / "broken"
    shutil.copytree(b, broken)
    llm.sleep(0)
    llm.update_weights_from_disk(str(broken))
    llm.wake_up()
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(100)
    llm.sleep(2)
    with pytest.raises(RuntimeError):
        llm.wake_up()
    # a path that is no model directory is refused as it is while awake (it went on to the Hub,
    # 23 s of retries with the engine blocked; "" reloaded the old checkpoint and said success)
    for bad in ("/nonexistent", "", "not-a-dir-nor-a-repo"):
        t0 = time.monotonic()
        with pytest.raises(Exception, match="not a model directory"):
            llm.update_weights_from_disk(bad)
        assert time.monotonic() - t0 < 5
    assert llm.is_sleeping()
    assert llm.update_weights_from_disk(a) > 0
    llm.wake_up()                                   # the KV cache
    assert not llm.is_sleeping() and _gen(llm) == ref[a]
    llm.sleep(2)                                    # and it reloads from A from now on
    llm.wake_up()
    assert _gen(llm) == ref[a]


def test_bad_updates_change_nothing(llm, ckpt, ref, tmp_path):
    a, b = ckpt
    new = load_file(os.path.join(b, "model.safetensors"))
    before = llm.get_weights_by_name(K_PROJ, 4)
    with pytest.raises(RuntimeError, match="pause it first"):       # running, not paused
        llm.update_weights_from_tensor(new)
    llm.pause("keep")
    bad_cases = [
        ({**new, "model.layers.0.mlp.nope.weight": new[K_PROJ]}, "'model.layers.0.mlp.nope.weight' is not a weight"),
        ({**new, K_PROJ: new[K_PROJ][:-1]}, rf"'{K_PROJ}' has shape \[31, 64\], expected \[32, 64\]"),
        ({**new, K_PROJ: new[K_PROJ].to(torch.int32)}, f"'{K_PROJ}' has dtype torch.int32"),
    ]
    for tensors, msg in bad_cases:   # the good tensors come first: none of them may be copied
        with pytest.raises(RuntimeError, match=msg):
            llm.update_weights_from_tensor(tensors)
    with pytest.raises(RuntimeError, match="no config.json"):
        llm.update_weights_from_disk(str(tmp_path))
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(RuntimeError, match="LlamaForCausalLM"):
        llm.update_weights_from_disk(str(other))
    with pytest.raises(RuntimeError, match="shared-memory segment 'loom-missing' does not exist"):
        llm.client.call_utility("update_weights_from_tensor", [
            {"name": K_PROJ, "dtype": "float32", "shape": [32, 64], "shm": {"segment": "loom-missing"}}])
    with pytest.raises(RuntimeError, match="bad shared-memory segment name"):
        llm.client.call_utility("update_weights_from_tensor", [
            {"name": K_PROJ, "dtype": "float32", "shape": [32, 64], "shm": {"segment": "../etc/passwd"}}])
    with pytest.raises(RuntimeError, match="not callable on workers through collective_rpc"):
        llm.collective_rpc("update_weights_from_disk", [b])   # only the engine may (it resets the cache)
    t0 = time.monotonic()   # no trainer at this port: the engine's loop waited 10 minutes
    # a ValueError in the worker: the caller's fault, a 400 over HTTP (SGLang's status; it was a 500)
    with pytest.raises(RuntimeError, match=f"ValueError: the trainer's group .* did not form within {JOIN_TIMEOUT_S} s"):
        llm.init_weights_update_group("127.0.0.1", free_tcp_port(), 1, 2, "nobody", "gloo")
    assert time.monotonic() - t0 < JOIN_TIMEOUT_S + 15
    llm.resume()
    assert llm.get_weights_by_name(K_PROJ, 4) == before
    assert _gen(llm) == ref[a]


def test_profiler_writes_a_trace_per_rank(llm):
    trace_dir = llm.config.profiler_dir
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()
    short = ([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=2))
    llm.start_profile("rltest")
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    llm.generate(*short, use_tqdm=False)
    llm.stop_profile()
    llm.start_profile()   # a restart keeps the name
    llm.generate(*short, use_tqdm=False)
    llm.stop_profile()
    traces = sorted(glob.glob(os.path.join(trace_dir, "*.pt.trace.json")))
    assert len(traces) == 2, traces
    for path in traces:
        assert os.path.basename(path).startswith("rltest_dp0_tp0_rank0."), path
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        ops = {e["name"] for e in events if e.get("cat") == "cpu_op"}
        assert "aten::linear" in ops or "aten::mm" in ops, sorted(ops)[:20]


def test_a_trainers_state_dict_with_tied_embeddings(model_factory):
    """A trainer sends model.state_dict(): with tied embeddings it names the weight twice
    (lm_head.weight too); both are accepted. In-process, on one WeightUpdater (no engine)."""
    from types import SimpleNamespace

    from ipc.config import EngineConfig
    from ipc.tensor_handles import SharedTensors
    from tests.hf_oracle import hf_model
    from workers.model_loader import load_model
    from workers.weight_update import WeightUpdater
    a, b = model_factory("qwen3", tie_word_embeddings=True), model_factory("qwen3", tie_word_embeddings=True, seed=1)
    runner = SimpleNamespace(model=load_model(a, torch.float32, "cpu"), device=torch.device("cpu"), weights_dir=a,
                             config=EngineConfig(model=a))
    updater = WeightUpdater(runner, rank=0)
    sd = hf_model(b).state_dict()
    assert "lm_head.weight" in sd
    with SharedTensors(sd.items()) as shared:
        updater.update_from_tensors(shared.to_builtins())
    ours = runner.model.state_dict()
    assert torch.equal(ours["lm_head.weight"], sd["model.embed_tokens.weight"])
    assert torch.equal(ours["model.layers.1.mlp.gate_up_proj.weight"],
                       torch.cat([sd["model.layers.1.mlp.gate_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"]]))
    assert updater.get_weights_by_name("model.layers.1.self_attn.v_proj.weight", 2)["values"] == \
        sd["model.layers.1.self_attn.v_proj.weight"][:2].tolist()


def test_profiler_dir_from_the_environment(model_factory, monkeypatch):
    from ipc.config import EngineConfig
    monkeypatch.setenv("LOOM_TORCH_PROFILER_DIR", "/tmp/loom-env-traces")
    assert EngineConfig(model=model_factory("qwen3")).resolve().profiler_dir == "/tmp/loom-env-traces"
    assert EngineConfig(model=model_factory("qwen3"), profiler_dir="/x").resolve().profiler_dir == "/x"


def test_trainer_group_at_tensor_parallel_2(model_factory):
    """Trainer (rank 0) + two tensor-parallel workers (ranks 1, 2, gloo): each rank keeps its shard
    of every broadcast (one KV head, replicated on both ranks; a vocabulary padded to split). Then
    tensors through shared memory at TP=2 give the same result."""
    import json
    import subprocess
    import sys

    from ipc.sockets import free_tcp_port
    from tests.conftest import ROOT
    a = model_factory("llama", num_key_value_heads=1, vocab_size=337)
    b = model_factory("llama", num_key_value_heads=1, vocab_size=337, seed=1)
    prompts = [[11, 12, 13, 14], [50, 60, 70, 80, 90]]
    ref = {d: [hf_greedy(d, p, 12) for p in prompts] for d in (a, b)}
    assert ref[a] != ref[b]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def gen(llm):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                               use_tqdm=False)]
    llm = LLM(a, tensor_parallel_size=2, max_model_len=64, block_size=4, multiprocess=True)   # two ranks: processes
    port = free_tcp_port()
    trainer = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "_rl_trainer.py"), str(port), "3",
                                "tp_group", b], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert gen(llm) == ref[a]
        llm.init_weights_update_group("127.0.0.1", port, 1, 3, "tp_group", "gloo")
        assert trainer.stdout.readline().strip() == "ready"
        new = load_file(os.path.join(b, "model.safetensors"))
        names = sorted(new)
        meta = {"names": names, "dtypes": ["float32"] * len(names), "shapes": [list(new[n].shape) for n in names]}
        llm.pause("keep")
        trainer.stdin.write(json.dumps(meta) + "\n")
        trainer.stdin.flush()
        assert llm.update_weights_from_distributed(names, meta["dtypes"], meta["shapes"], "tp_group") == len(names)
        assert trainer.stdout.readline().strip() == "sent"
        llm.resume()
        assert gen(llm) == ref[b]
        # read back whole weights from the ranks' shards: rows split (q, the vocabulary), columns
        # split (o_proj, down_proj), a KV head on both ranks, replicated norms
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                     "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
                     "model.layers.1.mlp.up_proj.weight", "model.embed_tokens.weight", "lm_head.weight",
                     "model.norm.weight"):
            for n in (3, 1000):
                assert torch.equal(torch.tensor(llm.get_weights_by_name(name, n)), new[name][:n]), (name, n)
        llm.destroy_weights_update_group("tp_group")
        trainer.stdin.close()
        assert trainer.wait(60) == 0
        llm.pause("keep")
        llm.update_weights_from_tensor(load_file(os.path.join(a, "model.safetensors")))
        llm.resume()
        assert gen(llm) == ref[a]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        llm.shutdown()


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("qwen3", True), ("phi3", False), ("cohere", True),
                                       ("qwen3_moe", False), ("mixtral", False), ("qwen2_moe", False)])
def test_dummy_weights_expect_the_checkpoint_shapes(model_factory, arch, tied):
    """With --load-format dummy there is no checkpoint to list: the expected names and shapes come
    from the model's parameters, fused ones split into their parts (Phi-3's checkpoint fuses them
    too), and equal the checkpoint's."""
    from workers.model_loader import load_model
    from workers.weight_update import expected_shapes
    d = model_factory(arch, tie_word_embeddings=True) if tied else model_factory(arch)
    model = load_model(d, torch.float32, "cpu", "dummy")
    assert expected_shapes(model, d, "dummy") == expected_shapes(model, d, "auto")


def test_vision_language_model_takes_a_checkpoints_tensors(tmp_path):
    """Qwen2.5-VL renames checkpoint weights (model.language_model.*, model.visual.*) and fuses the
    vision MLP: a partial update by checkpoint names lands where a fresh load puts them."""
    from types import SimpleNamespace

    from ipc.config import EngineConfig
    from ipc.tensor_handles import SharedTensors
    from tests.tiny_vl_models import make_tiny_qwen2_5_vl
    from workers.model_loader import load_model
    from workers.weight_update import WeightUpdater
    a = make_tiny_qwen2_5_vl(str(tmp_path / "a"))
    b = make_tiny_qwen2_5_vl(str(tmp_path / "b"), seed=1)
    runner = SimpleNamespace(model=load_model(a, torch.float32, "cpu"), device=torch.device("cpu"), weights_dir=a,
                             config=EngineConfig(model=a))
    new = load_file(os.path.join(b, "model.safetensors"))
    fresh = load_model(b, torch.float32, "cpu").state_dict()
    before = {k: v.clone() for k, v in runner.model.state_dict().items()}
    assert sum(not torch.equal(before[k], fresh[k]) for k in fresh) > 20   # every matrix differs
    with SharedTensors(new.items()) as shared:
        WeightUpdater(runner, rank=0).update_from_tensors(shared.to_builtins())
    ours = runner.model.state_dict()
    assert ours.keys() == fresh.keys()
    assert all(torch.equal(ours[k], fresh[k]) for k in ours)
