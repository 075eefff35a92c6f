"""The trainer service: samples topic -> DeepSpeed policy update -> checkpoint in MinIO -> checkpoints topic.

Reads top to bottom: config, engine, one update (algorithm), checkpointing, the
service loop (plumbing), HTTP status, CLI. Run: ``python -m spanrl.trainer.train --run NAME``.

Promises
- Every update is one optimizer step over all buffered samples (micro-batched with
  gradient accumulation; the loss is the token mean over the whole update).
- Each checkpoint manifest records ``trained_offsets`` = next offset per samples
  partition and ``consumed_offsets`` = the ``[from, to)`` ranges trained since the
  parent (``checkpoint.check_offset_chain`` proves a run's ranges tile); on start the
  trainer loads the latest checkpoint of its run and seeks there, so no sample is
  trained twice or skipped (Adam moments restart at zero on resume: only HF weights are
  checkpointed).
- A run without a checkpoint starts at its start marker ``s3://BUCKET/RUN/start.json``,
  written (offsets resolved from ``start``) before its first sample is consumed, so a
  crash before the first checkpoint does not move the start.
- MinIO/Kafka outages are retried with backoff (``checkpoint.retry``; each retry is a
  ``retry`` log line); while a checkpoint is unpublished the trainer consumes nothing
  further. Version, ``trained_offsets`` and manifest are fixed before the upload and
  reused by every retry; the manifest goes last and the version counts as published
  only once it is announced, so a SIGKILL at any point resumes from the last complete
  checkpoint.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from spanrl.core import heap, schema_registry
from spanrl.core import settings as env
from spanrl.core.edge import service_credentials
from spanrl.core.partitions import topic_partitions
from spanrl.core.recipes import differences, recipe_fields
from spanrl.core.settings import TrainerConfig, check_environment, get_settings
from spanrl.trainer import batching, checkpoint, deepspeed_patches, lora, losses, ranks, staleness, tracking, tree_pack
from spanrl.trainer.prefix_merge import BREAK_CAUSES, collate_rows, merge_calls
from spanrl.trainer.tree_pack import TreePack
from spanrl.trainer.self_imitation import SelfImitationBuffer, check_replay_loss, positive_entries

log = logging.getLogger("spanrl.trainer")

# Files save_pretrained writes itself; every other file of the base dir (tokenizer,
# chat template, generation config, ...) is copied into each checkpoint.
_MODEL_FILES = {"config.json", "model.safetensors", "model.safetensors.index.json", checkpoint.MANIFEST}

#: completion positions whose log-probs are computed at once (losses.chunked_token_logprobs):
#: ~3 x 256 x 49,152 float32 = 150 MB of logits at a time for SmolLM2; 0: the full logits of a
#: micro-batch's completion window (losses.token_logprobs), the path before issue 20. The
#: trainer's setting ``SPANRL_TRAINER_LOGPROB_CHUNK`` (declared in spanrl/core/settings.py)
LOGPROB_CHUNK = TrainerConfig.default("logprob_chunk")
#: elements per ZeRO gradient-reduction / all-gather bucket: DeepSpeed's default 5e8 is 2 GB of
#: float32 staged per backward (~0.5 GB of it touched for a 135M model); this is 80 MB
BUCKET_ELEMENTS = 20_000_000


# ---- engine ---------------------------------------------------------------------------

LOOPBACK_NAMES = ("localhost", "ip6-localhost", "ip6-loopback")


def rendezvous_bind_address(master_addr: str | None) -> str:
    """The address rank 0's torch.distributed TCP store listens on, from ``MASTER_ADDR``.

    Unset, empty or a loopback address / name (one machine): ``127.0.0.1`` (``::1`` for an
    IPv6 loopback), never every interface as torch's own store does (``*:port``). Any other
    address or host name (ranks on several machines): that address itself, i.e. only the
    interface the other machines were told to reach. Raises ValueError for an unspecified
    address (``0.0.0.0``, ``::``): peers cannot connect to it, and it would listen everywhere.
    Examples: None -> "127.0.0.1"; "localhost" -> "127.0.0.1"; "::1" -> "::1";
    "10.0.0.5" -> "10.0.0.5"; "trainer-0.svc" -> "trainer-0.svc".
    """
    import ipaddress

    addr = (master_addr or "").strip().strip("[]")
    if not addr or addr.lower() in LOOPBACK_NAMES:
        return "127.0.0.1"
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return addr  # a host name: resolved by bind() to the machine's address for it
    if ip.is_unspecified:
        raise ValueError(f"MASTER_ADDR {master_addr!r} is not an address peers can reach; "
                         "use 127.0.0.1 on one machine or rank 0's address across machines")
    if ip.is_loopback:
        return "::1" if ip.version == 6 else "127.0.0.1"
    return str(ip)


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (port 0: a free one), for the TCP store."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def init_distributed() -> None:
    """torch.distributed for DeepSpeed (gloo on CPU, nccl on GPU) with a rendezvous that
    listens only where :func:`rendezvous_bind_address` says (loopback on one machine).

    RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as torch's launchers set them (defaults:
    one rank, 127.0.0.1, a free port). Rank 0 binds the store's socket itself and hands it to
    ``TCPStore(master_listen_fd=...)``; other ranks connect to MASTER_ADDR:MASTER_PORT."""
    import deepspeed

    global _STORE
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    # torch's launcher variables, in the process environment (DeepSpeed reads them there too)
    rank = int(env.setdefault_env("RANK", "0"))
    world = int(env.setdefault_env("WORLD_SIZE", "1"))
    env.setdefault_env("LOCAL_RANK", "0")
    env.setdefault_env("TORCH_EXTENSIONS_DIR", str(get_settings().cache_dir / "torch_extensions"))
    host = rendezvous_bind_address(env.env_value("MASTER_ADDR"))
    env.set_env("MASTER_ADDR", env.env_value("MASTER_ADDR") or host)
    timeout = ranks.RENDEZVOUS_TIMEOUT
    if rank == 0:
        sock = _listening_socket(host, int(env.env_value("MASTER_PORT", "0")))
        env.set_env("MASTER_PORT", str(sock.getsockname()[1]))
        store = torch.distributed.TCPStore(host, int(env.env_value("MASTER_PORT")), world, True, timeout,
                                           master_listen_fd=sock.detach())  # the store owns the fd now
    else:
        store = torch.distributed.TCPStore(env.env_value("MASTER_ADDR"), int(env.env_value("MASTER_PORT")), world,
                                           False, timeout)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo" and host in ("127.0.0.1", "::1") and sys.platform == "linux":
        env.setdefault_env("GLOO_SOCKET_IFNAME", "lo")  # gloo's own listeners on loopback too
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    deepspeed.init_distributed(dist_backend=backend)  # adopts the process group above
    deepspeed_patches.after_init_distributed(rank, world)  # its shm segments: no leak (66 MiB per start)
    _STORE = store


#: the rendezvous store of this process's group (rank 0 serves it): trainer/ranks.py's
#: CommandChannel runs over it
_STORE = None


def launched_rank_and_world() -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` as a launcher set them for this process (before the process group
    exists); ``(0, 1)`` when started alone."""
    return int(env.env_value("RANK", "0")), int(env.env_value("WORLD_SIZE", "1"))


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of the initialised process group; ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


#: the ZeRO stages the trainer runs (``SPANRL_TRAINER_ZERO_STAGE``): 0 (no partitioning; on one
#: rank no ZeRO copies of weights and gradients), 2, 3
ZERO_STAGES = (0, 2, 3)


def check_zero_stage(zero_stage: int) -> None:
    """Raise ValueError unless ``zero_stage`` is one of :data:`ZERO_STAGES`."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage}")


def deepspeed_config(micro_batch: int, grad_clip: float, lr: float, weight_decay: float,
                     gpu: bool | None = None, zero_stage: int = 0) -> dict:
    """The one DeepSpeed config: ZeRO ``zero_stage`` (0: nothing partitioned, plain data
    parallelism; 2: optimizer states and gradients partitioned; 3: the parameters too,
    :data:`ZERO_STAGES`). GPU: bf16 + FusedAdam (the "AdamW"
    optimizer block). CPU: fp32, the optimizer is passed in by build_engine. ``gpu``: None =
    whether CUDA is available. ``python -m spanrl.trainer.train --deepspeed-config [--gpu]`` prints
    it as JSON for the trainer's settings (there is no second copy in a file). Raises ValueError
    for another stage."""
    check_zero_stage(zero_stage)
    buckets = ({} if zero_stage == 0 else {"allgather_bucket_size": BUCKET_ELEMENTS} if zero_stage == 2 else
               {"stage3_prefetch_bucket_size": BUCKET_ELEMENTS, "stage3_max_live_parameters": BUCKET_ELEMENTS})
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,  # accumulation is driven explicitly in train_update
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage, "contiguous_gradients": True, "overlap_comm": False,
                              "reduce_bucket_size": BUCKET_ELEMENTS, **buckets},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if torch.cuda.is_available() if gpu is None else gpu:
        cfg["bf16"] = {"enabled": True}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                        "weight_decay": weight_decay}}
    return cfg


def build_engine(model: torch.nn.Module, *, lr: float, weight_decay: float = 0.0, micro_batch: int = 8,
                 grad_clip: float = 1.0, zero_stage: int = 0):
    """Wrap ``model`` in a DeepSpeed ZeRO engine, stage ``zero_stage`` (:func:`deepspeed_config`;
    the one function tests and the service use).

    CPU: fp32 with DeepSpeedCPUAdam (JIT-built once into TORCH_EXTENSIONS_DIR); if that
    build fails, torch.optim.AdamW (logged). The optimizer (and ZeRO's partitions, master copy
    and gradients) holds only the parameters that require gradients: every one for full
    fine-tuning, the adapters' for LoRA (:func:`load_model`). Raises ValueError when no
    parameter requires gradients.
    """
    import deepspeed

    init_distributed()
    cfg = deepspeed_config(micro_batch, grad_clip, lr, weight_decay, zero_stage=zero_stage)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no parameter that requires gradients")
    optimizer = None
    if not torch.cuda.is_available():
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(trainable, lr=lr, weight_decay=weight_decay, adamw_mode=True)
        except Exception as exc:  # JIT build failure
            log.warning("DeepSpeedCPUAdam unavailable (%s); falling back to torch.optim.AdamW", exc)
            optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg,
                                           model_parameters=None if optimizer else trainable)
    deepspeed_patches.skip_single_rank_allreduce(engine)
    return engine


def zero_stage_of(engine) -> int:
    """The ZeRO stage of a DeepSpeed engine (0 for a plain module, e.g. the reference model)."""
    stage = getattr(engine, "zero_optimization_stage", None)
    return stage() if callable(stage) else 0


def gathered_state_dict(engine) -> dict | None:
    """The whole weights of ``engine``'s module as a state dict on rank 0 (None on the other
    ranks): with ZeRO-3 the partitions are gathered (a collective: every rank calls this at the
    same point), tensors that share storage (tied embeddings) stay shared; with ZeRO-2 every
    rank holds them and rank 0 reads its own (no collective)."""
    rank, _ = rank_and_world()
    module = engine.module
    if zero_stage_of(engine) != 3:
        return module.state_dict() if rank == 0 else None
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        if rank != 0:
            return None
        copies: dict[int, torch.Tensor] = {}
        return {k: copies.setdefault(v.data_ptr(), v.detach().clone()) for k, v in module.state_dict().items()}


def parameter_count(model, trainable_only: bool = False) -> int:
    """Parameters of ``model`` (those that require gradients with ``trainable_only``), also when
    ZeRO-3 has partitioned them (``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad or not trainable_only)


def load_reference_model(model_dir: Path):
    """The reference policy for the KL term: the model of ``model_dir`` in eval mode with every
    parameter frozen (no gradients, no optimizer state: one more copy of the weights in memory)."""
    model = load_model(model_dir)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_model(model_dir: Path, activation_checkpointing: bool = False, adapter: dict | None = None,
               adapter_dir: Path | None = None):
    """The policy of ``model_dir`` (bf16 on GPU, fp32 on CPU, SDPA attention, no KV cache);
    ``activation_checkpointing``: each decoder layer's activations are recomputed in backward
    (HF gradient checkpointing, non-reentrant) instead of kept from the forward.
    ``adapter`` (``lora.lora_spec``): the model wrapped with LoRA adapters (``lora.wrap``, a peft
    model; the base weights frozen, only the adapters train), their weights from the adapter
    checkpoint ``adapter_dir`` when given (else peft's init: the base model's outputs). With
    frozen embeddings no decoder layer's input requires a gradient: non-reentrant checkpointing
    still gives the adapters inside each layer theirs (the reentrant kind would not; transformers'
    ``gradient_checkpointing_enable`` calls ``enable_input_require_grads`` anyway), the same as
    without checkpointing (tests/unit/test_lora.py)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    # sdpa: no [B, heads, T, T] score tensors kept for backward (eager attention OOMs on CPU)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    if adapter is not None:
        model = lora.wrap(model, adapter)
        if adapter_dir is not None:
            lora.load_adapter_weights(model, adapter_dir)
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


@contextlib.contextmanager
def lm_head_bypassed(model):
    """Within the block the model's output layer is the identity, so its ``.logits`` are the
    final hidden states ``[B, K, H]`` (for losses.chunked_token_logprobs); yields the output
    layer's weight ``[V, H]``. Raises ValueError for an output layer with a bias or a model
    that scales or soft-caps its logits (the chunked log-probs would differ)."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError("chunked log-probs need a bias-free linear output layer; set logprob_chunk=0")
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(model.config, name, None) not in (None, 1, 1.0):
            raise ValueError(f"chunked log-probs do not apply the model's {name}; set logprob_chunk=0")
    model.set_output_embeddings(torch.nn.Identity())
    try:
        yield head.weight
    finally:
        model.set_output_embeddings(head)


def completion_logprobs(model, input_ids, attention_mask, completion_mask, window: int, chunk: int,
                        temperature: float | None = None, pack: TreePack | None = None):
    """Log-probs ``[B, window]`` of the last ``window`` positions of ``input_ids`` under
    ``model`` (the engine, the reference model or a ``lora.AdapterDisabled``; masked by
    ``completion_mask[:, -window:]``), at the sampling ``temperature`` (the stack's
    ``rollout_temperature``; None: the raw logits, :func:`losses.tempered`):
    ``chunk`` > 0 through losses.chunked_token_logprobs (never the ``[B, window, V]``
    logits), 0 through the full logits and losses.token_logprobs.
    ``pack`` (``tree_pack.pack_batch`` of ``input_ids`` / ``attention_mask``): one forward over
    the packed prefix tree instead of the ``[B, T]`` rows (trainer/tree_pack.py), the same
    log-probs up to float rounding."""
    ids, mask = input_ids[:, -window:], completion_mask[:, -window:]

    def forward(keep):
        if pack is None:
            return model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep).logits
        dev = input_ids.device
        out = model(input_ids=pack.input_ids.to(dev), position_ids=pack.position_ids.to(dev),
                    attention_mask=pack.attention_mask.to(dev), logits_to_keep=0).logits
        return tree_pack.unpack_hidden(out, pack, window)

    if not chunk:
        return losses.token_logprobs(forward(window), ids, mask, temperature)
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    if zero_stage_of(model) == 3:
        raise ValueError("chunked log-probs read the output layer's weight outside its forward, which ZeRO-3 "
                         "keeps partitioned: set logprob_chunk=0 with zero_stage 3")
    with lm_head_bypassed(module) as weight:
        hidden = forward(window)
    return losses.chunked_token_logprobs(hidden, weight, ids, mask, chunk, temperature)


# ---- one update (algorithm) -----------------------------------------------------------

def sample_advantages(samples: list[dict], algorithm: str = "grpo", singleton_advantage: str = "batch",
                      advantage_std_scale: bool = True) -> list[float]:
    """The advantage of each sample in an update. ``reinforce_pp``: each sample's credited
    ``reward`` normalised over the update (:func:`losses.reinforce_pp_advantages`); ``grpo``:
    the sample's group advantage (the stream job's, of R), or with ``advantage_std_scale``
    False Dr. GRPO's ``R - group_mean`` (:func:`losses.dr_grpo_advantages`, from the sample's
    ``group_mean``), except, with ``singleton_advantage="batch"``, samples of a group of one
    (``group_rollouts`` 1), which get the batch baseline of their returns
    (:func:`losses.singleton_batch_advantages`); ``"zero"`` keeps their 0. Hand-made samples
    without ``group_rollouts`` (tests, bench) keep their own advantage. Raises ValueError for
    an unknown algorithm or singleton_advantage.
    Example: rewards [0.75, 1.05, 0, 0] -> reinforce_pp [0.65, 1.30, -0.97, -0.97] (rounded)."""
    if algorithm == "reinforce_pp":
        # REINFORCE++ (arXiv 2501.03262) s3: the return of each action, normalised over the batch
        return losses.reinforce_pp_advantages(torch.tensor([s["transition"]["reward"] for s in samples])).tolist()
    if algorithm != "grpo":
        raise ValueError(f"unknown algorithm {algorithm!r}")
    advantages = [s["advantage"] for s in samples]
    if not advantage_std_scale:  # Dr. GRPO where the sample carries its group's mean
        grouped = [i for i, s in enumerate(samples) if "group_mean" in s]
        dr = losses.dr_grpo_advantages([samples[i]["transition"]["episode_return"] for i in grouped],
                                       [samples[i]["group_mean"] for i in grouped])
        for i, a in zip(grouped, dr):
            advantages[i] = a
    if singleton_advantage == "zero":
        return advantages
    if singleton_advantage != "batch":
        raise ValueError(f"unknown singleton_advantage {singleton_advantage!r}")
    returns = torch.tensor([s["transition"]["episode_return"] for s in samples])
    return losses.singleton_batch_advantages(
        torch.tensor(advantages), returns, torch.tensor([s.get("group_rollouts", 2) for s in samples])).tolist()


def token_advantages(samples: list[dict], advantages: list[float], advantage_std_scale: bool,
                     eps: float = 1e-6) -> list[list[float]]:
    """Per completion token, the prefix-tree advantage of each sample
    (:func:`losses.prefix_tree_advantages`): the tree's roots are (``group_id``, prompt token
    ids), so calls that saw the same prompt in one group share a root; ``advantages`` are
    the samples' own (:func:`sample_advantages`), and the scale that turns a return
    difference into an advantage is 1 for Dr. GRPO and ``1 / (group_std + eps)`` for GRPO
    (stream_jobs.credit.grpo_advantages' eps). A sample without a ``group_id`` is a root of
    its own (its tokens keep its advantage)."""
    keys = [(s.get("group_id", f"sample-{i}"), tuple(s["transition"]["prompt_token_ids"]))
            for i, s in enumerate(samples)]
    scales = [1.0 if not advantage_std_scale else 1.0 / (float(s.get("group_std", 0.0)) + eps) for s in samples]
    return losses.prefix_tree_advantages(keys, [list(s["transition"]["completion_token_ids"]) for s in samples],
                                         [float(s["transition"]["episode_return"]) for s in samples],
                                         advantages, scales)


def sample_key(sample: dict) -> tuple:
    """A key that orders an update's samples by content alone (task, then the digest of the
    prompt and completion token ids), so the same samples in any arrival order are trained in
    the same order and split into the same mini-batches (rollout ids are random; token ids
    are reproducible from a run seed)."""
    import hashlib

    t = sample["transition"]
    h = hashlib.sha1()
    for ids in (t["prompt_token_ids"], t["completion_token_ids"]):
        h.update(len(ids).to_bytes(4, "little"))
        h.update(b"".join(int(x).to_bytes(4, "little", signed=True) for x in ids))
    return t.get("task_id", ""), h.hexdigest()


@dataclass(frozen=True)
class UpdateConfig:
    """What one update reads of the trainer's settings, passed whole to :func:`train_update`
    (``**asdict(update)``): the :class:`TrainerConfig` fields of the same names, made by
    :meth:`of` only, so the trainer and a benchmark that trains "as the trainer does" cannot map
    them differently. ``ratio_cap`` is the dual-clip cap when stale samples are kept, else None."""

    algorithm: str
    singleton_advantage: str
    clip_eps: float
    loss_agg: str
    advantage_std_scale: bool
    drop_zero_variance: bool
    negative_advantage_weight: float
    prefix_tree_advantage: bool
    prefix_merge: bool
    tree_packing: bool
    kl_coef: float
    mini_batches: int
    ppo_epochs: int
    micro_batch: int
    micro_batch_tokens: int
    logprob_chunk: int
    ratio_cap: float | None

    @classmethod
    def of(cls, cfg: TrainerConfig, *, stale_kept: bool = False, **over) -> "UpdateConfig":
        """``cfg``'s values (``ratio_cap`` only with ``stale_kept``: ``stale_policy=keep`` and
        stale samples in the update), ``over`` replacing some (a benchmark's variant).
        Example: ``UpdateConfig.of(TrainerConfig(), tree_packing=True).tree_packing is True``."""
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)}
        values["ratio_cap"] = cfg.ratio_cap if stale_kept else None
        return cls(**{**values, **over})


def train_update(engine, samples: list[dict], *, clip_eps: float = 0.2, micro_batch: int = 8, ppo_epochs: int = 1,
                 pad_token_id: int = 0, algorithm: str = "grpo", kl_coef: float = 0.0,
                 micro_batch_tokens: int | None = None, loss_agg: str = "token_mean",
                 singleton_advantage: str = "batch", ratio_cap: float | None = None,
                 advantage_std_scale: bool = True, drop_zero_variance: bool = False,
                 mini_batches: int = 1, ref_model=None, logprob_chunk: int = LOGPROB_CHUNK,
                 negative_advantage_weight: float = 1.0, prefix_tree_advantage: bool = False,
                 self_imitation: SelfImitationBuffer | None = None, prefix_merge: bool = False,
                 temperature: float | None = None, tree_packing: bool = False) -> dict:
    """One policy update on ``samples``: ``ppo_epochs`` passes, each of ``mini_batches``
    optimizer steps over a deterministic split of the samples (:func:`sample_key`,
    :func:`losses.mini_batch_indices`), micro-batched; ``loss_agg`` weighs tokens within a
    mini-batch (``losses.sequence_loss_weights``: token_mean, sequence_mean or
    per_rollout_mean); log-probs ``logprob_chunk`` completion positions at a time
    (:func:`completion_logprobs`; 0: full logits), the policy's and the reference's at the
    sampling ``temperature`` every sample was drawn at (the stack's ``rollout_temperature``,
    with which vLLM's behaviour log-probs are those of ``softmax(logits / T)``; None: the raw
    logits); ``ratio_cap``: dual-clip (``losses.dual_clip``; None: off).
    ``advantage_std_scale`` False: Dr. GRPO advantages (:func:`sample_advantages`).
    ``negative_advantage_weight``: negative advantages scaled by it after they are computed
    (:func:`losses.negative_weighted_advantages`; 1: unchanged).
    ``prefix_tree_advantage`` (grpo only): each completion token gets the value of the
    completions of its group and prompt that share the prefix up to it
    (:func:`token_advantages`, TreeRL's global advantage); the negative weight then applies
    per token. Raises ValueError with ``reinforce_pp``.
    ``self_imitation`` (a :class:`self_imitation.SelfImitationBuffer`): its entries (the
    positive-advantage samples of earlier updates, each with the advantage it was trained with)
    are trained again beside the new samples, against their own behaviour log-probs (counted as
    ``replayed``, not in ``samples``); afterwards this update's positive-advantage samples are
    added to it (Self-Imitation Learning, Oh et al. 2018); a replayed advantage is scaled by the
    buffer's ``weight`` (SIL's beta^sil); with the buffer's ``loss`` "sil" they are
    micro-batched apart from the new samples and trained under SIL's unclipped loss
    (:func:`losses.self_imitation_loss`) instead of the PPO clip. An update with no new sample left
    takes no step and adds nothing.
    ``prefix_merge``: each mini-batch's calls of one attempt that extend each other are trained
    as one row (trainer/prefix_merge.py, Agent Lightning v1's trajectory aggregation): every
    completion token keeps its own call's advantage, behaviour log-prob and ``loss_agg`` weight,
    so the loss and its gradient are those of the calls one by one (causal model), with fewer
    tokens forwarded; counted as ``prefix_merge_rows``, ``prefix_merge_links``,
    ``prefix_merge_breaks`` (by cause), ``prefix_merge_tokens`` / ``prefix_merge_tokens_per_call``
    and, with ``mini_batches`` > 1, ``prefix_merge_mini_batch_cuts`` (rows more than if the
    update were one mini-batch). Works with every other option here (merging happens after
    the advantages, the filters and the replay are settled, inside each mini-batch).
    ``tree_packing``: the rows (merged or not) of each mini-batch are grouped into micro-batches
    in lexicographic order (:func:`tree_pack.tree_budget_batches`: ``micro_batch`` rows and
    ``micro_batch_tokens`` *packed* tokens at most) and each micro-batch is forwarded as one
    packed prefix tree (trainer/tree_pack.py, AReaL's tree training): shared prefixes once, the
    same log-probs and gradients up to float rounding; counted as ``tree_pack_tokens`` (forwarded)
    and ``tree_pack_row_tokens`` (what the same rows unpacked would forward, without padding).
    Needs ``logprob_chunk`` > 0 (ValueError).
    ``drop_zero_variance``: samples of groups whose rollouts all got the same return are left
    out before the update (:func:`losses.zero_variance_samples`; counted as
    ``dropped_zero_variance``); when nothing is left no step is taken (``steps`` 0).
    ``ref_model`` (frozen, the base weights: a second model, or ``lora.AdapterDisabled`` of a
    LoRA engine's own model): the k3 KL to the reference policy is computed
    per token, logged as ``ref_kl`` (token mean) and added to the loss times ``kl_coef``
    (DeepSeekMath eq. 4); without it ``kl_coef`` has nothing to act on.
    With N ranks (torch.distributed initialised with world size N, trainer/ranks.py) every rank
    is given the same ``samples`` and computes the same plan; each trains its share of every
    mini-batch's micro-batches (:func:`ranks.rank_share`, padding passes at zero weight), its loss
    times N (ZeRO averages the reduced gradients), and the metrics are summed over the ranks: the
    update is the one-rank update (bench/ranks.py).
    ``reinforce_pp`` normalises each call's credited ``reward`` over the batch (the credit
    rule's return of that call, AIR's intermediate rewards included; with identical credit and
    no AIR it is the episode return R). Returns the update's metrics (those of the first
    epoch for the ratio statistics)."""
    t0 = time.perf_counter()
    received = len(samples)
    keyed = sorted(((sample_key(s), s) for s in samples), key=lambda ks: ks[0])
    keys = [k for k, _ in keyed]  # content order: arrival order changes nothing
    samples = [s for _, s in keyed]
    dropped = 0
    if drop_zero_variance:
        zero = losses.zero_variance_samples([s.get("group_std", 1.0) for s in samples],
                                            [s.get("group_rollouts", 2) for s in samples])
        dropped = sum(zero)
        keys = [k for k, z in zip(keys, zero) if not z]
        samples = [s for s, z in zip(samples, zero) if not z]
    base = {"samples_received": received, "dropped_zero_variance": dropped, "samples": len(samples),
            "loss_agg": loss_agg, "mini_batches": 0, "steps": 0}
    if self_imitation is not None:
        base["replayed"] = 0
    if not samples:
        return {**base, "update_s": time.perf_counter() - t0}
    use_ref = ref_model is not None
    raw = sample_advantages(samples, algorithm, singleton_advantage, advantage_std_scale)
    advantages = losses.negative_weighted_advantages(raw, negative_advantage_weight)
    per_token = None  # with prefix_tree_advantage: a list of token advantages per sample
    if prefix_tree_advantage:
        if algorithm != "grpo":
            raise ValueError(f"prefix_tree_advantage needs algorithm 'grpo', got {algorithm!r}")
        per_token = [losses.negative_weighted_advantages(row, negative_advantage_weight)
                     for row in token_advantages(samples, raw, advantage_std_scale)]
    n_new = len(samples)  # samples[:n_new] are this update's; the rest are replayed
    if self_imitation is not None:
        replay = self_imitation.entries()
        positives = positive_entries(samples, raw, per_token)  # added once the update is done
        for entry in replay:
            s, a, row = entry
            if (row is None) != (per_token is None):
                raise ValueError("a replayed sample's advantage is per token exactly when prefix_tree_advantage is on")
            samples.append(s)
            keys.append(sample_key(s))
            advantages.append(a * self_imitation.weight)
            if per_token is not None:
                per_token.append(self_imitation.replay_advantage(entry))
        base["replayed"] = len(replay)
        base["replayed_tokens"] = sum(len(s["transition"]["completion_token_ids"]) for s, _, _ in replay)
    sil_replay = self_imitation is not None and self_imitation.loss == "sil" and len(samples) > n_new
    minis = losses.mini_batch_indices(keys, mini_batches)
    per_sample = advantages if per_token is None else per_token
    stop_ids = eos_token_ids(engine) if prefix_merge else None
    tree_pack.check_tree_packing(tree_packing, logprob_chunk)
    merged_stats = {"rows": 0, "links": 0, "breaks": dict.fromkeys(BREAK_CAUSES, 0), "tokens": 0, "tokens_per_call": 0}
    plan = []  # per mini-batch: (micro-batches, their token weights [B, T], per-sample weights, sample indices)
    for mini in minis:
        sub = [samples[i] for i in mini]
        # weights of the mini-batch sum to 1 (token mean, sequence mean or per-rollout mean), per call
        seq_w = losses.sequence_loss_weights(
            [(s["transition"].get("rollout_id", i), s["transition"].get("attempt_id")) for i, s in enumerate(sub)],
            [len(s["transition"]["completion_token_ids"]) for s in sub], loss_agg)
        if prefix_merge:  # one row per chain of calls; each token keeps its call's advantage and weight
            merged = merge_calls(sub, [per_sample[i] for i in mini], stop_ids)
            merged_stats["rows"] += len(merged.rows)
            for k in ("links", "tokens", "tokens_per_call"):
                merged_stats[k] += getattr(merged, k)
            for cause, n in merged.breaks.items():
                merged_stats["breaks"][cause] += n
            lengths = [len(r.input_ids) for r in merged.rows]
        else:
            lengths = [len(s["transition"]["prompt_token_ids"]) + len(s["transition"]["completion_token_ids"])
                       for s in sub]
        units = list(range(len(lengths)))  # rows (prefix_merge) or samples of the mini-batch
        parts = [units]
        if sil_replay:  # replayed samples in micro-batches of their own: they take SIL's loss
            replayed = [mini[(merged.rows[u].samples[0] if prefix_merge else u)] >= n_new for u in units]
            parts = [[u for u in units if not replayed[u]], [u for u in units if replayed[u]]]
        groups, sil_chunks = [], []
        if tree_packing:
            tokens = [merged.rows[u].input_ids if prefix_merge else
                      list(sub[u]["transition"]["prompt_token_ids"]) + list(sub[u]["transition"]["completion_token_ids"])
                      for u in units]
        for k, part in enumerate(parts):
            if tree_packing:  # rows sharing prefixes side by side, by packed tokens
                part_groups = tree_pack.tree_budget_batches([tokens[u] for u in part],
                                                            micro_batch_tokens or sum(lengths), micro_batch)
            elif micro_batch_tokens:  # pack by padded tokens, longest first
                part_groups = batching.length_budget_batches([lengths[u] for u in part], micro_batch_tokens,
                                                             micro_batch) if part else []
            else:
                part_groups = batching.micro_batches(list(range(len(part))), micro_batch)
            groups += [[part[j] for j in g] for g in part_groups]
            sil_chunks += [k == 1] * len(part_groups)
        chunks, chunk_w = [], []
        for g in groups:
            if prefix_merge:
                b, token_w = collate_rows([merged.rows[j] for j in g], sub, seq_w, pad_token_id)
            else:
                b = batching.collate([sub[i] for i in g], pad_token_id, [per_sample[mini[i]] for i in g])
                token_w = b.completion_mask * torch.tensor([seq_w[i] for i in g], dtype=torch.float32)[:, None]
            chunks.append(b)
            chunk_w.append(token_w)
        packs = [tree_pack.pack_batch(b.input_ids, b.attention_mask) if tree_packing else None for b in chunks]
        plan.append((chunks, chunk_w, seq_w, mini, sil_chunks, packs))
    n_tokens = sum(b.num_completion_tokens for chunks, *_ in plan for b in chunks)
    device = engine.device
    rank, world = rank_and_world()  # N ranks: each trains its share of every mini-batch (trainer/ranks.py)
    engine.train()
    stats = {}
    steps = 0
    for epoch in range(ppo_epochs):
        epoch_stats = {"loss": 0.0, "approx_kl": 0.0, "clip_frac": 0.0, **({"ref_kl": 0.0} if use_ref else {})}
        for chunks, chunk_w, _, _, sil_chunks, packs in plan:
            share = ranks.rank_share([p.tokens if p is not None else b.input_ids.numel()
                                      for b, p in zip(chunks, packs)], world, rank)
            for j, (i, padding) in enumerate(share):
                engine.set_gradient_accumulation_boundary(j == len(share) - 1)
                b = chunks[i]
                b = batching.Batch(*(t.to(device) for t in (b.input_ids, b.attention_mask, b.completion_mask,
                                                            b.behaviour_logprobs, b.advantages, b.returns)))
                token_w = chunk_w[i].to(device)  # [B, T]: each completion token's weight in the loss
                if padding:  # a rank's padding pass: the same collectives, no contribution
                    token_w = torch.zeros_like(token_w)
                # log-probs only over the trailing window that predicts completion tokens
                # (the lm_head over a 49k vocabulary at every prompt position is most of the memory)
                K = batching.completion_window(b)
                logp = completion_logprobs(engine, b.input_ids, b.attention_mask, b.completion_mask, K,
                                           logprob_chunk, temperature, packs[i])
                ref_logp = None
                if use_ref:
                    with torch.no_grad():
                        ref_logp = completion_logprobs(ref_model, b.input_ids, b.attention_mask,
                                                       b.completion_mask, K, logprob_chunk, temperature, packs[i])
                b = batching.Batch(b.input_ids[:, -K:], b.attention_mask[:, -K:], b.completion_mask[:, -K:],
                                   b.behaviour_logprobs[:, -K:], b.advantages[:, -K:], b.returns)
                token_w = token_w[:, -K:]
                if sil_chunks[i]:  # replayed samples under SIL's unclipped loss
                    loss = losses.self_imitation_loss(logp, b.advantages, b.completion_mask, token_w,
                                                      kl_coef=kl_coef, ref_logp=ref_logp)
                else:
                    loss = losses.ppo_clip_loss(logp, b.behaviour_logprobs, b.advantages, b.completion_mask,
                                                clip_eps=clip_eps, kl_coef=kl_coef,
                                                ref_logp=ref_logp, token_weights=token_w, ratio_cap=ratio_cap)
                # DeepSpeed averages the ranks' gradients: times the world size, their sum
                engine.backward(loss * world if world > 1 else loss, scale_wrt_gas=False)
                if padding:
                    del logp, loss, ref_logp
                    continue
                with torch.no_grad():
                    w = b.num_completion_tokens / n_tokens
                    epoch_stats["loss"] += float(loss) / len(plan)
                    epoch_stats["approx_kl"] += w * float(losses.approx_kl(logp, b.behaviour_logprobs,
                                                                           b.completion_mask))
                    epoch_stats["clip_frac"] += w * float(losses.clip_fraction(logp, b.behaviour_logprobs,
                                                                               b.completion_mask, clip_eps))
                    if use_ref:
                        epoch_stats["ref_kl"] += w * float(losses.reference_kl(logp, ref_logp, b.completion_mask))
                del logp, loss, ref_logp
            pre_step_norm = _unpartitioned_grad_norm(engine) if epoch == 0 and "grad_norm" not in epoch_stats else None
            engine.step()
            steps += 1
            if epoch == 0 and "grad_norm" not in epoch_stats:  # of the first mini-batch's step
                epoch_stats["grad_norm"] = pre_step_norm if pre_step_norm is not None else _grad_norm(engine)
        if world > 1:  # each rank summed its share; also the update's last collective (every rank stepped)
            names = [k for k in epoch_stats if k != "grad_norm"]
            summed = torch.tensor([epoch_stats[k] for k in names], dtype=torch.float64)
            torch.distributed.all_reduce(summed)
            epoch_stats.update(zip(names, summed.tolist()))
        if epoch == 0:
            stats = epoch_stats  # metrics of the first epoch: ratio vs. the behaviour policy
    engine.set_gradient_accumulation_boundary(None)
    if self_imitation is not None:
        self_imitation.add(positives)
    dt = time.perf_counter() - t0
    total_tokens = sum(b.num_tokens for chunks, *_ in plan for b in chunks)
    mean_adv = sum(advantages) / len(advantages)
    # the advantage as the loss weighs it (token_mean: the token-weighted mean), over the update
    token_sums = ([sum(row) for row in per_token] if per_token is not None else
                  [a * len(s["transition"]["completion_token_ids"]) for a, s in zip(advantages, samples)])
    weighted = sum(w * token_sums[mini[j]] for _, _, seq_w, mini, *_ in plan for j, w in enumerate(seq_w)) / len(plan)
    return {
        **base,
        **stats,
        "lr": _learning_rate(engine),
        "advantage_std": (sum((a - mean_adv) ** 2 for a in advantages) / len(advantages)) ** 0.5,
        # of this update's samples (replayed ones are in the advantage figures and the loss)
        "mean_return": sum(s["transition"]["episode_return"] for s in samples[:n_new]) / n_new,
        "mean_reward": sum(s["transition"]["reward"] for s in samples[:n_new]) / n_new,
        "mean_advantage": mean_adv,
        "weighted_advantage": weighted,
        "zero_advantage_fraction": sum(1 for a in advantages if abs(a) < 1e-9) / len(advantages),
        "mini_batches": len(plan),
        "steps": steps,
        "completion_tokens": n_tokens,
        "tokens": total_tokens,
        "update_s": dt,
        "tokens_per_s": total_tokens * ppo_epochs / dt,
        **(merge_metrics(merged_stats, samples, per_sample, stop_ids, len(plan)) if prefix_merge else {}),
        **({"tree_pack_tokens": sum(p.tokens for *_, packs in plan for p in packs),
            "tree_pack_row_tokens": sum(p.row_tokens for *_, packs in plan for p in packs)} if tree_packing else {}),
    }


def merge_metrics(stats: dict, samples: list[dict], per_sample: list, stop_ids, n_minis: int) -> dict:
    """The update's prefix-merge counts (``train_update``'s ``prefix_merge``) from the summed
    per-mini-batch ``stats``; with more than one mini-batch also ``prefix_merge_mini_batch_cuts``,
    the rows minus those of the update's calls merged as one mini-batch (how many chains the
    content-order split cut)."""
    out = {"prefix_merge_rows": stats["rows"], "prefix_merge_links": stats["links"],
           "prefix_merge_breaks": dict(stats["breaks"]), "prefix_merge_tokens": stats["tokens"],
           "prefix_merge_tokens_per_call": stats["tokens_per_call"]}
    if n_minis > 1:
        whole = merge_calls(samples, per_sample, stop_ids)
        out["prefix_merge_mini_batch_cuts"] = stats["rows"] - len(whole.rows)
    return out


def eos_token_ids(model) -> set[int] | None:
    """The model's end-of-sequence token ids (its config's ``eos_token_id``, an int or a list;
    ``model`` an engine, a peft model or an HF model), for telling a cut completion
    (``prefix_merge.truncated``); None when the config has none."""
    config = getattr(getattr(model, "module", model), "config", None)
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return None
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _unpartitioned_grad_norm(engine) -> float | None:
    """Stage 0 only (None otherwise): the global L2 norm of the (already all-reduced) gradients
    before the step clips them, which DeepSpeed computes but does not keep without ZeRO."""
    if zero_stage_of(engine) != 0:
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else None


def _grad_norm(engine) -> float | None:
    """The global gradient norm DeepSpeed computed for its last step (before clipping), or None."""
    try:
        norm = engine.get_global_grad_norm()
        return None if norm is None else float(norm)
    except Exception:  # noqa: BLE001 - an optional metric
        return None


def _learning_rate(engine) -> float | None:
    try:
        return float(engine.get_lr()[0])
    except Exception:  # noqa: BLE001 - an optional metric
        return None


# ---- checkpoints ----------------------------------------------------------------------

def save_checkpoint(model, base_dir: Path, out_dir: Path, state_dict: dict | None = None, **manifest_fields) -> dict:
    """Write HF safetensors + config + the base dir's tokenizer files + manifest into ``out_dir``
    (the weights of ``state_dict`` when given, e.g. :func:`gathered_state_dict` under ZeRO-3).

    With ``adapter`` in ``manifest_fields`` (``lora.lora_spec``; ``model`` a peft LoRA model):
    only the adapter (``adapter_model.safetensors``, ``adapter_config.json``, ``lora.save_adapter``)
    and the manifest, whose ``adapter`` and ``base_model`` say what it applies to; the base
    model's files stay where they are. Raises ValueError when ``adapter`` and the model disagree."""
    out_dir = Path(out_dir)
    adapter = manifest_fields.get("adapter")
    if (adapter is not None) != hasattr(model, "peft_config"):
        raise ValueError("save_checkpoint: a peft model needs its manifest's adapter, and only a peft model has one")
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    if adapter is not None:
        lora.save_adapter(model, out_dir, manifest_fields["base_model"])
        return checkpoint.write_manifest(out_dir, **manifest_fields)
    model.save_pretrained(str(out_dir), safe_serialization=True, state_dict=state_dict)
    for p in Path(base_dir).iterdir():
        if p.is_file() and p.name not in _MODEL_FILES and not (out_dir / p.name).exists():
            shutil.copy2(p, out_dir / p.name)
    return checkpoint.write_manifest(out_dir, **manifest_fields)


def manifest_metrics(metrics: dict) -> dict:
    """What a checkpoint manifest carries of the last update's metrics (``train_update``'s):
    its numbers as they are, and a dict of numbers (``prefix_merge_breaks``, by cause) as
    ``<key>_<name>`` entries; anything else (strings) is left out.
    Example: {"loss": 0.1, "loss_agg": "token_mean", "prefix_merge_breaks": {"truncation": 2}}
    -> {"loss": 0.1, "prefix_merge_breaks_truncation": 2}."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)):
            out[k] = v
        elif isinstance(v, dict):
            out.update({f"{k}_{name}": n for name, n in v.items() if isinstance(n, (int, float))})
    return out


def base_model_id(base_dir: Path) -> str:
    """The base model's id: the manifest's ``base_model`` for a checkpoint, else what the
    conversion wrote beside the weights (``spanrl_base.json``, spanrl/core/model.py), else the
    directory's name (a model directory spanrl did not convert)."""
    from spanrl.core.model import BASE_FILE

    for name in (checkpoint.MANIFEST, BASE_FILE):
        m = Path(base_dir) / name
        if m.exists():
            return json.loads(m.read_text())["base_model"]
    return Path(base_dir).name


def fetch_limit(batching: str, good: int, min_batch: int, max_batch: int, fetch_max: int = 1000) -> int:
    """How many records the trainer's next fetch of ``samples`` may add to its buffer, which
    holds ``good`` decodable samples: in ``stream`` batching enough to fill one update
    (``max(min_batch, max_batch) - good``, 0: train before reading more), so that a trainer
    slower than the samples' rate holds at most an update's worth in memory and leaves the rest
    in Kafka (before issue 21 it read ``fetch_max`` per fetch and trained ``max_batch`` of them:
    the buffer, and the process, grew for as long as it was behind); in ``barrier`` batching
    ``fetch_max`` (the buffer must reach the requested offsets), and in ``groups`` batching (it
    must reach the end of the groups an update takes). At most ``fetch_max``."""
    if batching in ("barrier", "groups"):
        return fetch_max
    return max(0, min(fetch_max, max(min_batch, max_batch) - good))


def resume_plan(kafka_latest: int | None, store_latest: int | None) -> tuple[int, bool, int | None]:
    """Where a trainer resumes: ``(version, announce, gone)``.

    version: the newest checkpoint in the object store (0: the base model). A checkpoint is
    uploaded before it is announced, so an announcement newer than the store means its
    objects were deleted (``spanrl clean``): the run goes on from what the store still
    holds, never from a checkpoint that is gone (``gone``: that announced version, else
    None). announce: the version is uploaded but not announced (a crash between the two).
    """
    version = store_latest or 0
    announce = version > 0 and (kafka_latest is None or kafka_latest < version)
    gone = kafka_latest if kafka_latest is not None and kafka_latest > version else None
    return version, announce, gone


# ---- the service (plumbing) ----------------------------------------------------------

@dataclass
class TrainerState:
    run: str
    version: int = 0
    step: int = 0
    updates: int = 0
    buffered: int = 0
    skipped: dict = field(default_factory=dict)
    trained_offsets: dict = field(default_factory=dict)
    last_metrics: dict = field(default_factory=dict)
    last_checkpoint: str | None = None
    pending_checkpoint: str | None = None  # saved, upload/announce not finished yet
    retries: int = 0  # retried MinIO/Kafka operations since start
    batching: str = ""  # SPANRL_TRAINER_BATCHING, set at start
    #: the recipe this trainer runs (spanrl/core/recipes.py): its ``name`` (SPANRL_RECIPE; none:
    #: ``default``, TrainerConfig's own defaults), the trainer's ``values`` of every field a recipe
    #: sets, and where they ``differ`` from the recipe (``recipes.differences``: the environment's)
    recipe: dict = field(default_factory=dict)
    #: data-parallel ranks of this trainer (SPANRL_TRAINER_RANKS) and whether an update is running now
    ranks: int = 1
    in_update: bool = False
    #: barrier batching: the offsets ``POST /admin/train`` asked to train up to (``topic:p`` -> next offset)
    train_until: dict = field(default_factory=dict)
    #: staleness (trainer/staleness.py) since start: the bound, the lag histogram of the
    #: samples trained ({"lag": count}), samples refused (dead letter stale_sample) and kept
    staleness: dict = field(default_factory=lambda: {"max_staleness": None, "policy": None,
                                                     "lag_histogram": {}, "refused": 0, "kept": 0})
    #: samples in the self-imitation buffer (SPANRL_TRAINER_SELF_IMITATION_UPDATES > 0; else 0)
    self_imitation_samples: int = 0
    #: prefix-merged rows (SPANRL_TRAINER_PREFIX_MERGE, trainer/prefix_merge.py) since start: whether
    #: it is on, rows trained, calls merged into a previous call's row (links), breaks by cause,
    #: tokens forwarded merged vs what the calls one by one would forward (one pass; each PPO epoch repeats it)
    prefix_merge: dict = field(default_factory=lambda: {"enabled": False, "rows": 0, "links": 0,
                                                        "breaks": dict.fromkeys(BREAK_CAUSES, 0),
                                                        "tokens": 0, "tokens_per_call": 0})


def add_merge_counts(acc: dict, metrics: dict) -> None:
    """Add an update's prefix-merge counts (``train_update``'s ``prefix_merge_*`` metrics; none
    when it was off) to ``acc`` (``TrainerState.prefix_merge``).
    Example: acc rows 3, metrics prefix_merge_rows 2 -> rows 5."""
    if "prefix_merge_rows" not in metrics:
        return
    for k in ("rows", "links", "tokens", "tokens_per_call"):
        acc[k] += metrics[f"prefix_merge_{k}"]
    for cause, n in metrics["prefix_merge_breaks"].items():
        acc["breaks"][cause] = acc["breaks"].get(cause, 0) + n


async def read_announcements(topic: str, run: str, bootstrap: str) -> list[dict]:
    """Every CheckpointAnnouncement of ``run`` currently on ``topic`` (read_committed), event
    ``published`` only (the release gate's served/refused records are left out)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from spanrl.schemas.codec import decode

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed",
                                enable_auto_commit=False, group_id=None)
    await consumer.start()
    out = []
    try:
        parts = await topic_partitions(consumer, topic)
        if not parts:
            return []
        tps = [TopicPartition(topic, p) for p in parts]
        consumer.assign(tps)
        end = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning(*tps)
        while any([await consumer.position(tp) < end[tp] for tp in tps]):
            batch = await consumer.getmany(timeout_ms=1000)
            for msgs in batch.values():
                for m in msgs:
                    if m.key is not None and m.key.decode() == run:
                        ann = decode("checkpoint", m.value)
                        if ann.get("event", "published") == "published":  # not a release-gate decision
                            out.append(ann)
    finally:
        await consumer.stop()
    return out


BATCHING_MODES = ("stream", "barrier", "groups")
#: the batching modes in which a driver may ask for an update (``POST /admin/train``)
DRIVEN_BATCHING = ("barrier", "groups")


def recipe_report(cfg: TrainerConfig, name: str) -> dict:
    """What a trainer reports of its recipe (``TrainerState.recipe``, ``GET /status``, a run's
    summary): ``{"name", "values": {field: cfg's value} for every field a recipe sets,
    "differs": recipes.differences(values, name)}``."""
    values = {k: getattr(cfg, k) for k in recipe_fields()}
    return {"name": name, "values": values, "differs": differences(values, name)}


class Trainer:
    def __init__(self, cfg: TrainerConfig, settings=None):
        self.cfg = cfg
        self.settings = settings or get_settings()
        self.run = cfg.run or self.settings.run
        self.base_dir = Path(cfg.base_dir or self.settings.model_dir)
        self.state = TrainerState(run=self.run)
        self.log_path = Path(cfg.log_path or (self.settings.state_dir / f"trainer-{self.run}.jsonl"))
        self.minio = checkpoint.make_client(self.settings)
        self.engine = None
        self.model_dir = self.base_dir  # where the current weights were loaded from (tokenizer files too)
        # every torch call of the service runs on this one thread (:meth:`on_torch_thread`)
        self.torch_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="spanrl-torch")
        self._stop = asyncio.Event()
        # trained_offsets of the parent checkpoint (or the run's start): where the next
        # checkpoint's consumed_offsets ranges begin
        self._consumed_from: dict[str, int] = {}
        self.tracker: tracking.Tracker = tracking.NullTracker()  # set in _serve (SPANRL_TRACKER)
        self.staleness_rule = staleness.StalenessRule(cfg.max_staleness, cfg.stale_policy)  # ValueError if bad
        if cfg.batching not in BATCHING_MODES:
            raise ValueError(f"unknown batching {cfg.batching!r}; known: {', '.join(BATCHING_MODES)}")
        if cfg.loss_agg not in losses.LOSS_AGGREGATIONS:
            raise ValueError(f"unknown loss_agg {cfg.loss_agg!r}; known: {', '.join(losses.LOSS_AGGREGATIONS)}")
        if cfg.mini_batches < 1:
            raise ValueError(f"mini_batches must be >= 1, got {cfg.mini_batches}")
        if cfg.update_groups < 1:
            raise ValueError(f"update_groups must be >= 1, got {cfg.update_groups}")
        if cfg.prefix_tree_advantage and cfg.algorithm != "grpo":
            raise ValueError(f"prefix_tree_advantage needs algorithm 'grpo', got {cfg.algorithm!r}")
        losses.negative_weighted_advantages([], cfg.negative_advantage_weight)  # ValueError outside [0, 1]
        if cfg.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {cfg.kl_coef}")
        if cfg.self_imitation_updates < 0:
            raise ValueError(f"self_imitation_updates must be >= 0, got {cfg.self_imitation_updates}")
        if not cfg.self_imitation_weight > 0:
            raise ValueError(f"self_imitation_weight must be > 0, got {cfg.self_imitation_weight}")
        check_replay_loss(cfg.self_imitation_loss)  # also when the buffer is off: a misspelt value is an error
        #: the positive-advantage samples of the last updates, trained again (None: off)
        self.self_imitation = (SelfImitationBuffer(cfg.self_imitation_updates, cfg.self_imitation_weight,
                                                   cfg.self_imitation_loss)
                               if cfg.self_imitation_updates else None)
        #: the LoRA adapter trained (lora.lora_spec; None: full fine-tuning)
        self.adapter = lora.lora_spec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
        self.state.batching = cfg.batching
        self.state.recipe = recipe_report(cfg, self.settings.recipe or "default")
        self.state.prefix_merge["enabled"] = cfg.prefix_merge
        self.ref_model = None  # the reference policy (base weights) when kl_coef > 0: a model or lora.AdapterDisabled
        self._train_until: dict[int, int] = {}  # barrier batching: partition -> next offset to train up to
        self.state.staleness.update(max_staleness=cfg.max_staleness, policy=cfg.stale_policy)
        # what the next checkpoint's manifest reports (since its parent)
        self._since_parent = {"lag_histogram": {}, "refused": 0, "kept": 0}
        self._dead_producer = None
        #: this process's rank and the group's size (``SPANRL_TRAINER_RANKS``: DeepSpeed's launcher sets them)
        self.rank, self.world = launched_rank_and_world()
        self.state.ranks = self.world
        if cfg.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {cfg.ranks}")
        check_zero_stage(cfg.zero_stage)
        if cfg.zero_stage == 3 and (cfg.logprob_chunk or cfg.lora_rank):
            raise ValueError("zero_stage 3 needs logprob_chunk=0 (chunked log-probs read the partitioned output "
                             "layer) and lora_rank=0 (adapters are small: ZeRO-2 holds them)")
        tree_pack.check_tree_packing(cfg.tree_packing, cfg.logprob_chunk)
        #: rank 0 -> the other ranks: what to load and train (trainer/ranks.py); None with one rank
        self.channel: ranks.CommandChannel | None = None

    def emit(self, record: dict) -> None:
        if self.rank:  # rank 0 speaks for the group (its log file, its stdout)
            return
        line = json.dumps(record, sort_keys=True)
        print(line, flush=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    async def _retry(self, what: str, fn):
        """``checkpoint.retry`` with this trainer's stop event; each retry is logged as a
        ``retry`` event."""
        def on_retry(attempt: int, delay: float, exc: BaseException) -> None:
            self.state.retries += 1
            self.emit({"event": "retry", "run": self.run, "what": what, "attempt": attempt,
                       "delay_s": round(delay, 3), "error": f"{type(exc).__name__}: {exc}"[:500]})

        return await checkpoint.retry(fn, what=what, stop=self._stop, on_retry=on_retry)

    # resume ---------------------------------------------------------------------------
    async def resume(self) -> dict | None:
        """Load the latest checkpoint of the run that the object store holds
        (:func:`resume_plan`); returns its manifest or None (start from the base model)."""
        anns = await read_announcements(self.cfg.checkpoints_topic, self.run, self.settings.kafka_bootstrap)
        kafka_latest = max((a["version"] for a in anns), default=None)
        store_latest = await asyncio.to_thread(checkpoint.latest_version_in_store, self.minio,
                                               self.settings.checkpoint_bucket, self.run)
        latest, announce, gone = resume_plan(kafka_latest, store_latest)
        if gone is not None:
            self.emit({"event": "announced_checkpoint_gone", "run": self.run, "announced": gone, "in_store": latest})
            # versions keep growing past what was announced: readers take the newest announcement
            self.state.version = gone
        if latest == 0 and self.cfg.init_from:
            return await self.init_from(self.cfg.init_from)
        if latest == 0:
            return None
        uri = checkpoint.checkpoint_uri(self.settings.checkpoint_bucket, self.run, latest)
        dest = self.settings.cache_dir / "trainer" / self.run / f"{latest:06d}"
        manifest = await asyncio.to_thread(checkpoint.download_checkpoint, self.minio, uri, dest)
        self.model_dir = dest
        self.state.version = max(manifest["version"], gone or 0)
        self.state.step = manifest["step"]
        self.state.trained_offsets = dict(manifest["trained_offsets"])
        self.emit({"event": "resume", "run": self.run, "version": latest, "uri": uri, "step": manifest["step"],
                   "trained_offsets": manifest["trained_offsets"]})
        if announce:
            # uploaded but never announced (crash between the two): announce now
            await self.announce(uri, manifest, dest)
        return manifest

    async def init_from(self, spec: str) -> dict:
        """Start this (new) run from checkpoint ``RUN:VERSION`` of another run: its weights,
        verified against its manifest; this run's versions continue from it and its
        samples are read from ``cfg.start`` (the other run's offsets belong to another topic).
        Raises ValueError for a malformed spec, checkpoint errors for a bad checkpoint."""
        run, _, version = spec.partition(":")
        if not run or not version.isdigit():
            raise ValueError(f"init_from must be RUN:VERSION, got {spec!r}")
        uri = checkpoint.checkpoint_uri(self.settings.checkpoint_bucket, run, int(version))
        dest = self.settings.cache_dir / "trainer" / run / f"{int(version):06d}"
        manifest = await asyncio.to_thread(checkpoint.download_checkpoint, self.minio, uri, dest)
        self.model_dir = dest
        self.state.version = manifest["version"]
        self.state.step = manifest["step"]
        self.emit({"event": "init_from", "run": self.run, "from": spec, "uri": uri, "step": manifest["step"]})
        return manifest

    async def announce(self, uri: str, manifest: dict, ckpt_dir: Path) -> None:
        from aiokafka import AIOKafkaProducer

        from spanrl.schemas.codec import encode

        record = {
            "run": self.run, "version": manifest["version"], "uri": uri, "step": manifest["step"],
            "parent_version": manifest["parent_version"], "manifest_sha256": checkpoint.manifest_sha256(ckpt_dir),
            "created_ms": int(time.time() * 1000),
            "metrics": {k: float(v) for k, v in manifest["metrics"].items() if isinstance(v, (int, float))},
        }
        producer = AIOKafkaProducer(bootstrap_servers=self.settings.kafka_bootstrap, enable_idempotence=True,
                                    request_timeout_ms=30000)
        try:
            await producer.start()
            await asyncio.wait_for(producer.send_and_wait(self.cfg.checkpoints_topic, encode("checkpoint", record),
                                                          key=self.run.encode()), 60)
        finally:
            await producer.stop()

    async def on_torch_thread(self, fn, /, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the trainer's one torch thread (loading, updates, ZeRO-3
        gathers, checkpoint saves), awaited. glibc gives each thread that allocates its own
        malloc arena and keeps what is freed there for that arena: with asyncio's default
        pool (up to cores + 4 threads) each update's activations could come from a different
        arena, every one of them keeping an update's worth (the second hour-long soak's trainer
        stepped up ~70 MiB at minute 30 and stayed). One thread, one arena."""
        return await asyncio.get_running_loop().run_in_executor(self.torch_thread,
                                                                functools.partial(fn, *args, **kwargs))

    async def publish(self) -> None:
        """Save, upload (manifest last) and announce version ``state.version + 1``.

        Upload and announcement are retried until they succeed (or the trainer is
        stopped: :class:`checkpoint.Stopped`); the saved directory and its manifest are
        fixed first, so every retry publishes the same bytes. ``state.version`` moves
        only once the announcement is acknowledged."""
        parent = self.state.version
        version = parent + 1
        out = self.settings.cache_dir / "trainer" / self.run / f"{version:06d}"
        uri = checkpoint.checkpoint_uri(self.settings.checkpoint_bucket, self.run, version)
        t0 = time.perf_counter()
        metrics = manifest_metrics(self.state.last_metrics)
        trained = dict(self.state.trained_offsets)
        consumed = checkpoint.consumed_ranges(self._consumed_from, trained)
        if self.channel is not None and self.cfg.zero_stage == 3:  # every rank gives its partition
            self.channel.send({"op": "gather"})
        state = await self.on_torch_thread(gathered_state_dict, self.engine) if self.cfg.zero_stage == 3 else None
        manifest = await self.on_torch_thread(
            save_checkpoint, self.engine.module, self.model_dir, out, state_dict=state, run=self.run, version=version,
            parent_version=parent, base_model=base_model_id(self.model_dir), step=self.state.step,
            trained_offsets=trained, consumed_offsets=consumed, metrics=metrics,
            staleness={"max_staleness": self.cfg.max_staleness, "policy": self.cfg.stale_policy,
                       **self._since_parent}, adapter=self.adapter)
        key = self.settings.checkpoint_key()
        if key is not None:  # the reloader serves only what verifies (spanrl/core/credentials.py)
            await asyncio.to_thread(checkpoint.sign_manifest, out, key)
        elif self.settings.auth == "on":
            log.error("no checkpoint key in %s/secrets: v%d goes out unsigned and a reloader with auth on "
                      "refuses it (start the stack once to make the key)", self.settings.state_dir, version)
        self.state.pending_checkpoint = uri
        await self._retry(f"upload {uri}",
                          lambda: asyncio.to_thread(checkpoint.upload_checkpoint, self.minio, out, uri))
        await self._retry(f"announce {self.run} v{version}", lambda: self.announce(uri, manifest, out))
        self.state.version = version
        self.state.last_checkpoint = uri
        self.state.pending_checkpoint = None
        self._consumed_from = trained
        self._since_parent = {"lag_histogram": {}, "refused": 0, "kept": 0}
        checkpoint.prune_local(out.parent, self.cfg.keep_local, protect={self.model_dir, out})
        if self.cfg.keep_published > 0:
            try:
                pruned = await asyncio.to_thread(checkpoint.prune_store, self.minio, self.settings.checkpoint_bucket,
                                                 self.run, self.cfg.keep_published)
                if pruned:
                    self.emit({"event": "pruned", "run": self.run, "versions": pruned})
            except Exception as exc:  # noqa: BLE001 - housekeeping; the next publish tries again
                log.warning("pruning old checkpoints of %s failed: %s", self.run, exc)
        self.emit({"event": "checkpoint", "run": self.run, "version": version, "uri": uri,
                   "step": self.state.step, "trained_offsets": trained, "consumed_offsets": consumed,
                   "seconds": round(time.perf_counter() - t0, 3)})

    async def seek_start(self, consumer, tps: dict) -> dict[str, str]:
        """Assign every samples partition (``tps``: partition -> TopicPartition) and seek it
        to where this run continues (``checkpoint.start_positions``); a position not taken
        from the checkpoint or the start marker is resolved from ``cfg.start`` (log start
        or end offsets) and written to the marker before the partitions are assigned, so
        nothing is consumed before the marker is durable. Sets ``state.trained_offsets``
        for every partition; returns ``{"TOPIC:P": source}`` (checkpoint | marker |
        earliest | latest)."""
        keys = {p: f"{self.cfg.samples_topic}:{p}" for p in tps}
        bucket = self.settings.checkpoint_bucket
        marker = None
        if any(k not in self.state.trained_offsets for k in keys.values()):
            marker = await self._retry("read start marker", lambda: asyncio.to_thread(
                checkpoint.read_start_marker, self.minio, bucket, self.run))
        marker_offsets = marker["offsets"] if marker else None
        plan = checkpoint.start_positions(list(keys.values()), self.state.trained_offsets, marker_offsets)
        sources = {}
        for key, where in plan.items():
            if isinstance(where, int):
                sources[key] = "checkpoint" if key in self.state.trained_offsets else "marker"
            elif where == "earliest" or self.cfg.start != "latest":
                sources[key] = "earliest"
            else:
                sources[key] = "latest"
        # explicit ListOffsets queries (read_committed: the end is the last stable offset)
        ends = await consumer.end_offsets([tp for p, tp in tps.items() if sources[keys[p]] == "latest"])
        begins = await consumer.beginning_offsets([tp for p, tp in tps.items() if sources[keys[p]] == "earliest"])
        positions = {keys[p]: plan[keys[p]] if isinstance(plan[keys[p]], int) else {**ends, **begins}[tp]
                     for p, tp in tps.items()}
        resolved = {k: v for k, v in positions.items() if sources[k] in ("earliest", "latest")}
        if resolved:
            new_marker = {"run": self.run, "start": self.cfg.start, "created_ms": int(time.time() * 1000),
                          **(marker or {}), "offsets": {**(marker_offsets or {}), **resolved}}
            await self._retry("write start marker", lambda: asyncio.to_thread(
                checkpoint.write_start_marker, self.minio, bucket, self.run, new_marker))
            self.emit({"event": "start_marker", "run": self.run, "offsets": new_marker["offsets"],
                       "uri": f"s3://{bucket}/{checkpoint.start_marker_name(self.run)}"})
        consumer.assign(list(tps.values()))
        for p, tp in tps.items():  # no await in between: the fetcher sees only explicit positions
            consumer.seek(tp, positions[keys[p]])
        self.state.trained_offsets.update(positions)
        self._consumed_from = dict(self.state.trained_offsets)
        return sources

    async def open_consumer(self):
        """A started read_committed consumer and the samples partitions (not assigned yet:
        :meth:`seek_start` does that); raises RuntimeError when the topic does not exist,
        Kafka errors when Kafka is down."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        consumer = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka_bootstrap,
                                    isolation_level="read_committed", enable_auto_commit=False,
                                    group_id=None, max_partition_fetch_bytes=8 * 1024 * 1024,
                                    # an offset outside the log (retention) restarts at the oldest
                                    # record kept, never at the end (that would skip samples)
                                    auto_offset_reset="earliest")
        try:
            await consumer.start()
            parts = await topic_partitions(consumer, self.cfg.samples_topic, wait_s=60)
            if not parts:
                raise RuntimeError(f"topic {self.cfg.samples_topic!r} does not exist")
            tps = {p: TopicPartition(self.cfg.samples_topic, p) for p in parts}
        except BaseException:
            await consumer.stop()
            raise
        return consumer, tps

    def http_routes(self) -> dict:
        """The HTTP routes beside /health and /status (:func:`http_app`'s keyword arguments)."""
        return {"post_routes": {"/admin/train": self.request_train},
                "metrics_fn": lambda: tracking.trainer_families(self.status())}

    # loop -----------------------------------------------------------------------------
    async def serve(self) -> None:
        """Run until ``max_updates`` or :meth:`stop` (a stop during a retry ends it too)."""
        torch.manual_seed(self.torch_seed)
        http = await start_http(self.settings.host, self.settings.trainer_port, self.status, **self.http_routes(),
                                credentials=service_credentials(self.settings, "trainer", log)) \
            if self.cfg.http else None
        self.tracker = tracking.tracker_for(self.settings, self.run, "trainer")
        try:
            await self._serve()
        except checkpoint.Stopped as exc:
            log.warning("stopped: %s", exc)
        finally:
            self.tracker.close()
            if http is not None:
                await http.cleanup()

    @property
    def torch_seed(self) -> int:
        """torch's seed: ``SPANRL_TRAINER_SEED``, else the run seed ``SPANRL_SEED``, else 0."""
        if self.cfg.seed is not None:
            return self.cfg.seed
        return self.settings.seed if self.settings.seed is not None else 0

    async def request_train(self, body: dict) -> tuple[int, dict]:
        """``POST /admin/train {"until": {"<samples topic>:<partition>": next offset, ...}}``
        (barrier and groups batching: a driver, the main job): train every sample below these
        offsets as one update as soon as they are read (in groups batching the count rule waits
        while a request is open); answers 202 with the offsets now asked for. 409 ``not_barrier``
        when the trainer batches by stream; 400 ``invalid_until`` for offsets that are not a
        mapping of this trainer's samples partitions to integers >= 0."""
        if self.cfg.batching not in DRIVEN_BATCHING:
            return 409, {"error": "not_barrier", "detail": f"SPANRL_TRAINER_BATCHING is {self.cfg.batching!r}: "
                                                          "updates are cut by the stream, not on request"}
        until = body.get("until")
        parsed: dict[int, int] = {}
        if not isinstance(until, dict) or not until:
            return 400, {"error": "invalid_until", "detail": "until must be a non-empty object of "
                                                            f"'{self.cfg.samples_topic}:<partition>' -> offset"}
        for key, off in until.items():
            topic, _, part = str(key).rpartition(":")
            if topic != self.cfg.samples_topic or not part.isdigit() or isinstance(off, bool) \
                    or not isinstance(off, int) or off < 0:
                return 400, {"error": "invalid_until", "detail": f"{key!r}: {off!r} is not "
                                                                f"'{self.cfg.samples_topic}:<partition>' -> offset >= 0"}
            parsed[int(part)] = off
        for p, off in parsed.items():
            self._train_until[p] = max(self._train_until.get(p, 0), off)
        self.state.train_until = {f"{self.cfg.samples_topic}:{p}": o for p, o in sorted(self._train_until.items())}
        return 202, {"until": self.state.train_until}

    def _barrier_head(self, buffer: list, positions: dict[int, int]) -> list | None:
        """Barrier batching: the entries of ``buffer`` below the requested offsets once the
        consumer has read up to every one of them (``positions``: partition -> next offset to
        read), else None (wait). Entries of the requested partitions at or past the offsets,
        and of other partitions, stay buffered."""
        pending = dict(self._train_until)
        if not pending or any(positions.get(p, 0) < off for p, off in pending.items()):
            return None
        return [e for e in buffer if e[0] in pending and e[1] < pending[e[0]]]

    def _barrier_done(self, trained: dict[int, int]) -> None:
        """The offsets ``trained`` (partition -> offset) were trained: forget the requests they
        cover (one that asked further while the update ran stays)."""
        for p, off in trained.items():
            if self._train_until.get(p, 0) <= off:
                self._train_until.pop(p, None)
        self.state.train_until = {f"{self.cfg.samples_topic}:{p}": o for p, o in sorted(self._train_until.items())}

    async def _serve(self) -> None:
        if self.world > 1:  # the group's rendezvous (rank 0 serves its store) before anything else
            await self.on_torch_thread(init_distributed)
            self.channel = ranks.CommandChannel(_STORE, readers=self.world - 1)
        try:
            await self._serve_samples()
        finally:
            if self.channel is not None:
                with contextlib.suppress(Exception):  # a follower that is gone needs no stop
                    self.channel.send({"op": "stop"})

    async def _serve_samples(self) -> None:
        from transformers import AutoTokenizer

        from spanrl.schemas.codec import SchemaError, decode

        await self._retry("resume", self.resume)
        await self.on_torch_thread(self.load_policy)
        # an adapter checkpoint has no tokenizer files: the base model's (the same for full weights)
        tok = AutoTokenizer.from_pretrained(str(self.base_dir if self.adapter else self.model_dir))
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        consumer, tps = await self._retry("open samples consumer", self.open_consumer)
        try:
            sources = await self._retry("seek samples", lambda: self.seek_start(consumer, tps))
            self.emit({"event": "start", "run": self.run, "version": self.state.version, "ranks": self.world,
                       "offsets": dict(self.state.trained_offsets), "from": sources,
                       "model_dir": str(self.model_dir), "adapter": self.adapter,
                       "zero_stage": self.cfg.zero_stage, "parameters": parameter_count(self.engine.module),
                       "trainable_parameters": parameter_count(self.engine.module, trainable_only=True)})
            # the embedding's rows: a token id at or past them (another model's sample) is skipped
            vocab = self.engine.module.get_input_embeddings().num_embeddings
            buffer: list[tuple[int, int, dict | None]] = []  # (partition, offset, sample or None if bad)
            last_arrival = time.monotonic()
            good = 0  # decodable samples in the buffer
            while not self._stop.is_set():
                room = fetch_limit(self.cfg.batching, good, self.cfg.min_batch, self.cfg.max_batch)
                batch = await consumer.getmany(timeout_ms=500, max_records=room) if room else {}
                for tp, msgs in batch.items():
                    for m in msgs:
                        last_arrival = time.monotonic()
                        try:
                            s = decode("sample", m.value)
                            batching.check_sample(s, self.cfg.max_tokens, vocab)
                        except (SchemaError, batching.BadSample) as exc:
                            reason = getattr(exc, "reason", "schema_error")
                            self.state.skipped[reason] = self.state.skipped.get(reason, 0) + 1
                            log.warning("skipping sample at %s:%d:%d: %s", tp.topic, tp.partition, m.offset, exc)
                            s = None
                        buffer.append((tp.partition, m.offset, s))
                        good += s is not None
                self.state.buffered = good
                if self.cfg.batching == "barrier" or (self.cfg.batching == "groups" and self._train_until):
                    # at a barrier, or a driver's request in groups batching (served before the count rule)
                    positions = {p: await consumer.position(tp) for p, tp in tps.items()}
                    asked = dict(self._train_until)
                    head = self._barrier_head(buffer, positions)
                    if head is None:
                        continue
                    taken = {(p, off) for p, off, _ in head}
                    buffer = [e for e in buffer if (e[0], e[1]) not in taken]
                    good = sum(1 for _, _, s in buffer if s is not None)
                    if head:
                        await self._train(head, pad_id, publish_empty=True)
                    self._barrier_done(asked)
                elif self.cfg.batching == "groups":  # update_groups complete groups, each whole
                    cut = batching.group_cut([s for _, _, s in buffer], self.cfg.update_groups)
                    if cut is None:
                        continue
                    head, buffer = buffer[:cut], buffer[cut:]
                    good = sum(1 for _, _, s in buffer if s is not None)
                    await self._train(head, pad_id)
                else:
                    idle = time.monotonic() - last_arrival >= self.cfg.idle_flush_s
                    if not (good >= self.cfg.min_batch or (good > 0 and idle)):
                        continue
                    buffer = await self._update(buffer, pad_id)
                    good = sum(1 for _, _, s in buffer if s is not None)
                if self.cfg.max_updates and self.state.updates >= self.cfg.max_updates:
                    break
        finally:
            await consumer.stop()
            if self._dead_producer is not None:
                await self._dead_producer.stop()
                self._dead_producer = None

    def load_policy(self) -> None:
        """The engine over the weights of ``model_dir`` and, with ``kl_coef`` > 0, the reference
        policy. Full fine-tuning: the model of ``model_dir`` (the base or a full checkpoint) and,
        as reference, the base weights loaded once more, frozen (:func:`load_reference_model`).
        LoRA: the base model of ``base_dir`` with this trainer's adapter (``model_dir`` an adapter
        checkpoint: its weights; the base dir: a fresh adapter) and, as reference, the same model
        with the adapter disabled (``lora.AdapterDisabled``: no second copy). Raises ValueError
        when the checkpoint of ``model_dir`` does not fit the settings: an adapter of another
        base, rank, alpha or target modules, an adapter without ``lora_rank``, full weights with
        it, or a ``base_dir`` that is itself a checkpoint."""
        if self.channel is not None:  # every rank builds the same engine (deepspeed.initialize is collective)
            self.channel.send({"op": "load", "model_dir": str(self.model_dir)})
        manifest = None if self.model_dir == self.base_dir else lora.manifest_of(self.model_dir)
        if lora.is_adapter(manifest) and self.adapter is None:
            raise ValueError(f"{self.model_dir} is a LoRA adapter checkpoint: set SPANRL_TRAINER_LORA_RANK "
                             f"({manifest['adapter']['rank']}) to go on training it")
        if self.adapter is None:
            model = load_model(self.model_dir, self.cfg.activation_checkpointing)
        elif manifest is not None and not lora.is_adapter(manifest):
            raise ValueError(f"{self.model_dir} holds full weights; LoRA trains adapters of the base model "
                             f"{self.base_dir} (SPANRL_TRAINER_LORA_RANK=0 goes on from full weights)")
        else:
            base_id = base_model_id(self.base_dir)
            # a new adapter is made for the base it is given; one resumed must name that base and fit the settings
            problem = lora.base_problem(manifest or {"base_model": base_id}, self.base_dir, base_id)
            if manifest is not None:
                problem = problem or lora.spec_difference(manifest, self.adapter)
            if problem:
                raise ValueError(f"cannot train LoRA from {self.model_dir}: {problem}")
            model = load_model(self.base_dir, self.cfg.activation_checkpointing, adapter=self.adapter,
                               adapter_dir=self.model_dir if manifest else None)
        self.engine = build_engine(model, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
                                   micro_batch=self.cfg.micro_batch, grad_clip=self.cfg.grad_clip,
                                   zero_stage=self.cfg.zero_stage)
        if self.cfg.kl_coef <= 0:
            return
        if self.adapter is not None:  # the reference policy: the base weights under the adapter
            self.ref_model = lora.AdapterDisabled(self.engine.module)
            self.emit({"event": "reference_model", "run": self.run, "model_dir": str(self.base_dir),
                       "adapter_disabled": True, "bytes": 0})
            return
        self.ref_model = load_reference_model(self.base_dir)  # the base weights, frozen
        self.emit({"event": "reference_model", "run": self.run, "model_dir": str(self.base_dir),
                   "parameters": sum(p.numel() for p in self.ref_model.parameters()),
                   "bytes": sum(p.numel() * p.element_size() for p in self.ref_model.parameters())})

    async def _update(self, buffer: list, pad_id: int) -> list:
        """Train on a prefix of ``buffer`` holding up to max_batch good samples; return the rest."""
        taken, good = 0, 0
        for _, _, s in buffer:
            if s is not None and good == self.cfg.max_batch:
                break
            taken += 1
            good += s is not None
        head, rest = buffer[:taken], buffer[taken:]
        await self._train(head, pad_id)
        return rest

    async def _train(self, head: list, pad_id: int, publish_empty: bool = False) -> None:
        """One update on the good samples of ``head`` (``(partition, offset, sample or None)``)
        under the staleness rule; the trained offsets advance past all of ``head``. With
        ``publish_empty`` (barrier batching) a checkpoint is published even when no step was
        taken (every sample stale or of a zero-variance group), so every request ends in a
        version that records its offsets."""
        samples, lags, kept = await self._bound_staleness(head)
        trained_version = self.state.version
        if samples:
            options = dict(**asdict(UpdateConfig.of(self.cfg, stale_kept=kept)), pad_token_id=pad_id,
                           temperature=self.settings.rollout_temperature)
            if self.channel is not None:  # the batch is fixed now; every rank trains its share of it
                self.channel.send({"op": "update", "samples": samples, "options": options})
            # returns once every rank has stepped (train_update's last collective)
            self.state.in_update = True
            try:
                metrics = await self.on_torch_thread(train_update, self.engine, samples, ref_model=self.ref_model,
                                                        self_imitation=self.self_imitation, **options)
            finally:
                self.state.in_update = False
        # the trained offsets (what /status says was trained, and the next manifest) advance only
        # once the update is done: readers of /status wait on them (the main job's iteration)
        before = dict(self.state.trained_offsets)
        for p, off, _ in head:
            key = f"{self.cfg.samples_topic}:{p}"
            self.state.trained_offsets[key] = max(self.state.trained_offsets.get(key, 0), off + 1)
        if not samples:  # every sample was stale: consumed (in the next checkpoint's ranges), no update
            if publish_empty:
                await self.publish()
            return
        hist = staleness.lag_histogram(lags)
        for acc in (self.state.staleness, self._since_parent):
            acc["lag_histogram"] = staleness.add_histograms(acc["lag_histogram"], hist)
            acc["kept"] += kept
        metrics = {**metrics, "max_lag": max(lags), "mean_lag": sum(lags) / len(lags)}
        self.state.step += metrics["steps"]
        self.state.updates += 1
        if self.self_imitation is not None:  # what the buffer holds now (in memory: not in checkpoints)
            self.state.self_imitation_samples = len(self.self_imitation)
        add_merge_counts(self.state.prefix_merge, metrics)
        self.state.last_metrics = metrics
        try:  # x axis: the optimizer step (continues across restarts: it is in the manifest)
            self.tracker.log(tracking.update_scalars(metrics, samples, trained_version), self.state.step)
        except Exception as exc:  # noqa: BLE001 - tracking never stops training
            log.warning("tracker failed to log update %d: %s", self.state.updates, exc)
        self.emit({"event": "update", "run": self.run, "update": self.state.updates, "step": self.state.step,
                   "version": self.state.version, **{k: round(v, 6) if isinstance(v, float) else v
                                                     for k, v in metrics.items()},
                   "rollout_temperature": self.settings.rollout_temperature,  # the log-probs' (None: raw logits)
                   "offsets": dict(self.state.trained_offsets),
                   "heap": heap.malloc_totals(),  # what malloc holds after the update (spanrl/core/heap.py)
                   "consumed": checkpoint.consumed_ranges(before, self.state.trained_offsets),
                   "skipped": dict(self.state.skipped)})
        if self.state.updates % self.cfg.checkpoint_every == 0 or publish_empty:
            await self.publish()

    async def _bound_staleness(self, head: list) -> tuple[list[dict], list[int], int]:
        """The samples of ``head`` (``(partition, offset, sample or None)``) to train under the
        staleness rule at the current version, their lags, and how many of them are kept
        beyond the bound; each refused one is dead-lettered ``stale_sample`` (with its lag
        and source offset) and counted. A dead letter may be written again after a crash
        (the samples since the last checkpoint are read again); its source offset tells."""
        train, lags, kept = [], [], 0
        for p, off, s in head:
            if s is None:
                continue
            lag = staleness.version_lag(self.state.version, s["transition"]["policy_version"])
            verdict = staleness.judge(lag, self.staleness_rule)
            if verdict == staleness.REFUSED:
                await self._dead_letter_stale(p, off, s, lag)
                continue
            kept += verdict == staleness.KEPT
            train.append(s)
            lags.append(lag)
        return train, lags, kept

    async def _dead_letter_stale(self, partition: int, offset: int, sample: dict, lag: int) -> None:
        """The ``stale_sample`` dead letter of a refused sample, sent (:meth:`_send_dead_letter`,
        retried until Kafka acked it), then counted in ``/status`` and the update's figures."""
        from spanrl.core import dead_letters as dl

        t = sample["transition"]
        record = dl.dead_letter(
            dl.STALE_SAMPLE, dl.TRAINER, int(time.time() * 1000), rollout_id=t["rollout_id"], task_id=t["task_id"],
            source_topic=self.cfg.samples_topic, source_partition=partition, source_offset=offset,
            detail=f"lag {lag} > max_staleness {self.cfg.max_staleness}: behaviour version {t['policy_version']}, "
                   f"trained version {self.state.version} (run {self.run}); span {t['span_id']}")
        await self._retry(f"dead-letter stale sample {partition}:{offset}",
                          lambda: self._send_dead_letter(t["rollout_id"], record))
        for acc in (self.state.staleness, self._since_parent):
            acc["refused"] += 1
        self.emit({"event": "stale_sample", "run": self.run, "partition": partition, "offset": offset, "lag": lag,
                   "behaviour_version": t["policy_version"], "version": self.state.version})

    async def _send_dead_letter(self, rollout_id: str, record: dict) -> None:
        """One dead letter (decoded dead_letter.v1) to the dead-letter topic, keyed by rollout id,
        acked by Kafka (idempotent producer; a failed send drops the producer for the retry)."""
        from aiokafka import AIOKafkaProducer

        from spanrl.schemas.codec import encode

        if self._dead_producer is None:
            producer = AIOKafkaProducer(bootstrap_servers=self.settings.kafka_bootstrap, enable_idempotence=True)
            await producer.start()
            self._dead_producer = producer
        try:
            await asyncio.wait_for(self._dead_producer.send_and_wait(
                self.cfg.dead_letter_topic, encode("dead_letter", record), key=rollout_id.encode()), 60)
        except BaseException:
            producer, self._dead_producer = self._dead_producer, None  # a fresh one for the retry
            await producer.stop()
            raise

    def follow(self) -> None:
        """Rank > 0 of an N-rank trainer: join the group, then do what rank 0 says (trainer/ranks.py)
        until it says stop or is gone: ``load`` (build the engine over ``model_dir``, as rank 0
        does: :meth:`load_policy`), ``update`` (:func:`train_update` on the batch rank 0 fixed,
        with this rank's own reference model and self-imitation buffer, which evolve as rank 0's),
        ``gather`` (ZeRO-3: its partition of the weights for rank 0's checkpoint), ``stop``. Raises :class:`ranks.ChannelClosed` when rank 0's store goes away, ValueError
        for a command it does not know."""
        init_distributed()
        channel = ranks.CommandChannel(_STORE)
        while True:
            command = channel.receive()
            op = command["op"]
            if op == "stop":
                return
            if op == "load":
                self.model_dir = Path(command["model_dir"])
                if not self.model_dir.exists():
                    raise ValueError(f"rank {self.rank}: {self.model_dir} does not exist here; the ranks of one "
                                     "trainer share its cache directory (SPANRL_CACHE_DIR)")
                self.load_policy()
            elif op == "update":
                train_update(self.engine, command["samples"], ref_model=self.ref_model,
                             self_imitation=self.self_imitation, **command["options"])
            elif op == "gather":  # ZeRO-3: rank 0 writes a checkpoint from every rank's partition
                gathered_state_dict(self.engine)
            else:
                raise ValueError(f"rank {self.rank}: unknown command {op!r}")

    def status(self) -> dict:
        return asdict(self.state)

    def stop(self) -> None:
        self._stop.set()


# ---- HTTP /health and /status ---------------------------------------------------------

def http_app(status_fn, routes: dict | None = None, post_routes: dict | None = None, metrics_fn=None,
             credentials=None, max_body_bytes: int = 1 << 20):
    """The aiohttp app of the trainer and the reloader (:func:`start_http` serves it): GET /health -> {"ok": true}, GET /status -> status_fn(),
    GET /metrics -> the Prometheus families ``metrics_fn()`` returns, in the text format
    (spanrl.core.metrics),
    GET PATH -> ``await routes[PATH]()`` (a JSON-able dict) for each extra route, and
    POST PATH -> ``await post_routes[PATH](body)`` -> ``(http status, JSON-able dict)`` with
    the request's JSON object as ``body`` (a body that is not a JSON object: 400 invalid_json;
    over ``max_body_bytes``: 413 too_large).
    ``credentials`` (spanrl/core/edge.py ``Credentials``; None: open): every route but
    ``/health`` needs the agent or administrator token, ``/admin/*`` the administrator's;
    a refusal (401 / 403 with a JSON reason) is answered before the body is read."""
    from aiohttp import web

    from spanrl.core.edge import authorize, www_authenticate

    @web.middleware
    async def auth(request, handler):
        header = request.headers.get("Authorization")
        refusal = authorize(credentials, request.method, request.path,
                            header.encode("latin-1") if header is not None else None)
        if refusal is None:
            return await handler(request)
        status, reason, detail = refusal
        headers = {"WWW-Authenticate": www_authenticate(reason)} if status == 401 else None
        return web.json_response({"error": reason, "detail": detail}, status=status, headers=headers)

    async def health(_):
        return web.json_response({"ok": True})

    async def status(_):
        return web.json_response(status_fn())

    def handler(fn):
        async def h(_):
            return web.json_response(await fn())
        return h

    def post_handler(fn):
        async def h(request):
            if (request.content_length or 0) > max_body_bytes:
                return web.json_response({"error": "too_large", "detail": f"the body is over {max_body_bytes} bytes"},
                                         status=413)
            try:
                body = await request.json() if request.can_read_body else {}
            except ValueError as exc:
                body = exc
            if not isinstance(body, dict):
                return web.json_response({"error": "invalid_json", "detail": "the body must be a JSON object"},
                                         status=400)
            code, answer = await fn(body)
            return web.json_response(answer, status=code)
        return h

    async def metrics(_):
        from spanrl.core import metrics as prom

        body = prom.exposition(prom.registry(metrics_fn))
        return web.Response(body=body, headers={"Content-Type": prom.CONTENT_TYPE})

    app = web.Application(middlewares=[auth], client_max_size=max_body_bytes)
    app.router.add_get("/health", health)
    app.router.add_get("/status", status)
    if metrics_fn is not None:
        app.router.add_get("/metrics", metrics)
    for path, fn in (routes or {}).items():
        app.router.add_get(path, handler(fn))
    for path, fn in (post_routes or {}).items():
        app.router.add_post(path, post_handler(fn))
    return app


async def start_http(host: str, port: int, status_fn, **app_kw):
    """:func:`http_app` (``app_kw``: its keyword arguments) served on ``host:port`` from the
    running loop; returns the runner (``await runner.cleanup()`` stops it)."""
    from aiohttp import web

    app = http_app(status_fn, **app_kw)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def launch_ranks(n: int, args: list[str]) -> None:
    """Replace this process by DeepSpeed's launcher running ``n`` ranks of the trainer with
    ``args`` (trainer/ranks.py): the same pid, so whoever started the trainer holds the group;
    rank 0's rendezvous on ``MASTER_ADDR`` (:func:`rendezvous_bind_address`: loopback unless
    set) at a free port; ``OMP_NUM_THREADS`` split between the ranks. Does not return."""
    host = rendezvous_bind_address(env.env_value("MASTER_ADDR"))
    env.set_env("OMP_NUM_THREADS", str(ranks.threads_per_rank(int(env.env_value("OMP_NUM_THREADS", "2")), n)))
    argv = ranks.launch_argv(sys.executable, n, ranks.free_port(host), "spanrl.trainer.train", args, master_addr=host)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, argv)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="spanrl trainer: samples -> DeepSpeed -> checkpoints")
    ap.add_argument("--run", help="run name (default SPANRL_TRAINER_RUN or SPANRL_RUN)")
    ap.add_argument("--base-dir", type=Path, help="base model dir (default settings.model_dir)")
    ap.add_argument("--max-updates", type=int)
    ap.add_argument("--deepspeed-config", action="store_true",
                    help="print the DeepSpeed config the trainer's settings give (JSON) and exit")
    ap.add_argument("--gpu", action="store_true", help="with --deepspeed-config: the GPU config (bf16, FusedAdam)")
    args = ap.parse_args(argv)
    check_environment()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = {k: v for k, v in {"run": args.run, "base_dir": args.base_dir,
                                   "max_updates": args.max_updates}.items() if v is not None}
    cfg = TrainerConfig(**overrides)
    # samples of a schema id this checkout does not know (a newer writer's): ask the registry
    schema_registry.install(get_settings().schema_registry_url)
    if args.deepspeed_config:
        print(json.dumps(deepspeed_config(cfg.micro_batch, cfg.grad_clip, cfg.lr, cfg.weight_decay,
                                          gpu=args.gpu or None, zero_stage=cfg.zero_stage), indent=2))
        return
    if cfg.ranks > 1 and env.env_value("RANK") is None:  # this process becomes DeepSpeed's launcher
        launch_ranks(cfg.ranks, sys.argv[1:] if argv is None else argv)
    trainer = Trainer(cfg)
    if trainer.rank > 0:
        # the group stops when rank 0 says so (it finishes its update and checkpoint first), or dies with it
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        try:
            trainer.follow()
        except ranks.ChannelClosed as exc:
            log.error("rank %d: %s", trainer.rank, exc)
            sys.exit(1)
        return

    async def run() -> None:
        # SIGTERM/SIGINT: finish the update in hand (and its checkpoint, unless MinIO/Kafka
        # are down: a pending retry ends), then exit; unpublished work is redone on restart
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, trainer.stop)
        await trainer.serve()

    asyncio.run(run())


if __name__ == "__main__":
    main()
