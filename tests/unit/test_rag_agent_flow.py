"""Both RAG agent paths against scripted chat completions (httpx.MockTransport, no server).

The real ``OpenAIChatCompletionsModel`` and Agents SDK ``Runner`` run; only the HTTP
endpoint is fake. Checked: which agent made each call (header), the create args, what
was searched, that the tool runs with the model's query, and the emitted reward.
"""

import asyncio
import json

import httpx
import pytest

from spanrl.producers.runner import RolloutContext

from examples.rag_agent import agent as ra
from examples.rag_agent import spec

TASK = {
    "task_id": "rag-city_currency-city:4005539",
    "question": "What currency is used in the country where Guadalajara is?",
    "answers": ["Mexican Peso", "Peso", "MXN"],
    "support": ["city:4005539", "country:MX"],
    "metadata": {},
}


def completion(n, content=None, tool_calls=None):
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [{"id": f"call_{n}_{i}", "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(args)}}
                                 for i, (name, args) in enumerate(tool_calls)]
    return {"id": f"cmpl-{n}", "object": "chat.completion", "created": 0, "model": "policy",
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}


def run(replies, **kw):
    """Run one episode; ``replies`` are (content, tool_calls) pairs, one per model call."""
    requests, replies = [], list(replies)

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path.endswith("/chat/completions")
        requests.append({"headers": dict(request.headers), "body": json.loads(request.content)})
        content, tool_calls = replies.pop(0)
        return httpx.Response(200, json=completion(len(requests), content, tool_calls))

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    result = asyncio.run(ra.run_episode(TASK, "http://proxy.test/rollouts/r1/attempts/0/v1", "tok",
                                        http_client=client, **kw))
    assert not replies, "every scripted reply was used"
    return result, requests


def agents_of(requests):
    """Which agent made each request, by its instructions (the system message)."""
    by_prompt = {ra.QUERY_PROMPT: ra.QUERY_WRITER, ra.ANSWER_PROMPT: ra.ANSWERER, ra.RESEARCH_PROMPT: ra.RESEARCHER}
    return [by_prompt[r["body"]["messages"][0]["content"]] for r in requests]


def test_pipeline_two_hops_then_answer():
    result, reqs = run([("Guadalajara", None), ("Query: Mexico currency", None),
                        ("<answer>Mexican Peso</answer>", None)])
    assert agents_of(reqs) == ["query_writer", "query_writer", "answerer"]
    assert result["queries"] == ["Guadalajara", "Mexico currency"] and result["tool_calls"] == 2
    assert set(TASK["support"]) <= set(result["retrieved"])
    assert result["answer"] == "Mexican Peso" and result["calls"] == 3
    assert result["reward"] == 1.0
    assert result["components"] == {"f1": 1.0, "format": 1.0, "correct": 1.0}
    for r in reqs:
        body = r["body"]
        assert body["model"] == "policy" and body["max_tokens"] == 64 and body["temperature"] == 1.0
        assert "tools" not in body and r["headers"]["authorization"] == "Bearer tok"
    # hop 2 shows the query writer the first hop's passages; the answerer sees both hops'
    hop2 = reqs[1]["body"]["messages"][-1]["content"]
    assert "Guadalajara is a city in Mexico" in hop2 and hop2.endswith("Next query:")
    answer_msgs = reqs[2]["body"]["messages"]
    assert answer_msgs[0] == {"role": "system", "content": ra.ANSWER_PROMPT}
    assert answer_msgs[1:1 + len(ra.ANSWER_SHOTS)] == ra.ANSWER_SHOTS
    assert "Mexican Peso (MXN)" in answer_msgs[-1]["content"]
    assert answer_msgs[-1]["content"].endswith("Question: " + TASK["question"])


def test_pipeline_empty_query_falls_back_to_question_and_untagged_answer():
    result, _ = run([("", None), ("   ", None), ("It is the peso.", None)])
    assert result["queries"] == [TASK["question"]] * 2
    assert "city:4005539" in result["retrieved"]
    # untagged: whole reply scored; [it, is, peso] vs [peso] -> F1 0.5
    assert result["components"] == {"f1": 0.5, "format": 0.0, "correct": 0.0} and result["reward"] == 0.45


def test_pipeline_one_hop():
    result, reqs = run([("Guadalajara Mexico currency", None), ("<answer>Euro</answer>", None)], hops=1)
    assert agents_of(reqs) == ["query_writer", "answerer"] and result["tool_calls"] == 1
    assert result["reward"] == 0.1


@pytest.mark.parametrize("reply, expected", [
    ("Guadalajara", "Guadalajara"),
    ('Next query: "Mexico currency"\nmore text', "Mexico currency"),
    ("<query>Mexico currency</query>", "Mexico currency"),
    ("\n\nsearch query: Lima", "Lima"),
    ("Bengaluru is in India. Population: 8.4 million.", "Bengaluru is in India"),   # first sentence
    ("St. Louis? maybe", "St"),                                                  # (a known cost)
    ("", "FALLBACK"),
    (" ".join(["w"] * 30), " ".join(["w"] * ra.MAX_QUERY_WORDS)),
])
def test_parse_query(reply, expected):
    assert ra.parse_query(reply, "FALLBACK") == expected


def test_tool_path_calls_search_with_the_models_query():
    result, reqs = run([
        (None, [("search", {"query": "Guadalajara"})]),
        (None, [("search", {"query": "Mexico currency"})]),
        ("<answer>Peso</answer>", None),
    ], tool_mode=True)
    assert agents_of(reqs) == ["researcher"] * 3
    assert result["queries"] == ["Guadalajara", "Mexico currency"] and result["tool_calls"] == 2
    assert result["mode"] == "tool" and result["calls"] == 3
    first, second = reqs[0]["body"], reqs[1]["body"]
    assert [t["function"]["name"] for t in first["tools"]] == ["search"]
    assert first["tool_choice"] == {"type": "function", "function": {"name": "search"}}
    assert second.get("tool_choice") in (None, "auto")  # forced only on the first turn
    # the tool's output (the passages) went back to the model as a tool message
    tool_msgs = [m for m in second["messages"] if m["role"] == "tool"]
    assert len(tool_msgs) == 1 and "Guadalajara is a city in Mexico" in tool_msgs[0]["content"]
    assert result["components"] == {"f1": 1.0, "format": 1.0, "correct": 1.0} and result["reward"] == 1.0


def test_tool_path_auto_leaves_the_search_to_the_model(monkeypatch):
    """``tool_choice="auto"``: the first request forces nothing; a model that answers at once
    makes no search (tool_calls 0), one that searches is served as on the forced path. The
    runner callable ``rag_agent_tools_auto`` asks for exactly this."""
    result, reqs = run([("<answer>Peso</answer>", None)], tool_mode=True, tool_choice="auto")
    assert reqs[0]["body"]["tool_choice"] == "auto" and [t["function"]["name"] for t in reqs[0]["body"]["tools"]] == [
        "search"]
    assert (result["tool_calls"], result["queries"], result["calls"], result["reward"]) == (0, [], 1, 1.0)
    result, reqs = run([(None, [("search", {"query": "Guadalajara"})]), ("<answer>Peso</answer>", None)],
                       tool_mode=True, tool_choice="auto")
    assert reqs[0]["body"]["tool_choice"] == "auto" and result["queries"] == ["Guadalajara"]
    assert result["tool_calls"] == 1 and result["calls"] == 2

    seen = {}

    async def fake_episode(task, base_url, api_key, tool_mode=False, tool_choice="search"):
        seen.update(tool_mode=tool_mode, tool_choice=tool_choice)
        return {"reward": 0.1, "components": {"f1": 0.0, "format": 1.0, "correct": 0.0}}

    monkeypatch.setattr(ra, "run_episode", fake_episode)
    ctx = RolloutContext(TASK, TASK["task_id"], "r1", "0", "http://proxy.test/rollouts/r1/attempts/0/v1",
                         api_key="tok")
    ra.rag_agent_tools_auto(ctx)
    assert seen == {"tool_mode": True, "tool_choice": "auto"}


def test_tool_path_third_search_refused():
    result, reqs = run([
        (None, [("search", {"query": "Guadalajara"})]),
        (None, [("search", {"query": "Mexico"})]),
        (None, [("search", {"query": "Mexico currency"})]),
        ("<answer>Mexican Peso</answer>", None),
    ], tool_mode=True)
    assert result["tool_calls"] == ra.MAX_SEARCHES and result["queries"] == ["Guadalajara", "Mexico"]
    last_tool = [m for m in reqs[3]["body"]["messages"] if m["role"] == "tool"][-1]
    assert last_tool["content"] == "Search limit reached. Answer now."
    assert result["reward"] == 1.0


def test_tool_path_too_many_turns_scores_empty():
    replies = [(None, [("search", {"query": "Guadalajara"})])] * (ra.MAX_SEARCHES + 2)
    result, _ = run(replies, tool_mode=True)
    assert result["final_text"] == "" and result["reward"] == 0.0


def test_runner_callable_emits_reward_once(monkeypatch):
    async def fake_episode(task, base_url, api_key, tool_mode=False, tool_choice="search"):
        assert base_url.endswith("/attempts/0/v1") and api_key == "tok" and tool_mode is False
        return {"reward": 0.55, "components": {"f1": 0.5, "format": 1.0, "correct": 0.0}}

    monkeypatch.setattr(ra, "run_episode", fake_episode)
    ctx = RolloutContext(TASK, TASK["task_id"], "r1", "0", "http://proxy.test/rollouts/r1/attempts/0/v1",
                         api_key="tok")
    out = ra.rag_agent(ctx)
    assert out["reward"] == 0.55
    assert [(r["value"], r["final"], r["components"]) for r in ctx.rewards] == [
        (0.55, True, {"f1": 0.5, "format": 1.0, "correct": 0.0})]

    async def inside_loop():  # the sync callable also works from a running event loop
        return ra.rag_agent(ctx)

    asyncio.run(inside_loop())
    assert len(ctx.rewards) == 2


def test_spec_names():
    s = spec.SPEC
    assert s.name == "rag" and s.runner == spec.RUNNER == "examples.rag_agent.agent:rag_agent"
    assert s.train_agents == "query_writer,answerer" and s.agent_names == ("query_writer", "answerer")
    assert (s.train_seed, s.heldout_seed) == (0, 1000)
    assert s.success_component == "correct" and s.format_component == "format"
    assert s.load_runner() is ra.rag_agent
    assert tuple(s.train_agents.split(",")) == s.agent_names == (ra.QUERY_WRITER, ra.ANSWERER)
    assert len(s.tasks("heldout", 3)) == 3
