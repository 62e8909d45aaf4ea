"""Benchmark request sets (token-id prompts, so lengths are exact).

The default offline workload is the one nano-vllm and mini-sglang publish
(docs/performance.md): 256 requests, random.seed(0), prompt i of
randint(100, 1024) ids each randint(0, 10000), then max_tokens = randint(100, 1024)
per request; 142,827 prompt tokens and 133,966 output tokens in all.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

DEFAULT_NUM_PROMPTS = 256
DEFAULT_SEED = 0
MAX_INPUT_LEN = 1024
MAX_OUTPUT_LEN = 1024
MAX_TOKEN_ID = 10000
# totals of the default workload (256 requests, seed 0)
OFFLINE_PROMPT_TOKENS = 142_827
OFFLINE_OUTPUT_TOKENS = 133_966


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    @property
    def is_default(self) -> bool:
        return False

    def shard(self, rank: int, size: int) -> "Workload":
        """Requests rank, rank + size, ...: about what engine `rank` of DP=size gets from the
        router (each request goes to the less loaded engine, so they alternate), for timing one
        engine's share on one GPU."""
        return Workload(self.prompts[rank::size], self.max_tokens[rank::size])

    def __len__(self) -> int:
        return len(self.prompts)


class DefaultWorkload(Workload):
    @property
    def is_default(self) -> bool:
        return True


def _fit(ids: list[int], vocab_size: int | None) -> list[int]:
    """Token ids above a (tiny test) model's vocabulary wrap around; the random stream is unchanged."""
    if vocab_size is None or vocab_size > MAX_TOKEN_ID:
        return ids
    return [t % vocab_size for t in ids]


def offline_workload(num_prompts: int = DEFAULT_NUM_PROMPTS, seed: int = DEFAULT_SEED,
                     vocab_size: int | None = None) -> Workload:
    """nano-vllm's bench.py: all prompts are drawn first, then all max_tokens."""
    rng = random.Random(seed)   # the same stream as random.seed(seed) + random.randint
    prompts = [[rng.randint(0, MAX_TOKEN_ID) for _ in range(rng.randint(100, MAX_INPUT_LEN))]
               for _ in range(num_prompts)]
    max_tokens = [rng.randint(100, MAX_OUTPUT_LEN) for _ in range(num_prompts)]
    cls = DefaultWorkload if (num_prompts, seed) == (DEFAULT_NUM_PROMPTS, DEFAULT_SEED) else Workload
    return cls([_fit(p, vocab_size) for p in prompts], max_tokens)


def fixed_workload(num_prompts: int, input_len: int, output_len: int, seed: int = DEFAULT_SEED,
                   vocab_size: int | None = None) -> Workload:
    """num_prompts random prompts of exactly input_len ids, each asking for output_len tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, MAX_TOKEN_ID) for _ in range(input_len)] for _ in range(num_prompts)]
    return Workload([_fit(p, vocab_size) for p in prompts], [output_len] * num_prompts)


def make_workload(num_prompts: int | None, input_len: int | None, output_len: int | None, seed: int,
                  vocab_size: int | None = None) -> Workload:
    """Fixed lengths when either length is given (the other defaults to 128), else the random workload."""
    n = DEFAULT_NUM_PROMPTS if num_prompts is None else num_prompts
    if input_len is None and output_len is None:
        return offline_workload(n, seed, vocab_size)
    return fixed_workload(n, input_len or 128, output_len or 128, seed, vocab_size)
