"""Random combinations of `generate` arguments and engine configurations, each case drawn from its seed.

Greedy: SparseSpec equals plain `generate` token for token (ties aside) under random mixes of the logits
processors a user passes (repetition penalty, min new tokens, several EOS ids, no-repeat n-grams, bad
words, suppressed tokens at every position or at the first, sequence bias, forced EOS), architectures
and engine configurations (k, selection, page size, scheduler, adaptive drafts, plain steps first).
Sampled (temperature, top-k, top-p, several sequences per prompt): the hard constraints hold on every
row (banned tokens never drawn, no EOS before `min_new_tokens`, nothing but padding after a row's EOS,
no repeated n-gram, the forced EOS on the last position). Arguments plain `generate` rejects are
rejected with its message.
"""

from __future__ import annotations

import random

import pytest
import torch
from models import VOCAB, assert_greedy_equal, ragged_batch, tiny_model

import hf_sparsespec  # noqa: F401  (registers the strategy)
from hf_sparsespec import SparseSpecConfig

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe"]
SELECTIONS = ["pillar", "diagonal", "induction_diagonal", "streaming"]
PAD, EOS = 0, 1


def random_case(seed: int, do_sample: bool) -> tuple[str, list[int], dict, SparseSpecConfig]:
    """The architecture, prompt lengths, `generate` arguments and engine configuration of case `seed`."""
    rng = random.Random(seed)
    arch = rng.choice(ARCHS)
    lengths = [rng.randint(1, 30) for _ in range(rng.randint(1, 5))]
    new = rng.randint(1, 48)
    kwargs: dict = dict(max_new_tokens=new, do_sample=do_sample, pad_token_id=PAD)
    token = lambda: rng.randint(2, VOCAB - 1)  # noqa: E731  (not pad, not the EOS)
    if rng.random() < 0.4:
        kwargs["repetition_penalty"] = rng.choice([0.9, 1.1, 1.3])
    if rng.random() < 0.5:
        kwargs["eos_token_id"] = [EOS] + [token() for _ in range(rng.randint(0, 2))]
        if rng.random() < 0.5:
            kwargs["min_new_tokens"] = rng.randint(1, new)
    if rng.random() < 0.3:
        kwargs["no_repeat_ngram_size"] = rng.randint(2, 4)
    if rng.random() < 0.3:
        kwargs["bad_words_ids"] = [[token()] for _ in range(3)]
    if rng.random() < 0.3:
        kwargs["suppress_tokens"] = [token(), token()]
    if rng.random() < 0.3:
        kwargs["begin_suppress_tokens"] = [token()]
    if rng.random() < 0.2:
        kwargs["sequence_bias"] = {(token(),): 4.0}
    if rng.random() < 0.2:
        kwargs["forced_eos_token_id"] = EOS  # forced on the last position: no min_new_tokens up to there
        kwargs.setdefault("eos_token_id", [EOS])
        kwargs.pop("min_new_tokens", None)
    if do_sample:
        kwargs["temperature"] = rng.choice([0.7, 1.0, 1.5])
        if rng.random() < 0.3:
            kwargs["top_k"] = rng.randint(2, 20)
        if rng.random() < 0.3:
            kwargs["top_p"] = rng.choice([0.8, 0.95])
        if rng.random() < 0.3:
            kwargs["num_return_sequences"] = 2
    k = rng.choice([1, 2, 4, 8])
    selection = rng.choice(SELECTIONS)
    config = dict(num_draft_tokens=k, min_budget=rng.choice([4, 8]), page_size=rng.choice([1, 2, 4, 16]),
                  selection=selection)  # fmt: skip
    if selection == "streaming":
        config["num_sink_tokens"] = 1
    if rng.random() < 0.3:
        config["scheduler"] = "naive"
    if k > 1 and rng.random() < 0.3:
        config.update(adaptive_draft_tokens=True, min_draft_tokens=1)
    if rng.random() < 0.2:
        config["min_draft_context"] = rng.randint(1, 40)
    return arch, lengths, kwargs, SparseSpecConfig(**config)


@pytest.mark.parametrize("seed", range(14))
def test_random_greedy_arguments_match_plain_generate(seed):
    arch, lengths, kwargs, config = random_case(seed, do_sample=False)
    model = tiny_model(arch, seed=seed)
    ids, mask = ragged_batch(lengths, seed=seed)
    expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_strategy="sparsespec",
                         sparsespec_config=config, **kwargs)  # fmt: skip
    assert out.shape == expected.shape
    assert_greedy_equal(model, expected, out, mask)


def test_arguments_plain_generate_rejects_are_rejected_too():
    """Greedy with two sequences per prompt: plain `generate` refuses it, and so does SparseSpec (before any
    decoding), with transformers' own message."""
    model = tiny_model("qwen2")
    ids, mask = ragged_batch([4, 7])
    kwargs = dict(max_new_tokens=6, do_sample=False, num_return_sequences=2)
    with pytest.raises(ValueError) as plain:
        model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    with pytest.raises(ValueError) as ours:
        model.generate(input_ids=ids, attention_mask=mask, generation_strategy="sparsespec", **kwargs)
    assert str(ours.value) == str(plain.value)


@pytest.mark.parametrize("seed", [*range(100, 110), 219])  # 219: an EOS id among the bad words
def test_random_sampled_arguments_keep_their_constraints(seed):
    arch, lengths, kwargs, config = random_case(seed, do_sample=True)
    model = tiny_model(arch, seed=seed)
    ids, mask = ragged_batch(lengths, seed=seed)
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_strategy="sparsespec",
                         sparsespec_config=config, **kwargs)  # fmt: skip
    copies = kwargs.get("num_return_sequences", 1)
    width, new = ids.shape[1], kwargs["max_new_tokens"]
    assert out.shape[0] == ids.shape[0] * copies and width < out.shape[1] <= width + new
    eos = set(kwargs.get("eos_token_id", []))
    # transformers drops EOS ids from `bad_words_ids` (`NoBadWordsLogitsProcessor`); suppressed tokens stay banned
    banned = {w[0] for w in kwargs.get("bad_words_ids", [])} - eos | set(kwargs.get("suppress_tokens", []))
    for row, generated in enumerate(out[:, width:].tolist()):
        end = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
        tokens, tail = generated[:end], generated[end:]
        assert all(t == PAD for t in tail), f"row {row}: tokens after its EOS {tail}"
        assert not banned & set(tokens), f"row {row} drew banned tokens {banned & set(tokens)}"
        if kwargs.get("begin_suppress_tokens"):
            assert tokens[0] not in kwargs["begin_suppress_tokens"]
        if eos and "min_new_tokens" in kwargs:
            # `tokens` end at the row's first EOS, if it has one
            assert tokens[-1] not in eos or len(tokens) > kwargs["min_new_tokens"], f"row {row}: EOS at {len(tokens) - 1}"
        if kwargs.get("forced_eos_token_id") is not None and len(tokens) == new:
            assert tokens[-1] == kwargs["forced_eos_token_id"], f"row {row} did not end with the forced EOS"
        n = kwargs.get("no_repeat_ngram_size")
        if n:
            prompt = ids[row // copies, width - lengths[row // copies] :].tolist()
            sequence = prompt + tokens
            seen: set[tuple[int, ...]] = set()
            for i in range(len(sequence) - n + 1):
                gram = tuple(sequence[i : i + n])
                # an n-gram may repeat inside the prompt; none that ends in the generated part may repeat
                assert i + n <= len(prompt) or gram not in seen, f"row {row} repeated the {n}-gram {gram}"
                seen.add(gram)
