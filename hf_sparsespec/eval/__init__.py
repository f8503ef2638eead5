"""Does SparseSpec keep my accuracy, and how much faster is it on my dataset?

    python -m hf_sparsespec.eval --model smollm2 --dataset .assets/prompts/mmath_en.json \
        --filter data_source=MATH500 --limit 8 --max-new-tokens 256 --out docs/eval/smollm2
    accelerate launch --num_processes 2 -m hf_sparsespec.eval ...      # data parallel

(`hf-sparsespec-eval` is the console script.) Plain `generate` and SparseSpec decode the same
left-padded batches; the report (`results.json`, `results.md`, PNG plots) gives accuracy, tokens/s,
mean accepted drafts per cycle, the acceptance histogram, per-request speedups and, under greedy
decoding, whether every output is identical token for token. In Python: `run_eval(EvalConfig(...))`
returns the report and `write_report(report, out_dir)` writes it.

Modules: `config` (EvalConfig), `data` (loading, fields, prompts), `scoring` (boxed answers,
HumanEval), `runner` (model, decoding, accelerate), `report` (JSON, markdown, plots).
"""

from hf_sparsespec.eval.config import EvalConfig
from hf_sparsespec.eval.report import markdown, write_report
from hf_sparsespec.eval.runner import load_model, run_eval

__all__ = ["EvalConfig", "load_model", "markdown", "run_eval", "write_report"]
