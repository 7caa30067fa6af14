"""Node configs are typed and validated on read as on write (issue 24 case 3, issue 21 item 2): a bad
file never stops the supervisor and never reaches a server's argv, `config show` names it in one
line, and the next write replaces it; the supervisor's status lives in a folder of its own."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from orchestrator.cli import main
from workers import nodeconfig, serve
from workers.errors import BadInput
from workers.nodeconfig import BadConfigFile, NodeConfig

NODE = "d1" * 16
OTHER = "d2" * 16


def payload(version: int = 1, **params) -> dict:
    return {"version": version, "rollout_id": version, "model_sha256": "b" * 64, "model_name": "m",
            "objective": "tg", "expected_tps": 10.0, "workload": {"n_prompt": 16, "n_gen": 8},
            "source": "recommendation",
            "params": {"n_gpu_layers": 0, "n_threads": 2, "n_batch": 64, "n_ubatch": 64, "flash_attn": False,
                       "n_threads_batch": None, **params}}


GOOD = json.dumps(payload())
BAD_FILES = {
    "truncated": GOOD[: len(GOOD) // 2],
    "empty": "",
    "list": json.dumps([payload()]),
    "no params": json.dumps({k: v for k, v in payload().items() if k != "params"}),
    "injected threads": GOOD.replace('"n_threads": 2', '"n_threads": "4 --host 0.0.0.0"'),
    "injected threads_batch": GOOD.replace('"n_threads_batch": null', '"n_threads_batch": "4 --host 0.0.0.0"'),
    "injected cpu moe": json.dumps(payload(n_cpu_moe="1 --host 0.0.0.0")),
    "unknown objective": GOOD.replace('"objective": "tg"', '"objective": "tg; rm -rf /"'),
}


@pytest.fixture(autouse=True)
def _clean():
    for node in (NODE, OTHER):
        nodeconfig.path_for(node).unlink(missing_ok=True)
        serve.status_path(node).unlink(missing_ok=True)
    yield
    for node in (NODE, OTHER):
        nodeconfig.path_for(node).unlink(missing_ok=True)
        serve.status_path(node).unlink(missing_ok=True)


def put(node: str, text: str) -> None:
    path = nodeconfig.path_for(node)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_config_round_trips_through_its_type():
    for data in (payload(), {k: v for k, v in payload().items() if k not in ("workload", "source")},
                 {**payload(3, type_k="q8_0", flash_attn="auto", n_cpu_moe=2, op_offload=False),
                  "source": "pin", "server": {"n_ctx": 4096, "n_parallel": 2}}):
        config = NodeConfig.from_dict(data)
        assert config.to_dict() == data
        assert config.objective.name == data["objective"] and config.bench_params.n_threads == 2
    assert NodeConfig.from_dict(payload()).origin == "recommendation"


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_a_bad_file_is_one_line_on_read_and_the_next_write_replaces_it(kind):
    put(NODE, BAD_FILES[kind])
    with pytest.raises(BadConfigFile) as caught:
        nodeconfig.load(NODE)
    assert "\n" not in str(caught.value) and NODE[:12] in str(caught.value)
    assert nodeconfig.read(NODE) is None  # the head sees a node without a usable config
    # a rollout's apply is conditional on what the node held; a bad file is replaced all the same
    assert nodeconfig.write(NODE, payload(2), only_if=[payload(1)]) == {"previous": None, "applied": True}
    assert nodeconfig.read(NODE) == payload(2)
    put(NODE, BAD_FILES[kind])
    assert nodeconfig.write(NODE, None, only_if=[payload(2)])["applied"] is True  # a restore to none
    assert not nodeconfig.path_for(NODE).exists()


def test_a_write_of_a_bad_config_is_refused_and_changes_nothing():
    nodeconfig.write(NODE, payload(1))
    for bad in ({**payload(), "shell": "rm -rf /"}, payload(n_threads="4 --host 0.0.0.0"), [payload()],
                {**payload(), "server": {"n_ctx": "4096 --host 0.0.0.0"}}):
        with pytest.raises(BadInput):
            nodeconfig.write(NODE, bad)
    assert nodeconfig.read(NODE) == payload(1)


def supervisor() -> serve.Supervisor:
    return serve.Supervisor(NODE, "/nonexistent/m.gguf", "b" * 64, serve.LlamaCppPython(), "127.0.0.1", 0)


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_the_supervisor_keeps_its_last_good_config_over_a_bad_file(kind):
    sup = supervisor()
    try:
        put(NODE, BAD_FILES[kind])
        assert sup.wanted() is None and "bad config file" in sup.config_error  # a start over a bad file
        nodeconfig.write(NODE, payload(1))
        good = sup.wanted()
        assert good == NodeConfig.from_dict(payload(1)) and sup.config_error is None
        put(NODE, BAD_FILES[kind])
        assert sup.wanted() == good and "\n" not in sup.config_error
        sup.write_status()
        status = serve.read_status(NODE)
        assert status["config_error"] == sup.config_error and status["config_version"] == 0
    finally:
        sup.sock.close()


def test_the_server_argv_holds_only_validated_values():
    sup = supervisor()
    try:
        put(NODE, BAD_FILES["injected threads"])
        assert sup.wanted() is None
        server = object.__new__(serve.LlamaServer)
        server.binary = "/usr/bin/llama-server"
        config = NodeConfig.from_dict(payload(1))
        argv = server.argv("m.gguf", "m", config.bench_params, listen_fd=None, ready_fd=None, port=8080)
        assert "--host" in argv and argv[argv.index("--host") + 1] == "127.0.0.1" and argv.count("--host") == 1
    finally:
        sup.sock.close()


def test_config_show_shows_one_config_per_node_and_a_bad_file_in_one_line():
    nodeconfig.write(NODE, payload(1))
    sup = supervisor()  # a serving node: its status file is written
    try:
        sup.wanted()
        sup.write_status()
    finally:
        sup.sock.close()
    assert serve.status_path(NODE).parent != nodeconfig.config_dir()
    shown = CliRunner().invoke(main, ["config", "show", "--node", NODE[:8]])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout) == payload(1)  # one config, not two
    put(OTHER, BAD_FILES["injected threads"])
    bad = CliRunner().invoke(main, ["config", "show", "--node", OTHER[:8], "--format", "flags"])
    assert bad.exit_code == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1 and "n_threads" in bad.stderr
    both = CliRunner().invoke(main, ["config", "show", "--format", "flags"])
    assert both.exit_code == 2 and "Traceback" not in both.output
    assert f"# node {NODE}" in both.stdout and f"# node {OTHER}" in both.stdout and "--host" not in both.stdout
    assert both.stdout.count("-ngl") == 1 and "error: " in both.stderr
