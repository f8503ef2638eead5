"""BatchBuilder: the host side of an iteration, vectorised into one int32 staging buffer.

The scheduler hands over the rows of an iteration (prefill chunks, verifications, plain steps,
drafts, in that order). This module turns them into every index the device step needs, with numpy over whole arrays
(no per-token Python), written into a pinned host buffer that the runner uploads with ONE copy:

    tokens   input_index, position, kv_slot                [num_tokens]
    rows     row_slot, query_start (+1), context_len, recent_start, selection_slot, num_selected
    verify   query_start (+1), num_old_keys, budget, slot, first_position, num_drafts, base  [verify rows]
             draft_index, draft_prob_row                   [verify rows x k]
    logits   token, slot, prefix_len                       [logits rows]; processor params [n x logits rows]
    keys     logits_stream [logits rows x 2]: each draw's noise stream (the device folds in the
             position of the drawn token), accept_key [verify rows x k x 2]: each acceptance test's
             key (`sampling.sample_keys`; zeros under greedy decoding)
    singles  write, prob_index, row_base, recent_start     [one-token rows: plain steps, then drafts]
    prefill  write                                         [sampling prefill rows]
    plan     work [num_work x 5], merge [num_merge x 5]    (Triton backend only)
    shifts   shift_index [rows]; token_row, single_row, logits_row    (iterations with speculative rows)
and, after the fields of the shape, the new page-table entries: flat index, then page.

Shapes (`StepShape`): an iteration without prefill rows is padded to a bucket (verify rows and one-token
rows rounded up) so that a CUDA graph can replay it: padded rows and tokens read slot `num_slots` (the
dummy slot of every per-slot buffer), write the KV cache nowhere (`kv_slot = -1`) and sample into
the dummy slot. Logits rows are laid out `[verify rows x (k + 1)][one-token rows][prefill samples]`,
so a verification's k + 1 target distributions are a fixed-stride block. One-token rows are plain
steps (cycles of 0 drafts: attending fully, their sample committed), then drafts; where one kind ends
is data (the attention's count of full rows, each row's write indices and noise keys), not shape, so
requests that move from plain steps to drafting (`min_draft_context`) or back (the tail) keep their
iterations in the buckets, and the graphs, they had. The step writes every one-token row's sample
into the token history and a draft's probabilities to its `prob_index` (-1 for plain steps and
padding: none), and returns every one-token row's token; the host reads the plain steps'.

Speculative rows (a request's first draft right after its verification, see `scheduler.py`) are
built as if the verification accepted 0 drafts; `shift_index` points at that verification's
accepted count in the previous iteration's results, which the device step adds to the row's
position, context length, input index, KV slot, draft write and logits prefix (through the
`*_row` maps), and the attention plan gives the row room for the largest shift.

Invariant: a field's content depends only on the rows; its offset only on the shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hf_sparsespec.kernels.attention_plan import PlanCapacity, block_sizes, plan_capacity, plan_work_lists
from hf_sparsespec.sampling import ACCEPT_NOISE, DRAFT_NOISE, TARGET_NOISE, sample_keys, stream_keys
from hf_sparsespec.scheduler import RowKind, ScheduledRow

# Every field of the metadata buffer starts on a 16-byte boundary (4 int32): Triton specialises pointer
# arguments on 16-byte alignment, so fields at offsets that followed the row counts would compile every
# kernel again for the odd shapes of a draining batch (seconds each, in the middle of a run).
FIELD_ALIGNMENT = 4


def aligned(count: int) -> int:
    """Room a field of `count` int32 takes in the metadata buffer (the next field stays aligned)."""
    return -(-count // FIELD_ALIGNMENT) * FIELD_ALIGNMENT


@dataclass(frozen=True)
class StepShape:
    """Sizes of one iteration's buffers; iterations of equal shape share a CUDA graph."""

    num_tokens: int
    num_rows: int
    num_prefill_rows: int
    num_verify_rows: int
    num_single_rows: int  # one-token rows: plain steps, then drafts
    num_prefill_samples: int
    spec_len: int  # k + 1: logits rows per verify row
    num_params: int  # per-row parameters of the vectorised logits processors
    block_m_full: int
    plan: PlanCapacity | None  # None: the backend needs no plan
    padded: bool  # a bucket of a graph-able decode iteration
    shifted: bool = False  # has speculative rows (the shift fields are present)

    @property
    def num_logits(self) -> int:
        return self.num_verify_rows * self.spec_len + self.num_single_rows + self.num_prefill_samples

    def fields(self) -> list[tuple[str, int]]:
        """(name, int32 count) in staging order."""
        t, r, v, s = self.num_tokens, self.num_rows, self.num_verify_rows, self.num_single_rows
        k, n = self.spec_len - 1, self.num_logits
        plan = self.plan or PlanCapacity(0, 0, 0)
        return [
            ("num_full_rows", 1), ("input_index", t), ("position", t), ("kv_slot", t),
            ("row_slot", r), ("query_start", r + 1), ("context_len", r), ("recent_start", r),
            ("selection_slot", r), ("num_selected", r),
            ("verify_query_start", v + 1), ("num_old_keys", v), ("num_selectable_keys", v), ("budget", v), ("verify_slot", v),
            ("verify_first_position", v), ("num_drafts", v), ("verify_base", v),
            ("draft_index", v * k), ("draft_prob_row", v * k),
            ("logits_token", n), ("logits_slot", n), ("logits_prefix_len", n), ("logits_params", self.num_params * n),
            ("single_write", s), ("single_prob_index", s), ("single_row_base", s), ("single_recent_start", s),
            ("prefill_write", self.num_prefill_samples),
            ("logits_stream", 2 * n), ("accept_key", 2 * v * k),
            ("work", plan.num_work * 5), ("merge", plan.num_merge * 5),
            ("shift_index", r if self.shifted else 0), ("token_row", t if self.shifted else 0),
            ("single_row", s if self.shifted else 0), ("logits_row", n if self.shifted else 0),
        ]  # fmt: skip

    @property
    def size(self) -> int:
        """int32 count of the metadata buffer, every field aligned (`FIELD_ALIGNMENT`)."""
        return sum(aligned(n) for _, n in self.fields())


# Padded tokens a bucket may add past 8 rows: a padded token costs as much as a real one (the GEMMs
# of a 256-row iteration are compute-bound on an H200), so verification rows, k + 1 tokens each,
# get finer buckets than one-token draft rows.
MAX_PADDING_TOKENS = 16


def round_up_rows(n: int, limit: int, row_tokens: int = 1) -> int:
    """Bucket of `n` rows of `row_tokens` tokens each: 1, 2, 4, 8, then multiples of a step that
    pads at most `MAX_PADDING_TOKENS` tokens (8 rows up to 32, 16 beyond, for one-token rows; 2
    rows for verifications of 9 tokens); never above `limit` (the row capacity)."""
    if n <= 8:
        padded = 1 << max(0, (n - 1).bit_length()) if n else 0
    else:
        step = 8 if n <= 32 else 16
        while step > 1 and (step - 1) * row_tokens > MAX_PADDING_TOKENS:
            step //= 2
        padded = -(-n // step) * step
    return min(padded, max(limit, n))


class DevicePageTable:
    """Host mirror of the device page table `[num_slots + 1, max_pages]` (the last row is the dummy
    slot) and the entries to send with the next iteration (only those that changed)."""

    def __init__(self, num_slots: int, max_pages: int) -> None:
        self.pages = np.zeros((num_slots + 1, max_pages), dtype=np.int32)
        self.max_pages = max_pages
        self._index: list[np.ndarray] = []
        self._value: list[np.ndarray] = []

    def sync(self, slot: int, table: list[int], first_changed: int) -> None:
        """Record the entries `table[first_changed:]` (what changed since the slot's last sync, as the
        allocator reports it; entries past a request's length are never read)."""
        length = len(table)
        if length > first_changed:
            new = np.asarray(table[first_changed:], dtype=np.int32)
            self.pages[slot, first_changed:length] = new
            self._index.append(slot * self.max_pages + np.arange(first_changed, length, dtype=np.int32))
            self._value.append(new)

    def take_updates(self) -> tuple[np.ndarray, np.ndarray]:
        index = np.concatenate(self._index) if self._index else np.zeros(0, np.int32)
        value = np.concatenate(self._value) if self._value else np.zeros(0, np.int32)
        self._index, self._value = [], []
        return index, value


@dataclass
class HostBatch:
    """One iteration, built: its shape, the rows (for reading results) and the staging contents."""

    shape: StepShape
    rows: list[ScheduledRow]
    verify_rows: list[ScheduledRow]  # in result order
    plain_rows: list[ScheduledRow]  # in result order
    prefill_sample_rows: list[ScheduledRow]  # in result order
    arrays: dict[str, np.ndarray]
    host_rows: dict[str, np.ndarray]  # real logits rows' slot / prefix_len / params (the eager processors)
    page_updates: tuple[np.ndarray, np.ndarray]  # new page-table entries: flat index, page

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the real rows; the rest of `shape.num_tokens` is the bucket's padding."""
        return int(self.arrays["query_start"][len(self.rows)])

    @property
    def num_results(self) -> int:
        shape = self.shape
        return shape.num_verify_rows * (shape.spec_len + 1) + shape.num_single_rows + shape.num_prefill_samples


class BatchBuilder:
    """Rows of an iteration -> `HostBatch` (see the module docstring).

    Args:
        k: draft tokens per cycle (0: autoregressive rows of one token).
        num_slots, history_width: the token buffer `[num_slots + 1, history_width]` (last row: dummy).
        page_size, page_table: the KV page size and the device page table's host mirror.
        group, num_kv_heads, plan_items: the attention geometry and the plan's target work items;
            `plan_items = 0` when the backend needs no plan.
        num_params: per-request parameters of the vectorised logits processors (each request's
            `processor_params`, a tuple of ints set by the engine).
        pad: pad decode iterations to buckets (graph-able shapes).
        sample_seed: the seed of the keyed sampling noise; None under greedy decoding (no keys).
        num_moved: moved-key entries every draft row attends besides its selection (the diagonal
            selection, `(k + 1) x group`; 0 otherwise): room in the attention plan.
        min_padded_rows: the fewest rows of a kind (verifications, one-token rows) a padded iteration
            has when it has any (at most the slots): 2 with the compiled forward, which runs shapes with
            a single row of a kind eagerly (dynamo specialises a size of 1, `ModelRunner._compiles`): a
            256-row iteration with one verification took 10.7-11.2 ms on the H100, compiled ones
            with two or four ~9.1 at the same contexts (docs/measurements.md 30).
        plain_phases: whether plain one-token steps make up whole stretches of a run (k = 0,
            `min_draft_context`, `plain_tail_rows`): then a padded shape without verifications tiles
            its full rows for one query. Otherwise such shapes hold only the drain's last tokens (a
            request's last token is a plain step) beside drafts, and keep the verifications' tile, so
            that the attention kernel has one variant a run: a bucket of them, captured late in a long
            run, compiled a Triton variant of its own inside a timed 256 x 8192 run (1.7 s,
            docs/measurements.md 34).
    """

    def __init__(
        self, k: int, num_slots: int, history_width: int, page_size: int, page_table: DevicePageTable,
        group: int, num_kv_heads: int, plan_items: int, num_params: int, pad: bool, sample_seed: int | None = None,
        num_moved: int = 0, min_padded_rows: int = 1, plain_phases: bool = True,
    ) -> None:  # fmt: skip
        self.sample_seed, self.num_moved, self.min_padded_rows = sample_seed, num_moved, min_padded_rows
        self.plain_phases = plain_phases
        self.k, self.num_slots, self.width, self.page_size = k, num_slots, history_width, page_size
        self.page_table = page_table
        self.group, self.num_kv_heads, self.plan_items = group, num_kv_heads, plan_items
        self.num_params, self.pad = num_params, pad

    def build(self, rows: list[ScheduledRow], allocator, bucket=None) -> HostBatch:
        """`bucket(verify_rows, single_rows, shifted) -> (verify_rows', single_rows', shifted')`, optional:
        the bucket to pad a decode iteration to instead of its own (at least as large, shifted if it is;
        the runner's `bucket`, which picks a captured graph)."""
        k, spec, width, dummy = self.k, self.k + 1, self.width, self.num_slots
        n_rows = len(rows)
        # --- per row: the fields every row has, then those of drafts and verifications (Python loops) ---
        common = np.array([(row.request.slot, row.kind, row.first_position, row.num_tokens, row.request.history_offset,
                            row.samples, row.request.request_id) for row in rows], np.int64).reshape(n_rows, 7)  # fmt: skip
        slot, kind, first, n_tok, offset, samples, request_id = common.T
        samples = samples.astype(bool)
        recent = np.zeros(n_rows, np.int64)
        n_sel = np.zeros(n_rows, np.int64)
        budget = np.zeros(n_rows, np.int64)
        selectable = np.zeros(n_rows, np.int64)
        refreshes = np.zeros(n_rows, bool)
        draft_step = np.zeros(n_rows, np.int64)
        shift_index = np.full(n_rows, -1, np.int64)
        max_shift = np.zeros(n_rows, np.int64)
        verify_count = 0
        params = np.zeros((n_rows, self.num_params), np.int64)
        for i, row in enumerate(rows):
            if row.kind is not RowKind.DRAFT and row.kind is not RowKind.VERIFY:
                continue
            request = row.request
            if row.speculative:  # drafts from the window and selection of the verification in flight
                recent[i], n_sel[i], draft_step[i] = request.pending_recent_start, request.pending_budget, 1
                shift_index[i], max_shift[i] = request.verify_result_index * (k + 2), row.max_shift
            elif row.kind is RowKind.DRAFT:
                recent[i], n_sel[i], draft_step[i] = request.recent_start, request.num_selected, row.draft_index
            else:
                budget[i], refreshes[i], selectable[i] = row.budget, row.refreshes, row.selectable_keys
                request.verify_result_index = verify_count
                verify_count += 1
        if self.num_params:
            params[:] = [row.request.processor_params for row in rows]
        changed_requests = allocator.changed_requests
        if changed_requests:  # the others' tables are as last sent
            changed = np.fromiter(changed_requests, np.int64, len(changed_requests))
            for i in np.flatnonzero(np.isin(request_id, changed)).tolist():
                rid = rows[i].request.request_id
                self.page_table.sync(rows[i].request.slot, allocator.page_table(rid), allocator.take_changed(rid))
        is_prefill, is_verify, is_draft = kind == RowKind.PREFILL, kind == RowKind.VERIFY, kind == RowKind.DRAFT
        is_plain = kind == RowKind.PLAIN
        n_p, n_v, n_pl, n_d = int(is_prefill.sum()), int(is_verify.sum()), int(is_plain.sum()), int(is_draft.sum())
        n_full = n_p + n_v + n_pl  # rows that attend fully come first
        n_s = n_pl + n_d  # one-token rows
        context = first + n_tok
        shifted = bool((shift_index >= 0).any())
        updates = self.page_table.take_updates()

        # --- the shape ---
        padded = self.pad and n_p == 0
        v_pad = round_up_rows(n_v, self.num_slots, spec) if padded else n_v
        s_pad = round_up_rows(n_s, self.num_slots) if padded else n_s
        if padded and self.min_padded_rows > 1:  # no kind of row alone (`min_padded_rows`)
            least = min(self.min_padded_rows, self.num_slots)
            v_pad, s_pad = (max(n, least) if n else 0 for n in (v_pad, s_pad))
        if padded and bucket is not None:
            needs_shift = shifted
            v_pad, s_pad, shifted = bucket(v_pad, s_pad, shifted)
            assert v_pad >= n_v and s_pad >= n_s and shifted >= needs_shift, "a bucket must hold the iteration"
        prefill_samples = np.flatnonzero(is_prefill & samples)
        real_tokens = int(n_tok.sum())
        num_tokens = v_pad * spec + s_pad if padded else real_tokens
        num_rows = n_rows + (v_pad - n_v) + (s_pad - n_s)
        if padded:  # the tile of a bucket: verifications' (k + 1) queries if it has room for any (`plain_phases`)
            max_full_q = spec if v_pad or not self.plain_phases else 1
        else:
            max_full_q = int(n_tok[:n_full].max(initial=1))
        block_m_full = block_sizes(max_full_q, self.group)[0]
        capacity = None
        if self.plan_items:
            tile_q = block_m_full // self.group
            if padded:
                max_tiles = v_pad * -(-spec // tile_q) + s_pad
            else:
                max_tiles = int((-(-n_tok[:n_full] // tile_q)).sum()) + n_d
            capacity = plan_capacity(max_tiles, num_tokens, tile_q, self.plan_items)
        shape = StepShape(
            num_tokens=num_tokens, num_rows=num_rows, num_prefill_rows=n_p, num_verify_rows=v_pad,
            num_single_rows=s_pad, num_prefill_samples=len(prefill_samples), spec_len=spec,
            num_params=self.num_params, block_m_full=block_m_full, plan=capacity, padded=padded, shifted=shifted,
        )  # fmt: skip
        a: dict[str, np.ndarray] = {"num_full_rows": np.array([n_full])}

        # --- tokens: row i's positions first[i] .. context[i] - 1 ---
        token_row = np.repeat(np.arange(n_rows), n_tok)
        query_start = np.concatenate([[0], np.cumsum(n_tok)])
        position = np.arange(real_tokens) - np.repeat(query_start[:-1], n_tok) + first[token_row]
        row_base = slot * width + offset  # flat token-buffer index of each row's position 0
        tok_slot = slot[token_row]
        kv_slot = self.page_table.pages[tok_slot, position // self.page_size] * self.page_size + position % self.page_size
        pad_tokens = num_tokens - real_tokens
        a["input_index"] = _pad(row_base[token_row] + position, pad_tokens, 0)
        a["position"] = _pad(position, pad_tokens, 0)
        a["kv_slot"] = _pad(kv_slot, pad_tokens, -1)

        # --- rows: real rows, then padding rows (no work items read them) ---
        pad_rows = num_rows - n_rows
        a["row_slot"] = _pad(slot, pad_rows, dummy)
        a["query_start"] = _pad(query_start, pad_rows, real_tokens)
        a["context_len"] = _pad(context, pad_rows, 0)
        a["recent_start"] = _pad(recent, pad_rows, 0)
        a["selection_slot"] = _pad(np.where(is_draft, slot, 0), pad_rows, 0)
        a["num_selected"] = _pad(n_sel, pad_rows, 0)

        # --- verifications: the first n_v of v_pad acceptance slots ---
        vr = np.flatnonzero(is_verify)
        v_slot, v_first, v_m = slot[vr], first[vr], n_tok[vr] - 1
        v_base = row_base[vr] + v_first + 1  # flat index of each verification's first draft
        pad_v = v_pad - n_v
        dummy_base = dummy * width
        a["verify_query_start"] = _pad(query_start[n_p : n_p + n_v + 1], pad_v, query_start[n_p + n_v])
        # a verification that keeps its request's selection scores no key and selects into the dummy slot
        v_refresh = refreshes[vr]
        a["num_old_keys"] = _pad(np.where(v_refresh, v_first, 0), pad_v, 0)
        a["num_selectable_keys"] = _pad(np.where(v_refresh, selectable[vr], 0), pad_v, 0)
        a["budget"] = _pad(budget[vr], pad_v, 0)
        a["verify_slot"] = _pad(np.where(v_refresh, v_slot, dummy), pad_v, dummy)
        a["verify_first_position"] = _pad(v_first, pad_v, 0)
        a["num_drafts"] = _pad(v_m, pad_v, 0)
        a["verify_base"] = _pad(v_base, pad_v, dummy_base)
        steps = np.arange(k)
        draft_index = v_base[:, None] + np.minimum(steps[None, :], np.maximum(v_m - 1, 0)[:, None])
        a["draft_index"] = _pad(draft_index.reshape(-1), pad_v * k, dummy_base)
        a["draft_prob_row"] = _pad((v_slot[:, None] * k + steps[None, :]).reshape(-1), pad_v * k, dummy * k)

        # --- logits rows: [verify x spec][one-token rows: plain, drafts][prefill samples] ---
        j = np.minimum(np.arange(spec)[None, :], v_m[:, None])  # [n_v, spec]: row j reads token j (<= m)
        v_tokens = query_start[vr][:, None] + j
        v_prefix = (offset[vr] + v_first)[:, None] + j + 1
        pr, dr = np.flatnonzero(is_plain), np.flatnonzero(is_draft)
        sr, pad_s = np.concatenate([pr, dr]), s_pad - n_s  # the one-token rows, in row order
        tok = [v_tokens.reshape(-1), np.zeros(pad_v * spec, np.int64), query_start[sr], np.zeros(pad_s, np.int64),
               query_start[prefill_samples + 1] - 1]  # fmt: skip
        row_of = [np.repeat(vr, spec), np.full(pad_v * spec, -1), sr, np.full(pad_s, -1), prefill_samples]
        prefix = [v_prefix.reshape(-1), np.ones(pad_v * spec, np.int64), offset[sr] + context[sr],
                  np.ones(pad_s, np.int64), offset[prefill_samples] + context[prefill_samples]]  # fmt: skip
        logits_row = np.concatenate(row_of)
        real = logits_row >= 0
        a["logits_token"] = np.concatenate(tok)
        a["logits_slot"] = np.where(real, slot[logits_row], dummy)
        a["logits_prefix_len"] = np.concatenate(prefix)
        a["logits_params"] = np.where(real[None, :], params[logits_row].T, 0).reshape(-1)

        # --- keys of the sampling noise: (request, position of the drawn token, purpose) ---
        a["logits_stream"], a["accept_key"] = self._keys(request_id, logits_row, real, offset, is_draft, vr, v_first,
                                                         pad_v)  # fmt: skip

        # --- one-token rows and first tokens: where sampled tokens (and the drafts' distributions) go ---
        a["single_write"] = _pad(row_base[sr] + context[sr], pad_s, dummy_base)
        # each draft's distribution is stored for its verification; plain steps and padding store nothing (-1)
        a["single_prob_index"] = _pad(np.concatenate([np.full(n_pl, -1), slot[dr] * k + draft_step[dr] - 1]), pad_s, -1)
        # (the induction selection's lookup: each draft row's history and old keys; plain steps look in the dummy slot)
        a["single_row_base"] = _pad(np.concatenate([np.full(n_pl, dummy_base), row_base[dr]]), pad_s, dummy_base)
        a["single_recent_start"] = _pad(np.concatenate([np.zeros(n_pl, np.int64), recent[dr]]), pad_s, 0)
        a["prefill_write"] = row_base[prefill_samples] + context[prefill_samples]

        # --- the attention plan (rows [0, n_full) attend fully; speculative rows get room to shift) ---
        if capacity is not None:
            work, merge, _ = plan_work_lists(
                query_start, context + max_shift, n_full, n_sel, recent, group=self.group,
                block_m_full=block_m_full, items=self.plan_items, capacity=capacity, num_moved=self.num_moved,
            )  # fmt: skip
            a["work"], a["merge"] = work.reshape(-1), merge.reshape(-1)
        else:
            a["work"] = a["merge"] = np.zeros(0, np.int64)

        if shifted:  # maps to rows; padding entries map to row `num_rows`, which never shifts
            a["shift_index"] = _pad(shift_index, pad_rows, -1)
            a["token_row"] = _pad(token_row, pad_tokens, num_rows)
            a["single_row"] = _pad(sr, pad_s, num_rows)
            a["logits_row"] = np.where(real, logits_row, num_rows)
        host_rows = {
            "slot": slot[logits_row[real]],
            "prefix_len": a["logits_prefix_len"][real],
            "params": params[logits_row[real]],
            "index": np.flatnonzero(real),
        }
        return HostBatch(shape, rows, [rows[i] for i in vr], [rows[i] for i in pr], [rows[i] for i in prefill_samples],
                         a, host_rows, updates)  # fmt: skip


    def _keys(self, request_id, logits_row, real, offset, is_draft, vr, v_first, pad_v):
        """`logits_stream` [num_logits x 2] (drafts: draft noise; verifications and first tokens: target
        noise; the device adds the history position of the drawn token, `logits_prefix_len`) and
        `accept_key` [v_pad x k x 2] (the acceptance test of each draft, at its history position);
        zeros where nothing is drawn."""
        k, n_v = self.k, len(vr)
        streams = np.zeros((len(logits_row), 2), np.int64)
        accept_key = np.zeros((n_v + pad_v, k, 2), np.int64)
        if self.sample_seed is not None:
            rows = logits_row[real]
            streams[real] = stream_keys(self.sample_seed, request_id[rows], np.where(is_draft[rows], DRAFT_NOISE, TARGET_NOISE))
            if k and n_v:
                positions = (offset[vr] + v_first)[:, None] + 1 + np.arange(k)[None, :]
                keys = sample_keys(self.sample_seed, request_id[vr][:, None], positions, ACCEPT_NOISE)
                accept_key[:n_v] = keys.reshape(n_v, k, 2)
        return streams.reshape(-1), accept_key.reshape(-1)


def _pad(values: np.ndarray, count: int, fill: int) -> np.ndarray:
    """`values` followed by `count` copies of `fill`."""
    return np.concatenate([np.asarray(values, dtype=np.int64), np.full(count, fill, np.int64)]) if count else values

