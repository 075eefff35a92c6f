"""A support agent that runs as an ordinary web service: spanrl never launches it.

    python -m examples.support_agent.service [--port 8095] [--task support]

``POST /ask {"question", "session"?}`` answers with the policy behind spanrl's proxy (the
``openai`` client on the proxy's plain ``{proxy}/v1``), inside an OTel span naming the agent
(exported to spanrl's bridge); the proxy's ``x-spanrl-rollout-id`` answer header is the
session's rollout, sent back on the session's next questions. ``POST /feedback {"session",
"rating"}`` (the user's thumbs up/down, minutes later) becomes the session's reward:
``emit_reward(R, rollout_id=...)``, which also ends the rollout (spanrl/core/production.py).
Questions of one ``task`` label form GRPO groups of ``group_size``; with no label each
session is a group of one (the trainer's batch baseline). No runner, no tasks topic.
"""
from __future__ import annotations

import argparse
import asyncio

import openai
import uvicorn
from fastapi import FastAPI, HTTPException
from opentelemetry.sdk.trace import TracerProvider
from pydantic import BaseModel, Field

from examples.support_agent.feedback import messages_for, reward_of
from spanrl.core import production
from spanrl.producers import instrument

AGENT = "support"


class Ask(BaseModel):
    question: str = Field(min_length=1)
    session: str | None = None  # None: a new session


class Feedback(BaseModel):
    session: str = Field(min_length=1)
    rating: str


def create_app(proxy_url: str, model: str, provider: TracerProvider, task: str | None = None,
               group_size: int = 1, max_tokens: int = 24, api_key: str = "unused") -> FastAPI:
    """The service. ``provider``: the TracerProvider exporting to the bridge
    (``instrument.instrument(...)``); ``task`` / ``group_size``: the group label the proxy
    records (None: each session its own group)."""
    app = FastAPI(title="support agent")
    client = openai.AsyncOpenAI(base_url=proxy_url.rstrip("/") + "/v1", api_key=api_key)
    tracer = provider.get_tracer(AGENT)
    sessions: dict[str, list[dict]] = {}  # rollout id -> the session's turns (plumbing: in memory)
    labels = {} if task is None else {production.TASK_HEADER: task, production.GROUP_SIZE_HEADER: str(group_size)}

    @app.post("/ask")
    async def ask(q: Ask) -> dict:
        if q.session is not None and q.session not in sessions:
            raise HTTPException(404, f"unknown session {q.session!r}")
        history = sessions.get(q.session, [])
        headers = dict(labels)
        if q.session is not None:
            headers[production.ROLLOUT_HEADER] = q.session
        with tracer.start_as_current_span(f"invoke_agent {AGENT}", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": AGENT}):
            raw = await client.chat.completions.with_raw_response.create(
                model=model, messages=messages_for(history, q.question), max_tokens=max_tokens,
                temperature=1.0, extra_headers=headers)
        session = raw.headers[production.ROLLOUT_HEADER]
        answer = raw.parse().choices[0].message.content or ""
        sessions[session] = [*history, {"role": "user", "content": q.question},
                             {"role": "assistant", "content": answer}]
        return {"answer": answer, "session": session}

    @app.post("/feedback", status_code=202)
    async def feedback(f: Feedback) -> dict:
        if f.session not in sessions:
            raise HTTPException(404, f"unknown session {f.session!r}")
        try:
            value = reward_of(f.rating)
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from exc
        instrument.emit_reward(value, rollout_id=f.session, name="user_rating")
        await asyncio.to_thread(instrument.flush)  # the reward is on its way when we answer
        sessions.pop(f.session)
        return {"session": f.session, "reward": value}

    return app


def main(argv: list[str] | None = None) -> None:
    from spanrl.core.settings import get_settings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8095)
    p.add_argument("--task", default=None, help="group label of the questions (default: none, groups of one)")
    p.add_argument("--group-size", type=int, default=1)
    args = p.parse_args(argv)
    s = get_settings()
    provider = instrument.instrument(AGENT, frameworks=False)
    instrument.propagate_trace_context()  # the proxy's record of each call links to our span
    api_key = s.auth_token.get_secret_value() if s.auth_token else "unused"
    uvicorn.run(create_app(s.proxy_url, s.model_name, provider, args.task, args.group_size, api_key=api_key),
                host=s.host, port=args.port)


if __name__ == "__main__":
    main()
