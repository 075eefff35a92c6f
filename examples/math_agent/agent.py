"""Calculator math agent (the paper's Math QA setup) written with AutoGen AgentChat.

The policy model (SmolLM2-135M-Instruct behind vLLM / the spanrl proxy) has no
server-side tool calling, so the calculator is a *text tool protocol* run inside
the agent:

1. The system prompt tells the model to write ``<calc>EXPRESSION</calc>`` to use the
   calculator and to finish with ``Answer: <number>``.
2. After each model reply:
   * if it contains ``Answer: <number>`` (or ``#### <number>``) the episode ends;
   * else if it contains ``<calc>…</calc>`` tags, each expression (at most 4) is
     evaluated by :func:`calc.calculate` (ast-based, numbers and ``+ - * / // % **``
     only) and the results go back as the next user message
     ``<result>VALUE</result>`` (one per tag; errors as ``<result>error: …</result>``);
   * else the agent asks once more for the final line (:data:`NUDGE`).
3. At most ``max_turns`` (default 3) model calls per episode. The last model reply
   is the final text, scored by :func:`reward.reward`.

For a model whose chat template has tools (qwen2.5-coder-0.5b behind vLLM's tool parser) there is
also a native tool path (``tool_mode``, runner :func:`math_agent_tools_auto`): the calculator is an
OpenAI tool the model may call (``tool_choice="auto"``), without the text protocol; it measures the
model's unforced tool-call rate.

No spanrl header names the agent: the runner turns on OpenInference's AutoGen AgentChat
instrumentation, whose span of the ``math_agent`` AssistantAgent is the parent of each
request (``traceparent``), so spanrl resolves the agent from AutoGen's own telemetry;
sampling is ``temperature=1.0``,
``max_tokens=128`` (exploration for RL, short for the 2k context).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import re
import time
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.messages import TextMessage, ToolCallExecutionEvent, ToolCallRequestEvent
from autogen_core import CancellationToken
from autogen_core.model_context import UnboundedChatCompletionContext
from autogen_core.models import AssistantMessage, UserMessage
from autogen_core.tools import FunctionTool
from autogen_ext.models.openai import OpenAIChatCompletionClient

from spanrl.producers import instrument

from .calc import calculate
from .reward import extract_answer, reward
from .tasks import short_question

AGENT_NAME = "math_agent"  # the AssistantAgent's name: what AutoGen's telemetry reports
MODEL = "policy"
MAX_TURNS = 3
MAX_TOKENS = 128
TEMPERATURE = 1.0
MAX_CALCS_PER_REPLY = 4

SYSTEM_PROMPT = (
    "You are a math assistant. To compute, write <calc>EXPRESSION</calc>. "
    "Finish with a line: Answer: <number>\n"
    "Example:\n"
    "Question: Tom has 3 bags of 12 apples and eats 5. How many are left?\n"
    "<calc>3*12-5</calc>\n"
    "<result>31</result>\n"
    "Answer: 31"
)
NUDGE = "What is the final answer? Reply exactly as: Answer: <number>"

#: worked episodes the agent starts every conversation with (AutoGen model context
#: ``initial_messages``): a 135M model follows demonstrated turns far more often than an
#: instruction. Hand-written; no generated task (training or held out) uses pens or stickers.
FEW_SHOT = [
    ("user", "Question: A box holds 24 pens. How many pens are in 37 boxes?\nEnd with: Answer: <number>"),
    ("assistant", "<calc>24*37</calc>"),
    ("user", "<result>888</result>"),
    ("assistant", "Answer: 888"),
    ("user", "Question: Mia had 512 stickers and gave away 178. How many stickers are left?\n"
             "End with: Answer: <number>"),
    ("assistant", "<calc>512-178</calc>"),
    ("user", "<result>334</result>"),
    ("assistant", "Answer: 334"),
]

CALC_RE = re.compile(r"<calc>(.*?)</calc>", re.DOTALL | re.IGNORECASE)

MODEL_INFO = {
    "vision": False,
    "function_calling": False,
    "json_output": False,
    "family": "unknown",
    "structured_output": False,
}


#: the native tool path (``tool_mode=True``; issue 19 item 5, for models whose chat template has
#: tools, e.g. qwen2.5-coder-0.5b): the calculator is an OpenAI tool the model may call or not
#: (``tool_choice="auto"``, AutoGen's default for an agent with tools); no ``<calc>`` protocol and no
#: worked examples, so every tool call is the model's own. After a call AutoGen runs the tool and
#: asks the model once more (``reflect_on_tool_use``, tools off) for the text that ends the turn.
TOOL_SYSTEM_PROMPT = (
    "You are a math assistant. Use the calculator tool to compute. "
    "Finish with a line: Answer: <number>"
)
TOOL_NAME = "calculator"


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers and + - * / // % ** only."""
    return run_calculator(expression)


def user_prompt(task: dict[str, Any]) -> str:
    return f"Question: {short_question(task)}\nEnd with: Answer: <number>"


def run_calculator(expr: str) -> str:
    """The calculator tool, traced: one OTel tool span per call (GenAI ``execute_tool
    calculator``), failed (status ERROR, ``error.type = CalcError``) when the answer is an
    error; with ``SPANRL_AIR_RULES=tool_error:<r>`` the stream job gives the call that wrote
    the expression the intermediate reward r (stream_jobs/air.py)."""
    with instrument.tool_span("calculator", expr) as span:
        result = calculate(expr)
        if result.startswith("error:"):
            instrument.tool_failed(span, "CalcError", result)
        return result


def tool_reply(text: str) -> str | None:
    """The ``<result>…</result>`` message for the ``<calc>`` tags in ``text`` (None if none)."""
    exprs = CALC_RE.findall(text)[:MAX_CALCS_PER_REPLY]
    if not exprs:
        return None
    return "\n".join(f"<result>{run_calculator(e)}</result>" for e in exprs)


def make_client(base_url: str, **overrides: Any) -> OpenAIChatCompletionClient:
    """OpenAI-compatible client for the policy.

    autogen-ext 0.7.5: constructor keys that are OpenAI ``chat.completions.create``
    parameters (``temperature``, ``max_tokens``, …) become default create args of
    every call; keys that are ``AsyncOpenAI(...)`` keyword arguments
    (``default_headers``, ``base_url``, ``http_client``, ``max_retries``) go to the
    underlying openai client.
    """
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        base_url=base_url,
        api_key="spanrl",
        model_info=MODEL_INFO,
        temperature=TEMPERATURE,
        max_tokens=MAX_TOKENS,
        include_name_in_message=False,
        max_retries=0,  # a failed call fails the rollout; the runner records it
    )
    kwargs.update(overrides)
    return OpenAIChatCompletionClient(**kwargs)


async def run_episode(
    task: dict[str, Any],
    base_url: str,
    *,
    max_turns: int = MAX_TURNS,
    few_shot: bool = True,
    tool_mode: bool = False,
    **client_overrides: Any,
) -> dict[str, Any]:
    """Run one episode of ``task`` against ``base_url``; score the final text.

    Returns ``{"reward", "components", "final_text", "calls", "transcript",
    "tool_calls", "tool_errors"}``. ``client_overrides`` go to
    :func:`make_client` (tests pass an ``http_client`` with a mock transport).
    ``tool_mode``: the native tool path (:data:`TOOL_SYSTEM_PROMPT`; ``few_shot`` is not used);
    ``tool_calls`` then counts the model's parsed tool calls, and the result also has
    ``text_calcs`` (``<calc>`` tags the model wrote instead, not run) and ``unparsed_tool_calls``
    (replies that name the calculator in a JSON object the server's tool parser did not read).
    """
    if tool_mode:
        return await _run_tool_episode(task, base_url, max_turns=max_turns, **client_overrides)
    client = make_client(base_url, **client_overrides)
    shots = FEW_SHOT if few_shot else []
    context = UnboundedChatCompletionContext(initial_messages=[
        UserMessage(content=text, source="user") if role == "user" else AssistantMessage(content=text, source="math_agent")
        for role, text in shots])
    agent = AssistantAgent(
        name=AGENT_NAME,
        model_client=client,
        system_message=SYSTEM_PROMPT,
        model_context=context,
        description="Solves GSM-style word problems with a text calculator tool.",
    )
    token = CancellationToken()
    transcript: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PROMPT}]
    transcript += [{"role": role, "content": text, "few_shot": "1"} for role, text in shots]
    message = user_prompt(task)
    final_text = ""
    calls = tool_calls = tool_errors = 0
    try:
        while calls < max_turns:
            transcript.append({"role": "user", "content": message})
            response = await agent.on_messages([TextMessage(content=message, source="user")], token)
            calls += 1
            final_text = str(response.chat_message.content)
            transcript.append({"role": "assistant", "content": final_text})
            if extract_answer(final_text) is not None or calls >= max_turns:
                break
            results = tool_reply(final_text)
            if results is not None:
                n = len(CALC_RE.findall(final_text)[:MAX_CALCS_PER_REPLY])
                tool_calls += n
                tool_errors += results.count("<result>error:")
                message = results
            else:
                message = NUDGE
    finally:
        await client.close()
    value, components = reward(final_text, task)
    return {
        "reward": value,
        "components": components,
        "final_text": final_text,
        "calls": calls,
        "tool_calls": tool_calls,
        "tool_errors": tool_errors,
        "transcript": transcript,
    }


UNPARSED_CALL_RE = re.compile(r'\{\s*"name"\s*:\s*"' + TOOL_NAME + '"')


async def _run_tool_episode(task: dict[str, Any], base_url: str, *, max_turns: int,
                            **client_overrides: Any) -> dict[str, Any]:
    """:func:`run_episode`'s native tool path. A turn is one model call that may call the
    calculator, followed by AutoGen's reflection call when it did; :data:`NUDGE` starts another
    turn while no ``Answer:`` line came and fewer than ``max_turns`` calls were made (so at most
    ``max_turns + 1`` calls)."""
    client = make_client(base_url, model_info={**MODEL_INFO, "function_calling": True}, **client_overrides)
    agent = AssistantAgent(
        name=AGENT_NAME,
        model_client=client,
        tools=[FunctionTool(calculator, description=calculator.__doc__ or "", name=TOOL_NAME)],
        system_message=TOOL_SYSTEM_PROMPT,
        reflect_on_tool_use=True,
        description="Solves GSM-style word problems with a native calculator tool.",
    )
    token = CancellationToken()
    transcript: list[dict[str, str]] = [{"role": "system", "content": TOOL_SYSTEM_PROMPT}]
    message = user_prompt(task)
    final_text = ""
    calls = tool_calls = tool_errors = text_calcs = unparsed = 0
    try:
        while calls < max_turns:
            transcript.append({"role": "user", "content": message})
            response = await agent.on_messages([TextMessage(content=message, source="user")], token)
            for event in response.inner_messages or []:
                if isinstance(event, ToolCallRequestEvent):
                    calls += 1
                    tool_calls += len(event.content)
                    transcript += [{"role": "assistant", "content": f"{c.name}({c.arguments})"} for c in event.content]
                elif isinstance(event, ToolCallExecutionEvent):
                    tool_errors += sum(r.is_error or r.content.startswith("error:") for r in event.content)
                    transcript += [{"role": "tool", "content": r.content} for r in event.content]
            calls += 1  # the reply that ended the turn (the reflection after a tool call)
            final_text = str(response.chat_message.content)
            transcript.append({"role": "assistant", "content": final_text})
            text_calcs += len(CALC_RE.findall(final_text))
            unparsed += bool(UNPARSED_CALL_RE.search(final_text))
            if extract_answer(final_text) is not None:
                break
            message = NUDGE
    finally:
        await client.close()
    value, components = reward(final_text, task)
    return {"reward": value, "components": components, "final_text": final_text, "calls": calls,
            "tool_calls": tool_calls, "tool_errors": tool_errors, "text_calcs": text_calcs,
            "unparsed_tool_calls": unparsed, "transcript": transcript}


def _run_sync(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Called from inside a running loop (e.g. an async runner): use a fresh thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def math_agent_async(ctx: Any) -> dict:
    """Async form of :func:`math_agent`."""
    result = await run_episode(ctx.task, ctx.base_url, api_key=ctx.api_key)
    ctx.emit_reward(result["reward"], final=True, **result["components"])
    return result


def math_agent(ctx: Any) -> dict:
    """spanrl runner callable: ``ctx.task`` is the task dict, ``ctx.base_url`` the
    per-rollout OpenAI base URL, ``ctx.api_key`` the proxy's bearer token (or a placeholder).
    Emits the final reward (with its components) itself and returns the episode dict (not
    a float, so the runner does not emit it a second time)."""
    return _episode_sync(ctx)


def math_agent_tools_auto(ctx: Any) -> dict:
    """:func:`math_agent` on the native tool path (``tool_mode``): the model may call the
    calculator as a tool, nothing forces it (``spanrl eval --agent
    examples.math_agent.agent:math_agent_tools_auto``: its tool use rate is the unforced rate)."""
    return _episode_sync(ctx, tool_mode=True)


def _episode_sync(ctx: Any, **episode_options: Any) -> dict:
    """One episode of ``ctx.task`` (:func:`run_episode` with ``episode_options``), its final reward
    emitted from the caller's thread; the episode dict."""
    result = _run_sync(run_episode(ctx.task, ctx.base_url, api_key=ctx.api_key, **episode_options))
    ctx.emit_reward(result["reward"], final=True, **result["components"])
    return result


async def _main() -> None:
    from .tasks import load_task_set

    ap = argparse.ArgumentParser(description="Run math-agent episodes against an OpenAI-compatible server.")
    ap.add_argument("--base-url", default="http://127.0.0.1:18000/v1")
    ap.add_argument("--task-set", default="gsm_symbolic", help="arith_word | gsm_symbolic | ... (tasks.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-n", "--episodes", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--verbose", action="store_true", help="print every transcript")
    ap.add_argument("--tool-mode", action="store_true", help="the native tool path (tool_choice auto)")
    ap.add_argument("--temperature", type=float, default=TEMPERATURE)
    args = ap.parse_args()

    tasks = load_task_set(args.task_set, args.seed, args.episodes)
    sem = asyncio.Semaphore(args.concurrency)

    async def one(t: dict[str, Any]) -> dict[str, Any]:
        async with sem:
            t0 = time.perf_counter()
            r = await run_episode(t, args.base_url, tool_mode=args.tool_mode, temperature=args.temperature)
            r["seconds"] = time.perf_counter() - t0
            r["task_id"] = t["task_id"]
            r["answer"] = t["answer"]
            return r

    results = await asyncio.gather(*(one(t) for t in tasks))
    for r in results:
        line = {k: r[k] for k in ("task_id", "answer", "reward", "components", "calls", "tool_calls", "tool_errors")}
        line["seconds"] = round(r["seconds"], 2)
        print(json.dumps(line))
        if args.verbose:
            for m in r["transcript"]:
                print(f"  [{m['role']}] {m['content']}")
    n = len(results)
    print(
        json.dumps(
            {
                "episodes": n,
                "mean_reward": sum(r["reward"] for r in results) / n,
                "format_rate": sum(r["components"]["format"] for r in results) / n,
                "correct_rate": sum(r["components"]["correct"] for r in results) / n,
                "mean_calls": sum(r["calls"] for r in results) / n,
                "episodes_with_tool_call": sum(r["tool_calls"] > 0 for r in results),
                **({"episodes_with_text_calc": sum(r["text_calcs"] > 0 for r in results),
                    "episodes_with_unparsed_tool_call": sum(r["unparsed_tool_calls"] > 0 for r in results)}
                   if args.tool_mode else {}),
                "mean_seconds": sum(r["seconds"] for r in results) / n,
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(_main())
