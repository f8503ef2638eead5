"""benchmarks/kernel_resources.py: the mixed attention kernel compiled ahead of time for sm_90 with a
real launch's specialisations. The engine's configuration fits two CTAs an SM and its K/V loads are
pipelined (asynchronous copies); the occupancy arithmetic follows the CUDA tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import kernel_resources  # noqa: E402

SCRIPT = BENCHMARKS / "kernel_resources.py"


def test_the_engines_mixed_kernel_is_pipelined_and_fits_two_ctas_an_sm(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}  # a GPU-target compile
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--shapes", "sparsespec", "--configs", "engine", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads((tmp_path / "kernel_resources.json").read_text())["rows"]
    assert (row["BLOCK_N_FULL"], row["BLOCK_N_DRAFT"], row["num_warps"], row["num_stages"]) == (64, 128, 4, 3)
    assert row["block_m_full"] == 64  # 9 queries x a group of 6
    assert 0 < row["registers"] <= 255 and row["shared"] > 0
    assert row["async_copies"] > 0  # the K/V blocks are prefetched, not loaded and waited for
    assert row["ctas_per_sm"] >= 2
    assert "| sparsespec | engine (64:128:4:3) | 64 |" in run.stdout


def test_occupancy_follows_the_register_and_shared_memory_limits():
    # 255 registers a thread: 8,192 a warp (32 x 255 = 8,160, in 256-register chunks), 4 warps -> 2 CTAs
    assert kernel_resources.occupancy(255, 82176, 4, 90) == dict(ctas_by_registers=2, ctas_by_shared=2, ctas_per_sm=2)
    # 8 warps of 206 registers: 6,656 a warp -> one CTA; shared memory alone would allow two
    assert kernel_resources.occupancy(206, 82176, 8, 90) == dict(ctas_by_registers=1, ctas_by_shared=2, ctas_per_sm=1)
    # small CTAs: the 32-CTA limit
    assert kernel_resources.occupancy(32, 0, 1, 90)["ctas_per_sm"] == 32
    # sm_80 has less shared memory: 167,936 // (82,176 + 1,024) = 2; 100 KB -> 1
    assert kernel_resources.occupancy(128, 82176, 4, 80)["ctas_by_shared"] == 2
    assert kernel_resources.occupancy(128, 102400, 4, 80)["ctas_by_shared"] == 1


def test_a_bad_config_is_refused_clearly():
    with pytest.raises(SystemExit, match="BLOCK_N_FULL:BLOCK_N_DRAFT:num_warps:num_stages"):
        kernel_resources.parse_config("64:128:4", 128, kernel_resources.torch.bfloat16)
