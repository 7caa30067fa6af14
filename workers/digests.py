"""A node's sha256 of its model files, remembered by (path, size, mtime, inode, ctime).

Hashing a model of tens of GB takes a minute; every trial checks its model file before measuring
it, so a study pays for the hash once per file and a changed file (new size, mtime, inode or
ctime) is hashed again. The cache is one small JSON file in the node's data dir, replaced
atomically; a lost or corrupt cache only costs a re-hash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from workers.errors import BadInput
from workers.files import atomic_write
from workers.models import sha256_file
from workers.paths import data_dir

CACHE_NAME = "sha256-cache.json"
MAX_ENTRIES = 256  # a node holds a handful of models; older entries are dropped past this

hashes_computed = 0  # files hashed by this process (the cache's hits do not count)


def cache_path() -> Path:
    return data_dir() / CACHE_NAME


def _identity(stat: os.stat_result) -> list[int]:
    """What changes when the file's bytes can have changed (ctime: even when mtime is put back)."""
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_ctime_ns]


def _load() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save(entries: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(entries), fsync=False)
    except (OSError, BadInput):
        return  # a read-only data dir only means hashing again next time


def sha256_cached(path: str | os.PathLike) -> str:
    """The file's sha256, from the cache when the file is unchanged since it was hashed."""
    global hashes_computed
    key = str(Path(path).resolve())
    before = os.stat(key)
    entries = _load()
    entry = entries.get(key)
    if isinstance(entry, dict) and entry.get("identity") == _identity(before):
        return str(entry["sha256"])
    digest = sha256_file(key)
    hashes_computed += 1
    if _identity(os.stat(key)) == _identity(before):  # not written to while we read it
        entries = _load()  # another process may have added entries meanwhile
        entries.pop(key, None)
        entries[key] = {"identity": _identity(before), "sha256": digest}
        while len(entries) > MAX_ENTRIES:
            entries.pop(next(iter(entries)))
        _save(entries)
    return digest


def remember(path: str | os.PathLike, digest: str) -> None:
    """Record a digest just verified another way (a pushed file checked before its rename)."""
    key = str(Path(path).resolve())
    entries = _load()
    entries.pop(key, None)
    entries[key] = {"identity": _identity(os.stat(key)), "sha256": digest}
    _save(entries)
