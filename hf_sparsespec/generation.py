"""The two front doors of the engine.

- `generate`: the decoding callable for `model.generate(..., custom_generate=hf_sparsespec.generate)`
  (and what `generation_strategy="sparsespec"` forwards to). transformers has already prepared the
  generation config, the logits processors and the stopping criteria; this turns the (left-padded)
  batch into requests, runs the engine and returns exactly what `generate` returns.
- `generate_batch`: ragged prompts (lists of token ids, no padding) in, one result per prompt out.

Everything a request cannot get right is refused here, before any work, with NotImplementedError.
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from hf_sparsespec.config import SparseSpecConfig
from hf_sparsespec.engine import Engine
from hf_sparsespec.results import StopChecker
from hf_sparsespec.sampling import LogitsPipeline
from hf_sparsespec.scheduler import Request
from hf_sparsespec.stats import EngineStats, KVStats, RequestStats, SparseSpecStats
from hf_sparsespec.validation import check_model_supported

logger = logging.getLogger(__name__)

_MODEL_KWARGS_WE_HANDLE = {"attention_mask", "position_ids", "past_key_values", "cache", "use_cache", "logits_to_keep"}


@dataclass
class SparseSpecGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the acceptance statistics of the call."""

    sparsespec_stats: SparseSpecStats | None = None


@dataclass
class SparseSpecResult:
    """One prompt's outcome from `generate_batch`."""

    prompt_ids: list[int]
    generated_ids: list[int]
    finish_reason: str  # "eos", "length" or "stop_criteria"
    stats: RequestStats


# --- refusals -------------------------------------------------------------------------------------
def check_generation_config(generation_config: GenerationConfig) -> None:
    """NotImplementedError for every decoding option SparseSpec does not run exactly."""
    gc = generation_config
    refusals = {
        "num_beams > 1 (beam search)": (gc.num_beams or 1) > 1,
        "num_beam_groups > 1 (group beam search)": (getattr(gc, "num_beam_groups", 1) or 1) > 1,
        "penalty_alpha (contrastive search)": bool(gc.penalty_alpha) and (gc.top_k or 0) > 1,
        "dola_layers (DoLa decoding)": getattr(gc, "dola_layers", None) is not None,
        "constraints / force_words_ids (constrained beam search)": bool(
            getattr(gc, "constraints", None) or getattr(gc, "force_words_ids", None)
        ),
        "prompt_lookup_num_tokens (prompt-lookup decoding)": getattr(gc, "prompt_lookup_num_tokens", None) is not None,
        "assistant_early_exit (early-exit assisted decoding)": getattr(gc, "assistant_early_exit", None) is not None,
        "use_mtp (multi-token-prediction assisted decoding)": bool(getattr(gc, "use_mtp", False)),
        "guidance_scale != 1 (classifier-free guidance)": gc.guidance_scale is not None and gc.guidance_scale != 1,
    }
    for what, refused in refusals.items():
        if refused:
            raise NotImplementedError(
                f"generation_strategy='sparsespec' does not support {what}: SparseSpec drafts with the model "
                "itself and verifies one sequence per request"
            )
    if gc.return_dict_in_generate:
        for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
            if getattr(gc, flag, False):
                raise NotImplementedError(
                    f"generation_strategy='sparsespec' does not return {flag.removeprefix('output_')}: "
                    "verification computes them for whole draft blocks; ask without it"
                )


def _generate_call_arguments() -> dict:
    """`streamer` and `assistant_model` of the `GenerationMixin.generate` call that invoked us.

    transformers drops both before calling a `custom_generate` callable; without them a streamer
    would never be ended and an assistant model would be silently ignored.
    """
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code.co_name == "generate" and isinstance(frame.f_locals.get("self"), GenerationMixin):
            return {name: frame.f_locals.get(name) for name in ("streamer", "assistant_model")}
        frame = frame.f_back
    return {}


def _split_stopping_criteria(criteria: StoppingCriteriaList | None) -> tuple[set[int], list, bool]:
    """(eos ids, the other criteria in their order, whether plain `generate` would pad finished rows:
    it does iff one of its criteria has an `eos_token_id`)."""
    eos_ids: set[int] = set()
    others = []
    pads_finished_rows = any(hasattr(criterion, "eos_token_id") for criterion in criteria or [])
    for criterion in criteria or []:
        if isinstance(criterion, EosTokenCriteria):
            eos_ids.update(int(t) for t in criterion.eos_token_id.flatten().tolist())
        elif isinstance(criterion, MaxLengthCriteria):
            continue  # the length limit is each request's max_new_tokens
        elif type(criterion).__name__ == "ConfidenceCriteria":
            raise NotImplementedError("generation_strategy='sparsespec' does not support ConfidenceCriteria")
        else:
            others.append(criterion)
    return eos_ids, others, pads_finished_rows


def _run(model, requests, config, pipeline, do_sample, stop_checker, streamer=None, progress=None,
         ) -> tuple[KVStats, EngineStats]:  # fmt: skip
    def on_tokens(request: Request, tokens: list[int]) -> None:
        if streamer is not None:
            streamer.put(torch.tensor([tokens]))

    def on_finish(request: Request) -> None:
        if progress is not None:
            progress.update(1)

    engine = Engine(model, requests, config, pipeline, do_sample, stop_checker, on_tokens, on_finish)
    engine.run()
    return engine.kv.stats, EngineStats.from_counters(engine.runner.counters)


# --- model.generate(..., custom_generate=generate) --------------------------------------------------
def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    generation_config: GenerationConfig | None = None,
    sparsespec_config: SparseSpecConfig | None = None,
    sparsespec_streamer=None,
    **model_kwargs,
) -> torch.LongTensor | SparseSpecGenerateOutput:
    """SparseSpec decoding, called by `GenerationMixin.generate` after it prepared its inputs.

    Use `model.generate(..., generation_strategy="sparsespec")` (after `import hf_sparsespec`) or
    `model.generate(..., custom_generate=hf_sparsespec.generate)`; options go in
    `sparsespec_config=SparseSpecConfig(...)`. Returns what `generate` returns; with
    `return_dict_in_generate=True` the output also carries `sparsespec_stats`.
    """
    config = sparsespec_config if sparsespec_config is not None else SparseSpecConfig()
    if not isinstance(config, SparseSpecConfig):
        raise TypeError(f"sparsespec_config must be a SparseSpecConfig, got {type(config).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise NotImplementedError(
            f"{type(model).__name__} is an encoder-decoder model; hf_sparsespec supports decoder-only models"
        )
    caller = _generate_call_arguments()
    if caller.get("assistant_model") is not None:
        raise NotImplementedError(
            "generation_strategy='sparsespec' drafts with the model itself; it does not take an assistant_model"
        )
    streamer = sparsespec_streamer if sparsespec_streamer is not None else caller.get("streamer")
    generation_config = generation_config if generation_config is not None else model.generation_config
    check_generation_config(generation_config)
    unsupported = sorted(set(model_kwargs) - _MODEL_KWARGS_WE_HANDLE)
    if unsupported:
        raise NotImplementedError(f"generation_strategy='sparsespec' does not support the model inputs {unsupported}")
    _warn_ignored(generation_config, model_kwargs)
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and cache.get_seq_length() > 0:
        raise NotImplementedError("generation_strategy='sparsespec' cannot continue from a filled past_key_values cache")
    if input_ids.dim() != 2:
        raise ValueError(f"expected input_ids of shape [batch, length], got {tuple(input_ids.shape)}")
    batch_size, input_len = input_ids.shape
    if streamer is not None and batch_size > 1:
        raise NotImplementedError(f"streaming supports one sequence at a time, got a batch of {batch_size}")
    max_new_tokens = generation_config.max_length - input_len
    if max_new_tokens < 1:
        raise ValueError(f"max_length ({generation_config.max_length}) leaves no room after {input_len} input tokens")
    check_model_supported(model, input_len + max_new_tokens)
    requests = _requests_from_batch(input_ids, model_kwargs.get("attention_mask"), max_new_tokens)
    eos_ids, criteria, pads_finished_rows = _split_stopping_criteria(stopping_criteria)
    pad = _pad_token(generation_config, eos_ids)
    stop_checker = StopChecker(eos_ids, criteria, input_ids.device, requests, pad, pads_finished_rows)
    pipeline = LogitsPipeline(logits_processor if logits_processor is not None else [])
    start = time.perf_counter()
    try:
        kv_stats, engine_stats = _run(model, requests, config, pipeline, bool(generation_config.do_sample), stop_checker,
                                      streamer)  # fmt: skip
    finally:
        if streamer is not None:
            streamer.end()
    elapsed = time.perf_counter() - start
    width = max(len(r.generated) for r in requests)
    generated = torch.full((batch_size, width), pad, dtype=input_ids.dtype)
    for row, request in enumerate(requests):
        generated[row, : len(request.generated)] = torch.tensor(request.generated, dtype=input_ids.dtype)
    sequences = torch.cat([input_ids, generated.to(input_ids.device)], dim=1)
    if not generation_config.return_dict_in_generate:
        return sequences
    stats = SparseSpecStats.from_requests(config.num_draft_tokens, [r.stats for r in requests], elapsed, kv_stats,
                                          engine_stats)  # fmt: skip
    return SparseSpecGenerateOutput(sequences=sequences, sparsespec_stats=stats)


def _warn_ignored(generation_config: GenerationConfig, model_kwargs: dict) -> None:
    """Options that change only how plain `generate` caches, never its output: said, then ignored."""
    if generation_config.cache_implementation is not None:
        logger.warning(
            "cache_implementation=%r is ignored: generation_strategy='sparsespec' keeps the KV cache in its own pages",
            generation_config.cache_implementation,
        )
    if model_kwargs.get("use_cache") is False or generation_config.use_cache is False:
        logger.warning("use_cache=False is ignored: generation_strategy='sparsespec' always caches keys and values")


def _requests_from_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int):
    rows = input_ids.tolist()
    if attention_mask is None:
        masks = [[1] * len(row) for row in rows]
    else:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"expected attention_mask of shape {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
            )
        masks = attention_mask.tolist()
    requests = []
    for index, (row, mask) in enumerate(zip(rows, masks)):
        num_pad = len(mask) - sum(1 for m in mask if m)
        if any(mask[:num_pad]) or not all(mask[num_pad:]):
            raise ValueError(
                f"row {index} of attention_mask is not left-padded (zeros first, then ones); "
                "decoder-only generation needs padding_side='left'"
            )
        if num_pad == len(row):
            raise ValueError(f"row {index} of the batch is all padding")
        requests.append(Request(index, row[num_pad:], max_new_tokens, padding=row[:num_pad], batch_row=index))
    return requests


def _pad_token(generation_config: GenerationConfig, eos_ids: set[int]) -> int:
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is not None:
        return int(pad.flatten()[0])
    if generation_config.pad_token_id is not None:
        return int(generation_config.pad_token_id)
    return min(eos_ids) if eos_ids else 0


# --- generate_batch --------------------------------------------------------------------------------
@dataclass
class BatchJob:
    """What `generate_batch` hands the engine: requests, their logits pipeline and stop rules."""

    requests: list[Request]
    pipeline: LogitsPipeline
    do_sample: bool
    stop_checker: StopChecker


def generate_batch(
    model,
    prompts: list[list[int]],
    generation_config: GenerationConfig | None = None,
    sparsespec_config: SparseSpecConfig | None = None,
    progress_bar: bool = False,
) -> list[SparseSpecResult]:
    """Decode ragged prompts (lists of token ids, no padding) with SparseSpec; one result per prompt.

    `generation_config` works as in `generate` (do_sample, temperature, top_k, top_p, repetition
    penalty, eos_token_id, max_new_tokens, ...); without one, the model's own applies.
    """
    config = sparsespec_config if sparsespec_config is not None else SparseSpecConfig()
    if not isinstance(config, SparseSpecConfig):
        raise TypeError(f"sparsespec_config must be a SparseSpecConfig, got {type(config).__name__}")
    job = prepare_batch(model, prompts, generation_config)
    progress = None
    if progress_bar:
        from transformers.utils.logging import tqdm

        progress = tqdm(total=len(job.requests), desc="SparseSpec", unit="request")
    try:
        _run(model, job.requests, config, job.pipeline, job.do_sample, job.stop_checker, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    return [SparseSpecResult(r.prompt, r.generated, r.finish_reason, r.stats) for r in job.requests]


def prepare_batch(model, prompts: list[list[int]], generation_config: GenerationConfig | None = None) -> BatchJob:
    """Validate ragged prompts and build their requests, logits pipeline and stop rules (what
    `generate_batch` runs; benchmarks that drive an `Engine` themselves start here)."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("expected a non-empty list of prompts (lists of token ids)")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple)) or not prompt or not all(isinstance(t, int) for t in prompt):
            raise ValueError(f"prompt {index} must be a non-empty list of token ids, got {prompt!r:.80}")
    generation_config, _ = model._prepare_generation_config(generation_config)
    check_generation_config(generation_config)
    if generation_config.stop_strings:
        raise NotImplementedError("generate_batch takes no tokenizer, so it cannot stop on stop_strings")
    device = next(model.parameters()).device
    model._prepare_special_tokens(generation_config, True, device=device)
    eos = generation_config._eos_token_tensor
    eos_ids = set() if eos is None else {int(t) for t in eos.flatten().tolist()}
    lengths = {len(prompt) for prompt in prompts}
    if len(lengths) > 1:
        for option in ("exponential_decay_length_penalty", "begin_suppress_tokens"):
            if getattr(generation_config, option, None) is not None:
                raise NotImplementedError(
                    f"generate_batch cannot apply {option} to prompts of different lengths (it counts from the "
                    "prompt length); use generate() with a padded batch, or prompts of one length"
                )
    requests = []
    for index, prompt in enumerate(prompts):
        length = len(prompt)
        if generation_config.max_new_tokens is not None:
            max_new_tokens = generation_config.max_new_tokens
        else:
            max_new_tokens = generation_config.max_length - length
        if max_new_tokens < 1:
            raise ValueError(f"prompt {index} ({length} tokens) leaves no room under max_length {generation_config.max_length}")
        requests.append(Request(index, list(prompt), max_new_tokens, batch_row=index))
    # One processor list for every prompt: the length-dependent ones (min_new_tokens) take each
    # request's prompt length as a per-row parameter (`LogitsPipeline.request_params`).
    first = requests[0]
    per_length = generation_config.__class__.from_dict(generation_config.to_dict())
    for name in ("_eos_token_tensor", "_pad_token_tensor", "_bos_token_tensor", "_decoder_start_token_tensor"):
        setattr(per_length, name, getattr(generation_config, name, None))
    per_length.max_length = first.max_total_len
    processors = model._get_logits_processor(
        generation_config=per_length,
        input_ids_seq_length=first.prompt_len,
        encoder_input_ids=torch.tensor([first.prompt], device=device),
        prefix_allowed_tokens_fn=None,
        logits_processor=LogitsProcessorList(),
        device=device,
        model_kwargs={},
    )
    pipeline = LogitsPipeline(processors)
    check_model_supported(model, max(r.max_total_len for r in requests))
    return BatchJob(requests, pipeline, bool(generation_config.do_sample), StopChecker(eos_ids, [], device))
