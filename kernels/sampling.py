"""Token sampling: greedy, temperature, min-p, top-k, top-p; one program per row.

Semantics (shared exactly by the Triton kernel and the torch reference):

* temperature <= 0: greedy, argmax of the raw logits (first index on ties).
* otherwise, with m = max(logits) and inv_t = 1 / temperature, each token gets
  d = (m - logit) * inv_t >= 0 (its distance from the best token; the
  unnormalised probability is e = exp(-d), the best token has e = 1).
  All three filters are thresholds on d, so the kept set is always
  "every token with d <= thr" (ties at the threshold are kept):
  - min_p (> 0): keep p >= min_p * p_max, i.e. d <= -log(min_p);
  - top_k (0 < k < V): keep the k smallest d (of those min_p kept);
  - top_p (< 1): of what is left, keep the smallest set of highest-probability
    tokens whose mass (renormalised over what is left) is >= top_p, at least
    one token.
  d is compared through its float bits, so thresholds are found exactly by
  bisection over 32-bit keys (several pivots per pass over the vocabulary)
  instead of sorting the row.
* the token is argmax over kept tokens of e / q with q ~ Exp(1) (exponential
  race == sampling from the renormalised distribution).

Randomness is a pure function of (seed, position, token index): the Triton
path draws q = -log(u) from Philox (tl.rand4x) keyed by mix_seed(seed,
position), token t taking output (t // 256) % 4 of counter
(t // 1024) * 256 + t % 256; the reference uses a torch.Generator seeded with
the same mix_seed. The two streams differ; `sample_with_noise*` take q
explicitly so that both paths can be compared exactly.

The Triton path has no host sync: per-row parameters are read (and the seed
hashed) in the kernel. Cost per non-greedy row: one pass over the vocabulary
for max/argmax, one for the exponential race, plus for top-k/top-p one counting
pass and a few bisection passes (4 pivots each, early exit once the threshold
is pinned down).

Top-p without top-k (no max_top_k: the batch's rows have no top-k) takes the
plain route's chunked passes (max, then the exponential race over every token
min_p keeps) and one more: the mass strictly above the race winner w. When that
mass is under p times the kept mass, w lies in the top-p set and is its race's
winner too (the same noise: a subset's best is the best of the whole when it is
in the subset), so no threshold is searched. Otherwise (a chance of about 1 - p
per row) the row searches its threshold by the bisection passes and races
again. No sort, no candidates, the same tokens as the reference. Both run split over programs
per active row (_TP_CHUNKS for the search, LOOM_TOP_P_RACE_CHUNKS for the second race, or the
first race's split where that is finer): few rows are active, and at B=256 the first race's
3 chunks per row would leave 3 programs to walk an active row's vocabulary.

Rows with top-k (k <= max_top_k, max_top_k + 64 <= 1024) instead take their
candidates from one torch.topk of the batch (the max_top_k + 64 largest
logits per row, a radix select, not a sort): the top-k threshold is the k-th candidate's key, the
top-p threshold a prefix sum over the candidates, and the race runs over the
candidates alone, drawing each one's noise at its token index (the same
Philox stream as the full pass). No pass over the vocabulary then. Rows with
top-p and no top-k (top_p_only) use the top 1024 candidates the same way,
after one pass for the mass their top-p renormalises over. When the
kept set might reach past the candidates (the threshold equals the last
candidate's key: ties), the row falls back to the passes above. Same tokens
either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ipc import envs
from kernels.jit import runs_triton, sm_count, step_jit

_MASK64 = (1 << 64) - 1


def _signed64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


_C_SEED = _signed64(0x9E3779B97F4A7C15)
_C_POS = _signed64(0xD1B54A32D192ED03)
_C_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_C_MIX2 = _signed64(0x94D049BB133111EB)


def _lshr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix_seed(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 hash of (seed, position) (splitmix64 finaliser, wrapping int64 math).

    The Triton kernel computes the same hash in-kernel as its Philox key; the
    reference seeds its torch.Generator with it."""
    x = seeds.long() * _C_SEED + positions.long() * _C_POS
    x = (x ^ _lshr(x, 30)) * _C_MIX1
    x = (x ^ _lshr(x, 27)) * _C_MIX2
    return x ^ _lshr(x, 31)


def _prepare(logits, temperature, top_k, top_p, min_p):
    """Per-row parameters as both paths use them."""
    temperature = temperature.float()
    greedy = temperature <= 0
    inv_t = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature)
    min_p = min_p.float()
    max_d = torch.where(min_p > 0, -torch.log(min_p.clamp(1e-30, 1.0)), torch.full_like(min_p, float("inf")))
    return greedy, inv_t, top_k.to(torch.int32), top_p.float(), max_d


def _keys(d: torch.Tensor) -> torch.Tensor:
    return d.view(torch.int32) & 0x7FFFFFFF


# --------------------------------------------------------------------------
# torch reference
# --------------------------------------------------------------------------
def _threshold_ref(key: torch.Tensor, e: torch.Tensor, key0: int, k: int, p: float) -> int:
    vocab = key.shape[0]
    thr = key0
    allowed = key <= thr
    if 0 < k < vocab and k < int(allowed.sum()):
        thr = int(torch.sort(key[allowed]).values[k - 1])
        allowed = key <= thr
    if p < 1.0 and bool(allowed.any()):   # (none: a row masked whole, whose request fails alone)
        uniq, inv = torch.unique(key[allowed], sorted=True, return_inverse=True)
        mass = torch.zeros(uniq.shape[0], dtype=torch.float32, device=key.device).index_add_(0, inv, e[allowed])
        cum = mass.cumsum(0)
        target = p * float(cum[-1])
        idx = int(torch.nonzero(cum >= target)[0, 0])
        thr = int(uniq[idx])
    return thr


def sample_with_noise_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor, min_p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Reference sampler with explicit Exp(1) noise [B, V] (ignored for greedy rows)."""
    logits = logits.float()
    greedy, inv_t, top_k, top_p, max_d = _prepare(logits, temperature, top_k, top_p, min_p)
    out = torch.argmax(logits, dim=-1)
    m = logits.max(dim=-1).values
    d = (m[:, None] - logits) * inv_t[:, None]
    key = _keys(d)
    e = torch.exp(-d)
    key0 = _keys(max_d).tolist()
    greedy_l, k_l, p_l = greedy.tolist(), top_k.tolist(), top_p.tolist()
    for i in range(logits.shape[0]):
        if greedy_l[i]:
            continue
        thr = _threshold_ref(key[i], e[i], key0[i], k_l[i], p_l[i])
        score = torch.where(key[i] <= thr, e[i] / noise[i].float(), torch.full_like(e[i], -1.0))
        out[i] = torch.argmax(score)
    return out


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Reference sampler; row i's noise comes from a torch.Generator seeded with
    mix_seed(seed_i, position_i), so it depends on nothing else in the batch."""
    bsz, vocab = logits.shape
    noise = torch.empty((bsz, vocab), dtype=torch.float32, device=logits.device)
    for i, s in enumerate(mix_seed(seeds, positions).tolist()):
        g = torch.Generator(device=logits.device)
        g.manual_seed(s & _MASK64)
        noise[i].exponential_(generator=g)
    return sample_with_noise_ref(logits, temperature, top_k, top_p, min_p, noise)



# --------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------
_BLOCK = 1024  # tokens per loop step; also fixes the Philox stream layout (4 x _RAND_Q)
_RAND_Q = 256  # token t draws output (t // 256) % 4 of Philox counter (t // 1024) * 256 + t % 256
_NPIV = 4      # pivots per bisection pass (the pass is compute-bound: cost grows with pivots)
_MAX_CHUNKS = 64  # vocabulary chunks per row at most (a fixed tile: no recompiles as the batch changes)
_MAX_CAND = 1024  # top-k candidates per row at most (a fixed tile; rows with a larger k use the passes)
_CAND_SLACK = 64  # candidates beyond the batch's largest top-k
# the top-p route's threshold search for rows whose race winner lay outside their set: programs
# per row, pivots per round, and rounds (each narrows the 31-bit key interval by _TP_NPIV + 1:
# 8 rounds bring any interval to one key)
_TP_CHUNKS = 16
_TP_NPIV = 16
_TP_ROUNDS = 8
_TP_BLOCK = 256


@triton.jit
def _key_e(l, m, inv_t, mask):
    d = (m - l) * inv_t
    key = tl.where(mask, d.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x7FFFFFFF)
    e = tl.where(mask, tl.exp(-d), 0.0)
    return key, e


@triton.jit
def _count_mass_at(row_ptr, vocab, m, inv_t, thr, BLOCK: tl.constexpr):
    cnt = tl.zeros([BLOCK], dtype=tl.int32)
    mass = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < vocab
        l = tl.load(row_ptr + offs, mask=msk, other=0.0).to(tl.float32)
        key, e = _key_e(l, m, inv_t, msk)
        le = key <= thr
        cnt += le.to(tl.int32)
        mass += tl.where(le, e, 0.0)
    return tl.sum(cnt, 0), tl.sum(mass, 0)


@triton.jit
def _pivot_pass(row_ptr, vocab, m, inv_t, lo, hi,
                BLOCK: tl.constexpr, NPIV: tl.constexpr, NEED_MASS: tl.constexpr):
    """NPIV pivots in [lo, hi) (the last one strictly inside (lo, hi) when
    hi - lo >= 2): count (and mass) of the tokens with key <= each pivot."""
    j = tl.arange(0, NPIV)
    span = (hi - lo).to(tl.int64)
    piv = (lo.to(tl.int64) + span * (j + 1).to(tl.int64) // (NPIV + 1)).to(tl.int32)
    acc_c = tl.zeros([BLOCK, NPIV], dtype=tl.int32)
    acc_m = tl.zeros([BLOCK, NPIV], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = offs < vocab
        l = tl.load(row_ptr + offs, mask=msk, other=0.0).to(tl.float32)
        key, e = _key_e(l, m, inv_t, msk)
        le = key[:, None] <= piv[None, :]
        acc_c += le.to(tl.int32)
        if NEED_MASS:
            acc_m += tl.where(le, e[:, None], 0.0)
    return piv, tl.sum(acc_c, 0), tl.sum(acc_m, 0)


@triton.jit
def _race(row_ptr, noise_row_ptr, offs, lo, hi, m, inv_t, thr, u, best, best_i, USE_NOISE: tl.constexpr):
    msk = (offs >= lo) & (offs < hi)
    l = tl.load(row_ptr + offs, mask=msk, other=0.0).to(tl.float32)
    key, e = _key_e(l, m, inv_t, msk)
    if USE_NOISE:
        q = tl.load(noise_row_ptr + offs, mask=msk, other=1.0).to(tl.float32)
        score = tl.math.div_rn(e, q)  # IEEE division, as torch does
    else:
        score = e / -tl.log(u)  # u == 0 -> q = inf -> score 0
    score = tl.where(msk & (key <= thr), score, -1.0)
    upd = score > best
    return tl.where(upd, score, best), tl.where(upd, offs, best_i)


@triton.jit
def _max_argmax(row_ptr, lo, hi, vocab, BLOCK: tl.constexpr):
    """Max of the logits in [lo, hi) (not empty) and its first index."""
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_i = tl.arange(0, BLOCK)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        l = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        upd = l > best
        best = tl.where(upd, l, best)
        best_i = tl.where(upd, offs, best_i)
    m = tl.max(best, 0)
    return m, tl.min(tl.where(best == m, best_i, vocab), 0)


@triton.jit
def _min_p_key(min_p_ptr, row):
    """min_p keeps d <= -log(min_p): that bound as a key (everything when min_p is 0)."""
    min_p = tl.load(min_p_ptr + row).to(tl.float32)
    max_d = tl.where(min_p > 0.0, -tl.log(tl.minimum(tl.maximum(min_p, 1e-30), 1.0)), float("inf"))
    return max_d.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _philox_key(seed_ptr, pos_ptr, row):
    """The row's Philox key: splitmix64 of (seed, position), as mix_seed()."""
    x = tl.load(seed_ptr + row).to(tl.int64).to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15 \
        + tl.load(pos_ptr + row).to(tl.int64).to(tl.uint64, bitcast=True) * 0xD1B54A32D192ED03
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _race_range(row_ptr, noise_row, first, lo, hi, vocab, m, inv_t, thr, key, RAND_Q: tl.constexpr,
                USE_NOISE: tl.constexpr):
    """The exponential race over tokens [lo, hi), walked from `first` <= lo (a multiple of
    4 * RAND_Q: the Philox counters are the token's): returns the best score and its first
    token (vocab if none)."""
    best = tl.full([RAND_Q], -1.0, dtype=tl.float32)
    best_i = tl.arange(0, RAND_Q)
    lane = tl.arange(0, RAND_Q)
    for start in range(first, hi, 4 * RAND_Q):
        if USE_NOISE:
            u0 = tl.zeros([RAND_Q], dtype=tl.float32)
            u1 = u0
            u2 = u0
            u3 = u0
        else:
            u0, u1, u2, u3 = tl.rand4x(key, start // 4 + lane)
        best, best_i = _race(row_ptr, noise_row, start + lane, lo, hi, m, inv_t, thr, u0, best, best_i, USE_NOISE)
        best, best_i = _race(row_ptr, noise_row, start + RAND_Q + lane, lo, hi, m, inv_t, thr, u1, best, best_i,
                             USE_NOISE)
        best, best_i = _race(row_ptr, noise_row, start + 2 * RAND_Q + lane, lo, hi, m, inv_t, thr, u2, best,
                             best_i, USE_NOISE)
        best, best_i = _race(row_ptr, noise_row, start + 3 * RAND_Q + lane, lo, hi, m, inv_t, thr, u3, best,
                             best_i, USE_NOISE)
    top = tl.max(best, 0)
    return top, tl.min(tl.where(best == top, best_i, vocab), 0)


@triton.jit
def _candidate_sample(row_ptr, cand_val_ptr, cand_idx_ptr, noise_row_ptr, num_cand, k, p, inv_t, thr0, philox_key,
                      vocab, CAND: tl.constexpr, USE_NOISE: tl.constexpr, BLOCK: tl.constexpr):
    """The row's draw from its sorted top candidates: (token, ok); ok is False when the kept
    set may hold tokens past the candidates (the caller then runs the full passes). A row
    without top-k (k <= 0) renormalises top-p over every token min_p keeps: that mass takes
    one pass over the row."""
    j = tl.arange(0, CAND)
    msk = j < num_cand
    v = tl.load(cand_val_ptr + j, mask=msk, other=float("-inf")).to(tl.float32)
    t = tl.load(cand_idx_ptr + j, mask=msk, other=0).to(tl.int32)
    m = tl.max(v, 0)
    d = (m - v) * inv_t
    key = tl.where(msk, d.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x7FFFFFFF)
    thr = tl.where(k > 0, tl.minimum(thr0, tl.sum(tl.where(j == k - 1, key, 0), 0)), thr0)  # min_p, top-k
    e = tl.where(msk & (key <= thr), tl.exp(-d), 0.0)
    cum = tl.cumsum(e, 0)                                                   # keys ascend with j
    total = tl.sum(e, 0)
    if k <= 0:
        total = _count_mass_at(row_ptr, vocab, m, inv_t, thr, BLOCK)[1]
    first = tl.min(tl.where(cum >= p * total, j, CAND), 0)
    thr = tl.where(p < 1.0, tl.minimum(thr, tl.sum(tl.where(j == first, key, 0), 0)), thr)
    ok = (thr < tl.sum(tl.where(j == num_cand - 1, key, 0), 0)) & (first < CAND)
    # the exponential race over the kept candidates, each with its token's noise
    if USE_NOISE:
        q = tl.load(noise_row_ptr + t, mask=msk, other=1.0).to(tl.float32)
        score = tl.math.div_rn(tl.exp(-d), q)
    else:
        u0, u1, u2, u3 = tl.rand4x(philox_key, (t // 1024) * 256 + t % 256)
        r = (t % 1024) // 256
        u = tl.where(r == 0, u0, tl.where(r == 1, u1, tl.where(r == 2, u2, u3)))
        score = tl.exp(-d) / -tl.log(u)
    score = tl.where(msk & (key <= thr), score, -1.0)
    top = tl.max(score, 0)
    return tl.min(tl.where(score == top, t, vocab), 0), ok


@triton.jit
def _exact_threshold(row_ptr, vocab, m, inv_t, thr, k, p, BLOCK: tl.constexpr, NPIV: tl.constexpr):
    """The kept set's key bound of a row (every token with key <= it is kept), found by
    bisection over the 32-bit keys (NPIV pivots per pass over the vocabulary), given the row max
    m and min_p's bound thr: top-k (0 < k < vocab), then top-p (p < 1) over what is left."""
    j = tl.arange(0, NPIV)
    need_k = (k > 0) & (k < vocab)
    need_p = p < 1.0
    if need_k | need_p:
        hi = thr
        c_hi, s_hi = _count_mass_at(row_ptr, vocab, m, inv_t, hi, BLOCK)
        if need_k & (k < c_hi):
            # smallest key K with count(key <= K) >= k; invariant: count(<= lo) < k <= count(<= hi)
            lo = hi * 0 - 1
            while (hi - lo > 1) & (c_hi != k):
                piv, cnt, mass = _pivot_pass(row_ptr, vocab, m, inv_t, lo, hi, BLOCK, NPIV, False)
                first = tl.min(tl.where(cnt >= k, j, NPIV), 0)
                sel = j == first
                has = first < NPIV
                lo = tl.where(first > 0, tl.sum(tl.where(j == first - 1, piv, 0), 0), lo)
                c_hi = tl.where(has, tl.sum(tl.where(sel, cnt, 0), 0), c_hi)
                hi = tl.where(has, tl.sum(tl.where(sel, piv, 0), 0), hi)
            if need_p:
                c_hi, s_hi = _count_mass_at(row_ptr, vocab, m, inv_t, hi, BLOCK)
        if need_p:
            # smallest key K with mass(key <= K) >= p * mass(kept so far), at least one token
            target = p * s_hi
            lo = hi * 0 - 1
            c_lo = c_hi * 0
            while (hi - lo > 1) & (c_hi - c_lo > 1):
                piv, cnt, mass = _pivot_pass(row_ptr, vocab, m, inv_t, lo, hi, BLOCK, NPIV, True)
                first = tl.min(tl.where((mass >= target) & (cnt >= 1), j, NPIV), 0)
                sel = j == first
                has = first < NPIV
                sel_lo = j == first - 1
                has_lo = first > 0
                lo = tl.where(has_lo, tl.sum(tl.where(sel_lo, piv, 0), 0), lo)
                c_lo = tl.where(has_lo, tl.sum(tl.where(sel_lo, cnt, 0), 0), c_lo)
                c_hi = tl.where(has, tl.sum(tl.where(sel, cnt, 0), 0), c_hi)
                hi = tl.where(has, tl.sum(tl.where(sel, piv, 0), 0), hi)
        thr = hi
    return thr


@step_jit(ints=("num_cand", "cand_top_p"), pointers=("temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seed_ptr", "pos_ptr"))
def _sample_kernel(
    logits_ptr, stride_l, noise_ptr, stride_n,
    temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, pos_ptr, out_ptr,
    cand_val_ptr, cand_idx_ptr, num_cand, cand_top_p,
    vocab,
    BLOCK: tl.constexpr, RAND_Q: tl.constexpr, NPIV: tl.constexpr, USE_NOISE: tl.constexpr,
    CAND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l

    temp = tl.load(temp_ptr + row).to(tl.float32)
    k = tl.load(top_k_ptr + row).to(tl.int32)
    tok = vocab * 0
    ok = num_cand < 0  # False
    p_row = tl.load(top_p_ptr + row).to(tl.float32)
    top_p_only = (cand_top_p != 0) & ((k <= 0) | (k >= vocab)) & (p_row < 1.0)
    if (temp > 0.0) & (((k > 0) & (k < num_cand)) | top_p_only):
        tok, ok = _candidate_sample(row_ptr, cand_val_ptr + row * num_cand, cand_idx_ptr + row * num_cand,
                                    noise_ptr + row * stride_n, num_cand, tl.where(top_p_only, 0, k), p_row,
                                    tl.math.div_rn(1.0, temp), _min_p_key(min_p_ptr, row),
                                    _philox_key(seed_ptr, pos_ptr, row), vocab, CAND, USE_NOISE, BLOCK)
    if ok:  # (a return at the top level only: nested returns are not supported everywhere)
        tl.store(out_ptr + row, tok.to(tl.int64))
        return

    # pass 1: max and (first) argmax of the raw logits
    m, arg = _max_argmax(row_ptr, 0, vocab, vocab, BLOCK)
    if temp <= 0.0:
        tl.store(out_ptr + row, arg.to(tl.int64))
        return

    inv_t = tl.math.div_rn(1.0, temp)  # IEEE, as the reference's 1 / temperature
    thr = _exact_threshold(row_ptr, vocab, m, inv_t, _min_p_key(min_p_ptr, row), k,
                           tl.load(top_p_ptr + row).to(tl.float32), BLOCK, NPIV)

    # last pass: exponential race over the kept tokens
    top, tok = _race_range(row_ptr, noise_ptr + row * stride_n, 0, 0, vocab, vocab, m, inv_t, thr,
                           _philox_key(seed_ptr, pos_ptr, row), RAND_Q, USE_NOISE)
    tl.store(out_ptr + row, tok.to(tl.int64))


@step_jit(ints=("num_chunks",))
def _chunk_max_kernel(logits_ptr, stride_l, part_max_ptr, part_arg_ptr, vocab_lo, vocab_hi, base, chunk, num_chunks,
                      BLOCK: tl.constexpr):
    """Program (row, c): max and first argmax of the row's logits over chunk c, the token ids
    [base + c * chunk, base + (c + 1) * chunk) within [vocab_lo, vocab_hi). The logits hold ids
    vocab_lo.. (a rank's vocabulary shard; from 0 unsharded); the argmax is a token id."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start = base + c * chunk
    m, arg = _max_argmax(logits_ptr + row * stride_l - vocab_lo, tl.maximum(start, vocab_lo),
                         tl.minimum(start + chunk, vocab_hi), vocab_hi, BLOCK)
    tl.store(part_max_ptr + row * num_chunks + c, m)
    tl.store(part_arg_ptr + row * num_chunks + c, arg)


@step_jit(ints=("num_chunks", "num_max"), pointers=("temp_ptr", "min_p_ptr", "seed_ptr", "pos_ptr"))
def _chunk_race_kernel(
    logits_ptr, stride_l, noise_ptr, stride_n, temp_ptr, min_p_ptr, seed_ptr, pos_ptr,
    all_max_ptr, num_max, part_score_ptr, part_tok_ptr, vocab_lo, vocab_hi, base, chunk, num_chunks,
    RAND_Q: tl.constexpr, BLOCK_C: tl.constexpr, USE_NOISE: tl.constexpr,
):
    """Program (row, c): the exponential race over the row's chunk c (as _chunk_max_kernel's;
    as _sample_kernel's last pass, min_p the only filter), given the row max from the
    num_max chunk maxima of the whole vocabulary (every rank's, sharded). Noise, when given, is
    indexed by token id."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    if temp <= 0.0:
        return
    offs_c = tl.arange(0, BLOCK_C)
    m = tl.max(tl.load(all_max_ptr + row * num_max + offs_c, mask=offs_c < num_max, other=float("-inf")), 0)
    inv_t = tl.math.div_rn(1.0, temp)
    thr = _min_p_key(min_p_ptr, row)
    start = base + c * chunk  # a multiple of 4 * RAND_Q: the same Philox counters as one program per row
    top, tok = _race_range(logits_ptr + row * stride_l - vocab_lo, noise_ptr + row * stride_n, start,
                           tl.maximum(start, vocab_lo), tl.minimum(start + chunk, vocab_hi), vocab_hi, m, inv_t,
                           thr, _philox_key(seed_ptr, pos_ptr, row), RAND_Q, USE_NOISE)
    tl.store(part_score_ptr + row * num_chunks + c, top)
    tl.store(part_tok_ptr + row * num_chunks + c, tok)


@step_jit(ints=("num_chunks",), pointers=("temp_ptr",))
def _chunk_pick_kernel(temp_ptr, part_max_ptr, part_arg_ptr, part_score_ptr, part_tok_ptr, out_ptr, num_chunks,
                       BLOCK_C: tl.constexpr):
    """Per row: greedy -> the first argmax over the chunks; else the race winner (the first
    chunk's on a tie, so the lowest token index, as one program per row)."""
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    ok = offs_c < num_chunks
    base = row * num_chunks + offs_c
    if tl.load(temp_ptr + row).to(tl.float32) <= 0.0:
        val = tl.load(part_max_ptr + base, mask=ok, other=float("-inf"))
        tok = tl.load(part_arg_ptr + base, mask=ok, other=0)
    else:
        val = tl.load(part_score_ptr + base, mask=ok, other=-2.0)
        tok = tl.load(part_tok_ptr + base, mask=ok, other=0)
    first = tl.min(tl.where(val == tl.max(val, 0), offs_c, BLOCK_C), 0)
    tl.store(out_ptr + row, tl.sum(tl.where(offs_c == first, tok, 0), 0).to(tl.int64))


@step_jit(ints=("num_chunks", "chunk"), pointers=("temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr"))
def _chunk_top_p_mass_kernel(logits_ptr, stride_l, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, part_max_ptr,
                             part_score_ptr, part_tok_ptr, part_lt_ptr, part_all_ptr, vocab, chunk, num_chunks,
                             BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (row, c), for a row with top-p and no top-k: the race winner w over the whole row
    (from the chunks' parts, as _chunk_pick_kernel), then over chunk c the mass of the tokens
    strictly more probable than w, and the mass min_p keeps (top-p's renormalisation)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    temp = tl.load(temp_ptr + row).to(tl.float32)
    k = tl.load(top_k_ptr + row).to(tl.int32)
    p = tl.load(top_p_ptr + row).to(tl.float32)
    if (temp > 0.0) & (p < 1.0) & ((k <= 0) | (k >= vocab)):
        offs_c = tl.arange(0, BLOCK_C)
        ok = offs_c < num_chunks
        base = row * num_chunks + offs_c
        m = tl.max(tl.load(part_max_ptr + base, mask=ok, other=float("-inf")), 0)
        score = tl.load(part_score_ptr + base, mask=ok, other=-2.0)
        first = tl.min(tl.where(score == tl.max(score, 0), offs_c, BLOCK_C), 0)
        w = tl.sum(tl.where(offs_c == first, tl.load(part_tok_ptr + base, mask=ok, other=0), 0), 0)
        inv_t = tl.math.div_rn(1.0, temp)
        row_ptr = logits_ptr + row * stride_l
        key_w = ((m - tl.load(row_ptr + w).to(tl.float32)) * inv_t).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        thr = _min_p_key(min_p_ptr, row)
        lt = tl.zeros([BLOCK], dtype=tl.float32)
        kept = tl.zeros([BLOCK], dtype=tl.float32)
        start = c * chunk
        hi = tl.minimum(start + chunk, vocab)
        for s in range(start, hi, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            msk = offs < hi
            key, e = _key_e(tl.load(row_ptr + offs, mask=msk, other=0.0).to(tl.float32), m, inv_t, msk)
            lt += tl.where(key < key_w, e, 0.0)
            kept += tl.where(key <= thr, e, 0.0)
        tl.store(part_lt_ptr + row * num_chunks + c, tl.sum(lt, 0))
        tl.store(part_all_ptr + row * num_chunks + c, tl.sum(kept, 0))


@step_jit(ints=("num_chunks",), pointers=("temp_ptr", "top_k_ptr", "top_p_ptr", "min_p_ptr", "seed_ptr", "pos_ptr"))
def _top_p_pick_kernel(logits_ptr, stride_l, noise_ptr, stride_n, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                       seed_ptr, pos_ptr, part_max_ptr, part_arg_ptr, part_score_ptr, part_tok_ptr, part_lt_ptr,
                       part_all_ptr, out_ptr, active_ptr, lo_ptr, hi_ptr, target_ptr, m_ptr, num_chunks, vocab,
                       BLOCK: tl.constexpr, RAND_Q: tl.constexpr, NPIV: tl.constexpr, BLOCK_C: tl.constexpr,
                       USE_NOISE: tl.constexpr):
    """Per row: greedy -> the first argmax; else the race winner w over every token min_p keeps.
    With top-p, w is the answer when it lies in the top-p set (the mass strictly above it is
    under p times the kept mass): the race over that subset has the same winner, the noise being
    the same. Otherwise (about a 1 - p chance) the row is marked active for the chunked threshold
    search (_top_p_round_kernel) and raced again over its top-p set (_top_p_race_kernel). A row
    with top-k (only when the caller passed no max_top_k) takes _sample_kernel's passes here."""
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    ok = offs_c < num_chunks
    base = row * num_chunks + offs_c
    temp = tl.load(temp_ptr + row).to(tl.float32)
    if temp <= 0.0:
        val = tl.load(part_max_ptr + base, mask=ok, other=float("-inf"))
        toks = tl.load(part_arg_ptr + base, mask=ok, other=0)
    else:
        val = tl.load(part_score_ptr + base, mask=ok, other=-2.0)
        toks = tl.load(part_tok_ptr + base, mask=ok, other=0)
    first = tl.min(tl.where(val == tl.max(val, 0), offs_c, BLOCK_C), 0)
    tok = tl.sum(tl.where(offs_c == first, toks, 0), 0)
    k = tl.load(top_k_ptr + row).to(tl.int32)
    p = tl.load(top_p_ptr + row).to(tl.float32)
    need_k = (k > 0) & (k < vocab)
    active = 0
    if (temp > 0.0) & (need_k | (p < 1.0)):
        # (a row with top-k reads parts the mass kernel left unwritten, and ignores them)
        lt = tl.sum(tl.load(part_lt_ptr + base, mask=ok, other=0.0), 0)
        kept = tl.sum(tl.load(part_all_ptr + base, mask=ok, other=0.0), 0)
        m = tl.max(tl.load(part_max_ptr + base, mask=ok, other=float("-inf")), 0)
        if need_k:
            inv_t = tl.math.div_rn(1.0, temp)
            row_ptr = logits_ptr + row * stride_l
            thr = _exact_threshold(row_ptr, vocab, m, inv_t, _min_p_key(min_p_ptr, row), k, p, BLOCK, NPIV)
            top, tok = _race_range(row_ptr, noise_ptr + row * stride_n, 0, 0, vocab, vocab, m, inv_t, thr,
                                   _philox_key(seed_ptr, pos_ptr, row), RAND_Q, USE_NOISE)
        elif lt >= p * kept:   # the search state, in the slot round 0 reads ((0 - 1) % 2 = 1)
            active = 1
            tl.store(lo_ptr + tl.num_programs(0) + row, -1)
            tl.store(hi_ptr + tl.num_programs(0) + row, _min_p_key(min_p_ptr, row))
            tl.store(target_ptr + row, p * kept)
            tl.store(m_ptr + row, m)
    tl.store(active_ptr + row, active)
    tl.store(out_ptr + row, tok.to(tl.int64))


@triton.jit
def _top_p_state(lo_ptr, hi_ptr, cnt_ptr, mass_ptr, target_ptr, row, bsz, r,
                 NCH: tl.constexpr, NPIV: tl.constexpr, UPDATE: tl.constexpr):
    """The row's search interval (lo, hi] before round r: round r - 1's, narrowed by its
    pivots' masses (summed over the NCH chunks) unless UPDATE is False (round 0). Invariant:
    mass(key <= lo) < target <= mass(key <= hi); the kept set's bound is hi once hi - lo <= 1."""
    prev = (r + 1) % 2
    lo = tl.load(lo_ptr + prev * bsz + row)
    hi = tl.load(hi_ptr + prev * bsz + row)
    if UPDATE:
        if hi - lo > 1:
            j = tl.arange(0, NPIV)
            ch = tl.arange(0, NCH)
            base = ((prev * bsz + row) * NCH + ch[:, None]) * NPIV + j[None, :]
            cnt = tl.sum(tl.load(cnt_ptr + base), 0)
            mass = tl.sum(tl.load(mass_ptr + base), 0)
            piv = _pivots(lo, hi, NPIV)
            first = tl.min(tl.where((mass >= tl.load(target_ptr + row)) & (cnt >= 1), j, NPIV), 0)
            lo_new = tl.where(first > 0, tl.sum(tl.where(j == first - 1, piv, 0), 0), lo)
            hi = tl.where(first < NPIV, tl.sum(tl.where(j == first, piv, 0), 0), hi)
            lo = lo_new
    return lo, hi


@triton.jit
def _pivots(lo, hi, NPIV: tl.constexpr):
    """NPIV pivots spread over (lo, hi), as _pivot_pass's."""
    j = tl.arange(0, NPIV)
    span = (hi - lo).to(tl.int64)
    return (lo.to(tl.int64) + span * (j + 1).to(tl.int64) // (NPIV + 1)).to(tl.int32)


@step_jit(ints=("bsz", "chunk", "r"))
def _top_p_round_kernel(logits_ptr, stride_l, temp_ptr, active_ptr, lo_ptr, hi_ptr, target_ptr, m_ptr, cnt_ptr,
                        mass_ptr, vocab, bsz, chunk, r, NCH: tl.constexpr, NPIV: tl.constexpr,
                        BLOCK: tl.constexpr, UPDATE: tl.constexpr):
    """Program (row, c) of round r of an active row's top-p threshold search: the interval
    after round r - 1 (chunk 0 keeps it for round r + 1), then over chunk c the count and mass
    of the tokens at or below each of NPIV pivots inside it. Every program of the row derives
    the same interval from the same parts; buffers alternate between even and odd rounds."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    if tl.load(active_ptr + row) != 0:
        lo, hi = _top_p_state(lo_ptr, hi_ptr, cnt_ptr, mass_ptr, target_ptr, row, bsz, r, NCH, NPIV, UPDATE)
        if c == 0:
            tl.store(lo_ptr + (r % 2) * bsz + row, lo)
            tl.store(hi_ptr + (r % 2) * bsz + row, hi)
        if hi - lo > 1:
            piv = _pivots(lo, hi, NPIV)
            m = tl.load(m_ptr + row)
            inv_t = tl.math.div_rn(1.0, tl.load(temp_ptr + row).to(tl.float32))
            row_ptr = logits_ptr + row.to(tl.int64) * stride_l
            acc_c = tl.zeros([BLOCK, NPIV], dtype=tl.int32)
            acc_m = tl.zeros([BLOCK, NPIV], dtype=tl.float32)
            end = tl.minimum((c + 1) * chunk, vocab)
            for s in range(c * chunk, end, BLOCK):
                offs = s + tl.arange(0, BLOCK)
                msk = offs < end
                key, e = _key_e(tl.load(row_ptr + offs, mask=msk, other=0.0).to(tl.float32), m, inv_t, msk)
                le = key[:, None] <= piv[None, :]
                acc_c += le.to(tl.int32)
                acc_m += tl.where(le, e[:, None], 0.0)
            base = ((r % 2) * bsz + row) * NCH + c
            tl.store(cnt_ptr + base * NPIV + tl.arange(0, NPIV), tl.sum(acc_c, 0))
            tl.store(mass_ptr + base * NPIV + tl.arange(0, NPIV), tl.sum(acc_m, 0))


@step_jit(ints=("bsz", "chunk", "num_chunks", "r"), pointers=("temp_ptr", "seed_ptr", "pos_ptr"))
def _top_p_race_kernel(logits_ptr, stride_l, noise_ptr, stride_n, temp_ptr, seed_ptr, pos_ptr, active_ptr, lo_ptr,
                       hi_ptr, target_ptr, m_ptr, cnt_ptr, mass_ptr, part_score_ptr, part_tok_ptr, vocab, bsz,
                       chunk, num_chunks, r, NCH: tl.constexpr, NPIV: tl.constexpr, RAND_Q: tl.constexpr,
                       USE_NOISE: tl.constexpr):
    """Program (row, c) of an active row: the threshold after the last round, then the race
    over the kept tokens of the race's chunk c (as _chunk_race_kernel's, the top-p bound added)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    if tl.load(active_ptr + row) != 0:
        lo, thr = _top_p_state(lo_ptr, hi_ptr, cnt_ptr, mass_ptr, target_ptr, row, bsz, r, NCH, NPIV, True)
        inv_t = tl.math.div_rn(1.0, tl.load(temp_ptr + row).to(tl.float32))
        start = c * chunk
        row64 = row.to(tl.int64)
        top, tok = _race_range(logits_ptr + row64 * stride_l, noise_ptr + row64 * stride_n, start, start,
                               tl.minimum(start + chunk, vocab), vocab, tl.load(m_ptr + row), inv_t, thr,
                               _philox_key(seed_ptr, pos_ptr, row64), RAND_Q, USE_NOISE)
        tl.store(part_score_ptr + row64 * num_chunks + c, top)
        tl.store(part_tok_ptr + row64 * num_chunks + c, tok)


@step_jit(ints=("num_chunks",))
def _top_p_repick_kernel(active_ptr, part_score_ptr, part_tok_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr):
    """An active row's token: its top-p race's winner over the chunks (the first on a tie)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(active_ptr + row) != 0:
        offs_c = tl.arange(0, BLOCK_C)
        ok = offs_c < num_chunks
        val = tl.load(part_score_ptr + row * num_chunks + offs_c, mask=ok, other=-2.0)
        toks = tl.load(part_tok_ptr + row * num_chunks + offs_c, mask=ok, other=0)
        first = tl.min(tl.where(val == tl.max(val, 0), offs_c, BLOCK_C), 0)
        tl.store(out_ptr + row, tl.sum(tl.where(offs_c == first, toks, 0), 0).to(tl.int64))


def _launch_chunked(logits, temperature, min_p, seeds, positions, noise, stride_n, use_noise, out, num_chunks,
                    top_k=None, top_p=None):
    """Rows split over vocabulary chunks: about four programs per SM however small the batch.
    With top_k and top_p (the top-p route): the race winner's top-p check, one more pass."""
    bsz, vocab = logits.shape
    step = 4 * _RAND_Q
    max_chunks = triton.cdiv(vocab, step)
    if num_chunks is None:
        num_chunks = triton.cdiv(4 * sm_count(logits.device), bsz)
    num_chunks = max(1, min(int(num_chunks), max_chunks, _MAX_CHUNKS))
    chunk = triton.cdiv(triton.cdiv(vocab, num_chunks), step) * step
    num_chunks = triton.cdiv(vocab, chunk)
    f32 = dict(dtype=torch.float32, device=logits.device)
    i32 = dict(dtype=torch.int32, device=logits.device)
    part_max, part_score = torch.empty(bsz, num_chunks, **f32), torch.empty(bsz, num_chunks, **f32)
    part_arg, part_tok = torch.empty(bsz, num_chunks, **i32), torch.empty(bsz, num_chunks, **i32)
    _chunk_max_kernel[(bsz, num_chunks)](logits, logits.stride(0), part_max, part_arg, 0, vocab, 0, chunk,
                                         num_chunks, BLOCK=_BLOCK, num_warps=4)
    _chunk_race_kernel[(bsz, num_chunks)](
        logits, logits.stride(0), noise, stride_n, temperature, min_p, seeds, positions,
        part_max, num_chunks, part_score, part_tok, 0, vocab, 0, chunk, num_chunks,
        RAND_Q=_RAND_Q, BLOCK_C=_MAX_CHUNKS, USE_NOISE=use_noise, num_warps=4)
    if top_p is None:
        _chunk_pick_kernel[(bsz,)](temperature, part_max, part_arg, part_score, part_tok, out, num_chunks,
                                   BLOCK_C=_MAX_CHUNKS, num_warps=1)
        return out
    top_k, top_p = top_k.contiguous(), top_p.contiguous()
    part_lt, part_all = torch.empty(bsz, num_chunks, **f32), torch.empty(bsz, num_chunks, **f32)
    _chunk_top_p_mass_kernel[(bsz, num_chunks)](logits, logits.stride(0), temperature, top_k, top_p, min_p, part_max,
                                                part_score, part_tok, part_lt, part_all, vocab, chunk, num_chunks,
                                                BLOCK=_BLOCK, BLOCK_C=_MAX_CHUNKS, num_warps=4)
    active = torch.empty(bsz, **i32)
    lo, hi = torch.empty(2, bsz, **i32), torch.empty(2, bsz, **i32)
    target, row_max = torch.empty(bsz, **f32), torch.empty(bsz, **f32)
    _top_p_pick_kernel[(bsz,)](logits, logits.stride(0), noise, stride_n, temperature, top_k, top_p, min_p, seeds,
                               positions, part_max, part_arg, part_score, part_tok, part_lt, part_all, out,
                               active, lo, hi, target, row_max, num_chunks, vocab, BLOCK=_BLOCK, RAND_Q=_RAND_Q,
                               NPIV=_NPIV, BLOCK_C=_MAX_CHUNKS, USE_NOISE=use_noise, num_warps=8)
    # rows whose winner lay outside their top-p set (most steps: none, and these programs return
    # at once): the threshold by bisection, _TP_CHUNKS programs per row and _TP_NPIV pivots per
    # round, then the race again over the kept set
    # (the interpreter pays per program: one program per row there, in wider blocks)
    nch, block = (_TP_CHUNKS, _TP_BLOCK) if logits.is_cuda else (1, _BLOCK)
    cnt, mass = torch.empty(2, bsz, nch, _TP_NPIV, **i32), torch.empty(2, bsz, nch, _TP_NPIV, **f32)
    tp_chunk = triton.cdiv(vocab, nch)
    for r in range(_TP_ROUNDS):
        _top_p_round_kernel[(bsz, nch)](logits, logits.stride(0), temperature, active, lo, hi, target, row_max,
                                        cnt, mass, vocab, bsz, tp_chunk, r, NCH=nch, NPIV=_TP_NPIV,
                                        BLOCK=block, UPDATE=r > 0, num_warps=4)
    # the race again over the active rows' top-p sets: split as the search (few rows are active: at
    # B=256 the first race's 3 chunks per row left 3 programs to walk an active row's vocabulary)
    race_chunks, race_chunk = num_chunks, chunk
    if (want := envs.LOOM_TOP_P_RACE_CHUNKS) > num_chunks:
        race_chunks = min(want, max_chunks, _MAX_CHUNKS)
        race_chunk = triton.cdiv(triton.cdiv(vocab, race_chunks), step) * step
        race_chunks = triton.cdiv(vocab, race_chunk)
        part_score, part_tok = torch.empty(bsz, race_chunks, **f32), torch.empty(bsz, race_chunks, **i32)
    _top_p_race_kernel[(bsz, race_chunks)](logits, logits.stride(0), noise, stride_n, temperature, seeds, positions,
                                           active, lo, hi, target, row_max, cnt, mass, part_score, part_tok, vocab,
                                           bsz, race_chunk, race_chunks, _TP_ROUNDS, NCH=nch, NPIV=_TP_NPIV,
                                           RAND_Q=_RAND_Q, USE_NOISE=use_noise, num_warps=4)
    _top_p_repick_kernel[(bsz,)](active, part_score, part_tok, out, race_chunks, BLOCK_C=_MAX_CHUNKS, num_warps=1)
    return out


def _launch(logits, temperature, top_k, top_p, min_p, seeds, positions, noise, top_k_top_p, num_chunks=None,
            max_top_k=0, top_p_only=False):
    bsz, vocab = logits.shape
    out = torch.empty(bsz, dtype=torch.int64, device=logits.device)
    if bsz == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    use_noise = noise is not None
    if not use_noise:
        noise = logits  # a stand-in pointer, never read
    elif noise.stride(-1) != 1:
        noise = noise.contiguous()
    stride_n = noise.stride(0) if use_noise else 0
    temperature, min_p = temperature.contiguous(), min_p.contiguous()
    seeds, positions = seeds.contiguous(), positions.contiguous()
    if not top_k_top_p:
        return _launch_chunked(logits, temperature, min_p, seeds, positions, noise, stride_n, use_noise, out,
                               num_chunks)
    if not max_top_k:  # no top-k candidates: the top-p route (rows with top-k take the passes there)
        return _launch_chunked(logits, temperature, min_p, seeds, positions, noise, stride_n, use_noise, out,
                               num_chunks, top_k, top_p)
    # _CAND_SLACK candidates past the largest k: bf16 logits tie often (8 mantissa bits), and a
    # row whose k-th value ties with the last candidate must fall back to the passes
    num_cand = min(max_top_k + _CAND_SLACK, _MAX_CAND, vocab) if max_top_k and max_top_k > 0 else 0
    if top_p_only:  # rows with top-p and no top-k try the largest candidate tile
        num_cand = min(_MAX_CAND, vocab)
    if num_cand:
        cand_val, cand_idx = torch.topk(logits, num_cand, dim=-1)  # sorted, largest first
    else:
        cand_val, cand_idx = logits, out  # stand-in pointers, never read
    _sample_kernel[(bsz,)](
        logits, logits.stride(0), noise, stride_n, temperature, top_k.contiguous(), top_p.contiguous(), min_p,
        seeds, positions, out, cand_val, cand_idx, num_cand, int(top_p_only), vocab,
        BLOCK=_BLOCK, RAND_Q=_RAND_Q, NPIV=_NPIV, USE_NOISE=use_noise,
        CAND=max(16, triton.next_power_of_2(num_cand)), num_warps=8,  # the candidates' tile: top-k 50 -> 128
    )
    return out


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, top_k_top_p: bool = True,
           num_chunks: int | None = None, max_top_k: int = 0, top_p_only: bool = False) -> torch.Tensor:
    """logits [B, V] (fp32, or bf16/fp16 read as fp32), temperature [B] fp32 (0 =
    greedy), top_k [B] int32 (<= 0 or >= V: off), top_p [B] fp32 (1.0: off),
    min_p [B] fp32 (0: off), seeds [B] int64, positions [B] int64 -> token ids
    int64 [B]. No host sync (per-row parameters are read in the kernels).

    top_k_top_p=False promises that no row uses top-k or top-p: each row is then
    split over vocabulary chunks (num_chunks, default about four programs per
    SM) in three small launches instead of one program per row, which leaves
    most SMs idle at small batches. Same tokens either way.

    max_top_k == 0 (no row has top-k, as the host knows it; the default) takes the chunked
    route with the race winner's top-p check (rows with top-k still get their exact draw there,
    by the passes). max_top_k > 0 (the largest top_k of the batch) lets rows with top-k
    draw from the batch's top max_top_k + 64 candidates (one torch.topk) instead of passes over
    the vocabulary. top_p_only=True (some row has top-p and no top-k) lets those rows try the
    top 1024 candidates too, after one pass for the mass they renormalise over (they fall back
    to the passes when their top-p set is larger). Same tokens either way."""
    if not runs_triton(_sample_kernel, logits):
        return sample_ref(logits, temperature, top_k, top_p, min_p, seeds, positions)
    return _launch(logits, temperature, top_k, top_p, min_p, seeds, positions, None, top_k_top_p, num_chunks,
                   max_top_k, top_p_only)


def sample_with_noise(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, min_p: torch.Tensor, noise: torch.Tensor, top_k_top_p: bool = True,
                      num_chunks: int | None = None, max_top_k: int = 0,
                      top_p_only: bool = False) -> torch.Tensor:
    """The Triton sampler with explicit Exp(1) noise [B, V] instead of Philox."""
    if not runs_triton(_sample_kernel, logits):
        return sample_with_noise_ref(logits, temperature, top_k, top_p, min_p, noise)
    zeros = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    return _launch(logits, temperature, top_k, top_p, min_p, zeros, zeros, noise, top_k_top_p, num_chunks,
                   max_top_k, top_p_only)


@triton.jit
def _philox_noise_kernel(seed_ptr, pos_ptr, out_ptr, vocab, RAND_Q: tl.constexpr):
    """Program (row, c): the Exp(1) noise q = -log(u) the Philox draws give tokens
    [c * 4 * RAND_Q, (c + 1) * 4 * RAND_Q) of the row (the layout of _race_range)."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * 4 * RAND_Q
    lane = tl.arange(0, RAND_Q)
    u0, u1, u2, u3 = tl.rand4x(_philox_key(seed_ptr, pos_ptr, row), start // 4 + lane)
    out = out_ptr + row * vocab
    tl.store(out + start + lane, -tl.log(u0), mask=start + lane < vocab)
    tl.store(out + start + RAND_Q + lane, -tl.log(u1), mask=start + RAND_Q + lane < vocab)
    tl.store(out + start + 2 * RAND_Q + lane, -tl.log(u2), mask=start + 2 * RAND_Q + lane < vocab)
    tl.store(out + start + 3 * RAND_Q + lane, -tl.log(u3), mask=start + 3 * RAND_Q + lane < vocab)


def philox_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """The Exp(1) noise [B, vocab] that sample() draws for each (seed, position) from Philox:
    sample_with_noise_ref() with it is the reference of sample()'s seeded tokens (tests, bench)."""
    bsz = seeds.shape[0]
    out = torch.empty((bsz, vocab), dtype=torch.float32, device=seeds.device)
    if bsz:
        _philox_noise_kernel[(bsz, triton.cdiv(vocab, 4 * _RAND_Q))](seeds.contiguous(), positions.contiguous(),
                                                                    out, vocab, RAND_Q=_RAND_Q)
    return out


# --------------------------------------------------------------------------
# vocabulary shards (tensor parallelism)
# --------------------------------------------------------------------------
# Under tensor parallelism each rank computes the logits of its slice of the vocabulary.
# Rows that sample plainly (greedy, temperature, min-p) need no rank to see the others'
# logits: the row max, then the exponential race's winner, are reductions. Each rank reduces
# its own columns to a few values per row, `gather` ([B, k] -> every rank's [B, k] side by
# side, a collective) exchanges them, and every rank picks the same token. The draws are the
# unsharded sampler's (the same max, the same noise per token id, first index on ties), so
# the tokens equal sample() / sample_ref() on the gathered logits.

def _gather_pairs(gather, a: torch.Tensor, b: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's [B, C] float32 a and int32 b -> every rank's, [B, world * C] each, in rank
    order (one collective: a's bits travel as int32)."""
    bsz, c = a.shape
    got = gather(torch.cat((a.view(torch.int32), b), dim=1)).view(bsz, world, 2, c)
    return got[:, :, 0].reshape(bsz, world * c).view(torch.float32), got[:, :, 1].reshape(bsz, world * c)


def sample_sharded(logits: torch.Tensor, vocab_start: int, vocab_size: int, temperature: torch.Tensor,
                   min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, gather, world: int,
                   noise: torch.Tensor | None = None, num_chunks: int | None = None) -> torch.Tensor:
    """Plain rows (temperature [B] fp32, 0 = greedy; min_p [B]; no top-k / top-p) from this
    rank's logits [B, part] (token ids vocab_start.., padding past vocab_size) -> token ids
    int64 [B], the same on every rank of the `world` that makes the same call. `gather` is the
    group's all-gather ([B, k] -> [B, world * k]); noise, when given, is [B, vocab_size]
    (every rank's), else Philox as sample(). Each rank splits its part into the same number of
    chunks (num_chunks, default about four programs per SM), which stay on 1,024-token
    boundaries of the whole vocabulary (the Philox layout)."""
    if not runs_triton(_chunk_max_kernel, logits):
        return sample_sharded_ref(logits, vocab_start, vocab_size, temperature, min_p, seeds, positions, gather,
                                  noise)
    bsz, part = logits.shape
    out = torch.empty(bsz, dtype=torch.int64, device=logits.device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    step = 4 * _RAND_Q
    if num_chunks is None:
        num_chunks = triton.cdiv(4 * sm_count(logits.device), max(bsz, 1))
    # a part that starts mid-chunk needs one chunk more; every rank's chunks fit the pick's tile
    num_chunks = max(1, min(int(num_chunks), triton.cdiv(part, step), _MAX_CHUNKS // world - 1))
    chunk = triton.cdiv(triton.cdiv(part, num_chunks), step) * step
    per_rank = triton.cdiv(part, chunk) + 1   # the same on every rank: the exchange's shape
    base = vocab_start // chunk * chunk
    vocab_hi = min(vocab_start + part, vocab_size)
    use_noise = noise is not None
    noise_arg = noise.contiguous() if use_noise else logits
    stride_n = noise_arg.stride(0) if use_noise else 0
    temperature, min_p = temperature.contiguous(), min_p.contiguous()
    seeds, positions = seeds.contiguous(), positions.contiguous()
    f32 = dict(dtype=torch.float32, device=logits.device)
    i32 = dict(dtype=torch.int32, device=logits.device)
    # (a greedy row's race parts stay unwritten: the pick reads its maxima)
    part_max, part_score = torch.empty(bsz, per_rank, **f32), torch.empty(bsz, per_rank, **f32)
    part_arg, part_tok = torch.empty(bsz, per_rank, **i32), torch.empty(bsz, per_rank, **i32)
    grid = (bsz, per_rank)
    _chunk_max_kernel[grid](logits, logits.stride(0), part_max, part_arg, vocab_start, vocab_hi, base, chunk,
                            per_rank, BLOCK=_BLOCK, num_warps=4)
    all_max, all_arg = _gather_pairs(gather, part_max, part_arg, world)
    _chunk_race_kernel[grid](
        logits, logits.stride(0), noise_arg, stride_n, temperature, min_p, seeds, positions,
        all_max, world * per_rank, part_score, part_tok, vocab_start, vocab_hi, base, chunk, per_rank,
        RAND_Q=_RAND_Q, BLOCK_C=_MAX_CHUNKS, USE_NOISE=use_noise, num_warps=4)
    all_score, all_tok = _gather_pairs(gather, part_score, part_tok, world)
    _chunk_pick_kernel[(bsz,)](temperature, all_max, all_arg, all_score, all_tok, out, world * per_rank,
                               BLOCK_C=_MAX_CHUNKS, num_warps=1)
    return out


def _first_max(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per row, the id of the first largest value ([B, W] each: the ranks' bests in rank order)."""
    first = (values == values.max(dim=-1, keepdim=True).values).int().argmax(dim=-1, keepdim=True)
    return ids.gather(1, first).squeeze(1)


def sample_sharded_ref(logits: torch.Tensor, vocab_start: int, vocab_size: int, temperature: torch.Tensor,
                       min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, gather,
                       noise: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of sample_sharded: each rank's best per row, exchanged; the noise of its
    columns cut from the row's whole-vocabulary draw (sample_ref's generator)."""
    bsz, part = logits.shape
    n = max(0, min(part, vocab_size - vocab_start))
    x = logits[:, :n].float()
    ones = torch.ones_like(temperature, dtype=torch.float32)
    greedy, inv_t, _, _, max_d = _prepare(x, temperature, ones.int(), ones, min_p)
    local_max = x.max(dim=-1).values if n else torch.full((bsz,), float("-inf"), device=x.device)
    local_arg = x.argmax(dim=-1) + vocab_start if n else torch.zeros(bsz, dtype=torch.int64, device=x.device)
    all_max = gather(local_max[:, None])
    out = _first_max(all_max, gather(local_arg[:, None]))
    if bool(greedy.all()):
        return out
    if noise is None:
        noise = torch.empty((bsz, vocab_size), dtype=torch.float32, device=x.device)
        for i, s in enumerate(mix_seed(seeds, positions).tolist()):
            g = torch.Generator(device=x.device)
            g.manual_seed(s & _MASK64)
            noise[i].exponential_(generator=g)
    q = noise[:, vocab_start:vocab_start + n].float()
    d = (all_max.max(dim=-1).values[:, None] - x) * inv_t[:, None]
    score = torch.where(_keys(d) <= _keys(max_d)[:, None], torch.exp(-d) / q, torch.full_like(d, -1.0))
    best = score.max(dim=-1).values if n else torch.full((bsz,), -2.0, device=x.device)
    best_id = score.argmax(dim=-1) + vocab_start if n else torch.zeros(bsz, dtype=torch.int64, device=x.device)
    return torch.where(greedy, out, _first_max(gather(best[:, None]), gather(best_id[:, None])))
