"""The referee of the served trial: workers/loadgen.py and a maintained load generator on one llama-server.

Issue 22's done-when: "the same server config under the same load measured by fleettune and by a
maintained load tool agree on TTFT and ITL p50/p90 within 5 %". This script starts llama-server
itself (``workers.llamatools.find_tool``; ``-m MODEL --host 127.0.0.1 --port P -np N -c C
--metrics``), waits for ``/health``, then runs the same closed-loop load (``--users`` users,
``--prompt`` tokens in, ``--gen`` out with ``ignore_eos``, ``--requests`` measured after one
warm-up request per user) alternately with workers/loadgen.run_load and with the referee, in
``--rounds`` interleaved rounds against the one running server (ABBA order: loadgen first in even
rounds, the referee first in odd ones, so a drift in the machine's speed is shared). Each round
draws new prompts (a new seed for both tools), so no round hits the prompt cache of the one
before. It prints TTFT and ITL p50/p90 of each tool per round, then the median over rounds of each
figure, its range, the ratio loadgen / referee, and whether every ratio is within 5 %. Beside each
load it shows the client's CPU seconds (the referee's in a cpuacct cgroup, every process it starts),
llama-server's CPU seconds and its own decode time per token (from /metrics): what the server did
while each tool measured it, so a tool whose own CPU slows the server on a small machine shows it.
``--server-cpus 1`` gives llama-server CPU 1 alone and both tools (this script and every process it
starts) the others, so that neither tool's CPU takes the server's. llama-server
is always stopped at the end (terminated, then killed), on an error or a SIGTERM/SIGINT/SIGHUP too.

Both tools define the figures as AIPerf does: TTFT from sending to the first generated text, ITL
per request ``(e2e - ttft) / (tokens - 1)`` with the server's own token count, percentiles over
requests with linear interpolation.

The referee is AIPerf (docs/serving.md, "Load generator and its referee", says why: servebench came
closer to the fake server's known timing at less CPU, but against llama-server it failed 19 of 40
requests, reusing connections that llama-server closes after every streamed answer; AIPerf can be
told not to, ``--connection-reuse-strategy never``). It lives in its own virtual environment, never
the project's, and needs a Hugging Face tokenizer to synthesise prompts: rebuilt from the model's
GGUF by bench/gguf_tokenizer.py (no hub offline), into a temporary folder when ``--tokenizer`` is
not given (then the referee's environment needs ``gguf`` too):

    python3 -m venv /tmp/ref/venv-aiperf
    /tmp/ref/venv-aiperf/bin/pip install aiperf==0.13.0 gguf
    /tmp/ref/venv-aiperf/bin/python bench/gguf_tokenizer.py MODEL.gguf /tmp/ref/smollm2-tokenizer
    PYTHONPATH=. .venv/bin/python bench/served_referee.py --aiperf /tmp/ref/venv-aiperf/bin/aiperf \
        --tokenizer /tmp/ref/smollm2-tokenizer --rounds 5 --server-arg=-t --server-arg=1 --out served-referee.json

llama-server is given ``--alias smollm2`` so that the model name every tool sends is the one it
lists (servebench refuses a model the server does not list). ``--referee servebench --servebench
PATH`` runs servebench instead (``pip install servebench``), to see its failures for yourself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workers.llamatools import find_tool, identity  # noqa: E402 - after the path fix above
from workers.loadgen import LoadSpec, run_load, scrape_metrics  # noqa: E402
from workers.slo import figures as slo_figures  # noqa: E402
from workers.slo import parse_slo  # noqa: E402

FIGURES = ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90")  # milliseconds
AGREE = 0.05
MODEL_NAME = "smollm2"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gguf_vocab_size(path: str) -> int:
    from workers.models import open_gguf  # noqa: PLC0415

    reader = open_gguf(path)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


CGROUP = Path("/sys/fs/cgroup/cpuacct")


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc (0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_counted(argv: list[str], timeout_s: float) -> tuple[subprocess.CompletedProcess, float | None]:
    """Run a command; its CPU seconds with every process it starts (a cgroup-v1 cpuacct group where
    /sys/fs/cgroup/cpuacct is writable, else the waited children's rusage)."""
    group: Path | None = CGROUP / f"fleettune-referee-{os.getpid()}-{time.monotonic_ns()}"
    try:
        group.mkdir()
    except OSError:
        group = None
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wrapped = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(group), *argv] if group else argv
    try:
        done = subprocess.run(wrapped, capture_output=True, text=True, timeout=timeout_s, check=False)
    finally:
        if group is not None:  # what the tool left behind (its own processes), even when stopped by a signal
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
    if group is None:
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    end = time.monotonic() + 10
    while (group / "cgroup.procs").read_text().strip() and time.monotonic() < end:
        time.sleep(0.05)  # killed stragglers leaving the group
    cpu = int((group / "cpuacct.usage").read_text()) / 1e9
    with contextlib.suppress(OSError):
        group.rmdir()
    return done, cpu


class LlamaServer:
    """One llama-server process, stopped whatever happens."""

    def __init__(self, binary: str, model: str, port: int, slots: int, ctx: int, log: Path,
                 extra: list[str], cpus: set[int] | None = None) -> None:
        self.argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
                     "-c", str(ctx), "--metrics", "--alias", MODEL_NAME, *extra]
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("w") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)

    def wait_healthy(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited (rc {self.proc.returncode}); log {self.log}:\n"
                                 + self.log.read_text(errors="replace")[-2000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)  # polling a starting server's /health (a script, not a test)
        raise SystemExit(f"llama-server not healthy after {timeout_s:g} s; log {self.log}")

    def props(self) -> dict:
        try:
            with urllib.request.urlopen(self.url + "/props", timeout=10) as response:
                return json.load(response)
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(20)


def loadgen_round(url: str, args: argparse.Namespace, seed: int, vocab: int) -> dict:
    spec = LoadSpec(prompt_tokens=args.prompt, gen_tokens=args.gen, concurrency=args.users,
                    max_requests=args.requests, max_s=args.max_s, seed=seed, vocab_size=vocab,
                    request_timeout_s=args.max_s)
    cpu = time.process_time()
    result = run_load(url, spec, model=MODEL_NAME)
    cpu = time.process_time() - cpu
    fig = slo_figures(result.records, parse_slo("ttft_p90=1000s"))
    out = {name: 1000 * fig.percentiles[name] if fig.percentiles[name] is not None else None for name in FIGURES}
    out.update(requests=fig.requests, failed=fig.failed, wall_s=result.wall_s, client_cpu_s=cpu,
               errors=sorted({r.error for r in result.records if r.error}))
    return out


def aiperf_round(url: str, args: argparse.Namespace, seed: int, work: Path) -> dict:
    out_dir = work / f"aiperf-{seed}"
    argv = [args.aiperf, "profile", "--model", MODEL_NAME, "--url", url, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", args.tokenizer, "--use-server-token-count",
            "--concurrency", str(args.users), "--request-count", str(args.requests),
            "--warmup-request-count", str(args.users), "--isl", str(args.prompt), "--isl-stddev", "0",
            "--osl", str(args.gen), "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
            "--random-seed", str(seed), "--ui-type", "none", "--output-artifact-dir", str(out_dir),
            # llama-server closes a connection after each streamed answer; a pooled one fails the next request
            "--connection-reuse-strategy", "never"]
    started = time.monotonic()
    done, cpu = run_counted(argv, args.max_s + 300)
    wall = time.monotonic() - started
    try:
        data = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    except (OSError, ValueError):
        raise SystemExit(f"aiperf failed (rc {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}") from None
    ttft, itl = data["time_to_first_token"], data["inter_token_latency"]
    errors = data.get("error_summary") or []
    return {"ttft_p50": ttft["p50"], "ttft_p90": ttft["p90"], "itl_p50": itl["p50"], "itl_p90": itl["p90"],
            "requests": int(data["request_count"]["avg"]), "failed": sum(e.get("count", 0) for e in errors),
            "wall_s": wall, "client_cpu_s": cpu, "errors": [str(e) for e in errors]}


def servebench_round(url: str, args: argparse.Namespace, seed: int, work: Path) -> dict:
    out = work / f"servebench-{seed}.json"
    # servebench appends "/completions" to its URL: without /v1 that is llama-server's native endpoint
    argv = [args.servebench, "run", "--url", url + "/v1", "--model", MODEL_NAME, "--concurrency", str(args.users),
            "--num-requests", str(args.requests), "--input-len", str(args.prompt), "--output-len", str(args.gen),
            "--endpoint", "completions", "--warmup", str(args.users), "--no-gpu", "--seed", str(seed),
            "--out", str(out)]
    started = time.monotonic()
    done, cpu = run_counted(argv, args.max_s + 300)
    wall = time.monotonic() - started
    try:
        summary = json.loads(out.read_text())["levels"][0]["summary"]
    except (OSError, ValueError, KeyError, IndexError):
        raise SystemExit(f"servebench failed (rc {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}") from None
    # servebench's TPOT is AIPerf's ITL ((e2e - ttft) / (tokens - 1) per request)
    return {"ttft_p50": 1000 * summary["ttft"]["p50"], "ttft_p90": 1000 * summary["ttft"]["p90"],
            "itl_p50": 1000 * summary["tpot"]["p50"], "itl_p90": 1000 * summary["tpot"]["p90"],
            "requests": summary["completed"], "failed": summary["failed"], "wall_s": wall, "client_cpu_s": cpu,
            "errors": sorted(summary.get("errors") or {})}


def server_ms_per_token(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The server's own decode time per generated token over one load, from its /metrics
    (tokens_predicted_seconds_total sums each slot's decode time): how fast it ran, whoever measured."""
    key_s, key_n = "llamacpp:tokens_predicted_seconds_total", "llamacpp:tokens_predicted_total"
    if not all(k in d for d in (before, after) for k in (key_s, key_n)):
        return None
    tokens = after[key_n] - before[key_n]
    return 1000 * (after[key_s] - before[key_s]) / tokens if tokens > 0 else None


def against_server(rounds: list[dict], referee: str) -> dict:
    """Per tool, medians over rounds: the server's own decode time per token while the tool measured,
    the tool's ITL p50 over it, and the tool's own CPU in cores (CPU seconds over wall seconds)."""
    out = {}
    for tool in ("loadgen", referee):
        loads = [r[tool] for r in rounds]
        ratios = [x["itl_p50"] / x["server_ms_per_token"] for x in loads
                  if x.get("itl_p50") and x.get("server_ms_per_token")]
        if not ratios:
            continue
        cores = [x["client_cpu_s"] / x["wall_s"] for x in loads if x.get("client_cpu_s") is not None]
        out[tool] = {"itl_p50_over_server_ms_per_token": statistics.median(ratios),
                     "server_ms_per_token": statistics.median(x["server_ms_per_token"] for x in loads
                                                              if x.get("server_ms_per_token")),
                     "client_cores": statistics.median(cores) if cores else None}
    return out


def show(value: float | None) -> str:
    return "-" if value is None else f"{value:8.2f}"


def summary(rounds: list[dict], referee: str) -> dict:
    out: dict = {}
    for name in FIGURES:
        ours = [r["loadgen"][name] for r in rounds if r["loadgen"][name] is not None]
        theirs = [r[referee][name] for r in rounds if r[referee][name] is not None]
        paired = [r["loadgen"][name] / r[referee][name] for r in rounds
                  if r["loadgen"][name] is not None and r[referee][name]]
        mine, ref = statistics.median(ours), statistics.median(theirs)
        ratio = mine / ref
        out[name] = {"loadgen_median": mine, "loadgen_range": [min(ours), max(ours)], "referee_median": ref,
                     "referee_range": [min(theirs), max(theirs)], "ratio": ratio,
                     "paired_ratio_median": statistics.median(paired),
                     "paired_ratio_range": [min(paired), max(paired)], "agree": abs(ratio - 1) <= AGREE}
    return out


def cpu_list(text: str) -> set[int]:
    """--server-cpus: CPU numbers, comma-separated, at least one left for the clients."""
    try:
        cpus = {int(part) for part in text.split(",")}
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: CPU numbers, e.g. 1 or 2,3") from error
    if not cpus < os.sched_getaffinity(0):
        raise argparse.ArgumentTypeError(f"{text!r}: must be some, not all, of this process's CPUs "
                                         f"{sorted(os.sched_getaffinity(0))}")
    return cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file (default: SmolLM2-135M, fetched like `fleettune model fetch`)")
    parser.add_argument("--slots", type=int, default=4, help="llama-server -np")
    parser.add_argument("--ctx", type=int, default=4096, help="llama-server -c")
    parser.add_argument("--server-arg", action="append", default=[], help="one more llama-server argument")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--requests", type=int, default=40, help="measured requests per tool per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-s", type=float, default=600, help="time bound of one load")
    parser.add_argument("--referee", choices=("aiperf", "servebench"), default="aiperf")
    parser.add_argument("--aiperf", default="/tmp/ref/venv-aiperf/bin/aiperf")
    parser.add_argument("--servebench", default="/tmp/ref/venv-servebench/bin/servebench")
    parser.add_argument("--tokenizer", help="Hugging Face tokenizer folder for AIPerf (default: rebuilt from the GGUF)")
    parser.add_argument("--out", type=Path, help="write every round and the summary as JSON")
    parser.add_argument("--server-cpus", type=cpu_list, help="CPUs for llama-server alone (0 or 1,2); both load "
                        "tools, this script and everything they start then run on the other CPUs")
    args = parser.parse_args()
    if args.rounds < 1 or args.requests < 1 or args.users < 1:
        raise SystemExit("--rounds, --requests and --users must be >= 1")

    binary = find_tool("llama-server")
    if binary is None:
        raise SystemExit("llama-server not found: `fleettune tools build` (Linux) or `brew install llama.cpp` (Mac)")
    if args.model is None:
        from workers.models import fetch_known_model  # noqa: PLC0415
        from workers.paths import data_dir  # noqa: PLC0415

        args.model = str(fetch_known_model("smollm2-135m", data_dir() / "models"))
    work = Path(tempfile.mkdtemp(prefix="served-referee-"))
    if args.referee == "aiperf" and not args.tokenizer:
        python = str(Path(args.aiperf).parent / "python")
        args.tokenizer = str(work / "tokenizer")
        subprocess.run([python, str(ROOT / "bench" / "gguf_tokenizer.py"), args.model, args.tokenizer], check=True,
                       timeout=300)
    vocab = gguf_vocab_size(args.model)
    run_referee = {"aiperf": aiperf_round, "servebench": servebench_round}[args.referee]
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")

    def stop_on_signal(signum: int, frame: object) -> None:
        raise SystemExit(f"stopped by signal {signum}")  # so the finally below stops llama-server

    signal.signal(signal.SIGTERM, stop_on_signal)
    signal.signal(signal.SIGHUP, stop_on_signal)
    server = LlamaServer(binary, args.model, free_port(), args.slots, args.ctx, work / "llama-server.log",
                         args.server_arg, cpus=args.server_cpus)
    if args.server_cpus:  # the clients (this process and every tool it starts) on the CPUs the server does not use
        os.sched_setaffinity(0, os.sched_getaffinity(0) - args.server_cpus)
    rounds: list[dict] = []
    try:
        server.wait_healthy()
        build = identity(binary)
        print(f"llama-server {build} ({' '.join(server.argv)})\nCPU: {cpu}; referee: {args.referee}; "
              f"{args.users} users, prompt {args.prompt}, gen {args.gen}, {args.requests} requests a load", flush=True)
        print(f"{'round':>5} {'tool':>10} " + " ".join(f"{n + ' ms':>10}" for n in FIGURES)
              + "  requests failed wall_s client_cpu_s server_cpu_s server_ms/token")
        for i in range(args.rounds):
            seed = 1000 + i
            order = ["loadgen", args.referee] if i % 2 == 0 else [args.referee, "loadgen"]
            row: dict = {"round": i, "order": order}
            for tool in order:
                server_cpu, before = proc_cpu_s(server.proc.pid), scrape_metrics(server.url)
                if tool == "loadgen":
                    row[tool] = loadgen_round(server.url, args, seed, vocab)
                else:
                    row[tool] = run_referee(server.url, args, seed, work)
                r = row[tool]
                r["server_cpu_s"] = proc_cpu_s(server.proc.pid) - server_cpu
                r["server_ms_per_token"] = server_ms_per_token(before, scrape_metrics(server.url))
                print(f"{i:>5} {tool:>10} " + " ".join(f"{show(r[n]):>10}" for n in FIGURES)
                      + f"  {r['requests']:>8} {r['failed']:>6} {r['wall_s']:6.1f} {r['client_cpu_s']:12.1f}"
                      + f" {r['server_cpu_s']:12.1f} {show(r['server_ms_per_token']):>12}"
                      + (f"  errors: {r['errors'][:3]}" if r["errors"] else ""), flush=True)
            rounds.append(row)
        metrics = scrape_metrics(server.url)
        props = server.props()
    finally:
        server.stop()

    result = summary(rounds, args.referee)
    print(f"\nmedian of {args.rounds} rounds (range), loadgen / {args.referee}:")
    for name, s in result.items():
        print(f"  {name:>8}: loadgen {s['loadgen_median']:.2f} ms ({s['loadgen_range'][0]:.2f}-"
              f"{s['loadgen_range'][1]:.2f}), {args.referee} {s['referee_median']:.2f} ms "
              f"({s['referee_range'][0]:.2f}-{s['referee_range'][1]:.2f}), ratio {s['ratio']:.3f} "
              f"(paired per round: median {s['paired_ratio_median']:.3f}, {s['paired_ratio_range'][0]:.3f}-"
              f"{s['paired_ratio_range'][1]:.3f}) {'agree' if s['agree'] else 'DISAGREE'} within {AGREE:.0%}")
    agree = all(s["agree"] for s in result.values())
    print(f"all four within {AGREE:.0%}: {'yes' if agree else 'no'}")
    against = against_server(rounds, args.referee)
    for tool, a in against.items():
        print(f"  {tool:>10}: llama-server's own decode time per token while it measured "
              f"{a['server_ms_per_token']:.2f} ms (median of rounds); its ITL p50 / that "
              f"{a['itl_p50_over_server_ms_per_token']:.3f}; its own CPU {show(a['client_cores'])} cores")
    if args.out:
        args.out.write_text(json.dumps({
            "server_argv": server.argv, "server_cpus": sorted(args.server_cpus or ()), "build": build, "cpu": cpu,
            "referee": args.referee,
            "workload": {"users": args.users, "prompt": args.prompt, "gen": args.gen, "requests": args.requests},
            "rounds": rounds, "summary": result, "agree": agree, "against_server": against,
            "server_metrics": metrics, "server_props": {k: props.get(k) for k in ("total_slots", "build_info")}},
            indent=1))
    print(f"files: {work}")


if __name__ == "__main__":
    main()
