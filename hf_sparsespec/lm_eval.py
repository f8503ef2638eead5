"""lm-evaluation-harness as a client of SparseSpec (`pip install "hf_sparsespec[lm_eval]"`).

lm-eval's own `lm_eval` command never imports this package, so transformers would reject
`generation_strategy`. This module is the way in: it imports `hf_sparsespec` (which adds the strategy
to `generate`), registers the lm-eval model `hf-sparsespec`, and hands the command line to lm-eval's
CLI unchanged. Two equivalent uses (greedy: the same generations as plain decoding):

    python -m hf_sparsespec.lm_eval run --model hf --model_args pretrained=ORG/NAME \\
        --tasks gsm8k --gen_kwargs generation_strategy=sparsespec
    python -m hf_sparsespec.lm_eval run --model hf-sparsespec \\
        --model_args pretrained=ORG/NAME,num_draft_tokens=8,budget_ratio=0.05 --tasks gsm8k

(`hf-sparsespec-lm-eval` is the same as a console script.) `hf-sparsespec` is lm-eval's `hf` model
whose `generate_until` decodes with SparseSpec; the `SparseSpecConfig` fields among its model_args
configure it. In Python, `import hf_sparsespec` and pass `gen_kwargs={"generation_strategy":
"sparsespec"}` to `lm_eval.simple_evaluate` with an `HFLM`, or use `SparseSpecLM(pretrained=...)`.
"""

from __future__ import annotations

import dataclasses

import lm_eval.models  # noqa: F401  (registers lm-eval's own models before ours; see get_model)
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import hf_sparsespec  # noqa: F401  (adds generation_strategy= to generate)
from hf_sparsespec.config import SparseSpecConfig

MODEL_NAME = "hf-sparsespec"
_CONFIG_FIELDS = {field.name for field in dataclasses.fields(SparseSpecConfig)}


@register_model(MODEL_NAME)
class SparseSpecLM(HFLM):
    """lm-eval's `HFLM` whose generations use `generation_strategy="sparsespec"`.

    Keyword arguments named like `SparseSpecConfig` fields (`num_draft_tokens`, `budget_ratio`,
    `min_budget`, ...) build its config; all others go to `HFLM`. Log-likelihood tasks are unchanged
    (they run no decoding).
    """

    def __init__(self, *args, **kwargs) -> None:
        options = {name: kwargs.pop(name) for name in list(kwargs) if name in _CONFIG_FIELDS}
        self.sparsespec_config = SparseSpecConfig(**options)
        super().__init__(*args, **kwargs)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        generation_kwargs.setdefault("generation_strategy", "sparsespec")
        if generation_kwargs["generation_strategy"] == "sparsespec":
            generation_kwargs.setdefault("sparsespec_config", self.sparsespec_config)
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def main() -> None:
    """lm-eval's command line, with SparseSpec available (`generation_strategy=sparsespec`, `hf-sparsespec`)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
