"""Where pagedjax keeps files it writes: the cache root (conversions, native kernels, XLA cache),
and the names of what it derives from a file (`file_fingerprint`).

Jax-free and import-free, so that the loader, the kernel builder and the config resolution
all read the one rule.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root(download_dir: str | None = None) -> Path:
    """Folder for conversions: `download_dir`, else $PAGEDJAX_CACHE_DIR, else ~/.cache/pagedjax."""
    root = download_dir or os.environ.get("PAGEDJAX_CACHE_DIR") or "~/.cache/pagedjax"
    return Path(root).expanduser()


def file_fingerprint(path: str, *versions: str) -> str:
    """16 hex digits naming what is derived from the file at `path`: a hash of its real path,
    size and modification time (ns) and `versions` (of the derivation's format, of a library
    that reads the file), so that a changed file or a new format gets a new name."""
    st = os.stat(path)
    key = "|".join([os.path.realpath(path), str(st.st_size), str(st.st_mtime_ns), *versions])
    return hashlib.sha256(key.encode()).hexdigest()[:16]
