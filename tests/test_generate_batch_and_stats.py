"""The request-level API, the statistics, streaming and the unified scheduler's balance."""

from __future__ import annotations

import pytest
import torch
from models import assert_fused_draws_the_unfused_tokens, tiny_model
from transformers import GenerationConfig

import hf_sparsespec
from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.scheduler import RowKind, Scheduler

PROMPTS = [[5, 17, 3], [9] * 11, [40, 41, 42, 43, 44, 45, 46], [2]]


def test_generate_batch_matches_plain_greedy_per_prompt():
    model = tiny_model("qwen2")
    config = GenerationConfig(max_new_tokens=25, do_sample=False, eos_token_id=None)
    results = hf_sparsespec.generate_batch(
        model, PROMPTS, config, SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4), progress_bar=True
    )
    assert len(results) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, results):
        expected = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=25, do_sample=False)
        assert result.prompt_ids == prompt
        assert result.generated_ids == expected[0, len(prompt) :].tolist()
        assert result.finish_reason == "length"


def test_generate_batch_sampling_with_length_dependent_processors():
    model = tiny_model("llama")
    config = GenerationConfig(
        max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9, min_new_tokens=6, eos_token_id=3
    )
    torch.manual_seed(0)
    results = hf_sparsespec.generate_batch(model, PROMPTS * 3, config, SparseSpecConfig(num_draft_tokens=3, min_budget=2))
    for result in results:
        assert result.finish_reason in ("eos", "length")
        assert 6 <= len(result.generated_ids) <= 12  # min_new_tokens holds for every prompt length
        if result.finish_reason == "eos":
            assert result.generated_ids[-1] == 3 and 3 not in result.generated_ids[:-1]


@pytest.mark.parametrize("prompts", [[], [[]], [[1, "a"]], "abc"])
def test_generate_batch_rejects_bad_prompts(prompts):
    with pytest.raises(ValueError, match="prompt"):
        hf_sparsespec.generate_batch(tiny_model("llama"), prompts)


def test_stats_are_consistent():
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (5, 8), generator=torch.Generator().manual_seed(2))
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=3, page_size=4)
    out = model.generate(
        input_ids=ids, max_new_tokens=33, do_sample=True, temperature=0.9, generation_strategy="sparsespec",
        sparsespec_config=config, return_dict_in_generate=True, eos_token_id=7,
    )
    stats = out.sparsespec_stats
    assert len(stats.per_request) == 5
    for row, request in enumerate(stats.per_request):
        generated = out.sequences[row, 8:].tolist()
        num_generated = generated.index(7) + 1 if 7 in generated else 33
        assert request.generated_tokens == num_generated
        assert request.generated_tokens == 1 + request.accepted_drafts + request.cycles
        assert request.accepted_drafts <= request.drafted_tokens
        assert sum(request.accepted_histogram) == request.cycles
        assert sum(a * n for a, n in enumerate(request.accepted_histogram)) == request.accepted_drafts
        assert len(request.accepted_histogram) == 5
    total = stats.total
    assert total.cycles == sum(r.cycles for r in stats.per_request)
    assert total.accepted_drafts == sum(r.accepted_drafts for r in stats.per_request)
    assert 0 <= total.mean_accepted_per_cycle <= 4
    assert stats.as_dict()["total"]["cycles"] == total.cycles


def test_num_return_sequences_samples_independently():
    model = tiny_model("llama")
    out = model.generate(
        input_ids=torch.tensor([[4, 5, 6]]), max_new_tokens=10, do_sample=True, num_return_sequences=4,
        generation_strategy="sparsespec",
    )
    assert out.shape == (4, 13) and len({tuple(row) for row in out[:, 3:].tolist()}) > 1


def test_text_streamer_prints_the_generation(capsys):
    from transformers import TextStreamer

    class Tokenizer:  # the least a TextStreamer needs
        def decode(self, ids, **kwargs):
            return "".join(f"<{i}>" for i in ids)

    model = tiny_model("llama")
    prompt = torch.tensor([[4, 5, 6]])
    out = model.generate(
        input_ids=prompt, max_new_tokens=15, generation_strategy="sparsespec",
        streamer=TextStreamer(Tokenizer(), skip_prompt=True),
    )
    printed = capsys.readouterr().out.strip()
    assert printed == "".join(f"<{i}>" for i in out[0, 3:].tolist())


def schedule_trace(policy: str, num_requests: int = 18, k: int = 8) -> list[int]:
    """Verification rows per iteration when `num_requests` requests decode in steady state."""
    model = tiny_model("llama")
    config = SparseSpecConfig(num_draft_tokens=k, selection="dense", scheduler=policy, page_size=8)
    trace = []
    original = Scheduler.schedule

    def recording(self):
        rows = original(self)
        trace.append(sum(row.kind is RowKind.VERIFY for row in rows))
        return rows

    Scheduler.schedule = recording
    try:
        hf_sparsespec.generate_batch(
            model, [[i + 1, 2, 3] for i in range(num_requests)], GenerationConfig(max_new_tokens=80, do_sample=False),
            config,
        )
    finally:
        Scheduler.schedule = original
    return trace[12:60]  # steady state: after the first cycles, before requests finish


def test_unified_scheduler_balances_verifications_naive_runs_lockstep():
    unified, naive = schedule_trace("unified"), schedule_trace("naive")
    assert max(unified) - min(unified) <= 2, unified
    assert max(naive) == 18 and min(naive) == 0, naive


def test_fused_sampling_path_draws_the_pipelines_tokens(monkeypatch):
    """Temperature with a min-length ban of eos, no top-k: the engine bans eos on the model's logits and
    takes `tempered_softmax`, and draws exactly the tokens of the processors-then-softmax path; eos
    never comes before the minimum."""
    from hf_sparsespec.sampling import LogitsPipeline

    model = tiny_model("qwen2")
    ids = torch.randint(1, 96, (4, 6), generator=torch.Generator().manual_seed(5))
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=3, page_size=4)
    sample = dict(do_sample=True, temperature=0.8, top_k=0, top_p=1.0, min_new_tokens=12, max_new_tokens=24,
                  eos_token_id=7, generation_strategy="sparsespec", sparsespec_config=config)  # fmt: skip
    out = assert_fused_draws_the_unfused_tokens(monkeypatch, LogitsPipeline, "ban_eos_in_place", "fused_temperature",
                                                lambda: model.generate(input_ids=ids, **sample), seed=3)  # fmt: skip
    assert (out[:, 6:18] != 7).all()


def test_logits_wider_than_the_output_embeddings_get_a_store_of_their_dtype(monkeypatch):
    """Some models upcast their logits (a float32 softcap): with temperature alone the drafts' store, made
    in the output embeddings' dtype, is made again in the logits' at the first sampled iteration (a
    prefill's, before any graph), and the draws stay those of the processors-then-softmax path."""
    from hf_sparsespec.kernels.backend import TorchBackend
    from hf_sparsespec.runner import ModelRunner

    model = tiny_model("qwen2").half()
    model.lm_head.register_forward_hook(lambda module, args, output: output.float())
    stores = []
    original = ModelRunner._store_drafts
    monkeypatch.setattr(ModelRunner, "_store_drafts", lambda self, *args: stores.append(self.draft_store.values.dtype)
                        or original(self, *args))  # fmt: skip
    ids = torch.randint(1, 96, (3, 6), generator=torch.Generator().manual_seed(6))
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=3, page_size=4)
    sample = dict(do_sample=True, temperature=0.8, top_k=0, top_p=1.0, max_new_tokens=16,
                  generation_strategy="sparsespec", sparsespec_config=config)  # fmt: skip
    assert_fused_draws_the_unfused_tokens(monkeypatch, TorchBackend, "softmax_stats", "fused_temperature",
                                          lambda: model.generate(input_ids=ids, **sample), seed=2)  # fmt: skip
    assert stores and stores[0] == torch.float32


@pytest.mark.parametrize("history", ["repetition-penalty", "min-new-tokens"])
@pytest.mark.parametrize("num_draft_tokens", [4, 0], ids=["sparsespec", "autoregressive"])
def test_top_k_top_p_sampling_skips_the_vocabulary_sort(num_draft_tokens, history, monkeypatch):
    """A model card's sampling (temperature, top-k, top-p after a repetition penalty, or after the
    min-length ban that runs in place on the model's logits): the engine reads the distributions from the
    scores and the backend's `truncation_stats` (no sort of the vocabulary) and draws exactly the tokens
    of the processors-then-softmax path, and of the written `truncated_softmax` (the ablation)."""
    from hf_sparsespec import runner as runner_module
    from hf_sparsespec.kernels.backend import TorchBackend

    model = tiny_model("qwen2")
    ids = torch.randint(1, 96, (4, 6), generator=torch.Generator().manual_seed(8))
    config = SparseSpecConfig(num_draft_tokens=num_draft_tokens, min_budget=3, page_size=4)
    extra = dict(repetition_penalty=1.05) if history == "repetition-penalty" else dict(min_new_tokens=12, eos_token_id=7)
    sample = dict(do_sample=True, temperature=0.7, top_k=12, top_p=0.8, max_new_tokens=20,
                  generation_strategy="sparsespec", sparsespec_config=config, **extra)  # fmt: skip
    out = assert_fused_draws_the_unfused_tokens(monkeypatch, TorchBackend, "truncation_stats", "fused_truncation",
                                                lambda: model.generate(input_ids=ids, **sample), seed=4)  # fmt: skip
    if history == "min-new-tokens":
        assert (out[:, 6:18] != 7).all()
    monkeypatch.undo()
    monkeypatch.setattr(runner_module, "SAMPLE_FROM_LOGITS", 0)
    written = assert_fused_draws_the_unfused_tokens(monkeypatch, TorchBackend, "truncated_softmax",
                                                    "fused_truncation", lambda: model.generate(input_ids=ids, **sample),
                                                    seed=4)  # fmt: skip
    assert torch.equal(written, out)


def test_overlap_scoring_is_ignored_without_cuda():
    """`overlap_scoring` needs a second CUDA stream: on the CPU the scoring stays in line, and nothing
    changes (the GPU test compares both on a device)."""
    model = tiny_model("qwen2")
    ids = torch.randint(1, 96, (3, 7), generator=torch.Generator().manual_seed(2))
    outs = []
    for overlap in (True, False):
        config = SparseSpecConfig(num_draft_tokens=3, min_budget=3, page_size=4, overlap_scoring=overlap)
        outs.append(model.generate(input_ids=ids, do_sample=False, max_new_tokens=16, generation_strategy="sparsespec",
                                   sparsespec_config=config))  # fmt: skip
    assert torch.equal(outs[0], outs[1])
