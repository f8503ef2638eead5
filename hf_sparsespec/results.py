"""Deciding where a request stops (the results themselves are read by `runner.PendingResults`).

`StopChecker` owns where every request stops, and its statistics. The invariant: the tokens a request
keeps, and every call a stopping criterion receives, are exactly those of plain `generate`:

- eos and the length limit stop a request at once, per request (no tensors, no device work);
- custom stopping criteria (stop strings, max time, lm-eval's stop sequences, yours) are called the
  way `GenerationMixin._sample` calls them: once per generated position t = 1, 2, ..., with the whole
  batch `[batch, prompt width + t]` in its original row order, rows that have finished showing pad
  tokens (plain `generate` pads finished rows whenever an eos criterion is present; without one they
  keep generating until every row has stopped). A criterion may return a BoolTensor `[batch]` or a
  bool. Requests progress at different speeds (a cycle commits 1..k+1 tokens), so the criteria run at
  a *frontier*: position t is evaluated once every row still running at t has committed t tokens.
  A request that ran ahead of the position where the criteria stop it is truncated back to it, and
  its statistics are rebuilt from the cycles it kept (see `stats.py`).

Without custom criteria nothing here touches a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hf_sparsespec.scheduler import Request
from hf_sparsespec.stats import RequestStats


@dataclass
class _Row:
    """Stop bookkeeping of one request (one row of the batch)."""

    request: Request
    commits: list[tuple[int | None, int]] = field(default_factory=list)  # (drafted or None for prefill, kept)
    own_end: int | None = None  # length where eos or the length limit ended the request
    own_reason: str | None = None  # "eos" or "length"
    cleared: int | None = None  # length where plain generate marks the row finished
    final: int | None = None  # decided length of the output
    reason: str | None = None  # why it stops there


class StopChecker:
    """Stop rules of one `generate` call.

    Args:
        eos_token_ids: tokens that end a request (the eos token itself is kept, as `generate` does).
        criteria: further `StoppingCriteria` (stop strings, max time, custom); see the module docstring.
        device: where the criteria's `input_ids` live.
        batch: the requests in their batch row order, each with the same width of padding + prompt
            (needed when `criteria` is not empty).
        pad_token_id: the token finished rows show to the criteria.
        pad_finished_rows: whether finished rows are padded (plain `generate` does so iff one of its
            stopping criteria has an `eos_token_id`); if not, a row the criteria mark finished keeps
            generating until every row is finished, as in plain `generate`.
    """

    def __init__(
        self,
        eos_token_ids: set[int],
        criteria: Sequence = (),
        device: torch.device | str = "cpu",
        batch: Sequence[Request] = (),
        pad_token_id: int = 0,
        pad_finished_rows: bool = True,
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.criteria = list(criteria)
        self.device = torch.device(device)
        self.pad_token_id = pad_token_id
        self.pad_finished_rows = pad_finished_rows
        self._rows: dict[int, _Row] = {}  # id(request) -> its bookkeeping
        self._batch: list[_Row] = []
        self._history: torch.Tensor | None = None  # [batch, prompt width + frontier], what the criteria see
        self._frontier = 0  # generated positions the criteria have been called for
        self._stopped: list[tuple[Request, str]] = []
        if self.criteria:
            if not batch:
                raise ValueError("stopping criteria need the batch: expected its requests in row order, got none")
            widths = {len(r.padding) + len(r.prompt) for r in batch}
            if len(widths) != 1:
                raise ValueError(f"expected one padded prompt width for the batch, got {sorted(widths)}")
            self._batch = [self._row(request) for request in batch]
            self._history = torch.tensor([r.padding + r.prompt for r in batch], dtype=torch.long, device=self.device)

    def _row(self, request: Request) -> _Row:
        row = self._rows.get(id(request))
        if row is None:
            row = self._rows[id(request)] = _Row(request)
        return row

    # --- the engine's calls ----------------------------------------------------------------------
    def commit(self, request: Request, tokens: list[int], drafted: int | None = None) -> tuple[int, str | None]:
        """Append the tokens `request` committed (a cycle's accepted drafts and recovered/bonus token,
        `drafted` drafts verified; or the first token, `drafted=None`) up to its first stop, and record
        its statistics. Returns (kept, reason): how many of `tokens` the request keeps, and why it stops
        (None while it runs). Other requests the criteria stopped meanwhile are in `take_stopped()`."""
        start = len(request.generated)
        row = self._row(request) if self.criteria else None  # eos and the length limit alone: no frontier
        assert row is None or row.final is None, "a request the stopping criteria finished committed more tokens"
        kept, reason = self._own_stop(request, tokens)
        request.generated.extend(tokens[:kept])
        _record(request.stats, drafted, kept)
        if row is None:  # no commits kept for the frontier's truncation
            return kept, reason
        row.commits.append((drafted, kept))
        if reason is not None:
            row.own_end, row.own_reason = len(request.generated), reason
        self._advance()
        if row.final is not None:
            assert row.final > start, "the frontier stopped a request before tokens it had already kept"
            self._stopped = [(r, why) for r, why in self._stopped if r is not request]
            kept, reason = row.final - start, row.reason
        return kept, reason

    def _own_stop(self, request: Request, tokens: list[int]) -> tuple[int, str | None]:
        """(kept, reason) by the request's own rules: its tokens up to its first eos, at most up to its
        length limit (an eos at the limit's token is the reason)."""
        room = max(request.max_new_tokens - len(request.generated), 1)  # the last token it may append ends it
        kept, reason = (room, "length") if len(tokens) >= room else (len(tokens), None)
        for index in range(kept):
            if tokens[index] in self.eos_token_ids:
                return index + 1, "eos"
        return kept, reason

    def take_stopped(self) -> list[tuple[Request, str]]:
        """Requests (other than the one just committed) that the criteria stopped while they were still
        running, with the reason; the engine finishes them. Their tokens are already truncated."""
        stopped, self._stopped = self._stopped, []
        return stopped

    # --- the frontier ----------------------------------------------------------------------------
    def _advance(self) -> None:
        """Call the criteria for every position all running rows have reached."""
        while any(row.cleared is None for row in self._batch):
            t = self._frontier
            column = []
            for row in self._batch:
                generated = row.request.generated
                if row.cleared is not None and self.pad_finished_rows:
                    column.append(self.pad_token_id)
                elif len(generated) > t:
                    column.append(generated[t])
                else:
                    return  # this row has not committed position t yet
            column_tensor = torch.tensor(column, dtype=torch.long, device=self.device)
            self._history = torch.cat([self._history, column_tensor[:, None]], dim=1)
            done = torch.zeros(len(self._batch), dtype=torch.bool, device=self.device)
            for criterion in self.criteria:
                done = done | criterion(self._history, None)
            flags = done.tolist()
            self._frontier = t = t + 1
            for row, flag in zip(self._batch, flags):
                if row.cleared is None and (flag or row.own_end == t):
                    row.cleared = t
                    if self.pad_finished_rows:
                        self._decide(row, t)
        if not self.pad_finished_rows:  # the rows generated on until all were finished
            for row in self._batch:
                if row.final is None:
                    self._decide(row, self._frontier)

    def _decide(self, row: _Row, length: int) -> None:
        """Fix the row's output length; truncate tokens past it and rebuild its statistics."""
        request = row.request
        row.final = length
        if len(request.generated) > length:
            del request.generated[length:]
            row.commits = _truncated(row.commits, length)
            request.stats.reset()
            for drafted, kept in row.commits:
                _record(request.stats, drafted, kept)
        if row.own_end == length:
            row.reason = row.own_reason  # eos or length ended it, and the engine finishes it for that
            return
        row.reason = "stop_criteria"
        if request.finished:  # it ran on to its own end (eos, length) before the frontier got here
            request.finish_reason = row.reason
        else:
            self._stopped.append((request, row.reason))


def _record(stats: RequestStats, drafted: int | None, kept: int) -> None:
    stats.generated_tokens += kept
    if drafted is not None:
        stats.record_cycle(drafted=drafted, accepted=kept - 1)  # a cut cycle counts the drafts kept before the stop


def _truncated(commits: list[tuple[int | None, int]], length: int) -> list[tuple[int | None, int]]:
    kept_commits, total = [], 0
    for drafted, kept in commits:
        if total >= length:
            break
        kept_commits.append((drafted, min(kept, length - total)))
        total += kept_commits[-1][1]
    return kept_commits
