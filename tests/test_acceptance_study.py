"""The acceptance study tool (benchmarks/acceptance_study.py) on a tiny random Llama, in seconds.

Invariants of the harness, not of any model: the study attention's prefill equals sdpa; dense drafting
accepts every draft; a budget covering every old key makes each policy dense; PillarAttn and streaming
attend exactly B old keys per (layer, KV head) and the byte count follows; Quest's bound bounds q.k.
No ordering of policies (per-step oracle >= frozen oracle >= PillarAttn) holds cycle by cycle under
greedy acceptance, so none is asserted. A mutated harness (drafts blind to their own keys) must fail
the dense check, which shows that check can fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from acceptance_study import summarize  # noqa: E402
from study_harness import Study  # noqa: E402
from study_policies import (  # noqa: E402
    NO_OFFSET,
    DraftView,
    VerifyView,
    diagonal_offsets,
    induction_keys,
    make_policy,
    moved_keys,
    quest_bound,
    top_mask,
)
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from hf_sparsespec import SparseSpecConfig  # noqa: E402

K = 8
SPECS = ["dense", "pillar", "streaming", "oracle_step", "oracle_first", "oracle_frozen", "quest:page_size=4",
         "rerank:candidates=2", "shared:mode=mass", "shared:mode=entropy", "diagonal", "induction",
         "induction:top=2,diagonal=1", "induction:top=2,diagonal=1,carry=0.5", "pillar:refresh=2",
         "induction:top=2,diagonal=1,refresh=3", "induction:top=2,diagonal=1,local=4"]  # fmt: skip


@pytest.fixture(scope="module")
def model(one_thread):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(1)).tolist()


def run(model, tokens, specs, min_budget, study_class=Study, cycles=4):
    study = study_class(model, [make_policy(s, min_budget) for s in specs], num_draft=K)
    return study, study.run_text(tokens, [40, 97], cycles)


def test_prefill_matches_sdpa(model, tokens):
    study = Study(model, [make_policy("dense", 8)], num_draft=K)
    ids = torch.tensor(tokens)
    ours = study.prefill(ids, all_logits=True)
    model.set_attn_implementation("sdpa")
    try:
        reference = model(ids[None]).logits[0]
    finally:
        model.set_attn_implementation("acc_study")
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_dense_accepts_everything_and_sparse_does_not(model, tokens):
    _, records = run(model, tokens, SPECS, min_budget=8)
    assert {r["accepted"] for r in records if r["policy"] == "dense"} == {K}
    assert len(records) == len(SPECS) * 2 * 4
    sparse = [r["accepted"] for r in records if r["policy"] == "pillar"]
    assert min(sparse) < K  # a random model is sensitive to sparsity: the checks below are not vacuous


def test_full_budget_makes_every_policy_dense(model, tokens):
    _, records = run(model, tokens, SPECS, min_budget=10_000)
    for r in records:
        assert r["accepted"] == K, r
        assert r["old_keys_per_head"] == r["recent_start"], r  # every old key, each (layer, KV head)


def test_pillar_and_streaming_attend_exactly_the_budget(model, tokens):
    study, records = run(model, tokens, ["pillar", "streaming"], min_budget=8)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    units = config.num_hidden_layers * config.num_key_value_heads
    for r in records:
        engine_budget = SparseSpecConfig(min_budget=8).budget(r["recent_start"] + K + 1)  # the engine's rule
        assert r["budget"] == min(r["recent_start"], engine_budget)
        assert r["old_keys_per_head"] == r["budget"]
        window = r["t"] - r["recent_start"] + (K + 1) / 2  # recent text keys + the mean draft keys of a step
        expected = 2 * units * (r["budget"] + window) * head_dim * study.kv_bytes
        assert r["bytes_per_step"] == pytest.approx(expected, rel=1e-6)


def test_a_local_window_adds_the_newest_old_keys_to_the_selections_budget(model, tokens):
    """`local=w`: PillarAttn's B keys come from before the window, so a draft attends B + w old keys."""
    _, records = run(model, tokens, ["pillar:local=6"], min_budget=8)
    for r in records:
        assert r["old_keys_per_head"] == min(r["recent_start"], r["budget"] + 6), r
    with pytest.raises(ValueError, match="local"):
        make_policy("streaming:local=4", 8)


class BlindDrafts(Study):
    """A mutation: draft steps do not see the cycle's own draft keys (a bug the dense check must catch)."""

    def _draft_attention(self, layer, query, key, value, scale):
        self.draft_k[layer].zero_()
        self.draft_v[layer].zero_()
        return super()._draft_attention(layer, query, torch.zeros_like(key), torch.zeros_like(value), scale)


def test_a_policy_with_its_own_budget_rule_is_compared_with_the_studys_pillar(model, tokens):
    _, records = run(model, tokens, ["pillar", "pillar:min_budget=16"], min_budget=8)
    larger = [r for r in records if r["policy"] == "pillar:min_budget=16"]
    assert {r["min_budget"] for r in larger} == {8}  # the study's setting, which it is compared at
    assert all(r["budget"] == min(r["recent_start"], 16) for r in larger)  # ... while it drafts with its own
    rows = {r["policy"]: r for r in summarize([r | {"text": 0, "local_distinct4": 1.0} for r in records], K, [100])}
    assert rows["pillar:min_budget=16"]["bytes_vs_pillar"] > 1.0


def test_a_broken_harness_fails_the_dense_check(model, tokens):
    _, records = run(model, tokens, ["dense"], min_budget=8, study_class=BlindDrafts)
    assert min(r["accepted"] for r in records) < K


def test_top_mask_and_quest_bound():
    scores = torch.tensor([[[0.1, 0.5, float("-inf"), 0.3, 0.5]]])
    assert top_mask(scores, torch.tensor([[2]])).tolist() == [[[False, True, False, False, True]]]
    assert top_mask(scores, torch.tensor([[9]])).sum() == 4  # never a -inf entry
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 2, 4, 16, generator=generator)
    keys = torch.randn(2, 40, 16, generator=generator)
    pages = keys.view(2, 10, 4, 16)
    bound = quest_bound(query, pages.amin(2), pages.amax(2))
    exact = torch.einsum("rhgd,hnd->rhgn", query, keys).view(3, 2, 4, 10, 4).amax(-1).amax(2)
    assert (bound >= exact - 1e-5).all()


def test_policy_specs():
    assert make_policy("rerank:candidates=1.5", 64).candidates == 1.5
    assert make_policy("quest:with_pillar=0,page_size=8", 64).page_size == 8
    budget = make_policy("pillar:budget_scale=2", 64).budget(torch.tensor([10, 1000, 5000]), K)
    assert budget.tolist() == [10, 128, 502]
    with pytest.raises(ValueError, match="expected one of"):
        make_policy("nope", 64)
    # the budget rule of one policy: max(min_budget, ceil(budget_ratio * (t + k + 1))), clamped to t
    flat = make_policy("pillar:min_budget=112,budget_ratio=0.045", 64)
    assert flat.budget(torch.tensor([50, 1000, 5000]), K).tolist() == [50, 112, 226]
    assert flat.study_min_budget == 64  # compared with the study's PillarAttn at min_budget 64
    with pytest.raises(ValueError, match="budget rule"):
        make_policy("pillar:budget_ratio=0", 64)


def test_pillar_score_pools():
    # one row, one KV head, a group of 2 heads, 2 block queries, 4 keys (key 3 is the block's own)
    probs = torch.zeros(1, 1, 2, 2, 4)
    probs[0, 0, 0, 0, 0] = 0.8  # head 0, first query: key 0
    probs[0, 0, 1, 1, 1] = 0.6  # head 1, last query: key 1
    probs[0, 0, :, :, 2] = 0.2  # every head and query a little: key 2
    view = VerifyView(probs=probs, block_start=torch.tensor([3]), budget=torch.tensor([1]))
    expected = {
        "mean": [0.2, 0.15, 0.2],
        "max": [0.8, 0.6, 0.2],
        "headmax": [0.4, 0.3, 0.2],
        "late": [0.8 / 3 / 2, 0.6 * 2 / 3 / 2, 0.2],
    }
    for pool, scores in expected.items():
        got = view.pillar_scores(pool)[0, 0]
        assert torch.allclose(got[:3], torch.tensor(scores)), pool
        assert got[3] == float("-inf")  # not old
    assert make_policy("pillar:pool=headmax", 64).pool == "headmax"
    assert make_policy("pillar:pool=split1024", 64).pool == "split1024"
    assert make_policy("pillar:pool=running1024", 64).pool == "running1024"
    for bad in ("median", "split", "split0", "splitx", "running", "runningx"):
        with pytest.raises(ValueError, match="pool: expected one of"):
            make_policy(f"pillar:pool={bad}", 64)


def test_split_pooled_scores():
    """The one-pass approximation of PillarAttn's mean: exact with one split, and with several when each
    head's queries put equal mass in every split; otherwise keys get the head's mean mass of their split."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(2, 2, 3, 4, 10, generator=generator)  # rows, KV heads, group, queries, keys
    probs /= probs.sum(-1, keepdim=True)
    view = VerifyView(probs=probs, block_start=torch.tensor([9, 10]), budget=torch.tensor([2, 2]))
    exact = view.pillar_scores("mean")
    assert torch.allclose(view.pillar_scores("split16"), exact)  # one split
    # equal split masses within each head: keys 0-4 hold 0.3 of every query, keys 5-9 0.7
    even = probs.clone()
    even[..., :5] *= 0.3 / even[..., :5].sum(-1, keepdim=True)
    even[..., 5:] *= 0.7 / even[..., 5:].sum(-1, keepdim=True)
    even_view = VerifyView(probs=even, block_start=view.block_start, budget=view.budget)
    assert torch.allclose(even_view.pillar_scores("split5"), even_view.pillar_scores("mean"))
    # one query of head 0 puts all its mass in the first split, the other three in the second
    skewed = torch.zeros(1, 1, 1, 4, 4)
    skewed[0, 0, 0, 0, 0] = 1.0
    skewed[0, 0, 0, 1:, 2:] = 0.5
    skewed_view = VerifyView(probs=skewed, block_start=torch.tensor([4]), budget=torch.tensor([1]))
    assert torch.allclose(skewed_view.pillar_scores("mean")[0, 0], torch.tensor([0.25, 0.0, 0.375, 0.375]))
    # split 0 (keys 0-1) holds a mean mass of 0.25, split 1 of 0.75; within a split, each query's
    # normalised probabilities are weighted by that mean, so key 0 gets 1 x 0.25 / 4 and keys 2-3 each
    # 3 x 0.5 x 0.75 / 4: both lose against the exact scores
    assert torch.allclose(skewed_view.pillar_scores("split2")[0, 0], torch.tensor([0.0625, 0.0, 0.28125, 0.28125]))


def test_carried_scores_decay_across_verifications():
    # one row, one KV head, a group of 1, one block query; the first verification sees keys 0-2 as old,
    # the second keys 0-4
    policy = make_policy("pillar:carry=0.5", 64)
    policy.bind(slice(0, 1), num_layers=1)
    first = torch.tensor([0.9, 0.05, 0.05, 0.0, 0.0, 0.0])
    second = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.0])
    for probs, start in ((first, 3), (second, 5)):
        view = VerifyView(probs=probs.view(1, 1, 1, 1, 6), block_start=torch.tensor([start]), budget=torch.tensor([2]))
        policy.after_verify(0, view)
    carried = policy.history[0][0, 0]
    assert torch.allclose(carried[:5], torch.tensor([0.45, 0.125, 0.225, 0.3, 0.4]))
    assert carried[5] == float("-inf")  # not old
    assert policy.masks[0][0, 0].nonzero().flatten().tolist() == [0, 4]  # key 0 kept by its history
    without = make_policy("pillar", 64)
    without.bind(slice(0, 1), num_layers=1)
    without.after_verify(0, view)
    assert without.masks[0][0, 0].nonzero().flatten().tolist() == [3, 4]
    # a new text (bind) forgets the history
    policy.bind(slice(0, 1), num_layers=1)
    assert policy.history == [None]
    with pytest.raises(ValueError, match="carry: expected"):
        make_policy("pillar:carry=1", 64)
    with pytest.raises(ValueError, match="does not select by PillarAttn"):
        make_policy("oracle_step:carry=0.5", 64)


def test_refresh_keeps_the_last_selection_and_widens_the_window(model, tokens):
    _, records = run(model, tokens, ["pillar", "pillar:refresh=2"], min_budget=8, cycles=6)
    stale = {(r["episode"], r["cycle"]): r for r in records if r["policy"] == "pillar:refresh=2"}
    fresh = {(r["episode"], r["cycle"]): r for r in records if r["policy"] == "pillar"}
    checked = 0
    for (episode, cycle), r in stale.items():
        if cycle % 2 == 1:  # drafts after verification cycle - 1 (even): a refresh, as PillarAttn's
            assert r["old_keys_per_head"] == r["budget"]
        elif (episode, cycle - 1) in stale:  # the last refresh's selection + its block start onwards
            before = stale[(episode, cycle - 1)]
            assert r["old_keys_per_head"] == before["budget"] + r["recent_start"] - before["recent_start"]
            assert r["recent_start"] > before["recent_start"]
            checked += 1
    assert checked >= 4
    # the first cycles (before any stale one) draft exactly as PillarAttn
    assert all(stale[key]["accepted"] == fresh[key]["accepted"] for key in stale if key[1] == 1)
    with pytest.raises(ValueError, match="refresh: expected an int"):
        make_policy("pillar:refresh=0", 64)
    with pytest.raises(ValueError, match="does not select at verification"):
        make_policy("oracle_step:refresh=2", 64)


def test_moved_keys_follow_the_diagonal():
    offsets = torch.tensor([[[-5, -1, -300]]])  # one row, one KV head
    mask = moved_keys(offsets, torch.tensor([10]), num_keys=12)
    assert mask.nonzero()[:, -1].tolist() == [5, 9]  # 10 - 300 is outside the text


def test_confirmed_diagonal_offsets_keep_only_shared_ones():
    """`confirm=c`: an offset survives when at least c entries of its (row, KV head) list share it."""
    n = 12  # keys; the block of 3 queries starts at 6
    probs = torch.zeros(1, 1, 2, 3, n)  # [r, kvh, group 2, Q 3, N]
    for query, (diagonal_key, other_key) in enumerate([(2, 0), (3, 5), (4, 1)]):
        probs[0, 0, 0, query, diagonal_key] = 1.0  # head 0 walks the diagonal: offset -4 for every query
        probs[0, 0, 1, query, other_key] = 1.0  # head 1: offsets -6, -2, -7, one entry each
    view = VerifyView(probs=probs, block_start=torch.tensor([6]), budget=torch.tensor([4]))
    # entries e = g * Q + i (the study's order: head-major)
    assert diagonal_offsets(view, top=1).tolist() == [[[-4, -4, -4, -6, -2, -7]]]
    assert diagonal_offsets(view, top=1, confirm=2).tolist() == [[[-4, -4, -4] + [NO_OFFSET] * 3]]
    assert diagonal_offsets(view, top=1, confirm=4).tolist() == [[[NO_OFFSET] * 6]]
    assert make_policy("induction:top=16,diagonal=1,confirm=2", 64).confirm == 2
    with pytest.raises(ValueError, match="confirm"):
        make_policy("diagonal:confirm=0", 64)


def test_induction_keys_are_the_successors_of_the_latest_old_matches():
    text = torch.tensor([7, 1, 7, 2, 3, 7, 4, 7, 5, 6])
    old = torch.arange(10)[None, :] < torch.tensor([[8], [4]])  # recent_start 8, then 4
    view = DraftView(step=0, position=torch.tensor([9, 9]), query=None, logits=None, draft_logits=None, old=old,
                     recent=~old, budget=None, page_summaries=None, input_token=torch.tensor([7, 7]), text=text)  # fmt: skip
    mask = induction_keys(view, top=2, num_keys=10)
    # row 0: 7 occurs at 0, 2, 5 (and 7, whose successor 8 is not old): the latest two give 6 and 3
    assert mask[0].nonzero().flatten().tolist() == [3, 6]
    assert mask[1].nonzero().flatten().tolist() == [1, 3]  # recent_start 4: successors 1 and 3 only


def test_bigram_induction_keys_put_matches_of_the_previous_token_first():
    """`ngram=2`: the latest occurrences preceded by the query's previous token first, then the latest others."""
    text = torch.tensor([5, 7, 1, 9, 7, 2, 5, 7, 3, 4, 9, 7, 5, 7])  # position 13 reads 7 after a 5
    old = torch.arange(14)[None, :] < 12
    view = DraftView(step=0, position=torch.tensor([13]), query=None, logits=None, draft_logits=None, old=old,
                     recent=~old, budget=None, page_summaries=None, input_token=torch.tensor([7]), text=text)  # fmt: skip
    # 7 occurs at 1, 4 and 7 with an old successor; 1 and 7 come after a 5
    assert induction_keys(view, top=2, num_keys=14).nonzero()[:, 1].tolist() == [5, 8]  # the latest two
    assert induction_keys(view, top=2, num_keys=14, ngram=2).nonzero()[:, 1].tolist() == [2, 8]  # the bigrams
    assert induction_keys(view, top=3, num_keys=14, ngram=2).nonzero()[:, 1].tolist() == [2, 5, 8]  # back-off
    with pytest.raises(ValueError, match="ngram"):
        make_policy("induction:ngram=3", 64)


def test_summary_rows():
    records = [
        {"policy": p, "min_budget": 64, "text": 0, "episode": e, "t": t, "budget": 64, "accepted": a,
         "bytes_per_step": b, "old_keys_per_head": 64.0, "local_distinct4": 0.9}
        for p, b, accepted in (("pillar", 100.0, (2, 4)), ("diagonal", 115.0, (6, 8)))
        for e, a in enumerate(accepted)
        for t in (100, 900)
    ]  # fmt: skip
    rows = {r["policy"]: r for r in summarize(records, K, [500])}
    assert rows["pillar"]["accepted"] == 3 and rows["pillar"]["se"] == pytest.approx(1.0)
    assert rows["diagonal"]["bytes_vs_pillar"] == pytest.approx(1.15)
    assert rows["diagonal"]["by_context"]["0-500"]["cycles"] == 2
    assert rows["pillar"]["histogram"][2] == 0.5


def test_held_out_texts_start_on_other_problems(monkeypatch, tmp_path):
    """`--first-problem`: the pool rotates (held-out texts are on other problems), out-of-range starts
    are refused, and a texts file made before the option still matches the default recipe while one
    made with another start does not."""
    import json

    import study_traces

    pool = [{"question": f"q{i}", "data_source": source} for i, source in enumerate(["AIME2024", "MATH500"] * 3)]
    monkeypatch.setattr(study_traces, "load_mmath", lambda: pool)
    default = [p["question"] for p in study_traces.problems()]
    assert [p["question"] for p in study_traces.problems(first=4)] == default[4:] + default[:4]
    with pytest.raises(ValueError, match="first problem"):
        study_traces.problems(first=len(pool))
    recipe = dict(max_new=8, min_new=0, temperature=0.6, top_p=1.0, seed=1, penalty=0.0, window=96, turns=False,
                  turn_cap=1400)  # fmt: skip
    path = tmp_path / "texts.json"
    path.write_text(json.dumps([{"tokens": [1, 2], "prompt_len": 1, "forced": [[0, 1]], "recipe": recipe}]))
    assert study_traces.load_or_generate(path, None, None, 1, **recipe, first_problem=0)[0]["tokens"] == [1, 2]
    with pytest.raises(ValueError, match="recipe"):
        study_traces.load_or_generate(path, None, None, 1, **recipe, first_problem=4)


def test_running_pooled_scores():
    """The single-pass variant: with one block per split and equal maxima among a head's queries it is
    exact; a key in a block before its query's maximum comes out larger than its probability."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4]).expand(1, 1, 1, 2, 4).clone()  # two queries, same maxima
    view = VerifyView(probs=probs, block_start=torch.tensor([4]), budget=torch.tensor([1]))
    assert torch.allclose(view.pillar_scores("running4"), view.pillar_scores("mean"))
    # 128 keys in one split of two blocks: the query's maximum sits in the second block
    probs = torch.full((1, 1, 1, 1, 128), 0.5 / 127)
    probs[..., 100] = 0.5
    view = VerifyView(probs=probs, block_start=torch.tensor([128]), budget=torch.tensor([1]))
    running = view.pillar_scores("running128")[0, 0]
    assert torch.allclose(running[64:], probs[0, 0, 0, 0, 64:])  # the block holding the maximum: exact
    # the first block's keys are relative to their own block's maximum, 0.5 / 127: weighted by 0.5, not 0.5 / 127
    assert torch.allclose(running[:64], torch.full((64,), 0.5))
