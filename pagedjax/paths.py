"""Where pagedjax keeps files it writes: the cache root (conversions, native kernels, XLA cache).

Jax-free and import-free, so that the loader, the kernel builder and the config resolution
all read the one rule.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(download_dir: str | None = None) -> Path:
    """Folder for conversions: `download_dir`, else $PAGEDJAX_CACHE_DIR, else ~/.cache/pagedjax."""
    root = download_dir or os.environ.get("PAGEDJAX_CACHE_DIR") or "~/.cache/pagedjax"
    return Path(root).expanduser()
