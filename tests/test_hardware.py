"""Hardware fingerprints from real Mac outputs (tests/fixtures/macos) and from this Linux machine."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from workers.errors import BadInput
from workers.hardware import (
    apple_bandwidth,
    fingerprint_from_dir,
    fingerprint_live,
    make_chip_key,
    parse_cpuinfo,
    parse_nvidia_smi_csv,
    parse_system_profiler_text,
)

FIXTURES = Path(__file__).parent / "fixtures" / "macos"  # the project's own copy: a clone needs nothing beside it


def _dir_with(tmp_path: Path, **files: str) -> Path:
    for name, content in files.items():
        (tmp_path / name.replace("__", ".").replace("_dash_", "-")).write_text(content)
    return tmp_path


def _fixture(tmp_path: Path, fixture: str, as_name: str) -> Path:
    shutil.copy(FIXTURES / fixture, tmp_path / as_name)
    return tmp_path


def test_m1_pro_sysctl_gives_cores_and_leaves_the_rest_null(tmp_path):
    fp = fingerprint_from_dir(_fixture(tmp_path, "m1pro-10c_sysctl-hw.txt", "sysctl.txt"))
    assert (fp.p_cores, fp.e_cores, fp.logical_cores) == (8, 2, 10)
    assert fp.vendor == "Apple" and fp.backend == "metal"
    # the trimmed capture names no chip, GPU or memory: they stay null, never guessed
    assert fp.chip is None and fp.chip_key is None and fp.gpu_cores is None
    assert fp.memory_bytes is None and fp.bandwidth_gbs is None


def test_m2_pro_system_profiler_text(tmp_path):
    fp = fingerprint_from_dir(
        _fixture(tmp_path, "m2pro_system_profiler-SPDisplaysDataType.txt", "system_profiler.txt")
    )
    assert fp.chip == "Apple M2 Pro" and fp.gpu_cores == 19
    assert fp.chip_key == "apple-m2-pro-19g"
    assert fp.bandwidth_gbs == 200.0
    assert fp.p_cores is None and fp.memory_bytes is None


def test_m4_system_profiler_json(tmp_path):
    fp = fingerprint_from_dir(
        _fixture(tmp_path, "m4_system_profiler-SPDisplaysDataType.json", "system_profiler.json")
    )
    assert fp.chip == "Apple M4" and fp.gpu_cores == 10 and fp.chip_key == "apple-m4-10g"
    assert fp.bandwidth_gbs == 120.0 and fp.gpu_offload


def test_files_are_recognised_by_name_as_captured(tmp_path):
    fp = fingerprint_from_dir(_fixture(tmp_path, "m4_system_profiler-SPDisplaysDataType.json",
                                       "m4_system_profiler-SPDisplaysDataType.json"))
    assert fp.chip_key == "apple-m4-10g"


def test_a_whole_mac_from_sysctl_ioreg_and_hardware_json(tmp_path):
    sysctl = (
        "machdep.cpu.brand_string: Apple M3 Max\nhw.memsize: 68719476736\nhw.model: Mac15,9\n"
        "hw.nperflevels: 2\nhw.perflevel0.physicalcpu: 12\nhw.perflevel1.physicalcpu: 4\n"
        "hw.logicalcpu: 16\nkern.osproductversion: 15.1\n"
    )
    ioreg = '+-o AGXAcceleratorG15X  <class AGXAcceleratorG15X>\n    "gpu-core-count" = 40\n'
    hardware = {"SPHardwareDataType": [{"chip_type": "Apple M3 Max", "number_processors": "proc 16:12:4",
                                        "physical_memory": "64 GB", "machine_model": "Mac15,9"}]}
    d = _dir_with(tmp_path, sysctl__txt=sysctl, ioreg__txt=ioreg,
                  system_profiler__json=json.dumps(hardware))
    fp = fingerprint_from_dir(d)
    assert fp.chip == "Apple M3 Max" and fp.chip_key == "apple-m3-max-40g"
    assert (fp.p_cores, fp.e_cores, fp.gpu_cores) == (12, 4, 40)
    assert fp.memory_bytes == 64 * 1024**3 and fp.bandwidth_gbs == 400.0
    assert fp.os == "macOS 15.1" and fp.backend == "metal"


def test_hardware_text_section_is_not_confused_with_the_gpu_section():
    text = (
        "Hardware:\n\n    Hardware Overview:\n\n      Chip: Apple M2 Ultra\n"
        "      Total Number of Cores: 24 (16 performance and 8 efficiency)\n      Memory: 192 GB\n\n"
        "Graphics/Displays:\n\n    Apple M2 Ultra:\n\n      Chipset Model: Apple M2 Ultra\n"
        "      Total Number of Cores: 76\n"
    )
    out = parse_system_profiler_text(text)
    assert out["chip"] == "Apple M2 Ultra" and out["gpu_cores"] == 76
    assert (out["logical_cores"], out["p_cores"], out["e_cores"]) == (24, 16, 8)
    assert out["memory_bytes"] == 192 * 1024**3


def test_bandwidth_is_null_when_the_bins_disagree():
    assert apple_bandwidth("M3 Max", None, None, None) is None  # 300 or 400 GB/s
    assert apple_bandwidth("M3 Max", 40, None, None) == 400.0
    assert apple_bandwidth("M3 Max", None, 10, None) == 300.0
    assert apple_bandwidth("M9 Hyper", 10, None, None) is None


def test_missing_or_empty_dir_is_bad_input(tmp_path):
    with pytest.raises(BadInput):
        fingerprint_from_dir(tmp_path / "nope")
    with pytest.raises(BadInput):
        fingerprint_from_dir(tmp_path)


def test_nvidia_smi_csv_with_and_without_header():
    with_header = "name, memory.total [MiB], driver_version\nNVIDIA H200, 143771 MiB, 580.159.03\n"
    without = "NVIDIA H200, 143771, 580.159.03\n"
    for text in (with_header, without):
        out = parse_nvidia_smi_csv(text)
        assert out["gpu_name"] == "NVIDIA H200" and out["gpu_memory_bytes"] == 143771 * 1024**2


def test_cuda_node_is_routed_by_its_gpu(tmp_path):
    cpuinfo = "processor\t: 0\nmodel name\t: AMD EPYC 9654\ncore id\t: 0\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9654\ncore id\t: 1\n"
    d = _dir_with(tmp_path, cpuinfo__txt=cpuinfo, nvidia_dash_smi__csv="NVIDIA H200, 143771, 580\n")
    fp = fingerprint_from_dir(d)
    assert fp.backend == "cuda" and fp.gpu_offload and fp.chip_key == "nvidia-h200"
    assert fp.vendor == "AMD" and fp.logical_cores == 2 and fp.p_cores == 2


def test_this_linux_machine_live():
    fp = fingerprint_live()
    cpuinfo = parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    assert fp.chip == cpuinfo["cpu_model"]
    assert fp.logical_cores == os.cpu_count()
    meminfo = Path("/proc/meminfo").read_text().split("\n")[0]
    assert fp.memory_bytes == int(meminfo.split()[1]) * 1024
    assert fp.chip_key == make_chip_key(fp.chip, None, fp.logical_cores)
    if not shutil.which("nvidia-smi"):
        assert fp.backend == "cpu" and not fp.gpu_offload  # no GPU: no offload, no guess
        assert fp.gpu_name is None and fp.bandwidth_gbs is None


def test_live_from_dir_round_trip_on_this_machine(tmp_path):
    """Captured Linux outputs of this machine give the same identity as the live fingerprint."""
    shutil.copy("/proc/cpuinfo", tmp_path / "cpuinfo.txt")
    shutil.copy("/proc/meminfo", tmp_path / "meminfo.txt")
    live, captured = fingerprint_live(), fingerprint_from_dir(tmp_path)
    assert captured.chip == live.chip and captured.logical_cores == live.logical_cores
    assert captured.memory_bytes == live.memory_bytes
