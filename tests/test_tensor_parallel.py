"""SparseSpec under transformers' tensor parallelism on CPU: 2 processes, gloo, `tp_plan="auto"`
(transformers' own sharding and collectives), run by torchrun through `examples/tp_generate.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from models import assert_greedy_equal, tiny_model

import hf_sparsespec
from hf_sparsespec import SparseSpecConfig
from hf_sparsespec.validation import check_model_supported

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tp_generate.py"
PROMPTS = [[5, 17, 3, 8, 22, 1], [9, 9, 30, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    model = tiny_model("qwen2", num_attention_heads=4, num_key_value_heads=2)
    model.save_pretrained(folder / "model")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(EXAMPLE), "--model",
               str(folder / "model"), "--device", "cpu", "--out", str(folder / "out")]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((folder / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    return model, ranks


def test_tensor_parallel_greedy_equals_one_process_and_plain_generate(tp_run):
    model, ranks = tp_run
    assert all(r["tp_size"] == 2 and r["world_size"] == 2 for r in ranks)
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros((len(PROMPTS), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(PROMPTS):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    single = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    config = SparseSpecConfig(num_draft_tokens=4, min_budget=4, page_size=4)
    single_ss = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                               generation_strategy="sparsespec", sparsespec_config=config)  # fmt: skip
    for rank in ranks:
        tp_plain, tp_greedy = torch.tensor(rank["plain"]), torch.tensor(rank["sparsespec_greedy"])
        assert torch.equal(tp_greedy, tp_plain)  # the same process group, the same numerics: exact
        assert_greedy_equal(model, single, tp_greedy, mask)  # against one process: ties aside
        assert_greedy_equal(model, single_ss, tp_greedy, mask)
        assert rank["greedy_stats"]["cycles"] > 0


def test_tensor_parallel_processes_agree_on_sampled_tokens(tp_run):
    """Each process seeds its own random stream differently; the sampled tokens and acceptances are
    the first process's everywhere, so the sequences and the statistics agree."""
    _, ranks = tp_run
    assert ranks[0]["sparsespec_sampled"] == ranks[1]["sparsespec_sampled"]
    assert ranks[0]["sampled_stats"] == ranks[1]["sampled_stats"]
    assert ranks[0]["sparsespec_sampled"] != ranks[0]["sparsespec_greedy"]  # it did sample


def test_kv_heads_that_do_not_split_are_refused():
    model = tiny_model("qwen2", num_attention_heads=6, num_key_value_heads=3)
    model._tp_size = 2  # what from_pretrained(tp_plan="auto") sets for two processes
    with pytest.raises(NotImplementedError, match="3 KV heads and 6 query heads, which do not split over a tensor-parallel world of 2"):
        check_model_supported(model, 64)


def test_a_model_spread_over_devices_is_refused():
    model = tiny_model("llama")
    model.model.layers[1].to("meta")  # as a device_map over two devices would place a layer
    with pytest.raises(NotImplementedError, match="spread over several devices"):
        model.generate(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=3, generation_strategy="sparsespec")
    assert hf_sparsespec.is_installed()
