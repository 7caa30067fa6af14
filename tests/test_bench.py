"""One trial measured for real with llama.cpp, and every way a trial can fail without killing us."""

from __future__ import annotations

import dataclasses
import os

import pytest

from tests.conftest import TINY
from workers.bench import _describe_exit, measure
from workers.errors import BadInput
from workers.knobs import check_on_node
from workers.trial import BenchParams, FailureKind, Stats, TrialSpec, Workload, validate_workload


def _spec(model_info, params=None, workload=None, **kw) -> TrialSpec:
    return TrialSpec(
        model_path=model_info.path,
        model_sha256=model_info.sha256,
        params=params or BenchParams(n_threads=1, n_batch=8, n_ubatch=8),
        workload=workload or Workload(**TINY),
        timeout_s=kw.pop("timeout_s", 120),
        trial_key="t1",
        **kw,
    )


def test_real_trial_measures_every_repetition(model_info):
    workload = Workload(n_prompt=16, n_gen=4, reps=2)
    result = measure(_spec(model_info, workload=workload))
    assert result.ok, result.error
    pp = [s for s in result.samples if s.kind == "pp"]
    tg = [s for s in result.samples if s.kind == "tg"]
    assert [s.rep for s in pp] == [0, 1] and [s.rep for s in tg] == [0, 1]
    assert all(s.n_tokens == 16 for s in pp) and all(s.n_tokens == 4 for s in tg)
    assert all(s.seconds > 0 for s in result.samples)
    assert result.pp.median > 0 and result.tg.median > 0
    # summaries are computed from the samples, not reported separately
    assert result.tg == Stats.of(tg)
    assert result.load_s > 0 and result.measure_s >= result.load_s
    assert result.peak_rss_bytes > model_info.size_bytes // 2
    assert result.started_at <= result.finished_at
    assert "llama-cpp-python" in result.backend_info


def test_a_trial_records_what_nvidia_smi_counts_for_its_process(model_info, tmp_path, monkeypatch):
    # nvidia-smi as its CSV says: a row per process (its parent here: the measuring process) and GPU
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\necho "1, 99"\necho "$PPID, 1234"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    result = measure(_spec(model_info, workload=Workload(n_prompt=16, n_gen=4, reps=1)))
    assert result.ok, result.error
    assert result.gpu_device_bytes == 1234 * 1024**2 and result.gpu_bytes == 0  # a CPU build's buffers
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi: no count
    assert measure(_spec(model_info, workload=Workload(n_prompt=16, n_gen=4, reps=1))).gpu_device_bytes is None


def test_prompt_is_decoded_in_batch_sized_chunks(model_info):
    """n_batch 4 with a 16-token prompt: four decodes, still one sample per repetition."""
    result = measure(_spec(model_info, BenchParams(n_threads=1, n_batch=4, n_ubatch=4),
                           Workload(n_prompt=16, n_gen=0, reps=1)))
    assert result.ok, result.error
    assert [(s.kind, s.n_tokens) for s in result.samples] == [("pp", 16)]


def test_stats_match_llama_bench_definitions():
    from workers.trial import Sample

    stats = Stats.of([Sample("tg", i, 10, sec) for i, sec in enumerate((0.1, 0.2, 0.25))])
    rates = [100.0, 50.0, 40.0]
    assert stats.mean == pytest.approx(sum(rates) / 3)
    assert stats.median == 50.0
    assert stats.stddev == pytest.approx(32.1455, rel=1e-4)  # sample stddev (n-1), as llama-bench
    assert stats.cv == pytest.approx(stats.stddev / stats.mean)


def test_corrupt_model_is_a_failed_trial_and_we_live_on(tmp_path, model_info, model_path):
    broken = tmp_path / "broken.gguf"
    data = bytearray(model_path.read_bytes()[: 8 << 20])
    broken.write_bytes(bytes(data))  # the header is intact, the tensors are cut off
    from workers.models import sha256_file

    # registered as it is (a corrupt file that is the study's model), so it gets as far as loading
    spec = dataclasses.replace(_spec(model_info), model_path=str(broken),
                               model_sha256=sha256_file(broken))
    result = measure(spec)
    assert not result.ok and "could not load" in result.error
    assert measure(_spec(model_info)).ok  # the caller is unaffected


def test_hang_is_killed_at_the_timeout(model_info):
    big = Workload(n_prompt=0, n_gen=100_000, reps=1, warmup=False)
    result = measure(_spec(model_info, workload=big, timeout_s=3))
    assert not result.ok and result.error == "timed out after 3s"


def test_model_missing_on_node(model_info):
    spec = dataclasses.replace(_spec(model_info), model_path="/nonexistent/model.gguf")
    assert measure(spec).error.startswith("model not on node")


def test_crash_and_oom_reasons():
    assert _describe_exit(-11, "") == ("llama.cpp crashed (SIGSEGV)", FailureKind.CRASH)
    assert _describe_exit(-9, "") == ("killed by SIGKILL (out of memory?)", FailureKind.OUT_OF_MEMORY)
    assert _describe_exit(1, "x\nboom\n")[0].endswith(": boom")


@pytest.mark.parametrize(
    "params, match",
    [
        (BenchParams(n_gpu_layers=1, n_threads=1), "no GPU offload"),
        (BenchParams(n_threads=0), "threads 0"),
        (BenchParams(n_threads=10_000), "threads 10000"),
        (BenchParams(n_threads=1, n_batch=0), "batch 0"),
        (BenchParams(n_threads=1, n_batch=64, n_ubatch=128), "ubatch 128"),
        (BenchParams(n_gpu_layers=-1, n_threads=1), "ngl -1"),
    ],
)
def test_parameters_the_backend_cannot_use_are_rejected(params, match, local_fingerprint, model_info):
    if local_fingerprint.gpu_offload and "GPU" in match:
        pytest.skip("this machine can offload")
    with pytest.raises(BadInput, match=match):
        check_on_node(params, local_fingerprint, model_info)


def test_ngl_beyond_the_model_is_rejected(model_info):
    from workers.hardware import Fingerprint

    gpu = Fingerprint(None, "x", None, 8, 4, 12, 38, None, None, None, None, None, "metal", True)
    check_on_node(BenchParams(n_gpu_layers=31, n_threads=1), gpu, model_info)  # 30 layers + output
    with pytest.raises(BadInput, match="0..31"):
        check_on_node(BenchParams(n_gpu_layers=32, n_threads=1), gpu, model_info)


def test_workload_limits(model_info):
    with pytest.raises(BadInput):
        validate_workload(Workload(n_prompt=0, n_gen=0), model_info)
    with pytest.raises(BadInput, match="context"):
        validate_workload(Workload(n_prompt=9000, n_gen=0), model_info)


def test_the_measuring_subprocess_loads_no_numpy_before_llama_cpp():
    """A numpy loaded before llama.cpp crashed the CUDA build's model load (seen on an H200)."""
    import subprocess
    import sys

    code = "import sys, workers.bench; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- the model checked before loading


def _copy(model_path, dest):
    import shutil

    shutil.copyfile(model_path, dest)
    return dest


def test_a_model_changed_between_trials_fails_the_second(tmp_path, model_path, model_info):
    """Same path, same size, even the mtime put back: the second trial is not measured."""
    import os

    copy = _copy(model_path, tmp_path / "model.gguf")
    spec = dataclasses.replace(_spec(model_info), model_path=str(copy))
    assert measure(spec).ok
    before = os.stat(copy)
    with open(copy, "r+b") as handle:  # one byte of the last tensor: still loads, another model
        handle.seek(before.st_size - 100)
        byte = handle.read(1)
        handle.seek(before.st_size - 100)
        handle.write(bytes([byte[0] ^ 0x55]))
    os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))
    result = measure(spec)
    assert not result.ok and result.error.startswith("model changed"), result.error
    assert not result.samples


def test_the_measuring_process_takes_the_digest_from_the_cache(tmp_path, model_path, model_info):
    """The child hashes a file once: after a forged cache entry (same file, other digest) the
    next trial fails, which it cannot if it hashed the file again."""
    import json

    from workers import digests

    copy = _copy(model_path, tmp_path / "model.gguf")
    spec = dataclasses.replace(_spec(model_info), model_path=str(copy))
    assert measure(spec).ok
    cache = json.loads(digests.cache_path().read_text())
    entry = cache[str(copy.resolve())]
    assert entry["sha256"] == model_info.sha256
    entry["sha256"] = "0" * 64
    digests.cache_path().write_text(json.dumps(cache))
    assert measure(spec).error.startswith("model changed")
    copy.touch()  # a new mtime: hashed again, and the file is the model
    assert measure(spec).ok


def test_digest_cache_hashes_once_per_file_version(tmp_path, monkeypatch):
    from workers import digests

    monkeypatch.setenv("FLEETTUNE_HOME", str(tmp_path / "home"))
    model = tmp_path / "m.bin"
    model.write_bytes(b"a" * 1000)
    before = digests.hashes_computed
    first = digests.sha256_cached(model)
    assert digests.sha256_cached(model) == first and digests.hashes_computed == before + 1
    model.write_bytes(b"b" * 1000)
    assert digests.sha256_cached(model) != first and digests.hashes_computed == before + 2
    digests.cache_path().write_text("not json")  # a corrupt cache costs a hash, nothing else
    assert digests.sha256_cached(model) and digests.hashes_computed == before + 3


# ---------------------------------------------------------------- an isolated measuring process


@pytest.mark.parametrize("how", ["cwd", "PYTHONPATH"])
def test_a_local_workers_folder_does_not_shadow_the_package(tmp_path, monkeypatch, model_info, how):
    bogus = tmp_path / "shadow" / "workers"
    bogus.mkdir(parents=True)
    (bogus / "__init__.py").write_text("raise SystemExit('a bogus workers package was imported')\n")
    (bogus / "bench.py").write_text("raise SystemExit('a bogus workers.bench was imported')\n")
    if how == "cwd":
        monkeypatch.chdir(bogus.parent)
    else:
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("PYTHONPATH", str(bogus.parent))
    result = measure(_spec(model_info))
    assert result.ok, result.error


# ---------------------------------------------------------------- today's llama.cpp dimensions, for real


@pytest.mark.parametrize("params", [
    BenchParams(n_threads=1, n_batch=8, n_ubatch=8, flash_attn="on"),
    BenchParams(n_threads=1, n_batch=8, n_ubatch=8, flash_attn="auto"),
    BenchParams(n_threads=1, n_batch=8, n_ubatch=8, flash_attn="on", type_k="q8_0", type_v="q8_0"),
    BenchParams(n_threads=1, n_batch=8, n_ubatch=8, type_k="q4_0"),  # a quantized K alone needs no fa
    BenchParams(n_threads=1, n_threads_batch=2, n_batch=8, n_ubatch=8),
    BenchParams(n_threads=1, n_batch=8, n_ubatch=8, op_offload=False),
    BenchParams(n_threads=1, n_batch=8, n_ubatch=8, n_cpu_moe=2),  # no experts in SmolLM2: no effect
], ids=["fa-on", "fa-auto", "kv-q8_0", "k-q4_0", "threads-batch", "no-op-offload", "n-cpu-moe"])
def test_each_new_dimension_runs_in_llama_cpp(model_info, params):
    result = measure(_spec(model_info, params, Workload(n_prompt=16, n_gen=4, reps=1, depth=32)))
    assert result.ok, result.error
    assert result.pp.median > 0 and result.tg.median > 0


def test_a_quantized_v_without_flash_attention_is_a_bad_config(model_info, local_fingerprint):
    params = BenchParams(n_threads=1, n_batch=8, n_ubatch=8, type_v="q8_0", flash_attn="off")
    result = measure(_spec(model_info, params))
    assert not result.ok and result.kind is FailureKind.BAD_CONFIG and "-fa on" in result.error
    with pytest.raises(BadInput, match="needs flash attention on"):
        check_on_node(params, local_fingerprint, model_info)


def test_depth_slows_generation(model_info):
    """tg after 2,048 tokens already in the KV cache reads a cache as large as a sixth of the
    weights per token and attends over all of it: measurably slower than at depth 0. The measuring
    process also checks, after every repetition, that the cache holds depth + the test's tokens."""
    params = BenchParams(n_threads=1, n_batch=512, n_ubatch=512)

    def tg(depth: int) -> float:
        result = measure(_spec(model_info, params, Workload(n_prompt=0, n_gen=32, reps=3, depth=depth),
                               timeout_s=300))
        assert result.ok, result.error
        return result.tg.median

    shallow, deep = tg(0), tg(2048)
    assert deep < 0.9 * shallow, (shallow, deep)


def test_depth_must_fit_the_models_context(model_info):
    validate_workload(Workload(n_prompt=512, n_gen=128, depth=4096), model_info)
    with pytest.raises(BadInput, match="depth 8000"):
        validate_workload(Workload(n_prompt=512, n_gen=128, depth=8000), model_info)
    with pytest.raises(BadInput, match="depth -1"):
        validate_workload(Workload(depth=-1), model_info)


def test_a_cpu_only_measurement_turns_op_offload_off_on_a_gpu_backend():
    from workers.bench import cpu_only
    from workers.hardware import Fingerprint

    gpu = Fingerprint(None, "x", None, 16, 16, 16, 0, None, None, None, None, None, "cuda", True)
    cpu = dataclasses.replace(gpu, backend="cpu", gpu_offload=False)
    assert cpu_only(BenchParams(n_threads=4), gpu).op_offload is False
    assert cpu_only(BenchParams(n_threads=4), gpu, keep_op_offload=True).op_offload is True
    assert cpu_only(BenchParams(n_threads=4), cpu).op_offload is True  # nothing to offload to
    assert cpu_only(BenchParams(n_gpu_layers=3, n_threads=4), gpu).op_offload is True


def test_the_measuring_process_sees_packages_that_only_the_parents_sys_path_has(tmp_path, monkeypatch):
    """On a machine whose packages sit in a PYTHONPATH folder (no installer there), the isolated
    child must still import them; a folder named like the package in the working directory must
    not stand in for it."""
    import subprocess
    import sys

    from workers.bench import CHILD_PATH_BOOT, child_env

    extra = tmp_path / "site"
    extra.mkdir()
    (extra / "ft_probe_mod.py").write_text("VALUE = 42\n")
    cwd = tmp_path / "cwd"
    (cwd / "workers").mkdir(parents=True)
    (cwd / "workers" / "__init__.py").write_text("raise SystemExit('the working directory was imported')\n")
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", [str(extra), "", str(cwd), *sys.path])
    from pathlib import Path

    import workers

    root = str(Path(workers.__file__).resolve().parent.parent)
    code = CHILD_PATH_BOOT + "import ft_probe_mod, workers.trial; print(ft_probe_mod.VALUE, workers.__file__)"
    out = subprocess.run([sys.executable, "-I", "-c", code, root], capture_output=True, text=True,
                         env=child_env(), check=True).stdout.split()
    assert out[0] == "42" and out[1].startswith(root)
