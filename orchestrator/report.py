"""Printers: one list of rows, several formats (table, JSON, newline-delimited JSON, CSV).

Like llama-bench's printers, each format is one function over the same rows; commands choose
columns, never formatting.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from rich.console import Console
from rich.table import Table

FORMATS = ("table", "json", "ndjson", "csv")
TABLE_WIDTH = 80


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str | None = None  # a format spec for numbers, e.g. ".1f"
    justify: str = "left"
    no_wrap: bool = False


def _plain(value):
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def _cell(value, fmt: str | None) -> str:
    if value is None:
        return "-"
    if fmt and isinstance(value, int | float) and not isinstance(value, bool):
        return format(value, fmt)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def render(rows: Sequence[dict], columns: Sequence[Column], fmt: str = "table", title: str | None = None) -> str:
    """Rows as text in ``fmt``; JSON and CSV carry every key of the rows, tables only ``columns``."""
    if fmt == "json":
        return json.dumps([{k: _plain(v) for k, v in r.items()} for r in rows], indent=2, default=str)
    if fmt == "ndjson":
        return "\n".join(json.dumps({k: _plain(v) for k, v in r.items()}, default=str) for r in rows)
    if fmt == "csv":
        keys = list(dict.fromkeys(k for r in rows for k in r)) or [c.key for c in columns]
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=keys, lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k)) for k in keys})
        return out.getvalue().rstrip("\n")
    if fmt != "table":
        raise ValueError(f"unknown format {fmt}")
    table = Table(title=title, box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    for col in columns:
        table.add_column(col.header, justify=col.justify, overflow="fold", no_wrap=col.no_wrap)
    for row in rows:
        table.add_row(*(_cell(row.get(c.key), c.fmt) for c in columns))
    console = Console(file=io.StringIO(), width=TABLE_WIDTH, color_system=None, force_terminal=False)
    console.print(table)
    return console.file.getvalue().rstrip("\n")


def _csv_value(value):
    if isinstance(value, dict | list):
        return json.dumps(value)
    return _plain(value)


def render_record(record: dict, fmt: str = "table") -> str:
    """One object: key/value table, or JSON."""
    if fmt in ("json", "ndjson"):
        return json.dumps({k: _plain(v) for k, v in record.items()}, indent=2 if fmt == "json" else None,
                          default=str)
    rows = [{"field": k, "value": _cell(v, None)} for k, v in record.items()]
    if fmt == "csv":
        return render([record], [], "csv")
    return render(rows, [Column("field", "field"), Column("value", "value")], "table")


def human_bytes(n: int | None) -> str | None:
    if n is None:
        return None
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return None


def human_params(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def bench_rows(model, fp, params, result) -> list[dict]:
    """llama-bench's table rows (one per test) for a measured configuration."""
    rows = []
    for kind in ("pp", "tg"):
        stats = result.stats(kind)
        if stats is None:
            continue
        n_tokens = next(s.n_tokens for s in result.samples if s.kind == kind)
        rows.append({
            "model": f"{model.architecture} {model.file_type}",
            "size": human_bytes(model.size_bytes),
            "params": human_params(model.n_params),
            "backend": fp.backend.upper() if fp.backend != "cpu" else "CPU",
            "ngl": params.n_gpu_layers,
            "threads": params.n_threads,
            "n_batch": params.n_batch,
            "n_ubatch": params.n_ubatch,
            "test": f"{kind}{n_tokens}",
            "tps": f"{stats.mean:.2f} ± {stats.stddev:.2f}",
            "avg_ts": stats.mean,
            "median_ts": stats.median,
            "stddev_ts": stats.stddev,
            "cv": stats.cv,
            "samples_ts": [s.tokens_per_s for s in result.samples if s.kind == kind],
            "samples_ns": [round(s.seconds * 1e9) for s in result.samples if s.kind == kind],
            "load_s": result.load_s,
            "peak_rss_bytes": result.peak_rss_bytes,
        })
    return rows
