"""A Node.js agent on the real stack (issue 23 item 6): examples/node_agent/agent.mjs, with the
official openai-node client on the proxy's plain ``/v1`` and the OpenTelemetry JS SDK's default
exporter (OTLP/JSON) to the bridge, no spanrl code. The bridge, the proxy (the stack's vLLM
behind it) and a Faust worker from this checkout on private ``sjtest-<id>-*`` topics; the
agent's two episodes under one task label become two transitions with the rewards it posted,
its agent name joined by trace, and one GRPO group of two."""
import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from spanrl.infra.stack import Stack
from tests.integration.test_stream_app import _private_pipeline, _read

pytestmark = pytest.mark.integration
NODE_AGENT = Path(__file__).resolve().parents[2] / "examples" / "node_agent"
TASK = "arith/17x23"


def test_node_agent_trains_through_openai_node_and_the_js_sdk(tmp_path, settings):
    assert shutil.which("node"), "Node.js is needed (installed on this machine kind)"
    assert (NODE_AGENT / "node_modules").is_dir(), "run `make bootstrap` (npm ci in examples/node_agent)"
    Stack(settings).up(["kafka", "minio", "vllm"])
    with _private_pipeline(tmp_path) as p:
        done = subprocess.run(["node", "agent.mjs", "--proxy", p.proxy_url, "--bridge", p.bridge_url,
                               "--model", settings.model_name, "--episodes", "2", "--task", TASK],
                              cwd=NODE_AGENT, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        episodes = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        got = asyncio.run(_read(p.names, ("spans", "transitions", "samples", "dead-letter"),
                                lambda g: len(g["transitions"]) >= 2 and len(g["samples"]) >= 2, 120))
    worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-3000:]

    assert len(episodes) == 2 and all(e["rollout_id"].startswith("prod-") for e in episodes), done.stdout
    rewards = {e["rollout_id"]: e["reward"] for e in episodes}
    assert len(rewards) == 2
    # the JS SDK's agent spans arrived as OTLP/JSON and carry the call's trace
    agent_spans = [s for s in got["spans"] if s["source"] == "otlp" and s["name"] == "invoke_agent node-solver"]
    calls = {s["span_id"]: s for s in got["spans"] if s["source"] == "proxy"}
    assert len(agent_spans) == 2 and len(calls) == 2, got["spans"]
    assert {s["trace_id"] for s in agent_spans} == {s["trace_id"] for s in calls.values()}
    # one transition per call: the posted reward, the label's group, the agent named by its span
    trs = got["transitions"]
    assert sorted((t["rollout_id"], t["call_index"], t["task_id"], t["group_size"], t["reward"], t["agent_name"])
                  for t in trs) == sorted((rid, 0, TASK, 2, r, "node-solver") for rid, r in rewards.items()), worker_log
    for t in trs:
        llm = calls[t["span_id"]]["llm"]
        assert (t["prompt_token_ids"], t["completion_token_ids"]) == (llm["prompt_token_ids"], llm["completion_token_ids"])
        assert t["status"] == "succeeded" and t["attempt_id"] == "0"
    # one GRPO group of the two episodes (advantages ±(R - mean)/std, or 0 when both rewards tie)
    assert {s["group_id"] for s in got["samples"]} == {f"{TASK}/0"}
    assert all(s["group_rollouts"] == 2 for s in got["samples"])
    assert got["dead-letter"] == [], worker_log
