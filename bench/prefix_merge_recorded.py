"""Prefix-merged rows on a run's recorded samples: what merges, why chains break, and the same
update merged and per call, side by side (issue 20 items 3 and 4).

    python -m bench.one_update_shift dump samples.json           # the stack's `samples` topic
    python -m bench.prefix_merge_recorded samples.json --offsets FIRST:END --update-version 0 \\
        --out docs/data/bench/prefix_merge_recorded.json

For every behaviour version of the samples (one update's worth with barrier batching):
``prefix_merge.merge_calls`` over them as one mini-batch — rows, links, tokens forwarded merged
and per call, breaks by cause, with the model's end-of-sequence ids. Then, for the samples of
``--update-version``, the trainer's own update (``train_update`` with the demo's options, from
the base weights SPANRL_MODEL, through DeepSpeed) once per call and once merged, one after the
other in this process: loss, approx KL, clip fraction and gradient norm must agree (the merged
loss is the per-call loss, trainer/README.md "Prefix-merged rows"), and the update times give
the merged/per-call ratio. Offline, CPU; ~1-3 min per update of ~75 samples of SmolLM2-135M on
2 cores.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from spanrl.trainer.tree_pack import common_prefix


def tree_tokens(samples: list[dict]) -> int:
    """Tokens a prefix tree of each attempt's calls would forward (AReaL's tree training: a
    call's tokens shared with an earlier call of the same attempt are forwarded once): over the
    calls of each ``(rollout_id, attempt_id)`` in ``call_index`` order, ``len(prompt +
    completion)`` minus the longest prefix it shares with an earlier call. A lower bound for
    what merged rows (paths only) can reach."""
    attempts: dict[tuple, list[dict]] = {}
    for s in samples:
        t = s["transition"]
        attempts.setdefault((t["rollout_id"], t["attempt_id"]), []).append(t)
    total = 0
    for calls in attempts.values():
        seen: list[list[int]] = []
        for t in sorted(calls, key=lambda t: t.get("call_index", 0)):
            seq = t["prompt_token_ids"] + t["completion_token_ids"]
            total += len(seq) - max((common_prefix(seq, prev) for prev in seen), default=0)
            seen.append(seq)
    return total


def merge_counts(samples: list[dict], stop_ids: "set[int] | None") -> dict:
    """``prefix_merge.merge_calls`` over ``samples`` (Sample dicts, one mini-batch) with their own
    advantages: ``{"calls", "rows", "links", "tokens", "tokens_per_call", "tokens_tree",
    "breaks"}``; ``tokens`` are forwarded merged, ``tokens_per_call`` per call (prompt +
    completion each), ``tokens_tree`` by a prefix tree of each attempt (:func:`tree_tokens`)."""
    from spanrl.trainer.prefix_merge import merge_calls

    m = merge_calls(samples, [s["advantage"] for s in samples], stop_ids)
    return {"calls": len(samples), "rows": len(m.rows), "links": m.links, "tokens": m.tokens,
            "tokens_per_call": m.tokens_per_call, "tokens_tree": tree_tokens(samples), "breaks": dict(m.breaks)}


def side_by_side(samples: list[dict], model_dir: Path) -> dict:
    """One update of ``samples`` from ``model_dir``'s weights per call, then merged (the demo's
    options, ``bench.one_update_shift.demo_update_options``): each run's loss, approx_kl,
    clip_frac, grad_norm, tokens and update_s, and the largest relative difference of the four
    figures."""
    import copy

    from bench.metrics import max_rel_diff
    from bench.one_update_shift import demo_update_options
    from spanrl.trainer.train import build_engine, load_model, train_update

    out = {}
    for merge in (False, True):
        opts = demo_update_options()
        lr = opts.pop("lr")
        engine = build_engine(load_model(model_dir), lr=lr, micro_batch=opts["micro_batch"])
        t0 = time.perf_counter()
        m = train_update(engine, copy.deepcopy(samples), prefix_merge=merge, **opts)
        out["merged" if merge else "per_call"] = {
            **{k: m.get(k) for k in ("loss", "approx_kl", "clip_frac", "grad_norm", "tokens", "steps")},
            "update_s": round(time.perf_counter() - t0, 2)}
        del engine
    a, b = out["per_call"], out["merged"]
    out["max_rel_diff"] = max_rel_diff(a, b, ("loss", "approx_kl", "clip_frac", "grad_norm"))
    out["time_ratio_merged_per_call"] = round(b["update_s"] / a["update_s"], 3)
    out["token_ratio_merged_per_call"] = round(b["tokens"] / a["tokens"], 3)
    return out


def main(argv: list[str] | None = None) -> None:
    from rich.console import Console

    from spanrl.core.settings import get_settings
    from spanrl.trainer.train import eos_token_ids, load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("samples", type=Path, help="a dump of the samples topic (bench.one_update_shift dump)")
    ap.add_argument("--offsets", default=None, help="FIRST:END: only samples at these offsets (one run's range)")
    ap.add_argument("--update-version", type=int, default=0, help="behaviour version of the side-by-side update")
    ap.add_argument("--out", type=Path, default=Path("results/prefix_merge_recorded.json"))
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    samples = json.loads(args.samples.read_text())
    if args.offsets:
        lo, hi = (int(x) for x in args.offsets.split(":"))
        samples = [s for s in samples if lo <= s["_offset"] < hi]
    model_dir = get_settings().model_dir
    stop_ids = eos_token_ids(load_model(model_dir))
    by_version: dict[int, list[dict]] = {}
    for s in samples:
        by_version.setdefault(s["transition"]["policy_version"], []).append(s)
    report = {"samples": len(samples), "offsets": args.offsets, "stop_ids": sorted(stop_ids or ()),
              "per_version": {v: merge_counts(by_version[v], stop_ids) for v in sorted(by_version)}}
    for v, c in report["per_version"].items():
        console.print(f"version {v}: {c['calls']} calls -> {c['rows']} rows, {c['tokens']} tokens merged vs "
                      f"{c['tokens_per_call']} per call ({c['tokens_tree']} as a prefix tree); breaks {c['breaks']}")
    with console.status(f"one update of version {args.update_version}'s samples, per call then merged"):
        report["side_by_side"] = side_by_side(by_version[args.update_version], model_dir)
    console.print(json.dumps(report["side_by_side"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
