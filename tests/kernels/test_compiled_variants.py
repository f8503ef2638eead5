"""Launches with different row counts (a batch's ramp and tail) must reuse one compiled kernel: a new
compile-time constant or integer specialization compiles the kernel again in the middle of decoding
(1.7 s in a 256 x 2048 run: the scoring and fold kernels, docs/measurements.md 25).

Each kernel is replaced by a recorder of what Triton keys its compiled variants on (the constexprs,
the `== 1` and divisibility-by-16 specialization of integer arguments not in `do_not_specialize`,
the dtypes), so the wrappers are checked on the CPU; tests/kernels/test_kernels_gpu.py checks the
same on a GPU through Triton's own compile hook."""

from __future__ import annotations

import kernel_cases  # noqa: F401  (the Triton 3.6 interpreter fix)
import pytest
import torch

from hf_sparsespec.kernels import keyed_sample, pillar_select, tempered_softmax


class VariantRecorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **kwargs)` records the launch's
    variant key instead of running."""

    def __init__(self, kernel):
        self.arg_names = kernel.arg_names
        if hasattr(kernel, "params"):  # a JITFunction (GPU)
            self.not_specialized = {param.name for param in kernel.params if param.do_not_specialize}
        else:  # the interpreter's InterpretedFunction (CPU)
            self.not_specialized = set(kernel.kwargs.get("do_not_specialize") or ())
        self.variants: list[tuple] = []

    def __getitem__(self, grid):
        return self.launch

    def launch(self, *args, **kwargs):
        key = []
        for name, value in zip(self.arg_names, args):
            if isinstance(value, torch.Tensor):
                key.append((name, value.dtype))
            elif isinstance(value, int) and not isinstance(value, bool) and name not in self.not_specialized:
                key.append((name, value == 1, value % 16 == 0))
        key.extend(sorted((name, value) for name, value in kwargs.items()))
        self.variants.append(tuple(key))


def recorded(monkeypatch, module, name: str) -> VariantRecorder:
    recorder = VariantRecorder(getattr(module, name))
    monkeypatch.setattr(module, name, recorder)
    return recorder


def score_rows(num_rows: int, max_rows: int | None, capacity: int = 40):
    """One scoring launch over the first `num_rows` rows of fixed-width buffers (as the engine's)."""
    num_kv_heads, group, head_dim, page_size, k = 2, 3, 16, 4, 3
    k_cache = torch.zeros(64, page_size, num_kv_heads, head_dim)
    page_table = torch.zeros(capacity, 16, dtype=torch.int32)[:num_rows]
    query_start = torch.arange(0, (k + 1) * (num_rows + 1), k + 1, dtype=torch.int32)
    query = torch.zeros((k + 1) * num_rows, num_kv_heads * group, head_dim)
    lse = torch.zeros(query.shape[:2])
    num_old = torch.full((num_rows,), 20, dtype=torch.int32)
    scores = torch.zeros(capacity, num_kv_heads, 64)[:num_rows]
    pillar_select.pillar_scores_into(query, k_cache, page_table, query_start, lse, num_old, scores, 0.25, k + 1,
                                     max_rows=max_rows)  # fmt: skip


def test_the_scoring_kernel_compiles_one_variant_for_every_row_count_up_to_max_rows(monkeypatch):
    """The first graph's 36 verifications, the steady state's 32 and fewer, a single one."""
    recorder = recorded(monkeypatch, pillar_select, "_pillar_scores_kernel")
    for num_rows in (36, 32, 17, 7, 1):
        score_rows(num_rows, max_rows=40)
    assert len(set(recorder.variants)) == 1
    recorder.variants.clear()
    for num_rows in (36, 32):  # padded to this launch's rows alone: two variants (what compiled mid-run)
        score_rows(num_rows, max_rows=None)
    assert len(set(recorder.variants)) == 2


def test_the_scoring_kernel_refuses_more_rows_than_max_rows():
    with pytest.raises(ValueError, match="max_rows: expected at least the 36 rows"):
        score_rows(36, max_rows=32)


@pytest.mark.parametrize("stats_width", [2, 3], ids=["temperature", "truncated"])
@pytest.mark.parametrize("vocab", [100, 4096, 4097, 151_936])
def test_sampling_and_softmax_compile_one_variant_for_every_row_count(monkeypatch, vocab, stats_width):
    """`keyed_sample`'s fold and `tempered_softmax`'s write pass span a row's splits, whose number
    falls as the rows grow (interpreter: 4 SMs, so 1 to 32 splits of a 151,936-token vocabulary); one
    split a row must not switch `keyed_sample` to its single-launch variant. The draws read logits with
    two stats columns (temperature alone) or three (top-k / top-p, `truncation_stats`)."""
    names = {
        keyed_sample: ("_keyed_sample_kernel", "_fold_splits_kernel", "_probabilities_at_kernel"),
        tempered_softmax: ("_softmax_partials_kernel", "_softmax_stats_kernel", "_softmax_write_kernel",
                           "_truncated_partials_kernel"),
    }
    recorders = {name: recorded(monkeypatch, module, name) for module, pair in names.items() for name in pair}
    splits = set()
    for num_rows in (1, 2, 3, 5, 8, 13, 31, 64, 300):
        logits = torch.zeros(num_rows, vocab, dtype=torch.float16)
        stats = torch.zeros(num_rows, stats_width)  # the engine's path: draws from the logits
        keyed_sample.keyed_sample(logits, torch.zeros(num_rows, 2, dtype=torch.int64), stats, 0.7)
        rows = torch.arange(num_rows)
        keyed_sample.probabilities_at(logits, rows, rows, stats, 0.7)
        tempered_softmax.tempered_softmax(logits, 0.7)
        if stats_width == 3:
            tempered_softmax.truncation_stats(logits, 0.7, 20, 0.9)
        splits.add(keyed_sample.vocabulary_splits(num_rows, vocab, keyed_sample.SAMPLE_PROGRAMS_PER_SM,
                                                  logits.device)[2])  # fmt: skip
    for name, recorder in recorders.items():
        assert len(set(recorder.variants)) <= 1, name
    if vocab == 151_936:  # the case is real: from one split a row (300 rows) to 32
        assert len(splits) > 3 and min(splits) == 1 and len(recorders["_fold_splits_kernel"].variants) == 9
        assert max(splits) <= keyed_sample.splits_block(vocab)


@pytest.mark.parametrize("from_logits", [False, True], ids=["probabilities", "logits"])
@pytest.mark.parametrize("vocab", [100, 4097, 151_936])
def test_residual_draws_compile_one_variant_for_every_row_count(monkeypatch, vocab, from_logits):
    """The verifications' recovered tokens: 1 to 36 draws (a batch's tail to the first graph), rows of
    the step's distributions and of the drafts' store, which keep their widths."""
    recorders = [recorded(monkeypatch, keyed_sample, name) for name in ("_keyed_sample_kernel", "_fold_splits_kernel")]
    probs, store = torch.zeros(400, vocab), torch.zeros(300, vocab)
    stats = (torch.zeros(400, 2), torch.zeros(300, 2)) if from_logits else (None, None)
    for num_rows in (36, 32, 13, 7, 2, 1):
        rows = torch.arange(num_rows) * 9
        store_rows = torch.where(rows % 2 == 0, rows, -1)
        keyed_sample.keyed_sample_residual(probs, rows, store, store_rows, torch.zeros(num_rows, 2, dtype=torch.int64),
                                           *stats, 0.7)  # fmt: skip
    for recorder in recorders:
        assert len(set(recorder.variants)) <= 1
    assert len(recorders[0].variants) == 6


@pytest.mark.parametrize("vocab", [1, 15, 4096, 4097, 32_000, 151_936, 262_144])
def test_splits_block_holds_every_split_count_of_its_vocabulary(vocab):
    block = keyed_sample.splits_block(vocab)
    assert block & (block - 1) == 0
    for programs_per_sm in (keyed_sample.SAMPLE_PROGRAMS_PER_SM, tempered_softmax.SOFTMAX_PROGRAMS_PER_SM):
        for num_rows in range(1, 70):
            assert keyed_sample.vocabulary_splits(num_rows, vocab, programs_per_sm, torch.device("cpu"))[2] <= block
