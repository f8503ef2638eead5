"""linear (Triton, split over K) against its float32 reference: awkward token / feature / input counts,
with and without a bias, K split into 1..8 slices (a last slice shorter than the others), a 3-D input,
a weight that is a row slice of a packed buffer, the default tile choice, and bad arguments."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close_to_reference
from kernel_cases import poison_outputs  # noqa: F401

from hf_sparsespec.kernels.linear import LinearConfig, choose_linear_config, linear, linear_ref

SHAPES = [(1, 5, 3), (7, 70, 100), (33, 130, 520), (130, 48, 256)]  # (tokens, out features, in features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, n, k", SHAPES)
@pytest.mark.parametrize("split_k", [1, 3, 8])
def test_linear_matches_the_reference(device, dtype, m, n, k, split_k):
    x = torch.randn(m, k, device=device).to(dtype)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    bias = torch.randn(n, device=device).to(dtype)
    config = LinearConfig(block_m=16 if m <= 16 else 64, block_n=32, block_k=32, split_k=split_k, num_stages=2)
    for b in (bias, None):
        assert_close_to_reference(linear(x, weight, b, config), linear_ref(x, weight, b), dtype)


def test_linear_reads_a_3d_input_and_a_weight_slice_of_a_packed_buffer(device):
    packed = torch.randn(96 + 40, 72, device=device)  # two projections' rows, one buffer
    weight, bias = packed[96:], torch.randn(136, device=device)[96:]
    x = torch.randn(2, 5, 72, device=device)
    out = linear(x, weight, bias)  # the default tiles
    assert out.shape == (2, 5, 40)
    assert_close_to_reference(out, linear_ref(x, weight, bias), torch.float32)


def test_the_tile_choice_splits_k_only_while_the_programs_are_few():
    # down at 64 tokens: 24 tiles 64 wide, K split until 2 programs per SM (16 x 560 inputs)
    assert choose_linear_config(64, 1536, 8960, num_sms=132) == LinearConfig(64, 64, 64, 16)
    # gate/up at 64 tokens: 280 tiles 64 wide (128 wide would leave ~one per SM), no split
    assert choose_linear_config(64, 17920, 1536, num_sms=132) == LinearConfig(64, 64, 64, 1)
    assert choose_linear_config(496, 1536, 1536, num_sms=132) == LinearConfig(128, 64, 64, 4)
    assert choose_linear_config(64, 1536, 256, num_sms=132).split_k == 1  # 4 blocks of K: nothing to split
    assert choose_linear_config(3, 20, 64, num_sms=4) == LinearConfig(16, 64, 64, 1)


def test_linear_rejects_bad_arguments(device):
    x, weight = torch.randn(3, 8, device=device), torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"expected x \[..., K\] and weight \[N, K\]"):
        linear(x, torch.randn(4, 7, device=device))
    with pytest.raises(TypeError, match="expected one dtype"):
        linear(x.half(), weight)
    with pytest.raises(ValueError, match=r"expected bias \[4\]"):
        linear(x, weight, torch.randn(5, device=device))
