"""Attention kernels of SparseSpec behind one seam.

Each op lives in its own file: a torch reference `name_ref()` (also the CPU backend) and, where
written, a Triton kernel `_name_kernel` with its wrapper `name()` of the same signature. The engine
talks to an `AttentionBackend` (`get_backend`), never to a kernel directly.
"""

from hf_sparsespec.kernels.backend import AttentionBackend, TorchBackend, get_backend
from hf_sparsespec.kernels.mixed_attention import mixed_attention_ref
from hf_sparsespec.kernels.paged_attention import paged_attention_ref
from hf_sparsespec.kernels.pillar_select import pillar_scores_ref, pillar_select_ref
from hf_sparsespec.kernels.sparse_attention import sparse_draft_attention_ref
from hf_sparsespec.kernels.store_kv import store_kv_ref
from hf_sparsespec.kernels.top_keys import select_top_keys

__all__ = [
    "AttentionBackend",
    "TorchBackend",
    "get_backend",
    "mixed_attention_ref",
    "paged_attention_ref",
    "pillar_scores_ref",
    "pillar_select_ref",
    "select_top_keys",
    "sparse_draft_attention_ref",
    "store_kv_ref",
]
