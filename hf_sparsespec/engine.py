"""Engine: one loop behind every front door.

    step():  schedule (host) -> build the batch (host, vectorised) -> run (device: one upload, then a
             CUDA-graph replay or an eager step) -> read the results of an earlier iteration (host)

The model runs unmodified: one forward per iteration over a packed batch, with the attention
implementation switched to `"sparsespec"` for the duration of `run()` and restored afterwards. Token
values flow on the device: every request's token history lives in the runner's token buffer, the
forward gathers its input ids from it, and sampling writes drafts, first tokens and committed tokens
back into it. The host reads one small int64 tensor per iteration (first tokens and verification
results), the one planned synchronisation point; with delayed verification it reads iteration t's
results only after iteration t+1 was launched, so the host schedules and packs t+1 while the device
runs t (a verifying request sits that one iteration out).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_sparsespec.attention import ATTENTION_NAME, use_attention
from hf_sparsespec.batch import BatchBuilder, DevicePageTable, StepShape
from hf_sparsespec.cache.paged_cache import SparseSpecCache
from hf_sparsespec.config import DIAGONAL_SELECTIONS, INDUCTION_SELECTIONS, SCORED_SELECTIONS, SparseSpecConfig
from hf_sparsespec.kernels import attention_plan
from hf_sparsespec.kernels.attention_plan import PlanCapacity, target_items
from hf_sparsespec.kernels.backend import get_backend
from hf_sparsespec.kv_manager import KVManager
from hf_sparsespec.packed_projections import packed_projections
from hf_sparsespec.results import StopChecker
from hf_sparsespec.runner import ModelRunner, PendingResults
from hf_sparsespec.sampling import LogitsPipeline
from hf_sparsespec.scheduler import Request, RowKind, Scheduler
from hf_sparsespec.validation import (
    cache_kwarg_name,
    model_geometry,
    supports_logits_to_keep,
    tensor_parallel_group,
)

logger = logging.getLogger(__name__)
STRIDE_ALIGNMENT = 16


@contextlib.contextmanager
def frozen_heap():
    """The objects alive before decoding (the model, torch, transformers: 10^5 to 10^6 of them) moved to
    the garbage collector's permanent generation for the block (`gc.freeze`), so that a full collection
    while decoding scans only what decoding allocated. Otherwise it scans the whole heap and pauses the
    host that long (0.2 s for a tiny model on a CPU), while the device runs dry after the one iteration
    queued ahead. Left alone when the process has frozen objects itself: that freeze is not ours to undo."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def free_device_memory(device: torch.device) -> int:
    """Bytes a new KV pool may take: the device's free memory plus what PyTorch's caching allocator holds
    unused (a previous call's freed pool stays reserved there, invisible to `mem_get_info`, until
    `torch.cuda.empty_cache()`; without it a second `generate` in a notebook would size a smaller pool).
    A garbage collection first: a previous engine that only a reference cycle keeps alive still holds
    its pool until the collector runs."""
    gc.collect()
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class EngineLayout:
    """Sizes discovered at run time (never stored in the config)."""

    num_slots: int
    num_pages: int
    history_width: int  # columns of the token buffer
    max_budget: int  # width of the selected-index store
    num_moved: int  # width of the moved-key offsets store: (k + 1) x group for "diagonal", the
    # induction keys for "induction", both for "induction_diagonal" (in that order), else 0


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        requests: list[Request],
        config: SparseSpecConfig,
        pipeline: LogitsPipeline,
        do_sample: bool,
        stop_checker: StopChecker,
        on_tokens: Callable[[Request, list[int]], None] | None = None,
        on_finish: Callable[[Request], None] | None = None,
        pad_to_buckets: bool | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.stop_checker = stop_checker
        self.on_tokens = on_tokens
        self.on_finish = on_finish
        self.k = config.num_draft_tokens
        geometry = model_geometry(model)
        self.device = geometry.device
        backend = get_backend(config.backend, self.device)
        tp_group = tensor_parallel_group(model)
        self.layout = layout = self._layout(requests, geometry, tp_group)
        self.cache = SparseSpecCache(
            num_layers=geometry.num_layers,
            num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            num_pages=layout.num_pages,
            page_size=config.page_size,
            num_slots=layout.num_slots + 1,  # + the dummy slot padded rows write into
            max_budget=layout.max_budget,
            dtype=geometry.dtype,
            device=self.device,
            host_pool_bytes=config.host_pool_size(),
            offload_chunk_tokens=config.offload_chunk_tokens,
            num_moved=layout.num_moved,
        )
        # under tensor parallelism every process must decide alike: no decision on a copy's progress
        self.kv = KVManager(config, self.cache.allocator, self.cache.host, synchronous=tp_group is not None)
        self.scheduler = Scheduler(config, self.cache.allocator, layout.num_slots, self.kv)
        for request in requests:
            request.processor_params = pipeline.request_params(request)
            self.scheduler.add(request)
        group = geometry.num_q_heads // geometry.num_kv_heads
        graphs_possible = config.cuda_graphs and self.device.type == "cuda" and backend.needs_plan
        use_graphs = graphs_possible and pipeline.graph_safe
        if graphs_possible and not pipeline.graph_safe:
            logger.warning(
                "hf_sparsespec: the logits processors %s may synchronise with the host, so every iteration runs "
                "eagerly without CUDA graphs (several times slower on a GPU)", ", ".join(pipeline.host_synchronising()),
            )  # fmt: skip
        items = target_items(geometry.num_kv_heads, self.device) if backend.needs_plan else 0
        self.page_table = DevicePageTable(layout.num_slots, -(-layout.history_width // config.page_size))
        self.builder = BatchBuilder(
            self.k, layout.num_slots, layout.history_width, config.page_size, self.page_table, group,
            geometry.num_kv_heads, items, pipeline.num_params, pad=use_graphs if pad_to_buckets is None else pad_to_buckets,
            sample_seed=int(torch.randint(0, 2**62, ())) if do_sample else None,  # torch's generator seeds the noise
            num_moved=layout.num_moved, min_padded_rows=2 if config.compile_forward else 1,
            plain_phases=self.k == 0 or config.min_draft_context > 0 or config.plain_tail_rows > 0,
        )  # fmt: skip
        largest, max_page_updates = self._largest_step(pipeline.num_params, group, items)
        self.runner = ModelRunner(
            model, self.cache, backend, pipeline, do_sample, k=self.k, num_slots=layout.num_slots,
            history_width=layout.history_width, largest=largest, max_page_updates=max_page_updates,
            vocab_size=geometry.vocab_size, group=group, selection=config.selection,
            num_sink_tokens=config.num_sink_tokens, use_graphs=use_graphs, cache_kwarg=cache_kwarg_name(model),
            logits_to_keep=supports_logits_to_keep(model), max_context=max(r.max_total_len for r in requests),
            compile_forward=config.compile_forward, tp_group=tp_group, overlap_scoring=config.overlap_scoring,
            score_after_forward=config.score_after_forward,
            compiles_plain_shapes=config.min_draft_context > 0, pack_projections=config.packs_projections,
        )  # fmt: skip
        self.pending: deque[PendingResults] = deque()

    def _layout(self, requests: list[Request], geometry, tp_group=None) -> EngineLayout:
        config = self.config
        num_slots = min(config.max_num_requests, len(requests))
        spec = self.k + 1
        # widths that set strides of kernel arguments are multiples of 16 (pages of the page table too):
        # Triton specialises integer arguments on divisibility by 16, and a stride that changed class
        # from one call to the next (another max_new_tokens) would compile every kernel again
        history_width = _round_up(max(r.history_offset + r.max_total_len + spec for r in requests),
                                  STRIDE_ALIGNMENT * config.page_size)  # fmt: skip
        pages = sorted(-(-(r.max_total_len + spec) // config.page_size) for r in requests)
        # room for the largest requests at once, plus the dynamic policy's headroom (one speculative block
        # a request, `KVManager.headroom`): a pool sized to the requests never offloads
        needed = sum(pages[-num_slots:]) + num_slots * -(-spec // config.page_size)
        if config.num_pages is not None:
            num_pages = config.num_pages
        elif self.device.type == "cuda":
            free = free_device_memory(self.device)
            page_bytes = 2 * geometry.num_layers * config.page_size * geometry.num_kv_heads * geometry.head_dim
            page_bytes *= geometry.dtype.itemsize
            # the runner's verification scores (every layer's, `ModelRunner.scores`) and, overlapping the
            # scoring passes, the copies of the verifications' queries and LSE come out of the pool's share
            workspace = 0
            if config.selection in SCORED_SELECTIONS and self.k > 0:
                workspace = 4 * geometry.num_layers * num_slots * geometry.num_kv_heads * history_width
                if config.overlap_scoring or config.score_after_forward is not False:  # None: most models
                    copy_bytes = geometry.head_dim * geometry.dtype.itemsize + 4
                    workspace += geometry.num_layers * num_slots * spec * geometry.num_q_heads * copy_bytes
            share = int(free * config.gpu_memory_fraction) - workspace
            num_pages = max(1, min(needed, share // page_bytes))
            if tp_group is not None:  # one pool size for the group: admission and offloads must agree
                import torch.distributed as dist

                smallest = torch.tensor([num_pages], device=self.device)
                dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=tp_group)
                num_pages = int(smallest.item())
        else:
            num_pages = needed
        max_context = max(r.max_total_len + spec for r in requests)
        max_budget = 1 if config.selection == "dense" or self.k == 0 else config.budget(max_context)
        max_budget = _round_up(max_budget, STRIDE_ALIGNMENT) if max_budget > 1 else 1
        group = geometry.num_q_heads // geometry.num_kv_heads
        num_moved = 0  # moved-key entries per (layer, slot, KV head): the diagonal's first, then induction keys
        if config.selection in DIAGONAL_SELECTIONS and self.k > 0:
            num_moved += (self.k + 1) * group
        if config.selection in INDUCTION_SELECTIONS and self.k > 0:
            num_moved += config.num_induction_keys
        return EngineLayout(num_slots, num_pages, history_width, max_budget, num_moved)

    def _largest_step(self, num_params: int, group: int, items: int) -> tuple[StepShape, int]:
        """Bounds of every iteration's buffers: prefill tokens are capped by the chunk size, a slot holds
        one row, padding never passes the slot count; a row adds at most tokens / page_size + 1 pages."""
        slots, spec = self.layout.num_slots, self.k + 1
        tokens = self.config.prefill_chunk_size + slots * (spec + 1)
        rows = 3 * slots
        plan = PlanCapacity(num_work=tokens + rows + 2 * items, num_merge=tokens,
                            num_part_rows=(attention_plan.MAX_BLOCK_M // group) * 2 * items) if items else None  # fmt: skip
        shape = StepShape(
            num_tokens=tokens, num_rows=rows, num_prefill_rows=0, num_verify_rows=slots, num_single_rows=slots,
            num_prefill_samples=slots, spec_len=spec, num_params=num_params, block_m_full=0, plan=plan, padded=False,
        )  # fmt: skip
        return shape, tokens // self.config.page_size + 2 * rows

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        with self.running():
            while self.scheduler.has_work or self.pending:
                self.step()
        self.cache.host.synchronize()

    @contextlib.contextmanager
    def running(self):
        """What `step` needs around it: the engine's attention, no autograd and, when the config packs
        them, the sibling projections packed (`run` holds it; benchmarks that step by hand enter it)."""
        packing = packed_projections(self.model) if self.config.packs_projections else contextlib.nullcontext()
        with use_attention(self.model, ATTENTION_NAME), torch.no_grad(), packing, frozen_heap():
            yield

    def step(self) -> None:
        rows = self.scheduler.schedule()
        if not rows:
            if self.pending:
                while self.pending:
                    self._read(self.pending.popleft())
            elif self.kv.busy:
                self.kv.wait()  # only copies to or from the host are left in flight
            else:
                raise RuntimeError("hf_sparsespec: waiting requests cannot be admitted and nothing runs")
            return
        for row in rows:
            if row.kind is RowKind.PREFILL and row.first_position == 0:  # admitted this iteration
                self.runner.write_history(row.request.slot, row.request.padding + row.request.prompt)
        batch = self.builder.build(rows, self.cache.allocator, self.runner.bucket)
        self.pending.append(self.runner.run(batch))
        keep = 1 if self.config.delayed_verification else 0
        while len(self.pending) > keep:
            self._read(self.pending.popleft())

    # --- read results (host) --------------------------------------------------------------------
    def _read(self, pending: PendingResults) -> None:
        values = pending.read()
        batch, width = pending.batch, self.k + 2
        plain_start = batch.shape.num_verify_rows * width  # the one-token rows' tokens, plain steps first
        first_tokens = values[plain_start + batch.shape.num_single_rows :]
        for row, token in zip(batch.prefill_sample_rows, first_tokens):
            self._commit_token(row.request, token)
        # plain steps (the scheduler committed them already) before the verifications: the requests they
        # finish leave before the verifications start their next cycles (which see whether the tail began)
        for row, token in zip(batch.plain_rows, values[plain_start:]):
            self._commit_token(row.request, token, drafted=0)
        for index, row in enumerate(batch.verify_rows):
            request = row.request
            if request.finished:
                continue
            block = values[index * width : (index + 1) * width]
            accepted, drafts, next_token = block[0], block[1 : 1 + self.k], block[-1]
            committed = drafts[:accepted] + [next_token]
            kept, reason = self._commit(request, committed, drafted=row.num_tokens - 1)
            self._emit(request, committed[:kept])
            if reason is not None:
                self._finish(request, reason)
            else:
                self.scheduler.commit_verification(request, kept)
                self.scheduler.start_cycle(request, self.scheduler.iteration)

    def _commit_token(self, request: Request, token: int, drafted: int | None = None) -> None:
        """A first token (after prefill) or a plain step's: one token, no verification."""
        if request.finished:
            return
        kept, reason = self._commit(request, [token], drafted)
        self._emit(request, [token][:kept])
        if reason is not None:
            self._finish(request, reason)

    def _commit(self, request: Request, tokens: list[int], drafted: int | None = None) -> tuple[int, str | None]:
        """The stop checker keeps the tokens up to the request's stop and records its statistics. Stopping
        criteria see the whole batch at once, so they may also stop other requests that ran ahead (their
        tokens already truncated back); those finish here."""
        kept, reason = self.stop_checker.commit(request, tokens, drafted)
        for stopped, why in self.stop_checker.take_stopped():
            self._finish(stopped, why)
        return kept, reason

    def _emit(self, request: Request, tokens: list[int]) -> None:
        if self.on_tokens is not None:
            self.on_tokens(request, tokens)

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        if self.on_finish is not None:
            self.on_finish(request)
