"""The offline API: `LLM(model=DIR).generate(prompts, SamplingParams(...))`.

It drives the same engine-core and worker processes as `loom serve`, and
tokenizes and detokenizes in the calling process. With multiprocess=False (or
LOOM_ENABLE_MULTIPROCESSING=0) the engine core and its one worker run in the calling
process instead (frontend/inproc_client.py): one thread, to step through in a debugger.
"""
from __future__ import annotations

import os
import time
import weakref
from typing import Sequence

from frontend.engine_client import EngineCoreClient
from frontend.inproc_client import InprocClient
from ipc import envs
from ipc.config import EngineConfig
from frontend.entrypoints.model_download import resolve_hub_model
from ipc.control import merge_results
from engine_core.core import run_engine_core
from ipc.data_parallel import DPRank
from frontend.dp_router import DPRouter
from frontend.detokenizer import TokenTexts
from frontend.output_processor import RequestState
from frontend.outputs import CompletionOutput, RequestOutput
from frontend.entrypoints.llm_pooling import PoolingMixin
from frontend.chat_utils import audio_items, detect_content_format, load_images, parse_chat_messages, render_chat
from frontend.processing import (engine_requests, load_tokenizer, new_request_id, tokenize_bad_words, tokenize_prompt,
                                 typed_params)
from ipc.procs import start_process, stop_processes
from ipc.lora import LoRARequest
from ipc.sampling_params import SamplingParams
from ipc.sockets import ipc_address, make_ipc_dir, remove_ipc_dir
from multimodal.media import MediaError
from multimodal.processor import make_mm_processor, mm_reject
from workers.models.registry import check_architecture, multimodal_info
from ipc.validation import Limits, RequestError, check_sampling_params, validate_request


def _prompt_list(prompts) -> list:
    """One prompt (a string, a dict, a list of token ids) or a list of them -> a list of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], int)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise RequestError("prompts must be a prompt or a list of prompts (strings, token-id lists or "
                           f"dicts), got {type(prompts).__name__}", "prompt")
    return list(prompts)


def longest_first(max_tokens: Sequence[int]) -> list[int]:
    """The order in which one call's requests go to the engine: longest max_tokens first
    (stable). A batch ends when its last request does, so the longest should start first: in
    arrival order, one admitted in the last prefill step still needs its whole output after it
    (longest-processing-time-first, the makespan rule). Over several engines (data parallel) the
    router's turns then deal the long ones out evenly."""
    return sorted(range(len(max_tokens)), key=lambda k: -max_tokens[k])


class LLM(PoolingMixin):
    def __init__(self, model: str, multiprocess: bool | None = None, **options):
        """Options are those of `loom serve`, with underscores (max_model_len=..., block_size=...).
        multiprocess=False: the engine core and one worker in this process, stepped in the
        caller's thread (default: LOOM_ENABLE_MULTIPROCESSING, else True)."""
        # a Hub id becomes its snapshot's directory here, once: the processes started get that
        self.config = resolve_hub_model(EngineConfig(model=model, **options)).resolve(multimodal_info,
                                                                                      check_architecture)
        self.multiprocess = envs.LOOM_ENABLE_MULTIPROCESSING if multiprocess is None else multiprocess
        if not self.multiprocess and (self.config.tensor_parallel_size > 1 or self.config.data_parallel_size > 1):
            raise ValueError("multiprocess=False (LOOM_ENABLE_MULTIPROCESSING=0) runs one engine with one worker: "
                             "it takes neither tensor_parallel_size > 1 nor data_parallel_size > 1")
        self.mm = make_mm_processor(self.config, 0, multimodal_info)  # its store, before any child starts
        n = self.config.data_parallel_size
        if self.multiprocess:
            self.ipc_dir = make_ipc_dir()
            in_addr = ipc_address(self.ipc_dir, "client0-input")
            out_addr = ipc_address(self.ipc_dir, "client0-output")
            self.client = EngineCoreClient(in_addr, out_addr, client_index=0, num_engines=n)
            self.engine_procs = [start_process(run_engine_core,
                                               f"loom-engine-core-{rank}" if n > 1 else "loom-engine-core",
                                               (self.config.to_dict(), _engine_dir(self.ipc_dir, rank, n),
                                                [(in_addr, out_addr)], None, None,
                                                DPRank(rank, rank) if n > 1 else None))
                                 for rank in range(n)]
            self.client.engine_procs = self.engine_procs
        else:
            self.ipc_dir, self.engine_procs = None, []
            try:
                self.client = InprocClient(self.config)
            except BaseException:
                if self.mm is not None:
                    self.mm.store.close()
                raise
        self._finalizer = weakref.finalize(self, _shutdown, self.engine_procs, self.client, self.ipc_dir,
                                           self.mm.store if self.mm else None)
        try:
            # the tokenizer loads while the engine starts (transformers' import alone is seconds)
            self.tokenizer = load_tokenizer(self.config)
            self.token_texts = TokenTexts(self.tokenizer)
            ready = self.client.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.num_gpu_blocks = ready.num_gpu_blocks
        self.router = DPRouter(n, self.config.block_size, max_num_seqs=self.config.max_num_seqs)
        self._engine_of: dict[str, int] = {}   # engine request id -> its data-parallel rank
        self.stats = EngineStatsTotals()
        self._results: list[RequestOutput] = []                         # enqueued, in order
        self._states: dict[str, tuple[RequestOutput, RequestState]] = {}  # by engine request id
        self._loras: dict[int, LoRARequest] = {}   # adapters added (LoRARequest by lora_int_id)

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config defaults (--generation-config,
        --override-generation-config); what generate() uses when given none."""
        return SamplingParams(**self.config.default_sampling_params)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts: strings, token-id lists or
        {"prompt_token_ids": [...]} dicts; with images {"prompt": ..., "multi_modal_data":
        {"image": img_or_list}, "mm_processor_kwargs": {...}} (the prompt holds the model's image
        placeholder once per image). Prompts with images go to the engine in chunks, so that the
        shared-memory store only ever holds the images of requests in flight. `priority`: one
        per prompt, with scheduling_policy="priority" (lower runs first), as vLLM's. `lora_request`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model), with
        enable_lora=True; an adapter first seen is read and checked before any prompt is sent."""
        prompts = _prompt_list(prompts)
        has_images = any(isinstance(p, dict) and p.get("multi_modal_data") for p in prompts)
        if lora_request is not None:
            if has_images:
                raise ValueError("lora_request with images is not supported")
            self.enqueue(prompts, sampling_params, priority, lora_request)
            return self.wait_for_completion(use_tqdm=use_tqdm)
        if not has_images or self.mm is None:
            self.enqueue(prompts, sampling_params, priority)
            return self.wait_for_completion(use_tqdm=use_tqdm)
        chunk = 4 * self.config.max_num_seqs
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else None
        out = []
        for i in range(0, len(prompts), chunk):
            self.enqueue(prompts[i:i + chunk], params[i:i + chunk] if params else sampling_params,
                         priority[i:i + chunk] if priority else None)
            out += self.wait_for_completion(use_tqdm=use_tqdm)
        return out

    def enqueue(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                priority: Sequence[int] | None = None,
                lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[str]:
        """Send requests to the engine without waiting (they queue while it sleeps or is paused)."""
        prompts = _prompt_list(prompts)
        loras = self._lora_requests(lora_request, len(prompts))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one SamplingParams or one per prompt")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError("priority must hold one value per prompt")
        checked, limits = [], Limits.of(self.config)
        try:
            for prompt, params, prio in zip(prompts, params_list, priorities):  # check all before sending any
                typed_params(params)
                text, ids = tokenize_prompt(self.tokenizer, prompt)
                if params.bad_words:
                    check_sampling_params(params, limits)   # bounds the words before they are tokenized
                    params = tokenize_bad_words(self.tokenizer, params)
                ids, items = self._multimodal(prompt, ids, params.n)
                checked.append((text, ids, params, items, prio))
                validate_request(ids, params, limits, priority=prio)
                if params.structured_outputs is not None:
                    _check_constraint(params.structured_outputs)
        except BaseException:
            if self.mm is not None:  # release the images of the prompts already checked
                for *_, items, _ in checked:
                    self.mm.unref(items)
            raise
        now, sends = time.time(), []
        for (text, ids, params, items, prio), lora in zip(checked, loras):
            result = RequestOutput(new_request_id(), text, ids, [CompletionOutput(j, "", []) for j in range(params.n)])
            sends.append((result, ids, params, items, prio, lora))
        budgets = [p.max_tokens if p.max_tokens is not None else self.config.max_model_len - len(ids)
                   for _, ids, p, *_ in sends]
        sent: list[tuple[RequestOutput, str]] = []   # (a prompt's output, one engine request sent for it)
        try:
            for result, ids, params, items, prio, lora in (sends[k] for k in longest_first(budgets)):
                ecrs = engine_requests(result.request_id, ids, params, self.config.eos_token_ids, now, prio,
                                       lora_request=lora)
                engine = self.router.pick(ids, len(ecrs))
                for j, ecr in enumerate(ecrs):
                    ecr.mm_items = items
                    self.client.add_request(ecr, engine)
                    self._engine_of[ecr.request_id] = engine
                    self._states[ecr.request_id] = (result, RequestState(ecr.request_id, j, ids, params,
                                                                         self.tokenizer, self.token_texts,
                                                                         final_only=True))
                    sent.append((result, ecr.request_id))
        except BaseException:   # (Ctrl-C while sending): none of this call's requests stays behind
            self._withdraw(sends, sent)
            raise
        self._results.extend(result for result, *_ in sends)
        return [result.request_id for result, *_ in sends]

    def _lora_requests(self, lora_request, n: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt; adapters not seen before are added (read and checked
        on every worker) first, so that a bad one fails the call before any prompt is sent."""
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
        if len(loras) != n:
            raise ValueError("lora_request must be one LoRARequest or one per prompt")
        for lora in loras:
            if lora is not None and self._loras.get(lora.lora_int_id) != lora:
                self.add_lora(lora.lora_name, lora.lora_int_id, lora.lora_path, False)
                self._loras[lora.lora_int_id] = lora
        return loras

    def _withdraw(self, sends: list, sent: list[tuple[RequestOutput, str]]) -> None:
        """A call's requests whose sending was cut short: those sent are aborted, the others' image
        references given back. The next call waited for them (a partly sent batch)."""
        self._abort([rid for _, rid in sent])
        for _, rid in sent:
            del self._states[rid]
        if self.mm is not None:
            for result, _, params, items, *_ in sends:
                for _ in range(params.n - sum(r is result for r, _ in sent) if items else 0):
                    self.mm.unref(items)

    def _multimodal(self, prompt, ids: list[int], n: int) -> tuple[list[int], list]:
        """Images of a prompt dict into the store, placeholders expanded; one store reference
        per engine request (n choices are n requests)."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return ids, []
        unknown = set(data) - {"image", "audio"}
        if unknown:
            raise ValueError(f"unsupported modalities {sorted(unknown)} (only 'image' and 'audio')")
        modality = self.mm.modality if self.mm is not None else "image"
        for other in set(data) - {modality}:
            if data[other]:   # refused as the API server refuses it
                try:
                    mm_reject(self.config, 1, other)
                except MediaError as e:
                    raise ValueError(str(e)) from None
        images = data.get(modality) or []
        # a list of items, or one; one clip is an (array, sample_rate) tuple, as vLLM takes it
        if not isinstance(images, list) and not (isinstance(images, tuple) and modality == "image"):
            images = [images]
        if self.mm is None:
            raise ValueError("this model does not take images")
        try:
            ids, items = self.mm.process(ids, list(images), prompt.get("mm_processor_kwargs"))
        except MediaError as e:
            raise ValueError(str(e)) from None
        self.mm.addref(items, n - 1)
        return ids, items

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}), or a list of them: one output each.
        Content may be OpenAI content parts, with images as image_url parts or {"type":
        "image_pil", "image_pil": PIL.Image}. The keywords are vLLM's `LLM.chat`'s."""
        conversations = messages if isinstance(messages, list) and messages and isinstance(messages[0], list) \
            else [messages]
        # as the API server does (frontend/chat_utils.py), with its default --chat-template-content-format auto
        content_format = detect_content_format(chat_template or getattr(self.tokenizer, "chat_template", None))
        prompts = []
        for conversation in conversations:
            parsed = parse_chat_messages(conversation, content_format)
            text, ids = render_chat(self.tokenizer, parsed, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, tools=tools,
                                    chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)
            prompt = {"prompt_token_ids": ids, "prompt": text}
            images = load_images(parsed, self.config.allowed_local_media_path)
            if images:
                prompt.update(multi_modal_data={"image": images}, mm_processor_kwargs=mm_processor_kwargs or {})
            clips = audio_items(parsed, self.config.allowed_local_media_path)   # (bytes: decoded by the processor)
            if clips:
                prompt.setdefault("multi_modal_data", {})["audio"] = clips
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def wait_for_completion(self, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every enqueued request to the end; their outputs, in the order enqueued."""
        results, self._results = self._results, []
        try:
            self._run(results, use_tqdm)
        except BaseException:
            self._abort(list(self._states))
            self._states.clear()
            raise
        return results

    def _run(self, results: list[RequestOutput], use_tqdm: bool) -> None:
        bar = _progress(len(results), use_tqdm)
        while self._states:
            outs = self.client.get_outputs()
            if self.mm is not None:
                self.mm.store.maybe_unlink()
            if outs.load is not None:
                self.router.on_load(outs.engine_index, outs.load)
            if outs.scheduler_stats is not None:
                self.stats.add(outs.scheduler_stats, outs.timestamp, outs.engine_index)
            states = self._states
            for out in outs.outputs:
                entry = states.get(out.request_id)
                if entry is None:
                    continue
                result, st = entry
                delta, abort = st.process(out)   # None until the end for most (RequestState final_only)
                if bar is not None:
                    bar.add_tokens(len(out.new_token_ids))
                if abort:
                    self.client.abort([out.request_id], outs.engine_index)
                if delta is None:
                    continue
                choice = result.outputs[st.index]
                choice.text += delta.text
                choice.token_ids.extend(delta.token_ids)
                if delta.logprobs is not None:  # extended in place: a copy per delta is quadratic
                    if choice.logprobs is None:
                        choice.logprobs = []
                    choice.logprobs.extend(delta.logprobs)
                    choice.cumulative_logprob = delta.cumulative_logprob
                if delta.finish_reason is None:
                    continue
                choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
                choice.pooled = delta.pooled   # --runner pooling (LLM.embed, classify, score)
                result.num_cached_tokens = st.num_cached_tokens
                result.prompt_logprobs = st.prompt_logprobs
                del self._states[out.request_id]
                self._engine_of.pop(out.request_id, None)
                if all(c.finish_reason is not None for c in result.outputs):
                    result.finished = True
                    if bar is not None:
                        bar.update(1, len(result.prompt_token_ids) * len(result.outputs))
        if bar is not None:
            bar.close()

    def _abort(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            by_engine.setdefault(self._engine_of.pop(rid, 0), []).append(rid)
        for engine, ids in by_engine.items():
            self.client.abort(ids, engine)

    # ------------------------------------------------------------ control (ipc/control.py declares each)

    def _control(self, name: str, *args):
        """Control operation `name` on every engine core (data-parallel ranks), their answers
        merged as one as its row in ipc/control.py says."""
        return merge_results(name, self.client.call_utility_all(name, *args))

    def sleep(self, level: int = 1) -> None:
        self._control("sleep", level)

    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str, load_inplace: bool = False) -> bool:
        """Read and check a LoRA adapter on every worker (in place: new weights for a known id)."""
        try:
            return self._control("add_lora", lora_name, lora_int_id, lora_path, load_inplace)
        except RuntimeError as e:   # the workers' LoRAAdapterError: the caller's adapter
            raise ValueError(str(e)) from None

    def remove_lora(self, lora_int_id: int) -> bool:
        self._loras.pop(lora_int_id, None)
        return self._control("remove_lora", lora_int_id)

    def list_loras(self) -> list[int]:
        return self._control("list_loras")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._control("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self._control("is_sleeping")

    def pause(self, mode: str = "abort", clear_cache: bool = False) -> None:
        """abort: in-flight requests end with "abort"; wait: returns once they finish; keep: freeze them."""
        self._control("pause", mode, clear_cache)

    def resume(self) -> None:
        self._control("resume")

    def is_paused(self) -> bool:
        return self._control("is_paused")

    def collective_rpc(self, method: str, args: list | None = None, kwargs: dict | None = None,
                       timeout: float | None = None):
        return self._control("collective_rpc", method, args or [], kwargs or {}, timeout)

    def reset_prefix_cache(self) -> bool:
        return self._control("reset_prefix_cache")

    # ------------------------------------------------------------ weight updates (SGLang's names)
    # Allowed while paused (keep, or abort / wait once drained) or asleep with the weights awake.
    # A bad name, shape or dtype raises and changes nothing. With flush_cache (the default), running
    # requests recompute and the prefix cache is reset: later tokens equal a fresh engine's.

    def update_weights_from_disk(self, model_path: str, load_format: str = "auto", flush_cache: bool = True) -> int:
        """Reload every weight from a checkpoint directory of the same architecture and shapes."""
        return self._control("update_weights_from_disk", model_path, load_format, flush_cache)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> None:
        """Join a trainer's process group (its rank 0 hosts the TCP store); worker w is rank_offset + w."""
        self._control("init_weights_update_group", master_address, master_port, rank_offset, world_size,
                      group_name, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True) -> int:
        """Receive one broadcast per name from the trainer's rank 0, in order."""
        return self._control("update_weights_from_distributed", names, [str(d).removeprefix("torch.") for d in dtypes],
                             [list(s) for s in shapes], group_name, flush_cache)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._control("destroy_weights_update_group", group_name)

    def update_weights_from_tensor(self, named_tensors, flush_cache: bool = True) -> int:
        """New weights from this process's tensors (a dict or (name, tensor) pairs), handed over
        through shared memory (CPU) or CUDA IPC handles (GPU): ipc/tensor_handles.py."""
        from ipc.tensor_handles import SharedTensors
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        with SharedTensors(items) as shared:
            return self._control("update_weights_from_tensor", shared.to_builtins(), flush_cache)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first truncate_size rows of a weight (checkpoint name), as float lists."""
        return self._control("get_weights_by_name", name, truncate_size)

    # ------------------------------------------------------------ torch profiler (--profiler-dir)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        self._control("start_profile", profile_prefix)

    def stop_profile(self) -> None:
        """Stop the profiler; each worker writes {prefix}_dp{D}_tp{T}_rank{R}.*.pt.trace.json."""
        self._control("stop_profile")

    def debug_info(self) -> dict:
        """Engine internals for tests: live requests, free blocks."""
        return self._control("debug_info")

    def shutdown(self) -> None:
        self._finalizer()
        self.client = _ShutDown()   # later calls: one clear error (a ZMQError, or "the engine exited")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


class EngineStatsTotals:
    """Running totals of the per-step stats the engines send; with step_log set to a list, also
    each step's (engine timestamp, SchedulerStats), for benchmarks that time steps. Per
    data-parallel engine: its steps, output tokens and when its last step with output tokens
    arrived (perf_counter), which tell a benchmark whether the engines or this process set the pace."""

    def __init__(self):
        self.prefix_cache_queries = self.prefix_cache_hits = self.num_preemptions = 0
        self.steps = 0
        self.step_log: list | None = None
        self.engine_steps: dict[int, int] = {}
        self.engine_tokens: dict[int, int] = {}
        self.engine_last_output_at: dict[int, float] = {}
        # speculative decoding (the vllm:spec_decode_* metrics' totals)
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = []

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: 1 + accepted drafts per draft (vLLM's; 0 without drafts)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    def add(self, s, timestamp: float = 0.0, engine: int = 0) -> None:
        self.steps += 1
        if self.step_log is not None:
            self.step_log.append((timestamp, s))
        self.prefix_cache_queries += s.prefix_cache_queries
        self.prefix_cache_hits += s.prefix_cache_hits
        self.num_preemptions += s.num_preemptions
        if s.spec_num_drafts:
            self.spec_num_drafts += s.spec_num_drafts
            self.spec_num_draft_tokens += s.spec_num_draft_tokens
            self.spec_num_accepted_tokens += s.spec_num_accepted_tokens
            per_pos = self.spec_accepted_per_pos
            per_pos += [0] * (len(s.spec_accepted_per_pos) - len(per_pos))
            for i, n in enumerate(s.spec_accepted_per_pos):
                per_pos[i] += n
        self.engine_steps[engine] = self.engine_steps.get(engine, 0) + 1
        if s.num_generation_tokens:
            self.engine_tokens[engine] = self.engine_tokens.get(engine, 0) + s.num_generation_tokens
            self.engine_last_output_at[engine] = time.perf_counter()


def _engine_dir(ipc_dir: str, rank: int, n: int) -> str:
    """Each data-parallel rank's workers get their own socket directory."""
    if n == 1:
        return ipc_dir
    path = os.path.join(ipc_dir, f"dp{rank}")
    os.mkdir(path, 0o700)
    return path


def _shutdown(procs, client: EngineCoreClient | InprocClient, ipc_dir: str | None, store) -> None:
    stop_processes(procs, timeout=10)
    client.close()
    if ipc_dir is not None:
        remove_ipc_dir(ipc_dir)
    if store is not None:
        store.close()


class _progress:
    """tqdm bar: requests done, and est. speed of input (prompts of finished requests, once per
    choice, as vLLM counts them) and output tokens; the speeds refresh as tokens arrive."""

    def __new__(cls, total: int, enabled: bool):
        if not enabled:
            return None
        return super().__new__(cls)

    def __init__(self, total: int, enabled: bool):
        from tqdm import tqdm
        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.tokens = self.prompt_tokens = 0
        self.start = self.shown = time.perf_counter()

    def add_tokens(self, n: int) -> None:
        self.tokens += n
        if time.perf_counter() - self.shown > 0.5:
            self._postfix(refresh=True)

    def update(self, n: int, prompt_tokens: int = 0) -> None:
        self.prompt_tokens += prompt_tokens
        self._postfix(refresh=False)
        self.bar.update(n)

    def _postfix(self, refresh: bool) -> None:
        self.shown = now = time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        self.bar.set_postfix_str(f"est. speed input: {self.prompt_tokens / elapsed:.2f} toks/s, "
                                 f"output: {self.tokens / elapsed:.2f} toks/s", refresh=refresh)

    def close(self) -> None:
        self.bar.close()


class _ShutDown:
    """The engine client of an LLM after shutdown()."""

    def __getattr__(self, name):
        raise RuntimeError("this LLM has been shut down")


def _check_constraint(c) -> None:
    """ValueError for a constraint that does not compile, as vLLM's LLM raises (the engine would
    finish the request with an error)."""
    from frontend.openai.constraints import check_constraint
    from frontend.openai.protocol import APIError
    try:
        check_constraint(c, "structured_outputs")
    except APIError as e:
        raise ValueError(e.message) from None
