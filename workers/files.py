"""Writing output files whole or not at all, with one clear error where they cannot be written.

Every file fleettune writes for the user (exports, plots, synthetic models) goes to ``NAME.part``
beside the target and is renamed over it only when complete, so a failure never leaves a
half-written file; a folder that does not exist or cannot be written is bad input, not a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from workers.errors import BadInput


def part_path(target: Path) -> Path:
    return target.with_name(target.name + ".part")


def cannot_write(target: str | os.PathLike, exc: OSError) -> BadInput:
    return BadInput(f"cannot write {target}: {exc.strerror or exc}")


def check_writable(target: str | os.PathLike) -> Path:
    """The target as a Path, refused early when it names a folder or its folder is missing."""
    path = Path(target).expanduser()
    if path.is_dir():
        raise BadInput(f"cannot write {target}: it is a directory")
    if not path.parent.is_dir():
        raise BadInput(f"cannot write {target}: no such directory {path.parent}")
    return path


@contextmanager
def atomic_output(target: str | os.PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """An open ``target.part`` that becomes ``target`` when the block ends without an error.

    Any OSError on the way (no permission, a read-only or pseudo file system, a full disk) is
    reported as ``BadInput`` naming the target; the part file is removed in every failure.
    """
    path = check_writable(target)
    part = part_path(path)
    try:
        handle = open(part, mode, **open_kwargs)  # noqa: SIM115 - closed below, before the rename
    except OSError as exc:
        raise cannot_write(target, exc) from None
    try:
        with handle:
            yield handle
        os.replace(part, path)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise cannot_write(target, exc) from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise
