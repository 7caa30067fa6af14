"""bench/cuda/lib.sh, what every device script shares: a call cut at its limit still brings back what
its steps had written (lease 6 lost a study whose wait ran past the device budget)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

import pytest

from tests.conftest import wait_until

pytestmark = pytest.mark.faults  # a call killed at its limit: 6 s

LIB = Path(__file__).resolve().parent.parent / "bench" / "cuda" / "lib.sh"

# steps: a study's database with one row, a result, then it waits until the test releases it
JOB = """set -u
SRC=$(pwd)
. "$LIB"
steps() {
    echo "== working"
    python3 -c 'import sqlite3, sys
db = sqlite3.connect(sys.argv[1]); db.execute("create table trials (x)")
db.execute("insert into trials values (42)"); db.commit()' "$W/study.db"
    echo partial > "$W/result.txt"
    while [ ! -f "$W/release" ]; do sleep 0.1; done
}
collect() {
    [ -f "$W/result.txt" ] && cp "$W/result.txt" "$OUT/"
    copy_db "$W/study.db" "$OUT/study.db"
    return 0
}
main "$@"
"""


def test_a_call_cut_at_its_limit_returns_what_the_steps_wrote(tmp_path):
    job_dir, work, out = tmp_path / "src", tmp_path / "w", tmp_path / "out"
    job_dir.mkdir(), out.mkdir()
    (job_dir / "job.sh").write_text(JOB)
    env = {**os.environ, "LIB": str(LIB), "W": str(work), "D": str(tmp_path / "d"), "OUT": str(out),
           "COLLECT_EVERY_S": "1"}
    try:
        # the call asks to wait 60 s and is killed at 6 s, as the device kills a call at its limit
        cut = subprocess.run(["timeout", "6", "bash", "job.sh", "start", "60"], cwd=job_dir, env=env,
                             capture_output=True, text=True)
        assert cut.returncode == 124
        assert (out / "result.txt").read_text() == "partial\n"
        with sqlite3.connect(out / "study.db") as db:  # a whole database, not a torn copy
            assert db.execute("select x from trials").fetchall() == [(42,)]
        log = (out / "log.txt").read_text()
        assert "== working" in log and "== end" not in log  # collected while the steps ran
        assert not list(out.glob(".*.part"))
        # a later call waits again and, the steps done, says so
        (work / "release").touch()
        wait_until(lambda: (work / "done").exists(), timeout=30)
        again = subprocess.run(["bash", "job.sh", "wait", "10"], cwd=job_dir, env=env, capture_output=True,
                               text=True, timeout=60)
        assert again.returncode == 0 and again.stdout.strip().endswith("ALL DONE")
        assert "== end" in (out / "log.txt").read_text()
    finally:
        (work / "release").touch()
