"""LoRA adapters for the trainer (peft) and their merge into full weights for vLLM.

LoRA (Hu et al. 2021, arXiv 2106.09685): a frozen weight ``W`` [out, in] of a linear layer is
used as ``h = W x + (alpha / r) * B A x`` with trainable ``A`` [r, in] (random) and ``B``
[out, r] (zeros, so training starts at the base model); eq. 3 with s4.1's ``alpha / r`` scale.
The trainer trains only ``A`` and ``B`` (``TrainerConfig.lora_rank`` > 0) and publishes them
alone; vLLM here reloads full weights from a directory, so the reloader writes the merged
``W' = W + (alpha / r) * B A`` (:func:`merge_lora`) into a copy of the base model's directory
(:func:`merge_adapter_dir`) and reloads that.

An adapter checkpoint is ``adapter_model.safetensors`` (peft's key names, no adapter name),
``adapter_config.json`` (peft's LoraConfig) and ``manifest.json``, whose ``adapter`` field is
:func:`lora_spec`'s dict and whose ``base_model`` names the model it adapts.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from spanrl.core.settings import TrainerConfig
from spanrl.trainer import checkpoint

if TYPE_CHECKING:  # torch, peft and safetensors are imported where used: manifests need none of them
    import torch

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
#: the target modules' key prefix in peft's saved state dict (PeftModel -> LoraModel -> HF model)
PEFT_PREFIX = "base_model.model."
#: the attention and MLP projections of Qwen2 / Llama (SmolLM2) decoder layers
DEFAULT_TARGET_MODULES = TrainerConfig.default("lora_target_modules")
#: suffix of the reloader's merged copy beside a downloaded adapter checkpoint (``000003.merged``)
MERGED_SUFFIX = ".merged"
#: in a merged copy: what it was merged from (adapter manifest sha256, base dir), so it is reused only for that
MERGED_FROM = "merged_from.json"


class BaseModelMismatch(checkpoint.CheckpointError):
    """An adapter checkpoint does not apply to the base weights at hand."""


def lora_spec(rank: int, alpha: float, dropout: float, target_modules: str) -> dict | None:
    """The adapter the trainer settings ask for: None for ``rank`` 0 (full fine-tuning), else
    ``{"kind": "lora", "rank", "alpha", "dropout", "target_modules": [names]}`` (the manifest's
    ``adapter`` field). ``target_modules``: comma-separated module names (peft matches each
    against the end of a module's path, e.g. ``q_proj`` -> every ``...self_attn.q_proj``).
    Raises ValueError for a negative rank, alpha <= 0, dropout outside [0, 1) or no module.
    Example: (8, 16, 0.0, "q_proj, v_proj") -> {"kind": "lora", "rank": 8, "alpha": 16.0,
    "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}."""
    if rank < 0:
        raise ValueError(f"lora_rank must be >= 0, got {rank}")
    if rank == 0:
        return None
    modules = [m.strip() for m in target_modules.split(",") if m.strip()]
    if not modules:
        raise ValueError("lora_target_modules names no module")
    if alpha <= 0:
        raise ValueError(f"lora_alpha must be > 0, got {alpha}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora_dropout must be in [0, 1), got {dropout}")
    return {"kind": "lora", "rank": int(rank), "alpha": float(alpha), "dropout": float(dropout),
            "target_modules": modules}


def wrap(model, spec: dict):
    """``model`` (an HF causal LM) with LoRA adapters of ``spec`` (:func:`lora_spec`) on its
    target modules: a peft ``PeftModelForCausalLM`` whose only trainable parameters are the
    adapters' ``A`` and ``B`` (``lora_A`` / ``lora_B``, bias-free; peft's init: ``A`` Kaiming-
    uniform, ``B`` zeros). ``model`` is changed in place (its target layers are
    replaced, every other parameter frozen by peft). Raises ValueError when a target module
    name matches no module of the model (peft itself only refuses a list none of which matches)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"],
                     target_modules=list(spec["target_modules"]), bias="none", task_type="CAUSAL_LM")
    wrapped = get_peft_model(model, cfg)
    targeted = wrapped.targeted_module_names
    unmatched = [m for m in spec["target_modules"] if not any(n == m or n.endswith("." + m) for n in targeted)]
    if unmatched:
        raise ValueError(f"lora_target_modules {unmatched} not found in the model")
    return wrapped


def load_adapter_weights(peft_model, adapter_dir: Path) -> None:
    """Put the adapter weights of checkpoint ``adapter_dir`` into ``peft_model`` (made by
    :func:`wrap` with the checkpoint's spec). Raises ValueError when a weight of either side has
    no counterpart (another rank or other target modules than the checkpoint's)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    result = set_peft_model_state_dict(peft_model, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"{adapter_dir}: adapter weights do not fit the model: missing {missing[:4]}, "
                         f"unexpected {list(result.unexpected_keys)[:4]}")


def save_adapter(peft_model, out_dir: Path, base_model: str) -> None:
    """Write the adapter of ``peft_model`` into ``out_dir``: ``adapter_model.safetensors`` (its
    ``lora_A`` / ``lora_B`` weights under peft's saved names) and ``adapter_config.json`` with
    ``base_model_name_or_path`` = ``base_model`` (the base's id, not the trainer's local path);
    not the base weights, not peft's README model card."""
    import copy

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(peft_model).items()}
    save_file(state, str(Path(out_dir) / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = copy.copy(peft_model.peft_config["default"])
    config.base_model_name_or_path = base_model
    config.save_pretrained(str(out_dir))


class AdapterDisabled:
    """The reference policy of a LoRA policy for the KL term: the same peft model called with
    its adapter disabled (peft's ``disable_adapter()``), in eval mode, i.e. the frozen base
    weights; no second copy of the model. ``module`` is the peft model (what
    train.completion_logprobs takes the output layer of). Call it under ``torch.no_grad()``:
    peft turns the adapters' ``requires_grad`` off inside and back on after."""

    def __init__(self, peft_model):
        self.module = peft_model

    def __call__(self, **inputs):
        was_training = self.module.training
        self.module.eval()
        try:
            with self.module.disable_adapter():
                return self.module(**inputs)
        finally:
            self.module.train(was_training)


# ---- manifests ------------------------------------------------------------------------

def manifest_of(ckpt_dir: Path) -> dict | None:
    """The manifest of checkpoint ``ckpt_dir``, or None for a directory without one (a base model)."""
    path = Path(ckpt_dir) / checkpoint.MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def is_adapter(manifest: dict | None) -> bool:
    """True for the manifest of an adapter checkpoint (its ``adapter`` field); manifests written
    before LoRA have none: full weights."""
    return bool(manifest and manifest.get("adapter"))


def base_problem(manifest: dict, base_dir: Path, base_model: str) -> str | None:
    """Why the adapter checkpoint of ``manifest`` does not apply to the weights of ``base_dir``
    whose id is ``base_model`` (train.base_model_id), or None when it does: ``base_dir`` is
    itself a checkpoint (it has a manifest: its weights are not the base model its id names),
    or the adapter was trained on another base model."""
    if (Path(base_dir) / checkpoint.MANIFEST).is_file():
        return (f"{base_dir} is a checkpoint, not a base model: an adapter applies only to the base "
                f"model it was trained on ({manifest.get('base_model')!r})")
    if manifest.get("base_model") != base_model:
        return (f"adapter {manifest.get('run')}:{manifest.get('version')} was trained on base model "
                f"{manifest.get('base_model')!r}, not on {base_model!r} ({base_dir})")
    return None


def spec_difference(manifest: dict, spec: dict) -> str | None:
    """How the adapter of ``manifest`` differs from ``spec`` (:func:`lora_spec`) in rank, alpha or
    target modules (None: the same; dropout is a training setting and may differ)."""
    have = manifest.get("adapter") or {}
    diffs = [f"{k} {have.get(k)!r} != {spec[k]!r}" for k in ("kind", "rank", "alpha", "target_modules")
             if have.get(k) != spec[k]]
    return "; ".join(diffs) or None


def check_adapter_files(ckpt_dir: Path) -> None:
    """Raise CheckpointError unless ``ckpt_dir`` holds an adapter's weights and config."""
    missing = [n for n in (ADAPTER_WEIGHTS, ADAPTER_CONFIG) if not (Path(ckpt_dir) / n).is_file()]
    if missing:
        raise checkpoint.CheckpointError(f"{ckpt_dir}: adapter checkpoint without {', '.join(missing)}")


# ---- merging (the reloader) -----------------------------------------------------------

def adapter_scale(adapter_config: dict) -> float:
    """The scale of ``B A`` of a peft LoRA config: ``lora_alpha / r`` (Hu et al. s4.1), or
    ``lora_alpha / sqrt(r)`` with ``use_rslora``. Raises ValueError for what :func:`merge_lora`
    does not do: per-module ranks or alphas, DoRA, LoRA biases, transposed (``fan_in_fan_out``)
    weights, extra trained modules."""
    unsupported = [k for k in ("rank_pattern", "alpha_pattern", "modules_to_save", "use_dora", "lora_bias",
                               "fan_in_fan_out", "trainable_token_indices") if adapter_config.get(k)]
    if adapter_config.get("bias", "none") != "none":
        unsupported.append("bias")
    if adapter_config.get("peft_type", "LORA") != "LORA":
        unsupported.append(f"peft_type {adapter_config['peft_type']}")
    if unsupported:
        raise ValueError(f"cannot merge this adapter: {', '.join(unsupported)}")
    r, alpha = adapter_config["r"], adapter_config["lora_alpha"]
    return alpha / (r ** 0.5 if adapter_config.get("use_rslora") else r)


def lora_pairs(adapter_state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{base weight name: (A [r, in], B [out, r])}`` from a saved peft LoRA state dict, e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> key
    ``model.layers.0.self_attn.q_proj.weight``. Raises ValueError for a key that is not a LoRA
    ``A`` / ``B`` weight or an ``A`` without its ``B`` (or the reverse)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in adapter_state.items():
        for half in ("lora_A", "lora_B"):
            suffix = f".{half}.weight"
            if key.startswith(PEFT_PREFIX) and key.endswith(suffix):
                halves.setdefault(key[len(PEFT_PREFIX):-len(suffix)] + ".weight", {})[half] = t
                break
        else:
            raise ValueError(f"not a LoRA A/B weight: {key}")
    lone = [k for k, h in halves.items() if len(h) != 2]
    if lone:
        raise ValueError(f"LoRA weights without their other half: {lone[:4]}")
    return {k: (h["lora_A"], h["lora_B"]) for k, h in halves.items()}


def merge_lora(weights: dict[str, torch.Tensor], pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
               scale: float) -> dict[str, torch.Tensor]:
    """``weights`` with ``W' = W + scale * B @ A`` for each ``(A [r, in], B [out, r])`` of
    ``pairs`` whose name is in ``weights`` (Hu et al. 2021 eq. 3: the merged layer computes
    ``W x + scale * B A x``, so serving needs no extra latency); computed in float32, stored in
    ``W``'s dtype. Returns a new dict (``weights`` is not changed); the names of ``pairs`` that
    ``weights`` lacks are left to the caller (a base sharded over several files). Raises
    ValueError for shapes that do not fit ``W`` [out, in]."""
    out = dict(weights)
    for name, (a, b) in pairs.items():
        if name not in weights:
            continue
        w = weights[name]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ValueError(f"{name}: LoRA A {tuple(a.shape)}, B {tuple(b.shape)} do not fit W {tuple(w.shape)}")
        out[name] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def merged_dir(ckpt_dir: Path) -> Path:
    """Where the reloader writes the merged weights of adapter checkpoint ``ckpt_dir``: its sibling
    ``<name>.merged`` (deleted with the checkpoint's run, :func:`prune_merged`)."""
    ckpt_dir = Path(ckpt_dir)
    return ckpt_dir.with_name(ckpt_dir.name + MERGED_SUFFIX)


def merged_from(base_dir: Path, adapter_dir: Path) -> dict:
    """What a merged copy is made of: the adapter checkpoint's manifest sha256 and the base dir."""
    return {"adapter_manifest_sha256": checkpoint.manifest_sha256(adapter_dir),
            "base_dir": str(Path(base_dir).resolve())}


def merged_is_current(out_dir: Path, base_dir: Path, adapter_dir: Path) -> bool:
    """True when ``out_dir`` is a finished merge of exactly this adapter onto this base dir."""
    record = Path(out_dir) / MERGED_FROM
    return record.is_file() and json.loads(record.read_text()) == merged_from(base_dir, adapter_dir)


def merge_adapter_dir(base_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """Write the base model of ``base_dir`` with the adapter of checkpoint ``adapter_dir`` merged
    in (:func:`merge_lora`) into ``out_dir``, in the base's own file layout: each of its
    ``*.safetensors`` files with the same tensor names, dtypes and metadata, every other file
    (config, tokenizer, shard index, ...) copied, the base's manifest (if any) left out, plus
    ``merged_from.json`` (:func:`merged_from`). Written into ``out_dir.partial`` and renamed, so
    an existing ``out_dir`` is complete. Returns ``out_dir``. Raises ValueError when the adapter
    names a weight the base lacks, or :func:`adapter_scale`'s errors (``out_dir`` untouched:
    ``checkpoint.partial_dir``)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    base_dir, adapter_dir, out_dir = Path(base_dir), Path(adapter_dir), Path(out_dir)
    scale = adapter_scale(json.loads((adapter_dir / ADAPTER_CONFIG).read_text()))
    pairs = lora_pairs(load_file(str(adapter_dir / ADAPTER_WEIGHTS)))
    with checkpoint.partial_dir(out_dir) as tmp:
        merged: set[str] = set()
        for p in sorted(base_dir.iterdir()):
            if not p.is_file() or p.name == checkpoint.MANIFEST:
                continue
            if p.suffix != ".safetensors":
                shutil.copy2(p, tmp / p.name)
                continue
            with safe_open(str(p), framework="pt") as f:
                metadata = f.metadata()
            weights = load_file(str(p))
            save_file(merge_lora(weights, pairs, scale), str(tmp / p.name), metadata=metadata)
            merged |= pairs.keys() & weights.keys()
        if merged != pairs.keys():
            raise ValueError(f"{base_dir} has no weight {sorted(pairs.keys() - merged)[:4]} of adapter {adapter_dir}")
        (tmp / MERGED_FROM).write_text(json.dumps(merged_from(base_dir, adapter_dir), indent=2, sort_keys=True))
    return out_dir


def prune_merged(run_dir: Path, keep: set[Path]) -> list[Path]:
    """Delete the merged copies (``*.merged``, and unfinished ``*.merged.partial``) in ``run_dir``
    except those in ``keep``; returns what was deleted. Each is a full model (~0.5 GB for
    SmolLM2-135M fp32), rebuilt from its adapter when it is served again."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    kept = {Path(p).resolve() for p in keep}
    doomed = sorted(p for p in run_dir.iterdir() if p.is_dir() and p.name.endswith((MERGED_SUFFIX, MERGED_SUFFIX
                                                                                  + ".partial"))
                    and p.resolve() not in kept)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
