"""SparseSpecConfig validates every field at construction, naming field, expected range and value."""

from __future__ import annotations

import dataclasses
import os

import pytest

from hf_sparsespec import SparseSpecConfig


def test_defaults():
    config = SparseSpecConfig()
    assert (config.num_draft_tokens, config.budget_ratio, config.scheduler) == (8, 0.05, "unified")
    assert config.budget(100) == config.min_budget
    assert config.budget(100_000) == 5000


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_draft_tokens", -1, r"num_draft_tokens must be in \[0, 64\], got -1"),
        ("num_draft_tokens", 65, r"num_draft_tokens must be in \[0, 64\], got 65"),
        ("num_draft_tokens", 2.5, r"num_draft_tokens must be an int, got float 2.5"),
        ("num_draft_tokens", True, r"num_draft_tokens must be an int"),
        ("budget_ratio", 0.0, r"budget_ratio must be in \(0, 1\], got 0.0"),
        ("budget_ratio", 1.5, r"budget_ratio must be in \(0, 1\], got 1.5"),
        ("budget_ratio", float("nan"), r"budget_ratio must be in \(0, 1\], got nan"),
        ("budget_ratio", "0.1", r"budget_ratio must be a float, got '0.1'"),
        ("min_budget", 0, r"min_budget must be >= 1, got 0"),
        ("min_draft_tokens", 0, r"min_draft_tokens must be >= 1, got 0"),
        ("adaptive_draft_tokens", "on", r"adaptive_draft_tokens must be a bool, got 'on'"),
        ("scheduler", "lockstep", r"scheduler must be one of \('unified', 'naive'\), got 'lockstep'"),
        ("selection", "oracle",
         r"selection must be one of \('pillar', 'diagonal', 'induction', 'induction_diagonal', 'streaming', 'dense'\), "
         r"got 'oracle'"),
        ("selection", "Diagonal", r"selection must be one of .*, got 'Diagonal'"),
        ("page_size", 0, r"page_size must be in \[1, 4096\], got 0"),
        ("max_num_requests", -3, r"max_num_requests must be >= 1, got -3"),
        ("num_pages", 0, r"num_pages must be >= 1, got 0"),
        ("gpu_memory_fraction", 1.2, r"gpu_memory_fraction must be in \(0, 1\], got 1.2"),
        ("prefill_chunk_size", 0, r"prefill_chunk_size must be >= 1, got 0"),
        ("backend", "cuda", r"backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'"),
        ("delayed_verification", "yes", r"delayed_verification must be a bool, got 'yes'"),
        ("cuda_graphs", 1, r"cuda_graphs must be a bool, got 1"),
        ("overlap_scoring", "yes", r"overlap_scoring must be a bool, got 'yes'"),
        ("kv_policy", "lru", r"kv_policy must be one of \('dynamic', 'reserve'\), got 'lru'"),
        ("host_pool_bytes", -1, r"host_pool_bytes must be >= 0, got -1"),
        ("offload_chunk_tokens", 0, r"offload_chunk_tokens must be >= 1, got 0"),
    ],
)
def test_invalid_values_name_field_range_and_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        SparseSpecConfig(**{field: value})


def test_host_pool_defaults_to_half_the_physical_memory():
    assert SparseSpecConfig(host_pool_bytes=123).host_pool_size() == 123
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert SparseSpecConfig().host_pool_size() == physical // 2
    assert SparseSpecConfig().kv_policy == "dynamic"


def test_streaming_sinks_must_fit_the_budget():
    with pytest.raises(ValueError, match=r"num_sink_tokens must be < min_budget \(4\) for the streaming selection, got 4"):
        SparseSpecConfig(selection="streaming", min_budget=4, num_sink_tokens=4)


def test_diagonal_selection_is_accepted():
    config = SparseSpecConfig(selection="diagonal", min_budget=4)
    assert config.selection == "diagonal" and config.budget(10) == 4


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SparseSpecConfig().num_draft_tokens = 4
