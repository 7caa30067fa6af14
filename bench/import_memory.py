"""Peak memory of `fleettune import llama-bench` on a large file (issue 24, case 12).

Writes a llama-bench ``-o jsonl`` (or ``-o json``) file of about ``--mb`` megabytes, rows shaped
like tests/fixtures/llama-bench/smollm2.jsonl (pp and tg rows of many configurations, three
samples each), imports it with the real CLI into a fresh SQLite database in a child process, and
reports the child's peak RSS (``getrusage(RUSAGE_CHILDREN).ru_maxrss``), the time, and what went in.

    .venv/bin/python -m bench.import_memory --mb 200 --format jsonl
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llama-bench" / "smollm2.jsonl"


def rows(count: int):
    """``count`` llama-bench rows: a pp and a tg row per configuration, configurations all distinct."""
    template = json.loads(FIXTURE.read_text().splitlines()[0])
    for i in range(count):
        config, kind = divmod(i, 2)
        threads, rest = config % 64 + 1, config // 64
        yield {**template, "n_threads": threads, "n_batch": 2 ** (rest % 10 + 1), "n_ubatch": 2 ** (rest % 10 + 1),
               "n_gpu_layers": rest // 10 % 1000, "build_commit": f"b{rest // 10000}",
               "n_prompt": 64 if kind == 0 else 0, "n_gen": 0 if kind == 0 else 16,
               "avg_ts": 100.0 + i % 50, "stddev_ts": 0.5,
               "samples_ns": [344478808 + i % 1000, 345691443, 345700507]}


def write_file(path: Path, megabytes: float, fmt: str) -> int:
    """The file, about ``megabytes`` MB; the number of rows in it."""
    target, written, count = megabytes * 1e6, 0, 0
    with path.open("w") as out:
        if fmt == "json":
            out.write("[\n")
        for row in rows(10**9):
            text = json.dumps(row)
            if fmt == "json":
                text = ("  " if count == 0 else ",\n  ") + text
            else:
                text += "\n"
            out.write(text)
            written += len(text)
            count += 1
            if written >= target:
                break
        if fmt == "json":
            out.write("\n]\n")
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0)
    parser.add_argument("--format", choices=("jsonl", "json"), default="jsonl")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleettune-import-mem-") as tmp:
        source = Path(tmp, f"big.{args.format}")
        count = write_file(source, args.mb, args.format)
        size = source.stat().st_size
        url = f"sqlite:///{tmp}/import.db"
        fleettune = [sys.executable, "-m", "orchestrator.cli"]
        started = time.monotonic()
        done = subprocess.run([*fleettune, "import", "llama-bench", str(source), "--db", url, "--format", "json"],
                              capture_output=True, text=True)
        seconds = time.monotonic() - started
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
        if done.returncode != 0:
            sys.exit(f"import failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        print(json.dumps({"file_mb": round(size / 1e6, 1), "format": args.format, "rows": count,
                          "peak_rss_mb": round(peak_mb, 1), "seconds": round(seconds, 1),
                          "report": json.loads(done.stdout) if done.stdout.strip().startswith("{") else done.stdout[-300:]}))


if __name__ == "__main__":
    main()
