"""Retrieval (RAG) agent for two-hop questions, written with the OpenAI Agents SDK.

Default path (the paper's Figure 2: retrieval runs in the agent's code between LLM
calls, since SmolLM2-135M cannot emit tool calls through vLLM):

1. agent ``query_writer`` reads the question and writes a search query;
2. :func:`corpus.search` (BM25, Python) returns the top :data:`TOP_K` passages;
3. ``query_writer`` sees the question and those passages and writes a second query
   (the second hop); search again (at most :data:`MAX_SEARCHES` searches);
4. agent ``answerer`` reads the passages (deduplicated, at most :data:`MAX_PASSAGES`)
   and answers inside ``<answer>…</answer>``; :func:`reward.reward` scores it.

A query is the first sentence of the first non-empty line of the reply, with a leading
"Query:" and quotes removed, cut to :data:`MAX_QUERY_WORDS` words; an empty one falls
back to the question.

Tool path (``tool_mode=True``, for tool-capable models): one agent ``researcher`` with
the same search as an Agents SDK ``@function_tool`` named ``search``; its first turn is
forced to call it (``ModelSettings(tool_choice="search")``, which vLLM honours with any
model through structured output: the stack runs it with ``--tool-call-parser hermes``; the
query's ``maxLength`` keeps the forced call within ``max_tokens``; the SDK
resets the choice after the call); a third
search is refused; at most :data:`MAX_SEARCHES` + 2 model calls. With ``tool_choice="auto"``
(:func:`rag_agent_tools_auto`) nothing is forced: whether the model searches at all is its own
choice, which is what the unforced tool-call rate (issue 19) measures.

Every model call goes through ``OpenAIChatCompletionsModel`` (the proxy serves Chat
Completions, not the Responses API) with ``temperature=1.0``, ``max_tokens=64``. No
spanrl header names the agent: tracing is left as the SDK and its instrumentations
configure it (no ``set_tracing_disabled``), spanrl's runner turns on the OpenInference
instrumentation, and the agent of each call is read from the SDK's agent spans.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import re
import time
from dataclasses import dataclass, field
from typing import Annotated, Any

import httpx
from agents import (Agent, MaxTurnsExceeded, ModelSettings, OpenAIChatCompletionsModel, RunConfig,
                    RunContextWrapper, Runner, function_tool, trace)
from openai import AsyncOpenAI
from pydantic import Field

from . import corpus
from .reward import extract_answer, reward

MODEL = "policy"
MAX_TOKENS = 64
TEMPERATURE = 1.0
TOP_K = 3
MAX_SEARCHES = 2
MAX_PASSAGES = 5
MAX_QUERY_WORDS = 8
#: the search tool's ``query`` schema has ``maxLength`` this: vLLM constrains a forced call's
#: arguments to the (strict) schema, so the call ends within ``MAX_TOKENS`` (an unbounded
#: string from the base model ran past 64 tokens in 1 of 8 runs and no call was parsed)
MAX_QUERY_CHARS = 40
#: the search tool's name, and the tool path's default first-turn ``tool_choice`` (forced search)
SEARCH_TOOL = "search"
#: the tool path's first-turn choices: forced search, or the model's own choice
TOOL_CHOICES = (SEARCH_TOOL, "auto")
WORKFLOW = "rag_agent"

QUERY_WRITER = "query_writer"
ANSWERER = "answerer"
RESEARCHER = "researcher"

QUERY_PROMPT = "Write a search query of a few words for the fact still missing. Reply with the query only."
ANSWER_PROMPT = "Answer the question using the passages. Reply with <answer>a few words</answer> only."
RESEARCH_PROMPT = ("Use the search tool to look up facts; search again for the second fact you need. "
                   "Then reply with <answer>a few words</answer> only.")

#: worked turns each agent starts with (a 135M model follows a demonstration far more
#: often than an instruction). The entities are invented: no task or passage has them.
_SHOT_CITY = "Tessaly is a city in Valdoria. Population: 1.2 million. Location: 40.1 N, 20.3 E."
_SHOT_COUNTRY = ("Valdoria is a country in Europe. Its capital is Marenport. Its currency is the "
                 "Valdorian Crown (VDC). Languages: Valdorian.")
_SHOT_QUESTION = "What currency is used in the country where Tessaly is?"


def query_input(question: str, found: list[dict[str, str]]) -> str:
    """The query writer's user message: the question, and the passages found so far."""
    if not found:
        return f"Question: {question}\nQuery:"
    lines = "\n".join(p["text"] for p in found)
    return f"Question: {question}\nFound:\n{lines}\nNext query:"


def answer_input(question: str, passages: list[dict[str, str]]) -> str:
    lines = "\n".join(f"({i}) {p['text']}" for i, p in enumerate(passages, 1))
    return f"Passages:\n{lines}\nQuestion: {question}"


_SHOT_QUESTION_2 = "Name a language spoken in the country whose capital is Marenport."
_SHOT_CAPITAL = "Marenport is the capital of Valdoria. Population: 2.3 million. Location: 41.0 N, 19.8 E."
QUERY_SHOTS = [
    {"role": "user", "content": query_input(_SHOT_QUESTION, [])},
    {"role": "assistant", "content": "Tessaly"},
    {"role": "user", "content": query_input(_SHOT_QUESTION, [{"text": _SHOT_CITY}])},
    {"role": "assistant", "content": "Valdoria currency"},
    {"role": "user", "content": query_input(_SHOT_QUESTION_2, [])},
    {"role": "assistant", "content": "Marenport"},
    {"role": "user", "content": query_input(_SHOT_QUESTION_2, [{"text": _SHOT_CAPITAL}])},
    {"role": "assistant", "content": "Valdoria language"},
]
_SHOT_PASSAGES = [{"text": _SHOT_CITY}, {"text": _SHOT_COUNTRY}]
ANSWER_SHOTS = [
    {"role": "user", "content": answer_input(_SHOT_QUESTION, _SHOT_PASSAGES)},
    {"role": "assistant", "content": "<answer>Valdorian Crown</answer>"},
    {"role": "user", "content": answer_input("What is the capital of the country where Tessaly is?", _SHOT_PASSAGES)},
    {"role": "assistant", "content": "<answer>Marenport</answer>"},
]

_QUERY_PREFIX = re.compile(r"^\s*(?:next\s+)?(?:search\s+)?query\s*:\s*", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.?!;](?:\s|$)")


def parse_query(reply: str | None, fallback: str) -> str:
    """The search query in a query writer's reply (``fallback`` when there is none)."""
    text = re.sub(r"</?query>", " ", reply or "", flags=re.IGNORECASE)
    for line in text.splitlines():
        line = _SENTENCE_END.split(_QUERY_PREFIX.sub("", line), maxsplit=1)[0].strip().strip("\"'`").strip()
        if line:
            return " ".join(line.split()[:MAX_QUERY_WORDS])
    return fallback


def _settings(agent_name: str, **overrides: Any) -> ModelSettings:
    return ModelSettings(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, **overrides)


def make_model(base_url: str, api_key: str, http_client: httpx.AsyncClient | None = None
               ) -> tuple[OpenAIChatCompletionsModel, AsyncOpenAI]:
    """The policy behind ``base_url`` as an Agents SDK model, and its client (to close)."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client)
    return OpenAIChatCompletionsModel(model=MODEL, openai_client=client), client


def make_agents(model: OpenAIChatCompletionsModel, tool_choice: str = SEARCH_TOOL) -> dict[str, Agent]:
    """The three agents, by their stable names; ``tool_choice`` is the researcher's first turn's
    (``"search"``: forced, ``"auto"``: the model's choice)."""
    return {
        QUERY_WRITER: Agent(name=QUERY_WRITER, instructions=QUERY_PROMPT, model=model,
                            model_settings=_settings(QUERY_WRITER)),
        ANSWERER: Agent(name=ANSWERER, instructions=ANSWER_PROMPT, model=model,
                        model_settings=_settings(ANSWERER)),
        RESEARCHER: Agent(name=RESEARCHER, instructions=RESEARCH_PROMPT, model=model, tools=[search_tool],
                          model_settings=_settings(RESEARCHER, tool_choice=tool_choice)),
    }


@dataclass
class SearchLog:
    """What one episode searched: the queries and the passages found, in order."""

    queries: list[str] = field(default_factory=list)
    found: list[dict[str, str]] = field(default_factory=list)

    def search(self, query: str) -> list[dict[str, str]]:
        hits = corpus.search(query, TOP_K)
        self.queries.append(query)
        self.found += [h for h in hits if h["id"] not in {p["id"] for p in self.found}]
        return hits


@function_tool(name_override=SEARCH_TOOL)
def search_tool(ctx: RunContextWrapper[SearchLog], query: Annotated[str, Field(max_length=MAX_QUERY_CHARS)]) -> str:
    """Search an encyclopedia of countries and cities; returns the best passages.

    Args:
        query: a few keywords, e.g. a city name, or a country name and the fact wanted.
    """
    log = ctx.context
    if len(log.queries) >= MAX_SEARCHES:
        return "Search limit reached. Answer now."
    hits = log.search(query)
    return "\n".join(h["text"] for h in hits) or "No passage found."


async def _text(agent: Agent, items: list[dict[str, str]], run_config: RunConfig) -> tuple[str, int]:
    result = await Runner.run(agent, items, max_turns=1, run_config=run_config)
    return str(result.final_output or ""), len(result.raw_responses)


async def _pipeline(task: dict[str, Any], agents: dict[str, Agent], log: SearchLog, run_config: RunConfig,
                    hops: int) -> tuple[str, int, list[dict[str, str]]]:
    """Default path; returns ``(final text, model calls, transcript)``."""
    question, calls, transcript = task["question"], 0, []
    for _ in range(min(hops, MAX_SEARCHES)):
        message = query_input(question, log.found[:TOP_K])
        reply, n = await _text(agents[QUERY_WRITER], QUERY_SHOTS + [{"role": "user", "content": message}],
                               run_config)
        calls += n
        transcript.append({"agent": QUERY_WRITER, "input": message, "output": reply})
        log.search(parse_query(reply, question))
    message = answer_input(question, log.found[:MAX_PASSAGES])
    final, n = await _text(agents[ANSWERER], ANSWER_SHOTS + [{"role": "user", "content": message}], run_config)
    transcript.append({"agent": ANSWERER, "input": message, "output": final})
    return final, calls + n, transcript


async def _research(task: dict[str, Any], agents: dict[str, Agent], log: SearchLog, run_config: RunConfig
                    ) -> tuple[str, int, list[dict[str, str]]]:
    """Tool path; a run that exceeds its turns ends with an empty answer."""
    try:
        result = await Runner.run(agents[RESEARCHER], task["question"], context=log,
                                  max_turns=MAX_SEARCHES + 2, run_config=run_config)
    except MaxTurnsExceeded:
        return "", MAX_SEARCHES + 2, []
    final = str(result.final_output or "")
    return final, len(result.raw_responses), [{"agent": RESEARCHER, "input": task["question"], "output": final}]


async def run_episode(task: dict[str, Any], base_url: str, api_key: str = "spanrl", *, tool_mode: bool = False,
                      hops: int = MAX_SEARCHES, http_client: httpx.AsyncClient | None = None,
                      tool_choice: str = SEARCH_TOOL) -> dict[str, Any]:
    """Run one episode of ``task`` against ``base_url`` and score its final text.

    Returns ``{"answer", "final_text", "queries", "tool_calls", "retrieved", "calls",
    "reward", "components", "transcript", "mode"}``; ``tool_calls`` is the number of
    searches run, ``retrieved`` the ids of the passages found. ``tool_choice`` is the tool
    path's first turn's (``"search"`` forced, ``"auto"`` unforced). ``http_client`` is for
    tests (an ``httpx.MockTransport``).
    """
    model, client = make_model(base_url, api_key, http_client)
    agents = make_agents(model, tool_choice)
    run_config = RunConfig(workflow_name=WORKFLOW, group_id=str(task.get("task_id", "")) or None)
    log = SearchLog()
    try:
        with trace(WORKFLOW, group_id=run_config.group_id):  # one trace for the episode's runs
            if tool_mode:
                final, calls, transcript = await _research(task, agents, log, run_config)
            else:
                final, calls, transcript = await _pipeline(task, agents, log, run_config, hops)
    finally:
        await client.close()
    value, components = reward(final, task)
    return {
        "answer": extract_answer(final)[0],
        "final_text": final,
        "queries": list(log.queries),
        "tool_calls": len(log.queries),
        "retrieved": [p["id"] for p in log.found],
        "calls": calls,
        "reward": value,
        "components": components,
        "transcript": transcript,
        "mode": "tool" if tool_mode else "pipeline",
    }


def _episode_sync(ctx: Any, tool_mode: bool, tool_choice: str = SEARCH_TOOL) -> dict[str, Any]:
    episode = run_episode(ctx.task, ctx.base_url, ctx.api_key, tool_mode=tool_mode, tool_choice=tool_choice)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        result = asyncio.run(episode)
    else:  # inside a running loop: run the episode's own loop in a worker thread
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as worker:
            result = worker.submit(asyncio.run, episode).result()
    ctx.emit_reward(result["reward"], final=True, **result["components"])
    return result


def rag_agent(ctx: Any) -> dict[str, Any]:
    """spanrl runner callable (default path): runs ``ctx.task`` against ``ctx.base_url``
    with ``ctx.api_key``, emits the final reward with its components (``f1``, ``format``,
    ``correct``) and returns the episode dict (not a float: the runner emits nothing more)."""
    return _episode_sync(ctx, tool_mode=False)


def rag_agent_tools(ctx: Any) -> dict[str, Any]:
    """As :func:`rag_agent`, on the tool path (for a tool-capable model)."""
    return _episode_sync(ctx, tool_mode=True)


def rag_agent_tools_auto(ctx: Any) -> dict[str, Any]:
    """As :func:`rag_agent_tools` with ``tool_choice="auto"``: the model decides whether to call
    ``search`` at all (the episode's ``tool_calls`` counts the searches it chose; evaluation's
    tool-use rate is then the unforced tool-call rate)."""
    return _episode_sync(ctx, tool_mode=True, tool_choice="auto")


async def rag_agent_async(ctx: Any, tool_mode: bool = False) -> dict[str, Any]:
    """Async form of :func:`rag_agent`."""
    result = await run_episode(ctx.task, ctx.base_url, ctx.api_key, tool_mode=tool_mode)
    ctx.emit_reward(result["reward"], final=True, **result["components"])
    return result


async def _main() -> None:
    from .tasks import HELDOUT_SEED, TRAIN_SEED, load_tasks

    ap = argparse.ArgumentParser(description="Run rag-agent episodes against an OpenAI-compatible base URL.")
    ap.add_argument("--base-url", default="http://127.0.0.1:18000/v1")
    ap.add_argument("--api-key", default="spanrl")
    ap.add_argument("--split", choices=["train", "heldout"], default="heldout")
    ap.add_argument("--seed", type=int, default=None, help="default: TRAIN_SEED or HELDOUT_SEED of the split")
    ap.add_argument("-n", "--episodes", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--tool-mode", action="store_true", help="the researcher agent with the search tool")
    ap.add_argument("--tool-choice", choices=TOOL_CHOICES, default=SEARCH_TOOL,
                    help="tool mode: force the first search, or leave it to the model")
    ap.add_argument("--verbose", action="store_true", help="print every model call")
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else (TRAIN_SEED if args.split == "train" else HELDOUT_SEED)
    sem = asyncio.Semaphore(args.concurrency)

    async def one(task: dict[str, Any]) -> dict[str, Any]:
        async with sem:
            started = time.perf_counter()
            episode = await run_episode(task, args.base_url, args.api_key, tool_mode=args.tool_mode,
                                        tool_choice=args.tool_choice)
            return {**episode, "task_id": task["task_id"], "gold": task["answers"],
                    "support_found": sum(s in episode["retrieved"] for s in task["support"]),
                    "seconds": round(time.perf_counter() - started, 2)}

    episodes = await asyncio.gather(*(one(t) for t in load_tasks(args.split, seed, args.episodes)))
    for e in episodes:
        print(json.dumps({k: e[k] for k in ("task_id", "gold", "answer", "queries", "support_found", "reward",
                                            "components", "calls", "seconds")}))
        for step in e["transcript"] if args.verbose else []:
            print(f"  [{step['agent']}] {step['input']!r}\n    -> {step['output']!r}")
    n = len(episodes)
    mean = lambda f: round(sum(f(e) for e in episodes) / n, 4)  # noqa: E731
    print(json.dumps({"episodes": n, "mean_reward": mean(lambda e: e["reward"]),
                      "format_rate": mean(lambda e: e["components"]["format"]),
                      "mean_f1": mean(lambda e: e["components"]["f1"]),
                      "correct_rate": mean(lambda e: e["components"]["correct"]),
                      "both_support_found": mean(lambda e: e["support_found"] == 2),
                      "mean_seconds": mean(lambda e: e["seconds"])}))


if __name__ == "__main__":
    asyncio.run(_main())
