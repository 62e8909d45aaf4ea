"""Speculative decoding in the workers (vLLM's v1/spec_decode): the proposers that draft tokens
after each step (n-gram prompt lookup, a draft model, EAGLE-1/EAGLE-3 heads, the measurement-only oracle), and the
layout of a verify step's logits rows. The verification itself is workers/rejection_sampler.py;
the scheduler (engine_core/scheduler.py) budgets the drafts and rolls back rejected ones."""
from __future__ import annotations


def make_proposer(config, runner):
    """The proposer --speculative-config names (None: speculation off)."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from workers.spec_decode.ngram_proposer import NgramProposer
        return NgramProposer(spec)
    if spec.method == "oracle":
        from workers.spec_decode.oracle_proposer import OracleProposer
        return OracleProposer(spec, runner.model.config.vocab_size, config.seed)
    if spec.method == "draft_model":
        from workers.spec_decode.draft_model_proposer import DraftModelProposer
        return DraftModelProposer(spec, runner)
    if spec.method in ("eagle", "eagle3"):
        from workers.spec_decode.eagle import EagleProposer
        return EagleProposer(spec, runner)
    raise ValueError(f"speculative method {spec.method!r} has no proposer")


def may_speculate(params, bad_words) -> bool:
    """Whether a request's drafts can be verified exactly: penalties and bad words depend on the
    outputs before each position, which the verify step's rows do not see (no drafts for those)."""
    return not params.needs_penalties and bad_words is None
