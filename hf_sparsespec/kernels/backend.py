"""The backend seam: which implementation of the attention ops a step uses.

`TorchBackend` runs the float32 references (the CPU backend and the oracle); `TritonBackend` runs
the Triton kernels (CUDA, or the CPU interpreter under `TRITON_INTERPRET=1`). Both expose the same
calls: `plan` once per engine step (host-side lengths in, an opaque plan out, no device reads), then
per layer `store_kv`, `mixed_attention` and `pillar_select`, each taking that plan (`plan=None`:
the backend plans for itself, which may sync; for tests).
"""

from __future__ import annotations

from typing import Protocol

import torch

from hf_sparsespec.kernels.mixed_attention import mixed_attention_ref
from hf_sparsespec.kernels.pillar_select import pillar_select_ref
from hf_sparsespec.kernels.store_kv import store_kv_ref


class AttentionBackend(Protocol):
    name: str

    def plan(self, host) -> object:
        """Once per step. `host` has `query_start: list[int]` (len R+1), `context_lens: list[int]`,
        `num_full_rows: int`, `num_selected: list[int]`, `recent_start: list[int]`, `device`."""
        ...

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None: ...

    def mixed_attention(
        self, query, k_cache, v_cache, page_table, query_start, context_lens, num_full_rows,
        recent_start, selected, selection_slot, num_selected, scale, plan=None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # fmt: skip

    def pillar_select(
        self, query, k_cache, page_table, query_start, lse, num_old_keys, budgets,
        max_num_old_keys, max_budget, scale, plan=None,
    ) -> torch.Tensor: ...  # fmt: skip


class TorchBackend:
    """Float32 torch references; correct anywhere, fast nowhere (loops over requests on the host)."""

    name = "torch"

    def plan(self, host) -> None:
        return None

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    def mixed_attention(
        self, query, k_cache, v_cache, page_table, query_start, context_lens, num_full_rows,
        recent_start, selected, selection_slot, num_selected, scale, plan=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return mixed_attention_ref(
            query, k_cache, v_cache, page_table, query_start, context_lens, num_full_rows,
            recent_start, selected, selection_slot, num_selected, scale,
        )  # fmt: skip

    def pillar_select(
        self, query, k_cache, page_table, query_start, lse, num_old_keys, budgets,
        max_num_old_keys, max_budget, scale, plan=None,
    ) -> torch.Tensor:  # fmt: skip
        return pillar_select_ref(
            query, k_cache, page_table, query_start, lse, num_old_keys, budgets, max_num_old_keys, max_budget, scale
        )


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """`"torch"`, `"triton"`, or `"auto"` (Triton on CUDA when its kernels import, torch otherwise)."""
    if name == "torch":
        return TorchBackend()
    if name == "auto" and device.type != "cuda":
        return TorchBackend()
    try:
        from hf_sparsespec.kernels.triton_backend import TritonBackend
    except ImportError as error:
        if name == "triton":
            raise NotImplementedError(f"the Triton backend is not available here: {error}") from error
        return TorchBackend()
    return TritonBackend()
