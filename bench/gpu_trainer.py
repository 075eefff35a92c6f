"""Benchmark (5) on a GPU: the trainer's tokens/s and seconds per update for SmolLM2-135M.

Prepared for the `device` machine (one GPU, torch's CUDA build installed there):

    python -m bench.gpu_trainer [--updates 6 --samples 64 --prompt 512 --completion 128 --micro-batch 16] \
        > bench/results/gpu_trainer.json

Same code path as bench.trainer_bench (spanrl.trainer.train.build_engine -> DeepSpeed ZeRO-2, bf16,
FusedAdam; train_update), bigger defaults. Refuses to run without CUDA. Copy the printed
JSON's figures into docs/measured/benchmarks-archive.md (row "trainer, GPU" of the 100-rollout burst).
"""
from __future__ import annotations

import sys

from bench import trainer_bench


def main(argv=None) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench.gpu_trainer: no CUDA device (torch %s); use bench.trainer_bench on CPU" % torch.__version__)
    trainer_bench.main(argv, defaults=(6, 64, 512, 128, 16))


if __name__ == "__main__":
    main()
