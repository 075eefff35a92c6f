"""Benchmark (4): checkpoint write, and published -> vLLM serving it.

    python -m bench.checkpoint_reload [--vllm-url http://127.0.0.1:PORT] [--allow-stack-vllm]

Steps, each timed, with the trainer's and reloader's own functions:
  write    spanrl.trainer.train.save_checkpoint (safetensors + config + tokenizer + sha256 manifest)
  publish  spanrl.trainer.checkpoint.upload_checkpoint to MinIO (manifest last) = the moment it is published
  fetch    spanrl.trainer.checkpoint.download_checkpoint (download + verify every sha256), as the reloader does
  reload   spanrl.trainer.reloader.reload_vllm (pause, reload_weights, reset prefix cache, resume) - only with
           --vllm-url; the stack's own vLLM is refused unless --allow-stack-vllm (a reload pauses it).
published -> serving = fetch + reload. Objects go to a private run name (bench-<id>) and are removed.
The proxy is not told about the version (the stack's proxy must not see bench versions).
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


def measure(vllm_url: str | None) -> dict:
    from spanrl.core.settings import get_settings
    from spanrl.trainer import checkpoint
    from spanrl.trainer.train import load_model, save_checkpoint

    s = get_settings()
    run = f"bench-{uuid.uuid4().hex[:8]}"
    uri = checkpoint.checkpoint_uri(s.checkpoint_bucket, run, 1)
    client = checkpoint.make_client(s)
    model = load_model(s.model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="spanrl-bench-ckpt-"))
    out: dict = {"run": run, "model_dir": str(s.model_dir)}
    try:
        t = time.perf_counter()
        save_checkpoint(model, s.model_dir, tmp / "w", run=run, version=1, parent_version=0,
                        base_model="bench", step=1, trained_offsets={}, metrics={})
        out["write_s"] = time.perf_counter() - t
        out["bytes"] = sum(p.stat().st_size for p in (tmp / "w").iterdir())
        t = time.perf_counter()
        checkpoint.upload_checkpoint(client, tmp / "w", uri)
        out["publish_s"] = time.perf_counter() - t
        t = time.perf_counter()
        checkpoint.download_checkpoint(client, uri, tmp / "r")
        out["fetch_verify_s"] = time.perf_counter() - t
        if vllm_url:
            from spanrl.trainer.reloader import reload_vllm

            t = time.perf_counter()
            asyncio.run(reload_vllm(vllm_url, tmp / "r"))
            out["reload_s"] = time.perf_counter() - t
            out["published_to_serving_s"] = out["fetch_verify_s"] + out["reload_s"]
        else:
            out["reload_s"] = None
            out["published_to_serving_s"] = None
            out["note"] = "no --vllm-url: vLLM reload not measured (published -> verified on disk only)"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        bucket, prefix = checkpoint.parse_uri(uri)
        for o in client.list_objects(bucket, prefix=f"{run}/", recursive=True):
            client.remove_object(bucket, o.object_name)
    out["summary"] = {k: (round(out[k], 2) if isinstance(out[k], float) else out[k])
                      for k in ("write_s", "publish_s", "fetch_verify_s", "reload_s", "published_to_serving_s")}
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
    a = ap.parse_args(argv)
    if a.vllm_url:
        from spanrl.core.settings import get_settings

        if a.vllm_url.rstrip("/") == get_settings().vllm_url and not a.allow_stack_vllm:
            sys.exit(f"{a.vllm_url} is the stack's vLLM; a reload pauses it. Pass --allow-stack-vllm to do it anyway.")
    print(json.dumps(measure(a.vllm_url)), flush=True)


if __name__ == "__main__":
    main()
