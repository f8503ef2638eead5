"""tempered_softmax: the sampling distributions of an iteration's logits rows, `softmax(logits / T)`
in float32, straight from the model's logits (bf16 on the GPU).

Why: sampling with temperature alone (transformers' `TemperatureLogitsWarper`; min-length processors
allowed, `LogitsPipeline.fused_temperature`) went through three full passes over `[rows, vocab]` float32 (the float copy of the logits, the division, the
softmax): ~0.67 ms of an 8 ms SparseSpec iteration at 256 requests (500 logits rows x 152K vocabulary,
docs/measurements.md 15). Here they are one read of the logits for the row statistics and one read
plus the write of the probabilities.

`tempered_softmax_ref` (the torch backend, and what the engine ran before): `softmax(logits.float() /
temperature)`, exactly transformers' processor then `torch.softmax`. Triton: a row's vocabulary is
split over several programs when the rows alone would not fill the device. Launches with grids fixed
by the shapes (CUDA-graph safe):
- `_softmax_partials_kernel`: each (row, split) program's running maximum and its sum of
  `exp(x - max)` over its split;
- `_softmax_stats_kernel`: each row's partials folded into its maximum and inverse sum
  (`softmax_stats`);
- `_softmax_write_kernel`: `exp(x - max) / sum` over each split (`keyed_sample.stats_probability`).

The engine stops at the stats: its sampler, acceptance and drafts' store read the probabilities they
need from the model's logits and a few numbers a row (`stats_probability`, the same bits as the
written probabilities), so the float32 `[rows, vocab]` matrix is never written: at 256 requests (~500
rows x 152K) that was 300 MB written, then the one-token rows' 140 MB read by the sampler and copied
again into the drafts' store (which now keeps the drafts' logits, half the bytes, and stats).

`truncation_stats` (`LogitsPipeline.fused_truncation`: temperature -> top-k -> top-p, the models' own
sampling configs) takes the same pass around one `torch.topk`: the candidates give the row's maximum
and the k-th logit, `_truncated_partials_kernel` sums top-k's softmax over every token at or above the
k-th (ties beyond the k included), and top-p's cut is found among the candidates; a row's stats get a
third column, the smallest kept logit, below which every reader reads 0. `truncated_softmax` writes
those probabilities out (the ablation, `runner.SAMPLE_FROM_LOGITS = 0`, on either backend). transformers' top-p
sorts every row's whole vocabulary: at 256 rows x 8K contexts a SparseSpec iteration took 21.88 ms
through the processors, 15.51 ms with a torch-only version of this path, 13.46 ms with the written
Triton one (H200, docs/measurements.md 17).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_sparsespec.kernels._checks import HALF_AND_FLOAT, check_tensor
from hf_sparsespec.kernels.keyed_sample import (
    STATS_WIDTHS,
    load_stats,
    probabilities_ref,
    splits_block,
    stats_probability,
    vocabulary_splits,
)

SOFTMAX_PROGRAMS_PER_SM = 8  # rows x splits per SM the split aims at
# Values per chunk whose maximum ranks it in `largest_values` (0: one `torch.topk` over the whole row).
# `torch.topk` over a 151,936-entry row selects by radix, one pass over the rows per 8-bit digit: for 484
# rows on the H100, k = 20 / 50, 0.66 ms over bf16 logits and 1.04 over float32 scores; through chunks of
# 256, 0.26 / 0.31 and 0.29 / 0.37 ms (chunks of 64 and 128: 0.29-0.49 ms; docs/measurements.md 39). At
# 1-121 rows chunks of 128 time faster alone, but a 64-request iteration took the same with either
# (3.65 against 3.63 ms; one `torch.topk` 3.91; docs/measurements.md 41): one width for every row count.
TOPK_CHUNK = 256
_LOG2E = tl.constexpr(1.4426950408889634)


def tempered_softmax_ref(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`[rows, vocab]` float32 probabilities of `logits / temperature` (transformers' order of ops)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def softmax_stats_ref(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`[rows, 2]` float32: each row's maximum of `logits / temperature` (0 where it is -inf) and the
    inverse of its sum of `exp(logits / temperature - maximum)`."""
    scores = logits.float() / temperature
    row_max = scores.amax(dim=-1)
    row_max = torch.where(row_max == float("-inf"), 0.0, row_max)
    return torch.stack([row_max, 1.0 / torch.exp(scores - row_max[:, None]).sum(dim=-1)], dim=-1)


def top_p_cut(
    head: torch.Tensor, head_weights: torch.Tensor, top_k_norm: torch.Tensor, top_p: float, min_tokens_to_keep: int
) -> torch.Tensor:
    """Top-p's threshold among the top-k candidates: `head [rows, k]` their values, descending (equal
    values are one tie group), `head_weights` their unnormalised top-k probabilities, `top_k_norm
    [rows, 1]` top-k's normaliser (ties beyond the k included). A candidate is kept iff the probability
    strictly above its value is < top_p (transformers' rule, tie groups kept whole), the first
    `min_tokens_to_keep` always; returns `[rows, 1]`, the smallest kept value."""
    # mass strictly above each candidate: the exclusive prefix sum at the first candidate of its value
    above = torch.cumsum(head_weights, dim=-1) - head_weights
    negated = -head  # ascending, as searchsorted wants
    above = above.gather(1, torch.searchsorted(negated, negated, side="left")) / top_k_norm
    keep = above < top_p
    keep[:, : min(min_tokens_to_keep, keep.shape[1])] = True
    return torch.where(keep, head, float("inf")).amin(dim=-1, keepdim=True)


def truncation_stats_ref(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float = 1.0, min_tokens_to_keep: int = 1
) -> torch.Tensor:
    """`[rows, 3]` float32: each row's maximum of `logits / temperature`, the inverse of the kept tokens'
    sum of `exp(logits / T - maximum)` and the smallest kept logit, after transformers' temperature ->
    `TopKLogitsWarper` -> `TopPLogitsWarper` (see `truncated_softmax_ref`). Tokens are kept by comparing
    their logits with that threshold (raw logits, as the Triton kernels)."""
    logits = logits.float()
    scores = logits / temperature if temperature != 1.0 else logits  # as TemperatureLogitsWarper (absent at 1.0)
    head_logits = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values  # [rows, k], descending
    head = head_logits / temperature if temperature != 1.0 else head_logits
    best, kth = head[:, :1], head_logits[:, -1:]
    weights = torch.exp(scores - best).masked_fill_(logits < kth, 0.0)  # top-k's softmax, unnormalised
    threshold, norm = kth, weights.sum(dim=-1, keepdim=True)
    if top_p < 1.0:
        threshold = top_p_cut(head_logits, torch.exp(head - best), norm, top_p, min_tokens_to_keep)
        norm = weights.masked_fill_(logits < threshold, 0.0).sum(dim=-1, keepdim=True)
    return torch.cat([best, 1.0 / norm, threshold], dim=1)


def truncated_softmax_ref(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float = 1.0, min_tokens_to_keep: int = 1
) -> torch.Tensor:
    """transformers' temperature -> `TopKLogitsWarper` -> `TopPLogitsWarper` -> softmax on `logits
    [rows, vocab]` (any float dtype, the history processors applied), in float32, without sorting the
    vocabulary (`LogitsPipeline.fused_truncation` says when the engine may use it): `softmax(logits / T)`
    over the tokens at or above each row's smallest kept logit (`truncation_stats_ref`).

    - Top-k keeps every token at or above the k-th largest logit, ties included (as transformers).
    - Top-p: transformers sorts all scores ascending and drops the tokens whose cumulative probability
      is <= 1 - top_p, i.e. keeps a token iff the probability of the tokens above it is < top_p. Only
      the top-k candidates can be kept, so that mass is summed over the k candidates (sorted by
      `torch.topk`), tokens of equal score sharing the mass strictly above them.
    - The same distribution up to float rounding. Three cases can differ:
      - a token whose mass above lies within rounding of top_p (our sum runs from the top,
        transformers' cumulative sum from the bottom);
      - equal scores straddling the top-p boundary: transformers' unstable sort keeps an arbitrary part
        of them, this keeps all;
      - float32 logits that the division by T rounds onto one score: transformers compares the scores,
        this the logits (bf16 and fp16 logits never round together).

    One `torch.topk` over the vocabulary and a few elementwise passes, no host syncs (graph-safe);
    transformers' top-p sorts the whole vocabulary of every row."""
    return probabilities_ref(logits, truncation_stats_ref(logits, temperature, top_k, top_p, min_tokens_to_keep),
                             temperature)  # fmt: skip


@triton.jit
def _softmax_partials_kernel(
    logits_ptr,  # [num_rows, vocab]
    max_ptr,  # [num_rows, num_splits] fp32
    sum_ptr,  # [num_rows, num_splits] fp32
    vocab,
    split_size,
    stride_row,
    temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs = tl.arange(0, BLOCK_V)
    first = split * split_size
    last = tl.minimum(first + split_size, vocab)
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    for start in range(first, last, BLOCK_V):
        index = start + offs
        x = tl.load(logits_ptr + row * stride_row + index, mask=index < last, other=float("-inf")).to(tl.float32)
        x = x / temperature
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # a split of -inf only (masked tokens) keeps max -inf and sum 0: no inf - inf
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp2((running_max - safe_max) * _LOG2E) + tl.sum(
            tl.exp2((x - safe_max) * _LOG2E), axis=0
        )
        running_max = new_max
    tl.store(max_ptr + row * num_splits + split, running_max)
    tl.store(sum_ptr + row * num_splits + split, running_sum)


@triton.jit(do_not_specialize=["num_splits"])
def _softmax_stats_kernel(
    max_ptr,  # [num_rows, num_splits] fp32
    sum_ptr,  # [num_rows, num_splits] fp32
    stats_ptr,  # [num_rows, 2] fp32 out: (row maximum, 0 where it is -inf; 1 / sum of exp(x - maximum))
    num_splits,
    stride_stats_row,
    BLOCK_S: tl.constexpr,  # splits_block(vocab): >= num_splits
):
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    valid = splits < num_splits
    maxima = tl.load(max_ptr + row * num_splits + splits, mask=valid, other=float("-inf"))
    sums = tl.load(sum_ptr + row * num_splits + splits, mask=valid, other=0.0)
    row_max = tl.max(maxima, axis=0)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    weights = tl.where(maxima == float("-inf"), 0.0, tl.exp2((maxima - safe_max) * _LOG2E))
    tl.store(stats_ptr + row * stride_stats_row, safe_max)
    tl.store(stats_ptr + row * stride_stats_row + 1, 1.0 / tl.sum(sums * weights, axis=0))


@triton.jit
def _softmax_write_kernel(
    logits_ptr,  # [num_rows, vocab]
    stats_ptr,  # [num_rows, STATS_WIDTH] fp32 (softmax_stats or truncation_stats)
    probs_ptr,  # [num_rows, vocab] fp32
    vocab,
    split_size,
    stride_row,
    stride_probs_row,
    temperature,
    BLOCK_V: tl.constexpr,
    STATS_WIDTH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row_max, inv_sum, threshold = load_stats(stats_ptr, row, row >= 0, STATS_WIDTH)
    offs = tl.arange(0, BLOCK_V)
    first = split * split_size
    last = tl.minimum(first + split_size, vocab)
    for start in range(first, last, BLOCK_V):
        index = start + offs
        mask = index < last
        x = tl.load(logits_ptr + row * stride_row + index, mask=mask, other=float("-inf")).to(tl.float32)
        p = stats_probability(x, temperature, row_max, inv_sum, threshold, STATS_WIDTH)
        tl.store(probs_ptr + row * stride_probs_row + index, p, mask=mask)


def softmax_stats(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Triton `softmax_stats_ref`: each row's `(maximum of logits / T, 1 / sum of exp(logits / T -
    maximum))`, `[num_rows, 2]` float32, from one read of the logits (two launches with grids fixed by
    the shapes). With them a kernel reads any probability of the row straight from the logits
    (`tempered_probability`), bit for bit what `tempered_softmax` writes.

    Args:
        logits: `[num_rows, vocab]` fp16/bf16/fp32, unit stride over the vocabulary.
        temperature: a float > 0.
    """
    check_tensor("logits", logits, ndim=2, dtypes=HALF_AND_FLOAT, device=logits.device)
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    num_rows, vocab = logits.shape
    stats = torch.empty(num_rows, 2, dtype=torch.float32, device=logits.device)
    if num_rows == 0 or vocab == 0:
        return stats
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    block, split_size, num_splits = vocabulary_splits(num_rows, vocab, SOFTMAX_PROGRAMS_PER_SM, logits.device)
    maxima = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxima)
    warps = 4 if block >= 1024 else 1
    _softmax_partials_kernel[(num_rows, num_splits)](
        logits, maxima, sums, vocab, split_size, logits.stride(0), float(temperature), BLOCK_V=block, num_warps=warps,
    )  # fmt: skip
    _softmax_stats_kernel[(num_rows,)](maxima, sums, stats, num_splits, stats.stride(0), BLOCK_S=splits_block(vocab))
    return stats


def tempered_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Triton `tempered_softmax_ref`: `softmax_stats`, then one pass writing the probabilities.

    Args:
        logits: `[num_rows, vocab]` fp16/bf16/fp32, unit stride over the vocabulary.
        temperature: a float > 0.
    Returns:
        `[num_rows, vocab]` float32 probabilities.
    """
    return _write_probabilities(logits, softmax_stats(logits, temperature), temperature)


def _write_probabilities(logits: torch.Tensor, stats: torch.Tensor, temperature: float) -> torch.Tensor:
    """`[num_rows, vocab]` float32: every probability of the rows, as the samplers read them from `stats`."""
    num_rows, vocab = logits.shape
    probs = torch.empty(num_rows, vocab, dtype=torch.float32, device=logits.device)
    if num_rows == 0 or vocab == 0:
        return probs
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    assert stats.shape == (num_rows, stats.shape[1]) and stats.shape[1] in STATS_WIDTHS and stats.is_contiguous()
    block, split_size, num_splits = vocabulary_splits(num_rows, vocab, SOFTMAX_PROGRAMS_PER_SM, logits.device)
    _softmax_write_kernel[(num_rows, num_splits)](
        logits, stats, probs, vocab, split_size, logits.stride(0), probs.stride(0), float(temperature),
        BLOCK_V=block, STATS_WIDTH=stats.shape[1], num_warps=4 if block >= 1024 else 1,
    )  # fmt: skip
    return probs


@triton.jit
def _truncated_partials_kernel(
    logits_ptr,  # [num_rows, vocab]
    kth_ptr,  # [num_rows] fp32: the k-th largest logit (tokens at or above it survive top-k)
    best_ptr,  # [num_rows] fp32: the largest logit / temperature
    sum_ptr,  # [num_rows, num_splits] fp32
    vocab,
    split_size,
    stride_row,
    temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    kth = tl.load(kth_ptr + row)
    best = tl.load(best_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    first = split * split_size
    last = tl.minimum(first + split_size, vocab)
    total = tl.zeros([BLOCK_V], tl.float32)
    for start in range(first, last, BLOCK_V):
        index = start + offs
        x = tl.load(logits_ptr + row * stride_row + index, mask=index < last, other=float("-inf")).to(tl.float32)
        total += tl.where(x >= kth, tl.exp2((x / temperature - best) * _LOG2E), 0.0)
    tl.store(sum_ptr + row * tl.num_programs(1) + split, tl.sum(total, axis=0))


def largest_values(scores: torch.Tensor, k: int, chunk: int | None = None) -> torch.Tensor:
    """`torch.topk(scores, k, dim=-1).values` of `scores [rows, n]` (`[rows, k]`, descending), ranking
    the rows' chunks of `chunk` values (default `TOPK_CHUNK`) by their maxima first: one read of the
    rows (`amax` per chunk), a `torch.topk` over the `n / chunk` maxima, and one over the k best chunks
    and the remainder (the values past the last whole chunk), `k x chunk` values or so a row.

    The same values, ties included: every value of a chunk outside the k best is at most that chunk's
    maximum, so at most each of the k best chunks' maxima, which are k values of the candidates; it
    cannot displace any of their k largest. One `torch.topk` over the whole row when `chunk` is 0 or
    the candidates would be more than half of it. No host syncs (CUDA-graph safe)."""
    chunk = TOPK_CHUNK if chunk is None else chunk
    rows, n = scores.shape
    whole = n // chunk if chunk else 0
    if whole <= k or 2 * k * chunk > n:
        return torch.topk(scores, k, dim=-1).values
    body = scores[:, : whole * chunk].unflatten(1, (whole, chunk))  # a view, whatever the row stride
    best_chunks = torch.topk(body.amax(dim=-1), k, dim=-1).indices  # [rows, k]
    candidates = torch.gather(body, 1, best_chunks[:, :, None].expand(rows, k, chunk)).flatten(1)
    if whole * chunk < n:
        candidates = torch.cat([candidates, scores[:, whole * chunk :]], dim=1)
    return torch.topk(candidates, k, dim=-1).values


def truncation_stats(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float = 1.0, min_tokens_to_keep: int = 1
) -> torch.Tensor:
    """Triton `truncation_stats_ref`: each row's `(maximum of logits / T, 1 / the kept tokens' sum of
    exp(logits / T - maximum), smallest kept logit)`, `[num_rows, 3]` float32, after temperature -> top-k
    -> top-p. With them a kernel reads any probability of the row straight from the logits
    (`keyed_sample.stats_probability`), bit for bit what `truncated_softmax` writes.

    `largest_values` (one `torch.topk`, or the chunks' maxima first) finds each row's k best raw logits
    (the temperature does not reorder them); one pass sums top-k's softmax over every token at or above
    the k-th (ties beyond the k included); top-p's cut is found among the k candidates, as the reference
    does. Tokens are kept by comparing raw logits, so a float32 logit below the k-th that the division
    by T would round onto it stays out (the reference agrees; transformers keeps it); bf16 and fp16
    logits never round together. No host syncs (CUDA-graph safe).

    Args:
        logits: `[num_rows, vocab]` fp16/bf16/fp32, unit stride over the vocabulary.
        temperature: a float > 0. top_k: >= 1 (more than the vocabulary keeps it all).
        top_p: in [0, 1] (1.0: no top-p). min_tokens_to_keep: top-p keeps at least this many.
    """
    check_tensor("logits", logits, ndim=2, dtypes=HALF_AND_FLOAT, device=logits.device)
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k: expected an int >= 1, got {top_k!r}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p: expected a float in [0, 1], got {top_p!r}")
    num_rows, vocab = logits.shape
    if num_rows == 0 or vocab == 0:
        return torch.zeros(num_rows, 3, dtype=torch.float32, device=logits.device)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    temperature = float(temperature)
    head_logits = largest_values(logits, min(top_k, vocab)).float()  # [rows, k], descending
    head = head_logits / temperature if temperature != 1.0 else head_logits
    best, kth = head[:, 0].contiguous(), head_logits[:, -1].contiguous()
    block, split_size, num_splits = vocabulary_splits(num_rows, vocab, SOFTMAX_PROGRAMS_PER_SM, logits.device)
    sums = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
    _truncated_partials_kernel[(num_rows, num_splits)](
        logits, kth, best, sums, vocab, split_size, logits.stride(0), temperature, BLOCK_V=block,
        num_warps=4 if block >= 1024 else 1,
    )  # fmt: skip
    top_k_norm = sums.sum(dim=1)
    threshold, norm = kth, top_k_norm
    if top_p < 1.0:
        head_weights = torch.exp(head - best[:, None])
        threshold = top_p_cut(head_logits, head_weights, top_k_norm[:, None], top_p, min_tokens_to_keep)[:, 0]
        # a cut above the k-th keeps candidates only; at the k-th, every tie of it (the pass's sum)
        kept_norm = torch.where(head_logits >= threshold[:, None], head_weights, 0.0).sum(dim=-1)
        norm = torch.where(threshold > kth, kept_norm, top_k_norm)
    return torch.stack([best, 1.0 / norm, threshold], dim=1)


def truncated_softmax(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float = 1.0, min_tokens_to_keep: int = 1
) -> torch.Tensor:
    """Triton `truncated_softmax_ref`: temperature -> top-k -> top-p -> softmax, in float32, straight
    from the model's logits (bf16 on the GPU): `truncation_stats`, then one pass writing the probabilities
    of the tokens at or above each row's threshold.

    Args: as `truncation_stats`.
    Returns:
        `[num_rows, vocab]` float32 probabilities.
    """
    stats = truncation_stats(logits, temperature, top_k, top_p, min_tokens_to_keep)
    return _write_probabilities(logits, stats, float(temperature))
