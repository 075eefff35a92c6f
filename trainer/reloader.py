"""The reloader service: checkpoints topic -> verified download -> vLLM reloads in place -> proxy told.

For each CheckpointAnnouncement of its run (newer than what vLLM serves):
1. download ``s3://BUCKET/RUN/VERSION/`` into ``cache_dir/checkpoints/RUN/VERSION:06d``
   and verify every sha256 of the manifest, the trainer's signature of the manifest
   (``manifest.sig``, HMAC-SHA256 under ``state_dir/secrets/checkpoint_key``, which only the
   trainer and the reloader read: a writer of the bucket cannot forge it), and the
   manifest's own sha256 against the announcement. On any mismatch: log with a reason code
   (``checkpoint.CheckpointError.reason``: ``unsigned``, ``bad_signature``,
   ``sha256_mismatch``, ...), record ``verified: false`` and the ``reason``, touch nothing
   in vLLM (it keeps serving the old version).
2. reload vLLM in place (dev-mode endpoints of vllm 0.32, verified in
   vllm/entrypoints/rl/online/api_router.py and serve/dev/{rpc,cache}/api_router.py):
   ``POST /pause?mode=wait`` -> ``POST /collective_rpc {"method": "reload_weights",
   "kwargs": {"weights_path": DIR}}`` -> ``POST /reset_prefix_cache`` -> ``POST /resume``
   (resume is sent even when the reload fails). DIR must exist on vLLM's filesystem: a
   missing path kills the engine, hence the verification first.
3. ``POST {proxy}/admin/policy_version {"version", "checkpoint"}`` (connection errors warn).

LoRA adapters (trainer/lora.py): a checkpoint whose manifest has ``adapter`` holds only the
adapter; it is verified like any other and refused (``lora.BaseModelMismatch``) unless it was
trained on the base model vLLM serves (``settings.model_dir``, its id by
``train.base_model_id``). vLLM reloads full weights from a directory, so the adapter is merged
into the base (``lora.merge_adapter_dir``: ``W + (alpha / r) B A`` in the base's own file
layout) into ``<checkpoint dir>.merged``, which vLLM loads; merged copies not served (nor the
target's) are deleted after each reload.

Crash safety
- Downloads that fail because MinIO is unreachable (or answers 5xx) are retried with
  backoff (``checkpoint.retry``) until they succeed; a checkpoint that does not verify
  is refused at once and never loaded.
- The reloader keeps a *target* (the newest verified checkpoint; version 0 = the base
  model) and polls vLLM's ``/health`` every ``watch_interval_s``. When vLLM becomes
  unreachable it tells the proxy ``POST /admin/policy_unsynced`` (a restarted vLLM serves
  the base weights, so the proxy's version label would be false); when vLLM is back, it
  reloads the target and posts its version to the proxy again (version 0 too). A failed
  reload is retried the same way, with backoff, and leaves the proxy unsynced.
- ``GET /policy`` answers ``{"version", "checkpoint", "synced"}`` after checking vLLM's
  health now: what the proxy adopts at start-up or after a vLLM transport error.

Release gate (``SPANRL_RELOADER_GATE=true``, off by default; trainer/gate.py): a verified
checkpoint is loaded and evaluated greedily on held-out tasks against the incumbent and
stays served only when it is not worse beyond ``gate_tolerance`` with 95% confidence;
else the incumbent is reloaded. The decision goes to ``RUN/VERSION/gate.json`` beside the
manifest, the history (``/status``) and the ``checkpoints`` topic (event served | refused).
The trainer is not told: it goes on from its own latest weights.

Evaluation pins: ``POST /admin/pin {"run", "version"}`` makes vLLM serve another verified
checkpoint (version 0: the base model) until ``POST /admin/unpin``; announcements that arrive
meanwhile are verified and become the target, which the unpin applies. ``spanrl eval``
uses this to evaluate any ``RUN:VERSION`` and restore what was served.

Run: ``python -m spanrl.trainer.reloader --run NAME``; ``/health``, ``/status`` and ``/policy``
on reloader_port.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
from spanrl.core import plugins
from spanrl.core.edge import service_credentials
from spanrl.core.partitions import topic_partitions
from spanrl.core.settings import ReloaderConfig, check_environment, get_settings
from spanrl.trainer import checkpoint, lora, tracking
from spanrl.trainer.gate import GateEvaluation
from spanrl.trainer.train import base_model_id, read_announcements, start_http

log = logging.getLogger("spanrl.reloader")


class CheckpointNotFound(LookupError):
    """No published checkpoint (manifest) at the asked run and version."""


def vllm_watch_action(up: bool, synced: bool, now: float, next_apply_at: float) -> str:
    """What the reloader does after one vLLM health poll.

    ``up``: vLLM answered /health; ``synced``: vLLM is known to serve the target since the
    last successful reload (no outage seen since); ``next_apply_at``: earliest time
    (same clock as ``now``) for the next reload attempt after a failed one.
    Returns "lost" (was synced, now unreachable: tell the proxy its label is no longer
    true), "down" (still unreachable), "apply" (reachable but not synced: reload the
    target and post its version), "backoff" (same, but the last attempt failed recently)
    or "ok".
    """
    if not up:
        return "lost" if synced else "down"
    if synced:
        return "ok"
    return "apply" if now >= next_apply_at else "backoff"


class Reloader:
    def __init__(self, cfg: ReloaderConfig, settings=None, gate_evaluation: GateEvaluation | None = None):
        """``gate_evaluation``: the release gate's evaluation; None: the one
        ``cfg.gate_evaluation`` names, resolved when the gate first runs."""
        self.cfg = cfg
        self.gate_evaluation = gate_evaluation
        self.settings = settings or get_settings()
        self.run = cfg.run or self.settings.run
        self.vllm_url = (cfg.vllm_url or self.settings.vllm_url).rstrip("/")
        self.proxy_url = (cfg.proxy_url or self.settings.proxy_url).rstrip("/")
        self.minio = checkpoint.make_client(self.settings)
        self.served_version = 0  # what vLLM got from the last successful reload
        self.served_dir: str | None = None
        self.served_weights_dir: str | None = None  # what vLLM loaded: served_dir, or its merged copy (LoRA)
        self.served_uri = ""
        # the newest verified checkpoint vLLM should serve (version 0: the base model)
        self.target = {"version": 0, "dir": str(self.settings.model_dir), "uri": ""}
        self.vllm_synced = False  # vLLM serves `want()` and no outage was seen since
        #: a checkpoint served instead of the target until unpinned (``spanrl eval``, the gate)
        self.pinned: dict | None = None
        #: release gate: per-task rewards of each evaluated checkpoint uri ("" = base model)
        self._gate_cache: dict[str, dict[str, float]] = {}
        self.history: list[dict] = []
        self.handled = 0
        self._lock = asyncio.Lock()  # one vLLM reload / proxy notification sequence at a time
        self._stop = asyncio.Event()
        self._apply_failures = 0
        self._next_apply_at = 0.0

    def want(self) -> dict:
        """What vLLM should serve now: the pinned checkpoint, else the target."""
        return self.pinned or self.target

    def status(self) -> dict:
        return {"run": self.run, "served_version": self.served_version, "served_dir": self.served_dir,
                "served_weights_dir": self.served_weights_dir, "served_uri": self.served_uri,
                "target_version": self.target["version"], "vllm_synced": self.vllm_synced,
                "pinned": None if self.pinned is None else {k: self.pinned[k] for k in ("run", "version", "uri")},
                "history": self.history[-50:]}

    def stop(self) -> None:
        self._stop.set()

    async def policy(self) -> dict:
        """``{"version", "checkpoint", "synced"}``: what vLLM serves; ``synced`` only when a
        reload is not under way, the last one succeeded and vLLM answers /health now."""
        synced = (not self._lock.locked() and self.vllm_synced and self.served_version == self.want()["version"]
                  and self.served_uri == self.want()["uri"] and await vllm_healthy(self.vllm_url))
        return {"version": self.served_version, "checkpoint": self.served_uri, "synced": synced}

    # one announcement -----------------------------------------------------------------
    def _download_verified(self, ann: dict, dest: Path) -> None:
        """Download + verify (raises CheckpointError on any mismatch, MinIO errors as is)."""
        version = int(ann["version"])
        manifest = checkpoint.download_checkpoint(self.minio, ann["uri"], dest)
        self._check_signature(dest)
        actual = checkpoint.manifest_sha256(dest)
        if actual != ann["manifest_sha256"]:
            raise checkpoint.CheckpointError(f"manifest sha256 {actual} != announced {ann['manifest_sha256']}")
        if manifest["version"] != version or manifest["run"] != self.run:
            raise checkpoint.CheckpointError(
                f"manifest is {manifest['run']}/{manifest['version']}, announced {self.run}/{version}")
        self._check_servable(manifest, dest)

    def _check_signature(self, ckpt_dir: Path) -> None:
        """Raise CheckpointError unless ``ckpt_dir`` carries the trainer's signature under the
        stack's key (``checkpoint.verify_signature``: ``unsigned``, ``bad_signature``,
        ``unlisted_file``). Without a key: refused with auth on (``no_signing_key``); open mode
        serves it unsigned, with a warning."""
        key = self.settings.checkpoint_key()
        if key is not None:
            checkpoint.verify_signature(ckpt_dir, key)
        elif self.settings.auth == "on":
            raise checkpoint.CheckpointError(f"no checkpoint key in {self.settings.state_dir}/secrets: nothing can be "
                                             "verified (start the stack once to make it)", "no_signing_key")
        else:
            log.warning("SPANRL_AUTH=open and no checkpoint key: %s is served unsigned", ckpt_dir)

    def _check_servable(self, manifest: dict, ckpt_dir: Path) -> None:
        """Raise CheckpointError unless verified checkpoint ``ckpt_dir`` can be served: full weights
        (config.json and ``*.safetensors``), or an adapter (its weights and config) of the base
        model vLLM serves (:class:`lora.BaseModelMismatch` otherwise: never merged, never loaded)."""
        if not lora.is_adapter(manifest):
            if not (ckpt_dir / "config.json").is_file() or not any(ckpt_dir.glob("*.safetensors")):
                raise checkpoint.CheckpointError(f"{ckpt_dir}: no config.json or *.safetensors")
            return
        lora.check_adapter_files(ckpt_dir)
        problem = lora.base_problem(manifest, self.settings.model_dir, base_model_id(self.settings.model_dir))
        if problem:
            raise lora.BaseModelMismatch(problem)

    def _weights_dir(self, ckpt_dir: str, entry: dict) -> Path:
        """The directory vLLM reloads for checkpoint ``ckpt_dir``: the directory itself (full
        weights, the base model), or for an adapter its merge into the base model
        (:func:`lora.merged_dir`; made by :func:`lora.merge_adapter_dir` unless it is current;
        ``entry`` gets ``merged`` and ``merge_s``)."""
        ckpt = Path(ckpt_dir)
        if not lora.is_adapter(lora.manifest_of(ckpt)):
            return ckpt
        out = lora.merged_dir(ckpt)
        t0 = time.perf_counter()
        if not lora.merged_is_current(out, self.settings.model_dir, ckpt):
            lora.merge_adapter_dir(self.settings.model_dir, ckpt, out)
        entry["merged"], entry["merge_s"] = str(out), round(time.perf_counter() - t0, 3)
        return out

    async def fetch(self, ann: dict, entry: dict | None = None) -> Path:
        """The verified local directory of announcement ``ann``. MinIO outages are retried
        with backoff until MinIO answers (or :meth:`stop`: :class:`checkpoint.Stopped`);
        a checkpoint that does not verify raises CheckpointError at once (its partial
        directory removed: never leave an unverified dir vLLM could load)."""
        dest = self.settings.cache_dir / "checkpoints" / self.run / f"{int(ann['version']):06d}"

        def on_retry(attempt: int, delay: float, exc: BaseException) -> None:
            if entry is not None:
                entry["retries"] = attempt
                entry["error"] = f"retrying: {type(exc).__name__}: {exc}"[:500]

        try:
            await checkpoint.retry(lambda: asyncio.to_thread(self._download_verified, ann, dest),
                                   what=f"download {ann['uri']}", stop=self._stop, on_retry=on_retry)
        except Exception:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return dest

    async def handle(self, ann: dict) -> bool:
        """Verify and load one announcement; True when vLLM now serves it."""
        version, uri = int(ann["version"]), ann["uri"]
        entry = {"version": version, "uri": uri, "verified": False, "reloaded": False, "reload_s": None,
                 "error": None, "at_ms": int(time.time() * 1000)}
        self.history.append(entry)
        try:
            dest = await self.fetch(ann, entry)
        except checkpoint.Stopped:
            raise
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["reason"] = getattr(exc, "reason", None) or type(exc).__name__
            log.error("refusing checkpoint %s v%d (%s): %s; vLLM keeps serving v%d", uri, version, entry["reason"],
                      exc, self.served_version)
            return False
        entry["verified"], entry["error"] = True, None
        if self.cfg.gate:
            return await self.gated_load(ann, dest, entry)
        return await self.load(version, dest, uri, entry)

    # release gate ---------------------------------------------------------------------
    async def _gate_rewards(self, label: str) -> dict[str, float]:
        """Per-task reward of what vLLM serves now on the gate's tasks: the gate's evaluation
        (``gate_evaluation``, trainer/gate.py ``GateEvaluation``; by default the control
        plane's evaluator runs the agent greedily through the proxy's evaluation routes,
        recorded on the evaluation topics)."""
        evaluate = self.gate_evaluation or plugins.resolve(self.cfg.gate_evaluation)
        return await evaluate(self.cfg, self.settings, f"gate-{self.run}-{label}")

    async def gated_load(self, ann: dict, dest: Path, entry: dict) -> bool:
        """Serve verified checkpoint ``ann`` only if the release gate accepts it
        (trainer/gate.py): the incumbent's gate rewards (cached per checkpoint), then the
        candidate loaded into vLLM and evaluated on the same tasks; accepted -> it stays
        and becomes the target; refused -> the incumbent is reloaded. The decision is
        written beside the manifest (``RUN/VERSION/gate.json``), into the history and as a
        ``checkpoints`` record (event served | refused). True when vLLM now serves it."""
        from spanrl.trainer.gate import gate_decision

        version, uri = int(ann["version"]), ann["uri"]
        while self.pinned is not None and not self._stop.is_set():  # an evaluation holds vLLM
            await asyncio.sleep(1.0)
        incumbent = dict(self.target)
        t0 = time.perf_counter()
        if incumbent["uri"] not in self._gate_cache:
            self._gate_cache[incumbent["uri"]] = await self._gate_rewards(f"v{incumbent['version']}")
        async with self._lock:
            self.pinned = {"run": self.run, "version": version, "dir": str(dest), "uri": uri}
            self._apply_failures, self._next_apply_at = 0, 0.0
            loaded = await self._apply(entry)
            if not loaded:
                self.pinned = None
                return False
        try:
            candidate = await self._gate_rewards(f"v{version}")
        except Exception as exc:  # noqa: BLE001 - an evaluation that fails refuses nothing silently
            async with self._lock:
                self.pinned = None
                entry["error"] = f"gate evaluation failed: {type(exc).__name__}: {exc}"[:500]
                await self._apply(entry)
            log.error("release gate could not evaluate v%d: %s; vLLM back on v%d", version, exc,
                      self.target["version"])
            return False
        decision = gate_decision(self._gate_cache[incumbent["uri"]], candidate, self.cfg.gate_tolerance)
        record = {"run": self.run, "version": version, "incumbent_version": incumbent["version"],
                  "incumbent_uri": incumbent["uri"], "tasks": {"task_set": self.cfg.gate_task_set,
                                                              "seed": self.cfg.gate_seed,
                                                              "offset": self.cfg.gate_offset,
                                                              "count": self.cfg.gate_tasks},
                  "decision": decision.as_dict(), "seconds": round(time.perf_counter() - t0, 1),
                  "at_ms": int(time.time() * 1000)}
        entry["gate"] = record
        await self._retry_quiet(lambda: asyncio.to_thread(checkpoint.write_gate_record, self.minio, uri, record))
        await self._retry_quiet(lambda: announce_decision(self.settings, self.cfg.checkpoints_topic, ann, record))
        async with self._lock:
            self.pinned = None
            if decision.accept:
                self.target = {"version": version, "dir": str(dest), "uri": uri}
                self._gate_cache[uri] = candidate
                log.info("release gate: v%d served (%s, reward %+.3f vs v%d)", version, decision.reason,
                         decision.difference["estimate"], incumbent["version"])
                return True
            log.warning("release gate: v%d refused (%s, reward %+.3f [%+.3f, %+.3f] vs v%d); vLLM back on v%d",
                        version, decision.reason, decision.difference["estimate"], decision.difference["low"],
                        decision.difference["high"], incumbent["version"], incumbent["version"])
            entry["refused"] = decision.reason
            restore = {"version": incumbent["version"], "uri": incumbent["uri"], "event": "gate_restore",
                       "verified": True, "reloaded": False, "reload_s": None, "error": None,
                       "at_ms": int(time.time() * 1000)}
            self.history.append(restore)
            await self._apply(restore)
            return False

    async def _retry_quiet(self, fn) -> None:
        """Retry a MinIO/Kafka write of the gate's decision with backoff until it succeeds."""
        await checkpoint.retry(fn, what="gate decision", stop=self._stop)

    async def load(self, version: int, ckpt_dir: Path, uri: str, entry: dict | None = None) -> bool:
        """Make the verified checkpoint dir ``ckpt_dir`` the target, reload it into vLLM and
        post its version to the proxy; True when vLLM now serves it (else the watch
        retries). ``entry``: the history record to fill in."""
        if entry is None:
            entry = {"version": version, "uri": uri, "verified": True, "reloaded": False, "reload_s": None,
                     "error": None, "at_ms": int(time.time() * 1000)}
            self.history.append(entry)
        async with self._lock:
            self.target = {"version": version, "dir": str(ckpt_dir), "uri": uri}
            if self.pinned is not None:  # an evaluation holds vLLM: applied on unpin
                entry["deferred"] = "pinned"
                log.info("v%d verified; vLLM stays on pinned %s until unpinned", version, self.pinned["uri"] or "base")
                return False
            self._apply_failures, self._next_apply_at = 0, 0.0
            return await self._apply(entry)

    # pinning (evaluation) -------------------------------------------------------------
    async def pin(self, run: str | None, version: int) -> dict:
        """Serve checkpoint ``run:version`` (version 0: the base model) until :meth:`unpin`.

        The checkpoint is downloaded into ``cache_dir/checkpoints/pinned/RUN/VERSION`` (deleted
        again on unpin or the next pin) and verified against its manifest, and against the announced manifest sha256 when
        ``run`` announced that version. Announcements arriving meanwhile are verified and
        become the target, applied on unpin. Returns :meth:`status`. Raises
        :class:`CheckpointNotFound` (no manifest in MinIO), ``checkpoint.CheckpointError``
        (does not verify; vLLM untouched), RuntimeError (the vLLM reload failed; the pin is
        dropped and the target re-applied by the watch)."""
        run = run or self.run
        if version < 0:
            raise CheckpointNotFound(f"version must be >= 0, got {version}")
        if version == 0:
            want = {"run": run, "version": 0, "dir": str(self.settings.model_dir), "uri": ""}
        else:
            uri = checkpoint.checkpoint_uri(self.settings.checkpoint_bucket, run, version)
            dest = self.settings.cache_dir / "checkpoints" / "pinned" / run / f"{version:06d}"
            announced = [a for a in await read_announcements(self.cfg.checkpoints_topic, run,
                                                             self.settings.kafka_bootstrap)
                         if int(a["version"]) == version]

            def download() -> None:
                try:
                    self.minio.stat_object(self.settings.checkpoint_bucket,
                                           f"{run}/{version:06d}/{checkpoint.MANIFEST}")
                except Exception as exc:  # noqa: BLE001 - NoSuchKey / NoSuchBucket
                    raise CheckpointNotFound(f"no checkpoint {run}:{version} ({uri}): {exc}") from exc
                manifest = checkpoint.download_checkpoint(self.minio, uri, dest)
                self._check_signature(dest)
                if manifest["version"] != version or manifest["run"] != run:
                    raise checkpoint.CheckpointError(
                        f"manifest is {manifest['run']}/{manifest['version']}, asked for {run}/{version}")
                self._check_servable(manifest, dest)
                actual = checkpoint.manifest_sha256(dest)
                if announced and actual != announced[-1]["manifest_sha256"]:
                    raise checkpoint.CheckpointError(
                        f"manifest sha256 {actual} != announced {announced[-1]['manifest_sha256']}")

            try:
                await asyncio.to_thread(download)
            except Exception:
                shutil.rmtree(dest, ignore_errors=True)
                raise
            want = {"run": run, "version": version, "dir": str(dest), "uri": uri}
        entry = {"version": version, "uri": want["uri"], "event": "pin", "run": run, "verified": True,
                 "reloaded": False, "reload_s": None, "error": None, "at_ms": int(time.time() * 1000)}
        self.history.append(entry)
        async with self._lock:
            previous, self.pinned = self.pinned, want
            self._apply_failures, self._next_apply_at = 0, 0.0
            if not await self._apply(entry):
                self.pinned = None
                self._drop_pinned_copy(want)
                raise RuntimeError(f"vLLM reload of {run}:{version} failed: {entry['error']}")
            if previous is not None and previous["dir"] != want["dir"]:
                self._drop_pinned_copy(previous)
        return self.status()

    def _drop_pinned_copy(self, pin: dict) -> None:
        """Delete a pin's download (never the base model's or a training run's directory):
        an evaluation copy is ~0.5 GB and pinning again downloads and verifies afresh."""
        root = (self.settings.cache_dir / "checkpoints" / "pinned").resolve()
        d = Path(pin["dir"]).resolve() if pin.get("dir") else None
        if d is not None and root in d.parents:
            shutil.rmtree(d, ignore_errors=True)
            shutil.rmtree(lora.merged_dir(d), ignore_errors=True)  # an adapter's merge, if any
            if d.parent != root and d.parent.is_dir() and not any(d.parent.iterdir()):
                d.parent.rmdir()

    async def unpin(self) -> dict:
        """Drop the pin and serve the target again (the newest verified checkpoint of the
        run). Returns :meth:`status`; a failed reload is retried by the watch."""
        async with self._lock:
            was, self.pinned = self.pinned, None
            if was is not None:
                entry = {"version": self.target["version"], "uri": self.target["uri"], "event": "unpin",
                         "verified": True, "reloaded": False, "reload_s": None, "error": None,
                         "at_ms": int(time.time() * 1000)}
                self.history.append(entry)
                self._apply_failures, self._next_apply_at = 0, 0.0
                await self._apply(entry)
                self._drop_pinned_copy(was)
        return self.status()

    async def http_pin(self, body: dict) -> tuple[int, dict]:
        """``POST /admin/pin {"run"?, "version"}``: 200 status, 400 bad body, 404
        ``unknown_checkpoint``, 409 ``checkpoint_unverified``, 503 ``reload_failed``."""
        version, run = body.get("version"), body.get("run")
        if not isinstance(version, int) or isinstance(version, bool) or (run is not None and not isinstance(run, str)):
            return 400, {"error": "bad_request", "detail": 'expected {"run": str (optional), "version": int}'}
        try:
            return 200, await self.pin(run, version)
        except CheckpointNotFound as exc:
            return 404, {"error": "unknown_checkpoint", "detail": str(exc)}
        except checkpoint.CheckpointError as exc:
            return 409, {"error": "checkpoint_unverified", "reason": exc.reason, "detail": str(exc)}
        except RuntimeError as exc:
            return 503, {"error": "reload_failed", "detail": str(exc)}

    async def http_unpin(self, _body: dict) -> tuple[int, dict]:
        """``POST /admin/unpin``: 200 status."""
        return 200, await self.unpin()

    async def _apply(self, entry: dict) -> bool:
        """Reload ``self.target`` into vLLM and post its version to the proxy (caller holds
        the lock). On failure: unsynced, proxy told so, next attempt after a backoff."""
        t = dict(self.want())
        t0 = time.perf_counter()
        try:
            weights = await asyncio.to_thread(self._weights_dir, t["dir"], entry)
            await reload_vllm(self.vllm_url, weights, pause_mode=self.cfg.pause_mode,
                              timeout_s=self.cfg.reload_timeout_s)
        except Exception as exc:
            entry["error"] = f"reload failed: {type(exc).__name__}: {exc}"
            self._next_apply_at = time.monotonic() + checkpoint.backoff_s(self._apply_failures)
            self._apply_failures += 1
            log.error("vLLM reload of v%d failed (attempt %d): %s", t["version"], self._apply_failures, exc)
            if self.vllm_synced or self._apply_failures == 1:
                await notify_proxy_unsynced(self.proxy_url, f"reload of v{t['version']} failed")
            self.vllm_synced = False
            return False
        entry["reload_s"] = round(time.perf_counter() - t0, 3)
        entry["reloaded"], entry["error"] = True, None
        self.served_version, self.served_dir, self.served_uri = t["version"], t["dir"], t["uri"]
        self.served_weights_dir = str(weights)
        self.vllm_synced = True
        if t["dir"] and Path(t["dir"]).parent.name == self.run:  # never the base model's directory
            checkpoint.prune_local(Path(t["dir"]).parent, self.cfg.keep_local, protect={Path(t["dir"])})
            # merged copies (LoRA) of what is neither served nor the target (a gate's incumbent)
            lora.prune_merged(Path(t["dir"]).parent, keep={weights, lora.merged_dir(Path(self.target["dir"]))})
        self._apply_failures, self._next_apply_at = 0, 0.0
        log.info("vLLM now serves %s v%d (reload %.2fs)", self.run, t["version"], entry["reload_s"])
        await notify_proxy(self.proxy_url, t["version"], t["uri"])
        return True

    # vLLM watch -----------------------------------------------------------------------
    async def watch_once(self) -> str:
        """One health poll of vLLM and what follows from it (:func:`vllm_watch_action`)."""
        async with self._lock:
            up = await vllm_healthy(self.vllm_url)
            action = vllm_watch_action(up, self.vllm_synced, time.monotonic(), self._next_apply_at)
            if action == "lost":
                self.vllm_synced = False
                log.warning("vLLM at %s unreachable; v%d must be reloaded when it is back", self.vllm_url,
                            self.want()["version"])
                self.history.append({"version": self.want()["version"], "event": "vllm_lost",
                                     "at_ms": int(time.time() * 1000)})
                await notify_proxy_unsynced(self.proxy_url, "vllm_unreachable")
            elif action == "apply":
                entry = {"version": self.want()["version"], "uri": self.want()["uri"], "event": "reapply",
                         "verified": True, "reloaded": False, "reload_s": None, "error": None,
                         "at_ms": int(time.time() * 1000)}
                self.history.append(entry)
                await self._apply(entry)
            return action

    async def watch_vllm(self) -> None:
        while not self._stop.is_set():
            try:
                await self.watch_once()
            except Exception:  # never let the watch die
                log.exception("vLLM watch failed")
            try:
                await asyncio.wait_for(self._stop.wait(), self.cfg.watch_interval_s)
            except asyncio.TimeoutError:
                pass

    def http_routes(self) -> dict:
        """The HTTP routes beside /health and /status (trainer/train.py ``http_app``'s keyword
        arguments): ``GET /policy``, ``POST /admin/pin``, ``POST /admin/unpin``, /metrics."""
        return {"routes": {"/policy": self.policy},
                "post_routes": {"/admin/pin": self.http_pin, "/admin/unpin": self.http_unpin},
                "metrics_fn": lambda: tracking.reloader_families(self.status(), self.history, self.handled)}

    # loop -----------------------------------------------------------------------------
    async def serve(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        from spanrl.schemas.codec import SchemaError, decode

        http = await start_http(self.settings.host, self.settings.reloader_port, self.status, **self.http_routes(),
                                credentials=service_credentials(self.settings, "reloader", log)) \
            if self.cfg.http else None
        consumer = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka_bootstrap,
                                    isolation_level="read_committed", enable_auto_commit=False, group_id=None)
        await consumer.start()
        watch: asyncio.Task | None = None
        try:
            parts = await topic_partitions(consumer, self.cfg.checkpoints_topic, wait_s=60)
            if not parts:
                raise RuntimeError(f"topic {self.cfg.checkpoints_topic!r} does not exist")
            tps = [TopicPartition(self.cfg.checkpoints_topic, p) for p in parts]
            consumer.assign(tps)
            if self.cfg.start == "end":
                await consumer.seek_to_end(*tps)
            else:
                await consumer.seek_to_beginning(*tps)
            end = await consumer.end_offsets(tps)
            backlog: list[dict] = []  # 'latest': collect up to the end offsets, keep the newest
            catching_up = self.cfg.start == "latest"
            while not self._stop.is_set():
                batch = await consumer.getmany(timeout_ms=500)
                todo: list[dict] = []
                for msgs in batch.values():
                    for m in msgs:
                        if m.key is None or m.key.decode() != self.run:
                            continue
                        try:
                            ann = decode("checkpoint", m.value)
                        except SchemaError as exc:
                            log.error("undecodable announcement at offset %d: %s", m.offset, exc)
                            continue
                        if ann.get("event", "published") != "published":
                            continue  # a release-gate decision (ours), not a new checkpoint
                        (backlog if catching_up else todo).append(ann)
                if catching_up and all([await consumer.position(tp) >= end[tp] for tp in tps]):
                    catching_up = False
                    if backlog:
                        todo.insert(0, max(backlog, key=lambda a: a["version"]))
                for ann in todo:
                    if ann["version"] < self.cfg.from_version or ann["version"] <= self.target["version"]:
                        continue
                    await self.handle(ann)
                    self.handled += 1
                    if self.cfg.max_announcements and self.handled >= self.cfg.max_announcements:
                        return
                if watch is None and not catching_up and self.cfg.watch_interval_s > 0:
                    # after the backlog: from now on keep vLLM on the target (the base
                    # model = version 0 when nothing was loaded) and the proxy told
                    watch = asyncio.create_task(self.watch_vllm())
        except checkpoint.Stopped as exc:
            log.warning("stopped: %s", exc)
        finally:
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
            await consumer.stop()
            if http is not None:
                await http.cleanup()


async def announce_decision(settings, topic: str, ann: dict, record: dict) -> None:
    """A ``checkpoints`` record of the gate's decision on announcement ``ann``: the same
    run/version/uri/manifest, ``event`` served | refused, ``detail`` the decision as JSON,
    the decision's numbers as ``metrics``."""
    import json

    from aiokafka import AIOKafkaProducer

    from spanrl.schemas.codec import encode

    d = record["decision"]
    out = {**{k: ann[k] for k in ("run", "version", "uri", "step", "parent_version", "manifest_sha256")},
           "created_ms": int(time.time() * 1000), "event": "served" if d["accept"] else "refused",
           "detail": json.dumps(record, sort_keys=True),
           "metrics": {"gate_accept": float(d["accept"]), "gate_difference": float(d["difference"]["estimate"]),
                       "gate_difference_low": float(d["difference"]["low"]),
                       "gate_difference_high": float(d["difference"]["high"]),
                       "gate_incumbent_mean": float(d["incumbent_mean"]),
                       "gate_candidate_mean": float(d["candidate_mean"]), "gate_tasks": float(d["tasks"])}}
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, enable_idempotence=True,
                                request_timeout_ms=30000)
    try:
        await producer.start()
        await asyncio.wait_for(producer.send_and_wait(topic, encode("checkpoint", out), key=ann["run"].encode()), 60)
    finally:
        await producer.stop()


async def reload_vllm(vllm_url: str, weights_dir: Path, pause_mode: str = "wait", timeout_s: float = 600.0) -> None:
    """Reload vLLM's weights in place from ``weights_dir`` (must exist where vLLM runs)."""
    weights_dir = Path(weights_dir).resolve()
    if not weights_dir.is_dir():
        raise FileNotFoundError(f"{weights_dir} does not exist; refusing to send it to vLLM")
    async with httpx.AsyncClient(base_url=vllm_url, timeout=timeout_s) as client:
        r = await client.post("/pause", params={"mode": pause_mode})
        r.raise_for_status()
        try:
            r = await client.post("/collective_rpc", json={"method": "reload_weights",
                                                           "kwargs": {"weights_path": str(weights_dir)}})
            r.raise_for_status()
            r = await client.post("/reset_prefix_cache")
            r.raise_for_status()
        finally:
            r2 = await client.post("/resume")
            r2.raise_for_status()


async def vllm_healthy(vllm_url: str, timeout_s: float = 5.0) -> bool:
    """True when vLLM answers ``GET /health`` with 200 within ``timeout_s``."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            return (await client.get(f"{vllm_url}/health")).status_code == 200
    except httpx.HTTPError:
        return False


async def notify_proxy_unsynced(proxy_url: str, reason: str) -> None:
    """``POST {proxy}/admin/policy_unsynced {"reason"}``: the proxy answers 503
    policy_unsynced until a version is posted again (unreachable proxy = warning)."""
    from spanrl.core.edge import bearer_headers  # an admin route of the proxy: the administrator token

    try:
        async with httpx.AsyncClient(timeout=10.0, headers=bearer_headers(get_settings().admin_token)) as client:
            r = await client.post(f"{proxy_url}/admin/policy_unsynced", json={"reason": reason})
            if r.status_code >= 400:
                log.warning("proxy refused policy_unsynced: %s %s", r.status_code, r.text[:200])
    except httpx.HTTPError as exc:
        log.warning("could not tell the proxy its policy version is unsynced: %s", exc)


async def notify_proxy(proxy_url: str, version: int, uri: str) -> None:
    from spanrl.core.edge import bearer_headers  # an admin route of the proxy: the administrator token

    try:
        async with httpx.AsyncClient(timeout=10.0, headers=bearer_headers(get_settings().admin_token)) as client:
            r = await client.post(f"{proxy_url}/admin/policy_version", json={"version": version, "checkpoint": uri})
            if r.status_code >= 400:
                log.warning("proxy refused policy version %d: %s %s", version, r.status_code, r.text[:200])
    except httpx.HTTPError as exc:
        log.warning("could not tell the proxy about policy version %d: %s", version, exc)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="spanrl reloader: checkpoints -> vLLM")
    ap.add_argument("--run", help="run name (default SPANRL_RELOADER_RUN or SPANRL_RUN)")
    ap.add_argument("--start", choices=["latest", "end", "beginning"])
    ap.add_argument("--from-version", type=int)
    args = ap.parse_args(argv)
    check_environment()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = {k: v for k, v in {"run": args.run, "start": args.start,
                                   "from_version": args.from_version}.items() if v is not None}
    reloader = Reloader(ReloaderConfig(**overrides))

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, reloader.stop)
        await reloader.serve()

    asyncio.run(run())


if __name__ == "__main__":
    main()
