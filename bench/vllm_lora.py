"""Benchmark: vLLM's own LoRA serving (``--enable-lora``) against the reloader's merged weights,
side by side in one invocation, on one vLLM (issue 19 item 2).

    SPANRL_MODEL=qwen2.5-coder-0.5b python -m bench.vllm_lora [--lora-rank 16] [--prompts 8]
        [--max-tokens 48] [--out docs/data/model/vllm_lora_qwen05b.json]

For the model of ``SPANRL_MODEL``: a rank-R adapter with the trainer's settings (``lora_alpha``,
``lora_target_modules``; trainer/lora.py ``wrap``) whose ``lora_B`` is drawn N(0, ``--b-std``²),
``lora_A`` by peft's init, both seeded (peft's own init, B = 0, would make the adapter a no-op),
saved as the trainer saves one (``lora.save_adapter``). One vLLM is started as the stack starts it (infra/stack.py ``vllm_args``)
plus ``--enable-lora --max-lora-rank R --max-loras 1`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``,
on a free port; then, in this order:

  warm-up          the prompts once, not timed (a fresh vLLM's first requests are slower)
  decode, base     greedy chat completions of ``--prompts`` prompts, one at a time, the base name
  lora_load_s      ``POST /v1/load_lora_adapter`` of the adapter directory: what a reloader using
                   vLLM's LoRA would do per version instead of merging and reloading
  decode, lora     the same prompts under the adapter's name (vLLM's punica LoRA kernels)
  merge_s          ``lora.merge_adapter_dir`` (W + alpha / r B A into a copy of the base's files)
  reload_s         ``reloader.reload_vllm`` of the merged weights into the same vLLM
  decode, merged   the same prompts under the base name (now the merged weights)
  decode, plain    (after its own warm-up) a second vLLM with the stack's arguments alone (no ``--enable-lora``: a
                   LoRA-enabled engine may pay for its LoRA slots on every request), the same
                   prompts: the speed at which the stack serves merged weights
  agreement        each path's greedy log-probs against peft's in-process forward of the same
                   tokens (the adapter applied by peft, independent of vLLM and of our merge)

Where vLLM refuses ``--enable-lora`` or the adapter (the CPU build may lack a kernel), the JSON
has ``lora_error`` with vLLM's reason (and, where vLLM started, the merged path's figures).
Decode figures: output tokens per second of the sequential requests, and the ratios lora /
merged, lora / base and lora / plain. Writes one JSON line (stdout, and ``--out``). CPU: ~13 min
for the 0.5B model on 2 cores (each vLLM start ~2 min); run it with nothing else on the machine,
the stack down or idle (its vLLM keeps its memory).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Write a SQL query that counts the rows of a table named city.",
           "What is the capital of France? Answer in one word.",
           "Write a Python function that returns the square of a number.",
           "Name three colours.",
           "Explain what a primary key is in one sentence.",
           "What is 17 times 3?",
           "Write a SQL query for the names of countries in Europe.",
           "Say hello in Spanish."]


def lora_serving_args(rank: int) -> list[str]:
    """vLLM's arguments for serving LoRA adapters of rank up to ``rank``, one at a time, besides
    the stack's (vLLM docs, "LoRA Adapters": ``--enable-lora``, ``--max-lora-rank``,
    ``--max-loras``). Raises ValueError for a rank < 1. Example: 16 -> ["--enable-lora",
    "--max-lora-rank", "16", "--max-loras", "1"]."""
    if rank < 1:
        raise ValueError(f"a LoRA rank must be >= 1, got {rank}")
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1"]


def decode_summary(token_counts: list[int], seconds: list[float]) -> dict:
    """Output tokens, seconds and tokens per second of sequential requests. Raises ValueError for
    lists of different lengths or no time. Example: ([10, 30], [1.0, 3.0]) -> {"tokens": 40,
    "seconds": 4.0, "tokens_per_s": 10.0}."""
    if len(token_counts) != len(seconds) or sum(seconds) <= 0:
        raise ValueError("one positive duration per request is needed")
    return {"tokens": sum(token_counts), "seconds": round(sum(seconds), 3),
            "tokens_per_s": round(sum(token_counts) / sum(seconds), 3)}


def _adapter(s, rank: int, b_std: float, out_dir: Path) -> dict:
    """Write a rank-``rank`` adapter checkpoint of the trainer's settings with random ``lora_B``
    into ``out_dir`` as the trainer writes one (``save_checkpoint``: adapter files and manifest);
    returns its spec."""
    import torch

    from spanrl.core.settings import TrainerConfig
    from spanrl.trainer import lora
    from spanrl.trainer.train import base_model_id, load_model, save_checkpoint

    t = TrainerConfig()
    spec = lora.lora_spec(rank, t.lora_alpha, t.lora_dropout, t.lora_target_modules)
    torch.manual_seed(0)  # peft draws lora_A from torch's global generator
    peft_model = lora.wrap(load_model(s.model_dir), spec)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * b_std)
    save_checkpoint(peft_model, s.model_dir, out_dir, run="bench-vllm-lora", version=1, parent_version=0,
                    base_model=base_model_id(s.model_dir), step=1, trained_offsets={}, metrics={}, adapter=spec)
    return spec


def _start_vllm(s, rank: int | None, port: int, log_path: Path) -> subprocess.Popen:
    """vLLM as the stack starts it on ``port``, plus LoRA serving up to ``rank`` (None: the
    stack's arguments alone), in its own process group (:func:`_stop_vllm`)."""
    from spanrl.core.settings import StackSettings
    from spanrl.infra.stack import vllm_args

    args = vllm_args(s.model_copy(update={"vllm_port": port})) + (lora_serving_args(rank) if rank else [])
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "OMP_NUM_THREADS": StackSettings().vllm_threads,
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "spanrl.infra.vllm_server", *args], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_healthy(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 600) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}; log {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vLLM not healthy after {timeout_s} s; log {log_path}")


def _decode(url: str, model: str, max_tokens: int, n: int) -> tuple[dict, list[dict]]:
    """Greedy chat completions of the first ``n`` prompts, one at a time, under ``model``:
    (:func:`decode_summary`, per prompt: prompt and completion token ids and log-probs)."""
    counts, seconds, calls = [], [], []
    for prompt in PROMPTS[:n]:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0.0, "logprobs": True, "return_token_ids": True}
        t = time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        seconds.append(time.perf_counter() - t)
        r.raise_for_status()
        answer = r.json()
        choice = answer["choices"][0]
        counts.append(len(choice["token_ids"]))
        calls.append({"prompt_token_ids": answer["prompt_token_ids"], "token_ids": choice["token_ids"],
                      "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]]})
    return decode_summary(counts, seconds), calls


def _peft_gaps(s, spec: dict, adapter_dir: Path, calls_by_path: dict[str, list[dict]]) -> dict[str, float]:
    """Per path, the largest |vLLM log-prob - peft log-prob| over the tokens of its calls (the
    adapter loaded once into a fresh peft model; full logits, float32); paths without calls are
    left out."""
    import torch

    from spanrl.trainer import lora
    from spanrl.trainer.train import completion_logprobs, load_model

    peft_model = lora.wrap(load_model(s.model_dir), spec)
    lora.load_adapter_weights(peft_model, adapter_dir)
    peft_model.eval()
    gaps = {}
    with torch.no_grad():
        for path, calls in calls_by_path.items():
            for c in calls:
                P, C = len(c["prompt_token_ids"]), len(c["token_ids"])
                ids = torch.tensor([c["prompt_token_ids"] + c["token_ids"]])
                mask = torch.zeros_like(ids, dtype=torch.float32)
                mask[0, P:] = 1.0
                ours = completion_logprobs(peft_model, ids, torch.ones_like(ids), mask, C + 1, 0)[0, 1:]
                gaps[path] = max(gaps.get(path, 0.0), float((torch.tensor(c["logprobs"]) - ours).abs().max()))
    return gaps


def _warm_decode(url: str, model: str, max_tokens: int, n: int, console, label: str) -> dict:
    """:func:`_decode` of the prompts once untimed (a fresh vLLM's first requests are slower),
    then again, timed: the second pass's :func:`decode_summary`."""
    with console.status(f"warm-up, {label}: the prompts once, not timed"):
        _decode(url, model, max_tokens, n)
    with console.status(f"decode, {label}"):
        summary, _ = _decode(url, model, max_tokens, n)
    console.log(f"decode, {label}: {summary}")
    return summary


def measure(rank: int, n_prompts: int, max_tokens: int, b_std: float) -> dict:
    """The steps of the module docstring; seconds, decode figures and agreement in one dict."""
    from spanrl.core.settings import get_settings
    from spanrl.trainer import lora
    from spanrl.trainer.reloader import reload_vllm
    from bench.run import free_port

    from rich.console import Console

    console = Console(stderr=True)  # progress on stderr (also into a log); the result line on stdout
    s = get_settings()
    tmp = Path(tempfile.mkdtemp(prefix="spanrl-bench-vllm-lora-"))
    adapter_dir = tmp / "adapter"
    with console.status(f"writing a rank-{rank} adapter of {s.model}"):
        spec = _adapter(s, rank, b_std, adapter_dir)
    console.log(f"adapter written: {adapter_dir}")
    port = free_port()
    url = f"http://{s.host}:{port}"
    log_path = tmp / "vllm.log"
    proc = _start_vllm(s, rank, port, log_path)
    out: dict = {"model": s.model, "adapter": spec, "b_std": b_std, "prompts": n_prompts, "max_tokens": max_tokens,
                 "vllm_log": str(log_path)}
    lora_calls: list[dict] = []
    merged_calls: list[dict] = []
    try:
        with console.status(f"starting vLLM with --enable-lora on port {port} (log {log_path})"):
            try:
                out["vllm_start_s"] = round(_wait_healthy(url, proc, log_path), 2)
            except RuntimeError as e:  # vLLM refused --enable-lora: that is the result
                out["lora_error"] = f"{e}: {_log_tail(log_path)}"
                console.log(f"[red]{out['lora_error']}")
                return out
        console.log(f"vLLM healthy after {out['vllm_start_s']} s")
        out["decode_base"] = _warm_decode(url, s.model_name, max_tokens, n_prompts, console, "base")
        try:
            t = time.perf_counter()
            r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bench-adapter",
                                                                   "lora_path": str(adapter_dir)}, timeout=600)
            out["lora_load_s"] = round(time.perf_counter() - t, 3)
            r.raise_for_status()
            console.log(f"load_lora_adapter: {out['lora_load_s']} s")
            with console.status("decode, adapter (vLLM's LoRA)"):
                out["decode_lora"], lora_calls = _decode(url, "bench-adapter", max_tokens, n_prompts)
            console.log(f"decode, adapter: {out['decode_lora']}")
        except httpx.HTTPError as e:  # the adapter path failed; the merged path is still measured
            body = e.response.text[:2000] if isinstance(e, httpx.HTTPStatusError) else ""
            out["lora_error"] = f"{type(e).__name__}: {e} {body}".strip()
            console.log(f"[red]vLLM's LoRA path failed: {out['lora_error']}")
        with console.status("merging the adapter into a copy of the base"):
            t = time.perf_counter()
            merged = lora.merge_adapter_dir(s.model_dir, adapter_dir, tmp / "merged")
            out["merge_s"] = round(time.perf_counter() - t, 3)
        with console.status("reloading vLLM with the merged weights"):
            t = time.perf_counter()
            asyncio.run(reload_vllm(url, merged))
            out["reload_s"] = round(time.perf_counter() - t, 3)
        console.log(f"merge {out['merge_s']} s, reload {out['reload_s']} s")
        with console.status("decode, merged"):
            out["decode_merged"], merged_calls = _decode(url, s.model_name, max_tokens, n_prompts)
        console.log(f"decode, merged: {out['decode_merged']}")
    finally:
        _stop_vllm(proc)
    # the stack's own vLLM (no --enable-lora) serves merged weights at the base's speed: its decode
    # of the same prompts is what serving through vLLM's LoRA is compared with
    plain_log = tmp / "vllm-plain.log"
    port = free_port()
    url = f"http://{s.host}:{port}"
    plain = _start_vllm(s, None, port, plain_log)
    try:
        with console.status(f"starting a plain vLLM (the stack's arguments) on port {port} (log {plain_log})"):
            out["plain_vllm_start_s"] = round(_wait_healthy(url, plain, plain_log), 2)
        out["decode_plain_base"] = _warm_decode(url, s.model_name, max_tokens, n_prompts, console,
                                                "base, plain vLLM")
    finally:
        _stop_vllm(plain)
    with console.status("peft's log-probs of the same tokens"):
        out["max_logprob_gap_vs_peft"] = _peft_gaps(s, spec, adapter_dir, {"merged": merged_calls,
                                                                           "lora": lora_calls})
    shutil.rmtree(tmp, ignore_errors=True)  # the merged copy is a whole model
    if lora_calls:
        out["same_greedy_tokens"] = [a["token_ids"] == b["token_ids"] for a, b in zip(lora_calls, merged_calls)]
        out["ratios"] = {"lora_over_merged_tokens_per_s": round(out["decode_lora"]["tokens_per_s"]
                                                                / out["decode_merged"]["tokens_per_s"], 3),
                         "lora_over_base_tokens_per_s": round(out["decode_lora"]["tokens_per_s"]
                                                              / out["decode_base"]["tokens_per_s"], 3),
                         "lora_over_plain_vllm_tokens_per_s": round(out["decode_lora"]["tokens_per_s"]
                                                                    / out["decode_plain_base"]["tokens_per_s"], 3),
                         "lora_load_over_merge_plus_reload": round(out["lora_load_s"]
                                                                   / (out["merge_s"] + out["reload_s"]), 3)}
    return out


def _stop_vllm(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to vLLM's process group: its engine and worker processes too."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)


def _log_tail(path: Path, chars: int = 2000) -> str:
    """The last ``chars`` characters of a log file ('' when it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--b-std", type=float, default=0.02, help="std of the adapter's random lora_B")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    result = measure(a.lora_rank, a.prompts, a.max_tokens, a.b_std)
    line = json.dumps(result)
    print(line, flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
