"""Tree packing on a run's recorded samples: one update unpacked and one packed, side by side.

    make bench-tree-pack MODEL=qwen2.5-coder-0.5b [ARGS="--groups 4"]     # the recorded RAG samples
    python -m bench.one_update_shift dump samples.json             # or another run's `samples` topic
    SPANRL_MODEL=<its model> python -m bench.tree_pack samples.json --version 0 --out tree-pack.json

The samples of behaviour version ``--version`` (one update's worth with barrier batching; the
first ``--groups`` GRPO groups of them in group-id order, 0: all) are trained once by the
trainer's own ``train_update`` with the settings ``make demo MODEL=<SPANRL_MODEL>`` gives the
trainer (the math main job's ``demo_trainer_env`` with the model's ``QWEN05B_LORA_DEMO``
entries over it, activation checkpointing and the LoRA adapter as the trainer loads them, the
reference policy the adapter switched off) — first unpacked, then with ``tree_packing``, each in
a process of its own (its own peak RSS), from the same weights and the same seeded adapter.
Reported: update seconds and their ratio, tokens forwarded (the rows without padding, and
packed), peak RSS, and loss / approx KL / ref KL / clip fraction / grad norm
of both with their largest relative difference (tree packing must not change the update,
trainer/tree_pack.py). Offline, CPU; nothing else should run beside it for the times to mean
anything.
"""
from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import resource
import time
from pathlib import Path

FIGURES = ("loss", "approx_kl", "ref_kl", "clip_frac", "grad_norm")


def demo_trainer_config(model: str):
    """TrainerConfig of ``make demo MODEL=<model>``'s trainer: the math main job's
    ``demo_trainer_env`` with the RAG spec's ``demo_plan`` model entries (the one place each is
    written; the RAG and SQL specs share the 0.5B model's entry) over TrainerConfig's defaults
    (recipe ``default``)."""
    from examples.math_agent.main_job import demo_trainer_env
    from spanrl.core.settings import TrainerConfig
    from spanrl.infra.agents import load_agent_spec

    env = demo_trainer_env(load_agent_spec("rag").demo_plan(model)["trainer_env"])
    return TrainerConfig.from_environ(env)


def pick_groups(samples: list[dict], version: int, groups: int) -> list[dict]:
    """The samples of behaviour ``version``, only those of the first ``groups`` group ids in sorted
    order (0: every group). Example: groups a, b, c of version 0, groups 2 -> a's and b's samples."""
    mine = [s for s in samples if s["transition"]["policy_version"] == version]
    ids = sorted({s["group_id"] for s in mine})
    keep = set(ids[:groups] if groups else ids)
    return [s for s in mine if s["group_id"] in keep]


def one_update(samples: list[dict], model: str, packed: bool, queue) -> None:
    """Child process: one update of ``samples`` from the base weights (adapter seeded), put its
    figures on ``queue``."""
    import torch

    from spanrl.core.settings import get_settings
    from spanrl.trainer import lora
    from dataclasses import asdict

    from spanrl.trainer.train import UpdateConfig, build_engine, load_model, train_update

    cfg = demo_trainer_config(model)
    torch.manual_seed(0)  # peft draws lora_A from torch's global generator
    spec = lora.lora_spec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    net = load_model(get_settings().model_dir, cfg.activation_checkpointing, adapter=spec)
    engine = build_engine(net, lr=cfg.lr, weight_decay=cfg.weight_decay, micro_batch=cfg.micro_batch,
                          grad_clip=cfg.grad_clip)
    ref = lora.AdapterDisabled(engine.module) if spec is not None and cfg.kl_coef > 0 else None
    t0 = time.perf_counter()
    # the update exactly as the trainer configures it (UpdateConfig.of), packing on or off
    m = train_update(engine, copy.deepcopy(samples), ref_model=ref,
                     **asdict(UpdateConfig.of(cfg, tree_packing=packed)))
    queue.put({**{k: m.get(k) for k in (*FIGURES, "samples", "steps", "tokens", "prefix_merge_tokens",
                                         "tree_pack_tokens", "tree_pack_row_tokens")},
               "update_s": round(time.perf_counter() - t0, 2),
               "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)})


def side_by_side(samples: list[dict], model: str) -> dict:
    """:func:`one_update` unpacked, then packed, each in a fresh process; their figures, the time
    ratio packed / unpacked and the largest relative difference of :data:`FIGURES`."""
    from bench.metrics import max_rel_diff

    ctx = multiprocessing.get_context("spawn")
    out = {}
    for packed in (False, True):
        q = ctx.Queue()
        p = ctx.Process(target=one_update, args=(samples, model, packed, q))
        p.start()
        out["packed" if packed else "unpacked"] = q.get()
        p.join()
        if p.exitcode:
            raise RuntimeError(f"the {'packed' if packed else 'unpacked'} update's process exited {p.exitcode}")
    a, b = out["unpacked"], out["packed"]
    out["max_rel_diff"] = max_rel_diff(a, b, FIGURES)
    out["time_ratio_packed_unpacked"] = round(b["update_s"] / a["update_s"], 3)
    out["token_ratio_packed_rows"] = round(b["tree_pack_tokens"] / b["tree_pack_row_tokens"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console

    from spanrl.core.settings import get_settings
    from spanrl.trainer.batching import BadSample, check_sample

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("samples", type=Path, help="a dump of the samples topic (bench.one_update_shift dump)")
    ap.add_argument("--version", type=int, default=0, help="behaviour version of the samples trained")
    ap.add_argument("--groups", type=int, default=0, help="only the first N groups of that version (0: all)")
    ap.add_argument("--out", type=Path, default=Path("results/tree_pack.json"))
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    model = get_settings().model
    samples = pick_groups(json.loads(args.samples.read_text()), args.version, args.groups)
    if not samples:
        raise SystemExit(f"no samples of version {args.version} in {args.samples}")
    vocab = json.loads((get_settings().model_dir / "config.json").read_text())["vocab_size"]
    try:
        for s in samples:
            check_sample(s, vocab_size=vocab)
    except BadSample as e:
        raise SystemExit(f"{args.samples} cannot be trained by {model} ({e}): run with the model that recorded "
                         f"them (MODEL=... / SPANRL_MODEL)") from None
    with console.status(f"one update of {len(samples)} samples ({model}), unpacked then tree-packed"):
        report = {"model": model, "samples": len(samples), "version": args.version, "groups": args.groups,
                  "side_by_side": side_by_side(samples, model)}
    console.print(json.dumps(report["side_by_side"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
