"""Logits processing, sampling and lossless acceptance, on the device.

Vocabulary: a *draft* token is sampled from the draft distribution (the processed logits of a sparse
step); the verification gives the *target* distribution at every draft position plus one. The
*accepted* drafts are the leading drafts kept; after a rejection the cycle commits a *recovered*
token sampled from norm(max(0, p_target - p_draft)); when every draft is accepted it commits a *bonus*
token sampled from the last target distribution (Leviathan et al., 2023). Under greedy decoding this
is exact match against the target argmax. Both distributions are *processed*: the logits processors
`generate` builds (temperature, top-k, top-p, repetition penalty, ...) run on draft and target rows
alike, each row seeing the exact token prefix it has in plain decoding.
"""

from __future__ import annotations

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


def _min_length_threshold(processor) -> int | None:
    """History length below which a min-length processor bans eos (these read only the length)."""
    if type(processor) is lp.MinLengthLogitsProcessor:
        return processor.min_length
    if type(processor) is lp.MinNewTokensLengthLogitsProcessor:
        return processor.prompt_length_to_skip + processor.min_new_tokens
    return None


def classify_processor(processor: object) -> str:
    """`"row"`, `"length"` or `"prefix"`; raises NotImplementedError for processors SparseSpec cannot
    run exactly.

    A custom processor opts in by setting `sparsespec_kind = "row"` (reads only the scores) or
    `"prefix"` (reads each row's history row by row, keeps no state between calls).
    """
    declared = getattr(processor, "sparsespec_kind", None)
    if declared in ("row", "prefix"):
        return declared
    if _min_length_threshold(processor) is not None:
        return "length"
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


class LogitsPipeline:
    """One `LogitsProcessorList`, applied to packed logits rows with each row's exact prefix."""

    def __init__(self, processors: LogitsProcessorList | list) -> None:
        self.steps = [(processor, classify_processor(processor)) for processor in processors]
        self.needs_prefix = any(kind == "prefix" for _, kind in self.steps)

    def __call__(
        self,
        scores: torch.Tensor,  # [num_rows, vocab] float32
        token_buffer: torch.Tensor,  # [num_slots, history_width] int64, every request's token history
        row_slots: list[int],  # per row: the request's slot in `token_buffer`
        row_prefix_lens: list[int],  # per row: history length the row's logits condition on
        row_batch_index: list[int],  # per row: the request's row in the batch the processors were built for
    ) -> torch.Tensor:
        if not self.steps:
            return scores
        groups = self._prefix_groups(token_buffer, row_slots, row_prefix_lens, row_batch_index) if self.needs_prefix else []
        empty = scores.new_empty((scores.shape[0], 0), dtype=torch.long)
        lengths = None
        for processor, kind in self.steps:
            if kind == "row":
                scores = processor(empty, scores)
                continue
            if kind == "length":  # vectorised: ban eos on the rows whose history is still too short
                if lengths is None:
                    lengths = torch.tensor(row_prefix_lens, device=scores.device)
                banned = lengths < _min_length_threshold(processor)  # [num_rows]
                eos = torch.zeros(scores.shape[1], dtype=torch.bool, device=scores.device)
                eos[processor.eos_token_id.to(scores.device).flatten()] = True
                scores = scores.masked_fill(banned[:, None] & eos[None, :], float("-inf"))
                continue
            processed = scores.clone()
            for rows, prefixes, batch_index in groups:
                processed[rows] = _for_batch_rows(processor, batch_index)(prefixes, scores[rows])
            scores = processed
        return scores

    @staticmethod
    def _prefix_groups(token_buffer, row_slots, row_prefix_lens, row_batch_index) -> list[tuple]:
        by_length: dict[int, list[int]] = {}
        for row, length in enumerate(row_prefix_lens):
            by_length.setdefault(length, []).append(row)
        device = token_buffer.device
        groups = []
        for length, rows in by_length.items():
            slots = torch.tensor([row_slots[r] for r in rows], device=device)
            batch_index = torch.tensor([row_batch_index[r] for r in rows], device=device)
            groups.append((torch.tensor(rows, device=device), token_buffer[slots, :length], batch_index))
        return groups


def _for_batch_rows(processor, batch_index: torch.Tensor):
    """The processor as it applies to the given rows of the batch it was built for: processors that
    hold per-row state (the repetition penalty's per-row padding lengths, transformers >= 5.2x) get
    that state sliced to the rows at hand."""
    ignore = getattr(processor, "prompt_ignore_length", None)
    if isinstance(ignore, torch.Tensor) and isinstance(processor, lp.RepetitionPenaltyLogitsProcessor):
        return lp.RepetitionPenaltyLogitsProcessor(processor.penalty, prompt_ignore_length=ignore.to(batch_index.device)[batch_index])
    return processor


def sample_from(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of (possibly unnormalised) probabilities `[n, vocab]`, as `generate` samples."""
    return torch.multinomial(probs, num_samples=1).squeeze(1)


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


def accept_sampled(
    draft_tokens: torch.Tensor,  # [num_rows, k] int64
    num_drafts: torch.Tensor,  # [num_rows] int64
    target_probs: torch.Tensor,  # [num_rows, k + 1, vocab] float32 (rows past m + 1 unused)
    draft_probs: torch.Tensor,  # [num_rows, k, vocab] float32 (rows past m unused)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling: `(accepted [num_rows], next_token [num_rows])`; the committed
    tokens are `draft_tokens[:accepted]` then `next_token`, distributed exactly as target sampling."""
    num_rows, k = draft_tokens.shape
    device = draft_tokens.device
    valid = torch.arange(k, device=device)[None, :] < num_drafts[:, None]
    p = target_probs[:, :k].gather(2, draft_tokens[..., None]).squeeze(2)
    q = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2)
    uniform = torch.rand(p.shape, device=device, dtype=p.dtype)
    keep = (uniform * q < p) & valid  # accept with probability min(1, p / q)
    accepted = keep.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(num_rows, device=device)
    p_next = target_probs[rows, accepted]  # [num_rows, vocab]
    rejected = accepted < num_drafts
    q_next = draft_probs[rows, accepted.clamp(max=k - 1)] * rejected[:, None]
    residual = (p_next - q_next).clamp(min=0)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_next)
    return accepted, sample_from(residual)
