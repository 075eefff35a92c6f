"""The load balancer keeps a session on one policy unit, through a real nginx.

The repository's nginx configs (infra/deploy/nginx.conf for Compose, k8s/nginx.conf for
Kubernetes) are rendered for two upstream test servers: their ``map`` blocks and ``upstream
proxies`` hashing are taken as written (parsed and rebuilt with crossplane, NGINX's own
parser), only the upstream servers and the listen address change. nginx (Debian's
``nginx-light``, installed by ``make bootstrap``) then serves real HTTP calls: every call of
one rollout, by the per-rollout URL or by the production route's ``x-spanrl-rollout-id``
header, reaches one upstream, the same one for both forms; different rollouts spread over
both. No spanrl service is started: the upstreams are small HTTP servers that record what
they received.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import crossplane
import httpx
import pytest

from spanrl.core.production import ROLLOUT_HEADER
from spanrl.infra.stack import ROOT

DEPLOY = ROOT / "infra" / "deploy"
CONFIGS = [DEPLOY / "nginx.conf", DEPLOY / "k8s" / "nginx.conf"]
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


class Upstream:
    """A small HTTP server standing in for one policy unit's proxy: it answers every call
    with its name and records (method, path, rollout header) of each."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[str, str, str | None]] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                upstream.calls.append((self.command, self.path, self.headers.get(ROLLOUT_HEADER)))
                body = json.dumps({"unit": upstream.name}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render(conf_path: Path, upstream_ports: list[int], listen_port: int, prefix: Path) -> str:
    """The policy units' part of the repository's nginx config, for these upstream ports:
    the ``map`` blocks, ``upstream proxies`` (its hashing as written; its servers replaced by
    127.0.0.1 ports) and the server that listens on the proxy port (18080), listening on
    ``listen_port``. The other upstreams (bridges, MinIO) name hosts of a deployment and are
    left out; so is ``resolve`` (nginx >= 1.27.3 only; Debian 12 has 1.22)."""
    parsed = crossplane.parse(str(conf_path), comments=False)
    assert parsed["errors"] == [], parsed["errors"]
    http = next(d for d in parsed["config"][0]["parsed"] if d["directive"] == "http")["block"]
    kept: list[dict] = []
    for d in http:
        if d["directive"] == "map":
            kept.append(d)
        elif d["directive"] == "upstream" and d["args"] == ["proxies"]:
            block = [x for x in d["block"] if x["directive"] != "server"]
            block += [{"directive": "server", "args": [f"127.0.0.1:{p}"]} for p in upstream_ports]
            kept.append({**d, "block": block})
        elif d["directive"] in ("proxy_http_version", "proxy_set_header"):
            kept.append(d)
        elif d["directive"] == "server" and any(x["directive"] == "listen" and x["args"][0] == "18080"
                                                for x in d["block"]):
            block = [x if x["directive"] != "listen" else {"directive": "listen",
                                                             "args": [f"127.0.0.1:{listen_port}"]}
                     for x in d["block"]]
            kept.append({**d, "block": block})
    assert {d["directive"] for d in kept} >= {"map", "upstream", "server"}, conf_path
    temp = [{"directive": f"{kind}_temp_path", "args": [str(prefix / kind)]}
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")]
    top = [
        {"directive": "daemon", "args": ["off"]},
        {"directive": "worker_processes", "args": ["1"]},
        {"directive": "pid", "args": [str(prefix / "nginx.pid")]},
        {"directive": "error_log", "args": [str(prefix / "error.log"), "warn"]},
        {"directive": "events", "args": [], "block": [{"directive": "worker_connections", "args": ["256"]}]},
        {"directive": "http", "args": [], "block": [
            {"directive": "access_log", "args": ["off"]}, *temp, *kept]},
    ]
    return crossplane.build(top)


@pytest.fixture(params=CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def balancer(request, tmp_path):
    """(nginx's base URL, the two upstreams) for one of the repository's configs."""
    assert NGINX, "nginx missing: `make bootstrap` installs Debian's nginx-light (as root: apt-get install nginx-light)"
    units = [Upstream("unit-1"), Upstream("unit-2")]
    port = free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(render(request.param, [u.port for u in units], port, tmp_path))
    check = subprocess.run([NGINX, "-t", "-e", str(tmp_path / "error.log"), "-p", str(tmp_path), "-c", str(conf)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr + conf.read_text()
    proc = subprocess.Popen([NGINX, "-e", str(tmp_path / "error.log"), "-p", str(tmp_path), "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "nginx did not listen within 10 s"
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", units
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for u in units:
            u.close()


CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
ROLLOUTS = [f"r-{i}" for i in range(40)]


def unit_of(client: httpx.Client, method: str, path: str, headers: dict | None = None) -> str:
    r = client.request(method, path, headers=headers, json=CHAT if method == "POST" else None)
    assert r.status_code == 200, r.text
    return r.json()["unit"]


def test_every_call_of_a_rollout_reaches_one_unit(balancer):
    """Each rollout's calls by every route form (runner's per-rollout URL, evaluation URL, its
    model list, the production route's header, twice each) reach one unit, the same for
    both forms: the balancer hashes the rollout id whichever way it arrives. Different
    rollouts spread over both units."""
    url, units = balancer
    placement: dict[str, set[str]] = {}
    with httpx.Client(base_url=url, timeout=10) as client:
        for rid in ROLLOUTS:
            seen = set()
            for _ in range(2):
                seen.add(unit_of(client, "POST", f"/rollouts/{rid}/attempts/0/v1/chat/completions"))
                seen.add(unit_of(client, "POST", f"/eval/0/rollouts/{rid}/attempts/a1/v1/responses"))
                seen.add(unit_of(client, "GET", f"/rollouts/{rid}/attempts/0/v1/models"))
                seen.add(unit_of(client, "POST", "/v1/chat/completions", {ROLLOUT_HEADER: rid}))
                seen.add(unit_of(client, "POST", "/v1/messages", {ROLLOUT_HEADER: rid}))
            placement[rid] = seen
    assert {rid: len(s) for rid, s in placement.items()} == {rid: 1 for rid in ROLLOUTS}
    per_unit = {u.name: sum(1 for s in placement.values() if s == {u.name}) for u in units}
    assert sum(per_unit.values()) == len(ROLLOUTS)
    assert min(per_unit.values()) >= 10, per_unit  # consistent hashing spreads 40 ids over both
    # the header reaches the unit (its proxy takes the rollout from it), unchanged
    header_calls = [c for u in units for c in u.calls if c[1].startswith("/v1/")]
    assert sorted(c[2] for c in header_calls) == sorted(rid for rid in ROLLOUTS for _ in range(4))


def test_header_wins_over_the_path(balancer):
    """A call carrying the header is placed by the header's rollout, whatever its path says:
    the header of a rollout placed on one unit moves a path that hashes to the other unit."""
    url, units = balancer
    with httpx.Client(base_url=url, timeout=10) as client:
        home = {rid: unit_of(client, "POST", f"/rollouts/{rid}/attempts/0/v1/chat/completions") for rid in ROLLOUTS}
        a = next(r for r in ROLLOUTS if home[r] == "unit-1")
        b = next(r for r in ROLLOUTS if home[r] == "unit-2")
        assert unit_of(client, "POST", f"/rollouts/{a}/attempts/0/v1/chat/completions", {ROLLOUT_HEADER: b}) == "unit-2"
        assert unit_of(client, "POST", f"/rollouts/{b}/attempts/0/v1/chat/completions", {ROLLOUT_HEADER: a}) == "unit-1"


def test_calls_without_a_rollout_spread(balancer):
    """Production calls without the header are each their own rollout (the proxy mints one):
    nginx hashes its per-request id, so 40 of them reach both units."""
    url, units = balancer
    with httpx.Client(base_url=url, timeout=10) as client:
        seen = [unit_of(client, "POST", "/v1/chat/completions") for _ in range(40)]
    assert set(seen) == {"unit-1", "unit-2"}
