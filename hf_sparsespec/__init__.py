"""SparseSpec for Hugging Face Transformers."""
