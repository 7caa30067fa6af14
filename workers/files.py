"""Writing files whole or not at all, with one clear error where they cannot be written.

Every file fleettune writes (exports, plots, node configs, the serve status, token and service
files, caches) goes through ``atomic_output`` (streamed) or ``atomic_write`` (bytes or text at
once): a fresh temp file beside the target (``mkstemp``: same file system, no name two writers
share, never through a link), given its permissions before the first byte, renamed over the
target only when complete. A failure at any point removes the temp file and leaves the target as it
was (rule 21.5). ``fsync`` puts the bytes and the rename on disk before returning, for files whose
loss after a power cut matters (node configs, tokens, service files). A folder that does not exist
or cannot be written is bad input, not a traceback.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

from workers.errors import BadInput

PART_SUFFIX = ".part"


def part_path(target: Path) -> Path:
    """The temp name of a writer that must name its output before opening it (a GGUF writer)."""
    return target.with_name(target.name + PART_SUFFIX)


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


def fsync_dir(directory: str | os.PathLike) -> None:
    """Put a rename in ``directory`` on disk (where the file system can sync a folder)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename itself is still atomic
    finally:
        os.close(fd)


@contextmanager
def atomic_output(target: str | os.PathLike, mode: str = "w", *, permissions: int = 0o644,
                  fsync: bool = False, **open_kwargs) -> Iterator[IO]:
    """An open temp file that becomes ``target`` when the block ends without an error.

    ``mode`` is ``open``'s ("w" or "wb"); ``permissions`` the file's mode bits. Any OSError on the
    way (no permission, a read-only or pseudo file system, a full disk) is reported as
    ``BadInput`` naming the target; the temp file is removed in every failure.
    """
    path = check_writable(target)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=PART_SUFFIX, dir=path.parent)
    except OSError as exc:
        raise cannot_write(target, exc) from None
    part = Path(name)
    try:
        try:
            os.fchmod(fd, permissions)
        finally:
            os.close(fd)
        # opened by its name, so ``handle.name`` is the temp file's path (a caller may check it)
        handle = open(part, mode, **open_kwargs)  # noqa: SIM115 - closed below, before the rename
        with handle:
            yield handle
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(part, path)
    except OSError as exc:
        with suppress(OSError):
            part.unlink(missing_ok=True)
        raise cannot_write(target, exc) from None
    except BaseException:
        with suppress(OSError):
            part.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: str | bytes, *, mode: int = 0o644, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8), whole or not at all; ``mode``: its mode bits."""
    binary = isinstance(data, bytes)
    with atomic_output(path, "wb" if binary else "w", permissions=mode, fsync=fsync,
                       **({} if binary else {"encoding": "utf-8"})) as handle:
        handle.write(data)
