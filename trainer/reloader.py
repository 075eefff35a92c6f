"""The reloader service: checkpoints topic -> verified download -> vLLM reloads in place -> proxy told.

For each CheckpointAnnouncement of its run (newer than what vLLM serves):
1. download ``s3://BUCKET/RUN/VERSION/`` into ``cache_dir/checkpoints/RUN/VERSION:06d``
   and verify every sha256 of the manifest, and the manifest's own sha256 against the
   announcement. On any mismatch: log, record ``verified: false``, touch nothing in
   vLLM (it keeps serving the old version).
2. reload vLLM in place (dev-mode endpoints of vllm 0.32, verified in
   vllm/entrypoints/rl/online/api_router.py and serve/dev/{rpc,cache}/api_router.py):
   ``POST /pause?mode=wait`` -> ``POST /collective_rpc {"method": "reload_weights",
   "kwargs": {"weights_path": DIR}}`` -> ``POST /reset_prefix_cache`` -> ``POST /resume``
   (resume is sent even when the reload fails). DIR must exist on vLLM's filesystem: a
   missing path kills the engine, hence the verification first.
3. ``POST {proxy}/admin/policy_version {"version", "checkpoint"}`` (connection errors warn).

Run: ``python -m trainer.reloader --run NAME``; ``/health`` and ``/status`` on reloader_port.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import time
from pathlib import Path

import httpx
from pydantic_settings import BaseSettings, SettingsConfigDict

from infra.settings import get_settings
from schemas import topics
from trainer import checkpoint
from trainer.train import _partitions, start_http

log = logging.getLogger("spanrl.reloader")


class ReloaderConfig(BaseSettings):
    """Reloader knobs; each can be set as ``SPANRL_RELOADER_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="SPANRL_RELOADER_", extra="ignore")

    run: str | None = None  # default: settings.run
    checkpoints_topic: str = topics.CHECKPOINTS.name
    #: latest: reload the newest existing announcement of the run, then follow;
    #: end: only announcements made after start; beginning: replay all (oldest first)
    start: str = "latest"
    from_version: int = 1  # ignore announcements below this version
    pause_mode: str = "wait"  # vLLM /pause mode: wait (finish in-flight), abort, keep
    vllm_url: str | None = None  # default: settings.vllm_url
    proxy_url: str | None = None  # default: settings.proxy_url
    reload_timeout_s: float = 600.0
    max_announcements: int | None = None  # stop after handling this many (tests)
    http: bool = True


class Reloader:
    def __init__(self, cfg: ReloaderConfig, settings=None):
        self.cfg = cfg
        self.settings = settings or get_settings()
        self.run = cfg.run or self.settings.run
        self.vllm_url = (cfg.vllm_url or self.settings.vllm_url).rstrip("/")
        self.proxy_url = (cfg.proxy_url or self.settings.proxy_url).rstrip("/")
        self.minio = checkpoint.make_client(self.settings)
        self.served_version = 0
        self.served_dir: str | None = None
        self.history: list[dict] = []
        self.handled = 0

    def status(self) -> dict:
        return {"run": self.run, "served_version": self.served_version, "served_dir": self.served_dir,
                "history": self.history[-50:]}

    # one announcement -----------------------------------------------------------------
    async def handle(self, ann: dict) -> bool:
        """Verify and load one announcement; True when vLLM now serves it."""
        version, uri = int(ann["version"]), ann["uri"]
        entry = {"version": version, "uri": uri, "verified": False, "reloaded": False, "reload_s": None,
                 "error": None, "at_ms": int(time.time() * 1000)}
        self.history.append(entry)
        dest = self.settings.cache_dir / "checkpoints" / self.run / f"{version:06d}"
        try:
            manifest = await asyncio.to_thread(checkpoint.download_checkpoint, self.minio, uri, dest)
            actual = checkpoint.manifest_sha256(dest)
            if actual != ann["manifest_sha256"]:
                raise checkpoint.CheckpointError(
                    f"manifest sha256 {actual} != announced {ann['manifest_sha256']}")
            if manifest["version"] != version or manifest["run"] != self.run:
                raise checkpoint.CheckpointError(
                    f"manifest is {manifest['run']}/{manifest['version']}, announced {self.run}/{version}")
            if not (dest / "config.json").is_file() or not any(dest.glob("*.safetensors")):
                raise checkpoint.CheckpointError(f"{dest}: no config.json or *.safetensors")
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, checkpoint.CheckpointError):
                shutil.rmtree(dest, ignore_errors=True)  # never leave an unverified dir vLLM could load
            log.error("refusing checkpoint %s v%d: %s; vLLM keeps serving v%d", uri, version, exc,
                      self.served_version)
            return False
        entry["verified"] = True
        t0 = time.perf_counter()
        try:
            await reload_vllm(self.vllm_url, dest, pause_mode=self.cfg.pause_mode, timeout_s=self.cfg.reload_timeout_s)
        except Exception as exc:
            entry["error"] = f"reload failed: {type(exc).__name__}: {exc}"
            log.error("vLLM reload of v%d failed: %s", version, exc)
            return False
        entry["reload_s"] = round(time.perf_counter() - t0, 3)
        entry["reloaded"] = True
        self.served_version, self.served_dir = version, str(dest)
        log.info("vLLM now serves %s v%d (reload %.2fs)", self.run, version, entry["reload_s"])
        await notify_proxy(self.proxy_url, version, uri)
        return True

    # loop -----------------------------------------------------------------------------
    async def serve(self) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        from schemas.codec import SchemaError, decode

        http = await start_http(self.settings.host, self.settings.reloader_port, self.status) if self.cfg.http else None
        consumer = AIOKafkaConsumer(bootstrap_servers=self.settings.kafka_bootstrap,
                                    isolation_level="read_committed", enable_auto_commit=False, group_id=None)
        await consumer.start()
        try:
            parts = await _partitions(consumer, self.cfg.checkpoints_topic, wait_s=60)
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
            while True:
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
                        (backlog if catching_up else todo).append(ann)
                if catching_up and all([await consumer.position(tp) >= end[tp] for tp in tps]):
                    catching_up = False
                    if backlog:
                        todo.insert(0, max(backlog, key=lambda a: a["version"]))
                for ann in todo:
                    if ann["version"] < self.cfg.from_version or ann["version"] <= self.served_version:
                        continue
                    await self.handle(ann)
                    self.handled += 1
                    if self.cfg.max_announcements and self.handled >= self.cfg.max_announcements:
                        return
        finally:
            await consumer.stop()
            if http is not None:
                await http.cleanup()


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


async def notify_proxy(proxy_url: str, version: int, uri: str) -> None:
    from producers.edge import bearer_headers  # the proxy's token when SPANRL_AUTH_TOKEN is set

    try:
        async with httpx.AsyncClient(timeout=10.0, headers=bearer_headers(get_settings().auth_token)) as client:
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
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = {k: v for k, v in {"run": args.run, "start": args.start,
                                   "from_version": args.from_version}.items() if v is not None}
    asyncio.run(Reloader(ReloaderConfig(**overrides)).serve())


if __name__ == "__main__":
    main()
