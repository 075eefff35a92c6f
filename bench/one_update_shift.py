"""Does one update raise what it rewards? The trainer's own update on a run's recorded samples,
once per setting, and the log-prob shift of those samples' completions under the new weights.

    python -m bench.one_update_shift dump OUT.json                  # the stack's `samples` topic
    python -m bench.one_update_shift run OUT.json --version 0 \\
        --setting lr=5e-5 --setting lr=1e-5,mini_batches=8 --setting lr=5e-5,negative_advantage_weight=0
    python -m bench.one_update_shift run OUT.json --chain --setting lr=1e-5,mini_batches=8,kl_coef=0.1

Each ``--setting`` (``key=value`` pairs of ``train_update``'s options, plus ``lr``) starts from
the base weights (SPANRL_MODEL), trains one update of the demo's PPO options (token mean, Dr. GRPO,
zero-variance groups dropped, its lr and mini-batches unless set; the demo's replay of earlier
updates and its reference KL only when set, e.g. ``kl_coef=0.2``) on the samples of behaviour version
``--version`` (iteration 0's: sampled from the base policy), and scores every completion with a
non-zero advantage under the updated weights in the trainer's own forward (no vLLM needed):
``examples.math_agent.main_job.logprob_shift``, the main job's figure for its first iteration,
whose `base` line (the weights before the update) must be 0.0 when the recorded behaviour
log-probs are exact. Prints one JSON line per setting (docs/measured/learning-archive.md, 2026-12-03). Offline and
on CPU: ~2.5 min per setting for 75 samples of SmolLM2-135M on 2 cores.
``--chain`` replays every recorded version in order, one update each, and prints iteration 0's
shift after each (:func:`run_chain`; a screening replay, off-policy after the first update).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

def demo_update_options() -> dict:
    """``train_update`` keywords (and ``lr``) of the demo's trainer: TrainerConfig's defaults (recipe
    ``default``, spanrl/core/recipes.py) with the main job's DRIVER_TRAINER_ENV over them (the one
    place either is written)."""
    from examples.math_agent.main_job import DRIVER_TRAINER_ENV
    from spanrl.trainer.train import TrainerConfig

    cfg = TrainerConfig.from_environ(DRIVER_TRAINER_ENV)
    return {k: getattr(cfg, k) for k in ("lr", "loss_agg", "advantage_std_scale", "drop_zero_variance",
                                         "mini_batches", "micro_batch", "micro_batch_tokens")}


def parse_setting(text: str) -> dict:
    """``"lr=1e-5,mini_batches=8"`` -> ``{"lr": 1e-05, "mini_batches": 8}`` (ints, floats, booleans
    and strings by their look). Raises ValueError for an item without ``=`` or without ``lr``."""
    out: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} is not key=value")
        low = raw.lower()
        if low in ("true", "false"):
            value: object = low == "true"
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        out[key.strip()] = value
    if "lr" not in out:
        raise ValueError(f"setting {text!r} has no lr")
    return out


def completion_logprob_sums(model, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Summed log p(completion | prompt) in nats for each ``(prompt_ids, completion_ids)`` under
    ``model`` (a causal LM; one unpadded forward per pair, no gradients)."""
    import torch

    from spanrl.trainer import losses

    was_training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for prompt, completion in pairs:
            ids = torch.tensor([prompt + completion])
            mask = torch.tensor([[0.0] * len(prompt) + [1.0] * len(completion)])
            out.append(float(losses.token_logprobs(model(input_ids=ids).logits, ids, mask).sum()))
    model.train(was_training)
    return out


def _deltas(shift: dict) -> dict:
    return {sign: round(v["delta"], 4) for sign, v in shift.items()}


def run(samples: list[dict], settings: list[dict], model_dir: Path, console) -> list[dict]:
    """One update per setting from ``model_dir``'s weights on ``samples``; the shift of each."""
    from examples.math_agent.main_job import logprob_shift
    from spanrl.trainer.train import build_engine, load_model, train_update

    rows = []
    base = load_model(model_dir)
    rows.append({"setting": "base", "shift": _deltas(logprob_shift(
        samples, lambda pairs: completion_logprob_sums(base, pairs)))})
    console.print(json.dumps(rows[-1]))
    del base
    for st in settings:
        t0 = time.monotonic()
        opts = {**demo_update_options(), **st}
        lr = opts.pop("lr")
        engine = build_engine(load_model(model_dir, activation_checkpointing=True), lr=lr,
                              micro_batch=opts["micro_batch"])
        with console.status(f"update {st}"):
            m = train_update(engine, samples, **opts)
            shift = logprob_shift(samples, lambda pairs: completion_logprob_sums(engine.module, pairs))
        rows.append({"setting": st, "shift": _deltas(shift), "steps": m["steps"],
                     **{k: round(m[k], 4) for k in ("approx_kl", "grad_norm", "clip_frac") if k in m},
                     "wall_s": round(time.monotonic() - t0, 1)})
        console.print(json.dumps(rows[-1]))
    return rows


def run_chain(by_version: dict[int, list[dict]], settings: list[dict], model_dir: Path, console) -> list[dict]:
    """Per setting, from ``model_dir``'s weights: one update per recorded behaviour version in
    order (version 0's samples, then 1's, ...), and after each the shift of version 0's
    completions (the main job's ``logprob_shift_iteration0``) and of that update's own.

    A screening replay, not a run: versions >= 1 were sampled by the recorded run's policies,
    not by this setting's, so their importance ratios start away from 1 (``clip_frac``).
    ``kl_coef`` > 0 loads the base weights a second time as the reference policy."""
    from examples.math_agent.main_job import logprob_shift
    from spanrl.trainer.train import build_engine, load_model, train_update

    rows = []
    first = by_version[min(by_version)]
    for st in settings:
        opts = {**demo_update_options(), **st}
        lr = opts.pop("lr")
        if opts.get("kl_coef", 0.0) > 0:
            opts["ref_model"] = load_model(model_dir).eval()
        engine = build_engine(load_model(model_dir, activation_checkpointing=True), lr=lr,
                              micro_batch=opts["micro_batch"])
        score = lambda pairs: completion_logprob_sums(engine.module, pairs)  # noqa: E731
        for v in sorted(by_version):
            t0 = time.monotonic()
            with console.status(f"{st}: update on version {v}"):
                m = train_update(engine, by_version[v], **opts)
                row = {"setting": st, "update_on_version": v, "iteration0": _deltas(logprob_shift(first, score)),
                       "own": _deltas(logprob_shift(by_version[v], score)), "steps": m["steps"],
                       **{k: round(m[k], 4) for k in ("approx_kl", "ref_kl", "grad_norm", "clip_frac") if k in m},
                       "wall_s": round(time.monotonic() - t0, 1)}
            rows.append(row)
            console.print(json.dumps(row))
        del engine
        opts.pop("ref_model", None)
    return rows


def final_shift(samples: list[dict], weights_dir: Path) -> dict:
    """The main job's end-of-run figures for a recorded run, offline: every completion of
    ``samples`` (a dump of one run's samples) against its behaviour log-probs under the weights
    in ``weights_dir`` (a checkpoint: model.safetensors + config.json), pooled and per behaviour
    version (``main_job.logprob_shift_all``), scored in the trainer's own forward."""
    from examples.math_agent.main_job import logprob_shift_all
    from spanrl.trainer.train import load_model

    model = load_model(weights_dir)
    by_version: dict[int, list[dict]] = {}
    for x in samples:
        by_version.setdefault(x["transition"]["policy_version"], []).append(x)
    got = logprob_shift_all([by_version[v] for v in sorted(by_version)],
                            lambda pairs: completion_logprob_sums(model, pairs))
    return {"all": _deltas(got["all"]), "per_version": {v: _deltas(x) for v, x in zip(sorted(by_version),
                                                                                        got["per_iteration"])}}


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="write the stack's samples topic to a JSON file")
    d.add_argument("out", type=Path)
    r = sub.add_parser("run", help="one update per --setting on a dump's samples")
    r.add_argument("samples", type=Path)
    r.add_argument("--version", type=int, default=0, help="behaviour version of the samples trained")
    r.add_argument("--setting", action="append", required=True, type=parse_setting)
    r.add_argument("--chain", action="store_true", help="one update per recorded version in order "
                   "(0, 1, ...; --version ignored), version 0's shift after each (run_chain)")
    f = sub.add_parser("final", help="every completion's shift under a checkpoint's weights (final_shift)")
    f.add_argument("samples", type=Path)
    f.add_argument("weights", type=Path, help="a checkpoint folder (model.safetensors, config.json)")
    f.add_argument("--offsets", default=None, help="FIRST:END: only samples at these offsets of the dump "
                                                 "(one run's range, from its checkpoints' consumed_offsets)")
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    from spanrl.core.settings import get_settings

    s = get_settings()
    if args.cmd == "dump":
        from spanrl.infra.replay import read_records
        from spanrl.schemas import topics as T
        from spanrl.schemas import decode

        # each sample with where it lies (a checkpoint manifest's consumed_offsets name ranges)
        xs = [{**decode(T.SAMPLES.record, v), "_partition": p, "_offset": o}
              for p, o, _, v in asyncio.run(read_records(s.kafka_bootstrap, T.SAMPLES.name))]
        args.out.write_text(json.dumps(xs))
        console.print(f"{len(xs)} samples -> {args.out}")
        return
    every = json.loads(args.samples.read_text())
    if args.cmd == "final":
        if args.offsets:
            first, end = (int(v) for v in args.offsets.split(":"))
            every = [x for x in every if first <= x["_offset"] < end]
        print(json.dumps(final_shift(every, args.weights)), flush=True)
        return
    if args.chain:
        by_version: dict[int, list[dict]] = {}
        for x in every:
            by_version.setdefault(x["transition"]["policy_version"], []).append(x)
        for row in run_chain(by_version, args.setting, s.model_dir, console):
            print(json.dumps(row), flush=True)
        return
    xs = [x for x in every if x["transition"]["policy_version"] == args.version]
    if not xs:
        sys.exit(f"no samples of behaviour version {args.version} in {args.samples}")
    for row in run(xs, args.setting, s.model_dir, console):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
