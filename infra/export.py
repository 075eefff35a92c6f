"""``spanrl export``: the log's episodes, transitions and samples as Parquet and JSON lines
that other tools read: ``datasets.load_dataset("parquet", data_files=...)``, pandas, DuckDB,
Spark; the ``messages`` column is the conversational format TRL's SFTTrainer takes.

Sources: ``transitions`` and ``samples`` (or a replay's ``transitions.<suffix>`` /
``samples.<suffix>``) and, for the text, the proxy's call spans on ``spans`` (their
``input_messages`` / ``output_messages``, span schema v2; claim-checked spans read back from
MinIO). The conversion from decoded records to rows is pure (:func:`export_rows`, tested in
tests/unit/test_export.py with a TRL SFT step on what it writes); :data:`SCHEMAS` is the
documented schema (docs/export.md), written with every file so empty columns keep their type.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

TABLES = ("episodes", "transitions", "samples")
FORMATS = ("parquet", "jsonl")

_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
_CALL = [
    ("rollout_id", pa.string()), ("attempt_id", pa.string()), ("task_id", pa.string()), ("span_id", pa.string()),
    ("sequence_id", pa.int64()), ("call_index", pa.int32()), ("agent_name", pa.string()), ("model", pa.string()),
    ("policy_version", pa.int64()), ("tokenizer", pa.string()), ("tokenizer_sha256", pa.string()),
    ("prompt_token_ids", pa.list_(pa.int32())), ("completion_token_ids", pa.list_(pa.int32())),
    ("behaviour_logprobs", pa.list_(pa.float32())), ("episode_return", pa.float64()), ("reward", pa.float64()),
    ("intermediate_reward", pa.float64()), ("credit_rule", pa.string()), ("status", pa.string()),
    ("messages", pa.list_(_MESSAGE)), ("input_messages_json", pa.string()), ("output_messages_json", pa.string()),
    ("request_json", pa.string()),
]
#: table -> its Arrow schema (docs/export.md describes each column)
SCHEMAS: dict[str, pa.Schema] = {
    "transitions": pa.schema(_CALL),
    "samples": pa.schema(_CALL + [("advantage", pa.float64()), ("group_id", pa.string()),
                                  ("group_rollouts", pa.int32()), ("group_mean", pa.float64()),
                                  ("group_std", pa.float64())]),
    "episodes": pa.schema([
        ("rollout_id", pa.string()), ("attempt_id", pa.string()), ("task_id", pa.string()), ("status", pa.string()),
        ("episode_return", pa.float64()), ("calls", pa.int32()), ("agent_names", pa.list_(pa.string())),
        ("policy_versions", pa.list_(pa.int64())), ("completion_tokens", pa.int64()),
        ("messages", pa.list_(_MESSAGE)),
    ]),
}


def _text(content) -> str:
    """A message's content as text: a string as it is, the text parts of a list of parts
    (OpenAI ``{"type": "text", "text": ...}``) joined, None as ``""``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return json.dumps(content)


def chat_messages(messages) -> list[dict] | None:
    """OpenAI chat messages as ``{"role", "content"}`` rows (one Arrow struct type): content
    text as :func:`_text`; an assistant message that only calls tools gets its
    ``tool_calls`` as JSON for content (the text the model produced them from is in the
    token ids). None when ``messages`` is not a list. Pure."""
    if not isinstance(messages, list):
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = _text(m.get("content"))
        if not content and m.get("tool_calls"):
            content = json.dumps(m["tool_calls"])
        out.append({"role": str(m.get("role") or ""), "content": content})
    return out


def _json(value) -> str | None:
    return None if value is None else json.dumps(value)


def call_row(t: dict, call: dict | None) -> dict:
    """One transition (decoded, schema v2) with its call's recorded content (a
    ``replay_inputs.call_view`` of its span; None when the span is not at hand) as a row of
    :data:`SCHEMAS` ``["transitions"]``. ``messages``: the call's input messages and its
    output, the conversation one SFT example is; None when the call was recorded without
    them. Pure."""
    call = call or {}
    inputs, outputs = chat_messages(call.get("input_messages")), chat_messages(call.get("output_messages"))
    return {
        "rollout_id": t["rollout_id"], "attempt_id": t["attempt_id"], "task_id": t["task_id"], "span_id": t["span_id"],
        "sequence_id": t["sequence_id"], "call_index": t["call_index"], "agent_name": t.get("agent_name"),
        "model": t["model"], "policy_version": t["policy_version"], "tokenizer": call.get("tokenizer"),
        "tokenizer_sha256": call.get("tokenizer_sha256"), "prompt_token_ids": list(t["prompt_token_ids"]),
        "completion_token_ids": list(t["completion_token_ids"]), "behaviour_logprobs": list(t["behaviour_logprobs"]),
        "episode_return": t["episode_return"], "reward": t["reward"],
        "intermediate_reward": t.get("intermediate_reward", 0.0), "credit_rule": t["credit_rule"],
        "status": t["status"],
        "messages": None if inputs is None or outputs is None else inputs + outputs,
        "input_messages_json": _json(call.get("input_messages")),
        "output_messages_json": _json(call.get("output_messages")), "request_json": _json(call.get("request")),
    }


def sample_row(s: dict, call: dict | None) -> dict:
    """One sample (decoded, schema v2) as a row of :data:`SCHEMAS` ``["samples"]``: its
    transition's :func:`call_row` and its GRPO group fields. Pure."""
    return {**call_row(s["transition"], call), "advantage": s["advantage"], "group_id": s["group_id"],
            "group_rollouts": s["group_rollouts"], "group_mean": s["group_mean"], "group_std": s["group_std"]}


def episode_rows(rows: Iterable[dict]) -> list[dict]:
    """One row per attempt from its transitions' :func:`call_row` rows, in order of first
    appearance: its return and status, its calls, agents and policy versions in call order,
    and ``messages``, the conversation as its last call saw and answered it (for a chat
    agent that keeps its history: the whole episode). Pure."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["rollout_id"], r["attempt_id"]), []).append(r)
    out = []
    for (rid, aid), calls in by.items():
        calls = sorted(calls, key=lambda r: r["call_index"])
        out.append({"rollout_id": rid, "attempt_id": aid, "task_id": calls[0]["task_id"], "status": calls[0]["status"],
                    "episode_return": calls[0]["episode_return"], "calls": len(calls),
                    "agent_names": [c["agent_name"] or "" for c in calls],
                    "policy_versions": [c["policy_version"] for c in calls],
                    "completion_tokens": sum(len(c["completion_token_ids"]) for c in calls),
                    "messages": calls[-1]["messages"]})
    return out


def export_rows(transitions: Iterable[dict], samples: Iterable[dict], calls: dict[str, dict]) -> dict[str, list[dict]]:
    """The three tables from decoded transitions, samples and the calls' views by span id
    (``replay_inputs.call_view``). Pure."""
    t_rows = [call_row(t, calls.get(t["span_id"])) for t in transitions]
    return {"episodes": episode_rows(t_rows), "transitions": t_rows,
            "samples": [sample_row(s, calls.get(s["transition"]["span_id"])) for s in samples]}


def write_tables(tables: dict[str, list[dict]], out_dir: Path, formats: Iterable[str] = FORMATS) -> dict[str, str]:
    """Write each table as ``<out_dir>/<table>.parquet`` and/or ``<table>.jsonl`` with its
    :data:`SCHEMAS` schema; returns file -> row count (as text)."""
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, rows in tables.items():
        table = pa.Table.from_pylist(rows, schema=SCHEMAS[name])
        if "parquet" in formats:
            pq.write_table(table, out_dir / f"{name}.parquet")
            written[str(out_dir / f"{name}.parquet")] = str(len(rows))
        if "jsonl" in formats:
            with open(out_dir / f"{name}.jsonl", "w") as f:
                for row in table.to_pylist():
                    f.write(json.dumps(row) + "\n")
            written[str(out_dir / f"{name}.jsonl")] = str(len(rows))
    return written


async def read_export(settings, suffix: str | None = None) -> dict[str, list[dict]]:
    """:func:`export_rows` of the stack's topics now (a replay's with ``suffix``; its calls'
    text from the spans the replay copied when it made its own inputs, else from ``spans``)."""
    from spanrl.infra.replay import end_offsets, read_topic
    from spanrl.infra.replay_inputs import call_view, full_spans
    from spanrl.schemas import topics as T

    bootstrap = settings.kafka_bootstrap
    topic = (lambda t: T.derived(t, suffix)) if suffix else (lambda t: t)
    transitions = await read_topic(bootstrap, topic(T.TRANSITIONS))
    samples = await read_topic(bootstrap, topic(T.SAMPLES))
    wanted = {t["span_id"] for t in transitions} | {s["transition"]["span_id"] for s in samples}
    spans_topic = T.SPANS
    if suffix and any((await end_offsets(bootstrap, T.derived(T.SPANS, suffix).name)).values()):
        spans_topic = T.derived(T.SPANS, suffix)
    spans = [s for s in await read_topic(bootstrap, spans_topic) if s["span_id"] in wanted]
    calls = {s["span_id"]: call_view(s) for s in await full_spans(spans, settings) if s.get("llm")}
    return export_rows(transitions, samples, calls)
