"""Selection policies of the acceptance study: which old keys a draft step attends, per (layer, KV head).

Vocabulary (the engine's, `hf_sparsespec/scheduler.py`): a cycle starts at position `t` (the last
committed token, no KV yet); the previous verification's block started at `recent_start`; keys
`recent_start <= j < t` (plus the cycle's own draft keys) are the *recent window*, always attended;
keys `j < recent_start` are *old* and attended only when the policy selects them. The budget `B` of a
cycle is the engine's `min(block_start, max(min_budget, ceil(budget_ratio * (block_start + k + 1))))`,
fixed at the verification that opened the cycle.

A policy owns a contiguous slice of the study's rows (its episodes) and answers, per layer:
- `after_verify(layer, view)`: the verification's exact attention probabilities, to prepare the
  next cycle (PillarAttn scores, candidate sets, budgets);
- `draft(layer, view)`: the old-key mask `[rows, kv_heads, N]` of this draft step and the extra key
  vectors it read besides K and V of the attended keys (page summaries, candidate keys), per row.

Invariant: a policy never looks at keys `j >= t` (the harness hands them over as -inf logits) and a
policy's mask only holds old keys. Bytes are counted by the harness from the masks, so unions and
overlaps are charged as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


def top_mask(scores: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the `budget` best entries of `scores [..., N]` (-inf = never), per leading index.

    `budget` broadcasts against `scores.shape[:-1]`; ties go to the lower position."""
    width = scores.shape[-1]
    most = int(budget.max()) if budget.numel() else 0
    mask = torch.zeros_like(scores, dtype=torch.bool)
    most = min(most, width)
    if most <= 0:
        return mask
    values, index = scores.topk(most, dim=-1, sorted=True)
    rank = torch.arange(most, device=scores.device)
    keep = (rank < budget.expand(scores.shape[:-1])[..., None]) & torch.isfinite(values)
    return mask.scatter_(-1, index, keep)


def quest_bound(query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of `q . k` over each page, max over the GQA group: `[r, kvh, pages]` from
    `query [r, kvh, group, d]` and the pages' elementwise key min/max `[kvh, pages, d]`."""
    q = query[:, :, :, None, :]
    return torch.maximum(q * key_min[None, :, None], q * key_max[None, :, None]).sum(-1).amax(dim=2)


POOLS = ("mean", "max", "headmax", "late")  # how PillarAttn's score pools a block's attention (VerifyView)
# also `split<keys>` and `running<keys>`: the mean as a verification attention split into key ranges
# of that size could accumulate it in one pass (`VerifyView.split_pooled`)
ONE_PASS_POOLS = ("split", "running")
KEY_BLOCK = 64  # keys per block of the attention kernel's inner loop (`running<keys>`)


def check_pool(pool: str) -> None:
    kind = next((k for k in ONE_PASS_POOLS if pool.startswith(k)), None)
    size = pool.removeprefix(kind) if kind else ""
    if pool not in POOLS and not (size.isdigit() and int(size) > 0):
        raise ValueError(f"pool: expected one of {POOLS} or split<keys> / running<keys>, got {pool!r}")


@dataclass
class VerifyView:
    """One layer of a verification pass, for the rows of one policy."""

    probs: torch.Tensor  # [r, kvh, group, Q, N] exact probabilities of the block's queries; 0 at j >= block start
    block_start: torch.Tensor  # [r] long, = the next cycle's recent_start; keys below it are old
    budget: torch.Tensor  # [r] long, B of the next cycle (engine rule, clamped to block_start)

    def pillar_scores(self, pool: str = "mean") -> torch.Tensor:
        """PillarAttn's score `[r, kvh, N]` from the block's queries and the GQA group's heads; -inf if
        not old. `pool`: `"mean"` over both (PillarAttn), `"max"` over both, `"headmax"` the mean over
        the queries then the max over the heads (a key one head needs is not diluted by the others),
        `"late"` a mean weighting query i of the block by i + 1 (the latest queries are the nearest
        to the next cycle's drafts), `"split<keys>"` / `"running<keys>"` the mean as `split_pooled`
        approximates it."""
        if pool == "mean":
            scores = self.probs.mean(dim=(2, 3))
        elif pool == "max":
            scores = self.probs.amax(dim=(2, 3))
        elif pool == "headmax":
            scores = self.probs.mean(dim=3).amax(dim=2)
        elif pool == "late":
            weight = torch.arange(1, self.probs.shape[3] + 1, device=self.probs.device, dtype=self.probs.dtype)
            scores = (self.probs * (weight / weight.sum())[:, None]).sum(dim=3).mean(dim=2)
        else:
            check_pool(pool)
            running = pool.startswith("running")
            scores = self.split_pooled(int(pool.removeprefix("running" if running else "split")), running)
        old = torch.arange(scores.shape[-1], device=scores.device)[None, :] < self.block_start[:, None]
        return scores.masked_fill(~old[:, None, :], float("-inf"))

    def split_pooled(self, size: int, running: bool = False) -> torch.Tensor:
        """PillarAttn's mean score `[r, kvh, N]` as the verification attention itself could accumulate it,
        without the second pass over the keys: a program attending keys `[s x size, (s + 1) x size)`
        knows only its own split's LSE, so it can sum each key's probability normalised within the
        split, per query head over the block's queries (a few floats per key). After the merge, the
        split's sums are weighted by the head's mean mass in the split (over the block's queries).
        Exact when a head's queries put equal mass in every split; the question is how much the
        selection it gives loses.

        `running`: what a single pass really has. A key's probability is known relative to the running
        maximum of its query's logits when its block of `KEY_BLOCK` keys is reached, not to the
        split's: the program sums `exp(s - running max)` per head, and the merge weights the split by
        the head's mean `exp(split max - lse)`. Keys of a block before a query's maximum come out too
        large."""
        probs = self.probs
        n = probs.shape[-1]
        num_splits = -(-n // size)
        split = torch.nn.functional.pad(probs, (0, num_splits * size - n)).unflatten(-1, (num_splits, size))
        if running:
            # log-probabilities are the logits less the row's LSE: the same maxima, shifted
            logp = torch.log(split)  # -inf where 0
            blocks = logp.unflatten(-1, (-1, KEY_BLOCK)) if size % KEY_BLOCK == 0 else logp[..., None, :]
            maxima = torch.cummax(blocks.amax(dim=-1), dim=-1).values  # running max at each block
            relative = torch.exp(blocks - maxima[..., None]).nan_to_num(0.0).flatten(-2)  # -inf - -inf: no key
            weight = torch.exp(maxima[..., -1:])  # exp(split max - lse): the merge knows it per query
        else:
            weight = split.sum(dim=-1, keepdim=True)  # [r, kvh, group, Q, splits, 1]: the split's mass
            relative = torch.where(weight > 0, split / weight.clamp_min(torch.finfo(probs.dtype).tiny), 0.0)
        weighted = relative * weight.mean(dim=3, keepdim=True)  # each head's mean over its queries
        return weighted.flatten(-2)[..., :n].mean(dim=(2, 3))


@dataclass
class DraftView:
    """One layer of a draft step, for the rows of one policy."""

    step: int  # draft step i in 0..k-1
    position: torch.Tensor  # [r] long, t + step: this query's position
    query: torch.Tensor  # [r, kvh, group, d]
    logits: torch.Tensor  # [r, kvh, group, N] scaled q.k over the text keys; -inf at j >= t
    draft_logits: torch.Tensor  # [r, kvh, group, i+1] over the cycle's own draft keys
    old: torch.Tensor  # [r, N] bool, j < recent_start
    recent: torch.Tensor  # [r, N] bool, recent_start <= j < t
    budget: torch.Tensor  # [r] long
    page_summaries: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # page_size -> ([kvh, pages, d] min, max)
    input_token: torch.Tensor  # [r] long, the token this query reads (x_t at step 0, then the last draft)
    text: torch.Tensor  # [N] long, the committed text (teacher forcing)

    def group_scores(self, allowed_old: torch.Tensor) -> torch.Tensor:
        """Group-mean softmax probabilities `[r, kvh, N]` of this query when it attends `allowed_old`
        (`[r, kvh, N]` bool) plus the recent window and its draft keys; -inf off `allowed_old`."""
        allowed = allowed_old | self.recent[:, None, :]
        logits = self.logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
        lse = torch.logsumexp(torch.cat([logits, self.draft_logits], dim=-1), dim=-1, keepdim=True)
        scores = torch.exp(logits - lse).mean(dim=2)
        return scores.masked_fill(~allowed_old, float("-inf"))


class Policy:
    """Base: a frozen selection made at each verification (`self.masks[layer]`), budget by the engine's rule.

    `local=w`: every draft also attends the w newest old keys (a local window before the recent window),
    and the selection's budget goes to the keys before them.

    `refresh=n`: only every n-th verification (the first one included) selects anew; in between the
    selection (and whatever else `after_verify` keeps) stays the last refresh's, and the drafts attend
    every key from that refresh's block start on as their recent window (as the engine would, to skip
    the scoring pass of n - 1 verifications in n). The harness calls `verified` / `verify_done` /
    `draft_keys`, which apply it around `after_verify` / `end_verify` / `draft`."""

    hindsight = False  # True: needs `probe` over the dense chain of each cycle before drafting
    carries_scores = True  # False: the policy does not select by `carried_scores` (`carry=` is refused)
    refreshable = True  # False: the policy selects at draft time (or keeps everything): `refresh=` is refused

    def __init__(self, name: str, min_budget: int, budget_ratio: float = 0.05, budget_scale: float = 1.0,
                 pool: str = "mean", carry: float = 0.0, refresh: float = 1, local: float = 0):  # fmt: skip
        check_pool(pool)
        if local != int(local) or local < 0:
            raise ValueError(f"local: expected an int >= 0, got {local}")
        if local and not self.carries_scores:
            raise ValueError(f"local: {type(self).__name__} does not select by PillarAttn's score")
        self.local = int(local)  # the newest old keys every draft attends besides its selection
        if not 0.0 <= carry < 1.0:
            raise ValueError(f"carry: expected 0 <= carry < 1, got {carry}")
        if carry and not self.carries_scores:
            raise ValueError(f"carry: {type(self).__name__} does not select by PillarAttn's score")
        if refresh != int(refresh) or refresh < 1:
            raise ValueError(f"refresh: expected an int >= 1, got {refresh}")
        if refresh > 1 and not self.refreshable:
            raise ValueError(f"refresh: {type(self).__name__} does not select at verification")
        self.refresh = int(refresh)
        self.num_verified = 0  # verifications seen (`verify_done`)
        self.window_start: torch.Tensor | None = None  # [r] block start of the last refreshing verification
        self.name, self.min_budget, self.budget_ratio, self.budget_scale = name, min_budget, budget_ratio, budget_scale
        # the study's min_budget (`--min-budgets`) this policy is compared at, against the PillarAttn of that
        # setting, even when its spec replaces the budget rule (`make_policy`)
        self.study_min_budget = min_budget
        self.pool, self.carry = pool, carry
        self.rows = slice(0, 0)
        self.masks: list[torch.Tensor | None] = []
        self.history: list[torch.Tensor | None] = []

    def bind(self, rows: slice, num_layers: int) -> None:
        self.rows, self.masks, self.history = rows, [None] * num_layers, [None] * num_layers
        self.num_verified, self.window_start = 0, None

    @property
    def refreshing(self) -> bool:
        """Whether the verification in progress (or the last one, while drafting) selects anew."""
        return self.num_verified % self.refresh == 0

    def verified(self, layer: int, view: VerifyView) -> None:
        """One layer of a verification: `after_verify` when it refreshes, else nothing."""
        if self.refreshing:
            self.window_start = view.block_start
            self.after_verify(layer, view)

    def verify_done(self) -> None:
        if self.refreshing:
            self.end_verify()
        self.num_verified += 1

    def draft_keys(self, layer: int, view: DraftView) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft`'s old-key mask, plus, after a verification that did not refresh, the old keys from
        the last refresh's block start on (the longer recent window such a cycle attends)."""
        mask, extra = self.draft(layer, view)
        j = torch.arange(mask.shape[-1], device=mask.device)[None, :]
        if self.local:  # the newest `local` old keys
            recent_start = view.old.sum(-1, keepdim=True)  # old keys are j < recent_start
            mask = mask | ((j >= recent_start - self.local) & view.old)[:, None, :]
        kept = self.window_start is not None and (self.num_verified - 1) % self.refresh != 0  # the last one did not refresh
        if kept:
            window = (j >= self.window_start[:, None]) & view.old
            mask = mask | window[:, None, :]
        return mask, extra

    def carried_scores(self, layer: int, view: VerifyView) -> torch.Tensor:
        """PillarAttn's score of this verification; with `carry = c > 0`, plus `c` times the previous
        verification's carried score (a key's attention decays by `c` per cycle instead of being
        forgotten; keys that were not old then start from this verification's score alone)."""
        scores = view.pillar_scores(self.pool)
        if self.local:  # the local window is attended anyway: the budget goes to keys before it
            j = torch.arange(scores.shape[-1], device=scores.device)[None, :]
            scores = scores.masked_fill((j >= view.block_start[:, None] - self.local)[:, None, :], float("-inf"))
        if self.carry > 0.0:
            previous = self.history[layer]
            if previous is not None:
                scores = scores + self.carry * torch.where(torch.isfinite(previous), previous, 0.0)
            self.history[layer] = scores
        return scores

    def budget(self, block_start: torch.Tensor, num_draft: int) -> torch.Tensor:
        """B of the cycle a verification starting at `block_start [r]` opens (engine rule, then scaled)."""
        context = (block_start + num_draft + 1).double()
        base = torch.clamp(torch.ceil(self.budget_ratio * context), min=self.min_budget)
        return torch.minimum(torch.round(base * self.budget_scale).long(), block_start)

    def after_verify(self, layer: int, view: VerifyView) -> None:
        self.masks[layer] = top_mask(self.carried_scores(layer, view), view.budget[:, None])

    def end_verify(self) -> None:
        """Called after every layer's `after_verify` of one verification pass."""

    def draft(self, layer: int, view: DraftView) -> tuple[torch.Tensor, torch.Tensor]:
        mask = self.masks[layer]
        if mask is None:  # before the first verification: nothing is old yet
            mask = torch.zeros_like(view.logits[:, :, 0], dtype=torch.bool)
        return mask & view.old[:, None, :], torch.zeros(mask.shape[0], device=mask.device)

    def describe(self) -> str:
        return self.name


class Dense(Policy):
    """Every old key (a harness check: must accept all k drafts under greedy)."""

    carries_scores = False
    refreshable = False

    def after_verify(self, layer: int, view: VerifyView) -> None:
        pass

    def draft(self, layer, view):
        mask = view.old[:, None, :].expand(-1, view.logits.shape[1], -1)
        return mask, torch.zeros(mask.shape[0], device=mask.device)


class Pillar(Policy):
    """PillarAttn as the engine does it: top-B by the last verification's attention, frozen for the cycle."""


class Streaming(Policy):
    """First `num_sink` keys plus the newest keys before the recent window, the same in every layer/head."""

    carries_scores = False

    def __init__(self, name, min_budget, budget_ratio=0.05, *, num_sink: int = 4, **common):
        super().__init__(name, min_budget, budget_ratio, **common)
        self.num_sink = num_sink

    def after_verify(self, layer, view):
        n = view.probs.shape[-1]
        j = torch.arange(n, device=view.probs.device)[None, :]
        sink = torch.clamp(view.budget, max=self.num_sink)
        newest = (j >= (view.block_start - view.budget + sink)[:, None]) & (j < view.block_start[:, None])
        self.masks[layer] = ((j < sink[:, None]) | newest)[:, None, :].expand(-1, view.probs.shape[1], -1)


class OracleStep(Policy):
    """Per-step oracle: top-B by this draft query's own exact attention (group mean), at every step and layer."""

    carries_scores = False
    refreshable = False

    def after_verify(self, layer, view):
        pass

    def draft(self, layer, view):
        old = view.old[:, None, :].expand(-1, view.logits.shape[1], -1)
        mask = top_mask(view.group_scores(old), view.budget[:, None])
        return mask, torch.zeros(mask.shape[0], device=mask.device)


class OracleFirst(OracleStep):
    """The prototype's `oracle_first`: the per-step oracle's set at draft step 0, frozen for the cycle."""

    def draft(self, layer, view):
        if view.step == 0:
            self.masks[layer], extra = super().draft(layer, view)
        return self.masks[layer], torch.zeros(view.logits.shape[0], device=view.logits.device)


class OracleFrozen(Policy):
    """Best frozen set with hindsight: top-B by the summed own attention of the cycle's k dense-chain
    draft queries (the greedy continuation the drafts must reproduce), chosen before drafting."""

    hindsight = True
    carries_scores = False
    refreshable = False

    def after_verify(self, layer, view):
        pass

    def probe(self, layer: int, view: DraftView) -> None:
        old = view.old[:, None, :].expand(-1, view.logits.shape[1], -1)
        scores = view.group_scores(old).clamp_min(0.0)
        self.masks[layer] = scores if view.step == 0 else self.masks[layer] + scores

    def end_probe(self, budget: torch.Tensor, old: torch.Tensor) -> None:
        for layer, scores in enumerate(self.masks):
            self.masks[layer] = top_mask(scores.masked_fill(~old[:, None, :], float("-inf")), budget[:, None])


class Quest(Policy):
    """PillarAttn's frozen set plus, at every draft step, the `extra * B` keys of the best whole pages by
    Quest's bound `sum_d max(q_d min_d, q_d max_d)` (max over the GQA group), from per-page key
    min/max summaries of the old pages. Reads every old page's two summary vectors per step.
    With `with_pillar=False`: pages only, `B` keys' worth of them (Quest itself)."""

    def __init__(self, name, min_budget, budget_ratio=0.05, *, extra: float = 0.25, page_size: int = 16,
                 with_pillar: bool = True, **common):  # fmt: skip
        super().__init__(name, min_budget, budget_ratio, **common)
        self.extra, self.page_size, self.with_pillar = extra, page_size, with_pillar

    def draft(self, layer, view):
        base, _ = super().draft(layer, view) if self.with_pillar else (None, None)
        bound = quest_bound(view.query, *view.page_summaries(self.page_size))
        num_pages = bound.shape[-1]
        full_pages = torch.div(view.old.sum(-1), self.page_size, rounding_mode="floor")  # [r] pages wholly old
        page_ok = torch.arange(num_pages, device=bound.device)[None, :] < full_pages[:, None]
        fraction = self.extra if self.with_pillar else 1.0
        pick = torch.minimum(torch.ceil(fraction * view.budget / self.page_size).long(), full_pages)
        pages = top_mask(bound.masked_fill(~page_ok[:, None, :], float("-inf")), pick[:, None])
        mask = pages.repeat_interleave(self.page_size, dim=-1)[..., : view.logits.shape[-1]]
        if mask.shape[-1] < view.logits.shape[-1]:
            mask = torch.nn.functional.pad(mask, (0, view.logits.shape[-1] - mask.shape[-1]))
        if base is not None:
            mask = mask | base
        summary_reads = 2.0 * full_pages.float() * view.logits.shape[1]  # min and max vectors, every KV head
        return mask & view.old[:, None, :], summary_reads

    def describe(self):
        return f"{self.name} (page {self.page_size}, +{self.extra:g}B)" if self.with_pillar else self.name


NO_OFFSET = -(2**30)  # an offset that moves no key (the engine's `moved_keys.NO_OFFSET`)


def diagonal_offsets(view: VerifyView, top: int, per_head: bool = True, confirm: int = 1) -> torch.Tensor:
    """`j - p` for the top-`top` keys j of every block query p: of every head of the GQA group, or of the
    group's mean (`per_head=False`, g times fewer offsets): `[r, kvh, m]`. `confirm=c > 1` keeps only
    offsets that at least c entries of the (row, KV head)'s list share (a diagonal several queries or
    heads followed); the others become `NO_OFFSET`."""
    r, kvh, _, q, _ = view.probs.shape
    probs = view.probs if per_head else view.probs.mean(dim=2, keepdim=True)
    keys = probs.topk(top, dim=-1).indices  # [r, kvh, g or 1, Q, top]
    position = view.block_start[:, None, None, None, None] + torch.arange(q, device=keys.device)[:, None]
    offsets = (keys - position).reshape(r, kvh, -1)
    if confirm > 1:
        shared = (offsets[..., :, None] == offsets[..., None, :]).sum(dim=-1)  # entries with the same offset
        offsets = offsets.masked_fill(shared < confirm, NO_OFFSET)
    return offsets


def moved_keys(offsets: torch.Tensor, position: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Mask `[r, kvh, N]` of the keys `position + offset` (those inside 0..N-1)."""
    target = position[:, None, None] + offsets
    valid = (target >= 0) & (target < num_keys)
    mask = torch.zeros(*offsets.shape[:2], num_keys, dtype=torch.bool, device=offsets.device)
    return mask.scatter_(-1, target.clamp(0, num_keys - 1), valid)


class Rerank(Policy):
    """At verification, the top `c * B` keys by PillarAttn's score become candidates (plus, with
    `diagonal=m`, the moved keys of `Diagonal` at each step); every draft step re-ranks the candidates
    by its own attention over them (exact q.k: reads the candidates' K) and attends the best B (reads V
    of those). Extra reads: K of the candidates not attended."""

    def __init__(self, name, min_budget, budget_ratio=0.05, *, candidates: float = 1.5, diagonal: int = 0, **common):
        super().__init__(name, min_budget, budget_ratio, **common)
        self.candidates, self.diagonal = candidates, diagonal
        self.offsets: list[torch.Tensor | None] = []

    def bind(self, rows, num_layers):
        super().bind(rows, num_layers)
        self.offsets = [None] * num_layers

    def after_verify(self, layer, view):
        size = torch.minimum(torch.round(self.candidates * view.budget).long(), view.block_start)
        self.masks[layer] = top_mask(self.carried_scores(layer, view), size[:, None])
        if self.diagonal:
            self.offsets[layer] = diagonal_offsets(view, self.diagonal)

    def draft(self, layer, view):
        cand = self.masks[layer]
        if cand is None:
            cand = torch.zeros_like(view.logits[:, :, 0], dtype=torch.bool)
        if self.offsets[layer] is not None:
            cand = cand | moved_keys(self.offsets[layer], view.position, cand.shape[-1])
        cand = cand & view.old[:, None, :]
        mask = top_mask(view.group_scores(cand), view.budget[:, None])
        extra = (cand.sum(-1) - mask.sum(-1)).sum(-1).float()  # K of the candidates left out, over KV heads
        return mask, extra

    def describe(self):
        return f"{self.name} (c={self.candidates:g}, diagonal top {self.diagonal}, {self.pool})"


class SharedBudget(Policy):
    """PillarAttn with the budget of a cycle shared across all layers and KV heads (same total L*kvh*B):
    `mode="mass"` keeps the globally best (head, key) pairs by PillarAttn's score (each head's scores
    are a probability mass, so this covers the most verified attention); `mode="entropy"` gives each head
    a budget proportional to exp(entropy) of its scores. Each head keeps at least `floor * B` keys and
    at most `cap * B` (the width of a fixed selected-index store)."""

    carries_scores = False

    def __init__(self, name, min_budget, budget_ratio=0.05, *, mode: str = "mass", floor: float = 0.25,
                 cap: float = 4.0, **common):  # fmt: skip
        super().__init__(name, min_budget, budget_ratio, **common)
        if mode not in ("mass", "entropy"):
            raise ValueError(f"mode: expected 'mass' or 'entropy', got {mode!r}")
        self.mode, self.floor, self.cap = mode, floor, cap
        self.scores: list[torch.Tensor] = []
        self.next_budget: torch.Tensor | None = None

    def after_verify(self, layer, view):
        if layer == 0:
            self.scores = []
        self.scores.append(view.pillar_scores(self.pool))
        self.next_budget = view.budget

    def end_verify(self):
        scores = torch.stack(self.scores, dim=1)  # [r, L, kvh, N]
        r, num_layers, kvh, n = scores.shape
        budget = self.next_budget
        available = torch.isfinite(scores).sum(-1)  # [r, L, kvh]
        low = torch.minimum(torch.ceil(self.floor * budget.double()).long()[:, None, None], available)
        high = torch.minimum(torch.ceil(self.cap * budget.double()).long()[:, None, None], available)
        total = (budget * num_layers * kvh)[:, None, None]
        if self.mode == "entropy":
            p = scores.clamp_min(0.0)
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
            entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
            weight = torch.exp(entropy)
            share = total * weight / weight.sum(dim=(1, 2), keepdim=True)
            for _ in range(4):  # water-filling: what the caps cut goes to the heads below their cap
                share = torch.minimum(torch.maximum(share, low), high)
                open_weight = weight * (share < high)
                left = (total - share.sum(dim=(1, 2), keepdim=True)).clamp_min(0)
                share = share + left * open_weight / open_weight.sum(dim=(1, 2), keepdim=True).clamp_min(1e-30)
            per_head = torch.minimum(torch.maximum(torch.round(share).long(), low), high)
            mask = top_mask(scores, per_head)
        else:
            floor_mask = top_mask(scores, low)
            rank_in_head = scores.argsort(dim=-1, descending=True).argsort(dim=-1)
            eligible = torch.isfinite(scores) & ~floor_mask & (rank_in_head < high[..., None])
            rest = (total[:, 0, 0] - low.sum(dim=(1, 2))).clamp_min(0)
            flat = scores.masked_fill(~eligible, float("-inf")).reshape(r, -1)
            mask = floor_mask | top_mask(flat, rest).view(r, num_layers, kvh, n)
        self.masks = list(mask.unbind(dim=1))

    def describe(self):
        return f"{self.name} ({self.mode}, floor {self.floor:g}B, cap {self.cap:g}B)"


class Diagonal(Policy):
    """PillarAttn plus, at draft step i, the keys the verification's queries attended *moved along the
    diagonal*: for each block query at position p with top-`top` keys j, the key `(t + i) + (j - p)`.
    Copy and induction heads attend a key that advances with the query; a frozen set points one cycle
    behind them. No extra reads besides the added keys (offsets come from the verification)."""

    def __init__(self, name, min_budget, budget_ratio=0.05, *, top: int = 1, per_head: bool = True, confirm: int = 1,
                 **common):  # fmt: skip
        super().__init__(name, min_budget, budget_ratio, **common)
        if confirm < 1:
            raise ValueError(f"confirm: expected an int >= 1, got {confirm}")
        self.top, self.per_head, self.confirm = top, per_head, confirm
        self.offsets: list[torch.Tensor | None] = []

    def bind(self, rows, num_layers):
        super().bind(rows, num_layers)
        self.offsets = [None] * num_layers

    def after_verify(self, layer, view):
        super().after_verify(layer, view)
        self.offsets[layer] = diagonal_offsets(view, self.top, self.per_head, self.confirm)

    def draft(self, layer, view):
        base, extra = super().draft(layer, view)
        if self.offsets[layer] is None:
            return base, extra
        moved = moved_keys(self.offsets[layer], view.position, base.shape[-1])
        return (base | moved) & view.old[:, None, :], extra

    def describe(self):
        confirmed = f", offsets shared by >= {self.confirm} entries" if self.confirm > 1 else ""
        return f"{self.name} (top {self.top} per {'head' if self.per_head else 'group mean'}{confirmed})"


def induction_keys(view: DraftView, top: int, num_keys: int, ngram: int = 1) -> torch.Tensor:
    """Mask `[r, N]` of the successors j + 1 of the `top` latest old occurrences j of the query's own
    input token (j + 1 < recent_start): where an induction head attends. `ngram=2`: occurrences whose
    preceding token also equals the query's preceding token come first (the latest of them), then the
    latest other occurrences fill the `top` (a bigram match with a unigram back-off). The preceding
    token is the text's at `position - 1`: the committed token at step 0, the previous draft after it
    (for a draft that counts, every earlier draft matched the text); `Induction` checks it."""
    j = torch.arange(num_keys - 1, device=view.text.device)
    match = (view.text[None, :-1] == view.input_token[:, None]) & view.old[:, 1:]  # successor j + 1 is old
    rank = torch.where(match, j[None, :], -1)
    if ngram == 2:
        previous = view.text[(view.position - 1).clamp(min=0)]  # [r]
        before = torch.cat([view.text.new_full((1,), -1), view.text[:-2]])  # token j - 1 for j = 0..N-2
        bigram = match & (before[None, :] == previous[:, None])
        rank = torch.where(bigram, rank + num_keys, rank)  # every bigram match before every unigram one
    values = rank.topk(min(top, num_keys - 1), dim=-1).values  # [r, top]
    latest = torch.where(values >= num_keys, values - num_keys, values)
    mask = torch.zeros(match.shape[0], num_keys, dtype=torch.bool, device=match.device)
    return mask.scatter_(-1, (latest + 1).clamp(min=0), latest >= 0)


class Induction(Diagonal):
    """PillarAttn plus, at every draft step, the successors of the latest `top` earlier occurrences of
    the token the draft reads, in every layer and KV head: the keys induction heads attend ("after
    the last time this token came, the text went on with ..."). The matches come from the token ids
    alone (no key is read to find them), refresh at every step with the draft's own token, and add
    `top` keys at most. `diagonal=1` adds the diagonal policy's moved keys (its top 1 per head) as well."""

    def __init__(self, name, min_budget, budget_ratio=0.05, *, top: int = 4, diagonal: int = 0, ngram: int = 1,
                 **common):  # fmt: skip
        super().__init__(name, min_budget, budget_ratio, **common)
        if ngram not in (1, 2):
            raise ValueError(f"ngram: expected 1 or 2, got {ngram}")
        self.matches, self.diagonal, self.ngram = top, diagonal, ngram

    def after_verify(self, layer, view):
        if self.diagonal:
            super().after_verify(layer, view)  # PillarAttn's set and the moved keys' offsets
        else:
            Policy.after_verify(self, layer, view)  # no offsets: `Diagonal.draft` adds no moved keys

    def draft(self, layer, view):
        mask, extra = super().draft(layer, view)
        mask = mask | induction_keys(view, self.matches, mask.shape[-1], self.ngram)[:, None, :]
        return mask & view.old[:, None, :], extra

    def describe(self):
        bigram = ", bigram matches first" if self.ngram == 2 else ""
        return f"{self.name} (successors of the latest {self.matches} matches{bigram}{' + diagonal' if self.diagonal else ''})"


POLICIES = {
    "dense": Dense, "pillar": Pillar, "streaming": Streaming, "oracle_step": OracleStep,
    "oracle_first": OracleFirst, "oracle_frozen": OracleFrozen, "quest": Quest, "rerank": Rerank,
    "shared": SharedBudget, "diagonal": Diagonal, "induction": Induction,
}  # fmt: skip


def make_policy(spec: str, min_budget: int, budget_ratio: float = 0.05) -> Policy:
    """`kind[:key=value,...]`, e.g. `pillar`, `pillar:budget_scale=1.3`, `rerank:candidates=2`,
    `quest:extra=0.25,page_size=16`, `shared:mode=entropy`, `quest:with_pillar=0`. `min_budget=` and
    `budget_ratio=` replace the study's budget rule for this policy (the engine's config fields of
    the same names), e.g. `induction:top=16,diagonal=1,min_budget=112,budget_ratio=0.045`."""
    kind, _, options = spec.partition(":")
    study_min_budget = min_budget
    if kind not in POLICIES:
        raise ValueError(f"policy: expected one of {sorted(POLICIES)}, got {kind!r}")
    kwargs: dict = {}
    for item in filter(None, options.split(",")):
        key, _, value = item.partition("=")
        if key in ("mode", "pool"):
            kwargs[key] = value
        elif key == "min_budget":
            min_budget = int(value)
        elif key == "budget_ratio":
            budget_ratio = float(value)
        elif key in ("page_size", "top", "num_sink", "diagonal", "confirm", "ngram"):
            kwargs[key] = int(value)
        elif key in ("with_pillar", "per_head"):
            kwargs[key] = value not in ("0", "false", "False")
        else:
            kwargs[key] = float(value)
    name = spec if spec else kind
    policy = POLICIES[kind](name, min_budget, budget_ratio, **kwargs)
    policy.study_min_budget = study_min_budget
    if not math.isfinite(policy.budget_scale) or policy.budget_scale <= 0:
        raise ValueError(f"budget_scale: expected > 0, got {policy.budget_scale}")
    if min_budget < 1 or not 0 < budget_ratio <= 1:
        raise ValueError(
            f"budget rule: expected min_budget >= 1 and 0 < budget_ratio <= 1, got {min_budget}, {budget_ratio}"
        )
    return policy
