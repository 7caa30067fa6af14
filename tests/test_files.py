"""One atomic write (issue 21 item 5): a write that fails at any point leaves neither a temp file
nor a changed target; permissions hold from the first byte."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from workers.errors import BadInput
from workers.files import atomic_output, atomic_write
from workers.fleet_token import write_token_file

FILL_PAST_LIMIT = """
import resource, signal, sys
from workers.errors import BadInput
from workers.files import atomic_write
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    atomic_write(sys.argv[1], "new " * 100_000)
except BadInput as exc:
    print(exc)
    sys.exit(2)
"""


def test_a_write_that_fails_on_a_full_file_size_leaves_the_target_and_no_temp_file(tmp_path):
    target = tmp_path / "config.json"
    target.write_text("old")
    done = subprocess.run([sys.executable, "-c", FILL_PAST_LIMIT, str(target)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and f"cannot write {target}" in done.stdout, (done.stdout, done.stderr)
    assert os.listdir(tmp_path) == ["config.json"] and target.read_text() == "old"


def test_a_write_interrupted_midway_leaves_the_target_and_no_temp_file(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(UnicodeEncodeError):
        atomic_write(target, "half \udc80 of it")  # fails after the temp file exists
    with pytest.raises(KeyboardInterrupt), atomic_output(target) as handle:
        handle.write("half")
        raise KeyboardInterrupt
    assert os.listdir(tmp_path) == ["out.txt"] and target.read_text() == "old"
    with pytest.raises(BadInput, match="no such directory"):
        atomic_write(tmp_path / "missing" / "x", "x")


def test_a_whole_write_replaces_the_target_with_its_mode(tmp_path):
    target = tmp_path / "token"
    target.write_text("old")
    target.chmod(0o644)
    write_token_file(target, "secret")
    assert target.read_text() == "secret" and stat.S_IMODE(target.stat().st_mode) == 0o600
    atomic_write(target, b"\x00bytes", mode=0o640, fsync=False)
    assert target.read_bytes() == b"\x00bytes" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["token"]
