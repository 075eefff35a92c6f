"""The pure parts of bench/vllm_lora.py (vLLM's own LoRA serving against merged weights)."""
import pytest

from bench import vllm_lora
from bench.vllm_lora import decode_summary, lora_serving_args


def test_lora_serving_args():
    assert lora_serving_args(16) == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1"]
    with pytest.raises(ValueError, match="rank must be >= 1"):
        lora_serving_args(0)


def test_decode_summary():
    assert decode_summary([10, 30], [1.0, 3.0]) == {"tokens": 40, "seconds": 4.0, "tokens_per_s": 10.0}
    for counts, seconds in (([1], [1.0, 2.0]), ([1], [0.0])):
        with pytest.raises(ValueError, match="one positive duration"):
            decode_summary(counts, seconds)


def test_log_tail_is_the_end_of_the_log_or_empty(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("a" * 10 + "NotImplementedError: LoRA on CPU")
    assert vllm_lora._log_tail(log, chars=32) == "NotImplementedError: LoRA on CPU"
    assert vllm_lora._log_tail(tmp_path / "missing.log") == ""
