"""Policy-version labels across restarts: the reloader's vLLM watch decision and the
proxy's PolicyState (when a version label is known true, when calls must wait)."""
from __future__ import annotations

import httpx
import pytest

from spanrl.producers.proxy import PolicyState, vllm_lost
from spanrl.trainer.reloader import vllm_watch_action


@pytest.mark.parametrize("up,synced,now,next_at,action", [
    (False, True, 10.0, 0.0, "lost"),      # was serving the target, now gone: unsync the proxy
    (False, False, 10.0, 0.0, "down"),     # still gone (already told)
    (True, False, 10.0, 0.0, "apply"),     # back (or never loaded): reload the target, post it
    (True, False, 10.0, 10.0, "apply"),
    (True, False, 9.99, 10.0, "backoff"),  # the last reload failed recently
    (True, True, 10.0, 99.0, "ok"),
])
def test_vllm_watch_action(up, synced, now, next_at, action):
    assert vllm_watch_action(up, synced, now, next_at) == action


def test_policy_state_static_until_the_reloader_speaks():
    p = PolicyState(version=3)
    assert (p.version, p.synced, p.managed, p.wants_reloader()) == (3, True, False, True)
    assert p.vllm_unreachable() is False  # no reloader: the configured label stays
    assert p.synced and p.epoch == 0
    p.set_version(5, "s3://b/r/000005/")
    assert p.view() == {"version": 5, "checkpoint": "s3://b/r/000005/", "synced": True, "managed": True,
                        "reason": None}
    assert p.wants_reloader() is False


def test_policy_state_unsynced_by_vllm_loss_until_a_version_is_posted():
    p = PolicyState()
    p.set_version(4, "c4")
    assert p.vllm_unreachable() is True
    assert (p.synced, p.reason, p.epoch, p.version, p.wants_reloader()) == (False, "vllm_unreachable", 1, 4, True)
    assert p.vllm_unreachable() is False  # already unsynced; epoch unchanged
    assert p.epoch == 1
    p.set_version(4, "c4")  # the reloader re-applied v4 after vLLM came back
    assert (p.synced, p.reason, p.version) == (True, None, 4)
    p.unsync("vllm_unreachable")  # the reloader saw vLLM go
    assert (p.synced, p.epoch) == (False, 2)


def test_policy_state_adopts_the_reloader_answer_only_if_nothing_happened_meanwhile():
    p = PolicyState()
    assert p.adopt({"version": 2, "checkpoint": "c2", "synced": True}, epoch=0) is True
    assert (p.version, p.checkpoint, p.synced, p.managed) == (2, "c2", True, True)
    p.vllm_unreachable()
    epoch = p.epoch
    p.vllm_unreachable()
    p.unsync("again")  # a second outage while the answer was on its way
    assert p.adopt({"version": 2, "checkpoint": "c2", "synced": True}, epoch=epoch - 1) is False
    assert p.synced is False
    # the reloader says vLLM is not synced (down or reloading): stay unsynced
    assert p.adopt({"version": 2, "checkpoint": "c2", "synced": False}, epoch=p.epoch) is True
    assert (p.synced, p.reason) == (False, "reloader: vLLM not synced")
    assert p.adopt({"version": 3, "checkpoint": "c3", "synced": True}, epoch=p.epoch) is True
    assert (p.version, p.synced) == (3, True)


def test_vllm_lost_means_connection_trouble_not_slowness():
    req = httpx.Request("POST", "http://vllm/v1/chat/completions")
    assert vllm_lost(httpx.ConnectError("refused", request=req))
    assert vllm_lost(httpx.RemoteProtocolError("closed", request=req))
    assert vllm_lost(httpx.ReadError("reset", request=req))
    assert not vllm_lost(httpx.ReadTimeout("slow", request=req))
    assert not vllm_lost(httpx.ConnectTimeout("slow", request=req))
    assert not vllm_lost(httpx.HTTPStatusError("500", request=req, response=httpx.Response(500, request=req)))
