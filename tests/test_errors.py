"""Every refused option fails before any work with a clear error; plain generate is untouched."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model
from transformers import LogitsProcessor, LogitsProcessorList

import hf_sparsespec
from hf_sparsespec import SparseSpecConfig

PROMPT = torch.tensor([[5, 6, 7, 8]])


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def sparsespec(model, **kwargs):
    kwargs.setdefault("max_new_tokens", 4)
    return model.generate(input_ids=PROMPT, generation_strategy="sparsespec", **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_beams=2), "num_beams > 1"),
        (dict(num_beams=4, num_beam_groups=2, diversity_penalty=0.5), "num_beams > 1"),
        (dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
        (dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
        (dict(guidance_scale=1.5), "guidance_scale"),
        (dict(return_dict_in_generate=True, output_scores=True), "does not return scores"),
        (dict(return_dict_in_generate=True, output_attentions=True), "does not return attentions"),
        (dict(return_dict_in_generate=True, output_hidden_states=True), "does not return hidden_states"),
        (dict(cache_implementation="paged"), "cache_implementation='paged'"),
    ],
)
def test_refused_options(model, kwargs, message):
    with pytest.raises(NotImplementedError, match=message):
        sparsespec(model, **kwargs)


def test_inputs_embeds_are_refused(model):
    embeds = model.get_input_embeddings()(PROMPT)
    with pytest.raises(NotImplementedError, match=r"model inputs \['inputs_embeds'\]"):
        model.generate(inputs_embeds=embeds, max_new_tokens=3, generation_strategy="sparsespec")


def test_assistant_model_is_refused(model):
    with pytest.raises(NotImplementedError, match="assistant_model"):
        sparsespec(model, assistant_model=tiny_model("llama", seed=1))
    with pytest.raises(NotImplementedError, match="assistant_model"):
        model.generate(
            input_ids=PROMPT, max_new_tokens=4, assistant_model=tiny_model("llama", seed=1),
            custom_generate=hf_sparsespec.generate,
        )


def test_unknown_logits_processor_is_refused(model):
    class Mystery(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores

    with pytest.raises(NotImplementedError, match="cannot apply the logits processor Mystery"):
        sparsespec(model, logits_processor=LogitsProcessorList([Mystery()]))


def test_declared_custom_processor_runs(model):
    class Ban(LogitsProcessor):
        sparsespec_kind = "row"

        def __call__(self, input_ids, scores):
            return scores.index_fill(1, torch.tensor([9]), float("-inf"))

    expected = model.generate(input_ids=PROMPT, max_new_tokens=12, logits_processor=LogitsProcessorList([Ban()]))
    out = sparsespec(model, max_new_tokens=12, logits_processor=LogitsProcessorList([Ban()]))
    assert torch.equal(out, expected)


def test_streamer_with_a_batch_is_refused(model):
    class Sink:
        def put(self, value):
            pass

        def end(self):
            pass

    with pytest.raises(NotImplementedError, match="streaming supports one sequence at a time, got a batch of 2"):
        model.generate(input_ids=PROMPT.repeat(2, 1), max_new_tokens=3, generation_strategy="sparsespec", streamer=Sink())


def test_bad_strategy_and_config(model):
    with pytest.raises(ValueError, match="generation_strategy must be one of"):
        model.generate(input_ids=PROMPT, max_new_tokens=3, generation_strategy="medusa")
    with pytest.raises(ValueError, match="sparsespec_config needs generation_strategy"):
        model.generate(input_ids=PROMPT, max_new_tokens=3, sparsespec_config=SparseSpecConfig())
    with pytest.raises(TypeError, match="sparsespec_config must be a SparseSpecConfig, got dict"):
        sparsespec(model, sparsespec_config={"num_draft_tokens": 4})
    with pytest.raises(ValueError, match="either generation_strategy or custom_generate"):
        sparsespec(model, custom_generate=hf_sparsespec.generate)


def test_right_padding_is_refused(model):
    ids = torch.tensor([[5, 6, 0], [5, 6, 7]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="row 0 of attention_mask is not left-padded"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, generation_strategy="sparsespec")


def test_sliding_window_beyond_the_generation_is_refused():
    model = tiny_model("mistral", sliding_window=16)
    with pytest.raises(NotImplementedError, match=r"sliding-window attention \(window 16\)"):
        model.generate(input_ids=PROMPT, max_new_tokens=20, generation_strategy="sparsespec")
    # a window the generation never exceeds changes nothing: accepted, and exact
    expected = model.generate(input_ids=PROMPT, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(input_ids=PROMPT, max_new_tokens=8, generation_strategy="sparsespec"), expected)


def test_encoder_decoder_is_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(
        T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    ).eval()
    with pytest.raises(NotImplementedError, match="encoder-decoder"):
        model.generate(input_ids=PROMPT % 32, max_new_tokens=3, generation_strategy="sparsespec")


def test_plain_generate_is_untouched_and_uninstall_restores(model):
    from transformers.generation.utils import GenerationMixin

    expected = model.generate(input_ids=PROMPT, max_new_tokens=6)
    hf_sparsespec.uninstall()
    try:
        assert not hf_sparsespec.is_installed()
        assert torch.equal(model.generate(input_ids=PROMPT, max_new_tokens=6), expected)
        with pytest.raises(ValueError, match="generation_strategy"):
            model.generate(input_ids=PROMPT, max_new_tokens=6, generation_strategy="sparsespec")
    finally:
        hf_sparsespec.install()
    assert hf_sparsespec.is_installed() and GenerationMixin.generate.__wrapped__ is not None


def test_streamer_without_batch_works_with_custom_generate(model):
    """transformers drops `streamer` for custom_generate callables; we still feed and end it."""
    seen, ended = [], []

    class Recorder:
        def put(self, value):
            seen.append(value.flatten().tolist())

        def end(self):
            ended.append(True)

    out = model.generate(input_ids=PROMPT, max_new_tokens=10, custom_generate=hf_sparsespec.generate, streamer=Recorder())
    assert seen[0] == PROMPT[0].tolist()  # generate puts the prompt itself
    assert sum(seen[1:], []) == out[0, 4:].tolist() and ended == [True]


def test_cache_only_options_are_announced_and_ignored(model, caplog):
    expected = model.generate(input_ids=PROMPT, max_new_tokens=6)
    with caplog.at_level("WARNING", logger="hf_sparsespec.generation"):
        out = sparsespec(model, max_new_tokens=6, cache_implementation="static", use_cache=False)
    assert torch.equal(out, expected)
    assert "cache_implementation='static' is ignored" in caplog.text
    assert "use_cache=False is ignored" in caplog.text


class _Config:
    def __init__(self, **fields):
        self.is_encoder_decoder = False
        self.num_hidden_layers = 2
        self.__dict__.update(fields)

    def get_text_config(self):
        return self


class _Model:
    _supports_attention_backend = True

    def __init__(self, **fields):
        self.config = _Config(**fields)


@pytest.mark.parametrize(
    "model, message",
    [
        (_Model(kv_lora_rank=64), "multi-head latent attention"),
        (_Model(layer_types=["full_attention", "linear_attention"]), "'linear_attention' layers"),
        (_Model(attention_chunk_size=8192), "chunked attention"),
        (_Model(layer_types=["sliding_attention", "full_attention"], sliding_window=128), r"window 128"),
    ],
)
def test_unsupported_attention_kinds_are_refused(model, message):
    from hf_sparsespec.validation import check_model_supported

    with pytest.raises(NotImplementedError, match=message):
        check_model_supported(model, max_total_len=1000)


def test_models_without_the_attention_interface_are_refused():
    from hf_sparsespec.validation import check_model_supported

    model = _Model()
    model._supports_attention_backend = False
    with pytest.raises(NotImplementedError, match="does not route its attention through"):
        check_model_supported(model, max_total_len=10)
    check_model_supported(_Model(layer_types=["sliding_attention"], sliding_window=4096), max_total_len=4096)
