"""Requests, their cycle, and the unified scheduler that decides what every iteration runs.

A request's life: WAITING -> PREFILL (one or more chunks) -> a cycle repeated until it stops:

    DRAFT x m  (one token per iteration, sparse attention; m = k, or the request's adaptive length
                in [min_draft_tokens, k], never more than the length limit leaves)
    VERIFY     (the last committed token + the m drafts, full attention; PillarAttn selects keys)
    VERIFYING  (the host has not read the verification yet. With delayed verification the request
                drafts the next cycle's first token in the next iteration anyway, *speculatively*:
                its position depends on how many drafts were accepted, which only the device knows,
                so the row is built for 0 accepted and carries the index of the verification's
                result, which the device step adds to its position; then it AWAITs the read. Without
                delayed verification the result is read at once.)

Host-side truth (the invariant this module owns): `num_committed` is the number of committed tokens
(prompt + generated, the token sampled at the end of prefill included) as the host will know them
once it has read every launched result; the KV of positions `0 .. num_committed - 2` is exact; the
drafts of the current cycle occupy positions from `num_committed - 1` on. Token *values* of drafts
live only on the device.

Unified scheduling: every active request advances one phase per iteration, so each iteration runs
about k/(k+1) of the requests as 1-token sparse drafts and 1/(k+1) as (k+1)-token verifications.
A new request joins the phase bucket that verifies least often by waiting (at most one cycle) before
its first draft; a restored request rejoins the same way. The `naive` policy joins the fullest bucket
instead, so all requests run in lockstep. Joining by waiting, not by drafting fewer tokens, keeps every
request's cycles (which positions are drafted, where verifications fall) a function of the request
alone, whatever else is in the batch: with keyed sampling noise (`sampling.sample_keys`) its sampled
output does not depend on admission order, batch size or offloads.

Adaptive draft lengths (`adaptive_draft_tokens`, `adapt_draft_length`): each request picks every
cycle's m from its own last verification, so its cycles stay a function of the request alone. Its
verifications then no longer repeat with period k+1: the buckets (`verify_residues`, keyed by iteration
mod k+1) count exactly where every request's *next* verification falls, and joining balances that
next verification only; later ones drift with the request's own lengths, so the buckets are balanced
when requests join, and afterwards only as far as independent drifts keep them (an approximation;
`naive` stops being lockstep after the first short cycle).

KV pages (`kv_manager.KVManager`): before the rows of an iteration are built, the KV manager makes
the pages they need free, offloading whole requests to the host if it must; an offloaded request
keeps its phase and gets no rows until it is restored. Admission asks the KV manager too.

Plain steps (`RowKind.PLAIN`): a cycle of 0 drafts would be a "verification" of zero drafts, which
always commits exactly one token; so it runs as a one-token row with full attention whose sampled
token the request commits at scheduling time (its value stays on the device), and the request runs
again in the next iteration, without waiting for the host to read the result. Every cycle is one in
autoregressive mode (k = 0); a cycle with one token to go is one; with `min_draft_context`, every
cycle while the request's context is shorter (where a drafting cycle costs more than the tokens it
saves), after which the request joins a phase bucket as a new one does; and with `plain_tail_rows`,
once at most that many requests are left (decoding or waiting), every remaining request's cycles are
(the tail, where an iteration is bound by its launches and drafting only slows a request down).
"""

from __future__ import annotations

import enum
from collections import Counter, deque
from dataclasses import dataclass, field

from hf_sparsespec.cache.page_allocator import PageAllocator
from hf_sparsespec.config import SparseSpecConfig
from hf_sparsespec.kv_manager import KVManager
from hf_sparsespec.stats import RequestStats


def adapt_draft_length(target: int, drafted: int, accepted: int, low: int, high: int) -> int:
    """The next cycle's draft length from the last verification's: all `drafted` drafts accepted
    lengthens it by one (to at most `high`), fewer than half of them shortens it to `accepted + 1` (to at
    least `low`), anything in between keeps it. `target` is the length the request asked for, `drafted`
    what its cycle drafted (fewer near the length limit)."""
    if accepted >= drafted:
        return min(high, target + 1)
    if 2 * accepted < drafted:
        return max(low, min(target, accepted + 1))
    return target


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DRAFT = "draft"
    VERIFY = "verify"
    VERIFYING = "verifying"  # verification launched, result unread, the speculative first draft not yet run
    AWAIT = "await"  # nothing to run until the host reads a result
    FINISHED = "finished"


class RowKind(enum.IntEnum):
    """In the order rows run in an iteration (`Scheduler.schedule`)."""

    PREFILL = 0
    VERIFY = 1  # the last committed token and m >= 1 drafts, full attention
    PLAIN = 2  # a plain step: a cycle of 0 drafts, one token with full attention, committed when scheduled
    DRAFT = 3


@dataclass(eq=False)
class Request:
    """One prompt being decoded.

    `padding` are tokens before position 0 in the request's token history (the left padding of a
    `generate` batch row): logits processors and stopping criteria see them, the model does not.
    """

    request_id: int
    prompt: list[int]
    max_new_tokens: int
    padding: list[int] = field(default_factory=list)
    batch_row: int = 0  # the request's row in the batch its logits processors were built for
    processor_params: tuple[int, ...] = ()  # per-request parameters of the vectorised logits processors
    # --- host-side state ---
    phase: Phase = Phase.WAITING
    slot: int = -1
    num_prefilled: int = 0
    num_committed: int = 0
    generated: list[int] = field(default_factory=list)
    cycle_drafts: int = 0  # m: drafts of the current cycle
    draft_target: int = 0  # drafts of the next cycle the length limit does not cut (k, or the adaptive length)
    drafts_done: int = 0
    recent_start: int = 0  # first position of the recent window (0 before the first verification)
    num_verifications: int = 0  # verifications of drafts launched (selection refreshes: every n-th)
    num_selected: int = 0  # selected keys per (layer, KV head) for the current cycle's drafts
    pending_budget: int = 0  # selection size the in-flight verification produces
    pending_recent_start: int = 0  # the recent window's start for the cycle after that verification
    pending_drafts: int = 0  # drafts of the in-flight verification (the most it can accept)
    speculated_iteration: int = -1  # iteration of the speculative first draft, -1: none in flight
    verify_result_index: int = -1  # the in-flight verification's row among its iteration's verify rows
    verify_iteration: int = -1  # iteration of the next (or last) verification, for bucket accounting
    start_iteration: int = 0  # the request runs no row before this iteration (it waits for its bucket)
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def history_offset(self) -> int:
        return len(self.padding)

    @property
    def max_total_len(self) -> int:
        return self.prompt_len + self.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED


@dataclass
class ScheduledRow:
    """One request's work in one iteration: `num_tokens` query tokens at positions
    `first_position .. first_position + num_tokens - 1`."""

    request: Request
    kind: RowKind
    first_position: int
    num_tokens: int
    samples: bool  # whether the row's logits are sampled (not for non-final prefill chunks)
    draft_index: int = 0  # 1-based draft step of a DRAFT row
    budget: int = 0  # VERIFY: keys the selection keeps for the next cycle
    selectable_keys: int = 0  # VERIFY: old keys the selection takes them from (those before the local window)
    speculative: bool = False  # DRAFT right after a verification with an unread result
    max_shift: int = 0  # speculative DRAFT: the most positions the device may shift it by (drafts verified)
    refreshes: bool = True  # VERIFY: scores its old keys and selects the next cycle's (`selection_refresh_interval`)

    @property
    def context_len(self) -> int:
        return self.first_position + self.num_tokens


class Scheduler:
    """Admission, phases and row selection. Pure host bookkeeping; the engine executes the rows."""

    def __init__(
        self, config: SparseSpecConfig, allocator: PageAllocator, num_slots: int, kv: KVManager | None = None
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.kv = kv if kv is not None else KVManager(config, allocator, host=None)
        self.k = config.num_draft_tokens
        self.autoregressive = self.k == 0
        self.adaptive = config.adaptive_draft_tokens
        self.min_drafts = config.min_draft_tokens
        # iterations per cycle in steady state: k drafts (the first one speculative when delayed), one verification
        self.cycle_length = self.k + 1
        self.speculate = config.delayed_verification and not self.autoregressive
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self.iteration = 0  # index of the iteration being scheduled next
        self.verify_residues: Counter[int] = Counter()  # active requests per verify iteration mod cycle

    def _set_verify_iteration(self, request: Request, iteration: int) -> None:
        if request.verify_iteration >= 0:
            self.verify_residues[request.verify_iteration % self.cycle_length] -= 1
        request.verify_iteration = iteration
        if iteration >= 0:
            self.verify_residues[iteration % self.cycle_length] += 1

    def reservation(self, request: Request) -> int:
        """Positions a request may ever write: its full length plus one speculative block."""
        return request.max_total_len + self.k + 1

    def add(self, request: Request) -> None:
        needed = self.allocator.pages_for(self.reservation(request))
        if needed > self.allocator.num_pages:
            raise ValueError(
                f"request {request.request_id} needs {needed} KV pages ({request.prompt_len} prompt + "
                f"{request.max_new_tokens} new tokens), the pool has {self.allocator.num_pages}; "
                "raise SparseSpecConfig.num_pages or gpu_memory_fraction"
            )
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    # --- one iteration ------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledRow]:
        """Rows of the next iteration, ordered prefill, verify, plain, draft (the attention relies on it)."""
        prefill_rows: list[ScheduledRow] = []
        verify_rows: list[ScheduledRow] = []
        plain_rows: list[ScheduledRow] = []
        draft_rows: list[ScheduledRow] = []
        prefill_budget = self.config.prefill_chunk_size
        self.kv.prepare(self)
        self._release_waiting()
        for request in self.active:
            if not self._runs(request):
                continue
            if request.phase is Phase.DRAFT:
                draft_rows.append(self._draft_row(request))
            elif request.phase is Phase.VERIFY and request.cycle_drafts == 0:
                plain_rows.append(self._plain_row(request))
            elif request.phase is Phase.VERIFY:
                verify_rows.append(self._verify_row(request))
            elif request.phase is Phase.VERIFYING:
                draft_rows.append(self._speculative_draft_row(request))
            elif request.phase is Phase.PREFILL and prefill_budget > 0:
                row = self._prefill_row(request, prefill_budget)
                prefill_budget -= row.num_tokens
                prefill_rows.append(row)
        while self.waiting and self.free_slots and prefill_budget > 0:
            request = self.waiting[0]
            if not self.kv.can_admit(request, self.reservation(request)):
                break
            self.waiting.popleft()
            self._admit(request)
            row = self._prefill_row(request, prefill_budget)
            prefill_budget -= row.num_tokens
            prefill_rows.append(row)
        rows = prefill_rows + verify_rows + plain_rows + draft_rows
        if rows:
            self.iteration += 1
        return rows

    def _admit(self, request: Request) -> None:
        request.slot = self.free_slots.pop()
        request.phase = Phase.PREFILL
        self.kv.admit(request, self.reservation(request))
        self.active.append(request)

    def _prefill_row(self, request: Request, budget: int) -> ScheduledRow:
        start = request.num_prefilled
        num_tokens = min(request.prompt_len - start, budget)
        request.num_prefilled += num_tokens
        final = request.num_prefilled == request.prompt_len
        self.allocator.ensure(request.request_id, start + num_tokens)
        self.kv.count_prefill(num_tokens)
        if final:
            # the first generated token is sampled now; the host reads its value later
            request.num_committed = request.prompt_len + 1
            if request.max_new_tokens <= 1:
                request.phase = Phase.AWAIT
            else:
                self.start_cycle(request, self.iteration + 1, first=True)
        return ScheduledRow(request, RowKind.PREFILL, start, num_tokens, samples=final)

    def _draft_row(self, request: Request) -> ScheduledRow:
        request.drafts_done += 1
        position = request.num_committed - 2 + request.drafts_done
        self.allocator.ensure(request.request_id, position + 1)
        if request.drafts_done == request.cycle_drafts:
            request.phase = Phase.VERIFY
        return ScheduledRow(request, RowKind.DRAFT, position, 1, samples=True, draft_index=request.drafts_done)

    def _plain_row(self, request: Request) -> ScheduledRow:
        """A cycle of 0 drafts: one token, committed now (the next row reads it on the device). A
        request whose context was below `min_draft_context` starts drafting once it reaches it."""
        row = ScheduledRow(request, RowKind.PLAIN, request.num_committed - 1, 1, samples=True)
        self.allocator.ensure(request.request_id, row.context_len)
        request.num_committed += 1
        if request.num_committed >= request.max_total_len:
            request.phase = Phase.AWAIT  # the last token: wait for the host to read and finish it
        elif request.num_committed == self.config.min_draft_context and not self.autoregressive:
            self.start_cycle(request, self.iteration + 1, first=True)  # joins a phase bucket, as after prefill
        return row

    def _verify_row(self, request: Request) -> ScheduledRow:
        first = request.num_committed - 1
        row = ScheduledRow(request, RowKind.VERIFY, first, request.cycle_drafts + 1, samples=True)
        self.allocator.ensure(request.request_id, row.context_len)
        row.refreshes = request.num_verifications % self.config.refresh_interval == 0
        request.num_verifications += 1
        if row.refreshes:  # the next cycle's window starts `local_window` keys before this block
            window_start = 0 if self.config.selection == "dense" else max(first - self.config.local_window, 0)
            row.budget = min(window_start, self.config.budget(row.context_len))
            row.selectable_keys = window_start
            request.pending_budget = row.budget
            request.pending_recent_start = window_start
        else:  # the next cycle drafts from the last refresh's selection, over a window from its block on
            request.pending_budget = request.num_selected
            request.pending_recent_start = request.recent_start
        request.pending_drafts = request.cycle_drafts
        self._set_verify_iteration(request, self.iteration)
        request.phase = Phase.VERIFYING if self.speculate else Phase.AWAIT
        return row

    def _speculative_draft_row(self, request: Request) -> ScheduledRow:
        """The next cycle's first draft, the iteration after a verification whose result is unread:
        built as if 0 drafts were accepted (position `num_committed`, the recovered token's); the
        device shifts it by the accepted count, so pages are ensured for the largest shift."""
        position = request.num_committed
        self.allocator.ensure(request.request_id, position + request.pending_drafts + 1)
        request.speculated_iteration = self.iteration
        request.phase = Phase.AWAIT
        return ScheduledRow(request, RowKind.DRAFT, position, 1, samples=True, draft_index=1, speculative=True,
                            max_shift=request.pending_drafts)

    # --- cycles and buckets --------------------------------------------------------------------
    def start_cycle(self, request: Request, first_draft_iteration: int, first: bool = False) -> None:
        """Begin drafting at `first_draft_iteration` (the first cycle: up to a cycle later, to join a
        phase bucket). A cycle commits at most m + 1 tokens, so m stays below what the request may
        still commit. A cycle whose first draft already ran speculatively counts it (an adaptive m is
        at least min_draft_tokens >= 1, so it has room for it); with no room left for a draft (one
        token to go) the speculative draft is dropped and the cycle verifies at once."""
        if first:
            request.draft_target = self.k
        remaining = request.max_total_len - request.num_committed
        # the tail only grows (requests leave, none join): once in it, every later cycle is a plain step
        plain = self._in_tail() or request.num_committed < self.config.min_draft_context
        drafts = max(min(0 if plain else request.draft_target, remaining - 1), 0)
        drafts_done = 0
        if request.speculated_iteration >= 0 and drafts > 0:
            first_draft_iteration, drafts_done = request.speculated_iteration, 1
        request.speculated_iteration = -1
        if first and drafts:
            first_draft_iteration = self._join(first_draft_iteration, drafts, balance=True)
        request.start_iteration = first_draft_iteration
        request.cycle_drafts = drafts
        request.drafts_done = drafts_done
        request.phase = Phase.DRAFT if drafts > drafts_done else Phase.VERIFY
        # plain steps never verify drafts: they stay out of the phase buckets
        self._set_verify_iteration(request, first_draft_iteration + drafts if drafts else -1)

    def _in_tail(self) -> bool:
        """Whether at most `plain_tail_rows` requests are left (decoding or waiting)."""
        tail = self.config.plain_tail_rows
        return tail > 0 and len(self.active) + len(self.waiting) <= tail

    def _join(self, earliest: int, to_verify: int, balance: bool) -> int:
        """The iteration (at most a cycle after `earliest`) to start from so that the verification
        `to_verify` iterations later lands in the least-loaded phase bucket (the fullest for `naive`);
        ties go to the earliest."""
        if not balance:
            return earliest

        def load(delay: int) -> int:
            return self.verify_residues[(earliest + delay + to_verify) % self.cycle_length]

        delays = range(self.cycle_length)
        delay = max(delays, key=load) if self.config.scheduler == "naive" else min(delays, key=load)
        return earliest + delay

    def _runs(self, request: Request) -> bool:
        return request.start_iteration <= self.iteration and self.kv.runs(request)

    def _release_waiting(self) -> None:
        """A request waits for its bucket only while others run: when nothing else would, it goes now."""
        if any(self._runs(r) and self.has_row(r) for r in self.active):
            return
        for request in self.active:
            request.start_iteration = min(request.start_iteration, self.iteration)

    # --- results --------------------------------------------------------------------------------
    def commit_verification(self, request: Request, kept: int) -> None:
        """The host read a verification: `kept` tokens (accepted drafts + one) were committed. The
        next cycle drafts from the selection the verification made, over the window it opened; with
        adaptive drafting, its length follows from this verification's acceptance."""
        if self.adaptive:
            request.draft_target = adapt_draft_length(
                request.draft_target, request.pending_drafts, kept - 1, self.min_drafts, self.k
            )
        request.num_committed += kept
        request.recent_start = request.pending_recent_start
        request.num_selected = request.pending_budget
        # the KV of positions < num_committed - 1 is exact; a speculative first draft also wrote the
        # next position's, which its cycle attends to (the next verification rewrites it)
        speculated = 1 if request.speculated_iteration >= 0 else 0
        self.allocator.truncate(request.request_id, request.num_committed - 1 + speculated)

    def finish(self, request: Request, reason: str) -> None:
        self._set_verify_iteration(request, -1)
        request.phase = Phase.FINISHED
        request.finish_reason = reason
        self.kv.release(request)
        self.active.remove(request)
        self.free_slots.append(request.slot)

    # --- pages: what the KV manager asks (kv_manager.KVManager) --------------------------------
    def has_row(self, request: Request) -> bool:
        """Whether the request's next iteration runs a row (not while it awaits a result)."""
        return request.phase in (Phase.PREFILL, Phase.DRAFT, Phase.VERIFY, Phase.VERIFYING)

    def prefilling(self) -> bool:
        """Whether an admitted request's prompt is not fully prefilled yet."""
        return any(request.phase is Phase.PREFILL for request in self.active)

    def upcoming_length(self, request: Request) -> int:
        """The most token positions the request holds once its next row ran (its page demand)."""
        if request.phase is Phase.PREFILL:
            return request.num_prefilled + min(request.prompt_len - request.num_prefilled, self.config.prefill_chunk_size)
        if request.phase is Phase.DRAFT:
            return request.num_committed + request.drafts_done
        if request.phase is Phase.VERIFY:
            return request.num_committed + request.cycle_drafts
        if request.phase is Phase.VERIFYING:  # the speculative first draft, shifted by at most pending_drafts
            return request.num_committed + request.pending_drafts + 1
        return 0

    def settled(self, request: Request) -> bool:
        """Whether no unread result can still roll the request's pages back (a verification in flight)."""
        return request.cycle_drafts == 0 or request.phase not in (Phase.VERIFYING, Phase.AWAIT)

    def park(self, request: Request) -> None:
        """An offloaded request leaves the phase buckets while it is away."""
        if request.verify_iteration >= 0:
            self._set_verify_iteration(request, -1)

    def resume(self, request: Request) -> None:
        """A restored request rejoins with its cycle unchanged, from the iteration (at most a cycle
        away) that puts its next verification in the least-loaded phase bucket."""
        if request.cycle_drafts == 0 or request.phase not in (Phase.DRAFT, Phase.VERIFY):  # plain steps: at once
            request.start_iteration = self.iteration
            return
        to_verify = request.cycle_drafts - request.drafts_done
        request.start_iteration = self._join(self.iteration, to_verify, balance=True)
        self._set_verify_iteration(request, request.start_iteration + to_verify)
