"""Device slots: one Ray actor per device, joined into a torch.distributed group.

A slot is a GPU (NCCL) or, on a machine without one, a CPU worker process standing in for it
(gloo). Work reaches a slot as a picklable function ``fn(ctx, **kwargs)`` run by ``execute``; the
``SlotContext`` carries the slot's rank, device and the state that the job keeps on it between
calls. Every remote call has an outer timeout so that a hung peer becomes an error, never a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import resource
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from runtime.engine.ray_cluster import is_loopback_address

logger = logging.getLogger(__name__)


JOIN_TIMEOUT_S = 60.0
"""The least time new slot processes are given to start and form their group, by default (also
how long a re-form waits for a slot whose capacity is gone before it gives up)."""


class SlotError(RuntimeError):
    """A slot failed or did not answer in time."""


@dataclasses.dataclass(kw_only=True, slots=True)
class SlotContext:
    """What a function running on a slot can see: its place in the group and its kept state."""

    slot_index: int
    rank: int = -1
    world_size: int = 0
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeout_s: float | None = None
    """The pool's call timeout: every group made on the slot gives up on a peer after it."""

    def group_timeout(self) -> timedelta | None:
        """The timeout for a subgroup (``dist.new_group(timeout=...)``); None: torch's default."""
        return None if self.timeout_s is None else timedelta(seconds=self.timeout_s)

    def mesh_backend_override(self) -> tuple:
        """``DeviceMesh(backend_override=...)`` for a 1-D mesh whose group has the pool's call
        timeout rather than torch's default (30 min on gloo, 10 on NCCL)."""
        timeout = self.group_timeout()
        if timeout is None:
            return ((None, None),)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
        else:
            from torch._C._distributed_c10d import Backend

            options = Backend.Options("gloo", timeout=timeout)
        return ((None, options),)


class SlotWorker:
    """The body of a slot actor (wrapped with ``ray.remote`` by ``SlotPool``)."""

    def __init__(self, *, slot_index: int, num_threads: int = 1):
        torch.set_num_threads(num_threads)
        self.ctx = SlotContext(slot_index=slot_index)
        if torch.cuda.is_available():
            self.ctx.device = torch.device("cuda", 0)  # Ray sets CUDA_VISIBLE_DEVICES per actor.

    def node(self) -> dict[str, str]:
        """Where this slot runs: its Ray node and that node's address."""
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "address": ray.util.get_node_ip_address()}

    def reserve_port(self, host: str) -> int:
        """A free TCP port on ``host`` for the group's rendezvous store (rank 0 only)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]

    def join_group(
        self,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        backend: str,
        timeout_s: float,
    ) -> float:
        """Join the job's process group; returns the seconds it took."""
        started = time.perf_counter()
        if is_loopback_address(f"{master_addr}:0"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        device = {}
        if backend == "nccl":
            # Pin the slot's GPU first and name it to the group: NCCL's communicator is made
            # now, on that device (a set-up error surfaces here, not at the first collective),
            # and nothing guesses a device from the rank.
            torch.cuda.set_device(self.ctx.device)
            device = {"device_id": self.ctx.device}
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            **device,
        )
        self.ctx.rank, self.ctx.world_size = rank, world_size
        self.ctx.timeout_s = timeout_s
        return time.perf_counter() - started

    def execute(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """Run ``fn(ctx, **kwargs)`` on this slot."""
        return fn(self.ctx, **kwargs)

    def memory(self, *, reset_peak: bool = False) -> dict[str, int]:
        """Current and peak memory of this slot, in bytes. On a GPU, what the device has in use
        (``mem_get_info``: PyTorch's reserved blocks, and what PyTorch does not count: the CUDA
        context, NCCL's buffers, a vLLM engine's own pool, other processes), the peak being
        PyTorch's reserved peak plus the rest as it is now; ``reset_peak`` starts the next peak
        from here (once a step, so each step's peak is its own). On a CPU, the process's
        resident set and its lifetime peak."""
        if self.ctx.device.type == "cuda":
            device = self.ctx.device
            free, total = torch.cuda.mem_get_info(device)
            outside = max(0, total - free - torch.cuda.memory_reserved(device))
            peak = torch.cuda.max_memory_reserved(device) + outside
            if reset_peak:
                torch.cuda.reset_peak_memory_stats(device)
            return {"current_bytes": total - free, "peak_bytes": peak}
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with open("/proc/self/statm") as statm:
            rss_pages = int(statm.read().split()[1])
        return {
            "current_bytes": rss_pages * os.sysconf("SC_PAGE_SIZE"),
            "peak_bytes": peak_kib * 1024,
        }

    def leave_group(self) -> None:
        # Drop the cached subgroups and every tensor first: a gloo group that outlives
        # destroy_process_group can abort the process at exit (pytorch/pytorch#179291).
        self.ctx.state.clear()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


class SlotPool:
    """A fixed set of slots in one process group; the driver's handle on them."""

    def __init__(
        self,
        actors: Sequence[Any],
        *,
        backend: str,
        call_timeout_s: float,
        remote_cls: Any = None,
        master_addr: str = "127.0.0.1",
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ):
        self._actors = list(actors)
        self.backend = backend
        self.call_timeout_s = call_timeout_s
        self.join_timeout_s = join_timeout_s
        self.setup_s = 0.0
        self._remote_cls = remote_cls
        self._master_addr = master_addr
        self._placements: list[dict] = [{} for _ in actors]
        self._overdue: dict[int, tuple[Any, float]] = {}
        """Slot → (its process, when), where a call on that process ran past the call timeout
        (``time.monotonic()`` of when the driver gave up waiting)."""

    @classmethod
    def create(
        cls,
        num_slots: int,
        *,
        use_gpus: bool = False,
        call_timeout_s: float = 120.0,
        master_addr: str | None = "127.0.0.1",
        spread: bool = False,
        join_timeout_s: float = JOIN_TIMEOUT_S,
    ) -> SlotPool:
        """Start ``num_slots`` slot actors joined into one group (gloo on CPU, NCCL on GPU).

        ``spread``: reserve the slots as one placement group spread over the cluster's nodes (a
        bundle per slot), as a multi-node job does. ``master_addr`` None: the group meets at the
        address of slot 0's node (a cluster); the default keeps a single machine on loopback."""
        if num_slots < 1:
            raise ValueError(f"num_slots: must be at least 1, got {num_slots}")
        started = time.perf_counter()
        resources = {"num_gpus": 1, "num_cpus": 1} if use_gpus else {"num_cpus": 1}
        # One thread per actor, the process's main one: vLLM and torch.distributed expect it.
        remote_cls = ray.remote(**resources)(SlotWorker)
        placements: list[dict] = [{} for _ in range(num_slots)]
        if spread:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = {"GPU": 1, "CPU": 1} if use_gpus else {"CPU": 1}
            group = placement_group([dict(bundle) for _ in range(num_slots)], strategy="SPREAD")
            ray.get(group.ready(), timeout=call_timeout_s)
            placements = [
                {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=i
                    )
                }
                for i in range(num_slots)
            ]
        actors = [
            remote_cls.options(**placements[i]).remote(slot_index=i) for i in range(num_slots)
        ]
        if master_addr is None:
            master_addr = ray.get(actors[0].node.remote(), timeout=call_timeout_s)["address"]
        pool = cls(
            actors,
            backend="nccl" if use_gpus else "gloo",
            call_timeout_s=call_timeout_s,
            remote_cls=remote_cls,
            master_addr=master_addr,
            join_timeout_s=join_timeout_s,
        )
        pool._placements = placements
        try:
            pool._join("join_group")
        except BaseException:
            pool.close()  # no half-made pool keeps its actors
            raise
        pool.setup_s = time.perf_counter() - started
        return pool

    def _join(self, method: str) -> None:
        """Form the group. New processes are waited for longer than a call (``join_timeout_s``
        at least): starting one (Python, torch, the actor) takes seconds on a busy machine, and
        a group re-formed after a loss must not fail for a short call timeout."""
        wait_s = max(self.call_timeout_s, self.join_timeout_s)
        # Every process up first: the group's rendezvous then waits on no slow starter (it
        # gives up after the call timeout, the group's own).
        self._get_all([actor.node.remote() for actor in self._actors], timeout_s=wait_s)
        port = self._get_all(
            [self._actors[0].reserve_port.remote(self._master_addr)], timeout_s=wait_s
        )[0]
        self._get_all(
            [
                getattr(actor, method).remote(
                    rank=rank,
                    world_size=len(self._actors),
                    master_addr=self._master_addr,
                    master_port=port,
                    backend=self.backend,
                    timeout_s=self.call_timeout_s,
                )
                for rank, actor in enumerate(self._actors)
            ],
            timeout_s=wait_s,
        )

    def renew(self) -> float:
        """Start a new process for every slot and form a new group, as torchelastic re-forms a
        worker group after a member died: a communicator that lost a member cannot be used
        again, and torch keeps per-process group state that a re-initialised process would
        carry over, so no process survives. The new slots hold nothing. Returns the seconds."""
        if self._remote_cls is None:
            raise RuntimeError("renew: this pool was not made by SlotPool.create")
        started = time.perf_counter()
        old = list(self._actors)
        for actor in old:
            with contextlib.suppress(ray.exceptions.RayError):  # already gone
                ray.kill(actor, no_restart=True)
        # ``ray.kill`` only asks: the new processes need the devices the old ones free.
        deadline = time.monotonic() + self.call_timeout_s
        for actor in old:
            while time.monotonic() < deadline:
                try:
                    ray.get(actor.memory.remote(), timeout=1.0)
                except ray.exceptions.RayActorError:
                    break
                except ray.exceptions.GetTimeoutError:
                    continue
        self._overdue.clear()
        for slot in range(len(self._actors)):
            options = self._placements[slot]
            self._actors[slot] = self._remote_cls.options(**options).remote(slot_index=slot)
        self._join("join_group")
        return time.perf_counter() - started

    @property
    def num_slots(self) -> int:
        return len(self._actors)

    def run(
        self,
        fn: Callable[..., Any],
        per_rank_kwargs: Sequence[dict[str, Any]] | None = None,
        *,
        on: Sequence[int] | None = None,
        **common: Any,
    ) -> list[Any]:
        """Run ``fn`` at once on every slot, or only on the slots ``on`` (results in that order).

        A collective inside ``fn`` needs every member of its group among them. Calls on disjoint
        slot sets may run concurrently from several threads; each slot runs one call at a time.
        """
        return self.start(fn, per_rank_kwargs, on=on, **common).wait()

    def start(
        self,
        fn: Callable[..., Any],
        per_rank_kwargs: Sequence[dict[str, Any]] | None = None,
        *,
        on: Sequence[int] | None = None,
        **common: Any,
    ) -> Pending:
        """``run`` without waiting: the slots start ``fn`` now; ``wait()`` on the result gives
        what ``run`` would have. Later calls on those slots queue behind it."""
        slots = list(range(len(self._actors))) if on is None else list(on)
        for slot in slots:
            if not 0 <= slot < len(self._actors):
                raise ValueError(f"on: slot {slot} is not in the pool of {len(self._actors)}")
        per_rank = per_rank_kwargs or [{} for _ in slots]
        if len(per_rank) != len(slots):
            raise ValueError(f"per_rank_kwargs: expected {len(slots)} entries, got {len(per_rank)}")
        refs = [
            self._actors[slot].execute.remote(fn, {**common, **kw})
            for slot, kw in zip(slots, per_rank, strict=True)
        ]
        return Pending(pool=self, refs=refs, slots=tuple(slots))

    def memory(self, *, reset_peak: bool = False) -> list[dict[str, int]]:
        """Each slot's memory (``SlotWorker.memory``)."""
        return self._get_all(
            [a.memory.remote(reset_peak=reset_peak) for a in self._actors], range(self.num_slots)
        )

    def nodes(self) -> list[dict[str, str]]:
        """Each slot's Ray node id and address."""
        return self._get_all([a.node.remote() for a in self._actors], range(self.num_slots))

    def alive(self, *, timeout_s: float = 10.0, busy: frozenset[int] = frozenset()) -> list[bool]:
        """Which slots' processes live. Ray's word that an actor died makes a slot dead; a
        slot that does not answer within ``timeout_s`` is busy (a call, or a collective waiting
        on a peer, runs on it and ends within the pool's call timeout), and killing it would
        destroy state it may alone hold. Unless a call on that process already ran past the
        call timeout (``Pending.wait`` said so): then it is given a further call timeout and
        ``timeout_s`` since (by which time a peer blocked in a collective with a hung slot has
        timed out, and answers), and one still silent is hung (stuck in native code, a wedged
        driver): no call can reach its state, and it is killed and counted dead, for the group
        to be re-formed without it.
        The ``busy`` slots are taken to be alive unasked (a long call on one of them reports its
        slot's death itself, through ``Pending.wait``)."""
        refs = {i: a.memory.remote() for i, a in enumerate(self._actors) if i not in busy}
        out = []
        for i in range(len(self._actors)):
            if i not in refs:
                out.append(True)
                continue
            overdue = self._overdue.get(i)
            if overdue is not None and overdue[0] is not self._actors[i]:
                overdue = None  # of a process since replaced
            patience = timeout_s
            if overdue is not None:
                since = time.monotonic() - overdue[1]
                patience = max(timeout_s, self.call_timeout_s + timeout_s - since)
            try:
                ray.get(refs[i], timeout=patience)
                self._overdue.pop(i, None)  # its long call ended
                out.append(True)
            except ray.exceptions.GetTimeoutError:
                if overdue is None:
                    out.append(True)  # busy, not dead
                    continue
                logger.warning(
                    "slot %s: silent for twice the call timeout (%.0f s); killed as hung",
                    i,
                    self.call_timeout_s,
                )
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.kill(self._actors[i], no_restart=True)
                out.append(False)
            except ray.exceptions.ActorUnavailableError:
                out.append(True)  # unreachable for a moment (Ray says it may come back)
            except ray.exceptions.RayActorError:
                out.append(False)  # the process died
            except ray.exceptions.RayError:
                out.append(True)  # it answered, with an error
        return out

    def kill(self, slot: int, *, timeout_s: float = 30.0) -> None:
        """End one slot's actor abruptly, as a revoked GPU or a crashed node would; returns once
        Ray reports it dead (``ray.kill`` itself only asks)."""
        actor = self._actors[slot]
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get(actor.memory.remote(), timeout=1.0)
            except ray.exceptions.RayActorError:
                return
            except ray.exceptions.GetTimeoutError:
                continue
        raise SlotError(f"slot {slot}: still answering {timeout_s:.0f} s after it was killed")

    def close(self) -> None:
        """Leave the group and end the actors; best effort, never raises."""
        # Slots already known to be hung are not waited for, the others for at most the call
        # timeout: a job's end must not wait longer on a slot than any of its calls does.
        asked = [a for i, a in enumerate(self._actors) if i not in self._overdue]
        try:
            ray.get([a.leave_group.remote() for a in asked], timeout=min(30, self.call_timeout_s))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            # A dead or hung slot must not stop the others from being released.
            logger.warning("leaving the slot group failed (%s); killing the slots", exc)
        for actor in self._actors:
            ray.kill(actor)
        self._actors.clear()

    def _get(self, ref: Any) -> Any:
        return self._get_all([ref])[0]

    def _get_all(
        self,
        refs: list[Any],
        slots: Sequence[int] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """The calls' results; with ``slots`` (the slot of each call), the slots whose call ran
        past the call timeout (or ``timeout_s``) are remembered (``alive``) and named."""
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as exc:
            silent = []
            if slots is not None:
                done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
                ended = {id(r) for r in done}
                silent = [s for s, r in zip(slots, refs, strict=True) if id(r) not in ended]
                now = time.monotonic()
                self._overdue.update({s: (self._actors[s], now) for s in silent})
            which = f"slots {silent}" if silent else "a slot"
            raise SlotError(f"{which} did not answer within {timeout_s:.0f} s") from exc
        except ray.exceptions.RayError as exc:
            which = "a slot"
            if slots is not None:
                failed = self._failed(refs, slots)
                if failed:
                    which = f"slot {failed[0]}" if len(failed) == 1 else f"slots {failed}"
            how = "died" if isinstance(exc, ray.exceptions.RayActorError) else "failed"
            raise SlotError(f"{which} {how}: {exc}") from exc

    @staticmethod
    def _failed(refs: list[Any], slots: Sequence[int]) -> list[int]:
        """The slots whose call has ended in an error (those still running are not counted)."""
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        ended = {id(r) for r in done}
        failed = []
        for slot, ref in zip(slots, refs, strict=True):
            if id(ref) not in ended:
                continue
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayError:
                failed.append(slot)
        return failed


@dataclasses.dataclass(frozen=True)
class Pending:
    """Calls started on some slots (``SlotPool.start``)."""

    pool: SlotPool
    refs: list[Any]
    slots: tuple[int, ...]

    def wait(self) -> list[Any]:
        """The calls' results, in the order of ``slots``; a failed or silent slot raises
        ``SlotError`` (the pool's call timeout counts from now)."""
        return self.pool._get_all(self.refs, self.slots)

    def running(self) -> frozenset[int]:
        """The slots whose call has not ended (ended includes failed, a dead slot's too)."""
        done, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)
        ended = {id(r) for r in done}
        return frozenset(
            s for s, r in zip(self.slots, self.refs, strict=True) if id(r) not in ended
        )
