"""Benchmark (5): trainer tokens/s and seconds per update for SmolLM2-135M.

    python -m bench.trainer_bench [--updates 2] [--samples 8] [--prompt 200] [--completion 100] [--kl-coef 0.05]

Uses the trainer's own code (spanrl.trainer.train.load_model / build_engine / train_update: DeepSpeed
ZeRO-2; fp32 + DeepSpeedCPUAdam on CPU, bf16 + FusedAdam on GPU) on synthetic GRPO samples.
The first update is a warm-up and is reported separately; the figure is the median of the rest.
Prints one JSON line. bench/gpu_trainer.py runs the same on a GPU with larger defaults.
``--kl-coef`` > 0 loads the reference policy (the base weights, frozen) as the trainer does and
adds its KL term; the line then has the reference model's bytes. ``rss_after_setup_mib`` and
``peak_rss_mib`` (the process's maximum resident set, getrusage) are comparable between two runs
of this script (each its own process).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def samples(n: int, prompt: int, completion: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        c = [rng.randrange(1, 49152) for _ in range(completion)]
        out.append({"advantage": 1.0 if i % 2 else -1.0, "transition": {
            "prompt_token_ids": [rng.randrange(1, 49152) for _ in range(prompt)], "completion_token_ids": c,
            "behaviour_logprobs": [-1.0] * completion, "episode_return": float(i % 2), "reward": float(i % 2)}})
    return out


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024


def measure(updates: int, n: int, prompt: int, completion: int, micro_batch: int, kl_coef: float = 0.0) -> dict:
    import resource

    import torch

    from spanrl.infra.settings import get_settings
    from spanrl.trainer.train import build_engine, load_model, load_reference_model, train_update

    t0 = time.perf_counter()
    model = load_model(get_settings().model_dir)
    engine = build_engine(model, lr=1e-6, micro_batch=micro_batch)
    ref = load_reference_model(get_settings().model_dir) if kl_coef > 0 else None
    setup_s = time.perf_counter() - t0
    rss_setup = _rss_mib()
    batch = samples(n, prompt, completion)
    per = [train_update(engine, batch, micro_batch=micro_batch, kl_coef=kl_coef, ref_model=ref)
           for _ in range(updates)]
    timed = per[1:] or per
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "device": dev, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "params": {"updates": updates, "samples": n, "prompt_tokens": prompt, "completion_tokens": completion,
                   "micro_batch": micro_batch, "ppo_epochs": 1,
                   "dtype": "bf16" if torch.cuda.is_available() else "fp32"},
        "kl_coef": kl_coef,
        "reference_model_mib": (sum(p.numel() * p.element_size() for p in ref.parameters()) / 2**20) if ref else 0.0,
        "rss_after_setup_mib": rss_setup,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "setup_s": setup_s, "warmup_update_s": per[0]["update_s"],
        "s_per_update": statistics.median(p["update_s"] for p in timed),
        "tokens_per_s": statistics.median(p["tokens_per_s"] for p in timed),
        "summary": {"device": dev, "s_per_update": round(statistics.median(p["update_s"] for p in timed), 2),
                    "tokens_per_s": round(statistics.median(p["tokens_per_s"] for p in timed), 1)},
    }


def run_subprocess(args: list[str] | None = None, timeout: float = 1200) -> dict:
    """Run in a fresh process (DeepSpeed initialises torch.distributed once per process)."""
    p = subprocess.run([sys.executable, "-m", "bench.trainer_bench", *(args or [])], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    if p.returncode:
        return {"error": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None, defaults=(3, 8, 200, 100, 4)) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=defaults[0], help="first one is a warm-up")
    ap.add_argument("--samples", type=int, default=defaults[1])
    ap.add_argument("--prompt", type=int, default=defaults[2])
    ap.add_argument("--completion", type=int, default=defaults[3])
    ap.add_argument("--micro-batch", type=int, default=defaults[4])
    ap.add_argument("--kl-coef", type=float, default=0.0, help="> 0: with the reference policy's KL term")
    a = ap.parse_args(argv)
    print(json.dumps(measure(a.updates, a.samples, a.prompt, a.completion, a.micro_batch, a.kl_coef)), flush=True)


if __name__ == "__main__":
    main()
