"""SparseSpec (sparse self-speculative decoding) for Hugging Face Transformers.

    import hf_sparsespec
    out = model.generate(**inputs, generation_strategy="sparsespec", max_new_tokens=4096)

Importing the package registers the `"sparsespec"` attention implementation and adds the
`generation_strategy` argument to `generate` (see `hf_sparsespec.integration`; `uninstall()` removes
it). `model.generate(..., custom_generate=hf_sparsespec.generate)` works without that patch.
"""

from hf_sparsespec.attention import register_attention
from hf_sparsespec.cache import PageAllocator, SparseSpecCache
from hf_sparsespec.config import SparseSpecConfig
from hf_sparsespec.generation import SparseSpecGenerateOutput, SparseSpecResult, generate, generate_batch
from hf_sparsespec.integration import install, is_installed, uninstall
from hf_sparsespec.stats import RequestStats, SparseSpecStats

register_attention()
install()

__all__ = [
    "PageAllocator",
    "RequestStats",
    "SparseSpecCache",
    "SparseSpecConfig",
    "SparseSpecGenerateOutput",
    "SparseSpecResult",
    "SparseSpecStats",
    "generate",
    "generate_batch",
    "install",
    "is_installed",
    "register_attention",
    "uninstall",
]
