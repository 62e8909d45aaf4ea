"""A new request whose prompt begins as a running request's travels to the worker as that
request's id and the rest of its prompt (NewRequestData.shared_from, engine_core/recent_prompts.py);
the worker copies the shared tokens from the other request's row. Driven here by the real
Scheduler and ModelRunner (the step messages encoded and decoded as the ring carries them), through
preemptions, aborts and reused request ids: every row the worker holds must equal its request's
whole token list, and every step's input ids the tokens at their positions."""
from __future__ import annotations

import random

from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler
from ipc.config import EngineConfig
from ipc.messages import EngineCoreRequest, ModelRunnerOutput, MsgType, SchedulerOutput
from ipc.sampling_params import SamplingParams
from ipc.serial import Decoder, Encoder


def test_worker_rows_equal_whole_prompts_with_shared_prompts(tiny_model_dir):
    from workers.model_runner import ModelRunner
    from workers.models.registry import multimodal_info
    config = EngineConfig(model=tiny_model_dir, load_format="dummy", device="cpu", max_model_len=96,
                          max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                          enable_prefix_caching=True).resolve(multimodal_info)
    runner = ModelRunner(config)
    sched = Scheduler(config, 20)   # few blocks: preemptions
    enc, dec = Encoder(), Decoder(SchedulerOutput)
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 300) for _ in range(40)] for _ in range(3)]
    shared = penalised = preempted = aborted = 0
    next_id, finished_ids = 0, []
    for step in range(400):
        if len(sched.waiting) < 4 and rng.random() < 0.6:
            if finished_ids and rng.random() < 0.3:   # a finished request's id, reused
                rid = finished_ids.pop(rng.randrange(len(finished_ids)))
            else:
                rid, next_id = f"r{next_id}", next_id + 1
            base = prefixes[rng.randrange(3)]
            prompt = base[:rng.randrange(4, 41)] + [rng.randrange(3, 300) for _ in range(rng.randrange(6))]
            params = SamplingParams(max_tokens=rng.randrange(1, 24), ignore_eos=True,
                                    repetition_penalty=1.2 if rng.random() < 0.2 else 1.0)
            sched.add_request(Request(EngineCoreRequest(rid, prompt, params), config.max_model_len, 0))
        if sched.running and rng.random() < 0.05:
            victim = rng.choice(sched.running).request_id
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            finished_ids.append(victim)
            aborted += 1
        so = sched.schedule()
        preempted += sum(rid in sched.requests for rid in so.finished_req_ids)
        shared += sum(bool(r.shared_from) for r in so.new_requests)
        so = dec.decode([bytes(f) for f in enc.encode(MsgType.WORKER_STEP.value, so)])
        host_step = runner.prepare_host(so)
        for rid, st in runner.batch.requests.items():   # every row the worker holds: its request's tokens
            req = sched.requests[rid]
            want = req.prompt_token_ids + req.output_token_ids
            assert runner.batch.token_ids[st.slot, :st.num_tokens].tolist() == want[:st.num_tokens], (step, rid)
            assert st.num_prompt_tokens == req.num_prompt_tokens
        runner.batch.write_rows()   # (the staging's): a new request's penalty rows hold its whole prompt
        for r in so.new_requests:
            if r.sampling_params.repetition_penalty != 1.0:
                st = runner.batch.requests[r.req_id]
                mask = runner.batch.prompt_mask[st.slot].nonzero().flatten().tolist()
                assert mask == sorted(set(sched.requests[r.req_id].prompt_token_ids))
                penalised += bool(r.shared_from)
        if host_step is None:
            continue
        batch = host_step.batch
        want_ids = [(sched.requests[rid].prompt_token_ids + sched.requests[rid].output_token_ids)[p]
                    for rid, a, n in zip(so.req_ids, batch.computed_before, batch.num_scheduled)
                    for p in range(a, a + n)]
        assert batch.host.input_ids.tolist() == want_ids
        for st, computed in zip(batch.states, batch.computed_after):   # the launch's bookkeeping, no forward
            st.num_computed_tokens = int(computed)
        sampled = [-1] * len(so.req_ids)
        for i in batch.sample_rows.tolist():
            sampled[i] = token = rng.randrange(3, 300)
            runner.batch.append_token(batch.states[i], token)
        before = set(sched.requests)
        sched.update_from_output(ModelRunnerOutput(list(so.req_ids), sampled), so.step_id)
        finished_ids += sorted(before - set(sched.requests))
    assert shared > 20 and penalised > 2 and preempted > 10 and aborted > 10, (shared, penalised, preempted, aborted)
