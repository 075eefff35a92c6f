"""Records that outlive the model: span v2 keeps a call's messages, request and tokenizer
identity (spanrl/producers/content.py, spanrl/core/tokenizer_id.py); records written with
the previous versions (a committed fixture) still decode; a token-id replay onto another
tokenizer is refused (spanrl/infra/replay.py)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from spanrl.core.tokenizer_id import FILES, mismatch, tokenizer_sha256
from spanrl.producers.content import recorded_content
from spanrl.schemas import codec

FIXTURE = Path(__file__).parents[1] / "fixtures" / "archived" / "records.jsonl"


def test_records_written_by_the_old_versions_decode_under_the_new_reader():
    """tests/fixtures/archived/records.jsonl: a proxy span (v1), a reward (v1) and a rollout
    event (v2) as the codec wrote them before span v2; each decodes to what it held, the
    span's call with the v2 fields at their defaults."""
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert [(r["record"], r["version"]) for r in rows] == [("span", 1), ("reward", 1), ("rollout", 2)]
    assert codec.latest_version("span") == 2
    for r in rows:
        data = bytes.fromhex(r["value_hex"])
        assert data[:3] == bytes([codec.LEGACY_MAGIC, 0, r["version"]])
        back = codec.decode(r["record"], data)
        expected = r["decoded"]
        if r["record"] == "span":
            expected = {**expected, "llm": {**expected["llm"], "input_messages": None, "output_messages": None,
                                            "request": None, "tokenizer": None, "tokenizer_sha256": None}}
        assert back == expected
    span = codec.decode("span", bytes.fromhex(rows[0]["value_hex"]))
    assert span["schema_version"] == 1 and span["llm"]["completion_token_ids"] == [4, 5]


def test_span_v2_round_trips_the_content():
    [row] = [json.loads(line) for line in FIXTURE.read_text().splitlines()][:1]
    span = {k: v for k, v in row["decoded"].items() if k != "schema_version"}
    llm = {**span["llm"], "input_messages": json.dumps([{"role": "user", "content": "2+2?"}]),
           "output_messages": json.dumps([{"role": "assistant", "content": "4"}]), "request": "{}",
           "tokenizer": "smollm2-135m", "tokenizer_sha256": "0" * 64}
    back = codec.decode("span", codec.encode("span", {**span, "llm": llm}))
    assert back["schema_version"] == 2 and back["llm"]["input_messages"] == llm["input_messages"]
    assert back["llm"]["tokenizer_sha256"] == "0" * 64


def test_recorded_content_of_a_chat_call():
    body = {"model": "policy", "messages": [{"role": "user", "content": "2+2?"}], "temperature": 1.0,
            "tools": [{"type": "function", "function": {"name": "calc"}}]}
    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}},
                            {"index": 1, "message": {"role": "assistant", "content": "5"}}]}
    got = recorded_content(True, body, response, 1, True, ("smollm2-135m", "ab" * 32))
    assert got == {"input_messages": json.dumps(body["messages"]),
                   "output_messages": json.dumps([{"role": "assistant", "content": "5"}]),
                   "request": json.dumps({"model": "policy", "temperature": 1.0, "tools": body["tools"]}),
                   "tokenizer": "smollm2-135m", "tokenizer_sha256": "ab" * 32}


def test_recorded_content_of_a_text_completion_and_with_capture_off():
    body = {"model": "policy", "prompt": "2+2=", "max_tokens": 2}
    response = {"choices": [{"index": 0, "text": "4"}]}
    got = recorded_content(False, body, response, 0, True, ("m", None))
    assert got == {"input_messages": None, "output_messages": json.dumps([{"role": "assistant", "content": "4"}]),
                   "request": json.dumps(body), "tokenizer": "m", "tokenizer_sha256": None}
    off = recorded_content(True, {"messages": [{"role": "user", "content": "secret"}]},
                           {"choices": [{"message": {"role": "assistant", "content": "x"}}]}, 0, False, ("m", "h"))
    assert off == {"input_messages": None, "output_messages": None, "request": None, "tokenizer": "m",
                   "tokenizer_sha256": "h"}


def test_tokenizer_sha256_hashes_the_id_files_only(tmp_path):
    assert tokenizer_sha256(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (tmp_path / "merges.txt").write_text("a b\n")
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    files = {n: hashlib.sha256((tmp_path / n).read_bytes()).hexdigest() for n in ("tokenizer.json", "merges.txt")}
    expected = hashlib.sha256("".join(f"{n}\0{files[n]}\n" for n in FILES if n in files).encode()).hexdigest()
    assert tokenizer_sha256(tmp_path) == expected
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "y"}')  # not an id file
    assert tokenizer_sha256(tmp_path) == expected
    (tmp_path / "merges.txt").write_text("a c\n")
    assert tokenizer_sha256(tmp_path) != expected


def test_mismatch_names_the_other_tokenizer():
    a, b = "a" * 64, "b" * 64
    assert mismatch([("smollm2-135m", a), (None, None)], "smollm2-135m", a) is None
    assert mismatch([(None, None)], "qwen", a) is None  # unknown (v1 records): cannot be checked
    assert mismatch([("smollm2-135m", a)], "qwen", None) is None  # a target without tokenizer files
    problem = mismatch([("smollm2-135m", a), ("smollm2-135m", a), ("qwen", b)], "qwen2.5-coder-0.5b", b)
    assert problem == ("the recorded token ids were made by smollm2-135m (tokenizer sha256 aaaaaaaaaaaa…), not by "
                       "the tokenizer of qwen2.5-coder-0.5b (sha256 bbbbbbbbbbbb…): their ids mean other text to "
                       "it. Re-tokenise the recorded messages with the new model (docs/replay.md) instead of "
                       "training the ids")


def test_a_token_id_replay_onto_another_tokenizer_is_refused(tmp_path):
    from spanrl.infra.replay import ReplayError, check_tokenizer

    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    target = tokenizer_sha256(tmp_path)
    spans = [{"llm": {"tokenizer": "smollm2-135m", "tokenizer_sha256": "a" * 64}}, {"llm": None}]
    with pytest.raises(ReplayError, match=r"made by smollm2-135m \(tokenizer sha256 aaaaaaaaaaaa…\), not by the "
                                          rf"tokenizer of {tmp_path.name} \(sha256 {target[:12]}…\)"):
        check_tokenizer(spans, tmp_path)
    assert check_tokenizer([{"llm": {"tokenizer": "x", "tokenizer_sha256": target}}], tmp_path) == target


@pytest.mark.parametrize("capture", [True, False])
def test_the_proxy_records_what_the_client_sent_and_the_tokenizer(tmp_path, monkeypatch, capture):
    """A chat call through the proxy app (vLLM answering with a captured response): the span's
    call keeps the messages, the answer, the options and the tokenizer of the base model
    directory; with ``SPANRL_CAPTURE_MESSAGES=false`` only the tokenizer."""
    import httpx
    from fastapi.testclient import TestClient

    from spanrl.core.settings import get_settings
    from spanrl.producers.kafka import Topics
    from spanrl.producers.proxy import create_app
    from tests.unit.test_producers_messages_stream import AckingSink

    model_dir = tmp_path / "my-base"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text('{"model": {"vocab": {"hi": 0}}}')
    monkeypatch.setenv("SPANRL_BASE_MODEL_DIR", str(model_dir))
    monkeypatch.setenv("SPANRL_CAPTURE_MESSAGES", "true" if capture else "false")
    get_settings.cache_clear()  # the proxy reads the settings when the app is made; cleared again below
    answer = json.loads((Path(__file__).parents[1] / "fixtures" / "vllm_chat_completion.json").read_text())
    body = {"model": "policy", "messages": [{"role": "user", "content": "Hello!"}], "temperature": 1.0,
            "max_tokens": 16}
    sink = AckingSink(Topics())
    try:
        app = create_app(sink, "http://vllm", "policy", claim_client=object(), payload_bucket="b")
    finally:
        get_settings.cache_clear()
    with TestClient(app) as client:
        app.state.client = httpx.AsyncClient(base_url="http://vllm", transport=httpx.MockTransport(
            lambda request: httpx.Response(200, json=answer)))
        r = client.post("/rollouts/r1/attempts/0/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    [(_, _, value)] = sink.sent
    llm = codec.decode("span", value)["llm"]
    assert (llm["tokenizer"], llm["tokenizer_sha256"]) == ("my-base", tokenizer_sha256(model_dir))
    if capture:
        assert json.loads(llm["input_messages"]) == body["messages"]
        assert json.loads(llm["output_messages"]) == [answer["choices"][0]["message"]]
        assert json.loads(llm["request"]) == {"model": "policy", "temperature": 1.0, "max_tokens": 16}
    else:
        assert (llm["input_messages"], llm["output_messages"], llm["request"]) == (None, None, None)
