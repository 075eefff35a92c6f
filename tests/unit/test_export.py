"""``spanrl export``'s rows (spanrl/infra/export.py): records built here -> rows with exact
values; a written export read back by ``datasets`` and one TRL SFT step on CPU on its
``messages`` (a tiny random Qwen2 with a word-level tokenizer built here: no download)."""
from __future__ import annotations

import json

import pytest

from spanrl.infra.export import SCHEMAS, chat_messages, export_rows, write_tables
from spanrl.infra.replay_inputs import call_view


def _transition(rid, idx, span_id, ret, completion, version=3):
    return {"rollout_id": rid, "attempt_id": "a0", "span_id": span_id, "task_id": "t1", "group_size": 2,
            "sequence_id": 10 + idx, "call_index": idx, "rollout_transition_count": 2, "agent_name": "solver",
            "model": "policy", "policy_version": version, "prompt_token_ids": [1, 2, 3],
            "completion_token_ids": completion, "behaviour_logprobs": [-0.25] * len(completion),
            "episode_return": ret, "reward": ret, "credit_rule": "identical", "status": "succeeded",
            "intermediate_reward": 0.0, "air_rules": "", "reward_delay_ms": None, "late_reward": False}


def _span(span_id, question, answer):
    return {"rollout_id": "r1", "attempt_id": "a0", "sequence_id": 0, "span_id": span_id, "agent_name": "solver",
            "llm": {"model": "policy", "policy_version": 3, "prompt_token_ids": [1, 2, 3],
                    "completion_token_ids": [4], "completion_logprobs": [-0.25], "finish_reason": "stop",
                    "input_messages": json.dumps([{"role": "user", "content": question}]),
                    "output_messages": json.dumps([{"role": "assistant", "content": answer}]),
                    "request": json.dumps({"temperature": 1.0, "tools": []}),
                    "tokenizer": "smollm2-135m", "tokenizer_sha256": "ab" * 32}}


def test_chat_messages_flatten_parts_and_tool_calls():
    calls = [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"x\": 1}"}}]
    assert chat_messages([{"role": "system", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "2?"}]},
                          {"role": "assistant", "content": None, "tool_calls": calls},
                          {"role": "tool", "content": "4", "tool_call_id": "c1"}, "junk"]) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": json.dumps(calls)}, {"role": "tool", "content": "4"}]
    assert chat_messages(None) is None


def _records():
    transitions = [_transition("r1", 0, "s0", 1.0, [4, 5]), _transition("r1", 1, "s1", 1.0, [6]),
                   _transition("r2", 0, "s2", 0.0, [7])]
    samples = [{"transition": transitions[0], "advantage": 1.0, "group_id": "t1#0", "group_rollouts": 2,
                "group_mean": 0.5, "group_std": 0.5}]
    calls = {"s0": call_view(_span("s0", "2+2?", "4")), "s1": call_view(_span("s1", "and 3+3?", "6"))}
    return transitions, samples, calls


def test_export_rows_exact():
    transitions, samples, calls = _records()
    tables = export_rows(transitions, samples, calls)
    t0 = tables["transitions"][0]
    assert t0 == {
        "rollout_id": "r1", "attempt_id": "a0", "task_id": "t1", "span_id": "s0", "sequence_id": 10, "call_index": 0,
        "agent_name": "solver", "model": "policy", "policy_version": 3, "tokenizer": "smollm2-135m",
        "tokenizer_sha256": "ab" * 32, "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5],
        "behaviour_logprobs": [-0.25, -0.25], "episode_return": 1.0, "reward": 1.0, "intermediate_reward": 0.0,
        "credit_rule": "identical", "status": "succeeded",
        "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        "input_messages_json": json.dumps([{"role": "user", "content": "2+2?"}]),
        "output_messages_json": json.dumps([{"role": "assistant", "content": "4"}]),
        "request_json": json.dumps({"temperature": 1.0, "tools": []})}
    # a call recorded without its messages (older records, capture off): no text, ids kept
    t2 = tables["transitions"][2]
    assert t2["messages"] is None and t2["input_messages_json"] is None and t2["completion_token_ids"] == [7]
    assert tables["episodes"] == [
        {"rollout_id": "r1", "attempt_id": "a0", "task_id": "t1", "status": "succeeded", "episode_return": 1.0,
         "calls": 2, "agent_names": ["solver", "solver"], "policy_versions": [3, 3], "completion_tokens": 3,
         "messages": [{"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]},
        {"rollout_id": "r2", "attempt_id": "a0", "task_id": "t1", "status": "succeeded", "episode_return": 0.0,
         "calls": 1, "agent_names": ["solver"], "policy_versions": [3], "completion_tokens": 1, "messages": None}]
    [s] = tables["samples"]
    assert s == {**t0, "advantage": 1.0, "group_id": "t1#0", "group_rollouts": 2, "group_mean": 0.5, "group_std": 0.5}
    for name, rows in tables.items():  # every row has exactly its table's columns
        assert all(list(r) == SCHEMAS[name].names for r in rows), name


def _tokenizer(texts: list[str]):
    """A word-level fast tokenizer over ``texts``'s words with a chat template: real, tiny."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for t in texts for w in t.split()})
    specials = ["<pad>", "<unk>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {w: i for i, w in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    return fast


def test_export_reads_back_with_datasets_and_trains_one_trl_sft_step(tmp_path):
    import datasets
    import trl

    from tests.unit.tiny_models import tiny_qwen2

    transitions, samples, calls = _records()
    written = write_tables(export_rows(transitions, samples, calls), tmp_path)
    assert written == {str(tmp_path / f"{n}.{f}"): c for n, c in
                       (("episodes", "2"), ("transitions", "3"), ("samples", "1")) for f in ("parquet", "jsonl")}
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "transitions.parquet"), split="train")
    assert ds.num_rows == 3 and ds.column_names == SCHEMAS["transitions"].names
    assert ds[0]["messages"] == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert ds[1]["completion_token_ids"] == [6] and ds[2]["messages"] is None
    lines = datasets.load_dataset("json", data_files=str(tmp_path / "transitions.jsonl"), split="train")
    assert lines[0]["messages"] == ds[0]["messages"]

    sft = ds.filter(lambda r: r["messages"] is not None).select_columns(["messages"])
    tok = _tokenizer([m["content"] for r in sft for m in r["messages"]])
    model = tiny_qwen2(vocab=len(tok))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = trl.SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1, per_device_train_batch_size=2,
                         learning_rate=1e-2, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
                         dataloader_num_workers=0, max_length=32)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=sft, processing_class=tok)
    out = trainer.train()
    assert out.global_step == 1 and out.training_loss > 0
    changed = [n for n, p in model.named_parameters() if not bool((p.detach() == before[n]).all())]
    assert changed, "one SFT step changed no weight"
