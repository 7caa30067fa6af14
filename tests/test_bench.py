"""One trial measured for real with llama.cpp, and every way a trial can fail without killing us."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import TINY
from workers.bench import _describe_exit, measure, validate_params, validate_workload
from workers.errors import BadInput
from workers.trial import BenchParams, FailureKind, Stats, TrialSpec, Workload


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
    spec = dataclasses.replace(_spec(model_info), model_path=str(broken))
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
        validate_params(params, local_fingerprint, model_info)


def test_ngl_beyond_the_model_is_rejected(model_info):
    from workers.hardware import Fingerprint

    gpu = Fingerprint(None, "x", None, 8, 4, 12, 38, None, None, None, None, None, "metal", True)
    validate_params(BenchParams(n_gpu_layers=31, n_threads=1), gpu, model_info)  # 30 layers + output
    with pytest.raises(BadInput, match="0..31"):
        validate_params(BenchParams(n_gpu_layers=32, n_threads=1), gpu, model_info)


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
