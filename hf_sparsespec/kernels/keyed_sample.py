"""keyed_sample: one token per row of probabilities, from noise that depends only on the row's key.

Why: the device generator's stream is consumed by a whole iteration at once, so which requests share
an iteration (admission order, offload, restore, batch size) would change every request's samples.
Instead every sampled row carries a 64-bit key: the host derives a *stream* from (seed, request,
purpose) (`sampling.stream_keys`), and `position_keys_ref` folds in the position of the drawn token on
the device (a speculative draft's position is only known there). Its noise is a counter-based hash
of (key, vocabulary index):

    key       = (hash32(hi ^ p), hash32(lo ^ hash32(p ^ 0x9E3779B9)))   stream (hi, lo), position p
    h(key, v) = hash32(key_lo ^ hash32(key_hi ^ v))          hash32: "lowbias32" (C. Wellons), uint32
    u(key, v) = ((h >> 9) + 0.5) / 2^23                      uniform in (0, 1), exact in float32
    token     = argmax_v  p[v] / -log u(key, v)              the exponential race: token ~ p / sum(p)

(`torch.multinomial` draws one sample the same way, with its own noise.) Rows with different keys get
independent noise; the same key always gives the same token.

Triton: programs walk a row's vocabulary in blocks, keeping the running maximum and its index (the
first index on ties, as `torch.argmax`); a row's vocabulary is split over several programs when the
rows alone would not fill the device, and a second launch folds the splits. `position_keys` hashes a
step's keys in one launch and `accept_drafts` its acceptance tests' uniforms (the torch references take
~50 small integer kernels each); `keyed_uniform` is those uniforms alone.

Every sampler takes its rows as probabilities, or as logits with each row's stats: `softmax_stats`
(maximum of logits / T, inverse sum: temperature alone) or `truncation_stats` (top-k / top-p: the
maximum, the inverse sum of the kept tokens and the smallest kept logit, a third column). Then
`stats_probability` forms each probability in registers, the same expression `tempered_softmax` and
`truncated_softmax` write with, so the tokens are those of the written probabilities to the bit, and no
float32 `[rows, vocab]` matrix is written. `probabilities_at` reads single probabilities the same way
(the acceptance test's p and q of each draft).

`keyed_sample_residual` draws a rejected verification's recovered token (and a fully accepted one's
bonus token) the same way from `max(p - q, 0)`, p a row of the target probabilities and q a row of
the drafts' store (none for a bonus token), falling back to p where nothing is left: the rows are read
where they are and the residual is formed in registers, instead of two row gathers and five
vocabulary-wide passes before the sample (~0.14 ms of a 256-row iteration on the H100,
docs/measurements.md 30).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._checks import HALF_AND_FLOAT, check_tensor
from hf_sparsespec.kernels.attention_plan import num_sms
from hf_sparsespec.sampling import rejection_test

_MASK32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97
_POSITION_SALT = 0x9E3779B9
_LOG2E = tl.constexpr(1.4426950408889634)
MAX_VOCAB_BLOCK = 4096  # the most vocabulary entries a row-wise pass loads at once
SAMPLE_PROGRAMS_PER_SM = 8  # keyed_sample splits each row's vocabulary until rows x splits reach this per SM
# keys per program of position_keys and keyed_uniform whatever their number: one compiled variant each
# (a batch's tail hashes ever fewer rows; a block sized from n would compile each new size again)
KEYS_PER_PROGRAM = 1024


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for int64 tensors holding uint32 values (no int64 overflow)."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def hash32_ref(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 15)


def position_keys_ref(
    streams: torch.Tensor,  # [..., 2] int32/int64 bit patterns of (hi, lo) stream words
    positions: torch.Tensor,  # [...] int64, broadcast against streams[..., 0]
) -> torch.Tensor:
    """`[..., 2]` int64 keys of the draws at `positions` of each stream (see the module docstring)."""
    hi = streams[..., 0].long() & _MASK32
    lo = streams[..., 1].long() & _MASK32
    p = positions.long() & _MASK32
    return torch.stack([hash32_ref(hi ^ p), hash32_ref(lo ^ hash32_ref(p ^ _POSITION_SALT))], dim=-1)


def keyed_uniform_ref(
    keys: torch.Tensor,  # [..., 2] int32/int64 bit patterns of (key_hi, key_lo)
    index: torch.Tensor | int = 0,  # broadcast against keys[..., 0]
) -> torch.Tensor:
    """u(key, index) in (0, 1), float32, shape of `keys[..., 0]` broadcast with `index`."""
    hi = keys[..., 0].long() & _MASK32
    lo = keys[..., 1].long() & _MASK32
    h = hash32_ref(lo ^ hash32_ref(hi ^ index))
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def probabilities_ref(values: torch.Tensor, stats: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """Rows of probabilities (float32): `values` themselves when `stats` is None, else `values` are logits
    and the rows are `softmax(values / temperature)` (`tempered_softmax_ref`), over the tokens at or above
    each row's threshold when `stats` has a third column (`truncation_stats_ref`). Row by row: the same bits
    whichever rows are read together (the references use only the threshold of the stats, not the
    maximum and inverse sum, the Triton kernels' shortcut)."""
    if stats is None:
        return values.float()
    scores = values.float() / temperature
    if stats.shape[1] == 3:  # truncated: the tokens below the row's smallest kept logit dropped
        scores = torch.where(values.float() >= stats[:, 2:], scores, float("-inf"))
    return torch.softmax(scores, dim=-1)


def _rows_of(stats: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if stats is None else stats[rows]


def keyed_sample_ref(
    probs: torch.Tensor,  # [num_rows, vocab] fp16/bf16/fp32, unnormalised probabilities (>= 0), or logits
    keys: torch.Tensor,  # [num_rows, 2] int32/int64 bit patterns of each row's key
    stats: torch.Tensor | None = None,  # [num_rows, 2 or 3] fp32: `probs` are logits (`probabilities_ref`)
    temperature: float = 1.0,
) -> torch.Tensor:
    """Reference (and CPU backend) of `keyed_sample`: `[num_rows]` int64 tokens."""
    probs = probabilities_ref(probs, stats, temperature)
    vocab = torch.arange(probs.shape[1], device=probs.device)[None, :]
    uniform = keyed_uniform_ref(keys[:, None, :], vocab)
    return (probs.float() / -torch.log(uniform)).argmax(dim=-1)


def keyed_sample_residual_ref(
    probs: torch.Tensor,  # [n, vocab] target probabilities (>= 0), or logits (stats)
    rows: torch.Tensor,  # [num_rows] int64 row of `probs` per draw
    store: torch.Tensor,  # [m, vocab] draft probabilities (>= 0), or logits (store_stats)
    store_rows: torch.Tensor,  # [num_rows] int64 row of `store` to subtract, -1: none
    keys: torch.Tensor,  # [num_rows, 2] int32/int64
    stats: torch.Tensor | None = None,  # [n, 2 or 3] fp32: `probs` are logits (`probabilities_ref`)
    store_stats: torch.Tensor | None = None,  # [m, 2 or 3] fp32: `store` holds logits
    temperature: float = 1.0,
) -> torch.Tensor:
    """Reference (and CPU backend) of `keyed_sample_residual`: `[num_rows]` int64 tokens drawn from
    `max(probs[rows] - store[store_rows], 0)` (nothing subtracted at -1), or from `probs[rows]` itself
    where that is zero everywhere."""
    p = probabilities_ref(probs[rows], _rows_of(stats, rows), temperature)
    has_draft = store_rows >= 0
    q = torch.zeros_like(p)
    if store.shape[0]:
        store_rows = store_rows.clamp(min=0)
        q = probabilities_ref(store[store_rows], _rows_of(store_stats, store_rows), temperature) * has_draft[:, None]
    residual = (p - q).clamp(min=0)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p)
    return keyed_sample_ref(residual, keys)


def probabilities_at_ref(
    values: torch.Tensor,  # [n, vocab] probabilities, or logits (stats)
    rows: torch.Tensor,  # [...] int64 rows of `values`
    tokens: torch.Tensor,  # [...] int64, the shape of `rows`
    stats: torch.Tensor | None = None,  # [n, 2 or 3] fp32: `values` are logits
    temperature: float = 1.0,
) -> torch.Tensor:
    """Reference (and CPU backend) of `probabilities_at`: the probability of `tokens[i]` in row `rows[i]`,
    float32, the shape of `rows`."""
    flat_rows = rows.reshape(-1).long()
    probs = probabilities_ref(values[flat_rows], _rows_of(stats, flat_rows), temperature)
    return probs.gather(1, tokens.reshape(-1, 1).long()).view(rows.shape)


@triton.jit
def tempered_probability(x, temperature, row_max, inv_sum):
    """A row's probability of logits `x` (fp32) from its `tempered_softmax.softmax_stats` (row maximum of
    x / T, inverse sum): every kernel that reads a distribution from its logits (the softmax's write
    pass, the samplers, `probabilities_at`) computes it with this one expression, so they agree to the bit."""
    return tl.exp2((x / temperature - row_max) * _LOG2E) * inv_sum


@triton.jit
def load_stats(stats_ptr, row, mask, STATS_WIDTH: tl.constexpr):
    """A row's `(maximum, inverse sum, smallest kept logit)` from its stats: `[.., 2]` (`softmax_stats`,
    every token kept: -inf) or `[.., 3]` (`truncation_stats`); `row` a scalar or a block of rows (`mask`
    its valid ones)."""
    row_max = tl.load(stats_ptr + row * STATS_WIDTH, mask=mask, other=0.0)
    inv_sum = tl.load(stats_ptr + row * STATS_WIDTH + 1, mask=mask, other=0.0)
    if STATS_WIDTH == 3:
        threshold = tl.load(stats_ptr + row * STATS_WIDTH + 2, mask=mask, other=0.0)
    else:
        threshold = tl.full(row_max.shape, float("-inf"), tl.float32)
    return row_max, inv_sum, threshold


@triton.jit
def stats_probability(x, temperature, row_max, inv_sum, threshold, STATS_WIDTH: tl.constexpr):
    """`tempered_probability`, and 0 below the row's smallest kept logit with `truncation_stats` (three
    columns): the one expression of every kernel that reads a distribution from its logits."""
    p = tempered_probability(x, temperature, row_max, inv_sum)
    if STATS_WIDTH == 3:
        p = tl.where(x >= threshold, p, 0.0)
    return p


@triton.jit
def _hash32(x):
    """lowbias32 on uint32 (wrapping multiplies)."""
    x ^= x >> 16
    x *= tl.full(x.shape, 0x21F0AAAD, tl.uint32)
    x ^= x >> 15
    x *= tl.full(x.shape, 0x735A2D97, tl.uint32)
    x ^= x >> 15
    return x


@triton.jit
def keyed_uniform_of(key_hi, key_lo, index):
    """u(key, index) of `keyed_uniform_ref` (uint32 words and index): the one expression every kernel that
    draws or tests with keyed noise uses, so they agree to the bit."""
    h = _hash32(key_lo ^ _hash32(key_hi ^ index))
    return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _keyed_sample_kernel(
    probs_ptr,  # [n, vocab] probabilities, or logits (FROM_LOGITS)
    keys_ptr,  # [num_rows, 2] int32 or int64
    out_ptr,  # [num_rows] int64 (one split) or [num_rows, num_splits] int64 (the splits' best indices)
    best_ptr,  # [num_rows, num_splits] fp32, each split's best score (SPLIT)
    rows_ptr,  # [num_rows] int64 row of probs per draw (RESIDUAL; else row r reads row r)
    store_ptr,  # [m, vocab] subtracted rows (RESIDUAL), probabilities or logits (FROM_LOGITS)
    store_rows_ptr,  # [num_rows] int64 row of store per draw, -1: none (RESIDUAL)
    fallback_out_ptr,  # as out_ptr: the best of p itself (RESIDUAL)
    fallback_best_ptr,  # as best_ptr (RESIDUAL, SPLIT)
    stats_ptr,  # [n, STATS_WIDTH] fp32 (FROM_LOGITS): each row's `softmax_stats` or `truncation_stats`
    store_stats_ptr,  # [m, STATS_WIDTH] fp32 (FROM_LOGITS, RESIDUAL): the store rows' stats
    vocab,
    split_size,  # vocabulary entries per split, a multiple of BLOCK_V
    stride_probs_row,
    stride_keys_row,
    stride_store_row,
    temperature,
    BLOCK_V: tl.constexpr,
    SPLIT: tl.constexpr,
    RESIDUAL: tl.constexpr,  # race over max(p - q, 0), and over p for the rows where that is all zero
    FROM_LOGITS: tl.constexpr,  # rows are logits: p = stats_probability(x, T, row stats)
    STATS_WIDTH: tl.constexpr,  # 2 (temperature alone) or 3 (truncated) with FROM_LOGITS
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    key_hi = tl.load(keys_ptr + row * stride_keys_row).to(tl.uint32)  # int64 -> low 32 bits
    key_lo = tl.load(keys_ptr + row * stride_keys_row + 1).to(tl.uint32)
    offs = tl.arange(0, BLOCK_V)
    source = row
    store_row = row
    has_draft = offs < 0  # (BLOCK_V,) whether a store row is subtracted (RESIDUAL)
    if RESIDUAL:
        source = tl.load(rows_ptr + row).to(tl.int64)
        store_row = tl.load(store_rows_ptr + row).to(tl.int64)
        has_draft = (tl.zeros([BLOCK_V], tl.int64) + store_row) >= 0
    store_row = tl.maximum(store_row, 0)
    row_max = tl.full([], 0.0, tl.float32)
    inv_sum = row_max
    threshold = row_max
    store_max = row_max
    store_inv_sum = row_max
    store_threshold = row_max
    if FROM_LOGITS:
        row_max, inv_sum, threshold = load_stats(stats_ptr, source, source >= 0, STATS_WIDTH)
        if RESIDUAL:
            store_max, store_inv_sum, store_threshold = load_stats(store_stats_ptr, store_row, store_row >= 0,
                                                                   STATS_WIDTH)  # fmt: skip
    missing = float("-inf") if FROM_LOGITS else 0.0  # what a masked load reads: probability 0
    best = tl.full([], -1.0, tl.float32)
    best_index = tl.full([], 0, tl.int64)
    fallback = tl.full([], -1.0, tl.float32)
    fallback_index = tl.full([], 0, tl.int64)
    first = split * split_size
    last = tl.minimum(first + split_size, vocab)
    for start in range(first, last, BLOCK_V):
        index = start + offs
        mask = index < last
        p = tl.load(probs_ptr + source * stride_probs_row + index, mask=mask, other=missing).to(tl.float32)
        if FROM_LOGITS:
            p = stats_probability(p, temperature, row_max, inv_sum, threshold, STATS_WIDTH)
        exponential = -tl.log(keyed_uniform_of(key_hi, key_lo, index.to(tl.uint32)))
        if RESIDUAL:
            q_ptr = store_ptr + store_row * stride_store_row + index
            q = tl.load(q_ptr, mask=mask & has_draft, other=missing).to(tl.float32)
            if FROM_LOGITS:
                q = stats_probability(q, temperature, store_max, store_inv_sum, store_threshold, STATS_WIDTH)
            p_score = tl.where(mask, p / exponential, -1.0)
            block_fallback = tl.max(p_score, axis=0)
            fallback_block_index = tl.argmax(p_score, axis=0).to(tl.int64) + start
            fallback_index = tl.where(block_fallback > fallback, fallback_block_index, fallback_index)
            fallback = tl.maximum(fallback, block_fallback)
            p = tl.maximum(p - q, 0.0)
        score = tl.where(mask, p / exponential, -1.0)  # BLOCK_V
        block_best = tl.max(score, axis=0)
        block_index = tl.argmax(score, axis=0).to(tl.int64) + start
        take = block_best > best  # strictly: earlier blocks win ties
        best_index = tl.where(take, block_index, best_index)
        best = tl.maximum(best, block_best)
    if SPLIT:
        tl.store(out_ptr + row * num_splits + split, best_index)
        tl.store(best_ptr + row * num_splits + split, best)
        if RESIDUAL:
            tl.store(fallback_out_ptr + row * num_splits + split, fallback_index)
            tl.store(fallback_best_ptr + row * num_splits + split, fallback)
    else:
        if RESIDUAL:  # nothing left of p - q: p's own draw
            best_index = tl.where(best > 0.0, best_index, fallback_index)
        tl.store(out_ptr + row, best_index)


@triton.jit(do_not_specialize=["num_splits"])
def _fold_splits_kernel(
    best_ptr,  # [num_rows, num_splits] fp32
    index_ptr,  # [num_rows, num_splits] int64
    out_ptr,  # [num_rows] int64
    fallback_best_ptr,  # as best_ptr: the splits' best of p itself (RESIDUAL)
    fallback_index_ptr,  # as index_ptr (RESIDUAL)
    num_splits,
    BLOCK_S: tl.constexpr,  # splits_block(vocab): >= num_splits
    RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_S)
    valid = offs < num_splits
    best = tl.load(best_ptr + row * num_splits + offs, mask=valid, other=-2.0)
    index = tl.load(index_ptr + row * num_splits + offs, mask=valid, other=0)
    if RESIDUAL:  # nothing left of p - q in any split: p's own draw
        spent = tl.max(best, axis=0) <= 0.0
        best = tl.where(spent, tl.load(fallback_best_ptr + row * num_splits + offs, mask=valid, other=-2.0), best)
        index = tl.where(spent, tl.load(fallback_index_ptr + row * num_splits + offs, mask=valid, other=0), index)
    first = tl.min(tl.where(best == tl.max(best, axis=0), offs, BLOCK_S), axis=0)  # ties: the earliest split
    tl.store(out_ptr + row, tl.sum(tl.where(offs == first, index, 0), axis=0))


@triton.jit(do_not_specialize=["n"])
def _position_keys_kernel(
    streams_ptr,  # [n, 2] int32/int64 (hi, lo) stream words
    positions_ptr,  # [n] int32/int64
    keys_ptr,  # [n, 2] int64 out
    n,
    stride_streams,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row = offs.to(tl.int64)
    hi = tl.load(streams_ptr + row * stride_streams, mask=mask, other=0).to(tl.uint32)  # low 32 bits
    lo = tl.load(streams_ptr + row * stride_streams + 1, mask=mask, other=0).to(tl.uint32)
    position = tl.load(positions_ptr + row, mask=mask, other=0).to(tl.uint32)
    salt = tl.full(position.shape, 0x9E3779B9, tl.uint32)  # _POSITION_SALT
    tl.store(keys_ptr + row * 2, _hash32(hi ^ position).to(tl.int64), mask=mask)
    tl.store(keys_ptr + row * 2 + 1, _hash32(lo ^ _hash32(position ^ salt)).to(tl.int64), mask=mask)


@triton.jit(do_not_specialize=["n"])
def _keyed_uniform_kernel(
    keys_ptr,  # [n, 2] int32/int64 (key_hi, key_lo)
    out_ptr,  # [n] float32
    n,
    stride_keys,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row = offs.to(tl.int64)
    key_hi = tl.load(keys_ptr + row * stride_keys, mask=mask, other=0).to(tl.uint32)
    key_lo = tl.load(keys_ptr + row * stride_keys + 1, mask=mask, other=0).to(tl.uint32)
    tl.store(out_ptr + row, keyed_uniform_of(key_hi, key_lo, tl.zeros_like(key_hi)), mask=mask)  # index 0


def _rows_of_pairs(name: str, pairs: torch.Tensor) -> torch.Tensor:
    """`pairs [..., 2]` int32/int64 as `[n, 2]` with a unit-stride last dimension."""
    check_tensor(name, pairs, dtypes=(torch.int32, torch.int64), device=pairs.device)
    if pairs.ndim == 0 or pairs.shape[-1] != 2:
        raise ValueError(f"{name}: expected a last dimension of 2 (hi, lo), got shape {tuple(pairs.shape)}")
    rows = pairs.reshape(-1, 2)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def position_keys(streams: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Triton `position_keys_ref` in one launch: `streams [..., 2]` int32/int64 and `positions`
    (int32/int64, the shape of `streams[..., 0]`) give `[..., 2]` int64 keys."""
    flat = _rows_of_pairs("streams", streams)
    check_tensor("positions", positions, dtypes=(torch.int32, torch.int64), device=streams.device,
                 shape=tuple(streams.shape[:-1]))  # fmt: skip
    keys = torch.empty(flat.shape, dtype=torch.int64, device=streams.device)
    n = flat.shape[0]
    if n:
        _position_keys_kernel[(triton.cdiv(n, KEYS_PER_PROGRAM),)](flat, positions.reshape(-1).contiguous(), keys, n,
                                                                    flat.stride(0), BLOCK=KEYS_PER_PROGRAM)  # fmt: skip
    return keys.view(*streams.shape)


def keyed_uniform(keys: torch.Tensor) -> torch.Tensor:
    """Triton `keyed_uniform_ref(keys)` (index 0) in one launch: `keys [..., 2]` int32/int64 give the
    float32 uniforms, shape `keys[..., 0]`."""
    flat = _rows_of_pairs("keys", keys)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=keys.device)
    n = flat.shape[0]
    if n:
        _keyed_uniform_kernel[(triton.cdiv(n, KEYS_PER_PROGRAM),)](flat, out, n, flat.stride(0), BLOCK=KEYS_PER_PROGRAM)
    return out.view(*keys.shape[:-1])


def vocabulary_splits(num_rows: int, vocab: int, programs_per_sm: int, device: torch.device) -> tuple[int, int, int]:
    """`(block, split_size, num_splits)` of a row-wise pass over `[num_rows, vocab]`: each row's vocabulary
    in splits of whole blocks, as many as bring rows x splits to `programs_per_sm` per SM (0: one split)."""
    block = vocabulary_block(vocab)
    num_blocks = triton.cdiv(vocab, block)
    wanted = triton.cdiv(programs_per_sm * num_sms(device), num_rows)
    split_size = triton.cdiv(num_blocks, max(1, min(num_blocks, wanted))) * block
    return block, split_size, triton.cdiv(vocab, split_size)


def vocabulary_block(vocab: int) -> int:
    """Vocabulary entries a row-wise pass loads at once (a split is a whole number of them)."""
    return min(MAX_VOCAB_BLOCK, triton.next_power_of_2(vocab))


def splits_block(vocab: int) -> int:
    """The compile-time width over a row's splits (`BLOCK_S` of the kernels that fold them): a power of 2
    that holds the most splits `vocabulary_splits` gives the vocabulary (one per block). It depends on the
    vocabulary alone, not on the rows: an iteration with new row counts (a batch's ramp and tail) would
    otherwise compile those kernels again in the middle of decoding (the fold: 0.11 s in a 256 x 2048 run,
    docs/measurements.md 25)."""
    return triton.next_power_of_2(triton.cdiv(vocab, vocabulary_block(vocab)))


STATS_WIDTHS = (2, 3)  # columns of `softmax_stats` (temperature alone) and of `truncation_stats` (top-k / top-p)


def _check_stats(name: str, stats: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor | None:
    if stats is None:
        return None
    check_tensor(name, stats, ndim=2, dtypes=(torch.float32,), device=device)
    if stats.shape[0] != rows or stats.shape[1] not in STATS_WIDTHS:
        raise ValueError(f"{name}: expected shape ({rows}, 2) or ({rows}, 3), got {tuple(stats.shape)}")
    return stats.contiguous()


def keyed_sample(
    probs: torch.Tensor, keys: torch.Tensor, stats: torch.Tensor | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """Triton `keyed_sample_ref`.

    A few hundred rows would leave most of the GPU idle at one program per row (a draft iteration's
    rows over a 150K vocabulary), so each row's vocabulary is split over enough programs to fill the
    device; a second launch keeps each row's best split (the earliest on ties, so the token is the
    reference's: the first index of the maximum). A vocabulary of more than one block always takes
    the split launches, one split a row too (many rows): which kernels run depends on the vocabulary,
    not on the rows, so no row count compiles a variant in the middle of decoding.

    Args:
        probs: `[num_rows, vocab]` fp16/bf16/fp32 unnormalised probabilities (>= 0), unit stride over vocab;
            with `stats`, the rows' logits instead.
        keys: `[num_rows, 2]` int32/int64, each row's key (high word, low word) as bit patterns.
        stats: None, or `[num_rows, 2]` float32 `tempered_softmax.softmax_stats(probs, temperature)`: the rows
            are then `softmax(probs / temperature)`, read from the logits (`stats_probability`: the tokens
            are those of `keyed_sample(tempered_softmax(probs, temperature), keys)`, to the bit); or `[num_rows,
            3]` `truncation_stats(probs, temperature, ...)`: the rows are `truncated_softmax`'s, the same way.
        temperature: with `stats`, the temperature they were computed at.
    Returns:
        `[num_rows]` int64 tokens.
    """
    check_tensor("probs", probs, ndim=2, dtypes=HALF_AND_FLOAT, device=probs.device)
    check_tensor("keys", keys, dtypes=(torch.int32, torch.int64), device=probs.device, shape=(probs.shape[0], 2))
    stats = _check_stats("stats", stats, probs.shape[0], probs.device)
    return _race(probs, keys, None, stats, None, temperature)


def keyed_sample_residual(
    probs: torch.Tensor,
    rows: torch.Tensor,
    store: torch.Tensor,
    store_rows: torch.Tensor,
    keys: torch.Tensor,
    stats: torch.Tensor | None = None,
    store_stats: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Triton `keyed_sample_residual_ref`: one token per draw from `max(probs[rows[r]] - store[store_rows[r]],
    0)` (nothing subtracted where `store_rows[r]` is -1), or from `probs[rows[r]]` where that is zero
    everywhere, with `keyed_sample`'s noise; the rows are read in place (no gathered copies).

    Args:
        probs: `[n, vocab]` fp16/bf16/fp32 (>= 0), unit stride over vocab; with `stats`, logits.
        rows: `[num_rows]` int32/int64 rows of `probs`, each in [0, n).
        store: `[m, vocab]` fp16/bf16/fp32 (>= 0), unit stride over vocab; with `stats`, logits.
        store_rows: `[num_rows]` int32/int64 rows of `store`, each in [-1, m).
        keys: `[num_rows, 2]` int32/int64, each draw's key.
        stats, store_stats: None (probabilities), or both, of one kind: `[n, 2]` and `[m, 2]` float32
            `softmax_stats` of `probs` and of `store` at `temperature`, or `[n, 3]` and `[m, 3]`
            `truncation_stats` (as `keyed_sample`).
    Returns:
        `[num_rows]` int64 tokens.
    """
    check_tensor("probs", probs, ndim=2, dtypes=HALF_AND_FLOAT, device=probs.device)
    check_tensor("rows", rows, ndim=1, dtypes=(torch.int32, torch.int64), device=probs.device)
    num_rows, vocab = rows.shape[0], probs.shape[1]
    check_tensor("store", store, ndim=2, dtypes=HALF_AND_FLOAT, device=probs.device, shape=(None, vocab))
    check_tensor("store_rows", store_rows, dtypes=(torch.int32, torch.int64), device=probs.device, shape=(num_rows,))
    check_tensor("keys", keys, dtypes=(torch.int32, torch.int64), device=probs.device, shape=(num_rows, 2))
    if (stats is None) != (store_stats is None):
        raise ValueError("stats, store_stats: expected both (probs and store hold logits) or neither")
    stats = _check_stats("stats", stats, probs.shape[0], probs.device)
    store_stats = _check_stats("store_stats", store_stats, store.shape[0], probs.device)
    if stats is not None and stats.shape[1] != store_stats.shape[1]:
        raise ValueError(f"stats, store_stats: expected one kind (the same columns), got {stats.shape[1]} and "
                         f"{store_stats.shape[1]}")  # fmt: skip
    store = store if store.stride(1) == 1 else store.contiguous()
    return _race(probs, keys, (rows.contiguous(), store, store_rows.contiguous()), stats, store_stats, temperature)


def _race(probs: torch.Tensor, keys: torch.Tensor, residual: tuple | None, stats: torch.Tensor | None,
          store_stats: torch.Tensor | None, temperature: float) -> torch.Tensor:  # fmt: skip
    """The exponential race of `keyed_sample` over `keys`' rows: `residual` (rows, store, store_rows)
    reads each draw's row of `probs` and subtracts its store row; None: row r of `probs` as it is.
    `stats` (and `store_stats` with `residual`): the rows are logits."""
    num_rows, vocab = keys.shape[0], probs.shape[1]
    out = torch.empty(num_rows, dtype=torch.long, device=probs.device)
    if num_rows == 0:
        return out
    if stats is not None and not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    probs = probs if probs.stride(1) == 1 else probs.contiguous()
    keys = keys if keys.stride(1) == 1 else keys.contiguous()
    rows, store, store_rows = residual if residual is not None else (out, probs, out)
    from_logits = stats is not None
    width = stats.shape[1] if from_logits else STATS_WIDTHS[0]
    stats = stats if from_logits else probs  # unread without FROM_LOGITS
    store_stats = store_stats if store_stats is not None else stats
    block, split_size, num_splits = vocabulary_splits(num_rows, vocab, SAMPLE_PROGRAMS_PER_SM, probs.device)
    warps = 4 if block >= 1024 else 1
    common = dict(BLOCK_V=block, RESIDUAL=residual is not None, FROM_LOGITS=from_logits, STATS_WIDTH=width,
                  num_warps=warps)  # fmt: skip
    strides = (probs.stride(0), keys.stride(0), store.stride(0), float(temperature))
    if block >= vocab:  # one block: one split whatever the rows
        _keyed_sample_kernel[(num_rows, 1)](
            probs, keys, out, out, rows, store, store_rows, out, out, stats, store_stats, vocab, split_size, *strides,
            SPLIT=False, **common,
        )  # fmt: skip
        return out
    best = torch.empty(num_rows, num_splits, dtype=torch.float32, device=probs.device)
    index = torch.empty(num_rows, num_splits, dtype=torch.long, device=probs.device)
    fallback_best, fallback_index = (torch.empty_like(best), torch.empty_like(index)) if residual else (best, index)
    _keyed_sample_kernel[(num_rows, num_splits)](
        probs, keys, index, best, rows, store, store_rows, fallback_index, fallback_best, stats, store_stats, vocab,
        split_size, *strides, SPLIT=True, **common,
    )  # fmt: skip
    _fold_splits_kernel[(num_rows,)](best, index, out, fallback_best, fallback_index, num_splits,
                                     BLOCK_S=splits_block(vocab), RESIDUAL=residual is not None)  # fmt: skip
    return out


@triton.jit(do_not_specialize=["n"])
def _probabilities_at_kernel(
    values_ptr,  # [num_rows, vocab] probabilities, or logits (FROM_LOGITS)
    stats_ptr,  # [num_rows, STATS_WIDTH] fp32 (FROM_LOGITS)
    rows_ptr,  # [n] int64
    tokens_ptr,  # [n] int64
    out_ptr,  # [n] fp32
    n,
    stride_row,
    temperature,
    BLOCK: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
    STATS_WIDTH: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    row = tl.load(rows_ptr + offs, mask=mask, other=0).to(tl.int64)
    token = tl.load(tokens_ptr + offs, mask=mask, other=0).to(tl.int64)
    x = tl.load(values_ptr + row * stride_row + token, mask=mask, other=0.0).to(tl.float32)
    if FROM_LOGITS:
        row_max, inv_sum, threshold = load_stats(stats_ptr, row, mask, STATS_WIDTH)
        x = stats_probability(x, temperature, row_max, inv_sum, threshold, STATS_WIDTH)
    tl.store(out_ptr + offs, x, mask=mask)


def probabilities_at(
    values: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    stats: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Triton `probabilities_at_ref` in one launch: the probability of `tokens[i]` in row `rows[i]` of
    `values` (probabilities, or with `stats` logits read as `keyed_sample` reads them, to the bit), float32,
    the shape of `rows`: the acceptance test's p and q of every draft.

    Args:
        values: `[num_rows, vocab]` fp16/bf16/fp32, unit stride over the vocabulary.
        rows, tokens: int32/int64 of one shape, `rows` in [0, num_rows), `tokens` in [0, vocab).
        stats: None, or `[num_rows, 2]` float32 `softmax_stats(values, temperature)`, or `[num_rows, 3]`
            `truncation_stats`.
    """
    check_tensor("values", values, ndim=2, dtypes=HALF_AND_FLOAT, device=values.device)
    check_tensor("rows", rows, dtypes=(torch.int32, torch.int64), device=values.device)
    check_tensor("tokens", tokens, dtypes=(torch.int32, torch.int64), device=values.device, shape=tuple(rows.shape))
    stats = _check_stats("stats", stats, values.shape[0], values.device)
    if stats is not None and not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    if values.stride(1) != 1:
        raise ValueError(f"values: expected a unit-stride last dimension, got strides {values.stride()}")
    out = torch.empty(rows.shape, dtype=torch.float32, device=values.device)
    n = out.numel()
    if n:
        _probabilities_at_kernel[(triton.cdiv(n, KEYS_PER_PROGRAM),)](
            values, stats if stats is not None else values, rows.reshape(-1).contiguous(),
            tokens.reshape(-1).contiguous(), out, n, values.stride(0), float(temperature), BLOCK=KEYS_PER_PROGRAM,
            FROM_LOGITS=stats is not None, STATS_WIDTH=stats.shape[1] if stats is not None else STATS_WIDTHS[0],
        )  # fmt: skip
    return out


def accept_drafts_ref(
    p: torch.Tensor,  # [v, k] float32: the target's probability of each drafted token
    q: torch.Tensor,  # [v, k] float32: the draft's
    accept_keys: torch.Tensor,  # [v, k, 2] int32/int64: each acceptance test's key (`keyed_uniform_ref`)
    num_drafts: torch.Tensor,  # [v] int32/int64
    draft_rows: torch.Tensor,  # [v, k] int64: each draft's row of the drafts' store
    target_keys: torch.Tensor,  # [v, k + 1, 2] int32/int64: the key of each verification position's draw
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference (and CPU backend) of `accept_drafts`: `sampling.rejection_test` with the uniforms of
    `accept_keys`, and what the recovered or bonus token's draw (`keyed_sample_residual`) reads: `(accepted
    [v], target_rows [v]` (row `r * (k + 1) + accepted` of the verifications' distributions), `store_rows [v]`
    (-1: nothing to subtract), `keys [v, 2]` (the draw's key, `target_keys[r, accepted]`)), all int64."""
    v, k = p.shape
    accepted, store_rows = rejection_test(p, q, keyed_uniform_ref(accept_keys), num_drafts, draft_rows)
    rows = torch.arange(v, device=p.device)
    return accepted, rows * (k + 1) + accepted, store_rows, target_keys[rows, accepted].long()


@triton.jit(do_not_specialize=["num_rows"])
def _accept_drafts_kernel(
    p_ptr,  # [num_rows, K] fp32
    q_ptr,  # [num_rows, K] fp32
    accept_keys_ptr,  # [num_rows, K, 2] int32/int64
    num_drafts_ptr,  # [num_rows] int32/int64
    draft_rows_ptr,  # [num_rows, K] int64
    target_keys_ptr,  # [num_rows, K + 1, 2] int32/int64
    accepted_ptr,  # [num_rows] int64 (out)
    target_rows_ptr,  # [num_rows] int64 (out)
    store_rows_ptr,  # [num_rows] int64 (out)
    keys_ptr,  # [num_rows, 2] int64 (out)
    num_rows,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_ok = rows < num_rows
    drafts = tl.arange(0, BLOCK_K)
    mask = row_ok[:, None] & (drafts < K)[None, :]
    at = rows[:, None] * K + drafts[None, :]
    p = tl.load(p_ptr + at, mask=mask, other=0.0)
    q = tl.load(q_ptr + at, mask=mask, other=0.0)
    key_hi = tl.load(accept_keys_ptr + at * 2, mask=mask, other=0).to(tl.uint32)
    key_lo = tl.load(accept_keys_ptr + at * 2 + 1, mask=mask, other=0).to(tl.uint32)
    uniform = keyed_uniform_of(key_hi, key_lo, tl.zeros_like(key_hi))  # keyed_uniform's (index 0)
    num_drafts = tl.load(num_drafts_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    keep = (uniform * q < p) & (drafts[None, :] < num_drafts[:, None]) & mask
    # the first draft that fails (K where all pass): the cumulative product's sum of the reference
    accepted = tl.minimum(tl.min(tl.where(keep, BLOCK_K, drafts[None, :]), axis=1), K).to(tl.int64)
    rejected = accepted < num_drafts
    first_failed = tl.load(draft_rows_ptr + rows * K + tl.minimum(accepted, K - 1), mask=row_ok, other=0)
    store_row = tl.where(rejected, first_failed.to(tl.int64), -1)
    target_row = rows * (K + 1) + accepted
    draw_hi = tl.load(target_keys_ptr + target_row * 2, mask=row_ok, other=0).to(tl.int64)
    draw_lo = tl.load(target_keys_ptr + target_row * 2 + 1, mask=row_ok, other=0).to(tl.int64)
    tl.store(accepted_ptr + rows, accepted, mask=row_ok)
    tl.store(target_rows_ptr + rows, target_row, mask=row_ok)
    tl.store(store_rows_ptr + rows, store_row, mask=row_ok)
    tl.store(keys_ptr + rows * 2, draw_hi, mask=row_ok)
    tl.store(keys_ptr + rows * 2 + 1, draw_lo, mask=row_ok)


ACCEPT_ROWS_PER_PROGRAM = 16


def accept_drafts(
    p: torch.Tensor, q: torch.Tensor, accept_keys: torch.Tensor, num_drafts: torch.Tensor, draft_rows: torch.Tensor,
    target_keys: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Triton `accept_drafts_ref` in one launch (its torch ops are ~16 small kernels an iteration): the
    verifications' acceptance tests, with their uniforms hashed from `accept_keys` as `keyed_uniform`
    does, and the rows and key of each recovered or bonus token's draw.

    Args:
        p, q: `[v, k]` float32, the target's and the draft's probability of each drafted token.
        accept_keys: `[v, k, 2]` int32/int64 keys of the acceptance tests.
        num_drafts: `[v]` int32/int64, each row's drafts (<= k).
        draft_rows: `[v, k]` int32/int64 rows of the drafts' store.
        target_keys: `[v, k + 1, 2]` int32/int64 keys of the draws at each verification position.

    Returns:
        `(accepted, target_rows, store_rows, keys)`: `[v]`, `[v]`, `[v]` and `[v, 2]`, int64.
    """
    check_tensor("p", p, ndim=2, dtypes=(torch.float32,), device=p.device)
    v, k = p.shape
    device = p.device
    check_tensor("q", q, dtypes=(torch.float32,), device=device, shape=(v, k))
    check_tensor("accept_keys", accept_keys, dtypes=(torch.int32, torch.int64), device=device, shape=(v, k, 2))
    check_tensor("num_drafts", num_drafts, dtypes=(torch.int32, torch.int64), device=device, shape=(v,))
    check_tensor("draft_rows", draft_rows, dtypes=(torch.int32, torch.int64), device=device, shape=(v, k))
    check_tensor("target_keys", target_keys, dtypes=(torch.int32, torch.int64), device=device, shape=(v, k + 1, 2))
    if k == 0:
        raise ValueError("accept_drafts: expected at least one draft a row (k >= 1), got k = 0")
    accepted, target_rows, store_rows = (torch.empty(v, dtype=torch.int64, device=device) for _ in range(3))
    keys = torch.empty((v, 2), dtype=torch.int64, device=device)
    if v:
        _accept_drafts_kernel[(triton.cdiv(v, ACCEPT_ROWS_PER_PROGRAM),)](
            p.contiguous(), q.contiguous(), accept_keys.contiguous(), num_drafts.contiguous(), draft_rows.contiguous(),
            target_keys.contiguous(), accepted, target_rows, store_rows, keys, v, K=k,
            BLOCK_K=triton.next_power_of_2(k), BLOCK_ROWS=ACCEPT_ROWS_PER_PROGRAM,
        )  # fmt: skip
    return accepted, target_rows, store_rows, keys
