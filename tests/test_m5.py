"""The M5 generation (issue 23.5): its core tiers as a Mac reports them (an M5 Pro/Max's second tier
is performance cores, not efficiency cores)."""

from __future__ import annotations

import json

from workers.hardware import (
    apple_bandwidth,
    fingerprint_from_dir,
    parse_system_profiler_json,
    parse_system_profiler_text,
)

# Constructed captures, not real ones: the key names and values follow what M5 Macs print in public
# reports (sysctl hw.perflevelN.name "Super" / "Performance" / "Efficiency" as of macOS 26.3.1;
# system_profiler's "proc 18:6:0:12"; "Total Number of Cores: 18 (6 Super and 12 Performance)").
M5_MAX_SYSCTL = (
    "machdep.cpu.brand_string: Apple M5 Max\nhw.memsize: 137438953472\nhw.logicalcpu: 18\n"
    "hw.nperflevels: 2\nhw.perflevel0.physicalcpu: 6\nhw.perflevel0.logicalcpu: 6\nhw.perflevel0.name: Super\n"
    "hw.perflevel1.physicalcpu: 12\nhw.perflevel1.logicalcpu: 12\nhw.perflevel1.name: Performance\n"
    "kern.osproductversion: 26.5\n"
)
M5_MAX_IOREG = '+-o AGXAcceleratorG17X  <class AGXAcceleratorG17X>\n    "gpu-core-count" = 40\n'


def test_an_m5_max_reports_super_cores_as_p_cores_and_its_performance_cores_apart(tmp_path):
    (tmp_path / "sysctl.txt").write_text(M5_MAX_SYSCTL)
    (tmp_path / "ioreg.txt").write_text(M5_MAX_IOREG)
    fp = fingerprint_from_dir(tmp_path)
    assert (fp.p_cores, fp.m_cores, fp.e_cores, fp.logical_cores) == (6, 12, 0, 18)
    assert fp.chip_key == "apple-m5-max-40g" and fp.backend == "metal"
    # the base M5: super cores above efficiency cores, no second tier
    base = M5_MAX_SYSCTL.replace("M5 Max", "M5").replace("physicalcpu: 12", "physicalcpu: 6") \
        .replace("hw.perflevel0.physicalcpu: 6", "hw.perflevel0.physicalcpu: 4").replace("1.name: Performance",
                                                                                        "1.name: Efficiency")
    (tmp_path / "sysctl.txt").write_text(base)
    (tmp_path / "ioreg.txt").write_text(M5_MAX_IOREG.replace("40", "10"))
    fp = fingerprint_from_dir(tmp_path)
    assert (fp.p_cores, fp.m_cores, fp.e_cores) == (4, 0, 6)


def test_system_profiler_names_the_m5_tiers():
    hardware = {"SPHardwareDataType": [{"chip_type": "Apple M5 Max", "number_processors": "proc 18:6:0:12"}]}
    out = parse_system_profiler_json(json.dumps(hardware))
    assert (out["logical_cores"], out["p_cores"], out["e_cores"], out["m_cores"]) == (18, 6, 0, 12)
    old = {"SPHardwareDataType": [{"chip_type": "Apple M3 Max", "number_processors": "proc 16:12:4"}]}
    assert parse_system_profiler_json(json.dumps(old))["m_cores"] == 0
    text = "Hardware:\n\n    Hardware Overview:\n\n      Total Number of Cores: {}\n"
    for cores, tiers in (("18 (6 Super and 12 Performance)", (18, 6, 12, 0)),
                         ("10 (4 Super and 6 Efficiency)", (10, 4, 0, 6)),
                         ("24 (16 performance and 8 efficiency)", (24, 16, 0, 8))):
        out = parse_system_profiler_text(text.format(cores))
        assert (out["logical_cores"], out["p_cores"], out["m_cores"], out["e_cores"]) == tiers


def test_a_sysctl_capture_without_level_names_takes_the_tiers_from_system_profiler(tmp_path):
    sysctl = "\n".join(line for line in M5_MAX_SYSCTL.splitlines() if ".name:" not in line)
    (tmp_path / "sysctl.txt").write_text(sysctl)
    (tmp_path / "system_profiler.json").write_text(json.dumps(
        {"SPHardwareDataType": [{"chip_type": "Apple M5 Max", "number_processors": "proc 18:6:0:12"}]}))
    fp = fingerprint_from_dir(tmp_path)
    assert (fp.p_cores, fp.m_cores, fp.e_cores) == (6, 12, 0)


def test_an_unlisted_gpu_bin_gets_no_bandwidth_from_its_family():
    assert apple_bandwidth("M4 Max", 32, None, None) == 410.0  # listed bins as before
    assert apple_bandwidth("M4 Max", 36, None, None) is None  # no such bin in the table
    assert apple_bandwidth("M4 Max", None, 10, None) == 410.0
