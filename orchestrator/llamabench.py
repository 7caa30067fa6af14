"""llama-bench interop: read its JSON, JSONL and CSV output into the results database, and write
ours in the same shapes (and its markdown table), so results travel both ways.

llama-bench prints one row per test: ``pp512`` (n_prompt > 0) or ``tg128`` (n_gen > 0) for one
configuration. Importing groups a configuration's pp and tg rows into one fleettune trial (a
configuration measured again later in the file, a repeated run, is another trial). Rows that
cannot be read, or tests fleettune does not model (prompt+generation ``-pg``, depth ``-d``), are
reported by line; the rest go in, all in one transaction, so nothing is ever half-imported.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import itertools
import json
import math
import os
import statistics
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from orchestrator.db import Database, repo
from orchestrator.report import (
    Column,
    JsonPrinter,
    Layout,
    NdjsonPrinter,
    QuotedCsvPrinter,
    create_printer,
    human_bytes,
    human_params,
    register,
)
from workers import knobs
from workers.errors import BadInput
from workers.hardware import Fingerprint, make_chip_key
from workers.models import ModelInfo
from workers.trial import BenchParams, Sample, TrialResult

# llama-bench's own field order (tools/llama-bench: test::get_fields), then its two sample lists.
FIELDS = [
    "build_commit", "build_number", "cpu_info", "gpu_info", "backends", "model_filename", "model_type",
    "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "cpu_mask", "cpu_strict",
    "poll", "type_k", "type_v", "n_gpu_layers", "n_cpu_moe", "split_mode", "main_gpu", "no_kv_offload",
    "flash_attn", "devices", "tensor_split", "tensor_buft_overrides", "load_mode", "lazy_mode",
    "embeddings", "no_op_offload", "no_host", "repack", "fit_target", "fit_min_ctx", "n_prompt",
    "n_gen", "n_depth", "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts",
]
REQUIRED = ("model_filename", "n_batch", "n_ubatch", "n_threads", "n_gpu_layers", "n_prompt", "n_gen",
            "avg_ts")
IMPORT_PHASE = "import"
ALL_LAYERS = 999  # llama.cpp takes any -ngl above the layer count as "all of them"


@dataclass(frozen=True)
class BenchRow:
    """One llama-bench test row, checked."""

    line: int
    kind: str  # pp or tg
    params: BenchParams
    n_tokens: int
    avg_ts: float
    stddev_ts: float
    samples_ns: tuple[int, ...]
    model_filename: str
    model_type: str
    model_size: int
    model_n_params: int
    cpu_info: str
    gpu_info: str
    backends: str
    build_commit: str
    test_time: str

    @property
    def config_key(self) -> tuple:
        return (self.model_filename, self.cpu_info, self.gpu_info, self.build_commit,
                *self.params.to_dict().values())


@dataclass
class ImportReport:
    studies: list[str] = field(default_factory=list)
    trials: int = 0
    rows: int = 0
    problems: list[tuple[int, str]] = field(default_factory=list)  # (line, reason)
    source_sha256: str | None = None
    already: str | None = None  # the study that holds this file's bytes already (nothing imported)


# ---------------------------------------------------------------- reading

MAX_IMPORT_BYTES = 256 * 1024**2  # llama-bench writes about 2 KB per test: 100,000 tests fit
MAX_OBJECT_CHARS = 1024**2  # one llama-bench JSON object is about 2 KB; past this it is malformed
CHUNK_BYTES = 64 * 1024
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_NAME_CHARS = 200  # the model name column
MAX_CHIP_NAME_CHARS = 100  # a chip's name becomes its key, which has 120 characters
MAX_CHIP_KEY_CHARS = 120
MAX_STUDY_BASE_CHARS = 240  # study names have 255, with room for a "#N" suffix

Problems = list[tuple[int, str]]  # (line, reason)


class SourceFile:
    """A file read once, in chunks: its text as it streams, its sha256 and its size, refusing to
    read past ``limit`` bytes (so a huge or endless file is one clear error, not an exhausted head)."""

    def __init__(self, path: str | Path, limit: int = MAX_IMPORT_BYTES) -> None:
        self.path, self.limit = Path(path), limit
        self.sha256 = hashlib.sha256()
        self.size = 0

    def _too_large(self) -> BadInput:
        return BadInput(f"{self.path}: larger than the import limit of {self.limit / 1024**2:g} MiB")

    def chunks(self) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")  # a leading BOM is dropped
        try:
            with self.path.open("rb") as raw:
                if os.fstat(raw.fileno()).st_size > self.limit:
                    raise self._too_large()  # known before reading a byte; the loop catches growth
                while block := raw.read(CHUNK_BYTES):
                    self.size += len(block)
                    if self.size > self.limit:
                        raise self._too_large()
                    self.sha256.update(block)
                    yield decoder.decode(block)
        except OSError as exc:
            raise BadInput(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        yield decoder.decode(b"", final=True)


def _lines(chunks: Iterable[str]) -> Iterator[str]:
    """Lines (with their ends) of streamed text; each chunk is split once (a long line costs its
    length, not its length times its chunks)."""
    pending: list[str] = []
    for chunk in chunks:
        *complete, tail = chunk.split("\n")
        if complete:
            yield "".join(pending) + complete[0] + "\n"
            yield from (line + "\n" for line in complete[1:])
            pending = []
        pending.append(tail)
    if rest := "".join(pending):
        yield rest


Item = tuple[int, dict | str]  # (line, a record) or (line, why it is no record)


def iter_source(source: SourceFile) -> Iterator[Item]:
    """(line, record) for each llama-bench JSON, JSONL or CSV record, (line, reason) for each
    problem, as the file streams; the whole file is read (its sha256 covers every byte) even when
    parsing ends early."""
    chunks = source.chunks()
    head = ""
    for chunk in chunks:
        head += chunk
        if head.strip():
            break
    stripped = head.lstrip()
    if not stripped:
        raise BadInput(f"{source.path}: the file is empty")
    stream = itertools.chain([head], chunks)
    if stripped[0] == "[":
        yield from _json_array(stream)
    elif stripped[0] == "{":
        yield from _json_lines(_lines(stream))
    else:
        yield from _csv(_lines(stream))
    for _ in chunks:  # the rest of the file, for its hash and size
        pass


def read_source(source: SourceFile) -> tuple[list[tuple[int, dict]], Problems]:
    """Every record and every problem of a file, apart."""
    records, problems = [], []
    for line, item in iter_source(source):
        (records if isinstance(item, dict) else problems).append((line, item))
    return records, problems


def read_records(text: str) -> tuple[list[tuple[int, dict]], Problems]:
    """The same from text in memory (tests, small inputs)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as tmp:
        tmp.write(text)
    try:
        return read_source(SourceFile(tmp.name))
    finally:
        Path(tmp.name).unlink()


def _reject_constant(name: str):
    raise ValueError(f"non-finite number {name}")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _decode(text: str, pos: int) -> tuple[object, int]:
    """One JSON value at ``pos``; every way JSON text can be unusable is a ValueError."""
    try:
        return _DECODER.raw_decode(text, pos)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _problem(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"malformed JSON ({exc.msg})"
    return f"malformed JSON ({exc})"


def _json_array(chunks: Iterator[str]) -> Iterator[Item]:
    """llama-bench's ``-o json``: one array, each object decoded as soon as it is complete.

    Text already decoded is dropped (only the unparsed tail is held); a malformed object is
    reported by line and skipped to the next object start (llama-bench starts each on its own line).
    """
    buf, pos, line_base, eof = "", 0, 1, False

    def more() -> bool:
        nonlocal buf, pos, line_base, eof
        chunk = next(chunks, None)
        if chunk is None:
            eof = True
            return False
        line_base += buf.count("\n", 0, pos)
        buf, pos = buf[pos:] + chunk, 0
        return True

    def line_at(at: int) -> int:
        return line_base + buf.count("\n", 0, at)

    while "[" not in buf and more():
        pass
    pos = buf.index("[") + 1
    while True:
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) or not more():
                break
        if pos >= len(buf) or buf[pos] == "]":
            return
        try:
            value, end = _decode(buf, pos)
        except ValueError as exc:
            if not eof and len(buf) - pos < MAX_OBJECT_CHARS and more():
                continue  # maybe only cut off by the chunk's end: read on and try again
            yield line_at(pos), _problem(exc)
            start = pos + 1
            while (nxt := buf.find("\n  {", start)) < 0:
                pos = start = max(start, len(buf) - 3)  # what was searched is dropped by more()
                if not more():
                    return
                start = 0
            pos = nxt + 1
            continue
        if end >= len(buf) and not eof and more():
            continue  # a number at the chunk's end may go on in the next chunk
        yield line_at(pos), value if isinstance(value, dict) else "not a JSON object"
        pos = end


def _json_lines(lines: Iterable[str]) -> Iterator[Item]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value, end = _decode(line, len(line) - len(line.lstrip()))
            if line[end:].strip():
                raise json.JSONDecodeError("Extra data", line, end)
        except ValueError as exc:
            yield number, _problem(exc)
            continue
        yield number, value if isinstance(value, dict) else "not a JSON object"


def _csv(lines: Iterable[str]) -> Iterator[Item]:
    reader = csv.DictReader(lines)
    try:
        fieldnames = reader.fieldnames or []
    except csv.Error as exc:
        raise BadInput(f"not llama-bench output (JSON, JSONL or CSV): {exc}") from None
    missing = [f for f in REQUIRED if f not in fieldnames]
    if missing:
        raise BadInput(f"not llama-bench output (JSON, JSONL or CSV): no column {', '.join(missing)}")
    while True:
        try:
            record = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            yield reader.line_num, f"malformed CSV ({exc})"
            continue
        if None in record or any(v is None for v in record.values()):
            yield reader.line_num, "wrong number of columns"
            continue
        yield reader.line_num, record


def _int(record: dict, key: str, default: int | None = None, lo: int = 0, hi: int = INT32_MAX) -> int:
    """An integer field in [lo, hi]: JSON numbers, CSV text, llama-bench's true/false."""
    value = record.get(key, default)
    if value is None or value == "":
        raise ValueError(f"missing {key}")
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return int(value.lower() == "true")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{key} {value!r} is not a whole number")
        value = int(value)
    elif not isinstance(value, int | str):
        raise ValueError(f"{key} is not a number")
    number = int(value)
    if not lo <= number <= hi:
        raise ValueError(f"{key} {number} is out of range")
    return number


def _float(record: dict, key: str, default: float | None = None) -> float:
    """A finite float field (llama-bench never prints inf or nan; 1e400 reads as inf)."""
    value = record.get(key, default)
    if value is None or value == "" or isinstance(value, bool | dict | list):
        raise ValueError(f"missing {key}" if value in (None, "") else f"{key} is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{key} {value!r} is not a finite number")
    return number


def _text(record: dict, key: str, limit: int = MAX_NAME_CHARS) -> str:
    """A text field: a string or a scalar printed as one, never an object or a list; no NUL
    (PostgreSQL cannot store it; issue 24)."""
    value = record.get(key, "")
    if isinstance(value, dict | list | tuple):
        raise ValueError(f"{key} is not text")
    text = "" if value is None else str(value)
    if "\x00" in text:
        raise ValueError(f"{key} holds a NUL character")
    if len(text) > limit:
        raise ValueError(f"{key} is longer than {limit} characters")
    return text


def _samples_ns(record: dict) -> tuple[int, ...]:
    samples = record.get("samples_ns") or ()
    if isinstance(samples, str):  # not in llama-bench's CSV, but tolerated if someone adds it
        samples = [s for s in samples.replace(";", " ").split() if s]
    if not isinstance(samples, list | tuple):
        raise ValueError("samples_ns is not a list")
    out = []
    for sample in samples:
        ns = _float({"samples_ns": sample}, "samples_ns")
        if not 1 <= ns <= INT64_MAX:
            raise ValueError(f"samples_ns {sample!r} is out of range")
        out.append(int(ns))
    return tuple(out)


def parse_record(line: int, record: dict) -> BenchRow:
    """A checked row; ValueError says why a record cannot be imported."""
    for key in REQUIRED:
        if key not in record:
            raise ValueError(f"missing {key}")
    n_prompt, n_gen = _int(record, "n_prompt"), _int(record, "n_gen")
    if _int(record, "n_depth", 0):
        raise ValueError("depth tests (-d) are not imported")
    if n_prompt and n_gen:
        raise ValueError("prompt+generation tests (-pg) are not imported")
    if not n_prompt and not n_gen:
        raise ValueError("neither n_prompt nor n_gen")
    avg_ts = _float(record, "avg_ts")
    if not avg_ts > 0 or not 1 <= (n_prompt or n_gen) / avg_ts * 1e9 <= INT64_MAX:
        raise ValueError(f"avg_ts {record['avg_ts']!r} is not a speed")
    stddev_ts = 0.0 if record.get("stddev_ts") in (None, "") else _float(record, "stddev_ts")
    if stddev_ts < 0:
        raise ValueError(f"stddev_ts {stddev_ts!r} is negative")
    samples = _samples_ns(record)
    for key in ("n_gpu_layers", "n_batch", "n_ubatch", "n_threads"):
        _int(record, key, lo=-1)  # whole numbers within int32, before the table reads them
    values = knobs.from_bench_fields(record)  # every knob llama-bench has a field for
    backends = _text(record, "backends")
    if backends.strip().upper() == "CPU":
        values["n_gpu_layers"] = 0  # a CPU-only build offloads nothing, whatever -ngl said
    elif values["n_gpu_layers"] == -1:
        values["n_gpu_layers"] = ALL_LAYERS  # llama-bench's default -ngl -1: every layer
    values["n_ubatch"] = min(values["n_ubatch"], values["n_batch"])  # llama.cpp clamps the micro-batch
    if min(values["n_gpu_layers"], values["n_threads"] - 1, values["n_batch"] - 1, values["n_ubatch"] - 1,
           values.get("n_cpu_moe", 0)) < 0:
        raise ValueError("out-of-range parameters")
    params = BenchParams(**values)
    model_type = _text(record, "model_type")
    words = model_type.split()
    if words and (len(words[0]) > 60 or len(words[-1]) > 40):
        raise ValueError("model_type names an architecture or type too long to be one")
    for key in ("cpu_info", "gpu_info"):  # the chip's name is the first of a list
        if len(_text(record, key, 1000).split(",")[0].strip()) > MAX_CHIP_NAME_CHARS:
            raise ValueError(f"{key} names a chip longer than {MAX_CHIP_NAME_CHARS} characters")
    model_filename = _text(record, "model_filename", 4096)
    if len(Path(model_filename).stem) > MAX_NAME_CHARS:
        raise ValueError(f"model_filename's name is longer than {MAX_NAME_CHARS} characters")
    return BenchRow(
        line=line, kind="pp" if n_prompt else "tg", params=params, n_tokens=n_prompt or n_gen,
        avg_ts=avg_ts, stddev_ts=stddev_ts, samples_ns=samples,
        model_filename=model_filename, model_type=model_type,
        model_size=_int(record, "model_size", 0, hi=INT64_MAX),
        model_n_params=_int(record, "model_n_params", 0, hi=INT64_MAX),
        cpu_info=_text(record, "cpu_info", 1000), gpu_info=_text(record, "gpu_info", 1000),
        backends=backends, build_commit=_text(record, "build_commit", 1000),
        test_time=_text(record, "test_time", 100),
    )


# ---------------------------------------------------------------- importing


def _chip_fingerprint(row: BenchRow, chip_key: str | None) -> Fingerprint:
    backends = row.backends.lower()
    backend = "cuda" if "cuda" in backends else "metal" if "metal" in backends else "cpu"
    gpu = row.gpu_info.split(",")[0].strip() or None
    name = gpu if backend != "cpu" and gpu else row.cpu_info.split(",")[0].strip()
    if not name and not chip_key:
        raise BadInput(f"line {row.line}: no cpu_info or gpu_info to tell the chip; pass --chip")
    return Fingerprint(
        chip=name or chip_key, chip_key=chip_key or make_chip_key(name, None, None),
        vendor=name.split()[0] if name else None, p_cores=None, e_cores=None, logical_cores=None,
        gpu_cores=None, gpu_name=gpu if backend != "cpu" else None, gpu_memory_bytes=None,
        memory_bytes=None, bandwidth_gbs=None, os=None, backend=backend, gpu_offload=backend != "cpu",
    )


def _model_for(session, row: BenchRow, model: ModelInfo | None) -> ModelInfo:
    """The given model, else a registered one with the same file name and parameter count, else
    an unverified identity derived from what llama-bench printed (its file is not here to hash)."""
    if model is not None:
        return model
    base = Path(row.model_filename).name
    for known in repo.list_models(session):
        if Path(known.path or "").name == base and (not row.model_n_params or known.n_params == row.model_n_params):
            return repo.model_info_of(known)
    identity = f"llama-bench:{base}:{row.model_n_params}:{row.model_size}"
    parts = row.model_type.split()
    return ModelInfo(
        sha256=hashlib.sha256(identity.encode()).hexdigest(), path=row.model_filename,
        name=Path(base).stem, architecture=parts[0] if parts else "unknown", n_layer=0,
        n_params=row.model_n_params, file_type=parts[-1] if len(parts) > 1 else "unknown",
        size_bytes=row.model_size, context_length=None,
    )


def _result(rows: list[BenchRow]) -> TrialResult:
    samples = []
    for row in rows:
        times = row.samples_ns or (int(row.n_tokens / row.avg_ts * 1e9),)
        samples += [Sample(row.kind, i, row.n_tokens, ns / 1e9) for i, ns in enumerate(times)]
    started = min((_timestamp(r.test_time) for r in rows if r.test_time), default=None)
    return TrialResult(trial_key="llama-bench", ok=True, samples=samples, started_at=started,
                       finished_at=started)


def _timestamp(text: str) -> float | None:
    """``test_time`` as a Unix time; None when it is not an ISO time; ValueError when it is one a
    database cannot store back (issue 24: a year past 9999 once its offset is applied)."""
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    try:
        stamp = moment.timestamp()
        datetime.fromtimestamp(stamp, UTC)
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"test_time {text[:40]!r} is out of range") from None
    return stamp


def _first_problem(problems: Problems) -> str:
    """" (line 3: why; 7 more problems)": the one line a file with no usable row gets."""
    if not problems:
        return ""
    line, reason = problems[0]
    more = f"; {len(problems) - 1} more problems" if len(problems) > 1 else ""
    return f" (line {line}: {reason}{more})"


IMPORT_BATCH_TRIALS = 500  # trials written per round of bulk statements (memory: a constant plus these)


def check_row(row: BenchRow) -> BenchRow:
    """What a row must also hold to be stored and used (issue 24): thread and layer counts a node
    config can hold, a ``test_time`` that is a time (a database stores it)."""
    for name in ("n_threads", "n_gpu_layers"):
        lo, hi = knobs.knob(name).low, knobs.knob(name).high
        value = getattr(row.params, name)
        if not lo <= value <= hi:
            raise ValueError(f"{name} {value} is outside {lo}..{hi}")
    if row.test_time:
        _timestamp(row.test_time)  # ValueError when out of range
    return row


def _rows(source: SourceFile) -> Iterator[BenchRow | tuple[int, str]]:
    """Each checked row of the file, or (line, reason) for each problem, as the file streams."""
    for line, item in iter_source(source):
        if isinstance(item, str):
            yield line, item
            continue
        try:
            yield check_row(parse_record(line, item))
        except (ValueError, TypeError, OverflowError) as exc:
            yield line, str(exc)


@dataclass
class _ImportPlan:
    """What a first read of the file tells, keeping no row: each row's trial (its place in
    file order of its first row), each trial's row count, the workload the studies record, the problems."""

    group_of: array = field(default_factory=lambda: array("q"))  # row ordinal -> trial index
    group_sizes: array = field(default_factory=lambda: array("b"))  # trial index -> its rows
    n_prompt: int = 0
    n_gen: int = 0
    reps: int = 0
    problems: Problems = field(default_factory=list)
    sha256: str = ""


def _plan_import(source: SourceFile) -> _ImportPlan:
    """Read the file once: group its rows into trials (a configuration's pp row and tg row in one
    trial; a configuration measured again later, a repeated run, is another), in the file order of
    each trial's first row, holding one digest per configuration."""
    plan = _ImportPlan()
    open_groups: dict[bytes, int] = {}  # configuration -> its latest trial
    kinds = bytearray()  # trial index -> the kinds it has (1 pp, 2 tg)
    for row in _rows(source):
        if isinstance(row, tuple):
            plan.problems.append(row)
            continue
        key = hashlib.blake2b(repr(row.config_key).encode(), digest_size=16).digest()
        bit = 1 if row.kind == "pp" else 2
        group = open_groups.get(key)
        if group is None or kinds[group] & bit:
            group = len(kinds)
            kinds.append(0)
            plan.group_sizes.append(0)
            open_groups[key] = group
        kinds[group] |= bit
        plan.group_sizes[group] += 1
        plan.group_of.append(group)
        if row.kind == "pp":
            plan.n_prompt = max(plan.n_prompt, row.n_tokens)
        else:
            plan.n_gen = max(plan.n_gen, row.n_tokens)
        plan.reps = max(plan.reps, len(row.samples_ns))
    plan.sha256 = source.sha256.hexdigest()
    return plan


def _trials_in_order(source: SourceFile, plan: _ImportPlan) -> Iterator[list[BenchRow]]:
    """The file read again: each trial's rows as soon as they are all read, in trial order (a trial
    complete before an earlier one waits for it: only trials still open are held)."""
    pending: dict[int, list[BenchRow]] = {}
    complete: dict[int, list[BenchRow]] = {}
    ordinal = next_trial = 0
    for row in _rows(source):
        if isinstance(row, tuple):
            continue
        if ordinal >= len(plan.group_of):
            raise BadInput(f"{source.path}: the file changed while it was imported; nothing imported")
        group = plan.group_of[ordinal]
        ordinal += 1
        rows = pending.setdefault(group, [])
        rows.append(row)
        if len(rows) == plan.group_sizes[group]:
            complete[group] = pending.pop(group)
            while next_trial in complete:
                yield complete.pop(next_trial)
                next_trial += 1
    if ordinal != len(plan.group_of) or pending or complete or source.sha256.hexdigest() != plan.sha256:
        raise BadInput(f"{source.path}: the file changed while it was imported; nothing imported")


def import_file(db: Database, path: str | Path, *, chip_key: str | None = None,
                model: ModelInfo | None = None, limit: int | None = None) -> ImportReport:
    """Import one llama-bench output file; one study per (chip, model) found in it.

    The file is streamed (at most ``limit`` bytes, default MAX_IMPORT_BYTES) and hashed; a file whose bytes were imported
    before is recognised by its sha256 and changes nothing (``ImportReport.already``). A file with
    no usable row is BadInput naming its first problem.

    Memory is a constant plus the trials being written (issue 24): a first read checks every row
    and groups them into trials keeping only each row's trial number; a second read writes the
    trials, ``IMPORT_BATCH_TRIALS`` at a time, in one transaction (all of the file or none); a
    file whose bytes differ between the two reads is refused.
    """
    file = Path(path)
    if not file.is_file():
        raise BadInput(f"{path}: no such file")
    if chip_key is not None and not 0 < len(chip_key) <= MAX_CHIP_KEY_CHARS:
        raise BadInput(f"--chip must be 1 to {MAX_CHIP_KEY_CHARS} characters")
    if chip_key is not None and "\x00" in chip_key:
        raise BadInput("--chip holds a NUL character")
    limit = MAX_IMPORT_BYTES if limit is None else limit
    plan = _plan_import(SourceFile(file, limit))
    with db.session() as s:
        earlier = repo.studies_from_source(s, plan.sha256)
    if earlier:
        return ImportReport(already=earlier[0], source_sha256=plan.sha256)
    report = ImportReport(problems=sorted(plan.problems), source_sha256=plan.sha256)
    if not plan.group_of:
        raise BadInput(f"{path}: nothing imported{_first_problem(report.problems)}")
    with db.session() as s:  # one transaction: all of it or none
        studies: dict[tuple, object] = {}
        models: dict[tuple, ModelInfo] = {}

        def study_of(first: BenchRow) -> int:
            fp = _chip_fingerprint(first, chip_key)
            model_key = (Path(first.model_filename).name, first.model_n_params, first.model_size, first.model_type)
            if model_key not in models:
                models[model_key] = _model_for(s, first, model)
            info = models[model_key]
            key = (fp.chip_key, info.sha256)
            if key not in studies:
                chip = repo.upsert_chip(s, fp)
                model_row = repo.upsert_model(s, info)
                base = f"llama-bench/{fp.chip_key}/{info.name}/{file.stem}"[:MAX_STUDY_BASE_CHARS]
                name = repo.free_study_name(s, base)
                studies[key] = repo.add_study(s, repo.NewStudy(
                    name=name, chip_id=chip.id, model_id=model_row.id, objective="tg",
                    n_prompt=plan.n_prompt, n_gen=plan.n_gen, reps=plan.reps, sampler="llama-bench",
                    budget=len(plan.group_sizes), space={}, simulated=False, state="complete",
                    message=f"imported from {file.name}"[:1000], source_sha256=plan.sha256,
                ))
                report.studies.append(name)
            return studies[key].id

        def write(batch: list[list[BenchRow]]) -> None:
            trials_of: dict[int, list[list[BenchRow]]] = {}  # study id -> its trials' rows
            for trial_rows in batch:
                trials_of.setdefault(study_of(trial_rows[0]), []).append(trial_rows)
            for study_id, trials in trials_of.items():  # a few bulk statements per study, not per trial
                ids = repo.start_trials(s, study_id, [repo.NewTrial(IMPORT_PHASE, t[0].params.to_dict())
                                                      for t in trials], simulated=False)
                finished = []
                for trial_id, trial_rows in zip(ids, trials, strict=True):
                    result = _result(trial_rows)
                    tg = result.stats("tg")
                    finished.append(repo.FinishedTrial(trial_id, result, tg.median if tg else None, None, None))
                repo.finish_trials(s, finished)
                repo.set_trials_llama_bench_stats(s, {trial_id: {r.kind: (r.avg_ts, r.stddev_ts) for r in trial_rows}
                                                      for trial_id, trial_rows in zip(ids, trials, strict=True)})
                report.trials += len(trials)
                report.rows += sum(len(t) for t in trials)

        batch: list[list[BenchRow]] = []
        for trial_rows in _trials_in_order(SourceFile(file, limit), plan):
            batch.append(trial_rows)
            if len(batch) >= IMPORT_BATCH_TRIALS:
                write(batch)
                batch = []
        write(batch)
    return report


# ---------------------------------------------------------------- exporting

BACKEND_NAMES = {"metal": "Metal", "cuda": "CUDA"}  # llama-bench's names; anything else is CPU


def llama_bench_record(*, params: BenchParams, kind: str, samples: list[tuple[int, float]], build_commit: str,
                cpu_info: str, gpu_info: str, backend: str | None, model_filename: str, model_type: str,
                model_size: int, model_n_params: int, test_time: str, depth: int = 0) -> dict:
    """One llama-bench test row (its FIELDS, then samples_ns and samples_ts) from ``samples``:
    (tokens, seconds) of one kind of test, timed after ``depth`` tokens already in the KV cache.
    Both the export and `fleettune bench` build theirs here."""
    ns = [int(round(seconds * 1e9)) for _, seconds in samples]
    ts = [tokens / seconds for tokens, seconds in samples]
    n_tokens = samples[0][0]
    record = dict.fromkeys(FIELDS, "")
    record.update(
        build_commit=build_commit, build_number=0, cpu_info=cpu_info, gpu_info=gpu_info,
        backends=BACKEND_NAMES.get(backend or "", "CPU"), model_filename=model_filename,
        model_type=model_type, model_size=model_size, model_n_params=model_n_params,
        cpu_mask="0x0", cpu_strict=False, poll=50, split_mode="layer", main_gpu=0,
        no_kv_offload=False, devices="auto",
        tensor_split="0.00", tensor_buft_overrides="none", load_mode="mmap", lazy_mode="auto", embeddings=False,
        no_host=False, repack=True, fit_target=0, fit_min_ctx=0,
        n_prompt=n_tokens if kind == "pp" else 0, n_gen=n_tokens if kind == "tg" else 0,
        n_depth=depth, test_time=test_time,
        avg_ns=int(statistics.fmean(ns)), stddev_ns=int(statistics.stdev(ns)) if len(ns) > 1 else 0,
        avg_ts=statistics.fmean(ts), stddev_ts=statistics.stdev(ts) if len(ts) > 1 else 0.0,
        samples_ns=ns, samples_ts=ts,
    )
    record.update(knobs.bench_fields(params))  # every knob llama-bench has a field for (the table's)
    return record


def export_records(trial_rows: list[dict]) -> list[dict]:
    """Our trials as llama-bench rows: one pp and one tg row per trial that measured them."""
    out = []
    for trial in trial_rows:
        params = BenchParams.from_dict(trial["params"])
        for kind in ("pp", "tg"):
            samples = [(x["n_tokens"], x["seconds"]) for x in trial["samples"] if x["kind"] == kind]
            if not samples:
                continue
            out.append(llama_bench_record(
                params=params, kind=kind, samples=samples, build_commit=trial.get("llama_build") or "",
                cpu_info=trial["chip_name"] or trial["chip"], gpu_info=trial.get("gpu_name") or "",
                backend=trial.get("backend"), model_filename=trial["model_path"] or trial["model"],
                model_type=f"{trial['architecture']} {trial['file_type']}",
                model_size=trial["model_size"] or 0, model_n_params=trial["model_n_params"] or 0,
                test_time=trial["started_at"] or "", depth=trial.get("depth") or 0,
            ))
    return out


def table_cells(record: Mapping) -> dict:
    """The cells of llama-bench's table for one of its test rows: model, size, params, backend,
    ngl, threads, n_batch, n_ubatch, test, t/s (mean ± standard deviation)."""
    test = f"pp{record['n_prompt']}" if record["n_prompt"] else f"tg{record['n_gen']}"
    if record.get("n_depth"):
        test += f" @ d{record['n_depth']}"  # as llama-bench names a test run at a depth
    return {
        "model": record["model_type"],
        "size": human_bytes(int(record["model_size"])) if record["model_size"] else None,
        "params": human_params(int(record["model_n_params"])) if record["model_n_params"] else None,
        "backend": record["backends"],
        "ngl": record["n_gpu_layers"],
        "threads": record["n_threads"],
        "n_batch": record["n_batch"],
        "n_ubatch": record["n_ubatch"],
        "test": test,
        "tps": f"{record['avg_ts']:.2f} ± {record['stddev_ts']:.2f}",
    }


# llama-bench's table: `fleettune bench` (80 columns: short headers) and `export --format md`
TABLE_COLUMNS = (
    Column("model", "model"),
    Column("size", "size", justify="right"),
    Column("params", "params", justify="right"),
    Column("backend", "backend"),
    Column("ngl", "ngl", justify="right"),
    Column("threads", "t", justify="right", long_header="threads"),
    Column("n_batch", "b", justify="right", long_header="n_batch"),
    Column("n_ubatch", "ub", justify="right", long_header="n_ubatch"),
    Column("test", "test", justify="right"),
    Column("tps", "t/s", justify="right", no_wrap=True),
)
TABLE_LAYOUT = Layout(TABLE_COLUMNS, cells=table_cells)  # over llama-bench rows (FIELDS)
BENCH_LAYOUT = Layout(TABLE_COLUMNS)  # over bench_rows, which carry the same cells


# llama-bench's own formats, in the one printer registry
register("llama-bench-json", JsonPrinter)
register("llama-bench-jsonl", NdjsonPrinter)
register("llama-bench-csv", QuotedCsvPrinter, Layout(tuple(Column(f, f) for f in FIELDS)))
EXPORT_FORMATS = ("llama-bench-json", "llama-bench-jsonl", "llama-bench-csv", "md")


def write(records: Iterable[Mapping], fmt: str, out: TextIO) -> None:
    """llama-bench rows to ``out`` in one of EXPORT_FORMATS (md: llama-bench's table)."""
    if fmt not in EXPORT_FORMATS:
        raise BadInput(f"unknown export format {fmt!r}")
    create_printer(fmt, out, TABLE_LAYOUT).print_rows(records)


def bench_rows(model: ModelInfo, fp: Fingerprint, params: BenchParams, result: TrialResult,
               depth: int = 0) -> list[dict]:
    """`fleettune bench`'s rows: llama-bench's table cells (one row per test) and the figures
    behind them (mean, median, deviation, every sample)."""
    rows = []
    for kind in ("pp", "tg"):
        stats = result.stats(kind)
        if stats is None:
            continue
        samples = [s for s in result.samples if s.kind == kind]
        record = llama_bench_record(
            params=params, kind=kind, samples=[(s.n_tokens, s.seconds) for s in samples], build_commit="",
            cpu_info=fp.chip or "", gpu_info=fp.gpu_name or "", backend=fp.backend,
            model_filename=model.path, model_type=f"{model.architecture} {model.file_type}",
            model_size=model.size_bytes, model_n_params=model.n_params, test_time="", depth=depth,
        )
        rows.append({
            **table_cells(record),
            "avg_ts": stats.mean,
            "median_ts": stats.median,
            "stddev_ts": stats.stddev,
            "cv": stats.cv,
            "samples_ts": [s.tokens_per_s for s in samples],
            "samples_ns": [round(s.seconds * 1e9) for s in samples],
            "load_s": result.load_s,
            "peak_rss_bytes": result.peak_rss_bytes,
        })
    return rows


def utc_iso(value: datetime | None) -> str:
    if value is None:
        return ""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.isoformat().replace("+00:00", "Z")
