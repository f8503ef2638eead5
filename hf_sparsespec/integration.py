"""`model.generate(..., generation_strategy="sparsespec")`: the one patch this package makes.

transformers' `generate` has no `generation_strategy` argument; its supported extension point is
`custom_generate=<callable>`. `install()` (run on `import hf_sparsespec`) wraps
`GenerationMixin.generate` once: calls without `generation_strategy` go to the original untouched;
calls with it are forwarded as `custom_generate=hf_sparsespec.generate`, carrying what transformers
would otherwise drop for a callable (the streamer; stop strings, which need the tokenizer).
`uninstall()` restores the original. Models that override `generate` themselves are not reached.
"""

from __future__ import annotations

import functools
import inspect

from transformers import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerationMixin

from hf_sparsespec.generation import generate as sparsespec_generate

STRATEGIES = ("sparsespec",)
_original_generate = None


def is_installed() -> bool:
    return _original_generate is not None


def install() -> None:
    """Add `generation_strategy=` to `GenerationMixin.generate` (idempotent)."""
    global _original_generate
    if _original_generate is not None:
        return
    original = GenerationMixin.generate
    signature = inspect.signature(original)
    if "custom_generate" not in signature.parameters:
        raise RuntimeError("this transformers version has no custom_generate hook; hf_sparsespec needs transformers>=5.17")

    @functools.wraps(original)
    def generate(self, *args, generation_strategy: str | None = None, sparsespec_config=None, **kwargs):
        if generation_strategy is None:
            if sparsespec_config is not None:
                raise ValueError("sparsespec_config needs generation_strategy='sparsespec'")
            return original(self, *args, **kwargs)
        if generation_strategy not in STRATEGIES:
            raise ValueError(f"generation_strategy must be one of {STRATEGIES} or None, got {generation_strategy!r}")
        arguments = signature.bind_partial(self, *args, **kwargs).arguments
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}))
        if arguments.get("custom_generate") is not None:
            raise ValueError("pass either generation_strategy or custom_generate, not both")
        if arguments.get("assistant_model") is not None:
            raise NotImplementedError(
                "generation_strategy='sparsespec' drafts with the model itself; it does not take an assistant_model"
            )
        if arguments.get("cache_implementation") == "paged":
            raise NotImplementedError("generation_strategy='sparsespec' runs its own paged engine; drop cache_implementation='paged'")
        _move_stop_strings(self, arguments)
        return original(
            self,
            custom_generate=sparsespec_generate,
            sparsespec_config=sparsespec_config,
            sparsespec_streamer=arguments.get("streamer"),
            **arguments,
        )

    GenerationMixin.generate = generate
    _original_generate = original


def uninstall() -> None:
    """Put the original `GenerationMixin.generate` back."""
    global _original_generate
    if _original_generate is not None:
        GenerationMixin.generate = _original_generate
        _original_generate = None


def _move_stop_strings(model, arguments: dict) -> None:
    """Turn `stop_strings` into a StopStringCriteria: transformers drops the tokenizer it needs when
    it calls a custom_generate callable."""
    config = arguments.get("generation_config")
    stop_strings = arguments.pop("stop_strings", None)
    if stop_strings is None and config is not None and getattr(config, "stop_strings", None):
        stop_strings = config.stop_strings
        config = config.__class__.from_dict(config.to_dict())
        config.stop_strings = None
        arguments["generation_config"] = config
    if stop_strings is None and getattr(model.generation_config, "stop_strings", None):
        stop_strings = model.generation_config.stop_strings
        arguments["stop_strings"] = None
    if stop_strings is None:
        return
    tokenizer = arguments.pop("tokenizer", None)
    if tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=... to generate")
    criteria = StoppingCriteriaList(arguments.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    arguments["stopping_criteria"] = criteria
