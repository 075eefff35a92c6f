"""One fault of `make chaos` in the test suite: SIGKILL the Faust worker mid-run on the real
stack, restart it, and account for every acknowledged call (infra/chaos.py, infra/ledger.py).
The other faults (trainer, bridge, proxy, runner, Kafka, MinIO, vLLM) run in `make chaos`."""
from __future__ import annotations

import json

import pytest

from spanrl.infra.chaos import ChaosConfig, run_fault

pytestmark = [pytest.mark.integration, pytest.mark.stack_trainer]


def test_worker_sigkill_loses_and_duplicates_nothing(stack, tmp_path):
    cfg = ChaosConfig(faults=("worker",), tasks=3, group_size=4, calls=3, out_dir=tmp_path,
                      restart_stack=False, settle_timeout_s=240)
    entry = run_fault(stack, "worker", cfg, say=print)
    print(json.dumps(entry, indent=1, default=str))  # shown when an assertion fails: the whole account
    acc = entry["account"]
    assert entry["planned_calls"] == 36 and entry["expected"] >= 36, entry
    assert (entry["missing"], entry["duplicated"], acc["conflicting"], acc["unexpected"]) == (0, 0, 0, 0), acc["problems"]
    assert entry["produced"] + entry["dead_lettered"] == entry["expected"]
    assert (acc["samples_missing"], acc["samples_duplicated"], acc["advantage_mismatches"],
            acc["return_mismatches"], acc["acked_not_in_kafka"]) == (0, 0, 0, 0, 0), acc["problems"]
    assert entry["trainer"]["caught_up"] and entry["trainer"]["problems"] == []
    assert entry["ok"]
