"""spanrl.core.response_ids: minted response ids name their attempt (issue 23 item 4)."""
from __future__ import annotations

import json

import pytest

from spanrl.core import response_ids as R
from spanrl.core.edge import BadRequest


def test_mint_and_read_back_through_every_api_prefix():
    rid = R.mint("chatcmpl-9f8e7d", "prod-" + "a" * 32, "0")
    assert rid == "chatcmpl-9f8e7d~spanrl~prod-" + "a" * 32 + "~0"
    assert R.attempt_of(rid) == ("prod-" + "a" * 32, "0")
    # the Responses and Messages translations replace the prefix only (producers/responses.py)
    assert R.attempt_of("resp_" + rid.removeprefix("chatcmpl-")) == ("prod-" + "a" * 32, "0")
    assert R.attempt_of("msg_" + rid.removeprefix("chatcmpl-")) == ("prod-" + "a" * 32, "0")
    assert R.mint(rid, "other", "1") == rid  # already minted: unchanged


@pytest.mark.parametrize("value", [None, 7, "", "chatcmpl-abc", "a~spanrl~r", "a~other~r~0", "a~spanrl~r~0~x",
                                   "a~spanrl~-bad~0", "a~spanrl~r~", "a~spanrl~" + "r" * 129 + "~0"])
def test_ids_that_name_no_attempt(value):
    assert R.attempt_of(value) is None


def test_mint_refuses_ids_that_break_the_rule():
    with pytest.raises(BadRequest):
        R.mint("chatcmpl-1", "has space", "0")


def test_from_attributes_reads_genai_and_openinference():
    rid = R.mint("chatcmpl-1", "r1", "2")
    assert R.from_attributes({"gen_ai.response.id": rid}) == rid and R.attempt_of(rid) == ("r1", "2")
    answer = {"id": rid, "object": "chat.completion", "choices": [{"message": {"content": "hi ~ there"}}]}
    assert R.from_attributes({"output.value": json.dumps(answer), "output.mime_type": "application/json"}) == rid
    assert R.from_attributes({"output.value": "plain text ~ with a tilde"}) is None
    assert R.from_attributes({"output.value": "{not json ~"}) is None
    assert R.from_attributes({"gen_ai.response.id": "chatcmpl-plain"}) is None
    assert R.from_attributes(None) is None
    assert R.call_link({"gen_ai.response.id": rid}) == "response:" + rid
    assert R.call_link({"gen_ai.response.id": "chatcmpl-plain"}) is None and R.call_link(None) is None
