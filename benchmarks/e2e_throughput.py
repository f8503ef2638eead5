"""End-to-end decoding throughput on a GPU, side by side in one process (one model load):
transformers `generate` with the static cache, our autoregressive mode, our SparseSpec.

    python benchmarks/e2e_throughput.py --gguf ~/m/qwen15.gguf --batch 256 --new-tokens 2048 \\
        --runs hf_static,ar,pillar,streaming --out $OUT
    python benchmarks/e2e_throughput.py --random qwen2.5-1.5b --batch 64 --new-tokens 256   # shapes only

Every run decodes the same prompts (mmath AIME/MATH, chat template; `--prompts mixed` alternates them
with HumanEval tasks; random ids with `--random`), bf16 (`--dtype`), sampling T=0.65 (top-k and top-p
off), a forced length (min_new_tokens = max_new_tokens). `--repeat-kv-heads R` repeats every KV head of
the model R times (`loading.repeat_kv_heads`): the same function and acceptance with R x the KV bytes per
token, the KV-bound regime of models with more KV heads.
Runs (`--runs`): `hf_static` (warmed on the same shape first: it compiles per shape), `ar`
(`num_draft_tokens=0`), `pillar`, `diagonal`, `induction`, `induction_diagonal`, `streaming`, `dense`, `ar_compiled` /
`pillar_compiled` / `diagonal_compiled` / `induction_compiled` / `induction_diagonal_compiled`
(`compile_forward=True`, warmed first), `ar_compiledlayers` / `induction_diagonal_compiledlayers`
(`compile_forward="layers"`: one compiled graph shared by the decoder layers),
`adaptive` (`adaptive_draft_tokens=True`; `adaptive_induction_diagonal` with that selection), any of
our runs with `_tail` appended (`pillar_tail`: `plain_tail_rows=--plain-tail-rows`, the last requests
finish with plain one-token steps), any of our drafting runs with `_refresh<n>` appended
(`induction_diagonal_compiled_refresh2`: `selection_refresh_interval=n`, one scoring pass every n
verifications; without it the config's default, every 4th since measurements 34, and `_refresh1` the
paper's every verification; before it `_k<n>`, `num_draft_tokens=n`: `induction_diagonal_compiled_k16_refresh2`)
and then `_from<n>` (`induction_diagonal_compiled_refresh2_from2048`: `min_draft_context=n`,
plain one-token steps until a request's context reaches n tokens), `_local<n>` (`local_window=n`: the
drafts also attend the n newest old keys) and `_minbudget<n>` (`min_budget=n` instead of
`--min-budget`), `induction_diagonal_overlap` (`overlap_scoring=True`; and `_compiled`), any of our
runs with `_fullsplit<n>` appended (one-query full rows, the plain steps, split into pieces of at
least n keys instead of 1,024: `ar_compiled_fullsplit512`), then `_verifysplit<n>`
(tiles of full rows with several queries, the verifications, at least n keys instead of 256:
`induction_diagonal_compiled_refresh2_verifysplit1024`), then `_scoregrid<n>`
(the scoring pass's grid: n programs per SM instead of 4), `_scorechunk<n>` (its chunks grow to n keys
instead of 256) and `_padding<n>` (a row bucket's step pads at most n tokens instead of 16:
`batch.MAX_PADDING_TOKENS`), and with `_unfused`
appended last (the logits pipeline's fused paths off:
transformers' processors, then torch.softmax, to price them), and the ablation ladder of the paper:
`naive` (lockstep, no delayed verification, no graphs) -> `unified` (+ phase buckets) ->
`delayed` (+ delayed verification) -> `pillar` (+ CUDA graphs).

Per run: tokens/s, ratio to HF static and to our AR mode, mean accepted drafts per cycle that drafted
(plain one-token steps apart; `plain_steps` counts them), wall ms
per iteration next to device ms per iteration (CUDA events around each iteration's upload, step and
result copy), and the ideal iteration time: the larger of (weights + KV each iteration must read) /
the device's copy bandwidth and its FLOPs / the device's bf16 GEMM rate, from the iteration's real rows
(`--roofline measured`, the default: both timed at the start, ~1 s; `h200`: the H200's 4.26 TB/s and
790 TFLOP/s, the constants of the runs before 2026-12-05), and the ideal tokens/s (the run's tokens
over its iterations' ideal times: the most it could decode on that roofline) with its ratio to AR's,
the bound of the speed-up over AR; the seconds until the first
graph replay (start-up), the host's ms per step by part from the first replay on (`HostTimes`: where a
wall time above the device time goes) with the run's garbage collections, and tokens/s while the batch
is full (up to the first finish with nobody waiting: with forced lengths SparseSpec's requests finish at different iterations, and the ones that
accept least decode the tail in ever smaller batches; `--requests` more than `--batch` keeps the
batch full by continuous batching). Each of our runs is warmed once on the same prompts first (48
tokens; with `_from<n>` one drafting and one crossing warm-up, `warm_configs`; `--no-warm` times them
cold). Prints a table last, writes JSON (with every iteration's rows,
mean context and device ms) to --out.

KV policies (`--kv-policy reserve,dynamic` runs each of our runs under each; `--num-pages` caps the
pool, `third` = room for the worst cases of a third of the requests): the KV table reports peak pages,
offloads/restores (requests, GiB, forced ones), the request-seconds spent on the host, the device ms of
iterations launched while a copy was in flight over those of their nearest copy-free neighbours
(`copy / no-copy`, the overlap target is <= 1.1), and how many outputs equal those of the first policy
(`--stop eos` ends outputs at eos instead of forcing the length; `--greedy` decodes greedily).

    # dynamic admission + offload vs worst-case reservation on one pool (the worst cases of a third of
    # the requests): long forced outputs fill the pool, so requests move to the host and back
    python benchmarks/e2e_throughput.py --gguf ~/m/qwen15.gguf --batch 256 --new-tokens 8192 \
        --runs pillar --kv-policy reserve,dynamic --num-pages third --out $OUT
    # eos-terminated reasoning under max_new_tokens 16384: admission without a length guess
    python benchmarks/e2e_throughput.py --gguf ~/m/qwen15.gguf --batch 256 --new-tokens 16384 --stop eos \
        --runs pillar --kv-policy reserve,dynamic --num-pages third --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
import triton
from loading import add_model_arguments, load_model
from prompts import ensure_prompt_files, left_pad, mixed_prompts, reasoning_prompts
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from triton.testing import do_bench

import hf_sparsespec
from hf_sparsespec import SparseSpecConfig
from hf_sparsespec import batch as batch_builder
from hf_sparsespec import runner as model_runner
from hf_sparsespec.attention import use_attention
from hf_sparsespec.config import SCORED_SELECTIONS
from hf_sparsespec.engine import Engine
from hf_sparsespec.generation import prepare_batch
from hf_sparsespec.graph_buckets import CAPTURE_AFTER_PADDING_TOKENS, GraphBuckets
from hf_sparsespec.kernels import _attention_tile, attention_plan, pillar_select, tempered_softmax
from hf_sparsespec.sampling import LogitsPipeline


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The rates an ideal iteration is priced at."""

    hbm_bytes_per_s: float  # a device-to-device copy, read + write
    bf16_flops_per_s: float  # a large bf16 GEMM
    source: str


H200_ROOFLINE = Roofline(4.26e12, 790e12, "the H200's, measured 2026-11-29")


def measure_roofline(device: str) -> Roofline:
    """This device's copy bandwidth (1 GiB copied, read + write counted) and bf16 GEMM rate (8,192^3),
    medians of `triton.testing.do_bench`; the H200's constants off CUDA."""
    if torch.device(device).type != "cuda":
        return H200_ROOFLINE
    bandwidth = 2 * 2**30 / _median_seconds(_copy_of(2**30, device))
    n = 8192
    flops = 2 * n**3 / _median_seconds(_gemm_of(n, device))
    torch.cuda.empty_cache()
    return Roofline(bandwidth, flops, f"measured on {torch.cuda.get_device_name(device)}")


def _copy_of(size: int, device: str):
    source, target = (torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2))
    return lambda: target.copy_(source)


def _gemm_of(n: int, device: str):
    a, b, c = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(3))
    return lambda: torch.mm(a, b, out=c)


def _median_seconds(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


SELECTIONS = {  # run name -> SparseSpecConfig fields
    "ar": dict(num_draft_tokens=0),
    "ar_compiled": dict(num_draft_tokens=0, compile_forward=True),
    "pillar_compiled": dict(selection="pillar", compile_forward=True),
    "diagonal_compiled": dict(selection="diagonal", compile_forward=True),
    "induction": dict(selection="induction"),
    "induction_compiled": dict(selection="induction", compile_forward=True),
    "induction_diagonal": dict(selection="induction_diagonal"),
    "induction_diagonal_compiled": dict(selection="induction_diagonal", compile_forward=True),
    # each decoder layer compiled, one graph for all (`compile_forward="layers"`)
    "ar_compiledlayers": dict(num_draft_tokens=0, compile_forward="layers"),
    "induction_diagonal_compiledlayers": dict(selection="induction_diagonal", compile_forward="layers"),
    # the scoring passes on a second stream (`overlap_scoring`), against the same run without
    "induction_diagonal_overlap": dict(selection="induction_diagonal", overlap_scoring=True),
    "induction_diagonal_overlap_compiled": dict(selection="induction_diagonal", compile_forward=True,
                                                overlap_scoring=True),  # fmt: skip
    "pillar": dict(selection="pillar"),
    "diagonal": dict(selection="diagonal"),
    "streaming": dict(selection="streaming"),
    "dense": dict(selection="dense"),
    "adaptive": dict(adaptive_draft_tokens=True, selection="pillar"),
    "adaptive_induction_diagonal": dict(adaptive_draft_tokens=True, selection="induction_diagonal"),
    "naive": dict(selection="pillar", scheduler="naive", delayed_verification=False, cuda_graphs=False),
    "unified": dict(selection="pillar", delayed_verification=False, cuda_graphs=False),
    "delayed": dict(selection="pillar", cuda_graphs=False),
}


@contextlib.contextmanager
def unfused_sampling(active: bool):
    """With `active`, the logits pipeline's fused paths off (`fused_temperature`, `fused_truncation`):
    transformers' processors, then torch.softmax, as before them (the `<run>_unfused` runs)."""
    if not active:
        yield
        return
    saved = LogitsPipeline.fused_temperature, LogitsPipeline.fused_truncation
    LogitsPipeline.fused_temperature = LogitsPipeline.fused_truncation = property(lambda self: None)
    try:
        yield
    finally:
        LogitsPipeline.fused_temperature, LogitsPipeline.fused_truncation = saved


# Run-name suffixes that set a module constant for one run (no config field), in the order they
# are appended (before `_unfused`): `_fullsplit<n>` the least keys per split of a one-query full row
# (plain steps; 1,024), `_verifysplit<n>` of a tile of full rows with several queries (verifications,
# prefill; 256), `_scoregrid<n>` the scoring pass's programs per SM (4), `_scorechunk<n>` the keys its
# chunks grow to (256; 128 = the chunks before that rule).
MODULE_SUFFIXES = (
    ("_fullsplit", attention_plan, "MIN_KEYS_PER_FULL_SPLIT"),
    ("_verifysplit", attention_plan, "MIN_KEYS_PER_VERIFY_SPLIT"),
    ("_verifywide", attention_plan, "WIDE_KEYS_PER_VERIFY_SPLIT"),  # the verifications' floor where programs allow
    ("_scoregrid", pillar_select, "SCORE_PROGRAMS_PER_SM"),
    ("_scorechunk", pillar_select, "SCORE_PREFERRED_KEYS_PER_CHUNK"),
    ("_padding", batch_builder, "MAX_PADDING_TOKENS"),  # the most padding tokens a row bucket's step may add
    ("_fromlogits", model_runner, "SAMPLE_FROM_LOGITS"),  # 0: the sampling probabilities written out, as before
    ("_autotune", model_runner, "AUTOTUNE_GEMMS"),  # 1: the compiled forward's GEMMs autotuned by inductor
    ("_pdl", model_runner, "INDUCTOR_PDL"),  # 1: the compiled forward's Triton kernels launched dependent (PDL)
    ("_mergeblock", _attention_tile, "MERGE_SPLIT_BLOCK"),  # splits a merge program reads at once (1: one by one)
    ("_maxtile", attention_plan, "MAX_BLOCK_M"),  # the largest query tile of full rows (64: k = 16 in two)
    ("_topkchunk", tempered_softmax, "TOPK_CHUNK"),  # top-k's candidates through chunks' maxima (0: one topk, as before)
    ("_cublaslt", sys.modules[__name__], "PREFER_CUBLASLT"),  # 1: torch's GEMMs through cuBLASLt (`run_settings`)
)
PREFER_CUBLASLT = 0  # set for a run by `_cublaslt1`: `torch.backends.cuda.preferred_blas_library("cublaslt")`
# Settings read when the forward compiles: dynamo keeps one cache per code object and does not guard on
# them, so a run whose compile settings differ from the previous run's compiles from scratch.
COMPILE_SETTINGS = ("AUTOTUNE_GEMMS", "INDUCTOR_PDL")
_compiled_with: list[dict] = [{}]  # the compile settings of dynamo's cache (the last run's)


def split_module_settings(run: str) -> tuple[str, list[tuple[object, str, int]]]:
    """`(run without them, [(module, name, n), ...])` of a run name's `MODULE_SUFFIXES` (before `_unfused`)."""
    run = run.removesuffix("_unfused")
    settings = []
    for suffix, module, name in reversed(MODULE_SUFFIXES):
        base, _, value = run.rpartition(suffix)
        if base and value.isdigit():
            run = base
            settings.append((module, name, int(value)))
    return run, settings


@contextlib.contextmanager
def run_settings(run: str):
    """The module settings of a run name's last suffixes, which change no config field: `_unfused`
    (`unfused_sampling`) and, before it, `MODULE_SUFFIXES`."""
    _, settings = split_module_settings(run)
    saved = [(module, name, getattr(module, name)) for module, name, _ in settings]
    compiled_with = {name: value for _, name, value in settings if name in COMPILE_SETTINGS}
    if compiled_with != _compiled_with[0]:
        torch._dynamo.reset()
        _compiled_with[0] = compiled_with
    for module, name, value in settings:
        setattr(module, name, value)
    library = torch.backends.cuda.preferred_blas_library()
    try:
        if any(name == "PREFER_CUBLASLT" and value for _, name, value in settings):
            torch.backends.cuda.preferred_blas_library("cublaslt")  # read per GEMM call: graphs captured keep it
        with unfused_sampling(run.endswith("_unfused")):
            yield
    finally:
        torch.backends.cuda.preferred_blas_library(library)
        for module, name, value in saved:
            setattr(module, name, value)


def run_fields(run: str, args) -> dict:
    """SparseSpecConfig fields of a run name: SELECTIONS; `<run>_minbudget<n>` sets `min_budget=n`,
    `<run>_local<n>` `local_window=n`, `<run>_from<n>` `min_draft_context=n`, `<run>_refresh<n>`
    `selection_refresh_interval=n`, `<run>_k<n>` `num_draft_tokens=n`, `<run>_tail` `plain_tail_rows`
    (in that order: `pillar_tail_k16_refresh2_from2048_local16_minbudget80`), and before all of them
    `<run>_scoreafter` `score_after_forward=True` and `<run>_scoreinline` `False` (each layer scored inside the
    forward; None, the default, otherwise), and before that `<run>_packed` `pack_projections=True` and
    `<run>_unpacked` `False` (a compiled run's sibling projections in one GEMM or not; None, the default, packs
    them whenever the forward is compiled: `ar_compiled_unpacked`, `..._refresh2_scoreinline_packed`);
    `MODULE_SUFFIXES` and then `_unfused`, last, change no field (see `run_settings`)."""
    run, _ = split_module_settings(run)
    fields = {}
    if run.endswith("_packed"):
        run, fields = run.removesuffix("_packed"), dict(pack_projections=True)
    elif run.endswith("_unpacked"):
        run, fields = run.removesuffix("_unpacked"), dict(pack_projections=False)
    if run.endswith("_scoreafter"):
        run, fields = run.removesuffix("_scoreafter"), fields | dict(score_after_forward=True)
    elif run.endswith("_scoreinline"):
        run, fields = run.removesuffix("_scoreinline"), fields | dict(score_after_forward=False)
    base, _, budget = run.rpartition("_minbudget")
    if base and budget.isdigit():
        run, fields = base, fields | dict(min_budget=int(budget))
    base, _, window = run.rpartition("_local")
    if base and window.isdigit():
        run, fields = base, fields | dict(local_window=int(window))
    base, _, context = run.rpartition("_from")
    if base and context.isdigit():
        run, fields = base, fields | dict(min_draft_context=int(context))
    base, _, interval = run.rpartition("_refresh")
    if base and interval.isdigit():
        run, fields = base, fields | dict(selection_refresh_interval=int(interval))
    base, _, drafts = run.rpartition("_k")
    if base and drafts.isdigit():
        run, fields = base, fields | dict(num_draft_tokens=int(drafts))
    if run.endswith("_tail"):
        run, fields = run.removesuffix("_tail"), fields | dict(plain_tail_rows=getattr(args, "plain_tail_rows", 64))
    return SELECTIONS[run] | fields


def run_config(run: str, args, kv_policy: str) -> SparseSpecConfig:
    """The engine's config of one of our runs: `--min-budget`, the KV policy and a slot per request of
    the batch, then the run name's fields (`run_fields`; `_minbudget<n>` overrides `--min-budget`)."""
    fields = dict(min_budget=args.min_budget, kv_policy=kv_policy, max_num_requests=args.batch)
    return SparseSpecConfig(**(fields | run_fields(run, args)))


def resolved_config(run: str, config: SparseSpecConfig) -> dict:
    """What a run ran with, as the report keeps it: the config's fields, the values its defaults resolved
    to (`refresh_interval`, `packs_projections`) and the module settings of its name (`MODULE_SUFFIXES`), so
    that a saved report reads the same after a default changes (`ar_baseline`)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields = {name: value for name, value in fields.items() if value is None or isinstance(value, (bool, int, float, str))}
    settings = {name: value for _, name, value in split_module_settings(run)[1]}
    return fields | dict(refresh_interval=config.refresh_interval, packs_projections=config.packs_projections,
                         module_settings=settings)  # fmt: skip


def dynamo_graphs() -> int:
    """Graphs dynamo compiled so far in this process (a compiled forward's variants)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def warm_configs(config: SparseSpecConfig, prompts: list[list[int]], tokens: int) -> list[tuple[SparseSpecConfig, int]]:
    """The configs a run warms up with, and the new tokens of each: the run's own for `tokens`, or with
    `min_draft_context` (plain steps first) one that drafts from the start for `tokens` and one whose
    plain steps last until the plain-only bucket has bought its own graph, then drafts `tokens // 2`
    more (for the longest prompt): the compiled forward sees the drafting shapes, the plain-only ones
    (a variant of their own) and the mixed ones of requests crossing the threshold, each of which
    dynamo compiles once. The plain-only bucket borrows the batch's first graph until its padding has
    cost a capture (`graph_buckets`): ~26 iterations at 256 rows but ~92 at 64, and a warm-up that
    ended before that left a 32.6 s compilation inside a timed 64 x 8192 run (docs/measurements.md 30).
    Without `compile_forward` that capture compiles nothing of its own: the plain steps last `tokens // 2`."""
    if not config.min_draft_context:
        return [(config, tokens)]
    slots = min(config.max_num_requests, len(prompts))
    plain = plain_steps_to_own_graph(config.num_draft_tokens, slots) if config.compile_forward else tokens // 2
    crossing = max(len(p) for p in prompts) + 1 + plain
    return [
        (dataclasses.replace(config, min_draft_context=0), tokens),
        (dataclasses.replace(config, min_draft_context=crossing), plain + tokens // 2),
    ]


def plain_steps_to_own_graph(k: int, num_slots: int, margin: int = 4) -> int:
    """Plain steps a full batch of `num_slots` requests takes until its plain-only bucket replays a graph of
    its own: it borrows the first graph (`GraphBuckets.first_graph`) until the padding adds up to
    `CAPTURE_AFTER_PADDING_TOKENS`, then runs once eagerly and is captured; `margin` more for the prefill."""
    buckets = GraphBuckets(k + 1, num_slots)
    padding = buckets.tokens(buckets.first_graph()) - num_slots
    return -(-CAPTURE_AFTER_PADDING_TOKENS // max(padding, 1)) + 1 + margin


class StopAfter(StoppingCriteria):
    """Stops every row after `steps` calls: warms HF's compiled static path on the real shapes."""

    def __init__(self, steps: int) -> None:
        self.steps, self.calls = steps, 0

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls >= self.steps, dtype=torch.bool, device=input_ids.device)


class IdealCounter:
    """Bytes and FLOPs each iteration must move / do, from its real rows (see the module docstring)."""

    def __init__(self, model, roofline: Roofline) -> None:
        self.roofline = roofline
        config = model.config.get_text_config()
        self.layers, self.kv_heads = config.num_hidden_layers, config.num_key_value_heads
        self.q_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.q_heads
        itemsize = next(model.parameters()).dtype.itemsize
        params = sum(p.numel() for p in model.parameters())
        self.lm_head = model.get_output_embeddings().weight.numel()
        self.linear_params = params - self.lm_head  # the embedding lookup reads a few rows only
        self.weight_bytes = params * itemsize
        self.kv_bytes_per_key = self.layers * self.kv_heads * self.head_dim * 2 * itemsize  # K and V
        self.seconds, self.kv_bytes = [], []

    def add(self, tokens: int, logits: int, full_keys: int, sparse_keys: int, scored_keys: int, attended: int):
        kv = (full_keys + sparse_keys) * self.kv_bytes_per_key + scored_keys * self.kv_bytes_per_key // 2
        flops = 2 * self.linear_params * tokens + 2 * self.lm_head * logits
        flops += 4 * self.q_heads * self.head_dim * self.layers * attended
        rates = self.roofline
        self.seconds.append(max((self.weight_bytes + kv) / rates.hbm_bytes_per_s, flops / rates.bf16_flops_per_s))
        self.kv_bytes.append(kv)

    def observe(self, batch, pillar: bool) -> None:
        a = batch.arrays
        n_full = int(a["num_full_rows"][0])  # prefill, verify and plain rows attend fully
        n_rows = len(batch.rows)
        qs, ctx = a["query_start"][: n_rows + 1], a["context_len"][:n_rows]
        q_len = np.diff(qs)
        draft_keys = a["num_selected"][n_full:n_rows] + ctx[n_full:] - a["recent_start"][n_full:n_rows]
        attended = int((q_len[:n_full] * ctx[:n_full]).sum() + draft_keys.sum())
        scored = int(a["num_old_keys"][: len(batch.verify_rows)].sum()) if pillar else 0
        logits = len(batch.host_rows["index"])
        self.add(int(qs[-1]), logits, int(ctx[:n_full].sum()), int(draft_keys.sum()), scored, attended)


class HostTimes:
    """Where the host's time goes in each `Engine.step` of a run, from the engine's own methods wrapped for
    the run: `schedule`, `build` (the host batch), `launch` (the runner: upload and replay, or the eager
    step), `wait` (blocked until an earlier iteration's results are on the host) and `commit` (reading
    them: stop checks, statistics, callbacks). A step whose `wait` is ~0 found its results ready: the GPU
    had idled for the host (wall time above device time). Milliseconds, one entry per step."""

    PARTS = ("schedule", "build", "launch", "wait", "commit")

    def __init__(self, engine) -> None:
        self.steps: list[dict[str, float]] = []
        self.launch_index: list[int] = []  # per step: the iterations launched before it ended
        self._current: dict[str, float] = {}
        engine.scheduler.schedule = self._timed(engine.scheduler.schedule, "schedule")
        engine.builder.build = self._timed(engine.builder.build, "build")
        engine._read = self._timed(engine._read, "commit")  # minus the wait inside it, at the step's end
        step = engine.step

        def timed_step():
            self._current = dict.fromkeys(self.PARTS, 0.0)
            began = time.perf_counter()
            step()
            self._current["commit"] -= self._current["wait"]
            self._current["step"] = 1000 * (time.perf_counter() - began)
            self.steps.append(self._current)

        engine.step = timed_step

    def _timed(self, method, part: str):
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._current[part] = self._current.get(part, 0.0) + 1000 * (time.perf_counter() - began)

        return timed

    def timed_pending(self, pending, launch_seconds: float):
        """The runner's launch time, and `pending.read` timed as this step's wait."""
        self._current["launch"] = self._current.get("launch", 0.0) + 1000 * launch_seconds
        pending.read = self._timed(pending.read, "wait")
        return pending

    def means(self, first_step: int) -> dict[str, float]:
        """Mean ms per step of each part and of the whole step, from `first_step` on (the steady state;
        every step when nothing replayed, as on CPU)."""
        steps = self.steps[first_step:] or self.steps
        parts = (*self.PARTS, "step")
        return {part: float(np.mean([s.get(part, 0.0) for s in steps])) if steps else 0.0 for part in parts}


@contextlib.contextmanager
def recording_gc_pauses():
    """Yields a dict of the garbage collections inside the block: their count per generation and the
    milliseconds they took (in all and the longest): a collection pauses the host between launches."""
    pauses = {"collections": [0, 0, 0], "ms": 0.0, "max_ms": 0.0}
    started = [0.0]

    def callback(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
            return
        ms = 1000 * (time.perf_counter() - started[0])
        pauses["collections"][info["generation"]] += 1
        pauses["ms"] += ms
        pauses["max_ms"] = max(pauses["max_ms"], ms)

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def wall_over_gpu_replayed(seconds: float, launch_seconds: list[float], gpu_ms: list[float]) -> float | None:
    """Wall time over device time from the first replayed iteration's launch to the run's end: the steady
    state, without the eager prefill iterations before it (None without a replay or device times)."""
    if not launch_seconds or not gpu_ms or gpu_ms[0] != gpu_ms[0]:  # NaN: no device times (CPU)
        return None
    device_seconds = sum(gpu_ms) / 1000
    return (seconds - launch_seconds[0]) / device_seconds if device_seconds > 0 else None


@contextlib.contextmanager
def recording_triton_compiles(iteration):
    """Yields a list that gets (iteration, seconds, kernel with its argument specialisation) for every
    Triton kernel compiled (or loaded from Triton's disk cache) inside the block: a compilation in the
    middle of a run is a multi-second iteration. Needs `triton.knobs` (Triton >= 3.4); else stays empty."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    log: list = []
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        yield log
        return
    started, previous = {}, (runtime.jit_cache_hook, runtime.jit_post_compile_hook)

    def before(*args, **kwargs):
        started[id(kwargs.get("key"))] = time.perf_counter()

    def after(*args, **kwargs):
        seconds = time.perf_counter() - started.pop(id(kwargs.get("key")), time.perf_counter())
        name = str(kwargs.get("repr", "?")).split("(")[0]  # with its options; Triton 3.6 lists no argument types
        specialised = f"constants={kwargs.get('constants')} attrs={(kwargs.get('configs') or [None])[0]}"
        log.append((iteration(), round(seconds, 3), f"{name} {specialised}"[:4000]))

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
    try:
        yield log
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = previous


def run_ours(model, prompts, gen_config, config: SparseSpecConfig, pillar: bool, roofline: Roofline) -> dict:
    job = prepare_batch(model, prompts, gen_config)
    full_batch = {}  # when the batch stopped being full for good: the first finish with nobody waiting

    def on_finish(request):  # no per-commit callback: the run's own host work is what the table shows
        if not full_batch and not engine.scheduler.waiting:
            full_batch.update(seconds=time.perf_counter() - start, tokens=sum(len(r.generated) for r in job.requests))

    engine = Engine(model, job.requests, config, job.pipeline, job.do_sample, job.stop_checker, on_finish=on_finish)
    if config.num_pages is not None and model.device.type == "cuda":
        print(f"  KV pool: {config.num_pages} pages ({config.kv_policy})", flush=True)
    engine.runner.time_iterations = model.device.type == "cuda"
    ideal = IdealCounter(model, roofline)
    original = engine.runner.run
    launches = []  # per iteration: (host seconds since the start at its launch, replayed, tokens)
    row_counts = []  # per iteration: real rows (requests that ran)
    contexts = []  # per iteration: the rows' mean context after it (the host's view: speculative rows unshifted)
    padded_tokens = []  # per iteration: the tokens its shape computes (real tokens plus the bucket's padding)

    def run(batch):
        ideal.observe(batch, pillar)
        row_counts.append(len(batch.rows))
        contexts.append(float(batch.arrays["context_len"][: len(batch.rows)].mean()) if batch.rows else 0.0)
        replays = engine.runner.counters.graph_replays
        launched = time.perf_counter()
        pending = original(batch)
        launches.append((time.perf_counter() - start, engine.runner.counters.graph_replays > replays,
                         batch.num_real_tokens))  # fmt: skip
        host.launch_index.append(len(host.steps))  # the step that launched this iteration
        padded_tokens.append(batch.shape.num_tokens)
        return host.timed_pending(pending, time.perf_counter() - launched)

    engine.runner.run = run
    host = HostTimes(engine)
    sync(model)
    start = time.perf_counter()
    with (use_attention(model), torch.no_grad(), recording_triton_compiles(lambda: len(row_counts)) as compiles,
          recording_gc_pauses() as gc_pauses):  # fmt: skip
        engine.run()
    sync(model)
    seconds = time.perf_counter() - start
    counters = engine.runner.counters
    gpu_ms = counters.gpu_milliseconds() if engine.runner.time_iterations else [float("nan")] * len(ideal.seconds)
    iterations = len(ideal.seconds)
    stats = hf_sparsespec.SparseSpecStats.from_requests(config.num_draft_tokens, [r.stats for r in job.requests])
    tokens = sum(len(r.generated) for r in job.requests)
    decode = slice(len(gpu_ms) // 10, None)  # steady state: past the prefill iterations
    full = full_batch or dict(seconds=seconds, tokens=tokens)
    first_replay = next((i for i, (_, replayed, _) in enumerate(launches) if replayed), len(launches))
    replayed_launches = [t for t, _, _ in launches[first_replay:]]
    first_replay_step = host.launch_index[first_replay] if first_replay < len(launches) else len(host.steps)
    return {
        # while the batch is full (before its first request finishes with nobody waiting): without the
        # tail, in which the requests that accept least decode in ever smaller batches
        "full_batch_seconds": full["seconds"], "full_batch_tokens_per_s": full["tokens"] / full["seconds"],
        "iteration_rows": row_counts, "iteration_gpu_ms": [round(ms, 3) for ms in gpu_ms],
        "iteration_mean_context": [round(c, 1) for c in contexts],
        "iteration_tokens": [tokens for _, _, tokens in launches], "iteration_padded_tokens": padded_tokens,
        # tokens computed for nothing (bucket padding, borrowed larger graphs), over the real ones
        "padding_share": sum(padded_tokens) / max(1, sum(tokens for _, _, tokens in launches)) - 1,
        "seconds_to_first_replay": launches[first_replay][0] if first_replay < len(launches) else seconds,
        "iterations_before_first_replay": first_replay,
        "first_iterations": [  # where the start-up time goes: (launch s, device ms, replayed, tokens)
            (round(t, 4), round(ms, 3), replayed, tokens) for (t, replayed, tokens), ms in zip(launches[:64], gpu_ms)
        ],
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "iterations": iterations,
        "wall_ms_per_iter": 1000 * seconds / iterations, "gpu_ms_per_iter": float(np.mean(gpu_ms)),
        "wall_over_gpu_replayed": wall_over_gpu_replayed(seconds, replayed_launches, gpu_ms[first_replay:]),
        # host ms per step from the first replay on, by part (HostTimes), and the collections of the run
        "host_ms_per_step": host.means(first_replay_step), "gc": gc_pauses,
        "gpu_ms_per_iter_decode": float(np.mean(gpu_ms[decode])), "ideal_ms_per_iter": 1000 * float(np.mean(ideal.seconds)),
        "ideal_kv_gb_per_iter": float(np.mean(ideal.kv_bytes)) / 1e9, "weight_gb": ideal.weight_bytes / 1e9,
        # the run's tokens over its iterations' ideal times: the bound of its tok/s on this roofline
        "ideal_tokens_per_s": tokens / max(float(np.sum(ideal.seconds)), 1e-12),
        "mean_accepted": stats.total.mean_accepted_per_drafting_cycle, "plain_steps": stats.total.plain_steps,
        "mean_accepted_all_cycles": stats.total.mean_accepted_per_cycle, "histogram": stats.total.accepted_histogram,
        "graph_replays": counters.graph_replays, "eager_iterations": counters.eager_iterations,
        "graphs_captured": counters.graphs_captured, "capture_seconds": counters.capture_seconds,
        "kv": engine.kv.stats.as_dict(), "copy_slowdown": copy_slowdown(gpu_ms, engine.kv.copy_iterations),
        "triton_compiles": compiles,  # (iteration, seconds, kernel): compilations inside the timed run
        "outputs": [list(r.generated) for r in job.requests],
        "offloaded": sorted(engine.kv.offloaded_request_ids),
    }  # fmt: skip


def compare_outputs(first: list, first_offloaded: set, other: list, other_offloaded: set) -> dict:
    """How many requests decoded the same tokens under two KV policies, among all, among those neither
    run offloaded, and among those either offloaded; and where the others first differ (median token
    index). In bfloat16 the two policies batch different rows together, so GEMMs round differently and
    greedy near-ties can flip in requests that never moved: the never-offloaded count is the baseline
    the offloaded one is read against."""
    moved = first_offloaded | other_offloaded
    same = [a == b for a, b in zip(first, other)]
    diverge = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
               for a, b, s in zip(first, other, same) if not s]  # fmt: skip

    def count(requests):
        return f"{sum(same[i] for i in requests)}/{len(requests)}"

    never = [i for i in range(len(same)) if i not in moved]
    return {
        "outputs_equal_to_first_policy": f"{sum(same)}/{len(same)}",
        "outputs_equal_never_offloaded": count(never),
        "outputs_equal_offloaded": count(sorted(moved)),
        "first_difference_median": float(np.median(diverge)) if diverge else None,
    }


def copy_slowdown(gpu_ms: list[float], copy_iterations: list[int], window: int = 4) -> float | None:
    """Median over the iterations launched while a host copy was in flight of (its device ms / the median
    of its `window` nearest copy-free iterations): ~1.0 when copies overlap compute. None without copies
    or timings."""
    copying = set(copy_iterations)
    free = [i for i in range(len(gpu_ms)) if i not in copying and gpu_ms[i] == gpu_ms[i]]
    if not copying or not free:
        return None
    ratios = []
    for i in sorted(copying):
        if i >= len(gpu_ms) or gpu_ms[i] != gpu_ms[i]:
            continue
        nearest = sorted(free, key=lambda j: abs(j - i))[:window]
        ratios.append(gpu_ms[i] / float(np.median([gpu_ms[j] for j in nearest])))
    return float(np.median(ratios)) if ratios else None


def equal_outputs(result: dict) -> str:
    if "outputs_equal_to_first_policy" not in result:
        return "-"
    first = result["first_difference_median"]
    return (f"{result['outputs_equal_to_first_policy']} ({result['outputs_equal_never_offloaded']} / "
            f"{result['outputs_equal_offloaded']}; {'-' if first is None else f'{first:.0f}'})")  # fmt: skip


def pool_for_a_fraction(model, prompts, new_tokens: int, fraction: float, config: SparseSpecConfig) -> int:
    """Pages that hold the worst cases (prompt + new tokens + one block) of `fraction` of the requests."""
    spec = config.num_draft_tokens + 1
    pages = sorted(-(-(len(p) + new_tokens + spec) // config.page_size) for p in prompts)
    return max(sum(pages[: max(1, int(len(prompts) * fraction))]), pages[-1])  # the largest fits alone


def sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def run_hf_static(model, prompts, batch: int, pad: int, device, settings: dict, new_tokens: int) -> dict:
    """`generate` with the static cache, `batch` prompts at a time (warmed on the first batch's shape)."""
    ids, mask = left_pad(prompts[:batch], pad, device)
    model.generate(input_ids=ids, attention_mask=mask, cache_implementation="static",
                   stopping_criteria=StoppingCriteriaList([StopAfter(12)]), **settings)  # fmt: skip
    sync(model)
    start, tokens, iterations = time.perf_counter(), 0, 0
    for begin in range(0, len(prompts), batch):
        ids, mask = left_pad(prompts[begin : begin + batch], pad, device)
        out = model.generate(input_ids=ids, attention_mask=mask, cache_implementation="static", **settings)
        tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        iterations += out.shape[1] - ids.shape[1]
    sync(model)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "iterations": iterations,
            "wall_ms_per_iter": 1000 * seconds / iterations}  # fmt: skip


def ar_baseline(label: str, runs: dict) -> str | None:
    """The AR run a run of the report is compared with: the first AR run (no drafts) whose forward is the
    run's (`compile_forward`, whether it packs the projections) and whose module settings (`MODULE_SUFFIXES`)
    are the run's, else the first with its forward, else the first AR run, else None. So in one process
    `..._unpacked` compares with `ar_compiled_unpacked`, `..._fromlogits0` with `ar_compiled_fromlogits0` when
    there is one, and the others with `ar_compiled`."""

    def config(name: str) -> dict | None:
        """The run's resolved config: as its report recorded it, or (reports before `resolved_config`)
        as its name reads with today's defaults."""
        if runs.get(name, {}).get("config") is not None:
            return runs[name]["config"]
        try:
            return resolved_config(name, SparseSpecConfig(**run_fields(name.split("+")[0], None)))  # `+policy`
        except KeyError:  # hf_static
            return None

    def forward(c: dict) -> tuple:
        return c["compile_forward"], c["packs_projections"]

    ar_runs = {name: c for name in runs if (c := config(name)) is not None and c["num_draft_tokens"] == 0}
    own = config(label)
    same = [name for name, c in ar_runs.items() if own is not None and forward(c) == forward(own)]
    alike = [name for name in same if ar_runs[name]["module_settings"] == own["module_settings"]]  # same is empty when own is None
    return (alike or same or list(ar_runs) or [None])[0]


def print_tables(report: dict) -> None:
    """The throughput table (and the KV table of runs that have one) of a report, from its JSON alone:
    `python e2e_throughput.py --table-from e2e_throughput_64x8192.json` prints a saved run's again."""
    meta, runs = report["meta"], report["runs"]
    args, roofline = meta["args"], meta["roofline"]  # the arguments as strings
    hf = runs.get("hf_static", {}).get("tokens_per_s")
    dtype = meta.get("dtype") or (args["dtype"] if args["dtype"] != "None" else  # reports before the field
                                  "bfloat16" if args["device"] == "cuda" else "float32")  # fmt: skip
    greedy = args["greedy"] == "True"
    decoding = "greedy" if greedy else f"T={args['temperature']}"
    if not greedy and (args["top_k"] != "0" or float(args["top_p"]) < 1.0):
        decoding += f", top-k {args['top_k'] if args['top_k'] != '0' else 'off'}, top-p {args['top_p']}"
    if float(args.get("repetition_penalty", "1.0")) != 1.0:  # reports before the field have none
        decoding += f", repetition penalty {args['repetition_penalty']}"
    print(f"\n{meta['model']}, batch {args['batch']} x {args['new_tokens']} new tokens ({args['stop']}), "
          f"{dtype}, {decoding}, k=8, budget_ratio 0.05, min_budget {args['min_budget']}; "
          f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}; "
          f"ideal at {roofline['hbm_bytes_per_s'] / 1e12:.2f} TB/s and {roofline['bf16_flops_per_s'] / 1e12:.0f} "
          f"TFLOP/s ({roofline['source']})")  # fmt: skip
    print("| run | tok/s | vs HF static | vs our AR | accepted/cycle | iterations | wall ms/iter | GPU ms/iter "
          "(decode) | ideal ms/iter | GPU / ideal | ideal tok/s (vs AR's) | wall / GPU | graphs (replays / eager) | "
          "padded tokens | s to first replay | tok/s while the batch is full |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def ratio(x, base):
        return f"{x / base:.2f}x" if base else "-"

    def num(r, key, fmt=".2f"):
        return format(r[key], fmt) if key in r else "-"

    for run, r in runs.items():
        ar_run = runs.get(ar_baseline(run, runs), {})
        ar, ar_ideal = ar_run.get("tokens_per_s"), ar_run.get("ideal_tokens_per_s")
        gpu = r.get("gpu_ms_per_iter_decode")
        gpu = gpu if gpu == gpu else None  # NaN: not measured (CPU)
        wall_over_gpu = f"{r['wall_ms_per_iter'] / r['gpu_ms_per_iter']:.2f}" if "gpu_ms_per_iter" in r else "-"
        gpu_over_ideal = f"{gpu / r['ideal_ms_per_iter']:.2f}" if gpu else "-"
        graphs = f"{r['graphs_captured']} ({r['graph_replays']} / {r['eager_iterations']})" if "graphs_captured" in r else "-"
        padding = f"+{100 * r['padding_share']:.1f} %" if "padding_share" in r else "-"
        ideal_rate = "-"
        if "ideal_tokens_per_s" in r:
            ideal_rate = f"{r['ideal_tokens_per_s']:.0f} ({ratio(r['ideal_tokens_per_s'], ar_ideal)})"
        print(f"| {run} | {r['tokens_per_s']:.0f} | {ratio(r['tokens_per_s'], hf)} | {ratio(r['tokens_per_s'], ar)} | "
              f"{num(r, 'mean_accepted')} | {r['iterations']} | {r['wall_ms_per_iter']:.2f} | "
              f"{num(r, 'gpu_ms_per_iter')} ({num(r, 'gpu_ms_per_iter_decode')}) | {num(r, 'ideal_ms_per_iter')} | "
              f"{gpu_over_ideal} | {ideal_rate} | {wall_over_gpu} | {graphs} | {padding} | "
              f"{num(r, 'seconds_to_first_replay', '.1f')} | "
              f"{num(r, 'full_batch_tokens_per_s', '.0f')} |")  # fmt: skip

    host_runs = {run: r for run, r in runs.items() if "host_ms_per_step" in r}
    if host_runs:  # reports before the field have none
        print("\n| run | wall / GPU (all / from the first replay) | host ms per step from the first replay: "
              "schedule | build | launch | wait | commit | step | GC collections (gen 0 / 1 / 2) | GC ms (longest) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for run, r in host_runs.items():
            h, collected = r["host_ms_per_step"], r["gc"]
            replayed, gpu = r.get("wall_over_gpu_replayed"), r.get("gpu_ms_per_iter", float("nan"))
            wall_over_gpu = "-"
            if gpu == gpu:  # NaN: no device times (CPU)
                steady = "-" if replayed is None else f"{replayed:.2f}"
                wall_over_gpu = f"{r['wall_ms_per_iter'] / gpu:.2f} / {steady}"
            print(f"| {run} | {wall_over_gpu} | " + " | ".join(f"{h[part]:.2f}" for part in (*HostTimes.PARTS, "step"))
                  + f" | {' / '.join(map(str, collected['collections']))} | {collected['ms']:.0f} "
                  f"({collected['max_ms']:.1f}) |")  # fmt: skip

    kv_runs = {run: r for run, r in runs.items() if "kv" in r}
    if kv_runs:
        print("\n| run | policy | pages (peak / pool) | offloads (requests, forced) | offloaded GiB | restores | "
              "restored GiB | request-s on host | copy / no-copy iteration | outputs = first policy (never "
            "offloaded / offloaded; median first difference) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for run, r in kv_runs.items():
            kv, slowdown = r["kv"], r.get("copy_slowdown")
            print(f"| {run} | {kv['policy']} | {kv['peak_pages_used']} / {kv['num_pages']} | {kv['offloads']} "
                  f"({kv['requests_offloaded']}, {kv['forced_offloads']}) | {kv['offloaded_bytes'] / 2**30:.2f} | "
                  f"{kv['restores']} | {kv['restored_bytes'] / 2**30:.2f} | {kv['offloaded_seconds']:.1f} | "
                  f"{'-' if slowdown is None else f'{slowdown:.2f}x'} | {equal_outputs(r)} |")


def main() -> None:
    table_from = argparse.ArgumentParser(add_help=False)
    table_from.add_argument("--table-from", type=Path)
    saved = table_from.parse_known_args()[0].table_from
    if saved is not None:  # no model: the tables of a saved report
        print_tables(json.loads(saved.read_text()))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table-from", type=Path, metavar="JSON",
                        help="print the tables of a saved report (this script's JSON) and exit; no model")
    add_model_arguments(parser)
    parser.add_argument("--batch", type=int, default=256, help="requests decoding at once (max_num_requests)")
    parser.add_argument("--requests", type=int, default=None,
                        help="prompts in all (default: --batch); more keep the batch full as requests finish "
                             "(continuous batching; HF static decodes them --batch at a time)")
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--prompts", choices=["mmath", "mixed"], default="mmath",
                        help="mmath: AIME/MATH reasoning; mixed: mmath and HumanEval alternating (a real model)")
    parser.add_argument("--runs", default="hf_static,ar,pillar,streaming")
    parser.add_argument("--min-budget", type=int, default=128)
    parser.add_argument("--plain-tail-rows", type=int, default=64,
                        help="plain_tail_rows of the runs named <run>_tail (e.g. pillar_tail)")
    parser.add_argument("--temperature", type=float, default=0.65)
    parser.add_argument("--top-k", type=int, default=0,
                        help="top-k of the sampling (0: off; Qwen's own generation configs use 20)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p of the sampling (1.0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="transformers' repetition penalty (1.0: off; Qwen2.5's model cards: 1.05)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="model and KV dtype (default: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--kv-policy", default="dynamic", help="comma list of dynamic, reserve: each run under each")
    parser.add_argument("--num-pages", default=None,
                        help="KV pages per layer, or 'third' / '1/N' (room for the worst cases of 1/3 or 1/N of the requests)")
    parser.add_argument("--stop", choices=["forced", "eos"], default="forced",
                        help="forced: min_new_tokens = new tokens; eos: outputs end at eos (reasoning lengths)")
    parser.add_argument("--greedy", action="store_true", help="greedy decoding (outputs comparable across runs)")
    parser.add_argument("--roofline", choices=["measured", "h200"], default="measured",
                        help="the rates the ideal iteration is priced at: this device's, timed at the start, or "
                             "the H200's constants (4.26 TB/s, 790 TFLOP/s)")
    parser.add_argument("--no-warm", dest="warm", action="store_false",
                        help="time our runs cold (by default each runs once on the same prompts, 48 tokens, first)")
    args = parser.parse_args()
    args.requests = args.requests or args.batch
    if args.requests < args.batch:
        parser.error(f"--requests ({args.requests}) must be at least --batch ({args.batch})")

    if args.gguf is not None:
        ensure_prompt_files(args.prompts)
    started = time.perf_counter()
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if args.device == "cuda" else torch.float32
    model, tokenizer = load_model(args, dtype, args.device)
    if args.gguf is not None:
        prompts = (mixed_prompts if args.prompts == "mixed" else reasoning_prompts)(tokenizer, args.requests)
        eos, pad = model.generation_config.eos_token_id, model.generation_config.pad_token_id
    else:
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(1, 1000, int(n)).tolist() for n in rng.integers(100, 250, args.requests)]
        eos, pad = None, 0
    name = args.gguf.name if args.gguf is not None else f"random {args.random}"
    if args.repeat_kv_heads != 1:
        name += f" (KV heads x{args.repeat_kv_heads}: {model.config.num_key_value_heads})"
    print(f"loaded {name} in {time.perf_counter() - started:.0f} s; {len(prompts)} prompts", flush=True)
    n = args.new_tokens
    sampling = dict(do_sample=False) if args.greedy else dict(do_sample=True, temperature=args.temperature,
                                                               top_k=args.top_k, top_p=args.top_p)  # fmt: skip
    forced = dict(min_new_tokens=n) if args.stop == "forced" else {}
    settings = dict(**sampling, repetition_penalty=args.repetition_penalty, max_new_tokens=n, **forced,
                    eos_token_id=eos, pad_token_id=pad)  # fmt: skip
    gen_config = GenerationConfig(**settings)
    roofline = measure_roofline(args.device) if args.roofline == "measured" else H200_ROOFLINE
    print(f"roofline ({roofline.source}): {roofline.hbm_bytes_per_s / 1e12:.2f} TB/s, "
          f"{roofline.bf16_flops_per_s / 1e12:.0f} bf16 TFLOP/s", flush=True)
    report = {"meta": {
        "model": name, "dtype": str(dtype)[6:], "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__, "triton": triton.__version__,
        "transformers": transformers.__version__, "args": {k: str(v) for k, v in vars(args).items()},
        "roofline": dataclasses.asdict(roofline),
    }, "runs": {}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.warm:  # Triton compiles once per process, outside the timings
        warm = SparseSpecConfig(min_budget=args.min_budget)
        short = GenerationConfig(**{**settings, "max_new_tokens": 24, "min_new_tokens": 24})
        hf_sparsespec.generate_batch(model, prompts[:8], short, warm)
    policies = args.kv_policy.split(",")
    outputs = {}  # run label -> generated ids of every request (compared across policies, not written)
    for run, policy in [(run, policy) for run in args.runs.split(",") for policy in policies]:
        label = run if len(policies) == 1 or run == "hf_static" else f"{run}+{policy}"
        if label in report["runs"]:
            continue
        torch.manual_seed(args.seed)
        if run == "hf_static":
            result = run_hf_static(model, prompts, args.batch, pad or 0, args.device, settings, n)
        else:
            config = run_config(run, args, policy)
            if args.num_pages is not None:
                pages = args.num_pages
                pages = "1/3" if pages == "third" else pages
                if pages.startswith("1/"):
                    pages = pool_for_a_fraction(model, prompts, n, 1 / int(pages[2:]), config)
                config = dataclasses.replace(config, num_pages=int(pages))
            warm_seconds = None
            with run_settings(run):
                if args.warm:  # like HF static: the same batch shape once before timing (Triton specialisations,
                    # dynamo's compilation with compile_forward); graphs are per call and are captured again
                    started = time.perf_counter()
                    for warm_config, tokens in warm_configs(config, prompts, min(48, n)):
                        short = GenerationConfig(**{**settings, "max_new_tokens": tokens, "min_new_tokens": tokens})
                        hf_sparsespec.generate_batch(model, prompts, short, warm_config)
                    warm_seconds = time.perf_counter() - started  # with compile_forward: mostly the compilation
                    print(f"{run}: warm-up on the same shape {warm_seconds:.1f} s", flush=True)
                # the AR mode (no drafts) scores nothing: its rows are plain steps
                scored = config.selection in SCORED_SELECTIONS and config.num_draft_tokens > 0
                graphs_before = dynamo_graphs()
                result = run_ours(model, prompts, gen_config, config, pillar=scored, roofline=roofline)
                result["dynamo_graphs_compiled"] = dynamo_graphs() - graphs_before  # in the timed run: > 0 is a stall
                result["warm_seconds"] = warm_seconds
                result["config"] = resolved_config(run, config)
            outputs[label] = result.pop("outputs"), set(result["offloaded"])
            first = f"{run}+{policies[0]}"
            if len(policies) > 1 and first in outputs and first != label:
                result |= compare_outputs(*outputs[first], *outputs[label])
        report["runs"][label] = result
        print(f"{label}: {result['tokens_per_s']:.0f} tok/s, {result['wall_ms_per_iter']:.2f} ms/iter", flush=True)
        for iteration, compile_seconds, kernel in result.get("triton_compiles", [])[:8]:
            print(f"  Triton compiled at iteration {iteration} ({compile_seconds:.2f} s): {kernel[:160]}", flush=True)
        suffix = f"_{args.requests}requests" if args.requests != args.batch else ""
        (args.out / f"e2e_throughput_{args.batch}x{n}{suffix}.json").write_text(json.dumps(report, indent=1))
        if args.device == "cuda":  # the run's engine (a cycle through the `run` wrapper) and its pool go
            gc.collect()  # before the next run sizes its pool from free memory
            torch.cuda.empty_cache()

    print_tables(report)

if __name__ == "__main__":
    main()
