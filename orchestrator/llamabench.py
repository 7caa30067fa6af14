"""llama-bench interop: read its JSON, JSONL and CSV output into the results database, and write
ours in the same shapes (and its markdown table), so results travel both ways.

llama-bench prints one row per test: ``pp512`` (n_prompt > 0) or ``tg128`` (n_gen > 0) for one
configuration. Importing groups a configuration's pp and tg rows into one fleettune trial. Rows that
cannot be read, or tests fleettune does not model (prompt+generation ``-pg``, depth ``-d``), are
reported by line; the rest go in, all in one transaction, so nothing is ever half-imported.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from orchestrator.db import Database, repo
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


# ---------------------------------------------------------------- reading


def read_records(text: str) -> tuple[list[tuple[int, dict]], list[tuple[int, str]]]:
    """(line, record) pairs from llama-bench JSON, JSONL or CSV text, and (line, reason) problems."""
    stripped = text.lstrip()
    if not stripped:
        raise BadInput("the file is empty")
    if stripped[0] == "[":
        return _json_array(text)
    if stripped[0] == "{":
        return _json_lines(text)
    return _csv(text)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _json_array(text: str) -> tuple[list, list]:
    decoder, records, problems = json.JSONDecoder(), [], []
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return records, problems
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            problems.append((_line_of(text, pos), f"malformed JSON ({exc.msg})"))
            nxt = text.find("\n  {", pos + 1)  # llama-bench starts every object on its own line
            if nxt < 0:
                return records, problems
            pos = nxt + 1
            continue
        if isinstance(value, dict):
            records.append((_line_of(text, pos), value))
        else:
            problems.append((_line_of(text, pos), "not a JSON object"))
        pos = end


def _json_lines(text: str) -> tuple[list, list]:
    records, problems = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append((number, f"malformed JSON ({exc.msg})"))
            continue
        if isinstance(value, dict):
            records.append((number, value))
        else:
            problems.append((number, "not a JSON object"))
    return records, problems


def _csv(text: str) -> tuple[list, list]:
    reader = csv.DictReader(io.StringIO(text))
    missing = [f for f in REQUIRED if f not in (reader.fieldnames or [])]
    if missing:
        raise BadInput(f"not llama-bench output (JSON, JSONL or CSV): no column {', '.join(missing)}")
    records, problems = [], []
    for record in reader:
        if None in record or any(v is None for v in record.values()):
            problems.append((reader.line_num, "wrong number of columns"))
            continue
        records.append((reader.line_num, record))
    return records, problems


def _int(record: dict, key: str, default: int | None = None) -> int:
    value = record.get(key, default)
    if value is None or value == "":
        raise ValueError(f"missing {key}")
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return int(value.lower() == "true")
    return int(value)


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
    avg_ts = float(record["avg_ts"])
    if not avg_ts > 0:
        raise ValueError(f"avg_ts {record['avg_ts']!r} is not a speed")
    samples = record.get("samples_ns") or ()
    if isinstance(samples, str):  # not in llama-bench's CSV, but tolerated if someone adds it
        samples = [s for s in samples.replace(";", " ").split() if s]
    ngl, n_batch, n_ubatch = _int(record, "n_gpu_layers"), _int(record, "n_batch"), _int(record, "n_ubatch")
    if str(record.get("backends", "")).strip().upper() == "CPU":
        ngl = 0  # a CPU-only build offloads nothing, whatever -ngl said (fleettune's CPU studies say 0)
    elif ngl == -1:
        ngl = ALL_LAYERS  # llama-bench's default -ngl -1: every layer
    params = BenchParams(
        n_gpu_layers=ngl, n_threads=_int(record, "n_threads"), n_batch=n_batch,
        n_ubatch=min(n_ubatch, n_batch),  # llama.cpp clamps the micro-batch to the batch
        flash_attn=_int(record, "flash_attn", 0) == 1,  # -1 (auto) is stored as off
    )
    if min(params.n_gpu_layers, params.n_threads - 1, params.n_batch - 1, params.n_ubatch - 1) < 0:
        raise ValueError("out-of-range parameters")
    return BenchRow(
        line=line, kind="pp" if n_prompt else "tg", params=params, n_tokens=n_prompt or n_gen,
        avg_ts=avg_ts, stddev_ts=float(record.get("stddev_ts") or 0.0),
        samples_ns=tuple(int(float(s)) for s in samples),
        model_filename=str(record["model_filename"]), model_type=str(record.get("model_type", "")),
        model_size=_int(record, "model_size", 0), model_n_params=_int(record, "model_n_params", 0),
        cpu_info=str(record.get("cpu_info", "")), gpu_info=str(record.get("gpu_info", "")),
        backends=str(record.get("backends", "")), build_commit=str(record.get("build_commit", "")),
        test_time=str(record.get("test_time", "")),
    )


# ---------------------------------------------------------------- importing


def group_trials(rows: list[BenchRow]) -> list[list[BenchRow]]:
    """One trial per configuration's pp row and tg row, in file order; a configuration measured
    again later in the file (a repeated run) is another trial, not more samples of the first."""
    groups: list[list[BenchRow]] = []
    open_groups: dict[tuple, list[BenchRow]] = {}
    for row in rows:
        group = open_groups.get(row.config_key)
        if group is None or any(r.kind == row.kind for r in group):
            group = []
            groups.append(group)
            open_groups[row.config_key] = group
        group.append(row)
    return groups


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
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def import_file(db: Database, path: str | Path, *, chip_key: str | None = None,
                model: ModelInfo | None = None) -> ImportReport:
    """Import one llama-bench output file; one study per (chip, model) found in it."""
    file = Path(path)
    if not file.is_file():
        raise BadInput(f"{path}: no such file")
    records, problems = read_records(file.read_text(errors="replace"))
    rows: list[BenchRow] = []
    for line, record in records:
        try:
            rows.append(parse_record(line, record))
        except (ValueError, TypeError) as exc:
            problems.append((line, str(exc)))
    report = ImportReport(problems=sorted(problems))
    if not rows:
        return report
    with db.session() as s:  # one transaction: all of it or none
        groups = group_trials(rows)
        studies: dict[tuple, object] = {}
        for trial_rows in groups:
            first = trial_rows[0]
            fp = _chip_fingerprint(first, chip_key)
            info = _model_for(s, first, model)
            key = (fp.chip_key, info.sha256)
            if key not in studies:
                chip = repo.upsert_chip(s, fp)
                model_row = repo.upsert_model(s, info)
                name = repo.free_study_name(s, f"llama-bench/{fp.chip_key}/{info.name}/{file.stem}")
                studies[key] = repo.add_study(
                    s, name=name, chip_id=chip.id, model_id=model_row.id, objective="tg",
                    n_prompt=max((r.n_tokens for r in rows if r.kind == "pp"), default=0),
                    n_gen=max((r.n_tokens for r in rows if r.kind == "tg"), default=0),
                    reps=max((len(r.samples_ns) for r in rows), default=1), sampler="llama-bench",
                    budget=len(groups), space={}, simulated=False, state="complete",
                    message=f"imported from {file.name}",
                )
                report.studies.append(name)
            study = studies[key]
            trial_id = repo.start_trial(s, study_id=study.id, optuna_number=None, phase=IMPORT_PHASE,
                                        params=first.params.to_dict(), simulated=False)
            result = _result(trial_rows)
            tg = result.stats("tg")
            repo.finish_trial(s, trial_id, result, objective_value=tg.median if tg else None,
                              e2e_s=None, node_id=None)
            repo.set_trial_llama_bench_stats(s, trial_id, {r.kind: (r.avg_ts, r.stddev_ts) for r in trial_rows})
            report.trials += 1
            report.rows += len(trial_rows)
    return report


# ---------------------------------------------------------------- exporting


def export_records(trial_rows: list[dict]) -> list[dict]:
    """Our trials as llama-bench rows: one pp and one tg row per trial that measured them."""
    out = []
    for trial in trial_rows:
        params = BenchParams.from_dict(trial["params"])
        for kind in ("pp", "tg"):
            samples = [x for x in trial["samples"] if x["kind"] == kind]
            if not samples:
                continue
            ns = [int(round(x["seconds"] * 1e9)) for x in samples]
            ts = [x["n_tokens"] / x["seconds"] for x in samples]
            n_tokens = samples[0]["n_tokens"]
            record = dict.fromkeys(FIELDS, "")
            record.update(
                build_commit=trial.get("llama_build") or "", build_number=0,
                cpu_info=trial["chip_name"] or trial["chip"], gpu_info=trial.get("gpu_name") or "",
                backends={"metal": "Metal", "cuda": "CUDA"}.get(trial.get("backend") or "", "CPU"),
                model_filename=trial["model_path"] or trial["model"],
                model_type=f"{trial['architecture']} {trial['file_type']}",
                model_size=trial["model_size"] or 0, model_n_params=trial["model_n_params"] or 0,
                n_batch=params.n_batch, n_ubatch=params.n_ubatch, n_threads=params.n_threads,
                cpu_mask="0x0", cpu_strict=False, poll=50, type_k="f16", type_v="f16",
                n_gpu_layers=params.n_gpu_layers, n_cpu_moe=0, split_mode="layer", main_gpu=0,
                no_kv_offload=False, flash_attn=int(params.flash_attn), devices="auto", tensor_split="0.00",
                tensor_buft_overrides="none", load_mode="mmap", lazy_mode="auto", embeddings=False,
                no_op_offload=0, no_host=False, repack=True, fit_target=0, fit_min_ctx=0,
                n_prompt=n_tokens if kind == "pp" else 0, n_gen=n_tokens if kind == "tg" else 0,
                n_depth=0, test_time=trial["started_at"] or "",
                avg_ns=int(statistics.fmean(ns)), stddev_ns=int(statistics.stdev(ns)) if len(ns) > 1 else 0,
                avg_ts=statistics.fmean(ts), stddev_ts=statistics.stdev(ts) if len(ts) > 1 else 0.0,
                samples_ns=ns, samples_ts=ts,
            )
            out.append(record)
    return out


def write(records: list[dict], fmt: str) -> str:
    if fmt == "llama-bench-json":
        return json.dumps(records, indent=2, default=str) + "\n"
    if fmt == "llama-bench-jsonl":
        return "".join(json.dumps(r, default=str) + "\n" for r in records)
    if fmt == "llama-bench-csv":  # llama-bench's CSV: every field quoted, no sample lists
        lines = [",".join(FIELDS)]
        for r in records:
            lines.append(",".join('"' + _csv_value(r[f]).replace('"', '""') + '"' for f in FIELDS))
        return "\n".join(lines) + "\n"
    if fmt == "md":
        return _markdown(records)
    raise BadInput(f"unknown export format {fmt!r}")


def _csv_value(value) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.6f}"
    return str(value)


def _markdown(records: list[dict]) -> str:
    """llama-bench's default table: model, size, params, backend, ngl, threads, n_batch, test, t/s."""
    header = "| model | size | params | backend | ngl | threads | n_batch | n_ubatch | test | t/s |"
    lines = [header, "| --- | ---: | ---: | --- | --: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        size = f"{int(r['model_size']) / 1024**3:.2f} GiB" if r["model_size"] else "-"
        params = f"{int(r['model_n_params']) / 1e9:.2f} B" if r["model_n_params"] else "-"
        lines.append(
            f"| {r['model_type']} | {size} | {params} | {r['backends']} | {r['n_gpu_layers']} | "
            f"{r['n_threads']} | {r['n_batch']} | {r['n_ubatch']} | {test} | "
            f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def utc_iso(value: datetime | None) -> str:
    if value is None:
        return ""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.isoformat().replace("+00:00", "Z")
