"""Agent names from the frameworks' own telemetry: which attribute names an agent
(producers/otlp.py span_agent_name), and the trace context an LLM request carries
(producers/instrument.py propagate_trace_context) -- with a real LangGraph graph, the real
OpenInference LangChain instrumentation and langchain-openai's client (httpx2) against a
local HTTP server, no spanrl code in the graph."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import TypedDict

import pytest

from spanrl.producers import instrument
from spanrl.producers.otlp import span_agent_name


def test_span_agent_name_per_framework():
    assert span_agent_name({"spanrl.agent_name": "explicit", "gen_ai.agent.name": "x"}) == "explicit"
    assert span_agent_name({"gen_ai.agent.name": "planner"}) == "planner"  # OTel GenAI semconv
    assert span_agent_name({"agent.name": "answerer", "graph.node.id": "answerer"}) == "answerer"  # Agents SDK
    assert span_agent_name({"graph.node.id": "math_agent"}) == "math_agent"  # AutoGen AgentChat
    meta = json.dumps({"ls_integration": "langgraph", "langgraph_step": 1, "langgraph_node": "write_query"})
    assert span_agent_name({"metadata": meta}) == "write_query"  # LangGraph via OpenInference
    assert span_agent_name({"metadata": json.dumps({"langgraph_node": "__start__"})}) is None
    assert span_agent_name({"metadata": "{not json langgraph_node"}) is None
    assert span_agent_name({"metadata": json.dumps({"ls_integration": "langgraph"})}) is None
    assert span_agent_name({"gen_ai.agent.name": ""}, {"spanrl.agent_name": "from-resource"}) == "from-resource"
    assert span_agent_name({}) is None


class _Completions(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["content-length"]))
        type(self).seen.append(self.headers.get("traceparent"))
        body = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "SELECT 1"}}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def completions_server():
    _Completions.seen = []
    srv = HTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}/v1"
    srv.shutdown()


@pytest.fixture
def langchain_to(completions_server):
    """``instrument(provider)``: OpenInference's LangChain instrumentation writing to
    ``provider`` for this test, whatever an earlier test of the process instrumented it with
    (restored after)."""
    from openinference.instrumentation.langchain import LangChainInstrumentor

    before = "langchain_core" in instrument._instrumented

    def to(provider):
        if "langchain_core" in instrument._instrumented:
            LangChainInstrumentor().uninstrument()
            instrument._instrumented.pop("langchain_core", None)
        instrument.instrument_frameworks(provider)

    yield to
    LangChainInstrumentor().uninstrument()
    instrument._instrumented.pop("langchain_core", None)
    if before:  # back to the process's provider (instrument_frameworks' default)
        instrument.instrument_frameworks()


def test_a_langgraph_nodes_llm_request_carries_the_nodes_trace_context(completions_server, langchain_to):
    """Without propagate_trace_context the request has no traceparent at all (httpx2 is not
    instrumented upstream); with it, its parent is the LangGraph node's span, whose
    OpenInference attributes name the node -- so the proxy's record of the call resolves to
    agent ``write_query``."""
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, StateGraph
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    langchain_to(provider)
    llm = ChatOpenAI(base_url=completions_server, api_key="x", model="m", max_retries=0)

    class State(TypedDict):
        sql: str

    graph = StateGraph(State)
    graph.add_node("write_query", lambda s: {"sql": llm.invoke("question").content})
    graph.add_edge(START, "write_query")
    graph.add_edge("write_query", END)
    assert graph.compile().invoke({"sql": ""}) == {"sql": "SELECT 1"}

    [traceparent] = _Completions.seen
    assert traceparent is not None, "no trace context on the LLM request"
    _, trace_id, parent_id, _ = traceparent.split("-")
    spans = {format(s.context.span_id, "016x"): s for s in exporter.get_finished_spans()}
    parent = spans[parent_id]
    assert format(parent.context.trace_id, "032x") == trace_id
    assert span_agent_name(dict(parent.attributes)) == "write_query"


def test_propagation_keeps_an_existing_traceparent_and_is_idempotent():
    import httpx2

    instrument.propagate_trace_context()
    first = httpx2.Client.send
    assert instrument.propagate_trace_context() == ["httpx.Client", "httpx.AsyncClient",
                                                    "httpx2.Client", "httpx2.AsyncClient"]
    assert httpx2.Client.send is first  # not wrapped twice
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("t")
    seen = []
    transport = httpx2.MockTransport(lambda req: (seen.append(req.headers.get("traceparent")),
                                                  httpx2.Response(200))[1])
    with httpx2.Client(transport=transport) as client:
        client.get("http://x/")  # no span: nothing injected
        with tracer.start_as_current_span("outer") as sp:
            client.get("http://x/")
            client.get("http://x/", headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    assert seen[0] is None
    assert seen[1].split("-")[2] == format(sp.get_span_context().span_id, "016x")
    assert seen[2] == "00-" + "1" * 32 + "-" + "2" * 16 + "-01"


def test_frameworks_follow_the_newest_provider(completions_server, langchain_to):
    """A second ``instrument()`` (another bridge) re-binds the frameworks' instrumentations:
    LangChain's spans go to the newest provider, none to the first -- found when a test's
    ``instrument(..., private bridge)`` left a later runner's framework spans going to a
    bridge that was gone."""
    from langchain_openai import ChatOpenAI
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    first, second = InMemorySpanExporter(), InMemorySpanExporter()
    providers = []
    for exporter in (first, second):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        providers.append(provider)
    langchain_to(providers[0])
    assert "langchain_core" not in instrument.instrument_frameworks(providers[0])  # same provider: kept
    assert "langchain_core" in instrument.instrument_frameworks(providers[1])
    llm = ChatOpenAI(base_url=completions_server, api_key="x", model="m", max_retries=0)
    assert llm.invoke("question").content == "SELECT 1"
    assert first.get_finished_spans() == () and len(second.get_finished_spans()) >= 1
