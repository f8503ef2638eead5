"""lm-evaluation-harness as a client: a greedy `generate_until` task on a local JSONL file gives the same
generations and the same metric with `generation_strategy="sparsespec"` as plain decoding, at batch
sizes 1 and 4, in Python and through `python -m hf_sparsespec.lm_eval`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from models import tiny_model, tiny_tokenizer

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from hf_sparsespec.lm_eval import SparseSpecLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TASK = "tiny_sparsespec_gen"
QUESTIONS = [f"Q: what is {i} plus {i + 3}?\nA:" for i in range(6)] + ["Q: name a colour.\nA:", "Q: 2*7?\nA:"]
# stop sequences the tiny model produces at different positions in different rows (and never in others),
# so in a batch some rows stop early, lm-eval's all-rows-done criterion holds the batch, and rows run ahead
UNTIL = ["`", "W", "p"]
MAX_GEN_TOKS = 20


def write_task(folder: Path, targets: list[str]) -> None:
    with open(folder / "data.jsonl", "w") as f:
        for question, target in zip(QUESTIONS, targets):
            f.write(json.dumps({"question": question, "answer": target}) + "\n")
    (folder / "task.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )


def evaluate(lm, folder: Path, gen_kwargs: dict | None = None) -> tuple[float, list[str]]:
    results = lm_eval.simple_evaluate(
        model=lm, tasks=[TASK], task_manager=TaskManager(include_path=str(folder), include_defaults=False), gen_kwargs=gen_kwargs,
        log_samples=True,
    )
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return results["results"][TASK]["exact_match,none"], [s["resps"][0][0] for s in samples]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The task, with targets that half of plain decoding's answers match (so the metric is 0.5)."""
    folder = tmp_path_factory.mktemp("lm_eval_task")
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    write_task(folder, ["?"] * len(QUESTIONS))
    _, answers = evaluate(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1), folder)
    lengths = [len(a) for a in answers]
    assert min(lengths) < MAX_GEN_TOKS // 2 and max(lengths) == MAX_GEN_TOKS  # stops fire, and not for every row
    write_task(folder, [a if i % 2 == 0 else a + "!" for i, a in enumerate(answers)])
    return folder, model, tokenizer, answers


@pytest.mark.parametrize("batch_size", [1, 4])
def test_generate_until_matches_plain(task, batch_size):
    folder, model, tokenizer, answers = task
    plain = evaluate(HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size), folder)
    sparse = evaluate(
        HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size), folder, {"generation_strategy": "sparsespec"}
    )
    assert plain == (0.5, answers)
    assert sparse == plain


def test_registered_model_with_config_options(task):
    folder, model, tokenizer, answers = task
    lm = SparseSpecLM(pretrained=model, tokenizer=tokenizer, batch_size=4, num_draft_tokens=3, min_budget=2)
    assert lm.sparsespec_config.num_draft_tokens == 3
    assert evaluate(lm, folder) == (0.5, answers)


def test_command_line(task, tmp_path):
    folder, model, tokenizer, answers = task
    checkpoint = tmp_path / "tiny"
    model.save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    out = tmp_path / "results"
    command = [
        sys.executable, "-m", "hf_sparsespec.lm_eval", "run", "--model", "hf",
        "--model_args", f"pretrained={checkpoint},dtype=float32", "--tasks", TASK, "--include_path", str(folder),
        "--gen_kwargs", "generation_strategy=sparsespec", "--batch_size", "4", "--device", "cpu",
        "--output_path", str(out), "--log_samples",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, cwd=Path(__file__).parent, timeout=300, env=env)
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    assert results["results"][TASK]["exact_match,none"] == 0.5
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()]
    assert [s["resps"][0][0] for s in sorted(samples, key=lambda s: s["doc_id"])] == answers
