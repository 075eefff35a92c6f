"""Prometheus families of the services' own counters (spanrl.core.metrics,
spanrl.stream_jobs.metrics, spanrl.trainer.tracking), read back with prometheus_client's parser."""
from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spanrl.core import metrics as prom
from spanrl.stream_jobs.metrics import RewardToTransition, worker_families
from spanrl.trainer.tracking import reloader_families, trainer_families


def samples(families) -> dict[tuple, float]:
    """``{(sample name, sorted labels): value}`` of the text exposition of ``families``."""
    text = prom.exposition(prom.registry(lambda: families)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_count_families_sorts_keys_into_plain_status_vllm_dead_letter_and_refusal():
    counts = {"requests": 5, "spans": 4, "http_401": 3, "http_404": 1, "missing_token": 2, "invalid_token": 1,
              "model_not_found": 1, "dead_letter.missing_token_ids": 2, "vllm_http_400": 2, "policy_version": 3,
              "flag": True}
    got = samples(prom.count_families("proxy", counts, {"requests": "r", "spans": "s", "streams": "t"}))
    assert got == {
        ("spanrl_proxy_requests_total", ()): 5.0, ("spanrl_proxy_spans_total", ()): 4.0,
        ("spanrl_proxy_streams_total", ()): 0.0,
        ("spanrl_proxy_error_responses_total", (("status", "401"),)): 3.0,
        ("spanrl_proxy_error_responses_total", (("status", "404"),)): 1.0,
        ("spanrl_proxy_vllm_errors_total", (("status", "400"),)): 2.0,
        ("spanrl_proxy_dead_letters_total", (("reason", "missing_token_ids"),)): 2.0,
        ("spanrl_proxy_refusals_total", (("reason", "invalid_token"),)): 1.0,
        ("spanrl_proxy_refusals_total", (("reason", "missing_token"),)): 2.0,
        ("spanrl_proxy_refusals_total", (("reason", "model_not_found"),)): 1.0,
        ("spanrl_proxy_refusals_total", (("reason", "policy_version"),)): 3.0,
    }


def test_histogram_family_is_cumulative_with_inf_count_and_sum():
    got = samples([prom.histogram_family("h_seconds", "h", [0.004, 0.2, 1.0, 400.0], buckets=(0.01, 1.0))])
    assert got == {("h_seconds_bucket", (("le", "0.01"),)): 1.0, ("h_seconds_bucket", (("le", "1.0"),)): 3.0,
                   ("h_seconds_bucket", (("le", "+Inf"),)): 4.0, ("h_seconds_count", ()): 4.0,
                   ("h_seconds_sum", ()): 401.204}


def test_reward_to_transition_pairs_first_reward_with_first_transition():
    clock = RewardToTransition(max_pending=2)
    clock.reward_consumed("r1", "0", 10.0)
    clock.reward_consumed("r1", "0", 11.0)  # a later reward of the same attempt keeps the first time
    clock.reward_consumed("r2", "0", 12.0)
    assert clock.transition_sent("r1", "0", 12.5) == 2.5
    assert clock.transition_sent("r1", "0", 13.0) is None  # only the attempt's first transition
    assert clock.transition_sent("r1", "1", 13.0) is None  # another attempt: its reward was not seen
    clock.reward_consumed("r3", "0", 14.0)
    clock.reward_consumed("r4", "0", 15.0)  # over max_pending: r2 (the oldest) is forgotten
    assert len(clock) == 2 and clock.transition_sent("r2", "0", 16.0) is None
    assert clock.transition_sent("r4", "0", 15.25) == 0.25
    with pytest.raises(ValueError):
        RewardToTransition(0)


def test_worker_families_from_the_counters_page_numbers():
    got = samples(worker_families({"spans_in": 7, "transitions_out": 3, "dead_letters_out": 2},
                                  {"rollout_timeout": 2}, {("math_agent", "trained"): 3, ("(unresolved)", "excluded"): 1}))
    assert got[("spanrl_worker_spans_in_total", ())] == 7.0
    assert got[("spanrl_worker_transitions_out_total", ())] == 3.0
    assert got[("spanrl_worker_samples_out_total", ())] == 0.0
    assert got[("spanrl_worker_dead_letters_out_total", ())] == 2.0
    assert got[("spanrl_worker_dead_letters_total", (("reason", "rollout_timeout"),))] == 2.0
    assert got[("spanrl_worker_calls_total", (("agent", "math_agent"), ("trained", "true")))] == 3.0
    assert got[("spanrl_worker_calls_total", (("agent", "(unresolved)"), ("trained", "false")))] == 1.0
    assert len(got) == 15 + 3  # WORKER_COUNTERS + dead letters by reason + calls by agent


def test_trainer_families_from_its_status():
    status = {"run": "r", "version": 4, "step": 9, "updates": 7, "buffered": 3, "skipped": {"no_completion": 2},
              "retries": 1, "pending_checkpoint": "s3://b/r/000005", "last_metrics": {"loss": -0.5, "clip_frac": 0.25,
                                                                                      "grad_norm": None}}
    got = samples(trainer_families(status))
    nan = [k for k, v in got.items() if math.isnan(v)]
    assert sorted(nan) == [(f"spanrl_trainer_last_{k}", ()) for k in ("approx_kl", "grad_norm", "mean_reward",
                                                                       "tokens_per_s")]
    assert {k: v for k, v in got.items() if k not in nan} == {
        ("spanrl_trainer_updates_total", ()): 7.0, ("spanrl_trainer_steps_total", ()): 9.0,
        ("spanrl_trainer_retries_total", ()): 1.0,
        ("spanrl_trainer_skipped_samples_total", (("reason", "no_completion"),)): 2.0,
        ("spanrl_trainer_policy_version", ()): 4.0, ("spanrl_trainer_buffered_samples", ()): 3.0,
        ("spanrl_trainer_pending_checkpoint", ()): 1.0,
        ("spanrl_trainer_last_loss", ()): -0.5, ("spanrl_trainer_last_clip_frac", ()): 0.25,
    }


def test_reloader_families_count_the_whole_history():
    history = [{"version": 1, "verified": True, "reloaded": True, "reload_s": 0.5, "error": None},
               {"version": 2, "verified": False, "reloaded": False, "reload_s": None, "error": "sha256 mismatch"},
               {"version": 3, "verified": True, "reloaded": True, "reload_s": 2.0, "error": None, "refused": "worse"},
               {"version": 3, "event": "vllm_lost"},
               {"version": 3, "event": "reapply", "verified": True, "reloaded": False, "reload_s": None,
                "error": "reload failed: x"}]
    status = {"served_version": 3, "target_version": 3, "vllm_synced": False, "pinned": None}
    got = samples(reloader_families(status, history, handled=3))
    assert {k: v for k, v in got.items() if not k[0].startswith("spanrl_reloader_reload_seconds")} == {
        ("spanrl_reloader_served_version", ()): 3.0, ("spanrl_reloader_target_version", ()): 3.0,
        ("spanrl_reloader_vllm_synced", ()): 0.0, ("spanrl_reloader_pinned", ()): 0.0,
        ("spanrl_reloader_announcements_total", ()): 3.0, ("spanrl_reloader_reloads_total", ()): 2.0,
        ("spanrl_reloader_refused_checkpoints_total", ()): 1.0, ("spanrl_reloader_gate_refusals_total", ()): 1.0,
        ("spanrl_reloader_vllm_lost_total", ()): 1.0,
    }
    assert got[("spanrl_reloader_reload_seconds_bucket", (("le", "1.0"),))] == 1.0
    assert got[("spanrl_reloader_reload_seconds_bucket", (("le", "2.5"),))] == 2.0
    assert (got[("spanrl_reloader_reload_seconds_count", ())], got[("spanrl_reloader_reload_seconds_sum", ())]) == (2.0, 2.5)


@pytest.mark.parametrize("service", ["bridge", "proxy"])
def test_service_metrics_page_has_the_status_numbers(service):
    """Bad requests (answered before vLLM or Kafka, both unreachable here): the Prometheus page
    shows the same numbers as the JSON ``/status``."""
    from fastapi.testclient import TestClient

    from spanrl.producers import bridge, proxy
    from spanrl.producers.kafka import Sink, Topics

    sink = Sink("127.0.0.1:1", Topics(), send_timeout_s=1.0)
    app = (proxy.create_app(sink, "http://127.0.0.1:1", "policy") if service == "proxy"
           else bridge.create_app(sink, claim_client=object(), payload_bucket="b"))
    url = "/rollouts/r/attempts/0/v1/chat/completions" if service == "proxy" else "/v1/traces"
    with TestClient(app) as client:
        for _ in range(2):
            assert client.post(url, content=b"{}", headers={"content-type": "text/plain"}).status_code == 415
        status = client.get("/status").json()
        page = client.get("/metrics")
    assert page.headers["content-type"].startswith("text/plain; version=")
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(page.text) for s in f.samples}
    assert status["requests"] == got[(f"spanrl_{service}_requests_total", ())] == 2.0
    assert status["http_415"] == got[(f"spanrl_{service}_error_responses_total", (("status", "415"),))] == 2.0
    assert got[(f"spanrl_{service}_refusals_total", (("reason", "unsupported_media_type"),))] == 2.0
