"""Hardware fingerprint: what kind of machine a node is, from what the machine itself says.

Sources are parsed from text so the same code reads a live machine and captured outputs
(`--from-dir`). A field the machine does not state stays ``None``; nothing is guessed. The one
table lookup is memory bandwidth for Apple chips (a vendor figure, not a machine readout), taken
from the bundled chip table only when the matching bins agree on it.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from workers.errors import BadInput

FROM_DIR_FILES = (
    "sysctl.txt",
    "system_profiler.json",
    "system_profiler.txt",
    "ioreg.txt",
    "cpuinfo.txt",
    "meminfo.txt",
    "nvidia-smi.csv",
)
NVIDIA_SMI_QUERY = "name,memory.total,driver_version"
MAX_CAPTURE_BYTES = 16 * 1024**2  # a command's captured output is kilobytes


GIB = 1024**3


@dataclass(frozen=True)
class Fingerprint:
    """What a node is: the one hardware record (a live machine, captured outputs, a row of the
    Apple Silicon chip table, a simulated Mac). ``chip_key`` is the routing label: nodes with one
    key are interchangeable."""

    chip: str | None
    chip_key: str | None
    vendor: str | None
    p_cores: int | None
    e_cores: int | None
    logical_cores: int | None
    gpu_cores: int | None
    gpu_name: str | None
    gpu_memory_bytes: int | None
    memory_bytes: int | None
    bandwidth_gbs: float | None
    os: str | None
    backend: str
    gpu_offload: bool
    # A second tier of "performance" cores beside p_cores that are not efficiency cores (M5 Pro/Max:
    # 6 super cores are p_cores, 12 performance cores are m_cores, no e_cores); None: not stated.
    m_cores: int | None = None

    @property
    def family(self) -> str | None:
        """Apple family such as "M2 Ultra", or None for other vendors."""
        if self.chip and self.chip.startswith("Apple "):
            return self.chip.removeprefix("Apple ")
        return None

    @property
    def generation(self) -> str | None:
        """Apple generation such as "M2" (what clock speeds follow from), or None."""
        return self.family.split()[0] if self.family else None

    @property
    def memory_gb(self) -> float | None:
        return self.memory_bytes / GIB if self.memory_bytes is not None else None

    @property
    def label(self) -> str | None:
        """An Apple bin as `--simulate` names it, "M2 Ultra/76/192" (family/GPU cores/memory GB)."""
        if not self.family:
            return self.chip_key
        memory = f"/{self.memory_bytes // GIB}" if self.memory_bytes is not None else ""
        return f"{self.family}/{self.gpu_cores}{memory}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Fingerprint:
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})


def apple_chip(family: str, p_cores: int, e_cores: int, gpu_cores: int, bandwidth_gbs: float,
               memory_bytes: int | None = None, os: str | None = None, m_cores: int = 0) -> Fingerprint:
    """The fingerprint of an Apple Silicon bin (what such a Mac reports about itself)."""
    name = f"Apple {family}"
    return Fingerprint(
        chip=name, chip_key=make_chip_key(name, gpu_cores, None), vendor="Apple",
        p_cores=p_cores, e_cores=e_cores, logical_cores=p_cores + m_cores + e_cores, gpu_cores=gpu_cores,
        gpu_name=name, gpu_memory_bytes=None, memory_bytes=memory_bytes, bandwidth_gbs=bandwidth_gbs,
        os=os, backend="metal", gpu_offload=True, m_cores=m_cores,
    )


@cache
def chip_table() -> tuple[Fingerprint, ...]:
    """The bundled Apple Silicon bins (family, core tiers, GPU cores, bandwidth; memory unknown).

    ``m_cores`` (the M5 Pro/Max's second tier of performance cores) is empty, 0, where a row leaves it out.
    """
    text = resources.files("workers").joinpath("data/apple_silicon_chips.csv").read_text()
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return tuple(
        apple_chip(r["family"], int(r["p_cores"]), int(r["e_cores"]), int(r["gpu_cores"]),
                   float(r["bandwidth_gbs"]), m_cores=int(r.get("m_cores") or 0))
        for r in rows
    )


def apple_bins(
    family: str,
    gpu_cores: int | None = None,
    p_cores: int | None = None,
    e_cores: int | None = None,
) -> list[Fingerprint]:
    """Bins of ``family`` consistent with whatever core counts are known."""
    bins = [b for b in chip_table() if b.family.lower() == family.lower()]
    for attr, value in (("gpu_cores", gpu_cores), ("p_cores", p_cores), ("e_cores", e_cores)):
        narrowed = [b for b in bins if value is None or getattr(b, attr) == value]
        bins = narrowed or bins
    return bins


def apple_bandwidth(
    family: str, gpu_cores: int | None, p_cores: int | None, e_cores: int | None
) -> float | None:
    """Vendor bandwidth for the bins that fit; None when they disagree, the family is unknown, or the
    GPU bin is not in the table (an unlisted bin, e.g. the 32-core M5 Max, need not have its
    family's listed bandwidth: the M4 Max's 32-core bin has 410 GB/s, its 40-core 546)."""
    if gpu_cores is not None and not any(b.gpu_cores == gpu_cores for b in apple_bins(family)):
        return None
    figures = {b.bandwidth_gbs for b in apple_bins(family, gpu_cores, p_cores, e_cores)}
    return figures.pop() if len(figures) == 1 else None


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def make_chip_key(chip: str | None, gpu_cores: int | None, logical_cores: int | None) -> str | None:
    """Routing key: "apple-m3-max-40g" (GPU bin) or "intel-xeon-...-8c" for CPU-only machines."""
    if not chip:
        return None
    key = slug(chip)
    if chip.startswith("Apple ") and gpu_cores:
        return f"{key}-{gpu_cores}g"
    if not chip.startswith("Apple ") and logical_cores:
        return f"{key}-{logical_cores}c"
    return key


# ---------------------------------------------------------------- parsers (pure, text in)


def parse_sysctl(text: str) -> dict[str, str]:
    """``key: value`` (``sysctl -a``) or ``key = value`` lines into a dict."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        match = re.match(r"^\s*([\w.\-]+)\s*[:=]\s*(.*?)\s*$", line)
        if match:
            values[match.group(1)] = match.group(2)
    return values


def _int(text: object) -> int | None:
    match = re.search(r"\d+", str(text)) if text is not None else None
    return int(match.group()) if match else None


def _memory_text_to_bytes(text: str) -> int | None:
    """"16 GB" as system_profiler prints it (binary units on Macs) into bytes."""
    match = re.match(r"\s*(\d{1,6}(?:\.\d+)?)\s*([KMGT])B", text or "", re.I)
    if not match:
        return None
    power = "KMGT".index(match.group(2).upper()) + 1
    return int(float(match.group(1)) * 1024**power)


def parse_system_profiler_json(text: str) -> dict:
    """Fields from ``system_profiler SPHardwareDataType SPDisplaysDataType -json``.

    ValueError for anything not shaped like it (an object of lists of objects of strings).
    """
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError("system_profiler JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("system_profiler JSON is not an object")
    out: dict = {}
    for item in _sections(data, "SPHardwareDataType"):
        out["chip"] = _text(item.get("chip_type")) or out.get("chip")
        procs = item.get("number_processors")
        # "proc 12:8:4" = total:performance:efficiency (M1-M4); "proc 18:6:0:12" adds a fourth,
        # the M5 Pro/Max's performance cores beside its 6 super cores (then in the second place)
        if isinstance(procs, str):
            nums = [int(n) for n in re.findall(r"\d+", procs)]
            if len(nums) >= 3:
                out["logical_cores"], out["p_cores"], out["e_cores"] = nums[:3]
                out["m_cores"] = nums[3] if len(nums) >= 4 else max(nums[0] - nums[1] - nums[2], 0)
        if _text(item.get("physical_memory")):
            out["memory_bytes"] = _memory_text_to_bytes(item["physical_memory"])
        if _text(item.get("machine_model")):
            out["model"] = item["machine_model"]
    for item in _sections(data, "SPDisplaysDataType"):
        name = _text(item.get("sppci_model")) or _text(item.get("_name"))
        if name and name.startswith("Apple"):
            out.setdefault("gpu_name", name)
            out["display_chip"] = name
            out["gpu_cores"] = _int(item.get("sppci_cores"))
    return out


def _sections(data: dict, name: str) -> list[dict]:
    """The list of objects system_profiler prints under ``name``; ValueError for another shape."""
    items = data.get(name, [])
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ValueError(f"system_profiler JSON: {name} is not a list of objects")
    return items


def _text(value: object) -> str | None:
    """A string field, or None; ValueError for a number, list or object where text belongs."""
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"system_profiler JSON: {value!r} where text belongs")


def parse_system_profiler_text(text: str) -> dict:
    """Fields from the plain-text ``system_profiler`` output (sections by indentation)."""
    out: dict = {}
    section = ""
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith(":"):
            section = line.strip().rstrip(":").lower()
            continue
        key, _, value = line.strip().partition(":")
        value = value.strip()
        if not value:
            continue
        if section.startswith("hardware"):
            if key == "Chip":
                out["chip"] = value
            elif key == "Total Number of Cores":
                # "12 (8 performance and 4 efficiency)"; on M5 "10 (4 Super and 6 Efficiency)" and
                # "18 (6 Super and 12 Performance)": the first tier named is the fastest
                match = re.match(r"(\d+)\s*\((.*)\)", value)
                tiers = re.findall(r"(\d+)\s+(super|performance|efficiency)\b", match.group(2), re.I) \
                    if match else []
                if tiers:
                    (top, _), rest = tiers[0], tiers[1:]
                    out["logical_cores"], out["p_cores"] = int(match.group(1)), int(top)
                    out["m_cores"] = sum(int(n) for n, kind in rest if kind.lower() != "efficiency")
                    out["e_cores"] = sum(int(n) for n, kind in rest if kind.lower() == "efficiency")
            elif key == "Memory":
                out["memory_bytes"] = _memory_text_to_bytes(value)
            elif key == "Model Identifier":
                out["model"] = value
        elif section.startswith("graphics"):
            if key == "Chipset Model" and value.startswith("Apple"):
                out["display_chip"] = value
            elif key == "Total Number of Cores":
                out["gpu_cores"] = _int(value)
    return out


def parse_ioreg(text: str) -> dict:
    """GPU core count from ``ioreg -rc AGXAccelerator -d1``."""
    match = re.search(r'"gpu-core-count"\s*=\s*(\d+)', text)
    return {"gpu_cores": int(match.group(1))} if match else {}


def parse_cpuinfo(text: str) -> dict:
    """Model name, logical and physical core counts from /proc/cpuinfo."""
    logical = 0
    cores: set[tuple[str, str]] = set()
    current: dict[str, str] = {}
    model = None
    for block in re.split(r"\n\s*\n", text.strip()):
        current = {}
        for line in block.splitlines():
            key, _, value = line.partition(":")
            current[key.strip()] = value.strip()
        if "processor" not in current:
            continue
        logical += 1
        model = model or current.get("model name") or current.get("Model")
        if "core id" in current:
            cores.add((current.get("physical id", "0"), current["core id"]))
    out: dict = {"logical_cores": logical or None, "cpu_model": model}
    if cores:
        out["physical_cores"] = len(cores)
    return out


def nvidia_smi_mib(field: str) -> int | None:
    """One figure of the first NVIDIA GPU in MiB (``memory.used``, ``memory.free``); None where
    there is no nvidia-smi or it says nothing usable."""
    out = _run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"])
    try:
        return int(out.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None


def gpu_free_bytes() -> int | None:
    """The first NVIDIA GPU's free memory in bytes (nvidia-smi); None without one."""
    free = nvidia_smi_mib("memory.free")
    return None if free is None else free * 1024**2


def process_gpu_bytes(pid: int) -> int | None:
    """What NVIDIA's driver counts for one process on its GPUs (its CUDA context and every
    allocation, ``nvidia-smi --query-compute-apps``), in bytes; None where there is no nvidia-smi,
    or it does not list the process (none of its memory on a GPU, or another PID namespace)."""
    return parse_compute_apps(_run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                    "--format=csv,noheader,nounits"]), pid)


def parse_compute_apps(text: str, pid: int) -> int | None:
    """Bytes of ``pid`` in ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``
    (a row per process and GPU, MiB; summed over GPUs); None where no usable row names it."""
    mib = [_int(row[1]) for row in csv.reader(text.strip().splitlines())
           if len(row) >= 2 and _int(row[0]) == pid]
    counted = [m for m in mib if m is not None]
    return sum(counted) * 1024**2 if counted else None


def parse_nvidia_smi_csv(text: str) -> dict:
    """First GPU of ``nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv``."""
    rows = [r for r in csv.reader(text.strip().splitlines()) if r]
    if not rows:
        return {}
    header = [c.strip().lower() for c in rows[0]]
    if header and header[0] == "name":
        names, rows = header, rows[1:]
    else:
        names = NVIDIA_SMI_QUERY.split(",")
    if not rows:
        return {}
    row = dict(zip((n.split(" ")[0] for n in names), (c.strip() for c in rows[0]), strict=False))
    memory_mib = _int(row.get("memory.total"))
    return {
        "gpu_name": row.get("name"),
        "gpu_memory_bytes": memory_mib * 1024**2 if memory_mib else None,
        "gpu_count": len(rows),
    }


def parse_meminfo(text: str) -> int | None:
    match = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.M)
    return int(match.group(1)) * 1024 if match else None


# ---------------------------------------------------------------- assembling a fingerprint


def _apple_fingerprint(sysctl: dict[str, str], prof: dict, ioreg: dict, os_name: str | None) -> dict:
    chip = sysctl.get("machdep.cpu.brand_string") or prof.get("chip") or prof.get("display_chip")
    if chip and not chip.startswith("Apple"):
        chip = None  # an Intel Mac's brand string is not an Apple Silicon chip
    # performance levels exist only on Apple Silicon, whose GPU llama.cpp drives through Metal
    apple_silicon = bool(chip or ioreg or prof.get("display_chip") or "hw.perflevel0.physicalcpu" in sysctl)
    p_cores = _int(sysctl.get("hw.perflevel0.physicalcpu")) or prof.get("p_cores")
    e_cores, m_cores = _lower_tiers(sysctl, prof)
    logical = _int(sysctl.get("hw.logicalcpu")) or prof.get("logical_cores")
    if logical is None and "hw.perflevel0.logicalcpu" in sysctl:
        logical = sum(
            _int(sysctl.get(f"hw.perflevel{i}.logicalcpu")) or 0
            for i in range(_int(sysctl.get("hw.nperflevels")) or 2)
        )
    gpu_cores = ioreg.get("gpu_cores") or prof.get("gpu_cores")
    memory = _int(sysctl.get("hw.memsize")) or prof.get("memory_bytes")
    family = chip.removeprefix("Apple ").strip() if chip else None
    bandwidth = apple_bandwidth(family, gpu_cores, p_cores, e_cores) if family else None
    version = sysctl.get("kern.osproductversion")
    return {
        "chip": chip,
        "vendor": "Apple" if apple_silicon else None,
        "p_cores": p_cores,
        "e_cores": e_cores,
        "m_cores": m_cores,
        "logical_cores": logical,
        "gpu_cores": gpu_cores,
        "gpu_name": chip if gpu_cores else prof.get("gpu_name"),
        "gpu_memory_bytes": None,  # unified memory: the GPU's share is memory_bytes
        "memory_bytes": memory,
        "bandwidth_gbs": bandwidth,
        "os": f"macOS {version}" if version else os_name,
        "backend": "metal" if apple_silicon else "cpu",
    }


def _lower_tiers(sysctl: dict[str, str], prof: dict) -> tuple[int | None, int | None]:
    """(efficiency cores, performance cores of a second tier) below ``hw.perflevel0``, the fastest
    tier (llama.cpp's default thread count). macOS names each level: "Performance" and "Efficiency"
    on M1-M4; "Super" and "Efficiency" on M5; "Super" and "Performance" on M5 Pro/Max, whose
    second tier is performance cores, not efficiency cores. A level without a name (older
    captures) is read as efficiency cores, as every chip before M5 Pro has them."""
    levels = _int(sysctl.get("hw.nperflevels"))
    if levels == 1:
        return 0, 0
    below = range(1, levels or 2)
    counts = [_int(sysctl.get(f"hw.perflevel{i}.physicalcpu")) for i in below]
    names = [sysctl.get(f"hw.perflevel{i}.name", "").strip().lower() for i in below]
    if any(names) and None not in counts:
        m_cores = sum(n for n, name in zip(counts, names, strict=True) if name in ("performance", "super"))
        return sum(counts) - m_cores, m_cores
    if prof.get("m_cores"):  # system_profiler names the tiers ("proc 18:6:0:12")
        return prof.get("e_cores"), prof["m_cores"]
    e_cores = counts[0] if counts[0] is not None else prof.get("e_cores")
    return e_cores, prof.get("m_cores")


def _linux_fingerprint(
    cpuinfo: dict, topology: dict, memory: int | None, nvidia: dict, os_name: str | None
) -> dict:
    model = cpuinfo.get("cpu_model")
    vendor = None
    if model:
        vendor = next(
            (v for v in ("Intel", "AMD", "Apple", "Ampere", "ARM") if v.lower() in model.lower()),
            None,
        )
    p_cores = topology.get("p_cores", cpuinfo.get("physical_cores"))
    e_cores = topology.get("e_cores", 0 if p_cores is not None else None)
    has_gpu = bool(nvidia.get("gpu_name"))
    return {
        "chip": model,
        "vendor": vendor,
        "p_cores": p_cores,
        "e_cores": e_cores,
        "logical_cores": cpuinfo.get("logical_cores"),
        "gpu_cores": None,
        "gpu_name": nvidia.get("gpu_name"),
        "gpu_memory_bytes": nvidia.get("gpu_memory_bytes"),
        "memory_bytes": memory,
        "bandwidth_gbs": None,
        "os": os_name,
        "backend": "cuda" if has_gpu else "cpu",
    }


def _finish(fields: dict, offload_supported: bool | None) -> Fingerprint:
    """Add chip_key and gpu_offload; a CPU-only llama.cpp build means backend cpu, no offload."""
    backend = fields["backend"]
    if offload_supported is False:
        backend = "cpu"
    gpu_offload = backend != "cpu"
    chip_for_key = fields["chip"]
    if backend == "cuda" and fields.get("gpu_name"):
        chip_for_key = fields["gpu_name"]  # a CUDA node is routed by its GPU
    key = make_chip_key(
        chip_for_key,
        fields["gpu_cores"],
        None if backend == "cuda" else fields["logical_cores"],
    )
    return Fingerprint(chip_key=key, gpu_offload=gpu_offload, **{**fields, "backend": backend})


def _source_kind(name: str) -> str | None:
    """Which capture a file holds, by its name: ``sysctl.txt`` or e.g. ``m1pro_sysctl-hw.txt``."""
    lower = name.lower()
    if "system_profiler" in lower or "system-profiler" in lower:
        return "system_profiler.json" if lower.endswith(".json") else "system_profiler.txt"
    for kind in ("sysctl", "ioreg", "cpuinfo", "meminfo", "nvidia-smi"):
        if kind in lower:
            return next(k for k in FROM_DIR_FILES if k.startswith(kind))
    return None


def fingerprint_from_dir(directory: str | os.PathLike) -> Fingerprint:
    """Fingerprint captured command outputs (any of FROM_DIR_FILES) instead of the live machine.

    Files are recognised by name (``sysctl.txt``, ``m2_sysctl-hw.txt``, ...); several captures of
    one kind (e.g. SPHardwareDataType and SPDisplaysDataType saved apart) are read together.
    """
    path = Path(directory)
    if not path.is_dir():
        raise BadInput(f"{directory}: not a directory")
    texts: dict[str, list[str]] = {}
    try:
        for file in sorted(path.iterdir()):
            kind = _source_kind(file.name) if file.is_file() else None
            if not kind:
                continue
            if file.stat().st_size > MAX_CAPTURE_BYTES:
                raise BadInput(f"{file}: larger than {MAX_CAPTURE_BYTES // 1024**2} MiB, not a captured output")
            texts.setdefault(kind, []).append(file.read_text(errors="replace"))
    except OSError as exc:
        raise BadInput(f"{exc.filename or directory}: cannot read: {exc.strerror or exc}") from None
    if not texts:
        raise BadInput(f"{directory}: none of {', '.join(FROM_DIR_FILES)} found")
    try:
        return _fingerprint_from_texts(texts)
    except ValueError as exc:  # json.JSONDecodeError is one
        raise BadInput(f"{directory}: cannot parse captured output: {exc}") from None


def _fingerprint_from_texts(captures: dict[str, list[str]]) -> Fingerprint:
    texts = {kind: "\n".join(parts) for kind, parts in captures.items()}
    mac_sources = {"system_profiler.json", "system_profiler.txt", "ioreg.txt"} & texts.keys()
    sysctl = parse_sysctl(texts.get("sysctl.txt", ""))
    is_mac = bool(mac_sources) or any(k.startswith(("hw.perflevel", "machdep.")) for k in sysctl)
    if is_mac:
        prof: dict = {}
        for part in captures.get("system_profiler.json", []):
            prof.update({k: v for k, v in parse_system_profiler_json(part).items() if v is not None})
        if "system_profiler.txt" in texts:
            prof.update(parse_system_profiler_text(texts["system_profiler.txt"]))
        ioreg = parse_ioreg(texts.get("ioreg.txt", ""))
        return _finish(_apple_fingerprint(sysctl, prof, ioreg, "macOS"), None)
    cpuinfo = parse_cpuinfo(texts.get("cpuinfo.txt", ""))
    nvidia = parse_nvidia_smi_csv(texts.get("nvidia-smi.csv", ""))
    memory = parse_meminfo(texts.get("meminfo.txt", ""))
    return _finish(_linux_fingerprint(cpuinfo, {}, memory, nvidia, None), None)


# ---------------------------------------------------------------- the live machine


def _run(argv: list[str], timeout: float = 10) -> str:
    """Output of a command, or "" when it is missing or fails (silent sources stay null)."""
    if shutil.which(argv[0]) is None:
        return ""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _linux_topology() -> dict:
    """Hybrid Intel parts list their P and E cores in sysfs; others have one kind of core."""
    core_cpus, atom_cpus = _read("/sys/devices/cpu_core/cpus"), _read("/sys/devices/cpu_atom/cpus")
    if not core_cpus:
        return {}

    def physical(cpulist: str) -> int:
        seen = set()
        for part in cpulist.strip().split(","):
            if not part:
                continue
            lo, _, hi = part.partition("-")
            for cpu in range(int(lo), int(hi or lo) + 1):
                seen.add(_read(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id").strip())
        return len(seen)

    return {"p_cores": physical(core_cpus), "e_cores": physical(atom_cpus) if atom_cpus else 0}


def llama_offload_supported() -> bool | None:
    """Whether the installed llama.cpp build can offload layers to a GPU (None: not installed)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return bool(llama_cpp.llama_supports_gpu_offload())


def gpu_unused(fp: Fingerprint) -> str | None:
    """One line where the machine has a GPU but its llama.cpp build cannot offload to it (every
    configuration then runs on the CPU), with how to get the GPU build; None otherwise."""
    if fp.gpu_offload or not fp.gpu_name:
        return None
    if fp.vendor == "Apple":
        fix = "reinstall llama-cpp-python on this Mac (pip builds it with Metal): sh install.sh"
    else:
        fix = "rebuild it with CUDA: FLEETTUNE_CUDA=1 sh install.sh (CMAKE_ARGS=-DGGML_CUDA=on)"
    return f"this machine has a GPU ({fp.gpu_name}) but its llama.cpp has no GPU offload; {fix}"


def fingerprint_live(offload_probe: Callable[[], bool | None] = llama_offload_supported) -> Fingerprint:
    """Fingerprint this machine from its own commands and files."""
    system = platform.system()
    if system == "Darwin":
        sysctl = parse_sysctl(_run(["sysctl", "hw", "machdep", "kern.osproductversion"]))
        prof_text = _run(["system_profiler", "SPHardwareDataType", "SPDisplaysDataType", "-json"], 60)
        prof = parse_system_profiler_json(prof_text) if prof_text else {}
        ioreg = parse_ioreg(_run(["ioreg", "-rc", "AGXAccelerator", "-d1"]))
        fields = _apple_fingerprint(sysctl, prof, ioreg, f"macOS {platform.mac_ver()[0]}")
    else:
        cpuinfo = parse_cpuinfo(_read("/proc/cpuinfo"))
        nvidia = parse_nvidia_smi_csv(
            _run(["nvidia-smi", f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv"])
        )
        os_name = f"{system} {platform.release()}"
        fields = _linux_fingerprint(
            cpuinfo, _linux_topology(), parse_meminfo(_read("/proc/meminfo")), nvidia, os_name
        )
        if fields["logical_cores"] is None:
            fields["logical_cores"] = os.cpu_count()
    return _finish(fields, offload_probe())
