"""ModelRunner: the device side of an iteration, its static buffers, and its CUDA graphs.

    run(batch):  upload (one copy) -> [apply new page-table entries] -> step on the device -> start
                 the copy of the results to pinned host memory (read later, behind an event)

The device step is one function: gather input ids from the token buffer, the unmodified
transformers forward with the `"sparsespec"` attention, logits processing, sampling, acceptance, and
the writes of drafts / first tokens / committed tokens back into the token buffer and of the
results into a static buffer. It reads nothing but device buffers whose addresses never change, so an
iteration of a padded bucket shape (no prefill rows) is captured once per shape in a CUDA graph and
replayed afterwards, and a new shape replays a larger captured one while it is new (`graph_buckets`);
other iterations, every iteration on CPU, and pipelines with host-synchronising logits processors run
the same function eagerly.

Buffers owned here (the last row of every per-slot buffer is the dummy slot that padding writes):
    token_buffer  [num_slots + 1, history_width] int64  every request's padding, prompt and tokens
    draft_store   [(num_slots + 1) * k, vocab]           the drafts' distributions (sampling only): their logits
                  (the model's dtype; float32 after history processors) and stats [.., 2] fp32 with temperature
                  alone, [.., 3] with top-k / top-p; else fp32 probabilities
    page_table    [num_slots + 1, max_pages] int32      every slot's pages (updated with new entries)
    staging (x2, pinned) / metadata                     the int32 fields of `batch.StepShape.fields`
    results       int64: per verify slot [accepted, k drafts, next], then the one-token rows' tokens
                  (plain steps and drafts), then prefill first tokens
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from hf_sparsespec.batch import HostBatch, StepShape, aligned
from hf_sparsespec.config import DIAGONAL_SELECTIONS, INDUCTION_SELECTIONS, SCORED_SELECTIONS
from hf_sparsespec.graph_buckets import Bucket, GraphBuckets
from hf_sparsespec.kernels.attention_plan import AttentionPlan, block_sizes
from hf_sparsespec.ops import ScoringAside, scoring_stream
from hf_sparsespec.packed_projections import FuseSiblingLinears, call_packed
from hf_sparsespec.sampling import Distributions, LogitsPipeline, LogitsRows, accept_greedy
from hf_sparsespec.step import StepBatch

logger = logging.getLogger(__name__)

# captured shapes kept; later shapes borrow a larger graph or run eagerly (`graph_buckets`). The graphs
# share one memory pool (a capture reuses what the previous ones freed); at 256 requests on the H200 a
# capture costs ~63 ms and an eager iteration ~58 ms (docs/measurements.md 9): a batch whose requests
# finish at different iterations passes through a few hundred padded shapes (a cap of 64 left 3,155 of
# 17,501 iterations eager at 256 x 8192)
MAX_GRAPHS = 512
# With temperature alone or temperature -> top-k -> top-p, read the distributions from the logits and
# each row's stats (no float32 probabilities written; the drafts' store keeps logits). 0 writes them
# (`tempered_softmax`, `truncated_softmax`), as before: the same tokens, kept as an ablation
# (`benchmarks/e2e_throughput.py`'s `_fromlogits0` runs).
SAMPLE_FROM_LOGITS = 1
# 1: a compiled forward's GEMMs are autotuned by inductor (its Triton templates against cuBLAS, per shape
# hint; minutes more compilation). 0 leaves them to cuBLAS. Off: at 496 tokens on an H100 its picks for
# the three projections timed were 5-36 % slower than cuBLAS (docs/measurements.md 40;
# `benchmarks/bench_gemms.py --autotune`), at 136 tokens tied or up to 24 % slower, and a 64-row
# iteration took 2.1 % longer with it (docs/measurements.md 41).
AUTOTUNE_GEMMS = 0
# 1: the compiled forward's Triton kernels use programmatic dependent launch (inductor's
# `triton.enable_pdl`, torch >= 2.10, Hopper and later): a kernel's launch and set-up overlap the end of
# the one before it. Off: a 256-row SparseSpec iteration took 4.7 % longer with it on an H100
# (docs/measurements.md 41; `_pdl1` runs).
INDUCTOR_PDL = 0


@dataclass
class StepViews:
    """Device views of one shape's fields in the metadata buffer, and their offsets in the staging buffers."""

    shape: StepShape
    fields: dict[str, torch.Tensor]  # int32
    wide: dict[str, torch.Tensor]  # the same fields as int64 (indices), filled by one copy per step
    offsets: dict[str, tuple[int, int]]  # (start, count) of each field in the staging buffers
    size: int


@dataclass
class RunnerCounters:
    """What the runner did (for benchmarks and tuning): iterations by mode, graphs, and, when
    `ModelRunner.time_iterations` is set, one (start, end) CUDA event pair per iteration that spans
    its upload, device step and result copy."""

    eager_iterations: int = 0
    graph_replays: int = 0
    graphs_captured: int = 0
    capture_seconds: float = 0.0
    iteration_events: list = dataclasses.field(default_factory=list)

    def gpu_milliseconds(self) -> list[float]:
        """Device time of each timed iteration (synchronises)."""
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in self.iteration_events]


@dataclass
class PendingResults:
    """An iteration in flight: its batch and where its results land on the host."""

    batch: HostBatch
    values: torch.Tensor  # int64 [num_results], pinned host memory on CUDA
    ready: torch.cuda.Event | None

    def read(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.values.tolist()


class ModelRunner:
    """Static buffers, the device step, capture and replay (see the module docstring)."""

    def __init__(self, model, cache, backend, pipeline: LogitsPipeline, do_sample: bool, *, k: int,
                 num_slots: int, history_width: int, largest: StepShape, max_page_updates: int, vocab_size: int,
                 group: int, selection: str, num_sink_tokens: int, use_graphs: bool, cache_kwarg: str,
                 logits_to_keep: bool, max_context: int, compile_forward: bool | str = False,
                 tp_group=None, overlap_scoring: bool = False, compiles_plain_shapes: bool = False,
                 score_after_forward: bool | None = None, pack_projections: bool = False) -> None:  # fmt: skip
        self.model, self.cache, self.backend, self.pipeline = model, cache, backend, pipeline
        self.do_sample, self.k, self.num_slots, self.selection = do_sample, k, num_slots, selection
        self.num_sink_tokens, self.group = num_sink_tokens, group
        self.cache_kwarg, self.logits_to_keep, self.max_context = cache_kwarg, logits_to_keep, max_context
        self.scores_verify_rows = selection in SCORED_SELECTIONS and k > 0
        # tensor parallelism: every process runs this engine on its share of the heads; the sampled
        # tokens and acceptances of the group's first process are everyone's (broadcast)
        self.tp_group = tp_group
        device = cache.layers[0].keys.device
        self.device = device
        self.token_buffer = torch.zeros((num_slots + 1, history_width), dtype=torch.long, device=device)
        # temperature alone (min-length bans aside), or temperature -> top-k -> top-p (history processors
        # first): the distributions are read from the logits and each row's stats, never written out
        # (`kernels.tempered_softmax`); the drafts' store keeps logits too
        self.temperature = pipeline.fused_temperature if do_sample else None
        self.truncation = pipeline.fused_truncation if do_sample and self.temperature is None else None
        self.from_logits = (self.temperature is not None or self.truncation is not None) and bool(SAMPLE_FROM_LOGITS)
        # greedy with min-length bans at most: the argmax of the model's logits (bans in place on them), as
        # of their float32 copy (the conversion is exact and keeps the order), without writing that copy
        self.greedy_on_logits = not do_sample and all(kind == "min_length" for _, kind in pipeline.steps)
        self.draft_store: Distributions | None = None  # the drafts' distributions until their verification
        if do_sample and k > 0:
            rows = (num_slots + 1) * k
            if self.from_logits:
                t = self.truncation
                dtype = logits_dtype(model) if t is None or t.bans_only else torch.float32  # the processors' scores
                values = torch.zeros((rows, vocab_size), dtype=dtype, device=device)
                stats = torch.zeros((rows, 2 if t is None else 3), dtype=torch.float32, device=device)
                self.draft_store = Distributions(values, stats, self.temperature if t is None else t.temperature)
            else:
                self.draft_store = Distributions(torch.zeros((rows, vocab_size), dtype=torch.float32, device=device))
        max_pages = -(-history_width // cache.page_size)
        self.page_table = torch.zeros((num_slots + 1, max_pages), dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        size = largest.size + 2 * max_page_updates
        # Two staging buffers, alternating: the host fills one while the other's copy may still be queued.
        self.staging = [torch.zeros(size, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self.staging_uploaded: list[torch.cuda.Event | None] = [None, None]
        self.staging_index = 0
        self.metadata = torch.zeros(size, dtype=torch.int32, device=device)
        self.metadata_wide = torch.zeros(size, dtype=torch.long, device=device)  # its int64 copy, for indexing
        # the one-token rows' tokens: as many as an iteration has rows at most (a bucket may pad past the slots)
        num_results = largest.num_verify_rows * (k + 2) + largest.num_rows + largest.num_prefill_samples
        self.results = torch.zeros(num_results, dtype=torch.long, device=device)
        self.result_ring = [torch.zeros(num_results, dtype=torch.long, pin_memory=pinned) for _ in range(3)]
        self.ring_index = 0
        self.part_out = self.part_lse = None
        if backend.needs_plan:
            num_q_heads, head_dim, part_rows = cache.num_kv_heads * group, cache.head_dim, largest.plan.num_part_rows
            self.part_out = torch.empty((part_rows, num_q_heads, head_dim), dtype=torch.float32, device=device)
            self.part_lse = torch.empty((part_rows, num_q_heads), dtype=torch.float32, device=device)
        # every layer's verification scores, selected from after the forward in one launch
        self.scores = None
        if self.scores_verify_rows:
            shape = (cache.num_layers, largest.num_verify_rows, cache.num_kv_heads, history_width)
            self.scores = torch.empty(shape, dtype=torch.float32, device=device)
        # `overlap_scoring`: the scoring passes on a second stream, reading copies of the verification
        # rows' queries and LSE (at most every request verifying, k + 1 tokens each)
        # `score_after_forward`: the layers only copy them; every layer is scored after the forward, in one call
        # (None: unless `overlap_scoring` or layers with different scales, which then score themselves)
        self.scoring_stream = self.aside_query = self.aside_lse = None
        overlap = overlap_scoring and backend.needs_plan and device.type == "cuda"
        self.score_scale = None
        if self.scores is not None and score_after_forward is not False and not overlap_scoring:
            scales = attention_scales(model, cache.head_dim)
            if len(scales) == 1:
                self.score_scale = scales.pop()
            elif score_after_forward:
                raise NotImplementedError(
                    f"SparseSpecConfig.score_after_forward=True needs one attention scale for every layer; "
                    f"{type(model).__name__}'s layers use {sorted(scales)} (leave it None: each layer scores itself)"
                )
        self.score_after_forward = self.score_scale is not None
        if self.scores is not None and (overlap or self.score_after_forward):
            self.scoring_stream = scoring_stream(device.index) if overlap else None  # a tensor's device: indexed
            copies = largest.num_verify_rows * (k + 1)
            num_q_heads, dtype = cache.num_kv_heads * group, cache.layers[0].keys.dtype
            self.aside_query = torch.empty((cache.num_layers, copies, num_q_heads, cache.head_dim), dtype=dtype,
                                           device=device)  # fmt: skip
            self.aside_lse = torch.empty((cache.num_layers, copies, num_q_heads), dtype=torch.float32, device=device)
        # who writes the moved-key store: the verifications its first (k + 1) x group entries ("diagonal",
        # "induction_diagonal"), the induction lookup before each iteration's drafts the rest
        has_store = cache.moved_offsets is not None
        self.verify_moves = (k + 1) * group if selection in DIAGONAL_SELECTIONS and has_store else 0
        self.induction = selection in INDUCTION_SELECTIONS and has_store
        self.best = None  # the diagonal moves' workspace (Triton), per layer: zeros, and zeroed again after each use
        if backend.needs_plan and self.verify_moves:
            shape = (cache.num_layers, largest.num_verify_rows, cache.num_kv_heads, self.verify_moves)
            self.best = torch.zeros(shape, dtype=torch.int64, device=device)
        self.use_graphs = use_graphs and device.type == "cuda" and backend.needs_plan and pipeline.graph_safe
        self.graphs: dict[StepShape, tuple[torch.cuda.CUDAGraph, StepViews]] = {}
        self.buckets = GraphBuckets(k + 1, num_slots)  # which buckets have graphs, which a new bucket borrows
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.capture_stream = torch.cuda.Stream(device) if self.use_graphs else None
        self.checked_attention = False
        # padded decode iterations may run the forward compiled (the attention ops as custom ops); the
        # iterations' sizes vary independently, so equal sizes must not share a symbol (duck shaping)
        self.compiled_forward = None
        self.fuse_projections = None
        self.compiled_layers: list[tuple[torch.nn.Module, object]] = []
        self.compiles_plain_shapes = compiles_plain_shapes or k == 0
        if compile_forward:
            import torch.fx.experimental._config as fx_config

            fx_config.use_duck_shape = False
            # with the sibling projections packed (the engine packs them around the run), the compiled
            # graphs fuse them and live under `call_packed`'s code (packed_projections.py's invariant)
            self.fuse_projections = FuseSiblingLinears() if pack_projections else None

            def through(function):
                return functools.partial(call_packed, function) if pack_projections else function

            if compile_forward == "layers":  # one graph for every decoder layer: the layer index symbolic
                # automatic dynamic shapes (dynamic=None), not dynamic=True: a layer's inputs (hidden states,
                # rotary tables) would get every dimension symbolic, and the modules' ints (`head_dim`, made
                # unspecialisable for `layer_idx`) too, so the elementwise kernels would index with divisions
                # by runtime head sizes. Compiled static first, a layer recompiles once for the index (it
                # changes from layer to layer) and once for the iteration's sizes (buckets): ~3 graphs.
                self.compiled_layers = [(layer, torch.compile(through(layer._call_impl), dynamic=None))
                                        for layer in decoder_layers(model)]  # fmt: skip
                self.compiled_forward = self._model_logits_compiled_layers
            else:
                self.compiled_forward = torch.compile(through(self._model_logits), dynamic=True)
        self.counters = RunnerCounters()
        self.time_iterations = False

    # --- the host-facing calls --------------------------------------------------------------------
    def write_history(self, slot: int, tokens: list[int]) -> None:
        """Put a newly admitted request's padding and prompt into its row of the token buffer."""
        history = torch.tensor(tokens, dtype=torch.long)
        if self.device.type == "cuda":
            history = history.pin_memory()
        self.token_buffer[slot, : len(tokens)].copy_(history, non_blocking=True)

    def bucket(self, verify_rows: int, single_rows: int, shifted: bool) -> Bucket:
        """The bucket to build a padded decode iteration for (`graph_buckets.GraphBuckets.choose`):
        with graphs, a new bucket replays a larger captured one while it is new."""
        if not self.use_graphs:
            return verify_rows, single_rows, shifted
        return self.buckets.choose((verify_rows, single_rows, shifted))

    def run(self, batch: HostBatch) -> PendingResults:
        shape = batch.shape
        captured = self.graphs.get(shape) if self.use_graphs and shape.padded else None
        views = captured[1] if captured is not None else self._views(shape)
        start = end = None
        if self.time_iterations:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        self._upload(batch, views)
        if captured is not None:
            captured[0].replay()
            self.counters.graph_replays += 1
        else:
            self._step(views, batch)
            self.counters.eager_iterations += 1
            # a bucket seen once may be a transient (requests joining or leaving): captured when seen again
            if self.use_graphs and shape.padded and len(self.graphs) < MAX_GRAPHS:
                if self.buckets.ran_eagerly(_bucket_of(shape)):
                    self._capture(shape, views)
        pending = self._start_read(batch)
        if end is not None:
            end.record()
            self.counters.iteration_events.append((start, end))
        return pending

    # --- buffers ----------------------------------------------------------------------------------
    def _views(self, shape: StepShape) -> StepViews:
        offsets, offset = {}, 0
        for name, count in shape.fields():
            offsets[name] = (offset, count)
            offset += aligned(count)
        n = shape.num_logits
        views = {"work": (-1, 5), "merge": (-1, 5), "draft_index": (shape.num_verify_rows, self.k),
                 "logits_params": (shape.num_params, n), "logits_stream": (n, 2),
                 "accept_key": (shape.num_verify_rows, self.k, 2)}  # fmt: skip

        def fields_of(buffer: torch.Tensor) -> dict[str, torch.Tensor]:
            fields = {name: buffer[start : start + count] for name, (start, count) in offsets.items()}
            return fields | {name: fields[name].view(view) for name, view in views.items()}

        return StepViews(shape, fields_of(self.metadata), fields_of(self.metadata_wide), offsets, offset)

    def _upload(self, batch: HostBatch, views: StepViews) -> None:
        """Fill a staging buffer, copy it to the device at once, apply the new page-table entries."""
        index = self.staging_index
        self.staging_index = 1 - index
        if self.staging_uploaded[index] is not None:
            self.staging_uploaded[index].synchronize()  # its last copy was queued two iterations ago
        staging = self.staging[index]
        host = staging.numpy()
        for name, values in batch.arrays.items():
            start, count = views.offsets[name]
            host[start : start + count] = values
        pages, values = batch.page_updates
        updates, start = len(pages), views.size
        host[start : start + updates] = pages
        host[start + updates : start + 2 * updates] = values
        size = start + 2 * updates
        self.metadata[:size].copy_(staging[:size], non_blocking=True)
        if self.device.type == "cuda":
            self.staging_uploaded[index] = torch.cuda.Event()
            self.staging_uploaded[index].record()
        if updates:
            self.page_table.view(-1)[self.metadata[start : start + updates].long()] = self.metadata[start + updates : size]

    def _start_read(self, batch: HostBatch) -> PendingResults:
        n = batch.num_results
        if self.device.type != "cuda":
            return PendingResults(batch, self.results[:n].clone(), None)
        host = self.result_ring[self.ring_index][:n]
        self.ring_index = (self.ring_index + 1) % len(self.result_ring)
        host.copy_(self.results[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingResults(batch, host, event)

    def _capture(self, shape: StepShape, views: StepViews) -> None:
        """Record the step of `shape` (its eager run just happened: kernels are compiled). Capturing
        records without executing; replays then run it with whatever the buffers hold."""
        began = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        stream = self.capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=self.pool)
                try:
                    self._step(views, None)
                finally:
                    graph.capture_end()
        except Exception as error:  # a model or processor that cannot be captured: stay eager
            logger.warning("hf_sparsespec: CUDA graph capture failed, running eagerly: %s", error)
            self.use_graphs = False
            torch.cuda.synchronize()
            return
        torch.cuda.current_stream().wait_stream(stream)
        self.graphs[shape] = (graph, views)
        self.buckets.add(_bucket_of(shape))
        self.counters.graphs_captured += 1
        self.counters.capture_seconds += time.perf_counter() - began

    # --- the device step ----------------------------------------------------------------------------
    def _step(self, views: StepViews, batch: HostBatch | None) -> None:
        """One iteration on the device (eager, or recorded into a graph when `batch` is None)."""
        shape, f, w = views.shape, views.fields, views.wide
        spec = shape.spec_len
        flat_tokens = self.token_buffer.view(-1)
        # the index fields as int64, one copy for all of them (the forward's own inputs are copies of
        # their own below: a compiled forward must see fresh tensors every iteration, shifted or not)
        self.metadata_wide[: views.size].copy_(self.metadata[: views.size])
        if self.selection == "streaming" and shape.num_verify_rows:
            self._write_streaming_selection(w)
        position, input_index, kv_slot = f["position"].long(), w["input_index"], f["kv_slot"].long()
        context_lens = f["context_len"]
        single_write, prefix_len = w["single_write"], w["logits_prefix_len"]
        if shape.shifted:  # speculative rows: add the accepted counts of the previous iteration's verifications
            position, input_index, kv_slot, context_lens, single_write, prefix_len = self.backend.shift_speculative_rows(
                self.results, w["shift_index"], w["token_row"], w["row_slot"], w["single_row"], w["logits_row"],
                self.page_table, self.cache.page_size, position, input_index, kv_slot, context_lens, single_write,
                prefix_len,
            )  # fmt: skip
        else:
            # a copy, not a view of the metadata buffer, as the shift's results are: a compiled forward guards
            # on its inputs' aliasing, and a view in one iteration and a fresh tensor in the next recompiled it
            context_lens = context_lens.clone()
        if self.induction and shape.num_single_rows:  # after the shift: each draft's own position and token
            reads = single_write - 1  # each draft row's last token, the one it reads
            # the store's entries after the diagonal's (if any)
            self.backend.write_induction_keys(self.cache.moved_offsets, self.verify_moves, self.token_buffer, reads,
                                              w["single_row_base"], f["single_recent_start"])  # fmt: skip
        compiled = self._compiles(shape)
        # the host count of full rows feeds the reference backend; a compiled forward reads the tensor
        # instead and must see the same ints when replayed as when captured (or it would recompile there)
        num_full_rows = shape.num_prefill_rows
        if batch is not None and not compiled:  # the builder's count: prefill, verify and plain rows
            num_full_rows = int(batch.arrays["num_full_rows"][0])
        step = StepBatch(
            backend=self.backend,
            cache=self.cache,
            num_full_rows=num_full_rows,
            slot_mapping=kv_slot,
            page_table=self.page_table.index_select(0, f["row_slot"]),
            query_start=f["query_start"],
            context_lens=context_lens,
            recent_start=f["recent_start"],
            selection_slot=f["selection_slot"],
            num_selected=f["num_selected"],
            plan=self._plan(shape, f),
            num_verify_rows=shape.num_verify_rows,
            spec_len=shape.spec_len,
            verify_page_table=None,
            verify_query_start=f["verify_query_start"],
            num_old_keys=f["num_old_keys"],
            budgets=f["budget"],
            verify_slots=f["verify_slot"].long(),
            scores=self.scores[:, : shape.num_verify_rows] if self.scores is not None else None,
            max_verify_rows=self.scores.shape[1] if self.scores is not None else None,
            score_verify_rows=self.scores_verify_rows,
            best=self.best[:, : shape.num_verify_rows] if self.best is not None else None,
            verify_moves=self.verify_moves,
            max_context=self.max_context,
            compiled=compiled,
            num_full_rows_tensor=f["num_full_rows"],
            score_scale=self.score_scale,
        )
        p = shape.num_prefill_rows
        step.verify_page_table = step.page_table[p : p + shape.num_verify_rows]
        v, s = shape.num_verify_rows, shape.num_single_rows
        if (self.scoring_stream is not None or self.score_after_forward) and v:
            step.aside = ScoringAside.for_step(self.scoring_stream, self.aside_query, self.aside_lse,
                                               f["verify_query_start"], v * spec, shape.num_tokens,
                                               deferred=self.score_after_forward)  # fmt: skip
        logits = self._forward(flat_tokens[input_index][None], position[None], f["logits_token"].long(), step)
        if step.aside is not None and step.aside.stream is not None:  # every layer's scores, before selecting
            torch.cuda.current_stream().wait_stream(self.scoring_stream)
        moves = self.cache.moved_offsets[..., : self.verify_moves] if self.verify_moves else None
        if step.aside is not None and step.aside.deferred:  # every layer's scores, from the copies
            self.backend.score_layers(self.aside_query[:, : v * spec], self.cache.key_pool, step.verify_page_table,
                                      step.aside.query_start, self.aside_lse[:, : v * spec], step.num_old_keys,
                                      step.scores, self.score_scale, step.verify_slots, spec, offsets=moves,
                                      best=step.best, max_rows=step.max_verify_rows)  # fmt: skip
        if v and self.scores_verify_rows:  # the verifications' new selections, every layer at once
            self.backend.select_verified_keys(step.scores, step.num_old_keys, step.budgets, self.cache.selected,
                                              step.verify_slots, moves, step.best, self.group,
                                              num_selectable_keys=f["num_selectable_keys"])  # fmt: skip
        # Verifications sample inside the acceptance; one-token rows and first tokens sample here, each row from
        # the noise of its own key (request, position of the drawn token, purpose: `sampling.sample_keys`).
        rows = LogitsRows(
            slot=w["logits_slot"],
            prefix_len=prefix_len,
            params=w["logits_params"],
            host=batch.host_rows if batch is not None else None,
        )
        truncation = self.truncation
        dists = scores = None
        if self.temperature is not None:
            logits = self.pipeline.ban_eos_in_place(logits, rows)
            if self.from_logits:  # one pass over the model's logits: each row's stats
                self._match_store_dtype(logits)
                dists = Distributions(logits, self.backend.softmax_stats(logits, self.temperature), self.temperature)
            else:  # the ablation: the probabilities written out
                dists = Distributions(self.backend.tempered_softmax(logits, self.temperature))
        elif self.do_sample and truncation is not None:  # top-k / top-p without sorting the vocabulary
            t = truncation
            if t.bans_only:  # in place on the model's logits, as the temperature-only path
                history = self.pipeline.ban_eos_in_place(logits, rows)
            else:
                history = self.pipeline(logits.float(), self.token_buffer, rows, t.num_history_steps)
            truncated = (history, t.temperature, t.top_k, t.top_p, t.min_tokens_to_keep)
            if self.from_logits:  # one topk and one pass over the scores: each row's stats and threshold
                self._match_store_dtype(history)
                dists = Distributions(history, self.backend.truncation_stats(*truncated), t.temperature)
            else:
                dists = Distributions(self.backend.truncated_softmax(*truncated))
        elif self.greedy_on_logits:
            scores = self.pipeline.ban_eos_in_place(logits, rows)
        else:
            scores = self.pipeline(logits.float(), self.token_buffer, rows)
            dists = Distributions(torch.softmax(scores, dim=-1)) if self.do_sample else None
        keys = self.backend.position_keys(f["logits_stream"], prefix_len)
        if dists is not None:
            sampled = dists[v * spec :]
            tokens = self.backend.keyed_sample(sampled.values, keys[v * spec :], sampled.stats, sampled.temperature)
        else:
            tokens = scores.argmax(dim=-1)[v * spec :]
        tokens = self._same_on_every_process(tokens)

        results = []
        if v:
            draft_tokens = flat_tokens[w["draft_index"]]  # [v, k]
            num_drafts = w["num_drafts"]
            if dists is None:
                targets = scores[: v * spec].argmax(dim=-1).view(v, spec)
                accepted, next_token = accept_greedy(draft_tokens, num_drafts, targets)
            else:
                accepted, next_token = self._accept_sampled(dists[: v * spec], draft_tokens, num_drafts,
                                                            w["draft_prob_row"].view(v, self.k), keys[: v * spec],
                                                            f["accept_key"])  # fmt: skip
            flat_tokens[w["verify_base"] + accepted] = next_token
            results.append(torch.cat([accepted[:, None], draft_tokens, next_token[:, None]], dim=1).view(-1))
        if s:  # plain steps' tokens are committed, drafts' verified later: the next rows read both
            single = dists[v * spec : v * spec + s] if dists is not None else None
            self._store_drafts(single_write, f["single_prob_index"], tokens[:s], single)
            results.append(tokens[:s])
        if shape.num_prefill_samples:
            first = tokens[s:]
            flat_tokens[w["prefill_write"]] = first
            results.append(first)
        if results:
            values = torch.cat(results)
            self.results[: values.shape[0]].copy_(values)

    def _same_on_every_process(self, values: torch.Tensor) -> torch.Tensor:
        """Random choices of the tensor-parallel group's first process (the logits are the same on
        every process, the random streams need not be); greedy choices agree without it."""
        if self.tp_group is None or not self.do_sample:
            return values
        import torch.distributed as dist

        dist.broadcast(values, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        return values

    def _accept_sampled(self, target: Distributions, draft_tokens, num_drafts, draft_rows, target_keys,
                        accept_keys) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Rejection sampling of the verifications' drafts (`sampling.accept_sampled`) in four launches: the
        drafted tokens' p and q, the acceptance tests (`backend.accept_drafts`) and the recovered or bonus
        tokens' draw, each reading in place. `target` holds the verifications' `v * (k + 1)` rows, the
        drafts' distributions are in their store (`draft_rows [v, k]`)."""
        v, spec = draft_tokens.shape[0], self.k + 1
        store = self.draft_store  # a verification has drafts (a cycle of none is a plain step): k > 0
        target_rows = torch.arange(v * spec, device=self.device).view(v, spec)[:, : self.k]
        p = self.backend.probabilities_at(target.values, target_rows, draft_tokens, target.stats, target.temperature)
        q = self.backend.probabilities_at(store.values, draft_rows, draft_tokens, store.stats, store.temperature)
        accepted, rows, store_rows, keys = self.backend.accept_drafts(p, q, accept_keys, num_drafts, draft_rows,
                                                                      target_keys.view(v, spec, 2))  # fmt: skip
        next_token = self.backend.keyed_sample_residual(target.values, rows, store.values, store_rows, keys,
                                                        target.stats, store.stats, target.temperature)  # fmt: skip
        return self._same_on_every_process(torch.stack([accepted, next_token]))

    def _match_store_dtype(self, logits: torch.Tensor) -> None:
        """Keep the drafts' logits in the dtype the model returns them in. The store is allocated in
        `logits_dtype(model)` (its output embeddings'); a model that returns other logits (upcast to float32
        for a softcap, say) gets its store again at its first sampled iteration: a prefill's, eager, before
        any graph has captured the store's address."""
        store = self.draft_store
        if store is None or logits.dtype == store.values.dtype:
            return
        if self.graphs:  # a captured graph writes the old store: cannot happen (prefill samples first)
            raise RuntimeError(f"hf_sparsespec: the model's logits changed dtype to {logits.dtype} mid-generation")
        values = torch.zeros(store.values.shape, dtype=logits.dtype, device=store.values.device)
        self.draft_store = Distributions(values, store.stats, store.temperature)

    def _store_drafts(self, write_index, prob_index, draft_tokens: torch.Tensor, drafts: Distributions | None):
        """Keep this iteration's one-token rows' tokens (plain steps' committed, drafts' for the
        verification) and the drafts' distributions (`prob_index` -1: plain steps and padding, nothing
        stored)."""
        self.token_buffer.view(-1)[write_index] = draft_tokens
        if drafts is not None and self.draft_store is not None:
            self.backend.store_rows(self.draft_store.values, prob_index, drafts.values)
            if drafts.stats is not None:
                self.backend.store_rows(self.draft_store.stats, prob_index, drafts.stats)

    def _plan(self, shape: StepShape, f: dict) -> AttentionPlan | None:
        if shape.plan is None:
            return None
        return AttentionPlan(
            work=f["work"], merge=f["merge"], num_part_rows=self.part_out.shape[0],
            block_m_full=shape.block_m_full, block_m_draft=block_sizes(1, self.group)[1], group=self.group,
            num_kv_heads=self.cache.num_kv_heads, part_out=self.part_out, part_lse=self.part_lse,
        )  # fmt: skip

    def _write_streaming_selection(self, w: dict) -> None:
        """Streaming baseline: each verification's request keeps its first sink tokens and the newest
        keys before the block, in every layer (positions >= the budget are unused)."""
        budget = w["budget"][:, None]
        first = w["verify_first_position"][:, None]
        index = torch.arange(self.cache.selected.shape[-1], device=self.device)[None, :]
        sink = torch.clamp(budget, max=self.num_sink_tokens)
        positions = torch.where(index < sink, index, first - budget + index).to(torch.int32)  # [v, max_budget]
        selected = self.cache.selected
        expanded = positions[None, :, None, :].expand(selected.shape[0], -1, selected.shape[2], -1)
        selected.index_copy_(1, w["verify_slot"], expanded)

    def _compiles(self, shape: StepShape) -> bool:
        """Whether the forward of `shape` runs compiled: padded decode shapes with verification rows
        and one-token rows counts of 0 or >= 2, after the first eager forward checked the attention.
        Dynamo specialises sizes 0 and 1, and the attention branches on whether any row verifies,
        so shapes with one row of a kind, or without verifications, would each compile the whole
        forward anew (88 s on the H200 in the middle of a run, docs/measurements.md 8): they run
        eagerly (in their CUDA graphs) instead. Shapes without verifications compile when plain steps
        are a phase of every request (`compiles_plain_shapes`: autoregressive mode, or
        `min_draft_context`), not only the tail of a batch."""
        if self.compiled_forward is None or not shape.padded or not self.checked_attention:
            return False
        verify, single = shape.num_verify_rows, shape.num_single_rows
        verify_ok = verify >= 2 or (verify == 0 and self.compiles_plain_shapes)
        return verify_ok and (single == 0 or single >= 2) and shape.num_tokens >= 2

    def _model_logits(self, input_ids, position_ids, logits_index, step: StepBatch) -> torch.Tensor:
        """The model's forward: logits of the rows `logits_index` (`[1, num_logits, vocab]` or all rows
        when the model takes no `logits_to_keep`)."""
        kwargs = {self.cache_kwarg: self.cache}
        if self.logits_to_keep:
            kwargs["logits_to_keep"] = logits_index
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=True, sparsespec_step=step,
                          **kwargs).logits  # fmt: skip

    def _model_logits_compiled_layers(self, input_ids, position_ids, logits_index, step: StepBatch) -> torch.Tensor:
        """`_model_logits` with each decoder layer called through its compiled call (`compile_forward=
        "layers"`), for this forward only: the layers' `layer_idx` stays a symbolic integer (the ops take
        whole stores and the index), so all layers share one graph (~3 compilations, see __init__).

        Every layer of every model compiled this way shares one code object (`Module._call_impl`), and
        dynamo keeps a code object's graphs together up to `recompile_limit` (8), then runs it eagerly:
        six configs of one tiny model in one process made 8 graphs (each new config adds 1-2 until its
        sizes are symbolic), so the limit is raised for these calls."""
        saved = [layer._compiled_call_impl for layer, _ in self.compiled_layers]
        for layer, compiled in self.compiled_layers:
            layer._compiled_call_impl = compiled
        try:
            with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, recompile_limit=LAYER_GRAPHS_LIMIT):
                return self._model_logits(input_ids, position_ids, logits_index, step)
        finally:
            for (layer, _), previous in zip(self.compiled_layers, saved):
                layer._compiled_call_impl = previous

    def _forward(self, input_ids, position_ids, logits_index, step: StepBatch) -> torch.Tensor:
        forward = self.compiled_forward if step.compiled else self._model_logits
        compile_options = {}  # read when a compilation runs
        if step.compiled and self.fuse_projections is not None:
            compile_options["pre_grad_custom_pass"] = self.fuse_projections
        if step.compiled and AUTOTUNE_GEMMS:
            compile_options["max_autotune_gemm"] = True
        if step.compiled and INDUCTOR_PDL:
            if not hasattr(torch._inductor.config.triton, "enable_pdl"):
                raise NotImplementedError(
                    f"INDUCTOR_PDL needs inductor's triton.enable_pdl (torch >= 2.10); torch {torch.__version__} has none"
                )
            compile_options["triton.enable_pdl"] = True
        self.cache.active_step = step
        try:
            with torch._inductor.config.patch(compile_options) if compile_options else nullcontext():
                logits = forward(input_ids, position_ids, logits_index, step)
        finally:
            self.cache.active_step = None
        if not self.checked_attention:
            self.checked_attention = True
            num_layers = len(self.cache.layers)
            if step.attention_calls != num_layers:
                raise NotImplementedError(
                    f"{type(self.model).__name__} ran {step.attention_calls} of its {num_layers} attention layers "
                    "through transformers' AttentionInterface; hf_sparsespec needs all of them"
                )
        logits = logits[0]
        if not self.logits_to_keep:
            logits = logits[logits_index]
        return logits  # [num_logits, vocab], the model's dtype


def logits_dtype(model) -> torch.dtype:
    """The dtype of the model's logits as most of transformers' causal LMs return them (the LM head's
    output as it is): its output embeddings', else its parameters' (`ModelRunner._match_store_dtype`
    follows a model that returns others)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else next(model.parameters()).dtype


LAYER_GRAPHS_LIMIT = 64  # dynamo graphs of the shared layer call (`_model_logits_compiled_layers`)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's repeated decoder layers: the first module list whose every entry holds an attention
    module (one with a `layer_idx`)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0 and all(
            any(hasattr(m, "layer_idx") for m in layer.modules()) for layer in module
        ):
            return list(module)
    raise NotImplementedError(
        f"SparseSpecConfig.compile_forward='layers' found no list of decoder layers in {type(model).__name__}; "
        "use compile_forward=True"
    )


def attention_scales(model, head_dim: int) -> set[float]:
    """The softmax scales `model`'s attention layers pass the attention (their modules' `scaling`,
    head_dim ** -0.5 where None): scoring every layer in one launch needs one for all of them."""
    scales = {m.scaling for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")}
    return {head_dim**-0.5 if scale is None else float(scale) for scale in scales} or {head_dim**-0.5}


def _bucket_of(shape: StepShape) -> Bucket:
    """The bucket a padded decode shape was built for (`BatchBuilder.build`): it determines the shape."""
    return shape.num_verify_rows, shape.num_single_rows, shape.shifted
