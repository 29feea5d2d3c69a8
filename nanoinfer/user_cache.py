"""Where nanoinfer keeps what it builds or measures once per machine (the CPU peaks, the
compiled CPU kernel): $NANOINFER_CACHE_DIR, else ~/.cache/nanoinfer."""
from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    return Path(os.environ.get("NANOINFER_CACHE_DIR") or Path.home() / ".cache" / "nanoinfer")
