"""Engine: one loop behind every front door.

    step():  schedule -> pack -> model forward -> sample / accept (on device) -> read results (host)

The model runs unmodified: one forward per iteration over a packed batch, with the attention
implementation switched to `"sparsespec"` for the duration of `run()` and restored afterwards. Token
values flow on the device: every request's token history lives in `token_buffer`, the forward
gathers its input ids from it, and the samplers write drafts, first tokens and recovered/bonus tokens
back into it. The host reads one small int64 tensor per iteration (first tokens and verification
results), the one planned synchronisation point; with delayed verification it reads iteration t's
results only after iteration t+1 was launched, so a verifying request sits one iteration out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_sparsespec.attention import ATTENTION_NAME, use_attention
from hf_sparsespec.cache.paged_cache import SparseSpecCache
from hf_sparsespec.config import SparseSpecConfig
from hf_sparsespec.kernels.backend import get_backend
from hf_sparsespec.results import ResultReader, StopChecker
from hf_sparsespec.sampling import LogitsPipeline, accept_greedy, accept_sampled, sample_from
from hf_sparsespec.scheduler import Request, RowKind, ScheduledRow, Scheduler
from hf_sparsespec.step import HostPlan, StepBatch
from hf_sparsespec.validation import cache_kwarg_name, model_geometry, supports_logits_to_keep


@dataclass(frozen=True)
class EngineLayout:
    """Sizes discovered at run time (never stored in the config)."""

    num_slots: int
    num_pages: int
    history_width: int  # columns of `token_buffer`
    max_budget: int  # width of the selected-index store


@dataclass
class SampleRows:
    """Where each sampled row's logits sit and where its token goes (host lists, built in `_pack`)."""

    logits_index: list[int]  # packed token index of every logits row
    row_slots: list[int]  # per logits row: request slot
    prefix_lens: list[int]  # per logits row: history length its distribution conditions on
    groups: list[int]  # per logits row: processor group
    batch_rows: list[int]  # per logits row: the request's row in the batch its processors were built for
    prefill: list[int]  # logits rows of final prefill chunks
    prefill_write: list[int]  # flat token_buffer index of each first token
    draft: list[int]  # logits rows of drafts
    draft_write: list[int]  # flat token_buffer index of each draft token
    draft_prob_index: list[int]  # flat (slot * k + draft_index - 1) into draft_probs
    verify: list[list[int]]  # per verify row: its m + 1 logits rows
    verify_base: list[int]  # flat token_buffer index of the first draft of each verify row


@dataclass
class StepOutputs:
    rows: list[ScheduledRow]
    host_values: torch.Tensor  # int64: first tokens of prefill rows, then per verify row [accepted, k drafts, next]
    ready: object  # torch.cuda.Event or None


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        requests: list[Request],
        config: SparseSpecConfig,
        pipelines: list[LogitsPipeline],
        do_sample: bool,
        stop_checker: StopChecker,
        on_tokens: Callable[[Request, list[int]], None] | None = None,
        on_finish: Callable[[Request], None] | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.pipelines = pipelines
        self.do_sample = do_sample
        self.stop_checker = stop_checker
        self.on_tokens = on_tokens
        self.on_finish = on_finish
        self.k = config.num_draft_tokens
        self.geometry = model_geometry(model)
        self.device = self.geometry.device
        self.backend = get_backend(config.backend, self.device)
        self.layout = self._layout(requests)
        self.cache = SparseSpecCache(
            num_layers=self.geometry.num_layers,
            num_kv_heads=self.geometry.num_kv_heads,
            head_dim=self.geometry.head_dim,
            num_pages=self.layout.num_pages,
            page_size=config.page_size,
            num_slots=self.layout.num_slots,
            max_budget=self.layout.max_budget,
            dtype=self.geometry.dtype,
            device=self.device,
        )
        self.scheduler = Scheduler(config, self.cache.allocator, self.layout.num_slots)
        for request in requests:
            self.scheduler.add(request)
        shape = (self.layout.num_slots, self.layout.history_width)
        self.token_buffer = torch.zeros(shape, dtype=torch.long, device=self.device)
        self.draft_probs = None
        if do_sample:
            shape = (self.layout.num_slots * self.k, self.geometry.vocab_size)
            self.draft_probs = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.reader = ResultReader(self.device)
        self.pending: deque[StepOutputs] = deque()
        self._cache_kwarg = cache_kwarg_name(model)
        self._logits_to_keep = supports_logits_to_keep(model)
        self._checked_attention = False

    def _layout(self, requests: list[Request]) -> EngineLayout:
        config, geometry = self.config, self.geometry
        num_slots = min(config.max_num_requests, len(requests))
        spec = self.k + 1
        history_width = max(r.history_offset + r.max_total_len + spec for r in requests)
        pages = sorted(-(-(r.max_total_len + spec) // config.page_size) for r in requests)
        needed = sum(pages[-num_slots:])  # room for the largest requests at once
        if config.num_pages is not None:
            num_pages = config.num_pages
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            page_bytes = 2 * geometry.num_layers * config.page_size * geometry.num_kv_heads * geometry.head_dim
            page_bytes *= geometry.dtype.itemsize
            num_pages = max(1, min(needed, int(free * config.gpu_memory_fraction) // page_bytes))
        else:
            num_pages = needed
        max_context = max(r.max_total_len + spec for r in requests)
        max_budget = 1 if config.selection == "dense" else config.budget(max_context)
        return EngineLayout(num_slots, num_pages, history_width, max_budget)

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        with use_attention(self.model, ATTENTION_NAME), torch.no_grad():
            while self.scheduler.has_work or self.pending:
                self.step()

    def step(self) -> None:
        rows = self.scheduler.schedule()
        if not rows:
            if not self.pending:
                raise RuntimeError("hf_sparsespec: waiting requests cannot be admitted and nothing runs")
            while self.pending:
                self._read(self.pending.popleft())
            return
        for row in rows:
            if row.kind is RowKind.PREFILL and row.first_position == 0:
                history = torch.tensor(row.request.padding + row.request.prompt, dtype=torch.long)
                self.token_buffer[row.request.slot, : history.numel()].copy_(history, non_blocking=True)
        batch, sample_rows = self._pack(rows)
        logits = self._forward(batch)
        self.pending.append(self._sample(rows, sample_rows, logits))
        keep = 1 if self.config.delayed_verification else 0
        while len(self.pending) > keep:
            self._read(self.pending.popleft())

    # --- pack -----------------------------------------------------------------------------------
    def _pack(self, rows: list[ScheduledRow]) -> tuple[StepBatch, SampleRows]:
        allocator, width, k = self.cache.allocator, self.layout.history_width, self.k
        gather, positions, slots = [], [], []
        query_start, context_lens, tables = [0], [], []
        recent_start, selection_slot, num_selected = [], [], []
        verify_slots, num_old_keys, budgets = [], [], []
        s = SampleRows(*([] for _ in range(12)))
        for row in rows:
            request = row.request
            base = request.slot * width + request.history_offset
            first_token = query_start[-1]
            for position in range(row.first_position, row.context_len):
                gather.append(base + position)
                positions.append(position)
                slots.append(allocator.slot(request.request_id, position))
            query_start.append(first_token + row.num_tokens)
            context_lens.append(row.context_len)
            tables.append(allocator.page_table(request.request_id))
            is_draft = row.kind is RowKind.DRAFT
            recent_start.append(request.recent_start if is_draft else 0)
            num_selected.append(request.num_selected if is_draft else 0)
            selection_slot.append(request.slot if is_draft else 0)
            if row.kind is RowKind.VERIFY:
                verify_slots.append(request.slot)
                num_old_keys.append(row.first_position)
                budgets.append(row.budget)
                if self.config.selection == "streaming":
                    self._write_streaming_selection(row)
            if not row.samples:
                continue
            sampled = range(first_token + row.num_tokens - 1 if row.kind is not RowKind.VERIFY else first_token,
                            first_token + row.num_tokens)
            logits_rows = []
            for token in sampled:
                logits_rows.append(len(s.logits_index))
                s.logits_index.append(token)
                s.row_slots.append(request.slot)
                s.prefix_lens.append(request.history_offset + positions[token] + 1)
                s.groups.append(request.processor_group)
                s.batch_rows.append(request.batch_row)
            if row.kind is RowKind.PREFILL:
                s.prefill += logits_rows
                s.prefill_write.append(base + row.context_len)
            elif row.kind is RowKind.DRAFT:
                s.draft += logits_rows
                s.draft_write.append(base + row.context_len)
                s.draft_prob_index.append(request.slot * k + row.draft_index - 1)
            else:
                s.verify.append(logits_rows)
                s.verify_base.append(base + row.first_position + 1)
        num_prefill, num_verify, num_draft = (sum(r.kind is kind for r in rows) for kind in RowKind)
        v0, v1 = query_start[num_prefill], query_start[num_prefill + num_verify]
        max_pages = max(len(t) for t in tables)
        device = self.device

        def ints(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=device)

        batch = StepBatch(
            backend=self.backend,
            cache=self.cache,
            num_prefill_rows=num_prefill,
            num_verify_rows=num_verify,
            num_draft_rows=num_draft,
            verify_tokens=(v0, v1),
            input_ids=self.token_buffer.view(-1)[ints(gather, torch.long)][None],
            position_ids=ints(positions, torch.long)[None],
            slot_mapping=ints(slots, torch.long),
            page_table=ints([t + [0] * (max_pages - len(t)) for t in tables]),
            query_start=ints(query_start),
            context_lens=ints(context_lens),
            recent_start=ints(recent_start),
            selection_slot=ints(selection_slot),
            num_selected=ints(num_selected),
            verify_query_start=ints([q - v0 for q in query_start[num_prefill : num_prefill + num_verify + 1]]),
            verify_slots=ints(verify_slots, torch.long),
            num_old_keys=ints(num_old_keys),
            budgets=ints(budgets),
            max_num_old_keys=max(num_old_keys, default=0),
            max_budget=self.layout.max_budget,
            score_verify_rows=self.config.selection == "pillar",
            max_context=max(context_lens),
            logits_indices=ints(s.logits_index, torch.long),
        )
        batch.host = HostPlan(query_start, context_lens, num_prefill + num_verify, recent_start, num_selected, device)
        batch.plan = self.backend.plan(batch.host)
        return batch, s

    def _write_streaming_selection(self, row: ScheduledRow) -> None:
        """Streaming baseline: the first sink tokens and the newest keys before the block, all layers."""
        sink = min(self.config.num_sink_tokens, row.budget)
        newest = range(row.first_position - (row.budget - sink), row.first_position)
        positions = torch.tensor([*range(sink), *newest], dtype=torch.int32, device=self.device)
        self.cache.selected[:, row.request.slot, :, : positions.numel()] = positions

    # --- forward --------------------------------------------------------------------------------
    def _forward(self, batch: StepBatch) -> torch.Tensor:
        kwargs = {self._cache_kwarg: self.cache}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = batch.logits_indices
        self.cache.active_step = batch
        try:
            outputs = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                use_cache=True,
                sparsespec_step=batch,
                **kwargs,
            )
        finally:
            self.cache.active_step = None
        if not self._checked_attention:
            self._checked_attention = True
            if batch.attention_calls != self.geometry.num_layers:
                raise NotImplementedError(
                    f"{type(self.model).__name__} ran {batch.attention_calls} of its {self.geometry.num_layers} "
                    "attention layers through transformers' AttentionInterface; hf_sparsespec needs all of them"
                )
        logits = outputs.logits[0]
        if not self._logits_to_keep:
            logits = logits[batch.logits_indices]
        return logits.float()  # [num_logits_rows, vocab]

    # --- sample and accept (device) -------------------------------------------------------------
    def _process_logits(self, s: SampleRows, logits: torch.Tensor) -> torch.Tensor:
        if len(self.pipelines) == 1:
            return self.pipelines[0](logits, self.token_buffer, s.row_slots, s.prefix_lens, s.batch_rows)
        scores = logits.clone()
        for group, pipeline in enumerate(self.pipelines):
            rows = [i for i, g in enumerate(s.groups) if g == group]
            if rows:
                index = torch.tensor(rows, device=self.device)
                scores[index] = pipeline(
                    logits[index],
                    self.token_buffer,
                    [s.row_slots[i] for i in rows],
                    [s.prefix_lens[i] for i in rows],
                    [s.batch_rows[i] for i in rows],
                )
        return scores

    def _sample(self, rows: list[ScheduledRow], s: SampleRows, logits: torch.Tensor) -> StepOutputs:
        device = self.device
        flat_tokens = self.token_buffer.view(-1)

        def index(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        scores = self._process_logits(s, logits)
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1)
            tokens = sample_from(probs) if scores.shape[0] else scores.new_empty(0, dtype=torch.long)
        else:
            probs = None
            tokens = scores.argmax(dim=-1)
        host_parts = []
        if s.prefill:
            first_tokens = tokens[index(s.prefill)]
            flat_tokens[index(s.prefill_write)] = first_tokens
            host_parts.append(first_tokens)
        if s.verify:
            host_parts.append(self._accept(s, tokens, probs).flatten())
        if s.draft:
            draft_rows = index(s.draft)
            self._store_drafts(s, tokens[draft_rows], None if probs is None else probs[draft_rows])
        values = torch.cat(host_parts) if host_parts else torch.zeros(0, dtype=torch.long, device=device)
        host, ready = self.reader.start(values)
        return StepOutputs(rows, host, ready)

    def _store_drafts(self, s: SampleRows, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None) -> None:
        """Keep this iteration's drafts (and their processed probabilities) for the verification."""
        self.token_buffer.view(-1)[torch.tensor(s.draft_write, device=self.device)] = draft_tokens
        if draft_probs is not None:
            self.draft_probs[torch.tensor(s.draft_prob_index, device=self.device)] = draft_probs

    def _accept(self, s: SampleRows, tokens: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor:
        """Accept/reject every verification row at once: `[num_verify, k + 2]` = [accepted, drafts, next]."""
        device, k = self.device, self.k
        num_drafts = [len(rows) - 1 for rows in s.verify]
        padded = [rows + [rows[-1]] * (k + 1 - len(rows)) for rows in s.verify]
        logits_rows = torch.tensor(padded, dtype=torch.long, device=device)  # [num_verify, k + 1]
        draft_index = torch.tensor(
            [[base + min(i, max(m - 1, 0)) for i in range(k)] for base, m in zip(s.verify_base, num_drafts)],
            dtype=torch.long,
            device=device,
        )
        draft_tokens = self.token_buffer.view(-1)[draft_index]  # [num_verify, k]
        m = torch.tensor(num_drafts, dtype=torch.long, device=device)
        if probs is None:
            accepted, next_token = accept_greedy(draft_tokens, m, tokens[logits_rows])
        else:
            slots = torch.tensor([s.row_slots[rows[0]] for rows in s.verify], dtype=torch.long, device=device)
            draft_rows = (slots[:, None] * k + torch.arange(k, device=device)[None, :]).flatten()
            draft_probs = self.draft_probs[draft_rows].view(len(s.verify), k, -1)
            accepted, next_token = accept_sampled(draft_tokens, m, probs[logits_rows], draft_probs)
        write = torch.tensor(s.verify_base, dtype=torch.long, device=device) + accepted
        self.token_buffer.view(-1)[write] = next_token
        return torch.cat([accepted[:, None], draft_tokens, next_token[:, None]], dim=1)

    # --- read results (host) --------------------------------------------------------------------
    def _read(self, outputs: StepOutputs) -> None:
        values = self.reader.finish(outputs.host_values, outputs.ready)
        cursor = 0
        prefill = [r for r in outputs.rows if r.kind is RowKind.PREFILL and r.samples]
        verify = [r for r in outputs.rows if r.kind is RowKind.VERIFY]
        for row in prefill:
            token = values[cursor]
            cursor += 1
            request = row.request
            if request.finished:
                continue
            kept, reason = self.stop_checker.commit(request, [token])
            request.stats.generated_tokens += kept
            self._emit(request, [token])
            if reason is not None:
                self._finish(request, reason)
        for row in verify:
            block = values[cursor : cursor + self.k + 2]
            cursor += self.k + 2
            request = row.request
            if request.finished:
                continue
            accepted, drafts, next_token = block[0], block[1 : 1 + self.k], block[-1]
            committed = drafts[:accepted] + [next_token]
            kept, reason = self.stop_checker.commit(request, committed)
            request.stats.record_cycle(drafted=row.num_tokens - 1, accepted=kept - 1)
            request.stats.generated_tokens += kept
            self._emit(request, committed[:kept])
            self.scheduler.commit_verification(request, kept)
            if reason is not None:
                self._finish(request, reason)
            else:
                self.scheduler.start_cycle(request, self.scheduler.iteration)

    def _emit(self, request: Request, tokens: list[int]) -> None:
        if self.on_tokens is not None:
            self.on_tokens(request, tokens)

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        if self.on_finish is not None:
            self.on_finish(request)
