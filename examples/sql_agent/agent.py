"""Text-to-SQL team (the paper's Spider setup, arXiv 2508.03680 s4.1) written with LangGraph.

One policy model plays three roles, each a LangGraph node with its own prompt::

    START -> write_query -> execute -> check_query --OK or turn limit--> END
                               ^            |
                               |          WRONG
                               +-- rewrite_query <-+

* ``write_query`` (LLM): schema summary of the question's tables + question -> SQL.
* ``execute`` (Python, no LLM): runs the query on this rollout's copy of the database,
  read-only, time-limited, row-capped (:func:`db.run_query`).
* ``check_query`` (LLM): question + query + result -> ``VERDICT: OK`` / ``VERDICT: WRONG``
  and a reason. No verdict line: WRONG when the query failed or returned no rows, else OK.
* ``rewrite_query`` (LLM): schema + question + the query, its result and the checker's
  reply -> a corrected query; at most ``max_rewrites`` (2) times, then the episode ends.

The LLM calls are plain LangChain ``ChatOpenAI`` calls to the rollout's ``base_url``:
nothing spanrl-specific is sent. spanrl tells the roles apart from the framework's own
telemetry (OpenInference LangChain spans are named after the LangGraph node each call runs
in), so each call is made inside the node of its role. The final query (from the last
writer reply: ``write_query`` or the last ``rewrite_query``) is scored by execution match
against the gold query (:func:`reward.reward`). Sampling: ``temperature=1.0``,
``max_tokens=96`` (SmolLM2-135M-Instruct, 2k context: short prompts, two worked examples
per role as chat turns).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import operator
import re
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph

from spanrl.producers import instrument

from . import db as dbs
from .reward import extract_sql, reward

MODEL = "policy"  # the name the stack's vLLM serves the policy under (as math_agent)
TEMPERATURE = 1.0
MAX_TOKENS = 96
MAX_REWRITES = 2
RESULT_ROWS_SHOWN = 5
RESULT_CHARS_SHOWN = 300
FEEDBACK_CHARS_SHOWN = 120
NODES = ("write_query", "execute", "check_query", "rewrite_query")

# ---- prompts: two worked examples per role, on a pets database no task uses ----------------
# (measured on the base model at temperature 1.0: a second writer example, a single-table one,
# raised replies with a parseable query 0.42 -> 0.58 over 24 episodes; asking the checker for
# the verdict line raised replies with one 0.25 -> 0.67; see examples/sql_agent/README.md)

EXAMPLE_SCHEMA = "Owner(OwnerId, Name)\nPet(PetId, Name, Species, OwnerId -> Owner.OwnerId)"
EXAMPLE_QUESTION = "How many pets does the owner 'Ann' have?"
EXAMPLE_SQL = "SELECT COUNT(*) FROM Pet JOIN Owner ON Pet.OwnerId = Owner.OwnerId WHERE Owner.Name = 'Ann'"
EXAMPLE_WRONG_SQL = "SELECT COUNT(*) FROM Pet WHERE Name = 'Ann'"

WRITE_SYSTEM = ("You write one SQLite query that answers the question. Use only the tables and columns "
                "given. Reply with the SQL only, in a ```sql block.")
CHECK_SYSTEM = ("You check a SQLite query. Does it answer the question? Look at the query and its result. "
                "Reply with one line VERDICT: OK or VERDICT: WRONG, then one short reason.")
REWRITE_SYSTEM = ("You fix a wrong SQLite query. Use only the tables and columns given. "
                  "Reply with the corrected SQL only, in a ```sql block.")

VERDICT_RE = re.compile(r"VERDICT\s*[:=-]?\s*\**\s*(OK|CORRECT|WRONG|INCORRECT)", re.IGNORECASE)


def write_prompt(schema: str, question: str) -> str:
    return f"Tables:\n{schema}\nQuestion: {question}"


def check_prompt(question: str, sql: str, result: str) -> str:
    return f"Question: {question}\nSQL: {sql}\nResult: {result}\nIs the SQL right? Start with VERDICT: OK or VERDICT: WRONG."


def rewrite_prompt(schema: str, question: str, sql: str, result: str, feedback: str) -> str:
    return f"Tables:\n{schema}\nQuestion: {question}\nWrong SQL: {sql}\nResult: {result}\nChecker: {feedback}"


def fenced(sql: str) -> str:
    return f"```sql\n{sql};\n```"


WRITE_SHOT = [HumanMessage(write_prompt("Pet(PetId, Name, Species, Age)", "How many pets are of the species 'cat'?")),
              AIMessage(fenced("SELECT COUNT(*) FROM Pet WHERE Species = 'cat'")),
              HumanMessage(write_prompt(EXAMPLE_SCHEMA, EXAMPLE_QUESTION)), AIMessage(fenced(EXAMPLE_SQL))]
#: an approved query, then a rejected one: the last shot is the one a small model copies,
#: and a rejection is what starts a rewrite
CHECK_SHOT = [HumanMessage(check_prompt(EXAMPLE_QUESTION, EXAMPLE_SQL, "[(2,)]")),
              AIMessage("VERDICT: OK\nIt joins Owner and counts Ann's pets."),
              HumanMessage(check_prompt(EXAMPLE_QUESTION, EXAMPLE_WRONG_SQL, "[(0,)]")),
              AIMessage("VERDICT: WRONG\nIt counts pets named Ann; it must join Owner and filter Owner.Name.")]
REWRITE_SHOT = [HumanMessage(rewrite_prompt("Pet(PetId, Name, Species, Age)", "How many pets are of the species 'cat'?",
                                            "SELECT COUNT(*) FROM Pet WHERE Kind = 'cat'",
                                            "error: no such column: Kind", "VERDICT: WRONG\nThere is no column Kind.")),
                AIMessage(fenced("SELECT COUNT(*) FROM Pet WHERE Species = 'cat'")),
                HumanMessage(rewrite_prompt(EXAMPLE_SCHEMA, EXAMPLE_QUESTION, EXAMPLE_WRONG_SQL, "[(0,)]",
                                            "VERDICT: WRONG\nIt must join Owner and filter Owner.Name.")),
                AIMessage(fenced(EXAMPLE_SQL))]


def short_feedback(reply: str, limit: int = FEEDBACK_CHARS_SHOWN) -> str:
    """The checker's reply as the rewriter sees it: its first two lines, at most ``limit`` chars."""
    lines = [line.strip() for line in (reply or "").strip().splitlines() if line.strip()]
    return "\n".join(lines[:2])[:limit] or "(no reason given)"


def format_result(execution: dbs.Execution) -> str:
    """What the checker and the rewriter see of an execution (a few rows, or the error)."""
    if not execution.ok:
        return f"error: {execution.error}"[:RESULT_CHARS_SHOWN]
    rows = execution.rows or []
    text = repr(rows[:RESULT_ROWS_SHOWN])
    if len(rows) > RESULT_ROWS_SHOWN or execution.truncated:
        text += f" ({'over ' if execution.truncated else ''}{len(rows)} rows)"
    return text if len(text) <= RESULT_CHARS_SHOWN else text[:RESULT_CHARS_SHOWN] + "…"


def parse_verdict(reply: str, execution: dbs.Execution | None = None) -> str:
    """``OK`` or ``WRONG`` from the checker's reply (the first VERDICT line); without one,
    WRONG when the query failed or returned no rows, else OK."""
    m = VERDICT_RE.search(reply or "")
    if m:
        return "OK" if m.group(1).upper() in ("OK", "CORRECT") else "WRONG"
    failed = execution is None or not execution.ok or not execution.rows
    return "WRONG" if failed else "OK"


# ---- the graph ------------------------------------------------------------------------------

class SQLState(TypedDict, total=False):
    question: str
    schema: str
    reply: str                   # the last writer reply (write_query or rewrite_query)
    sql: str | None              # the query extracted from it (None: none found)
    execution: dbs.Execution
    feedback: str                # the checker's last reply
    verdict: str                 # OK | WRONG
    rewrites: int
    tool_calls: int              # executions
    transcript: Annotated[list[dict[str, str]], operator.add]


def _messages(system: str, shot: list[BaseMessage], prompt: str) -> list[BaseMessage]:
    return [SystemMessage(system), *shot, HumanMessage(prompt)]


def _say(node: str, prompt: str, reply: str) -> list[dict[str, str]]:
    return [{"node": node, "role": "user", "content": prompt}, {"node": node, "role": "assistant", "content": reply}]


def build_graph(llm: BaseChatModel, db_path: Path, max_rewrites: int = MAX_REWRITES):
    """The compiled LangGraph graph over ``db_path`` (a rollout's copy). Node names are the
    agent names spanrl resolves: ``write_query``, ``check_query``, ``rewrite_query`` (LLM) and
    ``execute`` (no LLM)."""

    def write_query(state: SQLState) -> dict:
        prompt = write_prompt(state["schema"], state["question"])
        reply = str(llm.invoke(_messages(WRITE_SYSTEM, WRITE_SHOT, prompt)).content)
        return {"reply": reply, "sql": extract_sql(reply), "transcript": _say("write_query", prompt, reply)}

    def execute(state: SQLState) -> dict:
        sql = state.get("sql")
        # a tool span per execution, failed on an execution error: AIR's tool_error fact
        with instrument.tool_span("sql", sql or "") as span:
            execution = (dbs.run_query(db_path, sql) if sql
                         else dbs.Execution(None, "no SQL query found in the reply"))
            if execution.error:  # a query stopped at the time limit is AIR's timeout fact too
                instrument.tool_failed(span, "timeout" if execution.timed_out else "SQLError", execution.error)
        return {"execution": execution, "tool_calls": state.get("tool_calls", 0) + 1,
                "transcript": [{"node": "execute", "role": "tool", "content": format_result(execution)}]}

    def check_query(state: SQLState) -> dict:
        prompt = check_prompt(state["question"], _shown_sql(state), format_result(state["execution"]))
        reply = str(llm.invoke(_messages(CHECK_SYSTEM, CHECK_SHOT, prompt)).content)
        return {"feedback": reply, "verdict": parse_verdict(reply, state["execution"]),
                "transcript": _say("check_query", prompt, reply)}

    def rewrite_query(state: SQLState) -> dict:
        prompt = rewrite_prompt(state["schema"], state["question"], _shown_sql(state),
                                format_result(state["execution"]), short_feedback(state.get("feedback", "")))
        reply = str(llm.invoke(_messages(REWRITE_SYSTEM, REWRITE_SHOT, prompt)).content)
        return {"reply": reply, "sql": extract_sql(reply), "rewrites": state.get("rewrites", 0) + 1,
                "transcript": _say("rewrite_query", prompt, reply)}

    def after_check(state: SQLState) -> str:
        if state["verdict"] == "WRONG" and state.get("rewrites", 0) < max_rewrites:
            return "rewrite_query"
        return END

    graph = StateGraph(SQLState)
    graph.add_node("write_query", write_query)
    graph.add_node("execute", execute)
    graph.add_node("check_query", check_query)
    graph.add_node("rewrite_query", rewrite_query)
    graph.add_edge(START, "write_query")
    graph.add_edge("write_query", "execute")
    graph.add_edge("execute", "check_query")
    graph.add_conditional_edges("check_query", after_check, ["rewrite_query", END])
    graph.add_edge("rewrite_query", "execute")
    return graph.compile()


def _shown_sql(state: SQLState) -> str:
    """The query as the checker / rewriter see it: the extracted SQL, else the raw reply."""
    return state.get("sql") or (state.get("reply") or "").strip()[:200] or "(none)"


# ---- one episode ----------------------------------------------------------------------------

def make_llm(base_url: str, api_key: str = "spanrl", **overrides: Any) -> ChatOpenAI:
    """The policy as a LangChain user configures it: an OpenAI-compatible endpoint."""
    kwargs: dict[str, Any] = dict(model=MODEL, base_url=base_url, api_key=api_key, temperature=TEMPERATURE,
                                  max_tokens=MAX_TOKENS, max_retries=0)  # a failed call fails the rollout
    kwargs.update(overrides)
    return ChatOpenAI(**kwargs)


def initial_state(task: dict[str, Any]) -> SQLState:
    tables = task.get("tables") or None
    return {"question": task["question"], "schema": dbs.schema_summary(task["db"], tables),
            "rewrites": 0, "tool_calls": 0, "transcript": []}


def score(task: dict[str, Any], state: SQLState, db_path: Path) -> dict[str, Any]:
    """The episode dict of a finished graph run: the final query scored against the gold."""
    gold = dbs.run_query(db_path, task["gold_sql"], time_limit_ms=dbs.GOLD_TIME_LIMIT_MS)
    if not gold.ok:
        raise RuntimeError(f"gold query of {task.get('task_id')} failed: {gold.error}")
    execution: dbs.Execution = state["execution"]
    value, components = reward(state.get("sql"), execution.rows, execution.error, gold.rows, task["ordered"],
                               execution.truncated)
    return {
        "reward": value,
        "components": components,
        "sql": state.get("sql"),
        "final_reply": state.get("reply", ""),
        "rewrites": state.get("rewrites", 0),
        "tool_calls": state.get("tool_calls", 0),
        "verdict": state.get("verdict"),
        "calls": sum(1 for m in state["transcript"] if m["role"] == "assistant"),
        "result": format_result(execution),
        "transcript": state["transcript"],
    }


def run_episode(task: dict[str, Any], base_url: str | None = None, *, api_key: str = "spanrl",
                llm: BaseChatModel | None = None, max_rewrites: int = MAX_REWRITES, **llm_overrides: Any) -> dict:
    """Run one episode of ``task`` (sync). ``llm``: a chat model to use instead of
    :func:`make_llm` (tests pass a fake one); ``llm_overrides`` go to :func:`make_llm`."""
    llm = llm or make_llm(base_url, api_key, **llm_overrides)
    with tempfile.TemporaryDirectory(prefix="spanrl-sql-") as tmp:
        db_path = dbs.rollout_copy(task["db"], Path(tmp))
        state = build_graph(llm, db_path, max_rewrites).invoke(initial_state(task))
        return score(task, state, db_path)


async def arun_episode(task: dict[str, Any], base_url: str | None = None, *, api_key: str = "spanrl",
                       llm: BaseChatModel | None = None, max_rewrites: int = MAX_REWRITES,
                       **llm_overrides: Any) -> dict:
    """Async form of :func:`run_episode` (LangGraph runs the sync nodes in its executor)."""
    llm = llm or make_llm(base_url, api_key, **llm_overrides)
    with tempfile.TemporaryDirectory(prefix="spanrl-sql-") as tmp:
        db_path = await asyncio.to_thread(dbs.rollout_copy, task["db"], Path(tmp))
        state = await build_graph(llm, db_path, max_rewrites).ainvoke(initial_state(task))
        return await asyncio.to_thread(score, task, state, db_path)


def sql_agent(ctx: Any) -> dict:
    """spanrl runner callable: ``ctx.task`` is the task dict, ``ctx.base_url`` the
    per-rollout OpenAI base URL, ``ctx.api_key`` the proxy's token. Emits the final reward
    with its components itself and returns the episode dict."""
    result = run_episode(ctx.task, ctx.base_url, api_key=ctx.api_key)
    ctx.emit_reward(result["reward"], final=True, **result["components"])
    return result


async def sql_agent_async(ctx: Any) -> dict:
    """Async form of :func:`sql_agent`."""
    result = await arun_episode(ctx.task, ctx.base_url, api_key=ctx.api_key)
    ctx.emit_reward(result["reward"], final=True, **result["components"])
    return result


def _main() -> None:
    from .tasks import HELDOUT_SEED, TRAIN_SEED, load_tasks

    ap = argparse.ArgumentParser(description="Run sql-agent episodes against an OpenAI-compatible server.")
    ap.add_argument("--base-url", default="http://127.0.0.1:18000/v1")
    ap.add_argument("--split", choices=("train", "heldout"), default="train")
    ap.add_argument("--seed", type=int, default=None, help="default: TRAIN_SEED / HELDOUT_SEED")
    ap.add_argument("-n", "--episodes", type=int, default=1)
    ap.add_argument("--verbose", action="store_true", help="print every transcript")
    args = ap.parse_args()

    seed = args.seed if args.seed is not None else (TRAIN_SEED if args.split == "train" else HELDOUT_SEED)
    results = []
    for task in load_tasks(args.split, seed, args.episodes):
        t0 = time.perf_counter()
        r = run_episode(task, args.base_url)
        line = {"task_id": task["task_id"], "level": task["level"], "sql": r["sql"], "reward": r["reward"],
                "components": r["components"], "rewrites": r["rewrites"], "tool_calls": r["tool_calls"],
                "seconds": round(time.perf_counter() - t0, 2)}
        print(json.dumps(line))
        if args.verbose:
            print(f"  gold: {task['gold_sql']}")
            for m in r["transcript"]:
                print(f"  [{m['node']}/{m['role']}] {m['content']}")
        results.append(r)
    n = len(results)
    summary = {"episodes": n, "mean_reward": sum(r["reward"] for r in results) / n,
               "mean_rewrites": sum(r["rewrites"] for r in results) / n}
    for c in ("format", "executed", "correct"):
        summary[f"{c}_rate"] = sum(r["components"][c] for r in results) / n
    print(json.dumps(summary))


if __name__ == "__main__":
    _main()
