"""Knock on every port of a Ray head from another host, without a token, with a wrong one and with
the right one; print what each attempt got, as JSON.

Run inside a worker's namespace: ``python -m tests.netns_probe HOST PORT... --token-file F``.
A gRPC port is identified by the first of Ray's methods it does not answer UNIMPLEMENTED; an
HTTP port by answering HTTP. The right token is the control: it must be served where the others
were refused, so a refusal is authentication, not a broken probe. The verdicts are the servers' own: gRPC status
codes, HTTP status lines, or the connection failing.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys

GRPC_METHODS = (  # one method per Ray service that listens on a node; True: harmless to serve
    ("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", True),  # GCS
    ("/ray.rpc.NodeManagerService/GetNodeStats", True),  # raylet
    ("/ray.rpc.CoreWorkerService/NumPendingTasks", True),  # a worker or driver process
    ("/ray.rpc.RayletDriver/ClusterInfo", True),  # Ray client server
    ("/ray.rpc.ReporterService/HealthCheck", True),  # dashboard agent (with `ray[default]`)
    # the raylet's object manager serves only Push and Pull; an empty Pull is never sent with the
    # right token (it would reach the handler), only refused without one
    ("/ray.rpc.ObjectManagerService/Pull", False),
)
# the first path a server answers other than 404/405 with the right token names it: a Prometheus
# metrics endpoint (answers any path), the job API (dashboard), the runtime-env agent, the
# dashboard agent
HTTP_REQUESTS = (("GET", "/metrics"), ("GET", "/api/jobs/"), ("POST", "/get_or_create_runtime_env"),
                 ("GET", "/api/version"))
TIMEOUT_S = 5.0


def speaks_http(host: str, port: int) -> bool | None:
    """True for HTTP/1, False for anything else, None when the port cannot be reached."""
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S) as conn:
            conn.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
            conn.settimeout(TIMEOUT_S)
            try:
                head = conn.recv(5)
            except (TimeoutError, ConnectionResetError):
                return False
    except OSError:
        return None
    return head.startswith(b"HTTP/")


def grpc_status(host: str, port: int, method: str, token: str | None) -> str:
    import grpc

    metadata = [("authorization", f"Bearer {token}")] if token is not None else []
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(b"", timeout=TIMEOUT_S, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def http_status(host: str, port: int, verb: str, path: str, token: str | None) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    try:
        conn.request(verb, path, body=b"" if verb == "POST" else None, headers=headers)
        return str(conn.getresponse().status)
    except OSError as exc:
        return f"error: {exc}"
    finally:
        conn.close()


def probe(host: str, port: int, token: str) -> dict:
    """What this port did with no token, a wrong token and the right one."""
    wrong = "0" * len(token)
    kind = speaks_http(host, port)
    if kind is None:
        return {"port": port, "service": "unreachable"}
    if kind:
        for verb, path in HTTP_REQUESTS:
            right = http_status(host, port, verb, path, token)
            if right not in ("404", "405"):
                break
        return {"port": port, "service": f"http {verb} {path}", "right": right,
                "none": http_status(host, port, verb, path, None),
                "wrong": http_status(host, port, verb, path, wrong)}
    for method, harmless in GRPC_METHODS:
        none = grpc_status(host, port, method, None)
        if none == "UNIMPLEMENTED":
            continue  # not this server's method (gRPC answers that before any authentication)
        return {"port": port, "service": f"grpc {method}", "none": none,
                "wrong": grpc_status(host, port, method, wrong),
                "right": grpc_status(host, port, method, token) if harmless else "not sent"}
    return {"port": port, "service": "unknown"}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("host")
    parser.add_argument("ports", nargs="+", type=int)
    parser.add_argument("--token-file", required=True)
    args = parser.parse_args(argv)
    with open(args.token_file) as handle:
        token = handle.read().strip()
    print(json.dumps([probe(args.host, port, token) for port in args.ports]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
