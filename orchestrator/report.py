"""Printers: one registry of output formats, each a class over the same rows.

Like llama-bench's printers (``create_printer(format)``, then ``print_header``, one ``print_test``
per row, ``print_footer``), every format here is one ``Printer`` subclass, registered by name; a
command chooses the rows and their columns (a ``Layout``: one per kind of row), never the
formatting. Tables and markdown show a layout's columns; JSON, NDJSON and CSV carry every key.

Output safety lives here, once for every command: table cells are printed as plain text (a name
such as ``[/x]`` is not rich markup, an ESC or BEL is shown as ``\\x1b``, never sent to the
terminal), markdown cells escape ``|``, and CSV cells that a spreadsheet
would run as a formula (starting with ``=``, ``+``, ``-``, ``@``, tab or CR) get a leading ``'``,
as OWASP recommends; numbers are left alone.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import ClassVar, TextIO

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from workers.errors import BadInput
from workers.trial import BenchParams

TABLE_WIDTH = 80


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: str | None = None  # a format spec for numbers, e.g. ".1f"
    justify: str = "left"
    no_wrap: bool = False
    long_header: str | None = None  # where width does not matter (markdown); default: header


@dataclass(frozen=True)
class Layout:
    """How one kind of row is shown: its columns, and the cells a table shows for a row (by
    default the row itself; llama-bench rows derive theirs from llama-bench's fields)."""

    columns: tuple[Column, ...] = ()
    cells: Callable[[Mapping], Mapping] | None = None

    def table_row(self, row: Mapping) -> Mapping:
        return self.cells(row) if self.cells else row


RECORD_LAYOUT = Layout((Column("field", "field"), Column("value", "value")))


def _plain(value):
    if isinstance(value, datetime):
        return value.isoformat()
    return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _visible(text: str) -> str:
    """Text for a terminal: control characters (an ESC starting a terminal sequence, a BEL, a
    line break inside a name) shown as ``\\xNN`` instead of acted on."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _cell(value, fmt: str | None) -> str:
    if value is None:
        return "-"
    if fmt and isinstance(value, int | float) and not isinstance(value, bool):
        return format(value, fmt)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


# ---------------------------------------------------------------- CSV formula neutralisation

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def csv_safe(value: str) -> str:
    """A text cell a spreadsheet shows as text: a leading ``'`` where it would start a formula.

    A cell that is just a number (``-3``, ``+1.5e3``) stays as it is: it is no formula, and
    numeric columns must stay numeric.
    """
    if value.startswith(FORMULA_STARTS) and not _PLAIN_NUMBER.fullmatch(value):
        return "'" + value
    return value


# ---------------------------------------------------------------- the printers


class Printer:
    """One output format: ``print_header``, ``print_row`` per row, ``print_footer``.

    ``print_rows`` does all three; ``print_record`` prints one object (a key/value table, or one
    JSON object). Printers that need every row before the first line (a table sizes its columns,
    CSV takes its header from every row's keys) buffer rows and write in ``print_footer``.
    """

    name: ClassVar[str] = ""

    def __init__(self, out: TextIO, layout: Layout = Layout(), title: str | None = None) -> None:
        self.out = out
        self.layout = layout
        self.title = title

    def print_header(self) -> None:
        """What comes before the first row."""

    def print_row(self, row: Mapping) -> None:
        raise NotImplementedError

    def print_footer(self) -> None:
        """What comes after the last row."""

    def print_rows(self, rows: Iterable[Mapping]) -> None:
        self.print_header()
        for row in rows:
            self.print_row(row)
        self.print_footer()

    def print_record(self, record: Mapping) -> None:
        self.print_rows([record])


class TablePrinter(Printer):
    """A rich table, 80 columns wide, cells as plain text (never markup)."""

    name = "table"

    def print_header(self) -> None:
        self._rows: list[list[Text]] = []

    def print_row(self, row: Mapping) -> None:
        cells = self.layout.table_row(row)
        self._rows.append([Text(_visible(_cell(cells.get(c.key), c.fmt))) for c in self.layout.columns])

    def print_footer(self) -> None:
        table = Table(title=escape(_visible(self.title)) if self.title else None, box=None, pad_edge=False,
                      padding=(0, 1), header_style="bold")
        for col in self.layout.columns:
            table.add_column(Text(col.header), justify=col.justify, overflow="fold", no_wrap=col.no_wrap)
        for cells in self._rows:
            table.add_row(*cells)
        console = Console(file=io.StringIO(), width=TABLE_WIDTH, color_system=None, force_terminal=False)
        console.print(table)
        self.out.write(console.file.getvalue().rstrip("\n") + "\n")

    def print_record(self, record: Mapping) -> None:
        record_printer = TablePrinter(self.out, RECORD_LAYOUT, self.title)
        record_printer.print_rows({"field": k, "value": _cell(v, None)} for k, v in record.items())


class JsonPrinter(Printer):
    """A JSON array, two-space indented (json.dumps' exact text), streamed row by row."""

    name = "json"

    def print_header(self) -> None:
        self._count = 0
        self.out.write("[")

    def print_row(self, row: Mapping) -> None:
        text = json.dumps({k: _plain(v) for k, v in row.items()}, indent=2, default=str)
        self.out.write(("," if self._count else "") + "\n" + "\n".join("  " + line for line in text.split("\n")))
        self._count += 1

    def print_footer(self) -> None:
        self.out.write("\n]\n" if self._count else "]\n")

    def print_record(self, record: Mapping) -> None:
        self.out.write(json.dumps({k: _plain(v) for k, v in record.items()}, indent=2, default=str) + "\n")


class NdjsonPrinter(Printer):
    """One JSON object per line (llama-bench's jsonl)."""

    name = "ndjson"

    def print_row(self, row: Mapping) -> None:
        self.out.write(json.dumps({k: _plain(v) for k, v in row.items()}, default=str) + "\n")


def _csv_value(value):
    if isinstance(value, dict | list):
        return json.dumps(value)
    return _plain(value)


class CsvPrinter(Printer):
    """CSV with every key of the rows as a column (the layout's keys when there are no rows)."""

    name = "csv"

    def print_header(self) -> None:
        self._rows: list[Mapping] = []

    def print_row(self, row: Mapping) -> None:
        self._rows.append(row)

    def print_footer(self) -> None:
        keys = list(dict.fromkeys(k for r in self._rows for k in r)) or [c.key for c in self.layout.columns]
        self.out.write(_csv_line([csv_safe(str(k)) for k in keys]))
        for row in self._rows:
            self.out.write(_csv_line([_csv_cell(_csv_value(row.get(k))) for k in keys]))


def _csv_cell(value) -> str:
    """Text neutralised; numbers and booleans as Python prints them; None empty."""
    if value is None:
        return ""
    return csv_safe(value) if isinstance(value, str) else str(value)


def _csv_line(cells: list[str]) -> str:
    """One CSV line as the csv module's minimal quoting writes it, except that a carriage return
    is quoted too (Python's writer leaves a lone CR bare, which splits the row for readers)."""
    quoted = ['"' + c.replace('"', '""') + '"' if any(ch in c for ch in ',"\r\n') else c for c in cells]
    if cells == [""]:
        quoted = ['""']  # a row of one empty cell is not an empty line
    return ",".join(quoted) + "\n"


class MarkdownPrinter(Printer):
    """A GitHub markdown table of the layout's columns (llama-bench's default output)."""

    name = "md"

    def print_header(self) -> None:
        columns = self.layout.columns
        self.out.write("| " + " | ".join(_md(c.long_header or c.header) for c in columns) + " |\n")
        self.out.write("| " + " | ".join("---:" if c.justify == "right" else "---" for c in columns) + " |\n")

    def print_row(self, row: Mapping) -> None:
        cells = self.layout.table_row(row)
        self.out.write("| " + " | ".join(_md(_cell(cells.get(c.key), c.fmt)) for c in self.layout.columns)
                       + " |\n")

    def print_record(self, record: Mapping) -> None:
        MarkdownPrinter(self.out, RECORD_LAYOUT).print_rows(
            {"field": k, "value": _cell(v, None)} for k, v in record.items())


def _md(text: str) -> str:
    """A markdown cell: a ``|`` or a line break in a name cannot end the cell or the row."""
    return _visible(text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " "))


class QuotedCsvPrinter(Printer):
    """llama-bench's CSV: a fixed list of fields, every cell quoted, booleans as 0/1, floats
    with six decimals (``-o csv``), sample lists left out."""

    name = "llama-bench-csv"

    def print_header(self) -> None:
        self.out.write(",".join(c.key for c in self.layout.columns) + "\n")

    def print_row(self, row: Mapping) -> None:
        self.out.write(",".join('"' + _quoted_cell(row[c.key]).replace('"', '""') + '"'
                                for c in self.layout.columns) + "\n")


def _quoted_cell(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.6f}"
    if isinstance(value, int):
        return str(value)
    return csv_safe(str(value))


@dataclass(frozen=True)
class _Entry:
    printer: type[Printer]
    layout: Layout | None = None  # a format bound to one kind of row (llama-bench's)


_REGISTRY: dict[str, _Entry] = {}


def register(name: str, printer: type[Printer], layout: Layout | None = None) -> None:
    """Make ``name`` a format: ``printer``, over ``layout`` when the format is tied to one kind of
    row (a llama-bench format), else over the command's own layout."""
    _REGISTRY[name] = _Entry(printer, layout)


for _printer in (TablePrinter, JsonPrinter, NdjsonPrinter, CsvPrinter, MarkdownPrinter):
    register(_printer.name, _printer)

FORMATS = ("table", "json", "ndjson", "csv", "md")  # the query commands' --format choices


def create_printer(fmt: str, out: TextIO, layout: Layout | Sequence[Column] = Layout(),
                   title: str | None = None) -> Printer:
    """The printer of format ``fmt`` writing to ``out``; one clear error for an unknown format."""
    entry = _REGISTRY.get(fmt)
    if entry is None:
        raise BadInput(f"unknown format {fmt!r}; choose one of {', '.join(_REGISTRY)}")
    if not isinstance(layout, Layout):
        layout = Layout(tuple(layout))
    return entry.printer(out, entry.layout or layout, title)


def formats() -> tuple[str, ...]:
    return tuple(_REGISTRY)


# ---------------------------------------------------------------- text in, text out


def render(rows: Sequence[Mapping], columns: Sequence[Column] | Layout, fmt: str = "table",
           title: str | None = None) -> str:
    """Rows as text in ``fmt`` (no final newline): ``create_printer(fmt).print_rows`` to a string."""
    out = io.StringIO()
    create_printer(fmt, out, columns, title).print_rows(rows)
    return out.getvalue().removesuffix("\n")


def render_record(record: Mapping, fmt: str = "table") -> str:
    """One object: a key/value table, or one JSON object (no final newline)."""
    out = io.StringIO()
    create_printer(fmt, out).print_record(record)
    return out.getvalue().removesuffix("\n")


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


__all__ = ["FORMATS", "Column", "Layout", "Printer", "create_printer", "csv_safe", "formats", "human_bytes",
           "human_params", "register", "render", "render_record"]


# ---------------------------------------------------------------- a study's claims (issue 20)


def llama_bench_form(params, objective: str) -> str:
    """``params`` as llama-bench flags, faithfully (issue 20.5): llama-bench has no ``-tb`` and runs
    pp and tg on ``-t`` threads, so a pp configuration is given with its prompt threads as ``-t``,
    a tg one with its generation threads; an e2e one whose two thread counts differ says so."""
    from dataclasses import replace

    from workers.objective import objective as objective_named

    kinds = objective_named(objective).kinds
    threads_batch = params.threads_batch
    if kinds == ("pp",):
        return replace(params, n_threads=threads_batch, n_threads_batch=None).llama_cpp_flags("llama-bench")
    flags = replace(params, n_threads_batch=None).llama_cpp_flags("llama-bench")
    if "pp" in kinds and "tg" in kinds and threads_batch != params.n_threads:
        flags += f" (prompt threads {threads_batch}: llama-bench runs -p on -t, so measure -p with -t {threads_batch})"
    return flags


def config_forms(params, objective: str, prefix: str = "") -> dict:
    """One configuration in every tool's form: llama-server flags, llama-bench flags, Llama(...)."""
    return {
        f"{prefix}flags" if prefix else "llama_cpp_flags": params.llama_cpp_flags(),
        f"{prefix}llama_bench_flags": llama_bench_form(params, objective),
        f"{prefix}llama_cpp_python": params.llama_cpp_python_kwargs(),
    }


def claim_fields(claims: dict | None) -> dict:
    """What a study claims, as printed by ``tune``, ``best`` and stored with the recommendation
    (issue 20.3): the outcome, the ratio over each baseline with its interval from the paired
    rounds, the A/A noise, and the KL divergence of a lossy recommendation (issue 20.4)."""
    from orchestrator.learn import FIT, LLAMA_CPP, LLAMA_CPP_PYTHON, SINGLE_STREAM

    if not claims:
        return {}
    vs = claims.get("vs", {})
    out = {"outcome": claims.get("outcome"), "confirm_rounds": claims.get("rounds")}
    reference = claims.get("reference", LLAMA_CPP)
    shown = "vs_fit" if reference == FIT else "vs_llama_cpp"
    if LLAMA_CPP in vs:
        out["vs_llama_cpp"] = vs[LLAMA_CPP]["text"]
    if FIT in vs:  # issue 23.3: llama.cpp's --fit placement under the study's GPU budget
        out["vs_fit"] = vs[FIT]["text"]
    if claims.get("fit_source"):  # llama-fit-params on the node, or fleettune's estimate of it
        out["fit_source"] = claims["fit_source"]
    if shown not in out and "best_candidate" in claims:  # not recommended: named, so it can be refereed
        best = claims["best_candidate"]
        out[shown] = f"best candidate {BenchParams.from_dict(best['params']).llama_cpp_flags()}: {best['text']}"
    if LLAMA_CPP_PYTHON in vs:
        out["vs_llama_cpp_python"] = vs[LLAMA_CPP_PYTHON]["text"]
    if SINGLE_STREAM in vs:  # a served study's (issue 22.5)
        out["vs_single_stream"] = vs[SINGLE_STREAM]["text"]
    if "noise" in claims:
        out["noise_aa"] = claims["noise"]["text"]
    if claims.get("kl_divergence") is not None:
        out["kl_divergence"] = f"{claims['kl_divergence']:.5f}"
    return out
