"""One update of the same batch with 1 rank and with N ranks (issue 20 items 2 and 4).

    python -m bench.ranks [--ranks 2] [--model DIR] [--samples 16] [--prompt 120] [--completion 60]
                          [--calls 1] [--prefix-merge] [--micro-batch 4] [--mini-batches 1] [--lr 1e-5] [--updates 1]
                          [--zero-stage 0|2|3] [--logprob-chunk N] [--out DIR]

Each group is started the way the trainer starts itself with ``SPANRL_TRAINER_RANKS`` > 1:
DeepSpeed's launcher (trainer/ranks.launch_argv), every rank running ``python -m bench.ranks
worker SPEC``: the trainer's own ``load_model`` / ``build_engine`` (ZeRO-2, gloo, fp32,
DeepSpeedCPUAdam) / ``train_update`` on the same synthetic samples (behaviour log-probs = the
model's own, two returns per group so GRPO's advantages are not zero). The 1-rank group runs
through the launcher too. Compared: every parameter after the update (``param_rel_diff``:
``||theta_N - theta_1|| / ||theta_1||`` over all parameters; ``max_rel_param_diff``: the largest
``max|a - b| / max|a|`` over tensors, which a tensor near zero such as a fresh bias inflates;
``update_rel_diff``: ``||d_N - d_1|| / ||d_1||`` of the updates ``d = after - before``, the
strictest), the last update's loss and ratio figures, and per rank the last update's seconds
(``--updates`` > 1: the first is a warm-up) and the peak resident set (getrusage). Prints one JSON object and
writes it to ``OUT/ranks.json``. ``--model``: default the stack's base model (SPANRL_MODEL).
"""
from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def synthetic_samples(n: int, prompt: int, completion: int, vocab: int, seed: int = 0, calls: int = 1) -> list[dict]:
    """``n`` samples: rollouts of ``calls`` calls each (the last may have fewer), in groups of 4
    rollouts (task ``t<rollout // 4>``), returns 1.0 / 0.0 alternating by rollout (a group's
    advantages are ±1 after GRPO's scaling). A rollout's first prompt and each completion have
    lengths drawn in ``[len/2, len]``; call k > 0's prompt is call k-1's prompt + completion + 3-6
    inserted tokens (a tool result), so with ``calls`` > 1 the calls of a rollout chain
    (trainer/prefix_merge.py). Token ids in ``[1, vocab)``; behaviour log-probs are filled in by
    the worker."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r, k = divmod(i, calls)
        if k == 0:
            context = [rng.randrange(1, vocab) for _ in range(rng.randint(prompt // 2, prompt))]
        else:
            prev = out[-1]["transition"]
            context = (prev["prompt_token_ids"] + prev["completion_token_ids"]
                       + [rng.randrange(1, vocab) for _ in range(rng.randint(3, 6))])
        c = rng.randint(completion // 2, completion)
        ret = float(r % 2)
        out.append({"group_id": f"t{r // 4}", "group_std": 0.5, "group_rollouts": 4, "advantage": 2 * ret - 1,
                    "transition": {
                        "rollout_id": f"r{r}", "attempt_id": f"r{r}-a0", "task_id": f"t{r // 4}", "call_index": k,
                        "agent_name": "solver", "prompt_token_ids": context,
                        "completion_token_ids": [rng.randrange(1, vocab) for _ in range(c)],
                        "behaviour_logprobs": [0.0] * c, "episode_return": ret, "reward": ret}})
    return out


def fill_behaviour_logprobs(model, samples: list[dict]) -> None:
    """Each sample's behaviour log-probs := the model's own (one forward per sample, no grad)."""
    import torch

    with torch.no_grad():
        for s in samples:
            t = s["transition"]
            ids = torch.tensor([t["prompt_token_ids"] + t["completion_token_ids"]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            targets = ids[0, 1:]
            picked = logp.gather(-1, targets[:, None])[:, 0]
            t["behaviour_logprobs"] = picked[len(t["prompt_token_ids"]) - 1:].tolist()


def worker(spec_path: Path) -> None:
    """One rank: load, build the engine, one update; rank 0 writes the parameters before and
    after; every rank writes its timing and memory to ``OUT/rank<r>-of<N>.json``."""
    import torch

    from spanrl.trainer.train import build_engine, gathered_state_dict, load_model, rank_and_world, train_update

    spec = json.loads(spec_path.read_text())
    out = Path(spec["out"])
    torch.manual_seed(0)
    model = load_model(Path(spec["model"]), activation_checkpointing=spec["activation_checkpointing"])
    samples = synthetic_samples(spec["samples"], spec["prompt"], spec["completion"], model.config.vocab_size,
                                calls=spec.get("calls", 1))
    fill_behaviour_logprobs(model, samples)
    engine = build_engine(model, lr=spec["lr"], micro_batch=spec["micro_batch"], zero_stage=spec["zero_stage"])
    rank, world = rank_and_world()
    state = gathered_state_dict(engine)  # ZeRO-3: a collective; None on ranks > 0
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in state.items()}, out / "before.pt")
    seconds = []
    for _ in range(spec["updates"]):  # the same batch each time; the last update's figures are reported
        t0 = time.perf_counter()
        metrics = train_update(engine, samples, micro_batch=spec["micro_batch"],
                               micro_batch_tokens=spec["micro_batch_tokens"], mini_batches=spec["mini_batches"],
                               logprob_chunk=spec["logprob_chunk"], prefix_merge=spec.get("prefix_merge", False))
        seconds.append(time.perf_counter() - t0)
    state = gathered_state_dict(engine)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in state.items()}, out / f"after-{world}.pt")
    (out / f"rank{rank}-of{world}.json").write_text(json.dumps({
        "rank": rank, "world": world, "update_s": seconds[-1], "first_update_s": seconds[0],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float, str))}}))


def run_group(ranks: int, spec: dict, out: Path, timeout_s: float = 900) -> list[dict]:
    """Start ``ranks`` workers through the trainer's launcher and wait; their rank reports."""
    from spanrl.core.settings import child_env
    from spanrl.trainer import ranks as R

    spec_path = out / f"spec-{ranks}.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    threads = R.threads_per_rank(int(spec.get("threads", 2)), ranks)
    argv = R.launch_argv(sys.executable, ranks, R.free_port(), "bench.ranks", ["worker", str(spec_path)])
    with open(out / f"group-{ranks}.log", "w") as log:
        rc = subprocess.call(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                             env=child_env({"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}))
    if rc != 0:
        tail = (out / f"group-{ranks}.log").read_text()[-3000:]
        raise RuntimeError(f"the {ranks}-rank group exited with {rc}:\n{tail}")
    return [json.loads((out / f"rank{r}-of{ranks}.json").read_text()) for r in range(ranks)]


def compare(before: dict, one: dict, many: dict) -> dict:
    """Parameter differences between the 1-rank and the N-rank update (see the module doc)."""
    import torch

    rel, num, den, diff, norm = 0.0, 0.0, 0.0, 0.0, 0.0
    for k, a in one.items():
        a, b, b0 = a.double(), many[k].double(), before[k].double()
        scale = float(a.abs().max()) or 1.0
        rel = max(rel, float((a - b).abs().max()) / scale)
        diff += float(((a - b) ** 2).sum())
        norm += float((a ** 2).sum())
        d1, dn = a - b0, b - b0
        num += float(((dn - d1) ** 2).sum())
        den += float((d1 ** 2).sum())
    return {"param_rel_diff": (diff / norm) ** 0.5, "max_rel_param_diff": rel,
            "update_rel_diff": (num / den) ** 0.5 if den else 0.0, "update_norm": den ** 0.5}


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", default="compare", choices=["compare", "worker"])
    ap.add_argument("spec", nargs="?", type=Path, help="worker: the group's spec file")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--model", type=Path, help="model directory (default: the stack's base model)")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=120)
    ap.add_argument("--completion", type=int, default=60)
    ap.add_argument("--calls", type=int, default=1, help="calls per rollout, each extending the last (chains)")
    ap.add_argument("--prefix-merge", action="store_true", help="train chained calls as merged rows")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--micro-batch-tokens", type=int, default=2048)
    ap.add_argument("--mini-batches", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--updates", type=int, default=1, help="updates on the same batch; the last one is timed")
    ap.add_argument("--zero-stage", type=int, default=2, choices=(0, 2, 3), help="ZeRO stage of both groups")
    ap.add_argument("--logprob-chunk", type=int, help="default: the trainer's setting (0 with --zero-stage 3)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of the whole group (split over ranks)")
    ap.add_argument("--no-activation-checkpointing", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("results/ranks"))
    args = ap.parse_args(argv)
    if args.mode == "worker":
        worker(args.spec)
        return None
    import torch

    from spanrl.core.settings import TrainerConfig, get_settings

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    spec = {"model": str(args.model or get_settings().model_dir), "samples": args.samples, "prompt": args.prompt,
            "completion": args.completion, "calls": args.calls, "prefix_merge": args.prefix_merge,
            "micro_batch": args.micro_batch,
            "micro_batch_tokens": args.micro_batch_tokens, "mini_batches": args.mini_batches, "lr": args.lr,
            "updates": args.updates, "zero_stage": args.zero_stage,
            "logprob_chunk": args.logprob_chunk if args.logprob_chunk is not None else
            (0 if args.zero_stage == 3 else TrainerConfig.default("logprob_chunk")),
            "threads": args.threads, "activation_checkpointing": not args.no_activation_checkpointing}
    groups = {}
    for n in (1, args.ranks):
        t0 = time.perf_counter()
        groups[n] = {"ranks": run_group(n, spec, out), "wall_s": time.perf_counter() - t0}
        print(f"[ranks] {n} rank(s): update {max(r['update_s'] for r in groups[n]['ranks']):.1f}s", flush=True)
    before = torch.load(out / "before.pt")
    diff = compare(before, torch.load(out / "after-1.pt"), torch.load(out / f"after-{args.ranks}.pt"))
    m1, mn = groups[1]["ranks"][0]["metrics"], groups[args.ranks]["ranks"][0]["metrics"]
    report = {
        "spec": spec, **diff,
        "metrics_diff": {k: abs(m1[k] - mn[k]) for k in ("loss", "approx_kl", "clip_frac", "grad_norm")
                         if isinstance(m1.get(k), float) and isinstance(mn.get(k), float)},
        "groups": {str(n): {"update_s": max(r["update_s"] for r in g["ranks"]), "wall_s": round(g["wall_s"], 1),
                            "peak_rss_mib_per_rank": [round(r["peak_rss_mib"]) for r in g["ranks"]],
                            "steps": g["ranks"][0]["metrics"]["steps"],
                            "rows": g["ranks"][0]["metrics"].get("prefix_merge_rows")}
                   for n, g in groups.items()},
    }
    (out / "ranks.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
