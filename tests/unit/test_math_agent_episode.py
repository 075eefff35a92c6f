"""The math agent's episode loop against a scripted, in-process OpenAI endpoint.

No server: an httpx.MockTransport answers /chat/completions with scripted replies
and records every request, so we can check the text tool protocol, the header
no spanrl header (the agent is named by AutoGen's telemetry), the create args and the emitted reward.
"""

import asyncio
import json

import httpx
import pytest

from spanrl.producers.runner import RolloutContext

from examples.math_agent import agent as ma

TASK = {
    "task_id": "gsm_symbolic-0-0",
    "question": "Tom has 3 bags of 12 apples and eats 5. How many are left? "
    "Give the result as your final answer. Do not include units.",
    "answer": "31",
    "metadata": {},
}


def scripted(replies):
    requests = []
    replies = list(replies)

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path.endswith("/chat/completions")
        requests.append({"url": str(request.url), "headers": dict(request.headers), "body": json.loads(request.content)})
        content = replies.pop(0)
        return httpx.Response(
            200,
            json={
                "id": f"cmpl-{len(requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": "policy",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            },
        )

    return requests, handler


def run(replies, **kw):
    requests, handler = scripted(replies)
    http_client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    result = asyncio.run(ma.run_episode(TASK, "http://proxy.test/r/abc/v1", http_client=http_client, **kw))
    return result, requests


def test_calc_then_answer():
    result, reqs = run(["Compute: <calc>3*12-5</calc>", "Answer: 31"])
    assert result["reward"] == 1.0
    assert result["components"] == {"correct": 1.0, "format": 1.0}
    assert result["calls"] == 2 and result["tool_calls"] == 1 and result["tool_errors"] == 0
    assert result["final_text"] == "Answer: 31"
    # the tool result went back as the next user message
    second = reqs[1]["body"]["messages"]
    assert second[0]["role"] == "system" and "<calc>" in second[0]["content"]
    assert second[-1] == {"role": "user", "content": "<result>31</result>"}
    assert second[-2]["role"] == "assistant" and "<calc>3*12-5</calc>" in second[-2]["content"]
    episode = [m for m in result["transcript"] if not m.get("few_shot")]
    assert [m["role"] for m in episode] == ["system", "user", "assistant", "user", "assistant"]
    # the worked examples come first, as real chat turns, before the question
    first = reqs[0]["body"]["messages"]
    shots = [{"role": r, "content": c} for r, c in ma.FEW_SHOT]
    assert [{"role": m["role"], "content": m["content"]} for m in first[1:1 + len(shots)]] == shots
    assert first[-1]["content"].startswith("Question: Tom has 3 bags")


def test_without_few_shot_the_question_follows_the_system_prompt():
    result, reqs = run(["Answer: 31"], few_shot=False)
    assert [m["role"] for m in reqs[0]["body"]["messages"]] == ["system", "user"]
    assert result["reward"] == 1.0


def test_no_spanrl_header_and_the_sampling_args():
    _, reqs = run(["<calc>1+1</calc>", "no idea", "Answer: 2"])
    assert len(reqs) == 3
    for r in reqs:
        assert r["url"] == "http://proxy.test/r/abc/v1/chat/completions"  # the per-rollout base_url
        assert "x-spanrl-agent" not in r["headers"]
        assert r["body"]["model"] == "policy"
        assert r["body"]["temperature"] == 1.0
        assert r["body"]["max_tokens"] == 128
        assert "tools" not in r["body"]
        assert all("name" not in m for m in r["body"]["messages"])
    first_user = reqs[0]["body"]["messages"][-1]["content"]
    assert first_user.startswith("Question: Tom has 3 bags")
    assert "Give the result as your final answer" not in first_user


def test_nudge_then_max_turns():
    result, reqs = run(["I think 30", "still thinking", "maybe 31"])
    assert result["calls"] == 3 == len(reqs)
    assert reqs[1]["body"]["messages"][-1]["content"] == ma.NUDGE
    assert result["final_text"] == "maybe 31"
    assert result["reward"] == 0.0


def test_answer_ends_episode_even_with_calc_and_tool_errors():
    result, reqs = run(["<calc>x*2</calc> <calc>2**1000</calc>", "Answer: 30 <calc>1</calc>"])
    assert reqs[1]["body"]["messages"][-1]["content"] == (
        "<result>error: names are not allowed: x</result>\n<result>error: exponent too large</result>"
    )
    assert result["calls"] == 2 and result["tool_calls"] == 2 and result["tool_errors"] == 2
    assert result["reward"] == 0.1


def test_max_turns_one():
    result, reqs = run(["<calc>3*12-5</calc>"], max_turns=1)
    assert result["calls"] == 1 and len(reqs) == 1 and result["reward"] == 0.0


@pytest.mark.parametrize("inside_loop", [False, True])
def test_runner_callable_emits_reward(monkeypatch, inside_loop):
    requests, handler = scripted(["Answer: 31"])
    real = ma.make_client

    def make_client(base_url, **kw):
        return real(base_url, http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)), **kw)

    monkeypatch.setattr(ma, "make_client", make_client)
    ctx = RolloutContext(TASK, TASK["task_id"], "xyz", "0", "http://proxy.test/rollouts/xyz/attempts/0/v1")
    if inside_loop:  # the sync wrapper must also work when called from a running loop

        async def call():
            return ma.math_agent(ctx)

        value = asyncio.run(call())
    else:
        value = ma.math_agent(ctx)
    assert value["reward"] == 1.0
    assert [(r["value"], r["final"], r["components"]) for r in ctx.rewards] == [
        (1.0, True, {"correct": 1.0, "format": 1.0})]
    assert "x-spanrl-agent" not in requests[0]["headers"]


def test_calculator_calls_are_tool_spans_failed_on_errors(monkeypatch):
    """Each calculator call is a GenAI tool span; an error answer fails it (status ERROR,
    error.type CalcError): the facts AIR's tool_error / tool_ok rules read. The bridge's
    kind and AIR's facts of the exported spans, computed as the stack computes them."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from examples.math_agent.agent import run_calculator, tool_reply
    from spanrl.producers import instrument
    from spanrl.producers.otlp import span_kind
    from spanrl.stream_jobs.air import span_facts

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(instrument.trace, "get_tracer", lambda name, *a, **k: provider.get_tracer(name))
    assert run_calculator("12*3") == "36"
    assert tool_reply("<calc>1/0</calc> and <calc>2+2</calc>") == "<result>error: division by zero</result>\n<result>4</result>"
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["execute_tool calculator"] * 3
    assert [s.attributes["gen_ai.tool.call.arguments"] for s in spans] == ["12*3", "1/0", "2+2"]
    records = [{"kind": span_kind(s.name, dict(s.attributes)), "status_code": s.status.status_code.name,
                "attributes": dict(s.attributes)} for s in spans]
    assert [span_facts(r) for r in records] == [["tool_ok"], ["tool_error"], ["tool_ok"]]
    assert spans[1].attributes["error.type"] == "CalcError" and spans[1].status.description == "error: division by zero"


def tool_scripted(replies):
    """Like :func:`scripted`; a reply that is a dict ``{"expression": ...}`` comes back as a
    parsed calculator tool call (what vLLM's tool parser returns)."""
    requests = []
    replies = list(replies)

    def handler(request: httpx.Request) -> httpx.Response:
        requests.append(json.loads(request.content))
        reply = replies.pop(0)
        if isinstance(reply, dict):
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call-{len(requests)}", "type": "function",
                 "function": {"name": "calculator", "arguments": json.dumps(reply)}}]}
            finish = "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": reply}, "stop"
        return httpx.Response(200, json={
            "id": f"cmpl-{len(requests)}", "object": "chat.completion", "created": 0, "model": "policy",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})

    return requests, handler


def run_tools(replies):
    requests, handler = tool_scripted(replies)
    http_client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    result = asyncio.run(ma.run_episode(TASK, "http://proxy.test/r/abc/v1", http_client=http_client, tool_mode=True))
    return result, requests


def test_tool_mode_native_call_then_reflection():
    result, reqs = run_tools([{"expression": "3*12-5"}, "Answer: 31"])
    assert result["reward"] == 1.0 and result["calls"] == 2 == len(reqs)
    counts = ("tool_calls", "tool_errors", "text_calcs", "unparsed_tool_calls")
    assert tuple(result[k] for k in counts) == (1, 0, 0, 0)
    first = reqs[0]
    assert [t["function"]["name"] for t in first["tools"]] == ["calculator"]
    assert first["tool_choice"] == "auto"  # unforced
    assert [m["role"] for m in first["messages"]] == ["system", "user"]  # no worked examples
    assert "<calc>" not in first["messages"][0]["content"]
    # the reflection call sees the tool's result and may not call tools again
    assert reqs[1]["messages"][-1] == {"role": "tool", "content": "31", "tool_call_id": "call-1"}
    assert reqs[1].get("tool_choice", "none") == "none"
    assert [m["role"] for m in result["transcript"]] == ["system", "user", "assistant", "tool", "assistant"]


def test_tool_mode_counts_text_calcs_and_unparsed_calls_without_running_them():
    result, reqs = run_tools(["<calc>3*12-5</calc>", '{"name": "calculator", "arguments": {"expression": "31"}}',
                              "Answer: 31"])
    assert result["calls"] == 3 == len(reqs) and reqs[1]["messages"][-1]["content"] == ma.NUDGE
    assert (result["tool_calls"], result["text_calcs"], result["unparsed_tool_calls"]) == (0, 1, 1)
    assert result["reward"] == 1.0


def test_tool_mode_tool_error_and_turn_limit():
    result, reqs = run_tools([{"expression": "x*2"}, "no idea", "still no idea"])
    assert result["tool_calls"] == 1 and result["tool_errors"] == 1
    assert reqs[1]["messages"][-1]["content"] == "error: names are not allowed: x"
    # 2 calls in the first turn, 1 after the nudge: max_turns (3) reached
    assert result["calls"] == 3 == len(reqs) and result["reward"] == 0.0
