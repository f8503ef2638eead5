"""Logits processing, sampling and lossless acceptance, on the device.

Vocabulary: a *draft* token is sampled from the draft distribution (the processed logits of a sparse
step); the verification gives the *target* distribution at every draft position plus one. The
*accepted* drafts are the leading drafts kept; after a rejection the cycle commits a *recovered*
token sampled from norm(max(0, p_target - p_draft)); when every draft is accepted it commits a *bonus*
token sampled from the last target distribution (Leviathan et al., 2023). Under greedy decoding this
is exact match against the target argmax. Both distributions are *processed*: the logits processors
`generate` builds (temperature, top-k, top-p, repetition penalty, ...) run on draft and target rows
alike, each row seeing the exact token prefix it has in plain decoding.

Noise: the engine's random draws are keyed, not streamed. Each draw belongs to one request, one token
position and one purpose (a draft token, a target token: recovered, bonus or first, or the acceptance
test of a draft), and its noise is a hash of that key and of the seed drawn from torch's generator when
the engine starts (`sample_keys`; the position, shifted on the device for a speculative draft, is folded
in by the device step: `kernels.keyed_sample`). So a request's samples do not depend on
which requests share its iterations (admission order, batch size, offload and restore). Reusing a key
is safe: a position is drafted again only after a rejection before it, and the noise of positions past
the first rejection never influenced what was committed (so, given the committed tokens, it is still
fresh); every committed token is drawn exactly as rejection sampling prescribes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import transformers.generation.logits_process as lp
from transformers import LogitsProcessorList


def _classes(*names: str) -> tuple[type, ...]:
    return tuple(getattr(lp, name) for name in names if hasattr(lp, name))


# Processors that read only the scores: applied once to all rows.
ROW_INDEPENDENT_PROCESSORS = _classes(
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "TopHLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
    "SuppressTokensLogitsProcessor",
)
# Processors that read each row's token history (or its length) row by row: applied per prefix length
# with the exact prefix every draft and verify position has.
PREFIX_DEPENDENT_PROCESSORS = _classes(
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor",
    "SequenceBiasLogitsProcessor",
    "NoBadWordsLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "ExponentialDecayLengthPenalty",
    "SuppressTokensAtBeginLogitsProcessor",
    "WatermarkLogitsProcessor",
)


# Row-wise processors whose code is free of host syncs (no boolean indexing, no `.item()`, no
# validating distributions): an iteration that only uses these can be captured in a CUDA graph.
GRAPH_SAFE_PROCESSORS = _classes(
    "TemperatureLogitsWarper",
    "TopKLogitsWarper",
    "TopPLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "LogitNormalization",
    "SuppressTokensLogitsProcessor",
)


def classify_processor(processor: object) -> str:
    """`"row"`, `"min_length"`, `"repetition"` or `"prefix"`; raises NotImplementedError for processors
    SparseSpec cannot run exactly.

    A custom processor opts in by setting `sparsespec_kind = "row"` (reads only the scores) or
    `"prefix"` (reads each row's history row by row, keeps no state between calls).
    """
    declared = getattr(processor, "sparsespec_kind", None)
    if declared in ("row", "prefix"):
        return declared
    if type(processor) in (lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor):
        return "min_length"
    if type(processor) is lp.RepetitionPenaltyLogitsProcessor:
        return "repetition"
    if isinstance(processor, ROW_INDEPENDENT_PROCESSORS):
        return "row"
    if isinstance(processor, PREFIX_DEPENDENT_PROCESSORS):
        return "prefix"
    raise NotImplementedError(
        f"hf_sparsespec cannot apply the logits processor {type(processor).__name__}: it runs processors "
        "on draft and verification positions of many requests at once, each with its own history, so it "
        "must know that a processor treats rows independently and keeps no state between calls. "
        "Supported: " + ", ".join(c.__name__ for c in ROW_INDEPENDENT_PROCESSORS + PREFIX_DEPENDENT_PROCESSORS)
        + ". A custom processor can declare `sparsespec_kind = 'row'` or `'prefix'`."
    )


@dataclass
class LogitsRows:
    """Which history each logits row of an iteration conditions on (device tensors, plus host copies
    of the real rows for the processors that run group by group)."""

    slot: torch.Tensor  # [num_logits] int64, the request's row of `token_buffer`
    prefix_len: torch.Tensor  # [num_logits] int64, history length the row conditions on
    params: torch.Tensor  # [num_params, num_logits] int64, per-request processor parameters
    host: dict | None = None  # "slot", "prefix_len", "index" (numpy) of the real rows


class LogitsPipeline:
    """One `LogitsProcessorList`, applied to every logits row of an iteration at once.

    Each row sees the exact history it has in plain decoding (its request's padding, prompt and
    tokens up to the row's position, drafts included). Processors of kind `"row"` run once on all
    rows; min-length processors and the repetition penalty are vectorised with per-row tensors (the
    threshold or the ignored prompt length of each row's request, `request_params`); other history
    processors (`"prefix"`) run per group of equal prefix length (host syncs: no CUDA graph then).
    """

    def __init__(self, processors: LogitsProcessorList | list) -> None:
        self.steps = [(processor, classify_processor(processor)) for processor in processors]
        self.param_index: dict[int, int] = {}
        for index, (_, kind) in enumerate(self.steps):
            if kind in ("min_length", "repetition"):
                self.param_index[index] = len(self.param_index)
        self._eos_ids_of: dict[int, torch.Tensor] = {}

    @property
    def num_params(self) -> int:
        return len(self.param_index)

    @property
    def graph_safe(self) -> bool:
        """Whether the whole pipeline runs without host syncs (CUDA-graph capturable)."""
        return not self.host_synchronising()

    def host_synchronising(self) -> list[str]:
        """Class names of the processors that may synchronise with the host (they keep CUDA graphs off)."""
        return [
            type(p).__name__
            for p, kind in self.steps
            if not (kind in ("min_length", "repetition") or (kind == "row" and isinstance(p, GRAPH_SAFE_PROCESSORS)))
        ]

    @property
    def fused_temperature(self) -> float | None:
        """The temperature when sampling may fuse the pipeline into its softmax (`kernels.tempered_softmax`):
        at most one `TemperatureLogitsWarper` (1.0 without one) besides min-length processors, which only
        ban eos and run first, in place on the model's logits (`ban_eos_in_place`: a ban commutes with
        the division); None for any other processor."""
        temperatures = [p for p, _ in self.steps if type(p) is lp.TemperatureLogitsWarper]
        others = [kind for p, kind in self.steps if type(p) is not lp.TemperatureLogitsWarper]
        if len(temperatures) > 1 or any(kind != "min_length" for kind in others):
            return None
        return float(temperatures[0].temperature) if temperatures else 1.0

    @property
    def fused_truncation(self) -> Truncation | None:
        """How sampling may skip transformers' sort of the whole vocabulary (the backend's `truncated_softmax`):
        for a pipeline of history steps (min-length, repetition penalty; applied first, as usual), then at most
        one each of temperature, top-k and top-p in transformers' order, top-k present (at most
        `MAX_FUSED_TOP_K`), both truncations filtering to -inf. None for any other pipeline."""
        warpers = {lp.TemperatureLogitsWarper: "temperature", lp.TopKLogitsWarper: "top_k", lp.TopPLogitsWarper: "top_p"}
        kinds = [warpers.get(type(p), kind) for p, kind in self.steps]
        first = next((i for i, kind in enumerate(kinds) if kind in warpers.values()), len(kinds))
        head, tail = kinds[:first], kinds[first:]
        if any(kind not in ("min_length", "repetition") for kind in head) or "top_k" not in tail:
            return None
        if tail not in (["top_k"], ["top_k", "top_p"], ["temperature", "top_k"], ["temperature", "top_k", "top_p"]):
            return None
        found = {kinds[i]: self.steps[i][0] for i in range(first, len(kinds))}
        top_k, top_p = found["top_k"], found.get("top_p")
        if any(p.filter_value != float("-inf") for p in (top_k, top_p) if p is not None):
            return None
        if top_k.top_k > MAX_FUSED_TOP_K:
            return None
        temperature = float(found["temperature"].temperature) if "temperature" in found else 1.0
        return Truncation(first, temperature, int(top_k.top_k), float(top_p.top_p) if top_p else 1.0,
                          int(top_p.min_tokens_to_keep) if top_p else 1, set(head) <= {"min_length"})  # fmt: skip

    def ban_eos_in_place(self, logits: torch.Tensor, rows: LogitsRows) -> torch.Tensor:
        """The min-length steps alone, in place on `logits [num_logits, vocab]` (any float dtype)."""
        for index, (_, kind) in enumerate(self.steps):
            if kind == "min_length":
                logits.index_copy_(1, *self._eos_ban(index, logits, rows))
        return logits

    def _eos_ban(self, index: int, scores: torch.Tensor, rows: LogitsRows) -> tuple[torch.Tensor, torch.Tensor]:
        """(eos columns, their new values): -inf in the rows still below the step's minimum length."""
        banned = rows.prefix_len < rows.params[self.param_index[index]]  # [num_logits]
        eos = self._eos_ids(index, scores.device)
        return eos, scores[:, eos].masked_fill(banned[:, None], float("-inf"))

    def request_params(self, request) -> tuple[int, ...]:
        """Per-request integers of the vectorised processors: the history length below which a
        min-length processor bans eos, the prompt length the repetition penalty ignores."""
        params = []
        for index in self.param_index:
            processor = self.steps[index][0]
            if type(processor) is lp.MinLengthLogitsProcessor:
                params.append(processor.min_length)
            elif type(processor) is lp.MinNewTokensLengthLogitsProcessor:
                params.append(request.history_offset + request.prompt_len + processor.min_new_tokens)
            else:
                ignore = getattr(processor, "prompt_ignore_length", None)
                if isinstance(ignore, torch.Tensor):
                    ignore = int(ignore.flatten()[request.batch_row])
                params.append(int(ignore or 0))
        return tuple(params)

    def __call__(
        self, scores: torch.Tensor, token_buffer: torch.Tensor, rows: LogitsRows, num_steps: int | None = None
    ) -> torch.Tensor:
        """`scores [num_logits, vocab]` float32 -> processed scores (same shape), by every step or the
        first `num_steps`. The vectorised history steps (min-length, repetition penalty) write `scores`
        in place: pass a tensor the pipeline may overwrite (the engine's float copy of the logits)."""
        empty = scores.new_empty((scores.shape[0], 0), dtype=torch.long)
        for index, (processor, kind) in enumerate(self.steps[:num_steps]):
            if kind == "row":
                scores = processor(empty, scores)
            elif kind == "min_length":  # only the eos columns change: touch only them
                scores = scores.index_copy_(1, *self._eos_ban(index, scores, rows))
            elif kind == "repetition":
                ignore = rows.params[self.param_index[index]]
                scores = _repetition_penalty_(processor.penalty, scores, token_buffer, rows, ignore)
            else:
                scores = _by_prefix_length(processor, scores, token_buffer, rows)
        return scores

    def _eos_ids(self, index: int, device: torch.device) -> torch.Tensor:
        if index not in self._eos_ids_of:
            eos = torch.as_tensor(self.steps[index][0].eos_token_id).flatten()
            self._eos_ids_of[index] = eos.unique().to(device=device, dtype=torch.long)
        return self._eos_ids_of[index]


# Largest top-k the truncated path takes (its candidates' tie search is k log k per row; transformers'
# default is 50, model cards use 20-100).
MAX_FUSED_TOP_K = 1024


@dataclass(frozen=True)
class Truncation:
    """`LogitsPipeline.fused_truncation`: the pipeline's first `num_history_steps` steps (min-length,
    repetition penalty), then temperature -> top-k -> top-p (1.0: none)."""

    num_history_steps: int
    temperature: float
    top_k: int
    top_p: float
    min_tokens_to_keep: int  # top-p's
    bans_only: bool  # the history steps only ban eos (`ban_eos_in_place` on the model's logits will do)


def _repetition_penalty_(penalty: float, scores, token_buffer, rows: LogitsRows, ignore: torch.Tensor) -> torch.Tensor:
    """transformers' repetition penalty on every row at once, in place on `scores`: the tokens of each
    row's history `[ignore, prefix_len)` are penalised. A position outside that span writes what the
    row's last position inside writes (the same token, the same penalised value: a repeated index of
    `scatter_` is harmless when its values agree), or, in a row with none inside, token 0's own score:
    no copy of the `[rows, vocab]` scores (a spare column would take two, ~0.6 GB at 256 requests)."""
    history = token_buffer[rows.slot]  # [num_logits, history_width]
    position = torch.arange(history.shape[1], device=scores.device)[None, :]
    prefix_len = rows.prefix_len[:, None]
    inside = (position < prefix_len) & (position >= ignore[:, None])
    any_inside = prefix_len > ignore[:, None]  # [num_logits, 1]
    last = history.gather(1, (prefix_len - 1).clamp(min=0))  # the last position's token (inside when any is)
    tokens = torch.where(inside, history, torch.where(any_inside, last, 0))
    score = scores.gather(1, tokens)
    penalised = torch.where(score < 0, score * penalty, score / penalty)
    return scores.scatter_(1, tokens, torch.where(any_inside, penalised, score))


def _by_prefix_length(processor, scores: torch.Tensor, token_buffer: torch.Tensor, rows: LogitsRows) -> torch.Tensor:
    """A history processor applied per group of rows with equal prefix length (each group one call
    with its `[rows, length]` histories)."""
    host = rows.host
    processed = scores.clone()
    device = scores.device
    for length in np.unique(host["prefix_len"]):
        members = host["prefix_len"] == length
        index = torch.from_numpy(host["index"][members]).to(device)
        slots = torch.from_numpy(host["slot"][members]).to(device)
        processed[index] = processor(token_buffer[slots, : int(length)], scores[index])
    return processed


@dataclass(frozen=True)
class Distributions:
    """Sampling distributions of rows, as the backend's samplers read them: `values [n, vocab]` are the
    probabilities themselves (`stats` None), or logits whose distributions are `softmax(values /
    temperature)`, read through each row's `stats [n, 2]` (`kernels.tempered_softmax.softmax_stats`)."""

    values: torch.Tensor
    stats: torch.Tensor | None = None
    temperature: float = 1.0

    def __getitem__(self, rows: slice) -> Distributions:
        stats = self.stats[rows] if self.stats is not None else None
        return Distributions(self.values[rows], stats, self.temperature)

    @property
    def from_logits(self) -> bool:
        return self.stats is not None


# Purposes of a keyed draw (`sample_keys`)
DRAFT_NOISE, TARGET_NOISE, ACCEPT_NOISE = 1, 2, 3
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arrays, wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def stream_keys(seed: int, request_ids, purposes) -> np.ndarray:
    """`[n, 2]` int32 stream words (high, low, as bit patterns): a splitmix64 hash of (seed, purpose,
    request id) (arrays broadcast). The draws of one stream differ by position (`position_keys`)."""
    request_ids, purposes = np.broadcast_arrays(np.asarray(request_ids, np.int64), np.asarray(purposes, np.int64))
    with np.errstate(over="ignore"):
        key = _mix64(np.uint64(seed & (2**64 - 1)) ^ (purposes.astype(np.uint64) * _GOLDEN))
        key = _mix64(key ^ request_ids.astype(np.uint64))
    words = np.stack([key >> np.uint64(32), key & np.uint64(0xFFFFFFFF)], axis=-1).astype(np.uint32)
    return words.view(np.int32).reshape(-1, 2)


def _hash32(x: np.ndarray) -> np.ndarray:
    """lowbias32 on uint32 arrays (`kernels.keyed_sample.hash32_ref` on the host)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x21F0AAAD)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x735A2D97)
        return x ^ (x >> np.uint32(15))


def position_keys(streams: np.ndarray, positions) -> np.ndarray:
    """`[n, 2]` int32 keys of the draws at `positions` of `streams` (host twin of
    `kernels.keyed_sample.position_keys_ref`, which the device step runs, or its Triton twin)."""
    words = np.asarray(streams, np.int32).reshape(-1, 2).view(np.uint32)
    p = np.broadcast_to(np.asarray(positions, np.int64), words.shape[:1]).astype(np.uint32)
    hi = _hash32(words[:, 0] ^ p)
    lo = _hash32(words[:, 1] ^ _hash32(p ^ np.uint32(0x9E3779B9)))
    return np.stack([hi, lo], axis=-1).view(np.int32)


def sample_keys(seed: int, request_ids, positions, purposes) -> np.ndarray:
    """`[n, 2]` int32 keys of n draws: (seed, purpose, request id) and the history position of the drawn
    token (arrays broadcast); see `kernels.keyed_sample`."""
    request_ids, positions, purposes = np.broadcast_arrays(
        np.asarray(request_ids, np.int64), np.asarray(positions, np.int64), np.asarray(purposes, np.int64)
    )
    return position_keys(stream_keys(seed, request_ids.ravel(), purposes.ravel()), positions.ravel())


def sample_from(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of (possibly unnormalised) probabilities `[n, vocab]`: argmax of p / q with
    q ~ Exp(1), exactly how `torch.multinomial` draws one sample, without its host-side validity check
    (so it can be captured in a CUDA graph)."""
    return probs.div(torch.empty_like(probs).exponential_()).argmax(dim=-1)


def accept_greedy(
    draft_tokens: torch.Tensor,  # [num_rows, k] int64
    num_drafts: torch.Tensor,  # [num_rows] int64, m <= k drafts per row
    target_tokens: torch.Tensor,  # [num_rows, k + 1] int64, target argmax at each position
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact-match acceptance: `(accepted [num_rows], next_token [num_rows])`."""
    k = draft_tokens.shape[1]
    valid = torch.arange(k, device=draft_tokens.device)[None, :] < num_drafts[:, None]
    match = (draft_tokens == target_tokens[:, :k]) & valid
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    next_token = target_tokens.gather(1, accepted[:, None]).squeeze(1)
    return accepted, next_token


def rejection_test(
    p: torch.Tensor,  # [num_rows, k] float32: the target's probability of each drafted token
    q: torch.Tensor,  # [num_rows, k] float32: the draft's
    uniform: torch.Tensor,  # [num_rows, k] float32 in (0, 1)
    num_drafts: torch.Tensor,  # [num_rows] int
    draft_rows: torch.Tensor,  # [num_rows, k] int64: each draft's row of the drafts' store
) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance tests of speculative sampling: draft `i` passes with probability min(1, p / q)
    (`uniform * q < p`), and a row accepts its drafts up to the first that fails (at most `num_drafts`).
    Returns `(accepted [num_rows] int64, store_rows [num_rows] int64)`: the store row of the first
    rejected draft, whose distribution the recovered token's residual subtracts, or -1 where every
    draft passed (a bonus token). The backends' `accept_drafts` is this in one launch."""
    k = p.shape[1]
    valid = torch.arange(k, device=p.device)[None, :] < num_drafts[:, None]
    keep = (uniform * q < p) & valid
    accepted = keep.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(p.shape[0], device=p.device)
    store_rows = torch.where(accepted < num_drafts, draft_rows[rows, accepted.clamp(max=k - 1)], -1)
    return accepted, store_rows


def accept_sampled(
    draft_tokens: torch.Tensor,  # [num_rows, k] int64
    num_drafts: torch.Tensor,  # [num_rows] int64
    target_probs: torch.Tensor,  # [num_rows, k + 1, vocab] float32 (rows past m + 1 unused)
    draft_probs: torch.Tensor,  # [num_rows, k, vocab] float32 (rows past m unused), or a store (draft_rows)
    uniform: torch.Tensor | None = None,  # [num_rows, k] float32 in (0, 1); None: torch.rand
    sample: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    draft_rows: torch.Tensor | None = None,  # [num_rows, k] int64 rows of a store `draft_probs [N, vocab]`
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling: `(accepted [num_rows], next_token [num_rows])`; the committed
    tokens are `draft_tokens[:accepted]` then `next_token`, distributed exactly as target sampling.

    `uniform` are the acceptance tests' draws; `sample(probs [num_rows, vocab], accepted [num_rows])`
    draws the recovered or bonus token (at draft index `accepted`); by default both come from torch's
    generator (`sample_from`). With `draft_rows`, the draft distributions are read where they are
    kept (the engine's store): only the drafted tokens' probabilities and the one row each
    rejection needs, not a copy of every row. This is the torch reference of the engine's acceptance,
    which runs `rejection_test` in one launch (`backend.accept_drafts`) and draws the recovered or bonus
    token from `max(p - q, 0)` read in place (`backend.keyed_sample_residual`)."""
    num_rows, k = draft_tokens.shape
    device = draft_tokens.device
    sample = sample if sample is not None else (lambda probs, accepted: sample_from(probs))
    if k == 0:  # autoregressive rows: sample the one target distribution
        accepted = torch.zeros(num_rows, dtype=torch.long, device=device)
        return accepted, sample(target_probs[:, 0], accepted)
    if draft_rows is None:
        store = draft_probs.reshape(num_rows * k, -1)
        draft_rows = torch.arange(num_rows * k, device=device).view(num_rows, k)
    else:
        store = draft_probs
    p = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)
    q = store[draft_rows, draft_tokens]
    if uniform is None:
        uniform = torch.rand(p.shape, device=device, dtype=p.dtype)
    accepted, store_rows = rejection_test(p, q, uniform, num_drafts, draft_rows)
    rows = torch.arange(num_rows, device=device)
    p_next = target_probs[rows, accepted]  # [num_rows, vocab]
    q_next = store[store_rows.clamp(min=0)] * (store_rows >= 0)[:, None]
    residual = (p_next - q_next).clamp(min=0)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_next)
    return accepted, sample(residual, accepted)
