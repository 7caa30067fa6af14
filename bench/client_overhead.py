"""Load generators against the fake server with known timing: their error against the truth and their own CPU cost.

Issue 22 item 1 asks to measure the maintained load generators' own overhead on a 2-core machine
before choosing one. Each tool sends the same closed-loop workload (prompts of ``--prompt`` tokens,
``--gen`` tokens out, streamed, ``/v1/completions``) to bench/fake_openai_server.py, which writes
the first token ``--ttft`` s after a request arrives and the rest every ``--itl`` s, and records
when it actually wrote each (its /stats). For each tool and concurrency:

- **error against the truth**: the tool's reported mean TTFT (and p50) and mean ITL minus the
  server's own figures for the same requests (first token written minus arrival; (last - first) /
  (tokens - 1)), so the server's lateness under load is not charged to the client;
- **CPU per request**: the tool's CPU time, every process it starts included, counted by a cgroup-v1
  ``cpuacct`` group made for the run (/sys/fs/cgroup/cpuacct must be writable; else only the whole
  run's CPU, from the children's rusage). The group's usage is sampled every 50 ms beside the
  server's count of completed requests; the steady cost is the CPU spent between 10 % and 90 % of
  the completions divided by the requests completed in between (start-up, imports, tokenizer
  loading and the final report left out). The whole run's CPU per request and the CPU spent before
  the first completion (start-up) are reported beside it.

Each tool lives in its own virtual environment under ``--venvs`` (never the project's):

    for t in aiperf guidellm servebench; do python3 -m venv /tmp/ref/venv-$t; /tmp/ref/venv-$t/bin/pip install $t; done
    python3.12 -m venv /tmp/ref/venv-inference-perf; /tmp/ref/venv-inference-perf/bin/pip install inference-perf

and those that tokenize (AIPerf, GuideLLM, inference-perf) are given a local Hugging Face tokenizer
directory (``--tokenizer``; no hub here: one rebuilt from SmolLM2's GGUF will do, the fake server's
token text " the" is one token in it). ``loadgen`` is workers/loadgen.py, run in a subprocess like
the others.

    PYTHONPATH=. python bench/client_overhead.py --venvs /tmp/ref --tokenizer /tmp/ref/smollm2-tokenizer \\
        --concurrency 1,8,32 --out /tmp/ref/overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.serve_load import stop_process  # noqa: E402 (after the path is set)

FAKE = ROOT / "bench" / "fake_openai_server.py"
CGROUP = Path("/sys/fs/cgroup/cpuacct")
MODEL = "smollm2"


@dataclass
class Workload:
    url: str
    concurrency: int
    requests: int
    prompt: int
    gen: int
    tokenizer: str
    venvs: Path
    work: Path


@dataclass
class Reported:
    ttft_mean_ms: float | None
    ttft_p50_ms: float | None
    itl_mean_ms: float | None
    ok: int | None = None


# -- the fake server


class FakeServer:
    def __init__(self, ttft: float, itl: float) -> None:
        self.proc = subprocess.Popen([sys.executable, str(FAKE), "--port", "0", "--ttft", str(ttft), "--itl", str(itl),
                                      "--model", MODEL], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        if "listening on " not in line:
            self.stop()
            raise SystemExit(f"the fake server did not start: {line!r}")
        self.url = line.split("listening on ", 1)[1].strip()

    def call(self, path: str, data: bytes | None = None) -> dict:
        with urllib.request.urlopen(urllib.request.Request(self.url + path, data=data), timeout=30) as response:
            return json.load(response)

    def reset(self) -> None:
        self.call("/stats/reset", b"{}")

    def truth(self) -> dict:
        log = [e for e in self.call("/stats")["log"] if e["first"] is not None and e["tokens"] > 1]
        ttft = [1000 * (e["first"] - e["arrived"]) for e in log]
        itl = [1000 * (e["last"] - e["first"]) / (e["tokens"] - 1) for e in log]
        return {"requests": len(log), "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
                "ttft_p50_ms": statistics.median(ttft) if ttft else None,
                "itl_mean_ms": statistics.fmean(itl) if itl else None}

    def completed(self) -> int:
        return self.call("/count")["completed"]

    def stop(self) -> None:
        stop_process(self.proc)


# -- CPU of a command and everything it starts


def steady_cpu(samples: list[tuple[int, float]], total: int) -> float | None:
    """CPU seconds per completed request while the load ran: between the samples where 10 % and 90 %
    of the requests had completed (start-up, the first wave's connections and the final report left
    out)."""
    low, high = max(1, round(0.1 * total)), max(2, round(0.9 * total))
    first = next((s for s in samples if s[0] >= low), None)
    last = next((s for s in samples if s[0] >= high), None)
    if first is None or last is None or last[0] <= first[0]:
        return None
    return (last[1] - first[1]) / (last[0] - first[0])


def run_measured(argv: list[str], log: Path, timeout_s: float, env: dict | None,
                 completed: Callable[[], int]) -> dict:
    """Run a command; its CPU seconds (and its descendants'), exit code, and CPU samples against the
    server's completed requests (cgroup only: the group's usage is readable while it runs)."""
    group: Path | None = CGROUP / f"fleettune-ref-{os.getpid()}-{time.monotonic_ns()}"
    try:
        group.mkdir()
    except OSError:
        group = None
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    samples: list[tuple[int, float]] = []
    first_request_cpu = None
    with log.open("w") as out:
        if group is not None:
            wrapped = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), *argv]
        else:
            wrapped = argv
        proc = subprocess.Popen(wrapped, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        rc = None
        while rc is None:
            if group is not None:
                usage = int((group / "cpuacct.usage").read_text()) / 1e9
                done = completed()
                samples.append((done, usage))
                if first_request_cpu is None and done > 0:
                    first_request_cpu = usage
            try:
                rc = proc.wait(0.05)  # the sampling period
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
                    rc = -9
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if group is None:
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return {"cpu_s": cpu, "rc": rc, "counted_by": "rusage of waited children", "samples": []}
    for pid in (group / "cgroup.procs").read_text().split():  # stragglers the tool left (its own processes)
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    end = time.monotonic() + 10
    while (group / "cgroup.procs").read_text().strip() and time.monotonic() < end:
        select.select([], [], [], 0.05)  # waiting for killed stragglers to leave the group
    cpu = int((group / "cpuacct.usage").read_text()) / 1e9
    with contextlib.suppress(OSError):
        group.rmdir()
    return {"cpu_s": cpu, "rc": rc, "counted_by": "cgroup cpuacct", "samples": samples,
            "cpu_before_first_completion_s": first_request_cpu}


# -- the tools: a command and a parser of what it reported


def _venv_bin(w: Workload, tool: str, name: str) -> str:
    return str(w.venvs / f"venv-{tool}" / "bin" / name)


def loadgen_cmd(w: Workload, out: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--run-loadgen", w.url, str(w.concurrency), str(w.requests),
            str(w.prompt), str(w.gen), str(out / "loadgen.json")]


def loadgen_parse(out: Path) -> Reported:
    data = json.loads((out / "loadgen.json").read_text())
    return Reported(data["ttft_mean_ms"], data["ttft_p50_ms"], data["itl_mean_ms"], data["ok"])


def aiperf_cmd(w: Workload, out: Path) -> list[str]:
    return [_venv_bin(w, "aiperf", "aiperf"), "profile", "--model", MODEL, "--url", w.url, "--endpoint-type",
            "completions", "--streaming", "--tokenizer", w.tokenizer, "--use-server-token-count",
            "--concurrency", str(w.concurrency), "--request-count", str(w.requests), "--isl", str(w.prompt),
            "--isl-stddev", "0", "--osl", str(w.gen), "--extra-inputs", "ignore_eos:true",
            "--extra-inputs", "temperature:0", "--ui-type", "none", "--output-artifact-dir", str(out / "aiperf")]


def aiperf_parse(out: Path) -> Reported:
    data = json.loads((out / "aiperf" / "profile_export_aiperf.json").read_text())
    ttft, itl = data["time_to_first_token"], data["inter_token_latency"]
    return Reported(ttft["avg"], ttft["p50"], itl["avg"], int(data["request_count"]["avg"]))


def guidellm_cmd(w: Workload, out: Path) -> list[str]:
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": w.url, "model": MODEL, "request_format": "/v1/completions",
                    "extras": {"body": {"ignore_eos": True, "temperature": 0}}},
        "profile": {"kind": "concurrent", "streams": [w.concurrency]},
        "data": [{"kind": "synthetic_text", "prompt_tokens": w.prompt, "output_tokens": w.gen}],
        "tokenizer": {"kind": "huggingface_auto", "model": w.tokenizer},
        "constraints": [{"kind": "max_requests", "count": w.requests}],
        "outputs": [{"kind": "json", "path": str(out / "guidellm.json")}]}}
    path = out / "guidellm-scenario.json"
    path.write_text(json.dumps(scenario))
    return [_venv_bin(w, "guidellm", "guidellm"), "run", "--scenario", str(path), "--disable-progress"]


def guidellm_parse(out: Path) -> Reported:
    metrics = json.loads((out / "guidellm.json").read_text())["benchmarks"][0]["metrics"]
    ttft, itl = metrics["time_to_first_token_ms"]["successful"], metrics["inter_token_latency_ms"]["successful"]
    return Reported(ttft["mean"], ttft["median"], itl["mean"], ttft["count"])


def servebench_cmd(w: Workload, out: Path) -> list[str]:
    return [_venv_bin(w, "servebench", "servebench"), "run", "--url", w.url, "--model", MODEL, "--concurrency",
            str(w.concurrency), "--num-requests", str(w.requests), "--input-len", str(w.prompt), "--output-len",
            str(w.gen), "--endpoint", "completions", "--warmup", "0", "--no-gpu", "--seed", "1",
            "--out", str(out / "servebench.json")]


def servebench_parse(out: Path) -> Reported:
    summary = json.loads((out / "servebench.json").read_text())["levels"][0]["summary"]
    # servebench's TPOT is AIPerf's ITL, (e2e - ttft) / (tokens - 1) per request; its "itl" is per chunk
    return Reported(1000 * summary["ttft"]["mean"], 1000 * summary["ttft"]["p50"], 1000 * summary["tpot"]["mean"],
                    summary["completed"])


def inference_perf_cmd(w: Workload, out: Path) -> list[str]:
    total = max(w.requests, 64)
    config = {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "random",
                 "input_distribution": {"min": w.prompt, "max": w.prompt, "mean": w.prompt, "std_dev": 0,
                                        "total_count": total},
                 "output_distribution": {"min": w.gen, "max": w.gen, "mean": w.gen, "std_dev": 0,
                                         "total_count": total}},
        "load": {"type": "concurrent", "stages": [{"num_requests": w.requests, "concurrency_level": w.concurrency}]},
        "server": {"type": "vllm", "model_name": MODEL, "base_url": w.url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": w.tokenizer},
        "storage": {"local_storage": {"path": str(out / "inference-perf")}},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False, "per_request": False,
                                         "use_server_output_tokens": True}}}
    path = out / "inference-perf.yaml"  # written as JSON, which YAML reads
    path.write_text(json.dumps(config))
    return [_venv_bin(w, "inference-perf", "inference-perf"), "-c", str(path)]


def inference_perf_parse(out: Path) -> Reported:
    data = json.loads((out / "inference-perf" / "summary_lifecycle_metrics.json").read_text())
    latency = data["successes"]["latency"]
    # inference-perf's time_per_output_token is (e2e - ttft) / (tokens - 1): AIPerf's ITL
    return Reported(1000 * latency["time_to_first_token"]["mean"], 1000 * latency["time_to_first_token"]["median"],
                    1000 * latency["time_per_output_token"]["mean"], data["successes"].get("count"))


TOOLS: dict[str, tuple[Callable[[Workload, Path], list[str]], Callable[[Path], Reported], str]] = {
    "loadgen": (loadgen_cmd, loadgen_parse, ""),
    "aiperf": (aiperf_cmd, aiperf_parse, "aiperf"),
    "guidellm": (guidellm_cmd, guidellm_parse, "guidellm"),
    "servebench": (servebench_cmd, servebench_parse, "servebench"),
    "inference-perf": (inference_perf_cmd, inference_perf_parse, "inference-perf"),
}


def tool_version(venvs: Path, tool: str) -> str:
    if tool == "loadgen":
        return "this checkout"
    pip = venvs / f"venv-{tool}" / "bin" / "pip"
    if not pip.exists():
        return "not installed"
    shown = subprocess.run([str(pip), "show", tool], capture_output=True, text=True, timeout=120).stdout
    return next((line.split(":", 1)[1].strip() for line in shown.splitlines() if line.startswith("Version:")), "?")


def one_run(server: FakeServer, tool: str, w: Workload, timeout_s: float) -> dict:
    build, parse, _ = TOOLS[tool]
    out = Path(tempfile.mkdtemp(prefix=f"{tool}-c{w.concurrency}-n{w.requests}-", dir=w.work))
    server.reset()
    argv = build(w, out)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    started = time.monotonic()
    measured = run_measured(argv, out / "log.txt", timeout_s, env, server.completed)
    wall = time.monotonic() - started
    truth = server.truth()
    row = {"tool": tool, "concurrency": w.concurrency, "requests": w.requests, "rc": measured["rc"],
           "cpu_s": measured["cpu_s"], "wall_s": wall, "cpu_counted_by": measured["counted_by"],
           "steady_cpu_s_per_request": steady_cpu(measured["samples"], truth["requests"]),
           "cpu_before_first_completion_s": measured.get("cpu_before_first_completion_s"),
           "server_requests": truth["requests"], "truth": truth, "dir": str(out)}
    try:
        row["reported"] = vars(parse(out))
    except (OSError, KeyError, ValueError, IndexError, TypeError) as exc:
        tail = (out / "log.txt").read_text(errors="replace")[-600:]
        row["reported"] = None
        row["failure"] = f"{type(exc).__name__}: {exc}; log tail: {tail}"
    if measured["rc"] != 0 and not row.get("failure"):
        row["failure"] = f"exit code {measured['rc']}"
    return row


def summarise(run: dict) -> dict:
    rep, truth = run.get("reported"), run["truth"]

    def err(key: str) -> float | None:
        if not rep or rep.get(key) is None or truth.get(key) is None:
            return None
        return rep[key] - truth[key]

    return {"tool": run["tool"], "concurrency": run["concurrency"], "requests": run["requests"],
            "cpu_s": run["cpu_s"], "cpu_s_per_request": run["steady_cpu_s_per_request"],
            "cpu_s_per_request_overall": run["cpu_s"] / run["server_requests"] if run["server_requests"] else None,
            "startup_cpu_s": run["cpu_before_first_completion_s"], "truth": truth, "reported": rep,
            "ttft_mean_error_ms": err("ttft_mean_ms"), "ttft_p50_error_ms": err("ttft_p50_ms"),
            "itl_mean_error_ms": err("itl_mean_ms"), "failure": run.get("failure")}


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict], versions: dict[str, str]) -> str:
    lines = ["| tool | version | users | requests | TTFT mean, truth (ms) | TTFT mean error (ms) "
             "| TTFT p50 error (ms) | ITL mean, truth (ms) | ITL mean error (ms) | CPU s/request (steady) "
             "| CPU s/request (whole run) | CPU s before the first completion |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        t = r["truth"]
        lines.append(f"| {r['tool']} | {versions.get(r['tool'], '?')} | {r['concurrency']} | {r['requests']} | "
                     f"{fmt(t.get('ttft_mean_ms'), '.2f')} | {fmt(r['ttft_mean_error_ms'], '+.2f')} | "
                     f"{fmt(r['ttft_p50_error_ms'], '+.2f')} | {fmt(t.get('itl_mean_ms'), '.3f')} | "
                     f"{fmt(r['itl_mean_error_ms'], '+.3f')} | {fmt(r['cpu_s_per_request'], '.4f')} | "
                     f"{fmt(r['cpu_s_per_request_overall'], '.3f')} | {fmt(r['startup_cpu_s'], '.1f')} |")
    return "\n".join(lines)


def request_count(concurrency: int) -> int:
    """Enough requests for a steady stretch: at least 30, and 6 waves of the users."""
    return max(30, 6 * concurrency)


def run_loadgen_child(argv: list[str]) -> None:
    """``--run-loadgen URL USERS REQUESTS PROMPT GEN OUT``: workers/loadgen.py as a tool like the others."""
    from workers.loadgen import LoadSpec, run_load  # noqa: PLC0415 - only in the child

    url, users, requests, prompt, gen, out = argv
    spec = LoadSpec(prompt_tokens=int(prompt), gen_tokens=int(gen), concurrency=int(users),
                    max_requests=int(requests), warmup_requests=0, max_s=600, vocab_size=49152)
    records = [r for r in run_load(url, spec, model=MODEL).records if r.ok]
    ttft = [1000 * r.ttft_s for r in records]
    itl = [1000 * r.itl_s for r in records if r.itl_s is not None]
    Path(out).write_text(json.dumps({"ok": len(records), "ttft_mean_ms": statistics.fmean(ttft),
                                     "ttft_p50_ms": statistics.median(ttft), "itl_mean_ms": statistics.fmean(itl)}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--run-loadgen":
        run_loadgen_child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venvs", type=Path, default=Path("/tmp/ref"))
    parser.add_argument("--tokenizer", default="/tmp/ref/smollm2-tokenizer")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--ttft", type=float, default=0.05)
    parser.add_argument("--itl", type=float, default=0.01)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per tool run")
    parser.add_argument("--out", type=Path, default=Path("client-overhead.json"))
    args = parser.parse_args()
    tools = args.tools.split(",")
    unknown = set(tools) - set(TOOLS)
    if unknown:
        raise SystemExit(f"unknown tools: {', '.join(sorted(unknown))}; known: {', '.join(TOOLS)}")
    versions = {t: tool_version(args.venvs, t) for t in tools}
    work = Path(tempfile.mkdtemp(prefix="client-overhead-"))
    rows, runs = [], []
    server = FakeServer(args.ttft, args.itl)
    try:
        for c in (int(x) for x in args.concurrency.split(",")):
            for tool in tools:
                if versions[tool] == "not installed":
                    rows.append({"tool": tool, "concurrency": c, "failure": "not installed"})
                    continue
                n = request_count(c)
                w = Workload(server.url, c, n, args.prompt, args.gen, args.tokenizer, args.venvs, work)
                run = one_run(server, tool, w, args.timeout)
                runs.append({k: v for k, v in run.items()})
                print(f"{tool} c={c} n={n}: rc {run['rc']}, cpu {run['cpu_s']:.2f} s "
                      f"(steady {run['steady_cpu_s_per_request']} s/request), wall {run['wall_s']:.1f} s, "
                      f"server saw {run['server_requests']}, reported {run.get('reported')}"
                      + (f" FAILED {run['failure'][:300]}" if run.get("failure") else ""), flush=True)
                rows.append(summarise(run))
    finally:
        server.stop()
    done = [r for r in rows if "truth" in r]
    text = table(done, versions)
    print(text)
    args.out.write_text(json.dumps({"versions": versions, "ttft_s": args.ttft, "itl_s": args.itl,
                                    "prompt": args.prompt, "gen": args.gen, "rows": rows, "runs": runs,
                                    "cpu": _cpu_model(), "table": text}, indent=1))
    print(f"each run's files: {work}")


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except OSError:
        return "?"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


if __name__ == "__main__":
    main()
