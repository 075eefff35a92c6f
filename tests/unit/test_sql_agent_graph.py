"""The SQL agent's LangGraph graph against scripted chat models (no server).

A ``FakeListChatModel`` answers each LLM call in turn; a callback handler records which
LangGraph node each call ran in (what spanrl's agent resolution reads from the LangChain
telemetry) and the messages it sent. A mock OpenAI endpoint checks the wire format of the
real ``ChatOpenAI`` client.
"""
import asyncio
import json

import httpx
import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.language_models.fake_chat_models import FakeListChatModel

from examples.sql_agent import agent as A
from examples.sql_agent import spec
from spanrl.producers.runner import RolloutContext

TASK = {
    "task_id": "sql-chinook-tracks_in_genre-test", "db": "chinook",
    "question": "How many tracks belong to the genre 'Jazz'?",
    "gold_sql": "SELECT COUNT(*) FROM Track JOIN Genre ON Track.GenreId = Genre.GenreId WHERE Genre.Name = 'Jazz'",
    "ordered": False, "tables": ["Genre", "Track"], "level": "hard", "template": "tracks_in_genre",
}
GOLD_REPLY = f"```sql\n{TASK['gold_sql']};\n```"
WRONG_REPLY = "```sql\nSELECT COUNT(*) FROM Track;\n```"


class NodeRecorder(BaseCallbackHandler):
    def __init__(self):
        self.calls = []

    def on_chat_model_start(self, serialized, messages, *, metadata=None, **kwargs):
        self.calls.append({"node": (metadata or {}).get("langgraph_node"), "messages": messages[0]})


def scripted(replies):
    recorder = NodeRecorder()
    return FakeListChatModel(responses=list(replies), callbacks=[recorder]), recorder


def test_ok_verdict_ends_without_rewrite():
    llm, rec = scripted([GOLD_REPLY, "VERDICT: OK\nIt counts the Jazz tracks."])
    r = A.run_episode(TASK, llm=llm)
    assert [c["node"] for c in rec.calls] == ["write_query", "check_query"]
    assert r["rewrites"] == 0 and r["tool_calls"] == 1 and r["calls"] == 2 and r["verdict"] == "OK"
    assert r["reward"] == 1.0
    assert r["components"] == {"correct": 1.0, "format": 1.0, "executed": 1.0}
    assert r["sql"] == TASK["gold_sql"] and r["result"] == "[(130,)]"
    # the writer saw the schema of the task's tables only, after two worked examples
    write = rec.calls[0]["messages"]
    assert [m.type for m in write] == ["system", "human", "ai", "human", "ai", "human"]
    assert write[-1].content == ("Tables:\nGenre(GenreId, Name)\nTrack(TrackId, Name, AlbumId -> Album.AlbumId, "
                                 "MediaTypeId -> MediaType.MediaTypeId, GenreId -> Genre.GenreId, Composer, "
                                 "Milliseconds, Bytes, UnitPrice)\nQuestion: How many tracks belong to the genre 'Jazz'?")
    # the checker saw the query and its result
    assert rec.calls[1]["messages"][-1].content == (
        f"Question: {TASK['question']}\nSQL: {TASK['gold_sql']}\nResult: [(130,)]\n"
        "Is the SQL right? Start with VERDICT: OK or VERDICT: WRONG.")


def test_wrong_verdict_rewrites_and_reexecutes():
    llm, rec = scripted([WRONG_REPLY, "VERDICT: WRONG\nIt counts every track.", GOLD_REPLY, "VERDICT: OK"])
    r = A.run_episode(TASK, llm=llm)
    assert [c["node"] for c in rec.calls] == ["write_query", "check_query", "rewrite_query", "check_query"]
    assert r["rewrites"] == 1 and r["tool_calls"] == 2 and r["verdict"] == "OK"
    assert r["reward"] == 1.0 and r["sql"] == TASK["gold_sql"]
    rewrite = rec.calls[2]["messages"][-1].content
    assert "Wrong SQL: SELECT COUNT(*) FROM Track\nResult: [(3503,)]\nChecker: VERDICT: WRONG\nIt counts every track." \
        in rewrite
    assert [m["node"] for m in r["transcript"]] == [
        "write_query", "write_query", "execute", "check_query", "check_query",
        "rewrite_query", "rewrite_query", "execute", "check_query", "check_query"]


def test_turn_limit_holds_and_final_query_is_scored():
    # the checker never approves: two rewrites, then the episode ends on the last query
    replies = [WRONG_REPLY, "VERDICT: WRONG", "SELECT Name FROM Genre", "VERDICT: WRONG",
               "SELECT GenreId FROM Genre WHERE Name = 'Jazz'", "VERDICT: WRONG", "never asked"]
    llm, rec = scripted(replies)
    r = A.run_episode(TASK, llm=llm)
    assert [c["node"] for c in rec.calls] == ["write_query", "check_query", "rewrite_query", "check_query",
                                              "rewrite_query", "check_query"]
    assert r["rewrites"] == 2 and r["tool_calls"] == 3 and r["verdict"] == "WRONG"
    assert r["sql"] == "SELECT GenreId FROM Genre WHERE Name = 'Jazz'" and r["result"] == "[(2,)]"
    assert r["reward"] == 0.1 and r["components"] == {"correct": 0.0, "format": 1.0, "executed": 1.0}
    # max_rewrites=0: one query, checked, never rewritten
    llm, rec = scripted([WRONG_REPLY, "VERDICT: WRONG"])
    r = A.run_episode(TASK, llm=llm, max_rewrites=0)
    assert [c["node"] for c in rec.calls] == ["write_query", "check_query"] and r["rewrites"] == 0


def test_no_sql_and_unparsable_verdict():
    # no query in the reply: execute records the miss, the checker's reply has no verdict line
    # -> WRONG because nothing ran; the rewrite's query fails in SQLite: no reward
    llm, rec = scripted(["I am not sure.", "Looks fine to me", "SELECT Nme FROM Genre", "VERDICT: OK"])
    r = A.run_episode(TASK, llm=llm)
    assert [c["node"] for c in rec.calls] == ["write_query", "check_query", "rewrite_query", "check_query"]
    assert "SQL: I am not sure.\nResult: error: no SQL query found in the reply\n" in rec.calls[1]["messages"][-1].content
    assert r["sql"] == "SELECT Nme FROM Genre" and r["result"] == "error: OperationalError: no such column: Nme"
    assert r["reward"] == 0.0 and r["components"] == {"correct": 0.0, "format": 1.0, "executed": 0.0}
    llm, _ = scripted(["no idea", "VERDICT: OK"])
    r = A.run_episode(TASK, llm=llm)
    assert r["sql"] is None and r["components"] == {"correct": 0.0, "format": 0.0, "executed": 0.0}


def test_verdict_parsing():
    ok = A.dbs.Execution([(1,)])
    assert A.parse_verdict("VERDICT: OK", ok) == "OK"
    assert A.parse_verdict("verdict - wrong. The join is missing", ok) == "WRONG"
    assert A.parse_verdict("**VERDICT:** CORRECT", ok) == "OK"
    assert A.parse_verdict("I think so", ok) == "OK"
    assert A.parse_verdict("I think so", A.dbs.Execution([])) == "WRONG"
    assert A.parse_verdict("I think so", A.dbs.Execution(None, "boom")) == "WRONG"


def test_runner_callables_emit_the_final_reward(monkeypatch):
    for callable_ in (A.sql_agent, lambda ctx: asyncio.run(A.sql_agent_async(ctx))):
        llm, rec = scripted([GOLD_REPLY, "VERDICT: OK"])
        monkeypatch.setattr(A, "make_llm", lambda base_url, api_key, **kw: llm)
        ctx = RolloutContext(TASK, TASK["task_id"], "r1", "0", "http://unused.test/v1")
        result = callable_(ctx)
        assert [c["node"] for c in rec.calls] == ["write_query", "check_query"]
        assert result["reward"] == 1.0 and result["rewrites"] == 0 and result["tool_calls"] == 1
        assert [(r["value"], r["final"]) for r in ctx.rewards] == [(1.0, True)]
        assert ctx.rewards[0]["components"] == {"correct": 1.0, "format": 1.0, "executed": 1.0}
        json.dumps({k: v for k, v in result.items()})  # the episode dict is JSON-serialisable


def chat_response(content):
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "policy",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def test_chat_openai_on_the_wire(monkeypatch):
    """The real client through sql_agent(ctx): model, sampling, base URL, api key, and no
    spanrl header (the agent name comes from the telemetry, not from the agent)."""
    requests, replies = [], [GOLD_REPLY, "VERDICT: OK"]

    def handler(request):
        requests.append({"url": str(request.url), "headers": dict(request.headers),
                         "body": json.loads(request.content)})
        return httpx.Response(200, json=chat_response(replies.pop(0)))

    real = A.make_llm
    monkeypatch.setattr(A, "make_llm", lambda base_url, api_key, **kw: real(
        base_url, api_key, http_client=httpx.Client(transport=httpx.MockTransport(handler)), **kw))
    ctx = RolloutContext(TASK, TASK["task_id"], "r1", "0", "http://proxy.test/rollouts/r1/attempts/0/v1",
                         api_key="tok")
    result = A.sql_agent(ctx)
    assert result["reward"] == 1.0 and ctx.rewards[0]["components"]["correct"] == 1.0
    assert len(requests) == 2
    for req in requests:
        assert req["url"] == "http://proxy.test/rollouts/r1/attempts/0/v1/chat/completions"
        assert req["headers"]["authorization"] == "Bearer tok"
        assert not any(h.startswith("x-spanrl") for h in req["headers"])
        body = req["body"]
        assert body["model"] == "policy" and body["temperature"] == 1.0
        assert body.get("max_tokens", body.get("max_completion_tokens")) == 96
    assert requests[0]["body"]["messages"][0] == {"role": "system", "content": A.WRITE_SYSTEM}
    assert requests[1]["body"]["messages"][0] == {"role": "system", "content": A.CHECK_SYSTEM}


def test_spec_names_the_graph_nodes():
    s = spec.SPEC
    assert s.name == "sql" and s.runner == spec.RUNNER == "examples.sql_agent.agent:sql_agent"
    assert s.load_runner() is A.sql_agent
    assert s.agent_names == ("write_query", "check_query", "rewrite_query")
    assert set(s.agent_names) <= set(A.NODES) and "execute" not in s.agent_names
    assert s.train_agents.split(",") == ["write_query", "rewrite_query"]
    assert (s.success_component, s.format_component) == ("correct", "format")
    assert (s.train_seed, s.heldout_seed) == (0, 1000)
    assert s.tasks("train", 2)[0]["db"] == "chinook"


def test_executions_are_tool_spans_failed_on_sql_errors(monkeypatch):
    """``execute`` runs each query inside a tool span (GenAI ``execute_tool sql``): no query and
    a query SQLite refuses fail it (``error.type`` SQLError: AIR's tool_error fact), the gold
    query does not (tool_ok)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from spanrl.producers import instrument
    from spanrl.producers.otlp import span_kind
    from spanrl.stream_jobs.air import span_facts

    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(instrument.trace, "get_tracer", lambda name, *a, **k: provider.get_tracer(name))
    llm, _ = scripted(["I am not sure.", "VERDICT: WRONG", "SELECT Nme FROM Genre", "VERDICT: WRONG",
                       GOLD_REPLY, "VERDICT: OK"])
    A.run_episode(TASK, llm=llm)
    spans = [s for s in exporter.get_finished_spans() if s.name == "execute_tool sql"]
    assert [s.attributes["gen_ai.tool.call.arguments"] for s in spans] == ["", "SELECT Nme FROM Genre", TASK["gold_sql"]]
    assert [s.attributes.get("error.type") for s in spans] == ["SQLError", "SQLError", None]
    records = [{"kind": span_kind(s.name, dict(s.attributes)), "status_code": s.status.status_code.name,
                "attributes": dict(s.attributes)} for s in spans]
    assert [span_facts(r) for r in records] == [["tool_error"], ["tool_error"], ["tool_ok"]]
