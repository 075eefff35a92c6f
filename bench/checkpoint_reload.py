"""Benchmark (4): checkpoint write, and published -> vLLM serving it.

    python -m bench.checkpoint_reload [--vllm-url http://127.0.0.1:PORT] [--allow-stack-vllm] [--lora-rank R]

Steps, each timed, with the trainer's and reloader's own functions, for the model of ``SPANRL_MODEL``:
  write    spanrl.trainer.train.save_checkpoint (safetensors + config + tokenizer + sha256 manifest)
  publish  spanrl.trainer.checkpoint.upload_checkpoint to MinIO (manifest last) = the moment it is published
  fetch    spanrl.trainer.checkpoint.download_checkpoint (download + verify every sha256), as the reloader does
  merge    adapter checkpoints only: spanrl.trainer.lora.merge_adapter_dir (W + (alpha / r) B A into a copy of
           the base's files), as the reloader does before a reload
  reload   spanrl.trainer.reloader.reload_vllm (pause, reload_weights, reset prefix cache, resume) - only with
           --vllm-url; the stack's own vLLM is refused unless --allow-stack-vllm (a reload pauses it).
published -> serving = fetch (+ merge) + reload. With ``--lora-rank R`` > 0 the same invocation measures the
full checkpoint and then a rank-R LoRA adapter checkpoint of the same model (the trainer's lora_alpha and
target modules; peft's init, B = 0, so the merged weights vLLM ends up serving equal the base's while the
merge does all its arithmetic), side by side, with LoRA / full ratios. Objects go to a private run name
(bench-<id>) and are removed. The proxy is not told about the version (the stack's proxy must not see bench
versions).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


STEPS = ("write_s", "publish_s", "fetch_verify_s", "merge_s", "reload_s", "published_to_serving_s")


def _one_checkpoint(model, s, client, run: str, version: int, tmp: Path, vllm_url: str | None,
                    adapter: dict | None) -> dict:
    """Write, publish, fetch + verify (and for an adapter, merge) and reload one checkpoint of
    ``model`` as version ``version`` of ``run``; seconds per step, ``bytes`` written."""
    from spanrl.trainer import checkpoint, lora
    from spanrl.trainer.train import base_model_id, save_checkpoint

    uri = checkpoint.checkpoint_uri(s.checkpoint_bucket, run, version)
    w, r = tmp / f"w{version}", tmp / f"r{version}"
    out: dict = {"adapter": adapter}
    t = time.perf_counter()
    save_checkpoint(model, s.model_dir, w, run=run, version=version, parent_version=0,
                    base_model=base_model_id(s.model_dir) if adapter else "bench", step=version,
                    trained_offsets={}, metrics={}, **({"adapter": adapter} if adapter else {}))
    out["write_s"] = time.perf_counter() - t
    out["bytes"] = sum(p.stat().st_size for p in w.iterdir())
    t = time.perf_counter()
    checkpoint.upload_checkpoint(client, w, uri)
    out["publish_s"] = time.perf_counter() - t
    t = time.perf_counter()
    checkpoint.download_checkpoint(client, uri, r)
    out["fetch_verify_s"] = time.perf_counter() - t
    served, out["merge_s"] = r, None
    if adapter:
        t = time.perf_counter()
        served = lora.merge_adapter_dir(s.model_dir, r, lora.merged_dir(r))
        out["merge_s"] = time.perf_counter() - t
    out["reload_s"] = out["published_to_serving_s"] = None
    if vllm_url:
        from spanrl.trainer.reloader import reload_vllm

        t = time.perf_counter()
        asyncio.run(reload_vllm(vllm_url, served))
        out["reload_s"] = time.perf_counter() - t
        out["published_to_serving_s"] = out["fetch_verify_s"] + (out["merge_s"] or 0.0) + out["reload_s"]
    else:
        out["note"] = "no --vllm-url: vLLM reload not measured (published -> verified on disk only)"
    out["summary"] = {k: (round(out[k], 2) if isinstance(out[k], float) else out[k]) for k in STEPS}
    return out


def measure(vllm_url: str | None, lora_rank: int = 0) -> dict:
    """The full checkpoint's steps (:func:`_one_checkpoint`) at the top level, and with
    ``lora_rank`` > 0 a LoRA adapter checkpoint's under ``lora`` and ``lora_over_full`` (LoRA's
    figure / full's, per step and for bytes). Raises ValueError for a negative rank."""
    from spanrl.core.settings import TrainerConfig, get_settings
    from spanrl.trainer import checkpoint, lora
    from spanrl.trainer.train import load_model

    s = get_settings()
    t = TrainerConfig()
    adapter = lora.lora_spec(lora_rank, t.lora_alpha, t.lora_dropout, t.lora_target_modules)
    run = f"bench-{uuid.uuid4().hex[:8]}"
    client = checkpoint.make_client(s)
    model = load_model(s.model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="spanrl-bench-ckpt-"))
    out: dict = {"run": run, "model": s.model, "model_dir": str(s.model_dir)}
    try:
        out.update(_one_checkpoint(model, s, client, run, 1, tmp, vllm_url, None))
        if adapter:
            shutil.rmtree(tmp / "w1", ignore_errors=True)
            shutil.rmtree(tmp / "r1", ignore_errors=True)
            out["lora"] = _one_checkpoint(lora.wrap(model, adapter), s, client, run, 2, tmp, vllm_url, adapter)
            out["lora_over_full"] = {k: round(out["lora"][k] / out[k], 4) for k in ("bytes", *STEPS)
                                     if out["lora"].get(k) and out.get(k)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for o in client.list_objects(s.checkpoint_bucket, prefix=f"{run}/", recursive=True):
            client.remove_object(s.checkpoint_bucket, o.object_name)
    return out


def run_subprocess(args: list[str] | None = None, timeout: float = 900) -> dict:
    from spanrl.core.settings import child_env

    p = subprocess.run([sys.executable, "-m", "bench.checkpoint_reload", *(args or [])], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout,
                       env=child_env({"PYTHONPATH": str(REPO)}))
    if p.returncode:
        return {"error": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-url")
    ap.add_argument("--allow-stack-vllm", action="store_true")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="> 0: also a rank-R LoRA adapter checkpoint of the same model, side by side")
    a = ap.parse_args(argv)
    if a.vllm_url:
        from spanrl.core.settings import get_settings

        if a.vllm_url.rstrip("/") == get_settings().vllm_url and not a.allow_stack_vllm:
            sys.exit(f"{a.vllm_url} is the stack's vLLM; a reload pauses it. Pass --allow-stack-vllm to do it anyway.")
    print(json.dumps(measure(a.vllm_url, a.lora_rank)), flush=True)


if __name__ == "__main__":
    main()
