"""Where derived, re-creatable files live (exported model directories): defined with the
model files (``splitserve.contracts.model_files``), which config validation reads too."""

from __future__ import annotations

from splitserve.contracts.model_files import cache_root, model_cache_dir

__all__ = ["cache_root", "model_cache_dir"]
