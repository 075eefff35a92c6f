"""The trainer as N DeepSpeed ranks (trainer/ranks.py, issue 20): the launcher's command line,
the split of a mini-batch's micro-batches, the command channel over a real TCPStore, and two
ranks on CPU over gloo giving the parameters one rank gives for the same update (bench/ranks.py
runs both groups through DeepSpeed's launcher)."""
from __future__ import annotations

import base64
import datetime
import json
import sys
from pathlib import Path

import pytest
import torch

from spanrl.trainer import ranks

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import tiny_qwen2  # noqa: E402


def test_world_info_and_launch_argv():
    assert json.loads(base64.urlsafe_b64decode(ranks.world_info(2))) == {"localhost": [0, 1]}
    argv = ranks.launch_argv("/py", 2, 29511, "spanrl.trainer.train", ["--run", "r"])
    assert argv == ["/py", "-u", "-m", "deepspeed.launcher.launch", f"--world_info={ranks.world_info(2)}",
                    "--master_addr=127.0.0.1", "--master_port=29511", "--no_local_rank", "--module",
                    "spanrl.trainer.train", "--run", "r"]
    with pytest.raises(ValueError):
        ranks.world_info(0)


def test_threads_per_rank():
    assert [ranks.threads_per_rank(t, n) for t, n in ((2, 2), (8, 3), (1, 4), (4, 1))] == [1, 2, 1, 4]


def test_rank_share_balances_in_order_and_pads_with_zero_weight_copies():
    costs = [8, 6, 4, 1]
    # 8 -> r0 (0,0), 6 -> r1 (8,0), 4 -> r1 (8,6), 1 -> r0 (8,10)
    assert ranks.rank_share(costs, 2, 0) == [(0, False), (3, False)]
    assert ranks.rank_share(costs, 2, 1) == [(1, False), (2, False)]
    # one micro-batch for two ranks: rank 1 runs it again at zero weight
    assert ranks.rank_share([5], 2, 0) == [(0, False)]
    assert ranks.rank_share([5], 2, 1) == [(0, True)]
    # three for two: rank 1 (one real) pads with its own smallest
    assert ranks.rank_share([4, 3, 2], 2, 1) == [(1, False), (2, False)]
    assert ranks.rank_share([4, 3, 2], 2, 0) == [(0, False), (0, True)]
    # every micro-batch is trained exactly once over the ranks; every rank runs as many backward passes
    for costs, world in (([9, 1, 1, 1, 1, 7, 3], 3), ([2] * 5, 2), ([], 2), ([3, 3], 1)):
        shares = [ranks.rank_share(costs, world, r) for r in range(world)]
        real = sorted(i for share in shares for i, pad in share if not pad)
        assert real == list(range(len(costs)))
        assert len({len(share) for share in shares}) == 1
    assert ranks.rank_share([3, 3], 1, 0) == [(0, False), (1, False)]
    with pytest.raises(ValueError):
        ranks.rank_share([1], 2, 2)


def test_command_channel_over_a_tcp_store():
    server = torch.distributed.TCPStore("127.0.0.1", 0, 2, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    client = torch.distributed.TCPStore("127.0.0.1", server.port, 2, False, datetime.timedelta(seconds=10))
    send, receive = ranks.CommandChannel(server, readers=1), ranks.CommandChannel(client, poll_s=0.01)
    assert receive.receive(stop=lambda: True) is None  # nothing sent: waits until told to stop
    send.send({"op": "load", "model_dir": "/m"})
    send.send({"op": "update", "samples": [{"x": 1}], "options": {"micro_batch": 2}})
    assert send.pending() == 2  # nothing read yet: both kept
    assert receive.receive() == {"op": "load", "model_dir": "/m"}
    assert receive.receive() == {"op": "update", "samples": [{"x": 1}], "options": {"micro_batch": 2}}
    send.send({"op": "stop"})  # the two read ones are deleted now, the new one kept
    assert send.pending() == 1
    assert [server.check([f"spanrl/cmd/{k}"]) for k in range(3)] == [False, False, True]
    assert receive.receive() == {"op": "stop"}
    del send, server  # rank 0 gone: the follower stops with a reason instead of waiting for ever
    with pytest.raises(ranks.ChannelClosed):
        receive.receive()


# every stage in `make test-slow` (~1 min each, two ranks on 2 cores beside the test stack); one
# rank's DeepSpeed update and the rank arithmetic are unit-tested in `make test`
@pytest.mark.parametrize("zero_stage,merged", [pytest.param(0, False, marks=pytest.mark.slow),
                                               pytest.param(2, False, marks=pytest.mark.slow),
                                               pytest.param(3, False, marks=pytest.mark.slow),
                                               pytest.param(0, True, marks=pytest.mark.slow)])
def test_two_ranks_give_the_parameters_of_one(tmp_path, zero_stage, merged):
    """One update (two mini-batches of five samples, micro-batches of two: three per mini-batch,
    so rank 1 also runs a zero-weight padding pass) on a tiny Qwen2, with 1 and with 2 ranks
    started by DeepSpeed's launcher, without ZeRO, ZeRO-2 and ZeRO-3 (its weights gathered for
    the comparison as for a checkpoint): the same parameters within float summation order.
    ``merged``: 5 rollouts of 3 chained calls trained as prefix-merged rows (the default), the
    rows split over the ranks."""
    from bench import ranks as bench_ranks

    model_dir = tmp_path / "tiny"
    tiny_qwen2(512, 64, 0).save_pretrained(model_dir)
    segments_before = deepspeed_segments()
    shape = ["--samples", "15", "--calls", "3", "--prefix-merge", "--micro-batch", "1"] if merged else [
        "--samples", "10", "--micro-batch", "2"]
    report = bench_ranks.main(["--model", str(model_dir), *shape, "--prompt", "40", "--completion", "20",
                               "--mini-batches", "2", "--lr", "1e-3", "--out",
                               str(tmp_path / "out"), "--zero-stage", str(zero_stage)])
    assert report["groups"]["1"]["steps"] == report["groups"]["2"]["steps"] == 2
    if merged:  # chains cut only where the content-order split into 2 mini-batches cuts them
        assert 5 <= report["groups"]["1"]["rows"] == report["groups"]["2"]["rows"] < 15
    assert report["update_norm"] > 1e-3  # the update moved the parameters
    assert report["param_rel_diff"] <= 1e-5, report
    assert report["update_rel_diff"] <= 1e-5, report
    assert max(report["metrics_diff"].values()) <= 1e-5, report
    # each rank's shm all-reduce workspace is unlinked once both mapped it (deepspeed_patches)
    assert deepspeed_segments() <= segments_before


def deepspeed_segments() -> set[str]:
    """DeepSpeed's shm all-reduce workspaces in /dev/shm now (trainer/deepspeed_patches.py)."""
    from spanrl.trainer.deepspeed_patches import SHM_BUFFER_NAME, SHM_DIR

    return {p.name for p in SHM_DIR.glob(f"{SHM_BUFFER_NAME}_*")} if SHM_DIR.is_dir() else set()
