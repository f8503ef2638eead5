"""User-facing configuration of sparse self-speculative decoding.

`SparseSpecConfig` is frozen and validated once, in `__post_init__`; values discovered at run time
(page count, vocabulary, eos ids) live in the engine's `EngineLayout`, never here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

SCHEDULER_POLICIES = ("unified", "naive")
SELECTION_POLICIES = ("pillar", "diagonal", "induction", "induction_diagonal", "streaming", "dense")
SCORED_SELECTIONS = ("pillar", "diagonal", "induction", "induction_diagonal")  # from the verifications' exact scores
DIAGONAL_SELECTIONS = ("diagonal", "induction_diagonal")  # the verifications write moved keys
INDUCTION_SELECTIONS = ("induction", "induction_diagonal")  # induction keys are looked up at every draft step
DEFAULT_REFRESH_INTERVAL = 4  # `selection_refresh_interval=None` with a scored selection (docs/measurements.md 34)
BACKENDS = ("auto", "torch", "triton")
KV_POLICIES = ("dynamic", "reserve")


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"SparseSpecConfig.{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        expected = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"SparseSpecConfig.{name} must be {expected}, got {value}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"SparseSpecConfig.{name} must be one of {choices}, got {value!r}")


@dataclass(frozen=True)
class SparseSpecConfig:
    """How SparseSpec drafts, verifies and schedules.

    Args:
        num_draft_tokens: k, the number of sparse draft steps between two full verifications; 0 runs
            plain autoregressive decoding (one token per request per iteration) in the same engine,
            with the same paged cache, kernels and graphs: the baseline SparseSpec is measured against.
            With `adaptive_draft_tokens` it is the longest cycle a request may draft (the buffers' size).
        adaptive_draft_tokens: each request picks its cycle's number of drafts m in
            [`min_draft_tokens`, k] from its own last verification (`scheduler.adapt_draft_length`):
            it starts at k; a verification that accepted all of its m drafts lengthens the next
            cycle by one, one that accepted a < m/2 of them shortens it to max(min, a + 1).
            Verification is unchanged (lossless), and the choice depends on the request alone, so its
            output still does not depend on the batch. Off by default until measured on a GPU
            (docs/measurements.md 5).
        min_draft_tokens: the fewest drafts an adaptive cycle drafts (1 <= min <= k); also the
            floor that keeps a speculative first draft (delayed verification) inside its cycle.
        budget_ratio: fraction of the context each draft step reads, besides the recent window.
            The per-request budget is `B = max(min_budget, ceil(budget_ratio * kv_len))` keys per
            (layer, KV head).
        min_budget: the least number of selected keys per (layer, KV head).
        scheduler: `"unified"` staggers requests over the k+1 phases of a cycle so every iteration
            mixes drafts and verifications; `"naive"` runs every request in lockstep (ablation).
        selection: `"pillar"` (PillarAttn: top-B keys by the attention the last verification
            computed), `"diagonal"` (PillarAttn's keys plus, per (layer, KV head), the "moved" keys:
            each verification query p and query head of the GQA group keeps the offset `j - p` of its
            most attended old key j, and a draft query at position q also attends key `q + j - p`
            when it is older than the recent window; the copy/induction heads' keys advance with
            the drafts; (k + 1) x group extra keys at most), `"induction"` (PillarAttn's keys plus, at
            every draft step, in every layer and KV head, the keys right after the latest
            `num_induction_keys` older occurrences of the token the draft reads: where induction heads
            look, found from the token ids alone, refreshed at every step), `"induction_diagonal"`
            (both: PillarAttn's keys, the diagonal's moved keys and the induction keys; the default,
            and the best acceptance measured: teacher-forced on Qwen2.5-Coder-1.5B at ~4K contexts,
            960 cycles, 7.17 of 8 against PillarAttn's 6.57 at 1.14x its draft bytes, 7.31 at 1.294x
            with `min_budget=110` against PillarAttn's 64 (held-out texts: 7.30 at 1.296x with 106,
            docs/measurements.md 29); through the engine on the H200, 7.78
            against 6.02 and 1.30x PillarAttn's tokens/s at 256 x 8192, 1.40x with 6x the K/V per
            token, docs/measurements.md 11-13; `"pillar"` is the paper's selection),
            `"streaming"` (first `num_sink_tokens` keys plus the
            most recent ones), or `"dense"` (draft with full attention; accepts everything under
            greedy, a sanity check). Verification is the same for all: only acceptance changes.
        num_sink_tokens: sink tokens of the streaming selection.
        num_induction_keys: keys the induction selections add per draft step (per layer and KV head);
            16 by default (Qwen2.5-Coder-1.5B teacher-forced, 960 cycles, with the diagonal: 16 keys
            7.17, 32 keys 7.21, 64 keys 7.22 accepted of 8, docs/measurements.md 11).
        delayed_verification: the host reads an iteration's results only after launching the next
            one, so it never waits on the device while work is queued. A request that just verified
            drafts its next cycle's first token meanwhile, speculatively: its position depends on
            the accepted count, which the device adds itself (no stall iteration). False: the host
            reads every result at once (the ablation).
        page_size: tokens per KV page.
        max_num_requests: the most requests decoding at once (device slots).
        num_pages: KV pages per layer; None sizes the pool from the requests (CPU) or from free
            device memory (`gpu_memory_fraction`).
        gpu_memory_fraction: share of free device memory the KV pool may take when sizing itself.
        prefill_chunk_size: the most prompt tokens one iteration prefills (longer prompts are
            prefilled in chunks).
        kv_policy: `"dynamic"` admits a request when its prompt (plus one speculative block and a
            small watermark) fits the free pages, grows it page by page, and under pressure offloads
            whole requests (the most recently admitted first) to a host pool and brings them back
            (oldest first) when pages free up; nothing is recomputed (see `kv_manager`).
            `"reserve"` admits a request only when its worst case (prompt + max_new_tokens + one
            block) can be reserved, and never offloads.
        host_pool_bytes: the most host memory (pinned on CUDA, allocated as needed) offloaded
            requests may hold; None: half of the machine's physical memory. An offload that does not
            fit raises `HostMemoryError`.
        offload_chunk_tokens: token positions per host chunk, the unit of offload/restore copies.
        backend: attention kernels: `"triton"` on CUDA, `"torch"` (the reference) anywhere;
            `"auto"` picks Triton on CUDA and torch elsewhere.
        cuda_graphs: capture decode iterations (no prefill rows) in CUDA graphs, one per padded
            shape, and replay them. Needs CUDA, the Triton backend and logits processors free of host
            syncs (temperature, top-k, top-p, min-p, typical, epsilon, min length, repetition
            penalty); otherwise iterations run eagerly.
        compile_forward: run the model's forward of padded decode iterations through
            `torch.compile(dynamic=True)` (the attention ops as opaque custom ops, `hf_sparsespec.ops`),
            fusing the modeling code's elementwise kernels; compiles once per process and model
            (2.5-3.5 minutes for Qwen2.5-1.5B on the H200; shapes without verifications or with a
            single row of a kind run eagerly so that nothing recompiles mid-run). Off by default for
            that start-up: on the H200 it cut a 256-row iteration at 4K contexts from 10.45 to 8.77 ms
            (SparseSpec) and 12.94 to 11.60 ms (AR), with graphs (docs/measurements.md §8).
            `"layers"`: compile each decoder layer's call instead, one graph shared by all layers (the
            layer index a symbolic integer), so the compilation no longer grows with the depth: on the
            CPU a 28-layer model compiled in ~9 s instead of ~55 s, with the same tokens; the norms
            between layers are no longer fused with the residual adds. On the H100 (64 rows, 8K
            contexts) the warm-up took 18-38 s against 75-88 s, an iteration 1.5-5.7 % more GPU time
            (docs/measurements.md 32); the head sizes, symbolic in that run, are constants since.
        plain_tail_rows: once at most this many requests are left (decoding or waiting), each of them
            finishes with plain one-token steps (cycles of 0 drafts, as with `num_draft_tokens=0`).
            A batch that small is bound by its kernel launches: an iteration costs about the same
            whatever it drafts (~5 ms at 1-8 rows of Qwen2.5-1.5B on the H200), so there a request
            advances one token per iteration instead of (accepted + 1) / (m + 1), and the requests
            that accept least (the last to finish) gain most: PillarAttn 1.09x the tokens/s at 256 x
            2048 with 64 (docs/measurements.md 11), `"induction_diagonal"` unchanged. Lossless
            (greedy stays exact, sampling keeps the model's distribution), but the switch depends on
            the batch, so a sampled output then depends on when its batch shrank, not on the request
            alone. 0 (the default): never.
        overlap_scoring: run each layer's PillarAttn scoring pass (the verification rows' second read
            of their keys) on a second CUDA stream, beside the rest of the forward, instead of between
            the layer's attention and the next layer. The verification rows' queries and LSE are
            copied aside first (layers x requests x (k + 1) x query heads x (head_dim x dtype + 4)
            bytes, taken out of the KV pool's share), then every layer's scores join the main stream
            before the selection. Outputs are unchanged. CUDA with the Triton backend only (ignored
            elsewhere). Off by default: on the H200 it made a 256-row iteration at 8K contexts slower,
            14.09 against 13.46 ms (the copies, and a second stream competing for the SMs the GEMMs
            and the attention already fill; docs/measurements.md 17).
        selection_refresh_interval: verifications per selection refresh, for the scored selections.
            1 (the paper): every verification scores its old keys (the PillarAttn scoring pass, a
            second read of the verification rows' keys) and selects the next cycle's keys. n > 1:
            only every n-th verification of a request does; the cycles in between keep the last
            refresh's selection (and moved-key offsets), and their drafts attend every key from that
            refresh's verification block on as their recent window, so nothing committed since is
            left out. Saves n - 1 of n scoring passes at the price of older selections. Lossless
            (only acceptance changes). None (the default): 4 for the scored selections, 1 (nothing
            to refresh) for the others; `refresh_interval` resolves it. On the H100 (Qwen2.5-Coder-1.5B,
            bf16, compiled forward, one process per shape, docs/measurements.md 34) 4 decoded 9.0 %
            more tok/s than 1 at 256 x 8192, 4.7 % at 64 x 8192 and 3.1 % at 256 x 2048, for 7.70,
            7.68 and 7.35 accepted of 8 against 7.76, 7.78 and 7.50; 8 won 2.1 % more at 256 x 8192
            and lost at the other two.
        min_draft_context: the shortest context (prompt and generated tokens) a request drafts at;
            until its context reaches it, a request decodes with plain one-token steps (full
            attention, no drafts, no verification, as `num_draft_tokens=0`), then it joins the
            cycles. At short contexts a drafting cycle costs more than the tokens it saves: every
            committed token runs through the model twice (as a draft, then in its verification), and
            the verification's second read of its keys and the drafts' own reads buy back little
            while the KV is small. On the H200 (Qwen2.5-Coder-1.5B, compiled forward) a SparseSpec
            iteration beats AR's per token only past ~2.3K tokens of context at 256 rows, ~4.5K at 64
            rows (docs/measurements.md 19). Lossless, and the switch depends on the request alone (its
            sampled output still does not depend on the batch). 0 (the default): draft from the start,
            until an end-to-end run shows a gain.
        local_window: for the scored selections, the newest old keys every draft attends besides its
            selection: a refreshing verification of a block starting at position p starts the next
            cycles' recent window at `p - local_window` instead of p, and selects its budget among
            the keys before that (moved and induction keys too land before it). Reads `local_window`
            more keys per draft step for every layer and KV head; lossless (only acceptance changes).
            Teacher-forced on Qwen2.5-Coder-1.5B (960 cycles on each of two text sets), 16 keys with
            `"induction_diagonal"` accepted 7.25 of 8 at 1.27x PillarAttn's draft bytes on both, as
            much per byte as a higher `min_budget` (104 on the held-out texts: 7.28 at 1.29x) and no more
            (docs/measurements.md 29). 0 (the default): none.
        score_after_forward: for the scored selections, score every layer's verification keys (the
            PillarAttn pass) in one launch after the forward instead of one launch per layer: each
            layer's attention copies its verification rows' queries and LSE aside (layers x requests x
            (k + 1) x query heads x (head_dim x dtype + 4) bytes, taken out of the KV pool's share).
            One layer's pass spreads few verifications over the device in short chunks; all layers at
            once give each program longer chunks. On the H100 (8K contexts, compiled forward) an
            iteration's GPU time fell from 10.43 to 10.22 ms at 256 rows and from 4.98 to 4.83 ms at 64
            (docs/measurements.md 31). Outputs are unchanged (the scores are the same). None (the
            default): on, unless `overlap_scoring` is set or the model's layers attend with different
            scales (then each layer scores itself); True: on, and such a model is an error; False: off.
        pack_projections: with `compile_forward`, pack each layer's sibling projections (`q_proj`,
            `k_proj`, `v_proj`; `gate_proj`, `up_proj`) into one weight for the duration of a
            `generate` call, and let the compiled forward run one GEMM per group instead of two or
            three (`hf_sparsespec/packed_projections.py`): fewer latency-bound launches where an
            iteration has few rows. The model's parameters get storages of their own again when the
            call returns; the packing needs one group's weights of free memory while it runs. The
            same tokens as without (CPU tests; float32 greedy with graphs on the H100). On the H100
            (Qwen2.5-Coder-1.5B, bf16, compiled forward, docs/measurements.md 33) 64 x 8192 decoded
            15,993 tok/s against 14,494 (3.69 against 4.04 GPU ms an iteration) and our AR 12,251
            against 11,975, in one process. None (the default): on whenever `compile_forward` is;
            True: on (needs `compile_forward`); False: off.
    """

    num_draft_tokens: int = 8
    adaptive_draft_tokens: bool = False
    min_draft_tokens: int = 2
    budget_ratio: float = 0.05
    min_budget: int = 128
    scheduler: Literal["unified", "naive"] = "unified"
    selection: Literal["pillar", "diagonal", "induction", "induction_diagonal", "streaming", "dense"] = "induction_diagonal"
    num_sink_tokens: int = 4
    num_induction_keys: int = 16
    delayed_verification: bool = True
    page_size: int = 16
    max_num_requests: int = 256
    num_pages: int | None = None
    gpu_memory_fraction: float = 0.85
    prefill_chunk_size: int = 4096
    kv_policy: Literal["dynamic", "reserve"] = "dynamic"
    host_pool_bytes: int | None = None
    offload_chunk_tokens: int = 1024
    backend: Literal["auto", "torch", "triton"] = "auto"
    cuda_graphs: bool = True
    compile_forward: bool | Literal["layers"] = False
    plain_tail_rows: int = 0  # from here on last, so that positional arguments keep their meaning
    overlap_scoring: bool = False
    selection_refresh_interval: int | None = None
    min_draft_context: int = 0
    local_window: int = 0
    score_after_forward: bool | None = None
    pack_projections: bool | None = None

    def __post_init__(self) -> None:
        _check_int("num_draft_tokens", self.num_draft_tokens, 0, 64)
        if not isinstance(self.adaptive_draft_tokens, bool):
            raise ValueError(
                f"SparseSpecConfig.adaptive_draft_tokens must be a bool, got {self.adaptive_draft_tokens!r}"
            )
        if self.adaptive_draft_tokens:
            if self.num_draft_tokens == 0:
                raise ValueError("SparseSpecConfig.adaptive_draft_tokens needs num_draft_tokens >= 1, got 0")
            _check_int("min_draft_tokens", self.min_draft_tokens, 1, self.num_draft_tokens)
        else:
            _check_int("min_draft_tokens", self.min_draft_tokens, 1)
        _check_int("plain_tail_rows", self.plain_tail_rows, 0)
        if not isinstance(self.budget_ratio, (int, float)) or isinstance(self.budget_ratio, bool):
            raise ValueError(f"SparseSpecConfig.budget_ratio must be a float, got {self.budget_ratio!r}")
        if not (0.0 < self.budget_ratio <= 1.0) or math.isnan(self.budget_ratio):
            raise ValueError(f"SparseSpecConfig.budget_ratio must be in (0, 1], got {self.budget_ratio}")
        _check_int("min_budget", self.min_budget, 1)
        _check_choice("scheduler", self.scheduler, SCHEDULER_POLICIES)
        _check_choice("selection", self.selection, SELECTION_POLICIES)
        _check_int("num_sink_tokens", self.num_sink_tokens, 0)
        _check_int("num_induction_keys", self.num_induction_keys, 1, 256)
        if self.selection == "streaming" and self.num_sink_tokens >= self.min_budget:
            raise ValueError(
                f"SparseSpecConfig.num_sink_tokens must be < min_budget ({self.min_budget}) for the "
                f"streaming selection, got {self.num_sink_tokens}"
            )
        if not isinstance(self.delayed_verification, bool):
            raise ValueError(
                f"SparseSpecConfig.delayed_verification must be a bool, got {self.delayed_verification!r}"
            )
        _check_int("page_size", self.page_size, 1, 4096)
        _check_int("max_num_requests", self.max_num_requests, 1)
        if self.num_pages is not None:
            _check_int("num_pages", self.num_pages, 1)
        if not isinstance(self.gpu_memory_fraction, (int, float)) or not (0.0 < self.gpu_memory_fraction <= 1.0):
            raise ValueError(
                f"SparseSpecConfig.gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction!r}"
            )
        _check_int("prefill_chunk_size", self.prefill_chunk_size, 1)
        _check_choice("kv_policy", self.kv_policy, KV_POLICIES)
        if self.host_pool_bytes is not None:
            _check_int("host_pool_bytes", self.host_pool_bytes, 0)
        _check_int("offload_chunk_tokens", self.offload_chunk_tokens, 1)
        _check_choice("backend", self.backend, BACKENDS)
        if self.selection_refresh_interval is not None:
            _check_int("selection_refresh_interval", self.selection_refresh_interval, 1, 64)
        _check_int("min_draft_context", self.min_draft_context, 0)
        _check_int("local_window", self.local_window, 0)
        if self.local_window > 0 and self.selection not in SCORED_SELECTIONS:
            raise ValueError(
                f"SparseSpecConfig.local_window > 0 needs a scored selection {SCORED_SELECTIONS}, "
                f"got selection={self.selection!r}"
            )
        if self.refresh_interval > 1 and self.selection not in SCORED_SELECTIONS:
            raise ValueError(
                f"SparseSpecConfig.selection_refresh_interval > 1 needs a scored selection {SCORED_SELECTIONS}, "
                f"got selection={self.selection!r}"
            )
        for name in ("cuda_graphs", "overlap_scoring"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SparseSpecConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.pack_projections is not None and not isinstance(self.pack_projections, bool):
            raise ValueError(
                f"SparseSpecConfig.pack_projections must be a bool or None (with compile_forward), got {self.pack_projections!r}"
            )
        if not isinstance(self.compile_forward, bool) and self.compile_forward != "layers":
            raise ValueError(f"SparseSpecConfig.compile_forward must be a bool or 'layers', got {self.compile_forward!r}")
        if self.score_after_forward is not None and not isinstance(self.score_after_forward, bool):
            raise ValueError(
                f"SparseSpecConfig.score_after_forward must be a bool or None (automatic), got {self.score_after_forward!r}"
            )
        if self.pack_projections and not self.compile_forward:
            raise ValueError(
                "SparseSpecConfig.pack_projections fuses the packed projections in the compiled forward only: "
                "set compile_forward=True (or 'layers') as well"
            )
        if self.overlap_scoring and self.score_after_forward:
            raise ValueError(
                "SparseSpecConfig.overlap_scoring and score_after_forward are two places for the same scoring "
                "passes (beside the forward, or after it in one launch): choose one"
            )

    @property
    def refresh_interval(self) -> int:
        """Verifications per selection refresh: `selection_refresh_interval`, or with None 4 for the scored
        selections and 1 for the others (they select nothing from the verifications' scores)."""
        if self.selection_refresh_interval is not None:
            return self.selection_refresh_interval
        return DEFAULT_REFRESH_INTERVAL if self.selection in SCORED_SELECTIONS else 1

    @property
    def packs_projections(self) -> bool:
        """Whether `generate` packs the sibling projections: `pack_projections`, or with None whether the
        forward is compiled (the fusion lives in the compiled forward only)."""
        return self.pack_projections if self.pack_projections is not None else bool(self.compile_forward)

    def host_pool_size(self) -> int:
        """`host_pool_bytes`, or half of the physical memory when it is None."""
        if self.host_pool_bytes is not None:
            return self.host_pool_bytes
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
        except (AttributeError, ValueError, OSError):  # no sysconf (Windows): a modest default
            return 16 * 2**30

    def budget(self, kv_len: int) -> int:
        """Selected keys per (layer, KV head) for a context of `kv_len` keys (before clamping to the
        number of keys that can be selected)."""
        return max(self.min_budget, math.ceil(self.budget_ratio * kv_len))
