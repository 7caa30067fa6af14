"""`fleettune serve`: the node's model in a real inference server, with the node's active config.

A supervisor process owns the listening socket (bound once, on the address clients use) and runs
the server as a child process that inherits it, the way gunicorn, Einhorn and systemd socket
activation reload without dropping a request:

1. the node's config changes (a rollout wrote ``node-config/<node id>.json``);
2. a new child starts with the new config on the same inherited socket, loads and warms the model,
   starts accepting, and says so on its ready pipe;
3. the old child gets SIGTERM: uvicorn's graceful shutdown stops it accepting, finishes the
   requests in flight, closes idle keep-alive connections; new connections, and those already
   queued on the shared socket, are accepted by the new child.

A child that dies is started again, after a delay that doubles with each death in a row
(``RESTART_BACKOFF_S``); after ``RESTART_LIMIT`` deaths in a row (a model llama.cpp cannot load)
the supervisor gives up with one line and exit 2. Every child dies with its supervisor, however
the supervisor dies (rule 24.2): the parent-death signal on Linux, and everywhere a lifeline pipe
whose only write end the supervisor holds (``workers.bench``'s measuring child is the model), so a
restarted ``serve`` finds its port free. The server answers a health check every few seconds. What
the supervisor serves (address, model, config version, health, why the node's config file is not
used when it is not valid) is written to ``serve-status/<node id>.json``, a folder of its own beside
``node-config/`` (rule 21.2), which the head reads through Ray (``agent.serve_status``).

The config file is read as it is written, through ``NodeConfig.from_dict`` (rule 24.3): a file that
is not a valid config never reaches a server's argv and never stops the supervisor; the server keeps
the last good config, and the status says what is wrong with the file in ``config_error``.

Server kinds share one interface (``ServerKind``): llama-cpp-python's OpenAI-compatible server
(``create_app`` + ``uvicorn.Server`` on the inherited socket) and llama.cpp's own ``llama-server``
(same flags; it binds its own port and cannot take a socket, and it listens before its model is
loaded, answering 503 meanwhile, so two of them cannot share the port through a switch either: the
supervisor picks the port, a config change stops the old server and starts the new one on it; not
zero-drop, said so in docs/serving.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from workers import knobs, llamatools, nodeconfig
from workers.bench import die_with_parent
from workers.errors import BadInput
from workers.files import atomic_write
from workers.nodeconfig import BadConfigFile, NodeConfig
from workers.paths import data_dir
from workers.trial import BenchParams

DEFAULT_PARAMS = {"n_gpu_layers": 99, "n_threads": 4, "n_batch": 512, "n_ubatch": 512, "flash_attn": False,
                  "n_threads_batch": None}
HEALTH_EVERY_S = 2.0
HUB_EVERY_S = 10.0
STATUS_FRESH_S = 15.0  # a status file older than this: the supervisor is gone
READY_TIMEOUT_S = 300.0
N_CTX = 2048
RESTART_BACKOFF_S = 0.5  # the wait before the first restart; doubled for each death in a row
RESTART_BACKOFF_MAX_S = 30.0
RESTART_LIMIT = 6  # deaths in a row before `serve` gives up (exit 2)
STABLE_S = 30.0  # a child that served this long before it died starts the count again


def status_dir() -> Path:
    return data_dir() / "serve-status"


def status_path(node_id: str) -> Path:
    nodeconfig.path_for(node_id)  # checks the id
    return status_dir() / f"{node_id}.json"


def read_status(node_id: str) -> dict | None:
    """What the node's supervisor last said it serves, with ``fresh`` (is it still saying so)."""
    path = status_path(node_id)
    try:
        status = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    status["fresh"] = time.time() - status.get("updated_at", 0) < STATUS_FRESH_S
    return status


def _write_status(node_id: str, status: dict) -> None:
    path = status_path(node_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(status, sort_keys=True), fsync=False)  # rewritten every step


# ---------------------------------------------------------------- server kinds


class ServerKind:
    """How to run one server process with one configuration."""

    name = "?"
    takes_socket = False  # can it accept on the supervisor's inherited socket
    health_path = "/v1/models"  # answers 200 once the model is loaded
    build: dict | None = None  # llama.cpp's build (commit, backend) where the kind can tell

    def argv(self, model_path: str, alias: str, params: BenchParams, *, listen_fd: int | None,
             ready_fd: int | None, port: int | None, host: str = "127.0.0.1",
             parent_fd: int | None = None) -> list[str]:
        """The child's command line; ``parent_fd``: the read end of the supervisor's lifeline."""
        raise NotImplementedError


class LlamaCppPython(ServerKind):
    """llama-cpp-python's OpenAI-compatible server (extra ``server``), on the inherited socket."""

    name = "llama-cpp-python"
    takes_socket = True

    def argv(self, model_path, alias, params, *, listen_fd, ready_fd, port, host="127.0.0.1", parent_fd=None):
        lifeline = ["--parent-pipe", str(parent_fd)] if parent_fd is not None else []
        return [sys.executable, "-m", "workers.serve", "--fd", str(listen_fd), "--ready-fd", str(ready_fd),
                *lifeline, "--model", model_path, "--alias", alias, "--params", json.dumps(params.to_dict())]


class LlamaServer(ServerKind):
    """llama.cpp's ``llama-server`` (Homebrew installs it on Macs), with the same flags."""

    name = "llama-server"
    health_path = "/health"  # 503 while the model loads (it listens before loading)

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or llamatools.find_tool("llama-server")
        if not self.binary or not os.access(self.binary, os.X_OK):
            raise BadInput("llama-server not found (FLEETTUNE_LLAMA_SERVER, `fleettune tools build`'s cache, "
                           "PATH); use --server llama-cpp-python")
        self.build = llamatools.identity(self.binary)

    def argv(self, model_path, alias, params, *, listen_fd, ready_fd, port, host="127.0.0.1", parent_fd=None):
        # one slot, as llama-cpp-python serves: the whole context for one request at a time
        # (requests queue for it: llama-server never cuts one off for another)
        server = [self.binary, "-m", model_path, "--alias", alias,
                  *params.llama_cpp_flags("llama-server").split(), "-c", str(N_CTX),
                  "-np", "1", "--no-webui", "--host", host, "--port", str(port)]
        if parent_fd is None or sys.platform.startswith("linux"):
            return server  # on Linux the parent-death signal is set before exec (die_with_parent)
        # elsewhere llama-server cannot watch a pipe: a small keeper does, and stops it (rule 2)
        return [sys.executable, "-m", "workers.serve", "--keep", "--parent-pipe", str(parent_fd), "--", *server]


def server_kind(name: str) -> ServerKind:
    if name == "llama-cpp-python":
        return LlamaCppPython()
    if name == "llama-server":
        return LlamaServer()
    if name == "auto":
        found = llamatools.find_tool("llama-server")
        return LlamaServer(found) if found else LlamaCppPython()
    raise BadInput(f"unknown server kind {name!r}; choose llama-cpp-python, llama-server or auto")


# ---------------------------------------------------------------- supervisor


@dataclass
class Child:
    proc: subprocess.Popen
    config: NodeConfig | None
    ready_r: int | None
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    port: int | None = None

    @property
    def version(self) -> int:
        return self.config.version if self.config else 0


class Supervisor:
    """One node's server: started, restarted when it dies, replaced without a drop on a new config."""

    def __init__(self, node_id: str, model_path: str, model_sha256: str, kind: ServerKind, host: str,
                 port: int, log_dir: Path | None = None) -> None:
        nodeconfig.path_for(node_id)  # checks the id
        self.node_id, self.model_path, self.model_sha256, self.kind = node_id, model_path, model_sha256, kind
        self.alias = Path(model_path).stem
        self.sock: socket.socket | None = socket.create_server((host, port), backlog=256)
        self.host, self.port = host, self.sock.getsockname()[1]
        if kind.takes_socket:
            self.sock.set_inheritable(True)
        else:  # the server binds the port itself: the supervisor only picked it (port 0: a free one)
            self.sock.close()
            self.sock = None
        self.log_dir = log_dir or status_dir()
        self.current: Child | None = None
        self.pending: Child | None = None  # a new config's child, until it is ready
        self.refused: NodeConfig | None = None  # a config whose server would not start: not retried
        self.last_good: NodeConfig | None = None  # what the config file last held that was valid
        self.config_error: str | None = None  # why the config file is not used now (one line)
        self.draining: list[Child] = []
        self.restarts = 0
        self.healthy = False
        self.health_error: str | None = None
        self._last_health = 0.0
        self._last_hub = -HUB_EVERY_S
        self.chip_key: str | None = None  # set when connected to Ray: the hub is asked by chip
        self._stop = False
        self.deaths_in_row = 0  # children that died before serving STABLE_S, one after another
        self._restart_at = 0.0  # monotonic time before which no new child starts (the backoff)
        self.last_exit: str | None = None
        # rule 2 of issue 24: every child holds the read end; the only write end is this process's,
        # so the kernel closes it, and the children see EOF, whenever and however this one dies
        self._lifeline_r, self._lifeline_w = os.pipe()

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def wanted(self) -> NodeConfig | None:
        """The node's active config, if it is for the model this node serves; a node without one
        asks the head's config hub for its chip's (through Ray) every HUB_EVERY_S. A config file
        that holds no valid config: the last good one, and ``config_error`` says why (rule 24.3)."""
        try:
            config = nodeconfig.load(self.node_id)
        except BadConfigFile as exc:
            self.config_error = str(exc)
            return self.last_good
        self.config_error = None
        if config is None and self.chip_key and time.monotonic() - self._last_hub >= HUB_EVERY_S:
            from workers import confighub

            self._last_hub = time.monotonic()
            given = confighub.ask(self.chip_key, self.model_sha256)
            if given is not None:
                try:
                    given_config = NodeConfig.from_dict(given)
                except BadInput as exc:
                    self.config_error = f"the config hub's config: {exc}"
                else:
                    applied = nodeconfig.write(self.node_id, given_config, only_if=[None])["applied"]
                    config = given_config if applied else None
        self.last_good = config if config and config.model_sha256 == self.model_sha256 else None
        return self.last_good

    @property
    def log_path(self) -> Path:
        return self.log_dir / f".{self.node_id}.server.log"

    def _spawn(self, config: NodeConfig | None) -> Child:
        params = config.bench_params if config else BenchParams.from_dict(DEFAULT_PARAMS)
        ready_r, ready_w = os.pipe()
        port = None if self.sock else self.port
        fds = (self.sock.fileno(), ready_w) if self.sock else (ready_w,)
        argv = self.kind.argv(self.model_path, self.alias, params, listen_fd=fds[0] if self.sock else None,
                              ready_fd=ready_w, port=port, host=self.host, parent_fd=self._lifeline_r)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    pass_fds=(*fds, self._lifeline_r), start_new_session=True,
                                    preexec_fn=die_with_parent(os.getpid()))
        os.close(ready_w)
        if not self.kind.takes_socket:  # no ready pipe: readiness is its health check, then a warm-up
            os.close(ready_r)
            return Child(proc, config, None, port=port)
        os.set_blocking(ready_r, False)
        return Child(proc, config, ready_r, port=port)

    def _check_ready(self, child: Child) -> bool:
        if child.ready:
            return True
        if child.ready_r is not None:
            with contextlib.suppress(BlockingIOError):
                if os.read(child.ready_r, 16):
                    child.ready = True
        elif self._http_ok(child.port) and self._warm_http(child.port):
            child.ready = True
        if child.ready and child.ready_r is not None:
            os.close(child.ready_r)
            child.ready_r = None
        return child.ready

    def _local(self, port: int | None, path: str) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        return f"http://{host}:{port or self.port}{path}"

    def _http_ok(self, port: int | None = None) -> bool:
        try:
            with urllib.request.urlopen(self._local(port, self.kind.health_path), timeout=10) as r:
                return r.status == 200
        except OSError:
            return False

    def _warm_http(self, port: int | None) -> bool:
        """One short completion before the server is called ready (what ``_warm`` does inside a
        llama-cpp-python child)."""
        body = json.dumps({"prompt": "Hello", "max_tokens": 2, "model": self.alias}).encode()
        request = urllib.request.Request(self._local(port, "/v1/completions"), body,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status == 200
        except OSError:
            return False

    def _retire(self, child: Child) -> None:
        """Stop a child gracefully: it finishes what it is serving, then exits."""
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
        if child.ready_r is not None:
            os.close(child.ready_r)
            child.ready_r = None
        self.draining.append(child)

    def _died(self, child: Child) -> None:
        """Count a dead child and set when the next one may start (rule 6 of issue 24: back off,
        then give up after RESTART_LIMIT deaths in a row)."""
        served_s = time.monotonic() - child.started
        self.deaths_in_row = 1 if child.ready and served_s >= STABLE_S else self.deaths_in_row + 1
        code = child.proc.returncode
        self.last_exit = f"exit code {code}"
        if code < 0:
            with contextlib.suppress(ValueError):
                self.last_exit = f"killed by {signal.Signals(-code).name}"
        if self.deaths_in_row >= RESTART_LIMIT:
            raise ServerKeepsDying(
                f"the {self.kind.name} server died {self.deaths_in_row} times in a row ({self.last_exit}"
                f"{_last_line(self.log_path)}); giving up; its log: {self.log_path}")
        delay = min(RESTART_BACKOFF_S * 2 ** (self.deaths_in_row - 1), RESTART_BACKOFF_MAX_S)
        self._restart_at = time.monotonic() + delay
        self.restarts += 1

    def step(self) -> None:
        """One pass: follow the config, replace or restart children, reap drained ones, health."""
        wanted = self.wanted()
        live = self.current
        if live is not None and live.proc.poll() is not None:  # died: restarted after the backoff
            if live.ready_r is not None:
                os.close(live.ready_r)
                live.ready_r = None
            self._died(live)
            self.current = live = None
            self.healthy = False
        if live is None:
            if time.monotonic() < self._restart_at:
                self.write_status()
                return
            self.current, self.healthy = self._spawn(wanted), False  # healthy again once checked
            if self.pending is not None:  # started with the config wanted now: the switch is moot
                self._retire(self.pending)
            self.pending = None
        elif wanted != live.config and wanted != self.refused and not self.pending:
            if self.kind.takes_socket:
                self.pending = self._spawn(wanted)
            else:  # llama-server cannot share the socket: stop, then start on the same port
                self._retire(live)
                try:
                    live.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    live.proc.kill()
                    live.proc.wait()
                self.current, self.healthy = self._spawn(wanted), False
        pending = self.pending
        if pending is not None:
            if pending.proc.poll() is not None:  # the new config does not start: keep the old one
                if pending.ready_r is not None:
                    os.close(pending.ready_r)
                self.refused, self.pending = pending.config, None
                self.restarts += 1
            elif self._check_ready(pending):
                self._retire(self.current)
                self.current, self.pending = pending, None
        self._check_ready(self.current)
        self.draining = [c for c in self.draining if c.proc.poll() is None]
        now = time.monotonic()
        if now - self._last_health >= HEALTH_EVERY_S:
            self._last_health = now
            self.healthy = self.current.ready and self._http_ok()
        if self.current.ready and now - self.current.started >= STABLE_S:
            self.deaths_in_row = 0
        self.write_status()

    def write_status(self) -> None:
        child = self.current
        config = child.config if child else None
        _write_status(self.node_id, {
            "address": self.address, "kind": self.kind.name, "llama_build": self.kind.build, "model": self.alias,
            "model_sha256": self.model_sha256, "config_version": config.version if config else 0,
            "params": config.params if config else DEFAULT_PARAMS, "ready": bool(child and child.ready),
            "config_error": self.config_error,
            "healthy": self.healthy and bool(child and child.ready), "restarts": self.restarts,
            "pid": child.proc.pid if child else None, "deaths_in_row": self.deaths_in_row,
            "last_exit": self.last_exit,
            "supervisor_pid": os.getpid(), "draining": len(self.draining),
            "switching_to": self.pending.version if self.pending else None,
            "updated_at": time.time(),
        })

    def run(self, interval_s: float = 0.25, max_s: float | None = None) -> None:
        """Supervise until SIGTERM/SIGINT (or ``max_s``); then stop every child gracefully."""
        def stop(*_):
            self._stop = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        deadline = time.monotonic() + max_s if max_s else None
        try:
            while not self._stop and (deadline is None or time.monotonic() < deadline):
                self.step()
                time.sleep(interval_s)  # the supervision period, not synchronisation
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        for child in [self.current, self.pending, *self.draining]:
            if child is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in [self.current, self.pending, *self.draining]:
            if child is not None:
                try:
                    child.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
        if self.sock is not None:
            self.sock.close()
        os.close(self._lifeline_w)
        os.close(self._lifeline_r)
        status_path(self.node_id).unlink(missing_ok=True)


class ServerKeepsDying(BadInput):
    """The server child died RESTART_LIMIT times in a row: `serve` stops (one line, exit 2)."""


def _last_line(log_path: Path, limit: int = 200) -> str:
    """The log's last non-empty line (llama.cpp's reason, usually), for the one line on stderr."""
    try:
        with open(log_path, "rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - 4096))
            lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return f"; last logged: {lines[-1][:limit]}" if lines else ""


def _use_token() -> None:
    """Present the fleet's token, as `worker start` does ($FLEETTUNE_RAY_TOKEN or the file
    $FLEETTUNE_RAY_TOKEN_FILE names: what `service install serve` puts in the service's
    environment); Ray's own RAY_AUTH_TOKEN, set by the caller, is left alone."""
    from workers import fleet_token
    from workers.join import ray_env

    if os.environ.get("RAY_AUTH_TOKEN"):
        return
    token = fleet_token.resolve(None, None)
    if not token:
        return
    os.environ.update(ray_env(token))
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # Ray caches its settings per process
    AuthenticationTokenLoader.instance().reset_cache()


def join_ray(address: str | None) -> str:
    """Connect to the fleet's Ray cluster; the Ray node id of the raylet this process attached to."""
    import ray

    if not ray.is_initialized():
        _use_token()
        try:
            ray.init(address=address or "auto", log_to_driver=False, logging_level="ERROR")
        except (ConnectionError, RuntimeError) as exc:
            raise BadInput(f"no Ray cluster to serve in ({exc}); start the worker first, or pass --node-id") from None
    return ray.get_runtime_context().get_node_id()


def chip_of(node_id: str) -> str | None:
    """The node's chip label (what the head's config hub is keyed by)."""
    import ray

    from workers.labels import CHIP_LABEL

    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return (node.get("Labels") or {}).get(CHIP_LABEL)
    return None


def serve(model_path: str, *, node_id: str | None = None, server: str = "auto", host: str = "127.0.0.1",
          port: int = 8080, address: str | None = None, max_s: float | None = None,
          on_ready=None) -> None:
    """Serve ``model_path`` on this node with its active config until stopped (``fleettune serve``)."""
    from workers.models import read_model_info

    info = read_model_info(model_path)
    kind = server_kind(server)
    if not 0 <= port <= 65535:
        raise BadInput(f"port {port}: must be in 0..65535")
    if node_id is None or address:  # on a fleet node: its raylet's id, and the head's hub to ask
        attached = join_ray(address)
        node_id = node_id or attached
    try:
        supervisor = Supervisor(node_id, str(Path(model_path).resolve()), info.sha256, kind, host, port)
    except OSError as exc:
        raise BadInput(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    import ray

    if ray.is_initialized():
        supervisor.chip_key = chip_of(node_id)
    if on_ready:
        on_ready(supervisor)
    supervisor.run(max_s=max_s)


# ---------------------------------------------------------------- the llama-cpp-python child


def child_main(argv: list[str]) -> None:
    """A llama-cpp-python server on the inherited socket ``--fd``: load and warm the model, start
    accepting, then write one byte to ``--ready-fd``; SIGTERM drains it (uvicorn's shutdown)."""
    import argparse
    import threading

    import uvicorn
    from llama_cpp.server.app import create_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--alias", required=True)
    parser.add_argument("--params", required=True)
    parser.add_argument("--parent-pipe", type=int)
    args = parser.parse_args(argv)
    if args.parent_pipe is not None:  # gone with the supervisor, however it dies (rule 2 of issue 24)
        from workers.bench import _watch_parent

        _watch_parent(args.parent_pipe)
    from workers.llamacompat import extra_buffers_usable

    if not extra_buffers_usable(args.model):
        _without_extra_buffer_types()
    params = BenchParams.from_dict(json.loads(args.params))
    settings = ModelSettings(model=args.model, model_alias=args.alias, n_ctx=N_CTX, verbose=False,
                             **knobs.server_settings(params))
    # rule 24.2: a request waits for the one being served instead of cutting it off
    # (llama-cpp-python's default interrupts a running request whenever another one arrives)
    app = create_app(server_settings=ServerSettings(interrupt_requests=False), model_settings=[settings])
    _streams_outlive_sigterm()
    _warm(args.alias)
    sock = socket.socket(fileno=args.fd)
    server = uvicorn.Server(uvicorn.Config(_connection_close(app), log_level="warning",
                                           timeout_graceful_shutdown=120))

    def tell_ready() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)  # polling uvicorn's started flag
        if server.started:
            os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)

    threading.Thread(target=tell_ready, daemon=True).start()
    server.run(sockets=[sock])


def _streams_outlive_sigterm() -> None:
    """A retired server finishes the streams it is sending (rule 24.2: no request is cut by a config
    switch). sse-starlette, which llama-cpp-python streams through, ends every open stream when
    uvicorn is told to exit; uvicorn's graceful shutdown (``timeout_graceful_shutdown``) already waits
    for requests in flight, so that drain is turned off here."""
    from sse_starlette import sse

    if hasattr(sse.AppStatus, "disable_automatic_graceful_drain"):
        sse.AppStatus.disable_automatic_graceful_drain()
    elif getattr(sse.AppStatus, "original_handler", None) is not None:  # older sse-starlette: undo its patch
        import uvicorn

        uvicorn.Server.handle_exit = sse.AppStatus.original_handler


def _connection_close(app):
    """Every response says ``Connection: close``, so no client holds an idle keep-alive connection
    to a server that is being retired (a request sent on one just as the server closes it is
    reset: the one failure seen without this). A new loopback connection per request costs far
    less than one generated token."""
    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_closing(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return await app(scope, receive, send_closing)

    return wrapped


def _without_extra_buffer_types() -> None:
    """Load models without llama.cpp's extra CPU buffer types, where they crash (workers.llamacompat):
    llama-cpp-python's ``Llama`` has no setting for it, so the model parameters' default changes."""
    import llama_cpp
    import llama_cpp.llama as llama_module

    default = llama_cpp.llama_model_default_params

    def without():
        params = default()
        params.use_extra_bufts = False
        return params

    llama_module.llama_cpp.llama_model_default_params = without


def _warm(alias: str) -> None:
    """One short completion before the server accepts anything, so its first request is not slow."""
    from llama_cpp.server import app as server_app

    proxy = getattr(server_app, "_llama_proxy", None)
    if proxy is not None:
        proxy(alias).create_completion("Hello", max_tokens=2)


def keep_main(argv: list[str]) -> int:
    """``--keep --parent-pipe FD -- COMMAND...``: run COMMAND (llama-server, which cannot watch a
    pipe itself) and stop it when the supervisor's lifeline closes; SIGTERM is passed on, and the
    command's exit is this process's (rule 2 of issue 24, where there is no parent-death signal)."""
    pipe_fd, command = int(argv[argv.index("--parent-pipe") + 1]), argv[argv.index("--") + 1:]
    proc = subprocess.Popen(command, preexec_fn=die_with_parent(os.getpid()))
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))

    import threading

    from workers.bench import _exit_on_eof

    threading.Thread(target=_exit_on_eof, args=(pipe_fd, proc.kill), daemon=True).start()
    code = proc.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    if "--keep" in sys.argv[1:]:
        sys.exit(keep_main(sys.argv[1:]))
    child_main(sys.argv[1:])
