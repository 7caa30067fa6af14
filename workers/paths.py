"""Where fleettune keeps its files on a machine (the head's database and models, a node's config)."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """$FLEETTUNE_HOME, or the user's data dir (XDG on Linux, Application Support on macOS)."""
    if os.environ.get("FLEETTUNE_HOME"):
        return Path(os.environ["FLEETTUNE_HOME"])
    from platformdirs import user_data_dir

    return Path(user_data_dir("fleettune", appauthor=False))
