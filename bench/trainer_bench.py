"""Benchmark (5): trainer tokens/s and seconds per update for the base model (SPANRL_MODEL).

    python -m bench.trainer_bench [--updates 2] [--samples 8] [--prompt 200] [--completion 100] [--kl-coef 0.05]
                                  [--lora-rank 16]

Uses the trainer's own code (spanrl.trainer.train.load_model / build_engine / train_update: DeepSpeed
ZeRO-2; fp32 + DeepSpeedCPUAdam on CPU, bf16 + FusedAdam on GPU) on synthetic GRPO samples.
The first update is a warm-up and is reported separately; the figure is the median of the rest.
Prints one JSON line. bench/gpu_trainer.py runs the same on a GPU with larger defaults.
``--kl-coef`` > 0 loads the reference policy (the base weights, frozen) as the trainer does and
adds its KL term; the line then has the reference model's bytes. ``rss_after_setup_mib`` and
``peak_rss_mib`` (the process's maximum resident set, getrusage) are comparable between two runs
of this script (each its own process).

Memory (issue 20): a thread samples the resident set every 2 ms; ``phase_peak_rss_mib`` is the
highest RSS seen in each phase (load_model, build_engine, then per update u0, u1, ...: forward,
backward, step, the rest of train_update), ``model_state_mib`` the fp32 Adam model state
(parameters x 16 bytes: weights, gradients, two moments), ``target_rss_mib`` twice that (issue
20's target) and ``peak_over_target`` = peak RSS / target. ``--activation-checkpointing`` and
``--logprob-chunk`` default to the trainer's settings (TrainerConfig); run the script with
``PYTHONPATH`` at an older checkout (from that checkout) to measure its code with this harness:
options it lacks are then left out.
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


class PhaseRss:
    """Peak resident set per named phase, sampled every ``interval_s`` by a daemon thread
    (torch's CPU allocator is invisible to tracemalloc; RSS is what the kernel charges)."""

    def __init__(self, interval_s: float = 0.002):
        import threading

        self.phase, self.peaks = "start", {}
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._interval = interval_s
        threading.Thread(target=self._sample, daemon=True).start()

    def rss_mib(self) -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page / 2**20

    def _sample(self) -> None:
        while True:
            r, p = self.rss_mib(), self.phase
            self.peaks[p] = max(self.peaks.get(p, 0.0), r)
            time.sleep(self._interval)

    def wrap(self, obj, name: str, label) -> None:
        """Count calls of ``obj.name`` as phase ``label()``, what follows as ``label()`` + ``:rest``."""
        f = getattr(obj, name)

        def wrapped(*args, **kwargs):
            self.phase = label()
            try:
                return f(*args, **kwargs)
            finally:
                self.phase = label().rsplit(":", 1)[0] + ":rest"
        setattr(obj, name, wrapped)


def model_state_bytes(params: int) -> int:
    """Bytes of an fp32 Adam model state: weights, gradients and two moments, 4 bytes each per
    parameter (issue 20's yardstick: 135M parameters -> 2.15 GB)."""
    return 16 * params


def measure(updates: int, n: int, prompt: int, completion: int, micro_batch: int, kl_coef: float = 0.0,
            micro_batch_tokens: int | None = None, activation_checkpointing: bool | None = None,
            logprob_chunk: int | None = None, lora_rank: int | None = None) -> dict:
    import inspect
    import resource

    import torch

    from spanrl.core.settings import get_settings
    from spanrl.trainer import train
    from spanrl.trainer.train import build_engine, load_model, load_reference_model, train_update

    rss = PhaseRss()
    cfg = train.TrainerConfig()
    extra, options = {}, {}
    if "activation_checkpointing" in inspect.signature(load_model).parameters:  # older code: left out
        ckpt = cfg.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
        options["activation_checkpointing"] = ckpt
        extra_load = {"activation_checkpointing": ckpt}
    else:
        extra_load = {}
    if "logprob_chunk" in inspect.signature(train_update).parameters:
        extra["logprob_chunk"] = options["logprob_chunk"] = cfg.logprob_chunk if logprob_chunk is None else logprob_chunk
    adapter = None
    if "adapter" in inspect.signature(load_model).parameters:  # LoRA (trainer/lora.py); older code: left out
        from spanrl.trainer import lora

        rank = cfg.lora_rank if lora_rank is None else lora_rank
        adapter = lora.lora_spec(rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
        options["lora_rank"] = rank
        extra_load["adapter"] = adapter
    t0 = time.perf_counter()
    rss.phase = "load_model"
    model = load_model(get_settings().model_dir, **extra_load)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rss.phase = "build_engine"
    engine = build_engine(model, lr=1e-6, micro_batch=micro_batch)
    if kl_coef > 0 and adapter is not None:
        ref = lora.AdapterDisabled(engine.module)  # the trainer's reference for a LoRA policy
    else:
        ref = load_reference_model(get_settings().model_dir) if kl_coef > 0 else None
    setup_s = time.perf_counter() - t0
    rss_setup = _rss_mib()
    batch = samples(n, prompt, completion)
    update = [0]
    for name in ("forward", "backward", "step"):
        rss.wrap(engine, name, lambda name=name: f"u{update[0]}:{name}")
    per = []
    for u in range(updates):
        update[0] = u
        rss.phase = f"u{u}:rest"
        per.append(train_update(engine, batch, micro_batch=micro_batch, kl_coef=kl_coef, ref_model=ref,
                                micro_batch_tokens=micro_batch_tokens, **extra))
    rss.phase = "end"
    time.sleep(0.01)
    timed = per[1:] or per
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    state = model_state_bytes(params) / 2**20
    checkpoint_bytes = _checkpoint_bytes(model, adapter)
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "device": dev, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "code": str(Path(train.__file__).resolve().parents[1]), **options,
        "params": {"updates": updates, "samples": n, "prompt_tokens": prompt, "completion_tokens": completion,
                   "micro_batch": micro_batch, "micro_batch_tokens": micro_batch_tokens, "ppo_epochs": 1,
                   "dtype": "bf16" if torch.cuda.is_available() else "fp32"},
        "kl_coef": kl_coef,
        # a LoRA policy's reference is the same model, adapter off: no second copy
        "reference_model_mib": (sum(p.numel() * p.element_size() for p in ref.parameters()) / 2**20)
        if isinstance(ref, torch.nn.Module) else 0.0,
        "rss_after_setup_mib": rss_setup,
        "peak_rss_mib": peak,
        "phase_peak_rss_mib": {k: round(v) for k, v in rss.peaks.items()},
        "parameters": params, "trainable_parameters": trainable, "checkpoint_bytes": checkpoint_bytes,
        "model_state_mib": round(state), "target_rss_mib": round(2 * state),
        "peak_over_target": round(peak / (2 * state), 3),
        "setup_s": setup_s, "warmup_update_s": per[0]["update_s"],
        "s_per_update": statistics.median(p["update_s"] for p in timed),
        "tokens_per_s": statistics.median(p["tokens_per_s"] for p in timed),
        "summary": {"device": dev, "peak_rss_mib": round(peak), "peak_over_target": round(peak / (2 * state), 3),
                    "s_per_update": round(statistics.median(p["update_s"] for p in timed), 2),
                    "tokens_per_s": round(statistics.median(p["tokens_per_s"] for p in timed), 1)},
    }


def _checkpoint_bytes(model, adapter: dict | None) -> int:
    """Bytes a published checkpoint of ``model`` has: the adapter files (trainer/lora.py's
    save_adapter into a scratch dir) with LoRA, else the full fp32/bf16 weights (parameters x
    element size: what model.safetensors holds, tied weights once)."""
    if adapter is None:  # parameters() yields a tied tensor once
        return sum(p.numel() * p.element_size() for p in model.parameters())
    import tempfile

    from spanrl.trainer import lora

    with tempfile.TemporaryDirectory() as d:
        lora.save_adapter(model, Path(d), "bench")
        return sum(f.stat().st_size for f in Path(d).iterdir())


def run_subprocess(args: list[str] | None = None, timeout: float = 1200) -> dict:
    """Run in a fresh process (DeepSpeed initialises torch.distributed once per process)."""
    from spanrl.core.settings import child_env

    p = subprocess.run([sys.executable, "-m", "bench.trainer_bench", *(args or [])], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout,
                       env=child_env({"PYTHONPATH": str(REPO)}))
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
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="padded tokens per micro-batch (None: off)")
    ap.add_argument("--activation-checkpointing", type=int, choices=(0, 1), default=None,
                    help="default: SPANRL_TRAINER_ACTIVATION_CHECKPOINTING")
    ap.add_argument("--logprob-chunk", type=int, default=None, help="default: SPANRL_TRAINER_LOGPROB_CHUNK")
    ap.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (0: full fine-tuning); default: SPANRL_TRAINER_LORA_RANK")
    a = ap.parse_args(argv)
    ckpt = None if a.activation_checkpointing is None else bool(a.activation_checkpointing)
    print(json.dumps(measure(a.updates, a.samples, a.prompt, a.completion, a.micro_batch, a.kl_coef,
                             a.micro_batch_tokens, ckpt, a.logprob_chunk, a.lora_rank)), flush=True)


if __name__ == "__main__":
    main()
