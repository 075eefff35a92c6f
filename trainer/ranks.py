"""The trainer as N data-parallel DeepSpeed ranks (issue 20): launch, work split, commands.

``SPANRL_TRAINER_RANKS`` = N > 1: ``python -m spanrl.trainer.train`` replaces itself by
DeepSpeed's launcher (``deepspeed.launcher.launch``, :func:`launch_argv`), which starts N
copies with ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` set, kills all of
them when one exits with an error, and exits with that error: the group lives and dies as
one process (the stack, chaos's ``heal`` or Kubernetes restarts it; every rank then resumes
from the last published checkpoint).

Exactly-once with N ranks (trainer/train.py): rank 0 alone reads ``samples``, fixes an
update's batch and its offsets, and sends the batch to the other ranks over the rendezvous
store (:class:`CommandChannel`: no collective is open while the trainer waits for samples,
so an idle hour is not a gloo/NCCL timeout). Every rank computes the same update plan from the
same samples (advantages, mini-batches, micro-batches) and runs its share of each
mini-batch's micro-batches (:func:`rank_share`); DeepSpeed reduces the gradients. Rank 0
advances the trained offsets only once the update's last collective (the metrics'
all-reduce, after the last optimizer step) has returned on every rank, and publishes one
checkpoint per version (ZeRO-2: every rank holds the whole parameters; rank 0 saves them).

Equal to one rank: DeepSpeed averages gradients over ranks, so each rank's loss is scaled
by N (ZeRO's ``average_tensor`` divides the reduced gradient by N); the loss weights of a mini-batch are computed over the
whole mini-batch on every rank, so the sum of the ranks' gradients is the one-rank gradient.
Every rank must call backward the same number of times per optimizer step (ZeRO-2 reduces
in backward hooks): a rank with fewer micro-batches runs a zero-weight copy of its smallest
one (:func:`rank_share`'s padding).
"""
from __future__ import annotations

import base64
import datetime
import json
import pickle
import socket
import time

#: how long a rank waits for the others at the rendezvous and in one collective
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)


def world_info(ranks: int, host: str = "localhost") -> str:
    """DeepSpeed launcher's ``--world_info``: urlsafe base64 of ``{host: [0 .. ranks-1]}``.

    Example: world_info(2) -> base64 of '{"localhost": [0, 1]}'. Raises ValueError for
    ranks < 1."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return base64.urlsafe_b64encode(json.dumps({host: list(range(ranks))}).encode()).decode()


def launch_argv(python: str, ranks: int, master_port: int, module: str, args: list[str],
                master_addr: str = "127.0.0.1") -> list[str]:
    """The command line that starts ``ranks`` processes of ``python -m module args`` on this
    machine through DeepSpeed's launcher (``deepspeed.launcher.launch``: sets RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT; ``--no_local_rank``: no ``--local_rank`` argument).
    ``master_addr``: where rank 0's rendezvous store listens (train.rendezvous_bind_address)."""
    return [python, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info(ranks)}",
            f"--master_addr={master_addr}", f"--master_port={master_port}", "--no_local_rank",
            "--module", module, *args]


def threads_per_rank(threads: int, ranks: int) -> int:
    """``OMP_NUM_THREADS`` of each rank when the trainer has ``threads`` in all: at least 1.
    Example: threads_per_rank(2, 2) -> 1; threads_per_rank(8, 3) -> 2."""
    return max(1, threads // max(1, ranks))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for MASTER_PORT; rank 0 binds it moments later)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_share(costs: list[int], world: int, rank: int) -> list[tuple[int, bool]]:
    """This rank's micro-batches of one optimizer step, as ``(index into costs, padding)``.

    ``costs``: one number per micro-batch of the step (padded tokens, B x T), in plan order.
    Each micro-batch goes, in order, to the rank with the least cost so far (ties: the lowest
    rank): a deterministic, balanced split every rank computes alike. Every rank gets as many
    entries as the busiest one: a rank with fewer runs its own smallest micro-batch (or the
    step's smallest when it has none) again with ``padding`` True, which the caller trains at
    zero weight (same collectives, no contribution).

    Example: costs [8, 6, 4, 1], world 2 -> rank 0: [(0, False), (3, False)],
    rank 1: [(1, False), (2, False)]; costs [5], world 2 -> rank 1: [(0, True)].
    Raises ValueError for world < 1 or rank outside [0, world)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world {world}")
    load = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for i, c in enumerate(costs):
        r = min(range(world), key=lambda k: (load[k], k))
        load[r] += c
        owned[r].append(i)
    mine = [(i, False) for i in owned[rank]]
    most = max((len(o) for o in owned), default=0)
    if len(mine) < most:
        pool = owned[rank] or list(range(len(costs)))
        spare = min(pool, key=lambda i: (costs[i], i))
        mine += [(spare, True)] * (most - len(mine))
    return mine


class ChannelClosed(RuntimeError):
    """Rank 0's store went away (rank 0 exited): the follower stops."""


class CommandChannel:
    """Rank 0 -> the other ranks: numbered commands (picklable dicts) through the rendezvous
    ``store`` (torch.distributed TCPStore, served by rank 0). :meth:`send` writes command n under
    ``spanrl/cmd/<n>``; each reader counts itself in ``spanrl/read/<n>`` once it has the command,
    and the sender deletes every command all ``readers`` have counted (the store holds at most the
    commands not yet read: an update's samples are not kept for the life of the run).
    :meth:`receive` polls for the next command, so a trainer that waits hours for samples holds
    no collective open."""

    PREFIX = "spanrl/cmd/"
    READ = "spanrl/read/"

    def __init__(self, store, readers: int = 1, poll_s: float = 0.2):
        self.store = store
        self.readers = readers
        self.poll_s = poll_s
        self.n = 0
        self._unread: list[int] = []  # sent commands not yet deleted

    def send(self, command: dict) -> None:
        self.store.set(f"{self.PREFIX}{self.n}", pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL))
        self._unread.append(self.n)
        self.n += 1
        for k in list(self._unread):
            if self.store.add(f"{self.READ}{k}", 0) >= self.readers:
                self.store.delete_key(f"{self.PREFIX}{k}")
                self.store.delete_key(f"{self.READ}{k}")
                self._unread.remove(k)

    def pending(self) -> int:
        """Commands sent and not yet deleted (read by fewer than ``readers``)."""
        return len(self._unread)

    def receive(self, stop=lambda: False) -> dict | None:
        """The next command; None when ``stop()`` became true while waiting. Raises
        :class:`ChannelClosed` when the store cannot be reached."""
        key = f"{self.PREFIX}{self.n}"
        while not stop():
            try:
                if self.store.check([key]):
                    command = pickle.loads(self.store.get(key))
                    self.store.add(f"{self.READ}{self.n}", 1)
                    self.n += 1
                    return command
            except (RuntimeError, ConnectionError) as exc:  # torch's DistStoreError is a RuntimeError
                raise ChannelClosed(f"rendezvous store unreachable: {exc}") from exc
            time.sleep(self.poll_s)
        return None


def rank_processes(launcher_pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the trainer ranks below ``launcher_pid`` (their ``RANK`` variable, read
    from /proc through psutil); empty when the process is gone. For fault injection and tests."""
    import psutil

    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    out = {}
    for child in children:
        try:
            rank = child.environ().get("RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None and "spanrl.trainer.train" in " ".join(child.cmdline()):
            out[int(rank)] = child.pid
    return out
