"""PPO on slots: the driver of one job's steps, on whatever plan the controller holds.

The driver (this process) holds the data, as a single controller does: it samples prompts, cuts
the batch across each model-stage's data-parallel units, collects what the units return and
computes rewards and advantages. The slots hold the models (``runtime.ppo.slot_work``). One step:

1. generation: the actor's training parameters are synced into the actor's generation units,
   which sample responses to their share of the prompts;
2. inference: the actor's and the critic's inference units (synced from training) and the frozen
   reference and reward units score every response token; the programmatic reward (or the reward
   model's score) gives each sequence its score; rewards with the KL penalty and GAE follow;
3. training: ``epochs`` passes of minibatches; each minibatch is cut across the training units,
   gradients are summed across them, and Adam updates the units' own state.

Everything that decides a run's numbers (prompts, sampling noise per prompt, minibatch order,
the KL weight, Adam's step counts) is fixed by the seed and the step, not by the layout, so a run
whose plan changes between steps follows the same trajectory as one that does not, up to
floating-point summation order.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from runtime import files
from runtime.emu import checkpoint
from runtime.emu.checkpoint import UnusableCheckpointError
from runtime.emu.engine import UnitEngine
from runtime.emu.layout import ShardError, assemble
from runtime.emu.primitives import Unit
from runtime.emu.reshard import plan_copies
from runtime.engine.interface import StepReport
from runtime.engine.slots import Pending, SlotError
from runtime.planner import default_catalog
from runtime.planner.calibration import samples_from_stages
from runtime.planner.catalog import CPU_SLOT, CatalogError, ModelConfig, RopeScaling, finite_number
from runtime.planner.plan import Plan
from runtime.planner.search import on_ready
from runtime.planner.workload import PpoWorkload
from runtime.ppo import algorithm as ppo
from runtime.ppo import export, slot_work
from runtime.ppo.algorithm import PPOConfig, StepStats
from runtime.ppo.generate import SamplingParams, left_pad
from runtime.ppo.model import build_model
from runtime.ppo.parallel import check_tensor_parallel
from runtime.ppo.tasks import BOS, EOS, PAD, TaskSet, reward_function
from runtime.ppo.trainer_local import supervised_warmup
from runtime.ppo.weights import CheckpointError, load_weights, read_state_dict, unexpected_keys
from runtime.transition.dag import build_order, joining_units
from runtime.transition.units import persists, unit_layout


class SupersededError(RuntimeError):
    """Another driver took the job over: this one must not write the job's files."""


REWARDS = ("length", "correct", "partial", "model")
GENERATION_BACKENDS = slot_work.GENERATION_BACKENDS  # PpoJobConfig.generation_backend's values

logger = logging.getLogger(__name__)


class PpoConfigError(ValueError):
    """A PPO job configuration that cannot run; the message names the field."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PpoJobConfig:
    """A PPO job on slots. All four models share the architecture ``model``."""

    model: str = "tiny-sft"
    tasks: tuple[str, ...] = ("copy",)
    reward: str = "length"
    """``length`` (longer answers: response length grows, real drift), ``correct``, ``partial``,
    or ``model`` (the reward model's score)."""
    max_new_tokens: int = 16
    temperature: float = 1.0
    batch_size: int = 32
    ppo: PPOConfig = dataclasses.field(
        default_factory=lambda: PPOConfig(kl_coef=0.01, epochs=2, minibatch_size=16)
    )
    actor_lr: float = 1e-3
    critic_lr: float = 1e-3
    max_grad_norm: float = 1.0
    warmup_steps: int = 60
    """Supervised steps on the tasks' answers (on the driver) before PPO starts."""
    warmup_lr: float = 3e-3
    generation_backend: str = "torch"
    """``torch`` (any layout, CPU or GPU) or ``vllm`` (GPU slots, one-slot generation units)."""
    checkpoint_every: int = 5
    """Commit a checkpoint (DCP) every this many steps; 0: only when asked."""
    init_from: str = ""
    """A safetensors file or Hugging Face directory for the actor's (and reference's) start."""
    seed: int = 0

    def model_config(self) -> ModelConfig:
        """The catalog's model, with the RoPE base and RMSNorm epsilon of the ``init_from``
        folder's ``config.json`` where it has one (a Llama 3 checkpoint's 500000.0)."""
        try:
            model = default_catalog().model(self.model)
            return dataclasses.replace(model, **_numerics_of(self.init_from))
        except ValueError as exc:
            raise PpoConfigError(str(exc)) from None

    def task_set(self) -> TaskSet:
        try:
            return TaskSet(tasks=tuple(self.tasks), vocab_size=self.model_config().vocab_size)
        except ValueError as exc:
            raise PpoConfigError(str(exc)) from None

    def workload(self) -> PpoWorkload:
        """The planner's view of a step of this job (samples 64 prompts for their length)."""
        tasks = self.task_set()
        prompt_len = max(len(p.tokens) for p in tasks.sample(64, seed=self.seed))
        return PpoWorkload.for_model(
            self.model_config(),
            global_batch=self.batch_size,
            prompt_len=prompt_len,
            gen_len=max(1, self.max_new_tokens // 4),
            micro_batch=min(self.batch_size, 8),
            gen_micro_batch=self.batch_size,
            ppo_epochs=self.ppo.epochs,
            ppo_minibatches=-(-self.batch_size // self.ppo.minibatch_size),
            precision="fp32",
        )

    def sampling(self, seed: int) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            eos_token_id=EOS,
            temperature=self.temperature,
            seed=seed,
        )

    def validate(self) -> None:
        """Every field, before any slot is touched."""
        self.task_set()
        if self.reward not in REWARDS:
            raise PpoConfigError(
                f"reward: expected one of {', '.join(REWARDS)}, got {self.reward!r}"
            )
        if self.generation_backend not in GENERATION_BACKENDS:
            raise PpoConfigError(
                f"generation_backend: expected one of {', '.join(GENERATION_BACKENDS)}, "
                f"got {self.generation_backend!r}"
            )
        if (
            isinstance(self.checkpoint_every, bool)
            or not isinstance(self.checkpoint_every, int)
            or (self.checkpoint_every < 0)
        ):
            raise PpoConfigError(
                f"checkpoint_every: must be a non-negative integer, got {self.checkpoint_every!r}"
            )
        for field in ("batch_size", "max_new_tokens"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PpoConfigError(f"{field}: must be a positive integer, got {value!r}")
        if self.ppo.minibatch_size > self.batch_size:
            raise PpoConfigError(
                f"ppo.minibatch_size: {self.ppo.minibatch_size} exceeds batch_size={self.batch_size}"
            )
        for field in ("actor_lr", "critic_lr", "max_grad_norm", "warmup_lr"):
            if not getattr(self, field) > 0:
                raise PpoConfigError(f"{field}: must be positive, got {getattr(self, field)}")
        try:
            self.sampling(0)
        except ValueError as exc:
            raise PpoConfigError(str(exc)) from None


def _numerics_of(init_from: str) -> dict:
    """``rope_theta``, ``rms_norm_eps`` and ``rope_scaling`` from a Hugging Face folder's
    ``config.json`` (none for a single weights file). A RoPE scaling the model layer does not
    implement is refused: running without it would silently change every logit."""
    path = Path(init_from) / "config.json" if init_from else None
    if path is None or not path.is_file():
        return {}
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PpoConfigError(f"init_from: {path} is not readable JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise PpoConfigError(f"init_from: {path} is not a JSON object")
    out = {}
    try:
        for key in ("rope_theta", "rms_norm_eps"):
            if key not in hf:
                continue
            number = finite_number(hf[key], key)  # refuses an int past 1e308, and 1e400 (inf)
            if not number > 0:
                raise CatalogError(f"{key}: must be a positive number, got {hf[key]!r:.60}")
            out[key] = number
        out["rope_scaling"] = RopeScaling.from_hf(hf.get("rope_scaling"))
    except CatalogError as exc:
        raise PpoConfigError(f"init_from: {path} {exc}") from None
    return out


def _build_key(unit: Unit) -> tuple:
    """Derived units build in the engines' ``build_order``, on every slot in the same order."""
    return (build_order(unit.model_stage), unit.unit_id)


def _step_seed(seed: int, step: int, stream: int) -> int:
    return (seed * 1_000_003 + step * 8_191 + stream) % 2**63


def _split(rows: int, parts: int) -> list[range]:
    """``rows`` cut into ``parts`` contiguous runs as even as possible (none empty if rows >= parts)."""
    base, extra = divmod(rows, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        out.append(range(start, start + size))
        start += size
    return out


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: the training units (DCP, any layout) and the driver's state."""

    step: int
    """The next step to run from it."""
    units: dict[str, Path]
    state: Path
    checksums: dict[str, int] = dataclasses.field(default_factory=dict)
    """Each model-stage's state checksum when saved (``UnitEngine.checksum``: the same in any
    layout); a restart checks what it loads against them."""


@dataclasses.dataclass(frozen=True)
class _Ahead:
    """Builds started on idle slots (``PpoRuntime.build_ahead``)."""

    pending: Pending
    stage_of: dict[str, str]
    """Unit id → its stage."""
    units: tuple[Unit, ...] = ()
    unwanted: bool = False
    """No transition will use them (``drop_ahead``): freed once built."""


@dataclasses.dataclass(frozen=True)
class _Joining:
    """Derived units building while the step generates on the others (``_joining``)."""

    units: tuple[Unit, ...]
    pending: Pending
    stage_of: dict[str, str]
    """Unit id → its stage."""


@dataclasses.dataclass
class JobState:
    """What the driver keeps between steps, and what a checkpoint saves beside the units."""

    next_step: int = 0
    optimizer_steps: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"actor": 0, "critic": 0}
    )
    kl_coef: float = 0.0
    shuffle_state: list[int] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class PpoRuntime:
    """One PPO job's driver: initial weights, units' placement, and the step on a plan."""

    def __init__(
        self,
        config: PpoJobConfig,
        *,
        workdir: str | Path,
        still_current: Callable[[], bool] = lambda: True,
    ):
        """``still_current``: whether this driver still owns the job (a driver taken over while
        it ran a step must not write the job's files any more: ``fence``)."""
        config.validate()
        self.still_current = still_current
        self.config = config
        self.model = config.model_config()
        self.tasks = config.task_set()
        self.reward = (
            None
            if config.reward == "model"
            else reward_function(config.reward, max_new_tokens=config.max_new_tokens)
        )
        self.workdir = Path(workdir)
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file in its place, a folder the driver may not write
            raise OSError(exc.errno, f"workdir: {exc.strerror}", str(self.workdir)) from exc
        self.kl = ppo.kl_controller(config.ppo)
        self.shuffle = torch.Generator().manual_seed(config.seed)
        self.state = JobState(kl_coef=self.kl.value)
        self.stats: list[StepStats] = []
        self._weights: dict[str, Path] = {}
        self._workload: PpoWorkload | None = None
        self._grouped: set[tuple] = set()
        self._ahead: _Ahead | None = None
        """Derived units being built on idle slots ahead of a transition (``build_ahead``)."""
        self._built_ahead: dict[str, float] = {}
        """Per stage, the longest unit built ahead since the last step reported its builds."""
        self.last_ahead: dict[str, float] = {}
        """Unit id → seconds, of the last batch built ahead that finished."""
        self._built: set[tuple] = set()
        """The derived units whose workspaces are built on every one of their slots
        (``slot_work.workspace_key``)."""
        self.updating = False
        """Whether the step in progress has begun changing the job's state (its training
        stage, its bookkeeping and its checkpoint). A step that fails before then leaves every
        unit and the job at the step's start, so the step can be done again from the units a
        failure left intact; one that fails after can leave units mid-update."""
        if config.init_from:
            self._check_initial(config.init_from)
        export.write_job_file(self.workdir, self.model, **self.export_fields())

    # --- set-up ---------------------------------------------------------------------------------

    def workload(self) -> PpoWorkload:
        """The planner's view of a step of this job (made once: it samples prompts)."""
        if self._workload is None:
            self._workload = self._make_workload()
        return self._workload

    def _make_workload(self) -> PpoWorkload:
        return self.config.workload()

    def check_plan(self, plan: Plan, workload: PpoWorkload) -> None:
        """Raise ``PpoConfigError`` when a model-stage's layout cannot take the model, before any
        slot is touched."""
        for ms in workload.model_stages():
            layout = plan.model_stage(ms.name).layout
            try:
                check_tensor_parallel(ms.model, tp=layout.tp, lm_head=not ms.scalar_head)
                unit_layout(ms, layout, workload.precision)
            except (ValueError, ShardError) as exc:
                raise PpoConfigError(f"plan.{ms.name}: {exc}") from None
            if (
                ms.stage == "generation"
                and self.config.generation_backend == "vllm"
                and layout.tp * layout.pp != 1
            ):
                raise PpoConfigError(
                    f"plan.{ms.name}: the vLLM backend runs one-slot units, got tp={layout.tp} "
                    f"pp={layout.pp}"
                )
            rows = self.config.ppo.minibatch_size if ms.stage == "training" else 1
            if layout.dp > rows and ms.stage == "training":
                raise PpoConfigError(
                    f"plan.{ms.name}: dp={layout.dp} exceeds ppo.minibatch_size={rows}"
                )

    def _check_initial(self, path: str) -> None:
        """Refuse an ``init_from`` that ``load_weights`` would not load into the actor: a
        parameter missing or of another shape, or a tensor the model has no place for (derived
        buffers such as RoPE frequencies are skipped), before any slot is touched."""
        try:
            weights = read_state_dict(path)
        except (OSError, CheckpointError) as exc:
            raise PpoConfigError(f"init_from: {exc}") from None
        expected = build_model(self.model, scalar_head=False, seed=0).state_dict()
        for key, tensor in expected.items():
            if key not in weights:
                raise PpoConfigError(f"init_from: {path} has no tensor {key!r}")
            if tuple(weights[key].shape) != tuple(tensor.shape):
                raise PpoConfigError(
                    f"init_from: {key} has shape {tuple(weights[key].shape)}, the model "
                    f"{self.model.name} needs {tuple(tensor.shape)}"
                )
        unexpected = unexpected_keys(weights, expected)
        if unexpected:
            raise PpoConfigError(
                f"init_from: {path} has a tensor {unexpected[0]!r} that the model "
                f"{self.model.name} does not have"
            )

    def initial_weights(self) -> dict[str, Path]:
        """Full weights of the four models at step 0, written once to the job's directory: the
        actor from ``init_from`` or supervised warm-up, the reference a frozen copy of it, critic
        and reward model on its backbone with fresh scalar heads."""
        if self._weights:
            return self._weights
        c = self.config
        actor = build_model(self.model, scalar_head=False, seed=c.seed)
        if c.init_from:
            load_weights(actor, c.init_from)  # derived buffers (RoPE frequencies) skipped
        supervised_warmup(
            actor,
            self.tasks,
            steps=c.warmup_steps,
            batch_size=c.batch_size,
            lr=c.warmup_lr,
            seed=c.seed,
        )
        critic = build_model(self.model, scalar_head=True, seed=c.seed + 1)
        critic.model.load_state_dict(actor.model.state_dict())
        reward = build_model(self.model, scalar_head=True, seed=c.seed + 2)
        reward.model.load_state_dict(actor.model.state_dict())
        models = {"actor": actor, "critic": critic, "ref": copy.deepcopy(actor), "reward": reward}
        for role, model in models.items():
            path = self.workdir / f"{role}-initial.pt"
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
            self._weights[role] = path
        return self._weights

    def place(self, engine: UnitEngine, units: Mapping[str, tuple[Unit, ...]]) -> None:
        """Create the training units from the initial weights (parameters, fp32 masters, zero
        Adam moments) and register them with the unit engine."""
        weights = self.initial_weights()
        for name, group in units.items():
            role = name.partition("@")[0]
            for unit in group:
                engine.pool.run(
                    slot_work.place_training_unit, on=unit.slots, unit=unit, path=str(weights[role])
                )
                engine.units[unit.unit_id] = unit
                engine.verified.pop(unit.unit_id, None)

    # --- one step -------------------------------------------------------------------------------

    def units_for(
        self, engine: UnitEngine, plan: Plan, workload: PpoWorkload
    ) -> dict[str, tuple[Unit, ...]]:
        """Every model-stage's units this step: the training units the engine holds, and units
        of the plan's layouts for the others (named by layout and slots, so they are reused)."""
        held: dict[str, list[Unit]] = {}
        for unit in engine.units.values():
            held.setdefault(unit.model_stage, []).append(unit)
        out = {}
        for ms in workload.model_stages():
            if persists(ms):
                out[ms.name] = tuple(sorted(held.get(ms.name, []), key=lambda u: u.slots))
                if not out[ms.name]:
                    raise RuntimeError(f"{ms.name}: no training units are held")
                continue
            msp = plan.model_stage(ms.name)
            layout = unit_layout(ms, msp.layout, workload.precision)
            out[ms.name] = tuple(
                Unit(
                    unit_id=f"{ms.name}/{msp.layout.tp}x{msp.layout.pp}@"
                    + "-".join(map(str, slots)),
                    model_stage=ms.name,
                    layout=layout,
                    slots=slots,
                )
                for slots in msp.units
            )
        return out

    def build_ahead(
        self,
        engine: UnitEngine,
        plan: Plan,
        workload: PpoWorkload,
        units: Mapping[str, tuple[tuple[int, ...], ...]],
    ) -> int:
        """Start building ``plan``'s derived units ``units`` (model-stage → each unit's slots,
        on slots the running plan does not use) and return at once: the next step runs on the
        other slots meanwhile, and the first step that uses these slots waits for the builds.
        Returns how many units started."""
        wanted = {(name, tuple(slots)) for name, group in units.items() for slots in group}
        planned = self.units_for(engine, plan, workload)
        ahead = sorted(
            (u for group in planned.values() for u in group if (u.model_stage, u.slots) in wanted),
            key=_build_key,
        )
        if not ahead:
            return 0
        self.finish_ahead()  # one batch at a time
        # Groups are made collectively over the pool (every process, in the same order), so
        # they are made now, before the builds start; the builds then involve their slots only.
        engine.pool.run(checkpoint.ensure_unit_groups, units=ahead)
        slots = sorted({s for u in ahead for s in u.slots})
        pending = engine.pool.start(
            slot_work.build_workspaces, on=slots, units=ahead, frozen=self._frozen_weights()
        )
        stage_of = {u.unit_id: u.model_stage.partition("@")[2] for u in ahead}
        self._ahead = _Ahead(pending=pending, stage_of=stage_of, units=tuple(ahead))
        return len(ahead)

    def finish_ahead(self) -> None:
        """Wait for the units building ahead (their times are reported with the next step's
        builds). A batch that failed is dropped: the step that needs its units builds them
        (and meets the failure itself if a slot is gone)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        try:
            results = ahead.pending.wait()
        except SlotError as exc:
            logger.warning("units built ahead are dropped: %s", exc)
            return
        self.last_ahead = {}
        self._built.update(slot_work.workspace_key(u) for u in ahead.units)
        for took in results:
            for unit_id, seconds in took.items():
                self.last_ahead[unit_id] = seconds
                stage = ahead.stage_of[unit_id]
                self._built_ahead[stage] = max(self._built_ahead.get(stage, 0.0), seconds)

    def drop_ahead(self) -> None:
        """The units building ahead will not be used: the first step after their builds end
        frees them (a build already running cannot be stopped, and the step does not wait)."""
        if self._ahead is not None:
            self._ahead = dataclasses.replace(self._ahead, unwanted=True)

    def building_ahead(self) -> frozenset[int]:
        """Slots still running a build started ahead (finished or failed ones are not)."""
        return self._ahead.pending.running() if self._ahead is not None else frozenset()

    def _frozen_weights(self) -> dict[str, str]:
        weights = self.initial_weights()
        return {f"{role}@inference": str(weights[role]) for role in ("ref", "reward")}

    def _prepare(
        self, engine: UnitEngine, units: dict[str, tuple[Unit, ...]], workload: PpoWorkload
    ) -> tuple[dict[str, float], _Joining | None]:
        """Create, collectively over the pool, the groups and meshes these units need, and build
        the derived units' workspaces; returns, per stage, the longest a new unit took, and the
        joining generation units, whose builds it starts and leaves running (``_joining``)."""
        every = [u for group in units.values() for u in group]
        dp_groups = self._dp_groups(units)
        key = (tuple(sorted(u.unit_id + str(u.slots) for u in every)), tuple(sorted(dp_groups)))
        if self._ahead is not None and (
            key not in self._grouped  # groups are made on every slot: let the builds end first
            or {s for u in every for s in u.slots} & set(self._ahead.pending.slots)  # needed
            or (self._ahead.unwanted and not self._ahead.pending.running())  # to be freed
        ):
            self.finish_ahead()  # ended, their slots are among the live ones below, whose
            # workspaces of units this step does not use are dropped
        rebuild_s, self._built_ahead = self._built_ahead, {}
        building = set(self._ahead.pending.slots) if self._ahead is not None else set()
        # Slots still building ahead hold nothing this step uses: leave them to it.
        live = sorted(set(range(engine.pool.num_slots)) - engine.lost_slots - building)
        if key not in self._grouped:
            # Creating a group is collective over the whole pool, in the same order on every
            # process, members or not: a lost slot's replacement process takes part too.
            engine.pool.run(checkpoint.ensure_unit_groups, units=every)
            engine.prepare_groups(dp_groups)
            self._grouped.add(key)
        # A unit with members still building keeps its workspace on the live ones too (all or
        # none of a unit's members hold it: see ``keep_workspaces``).
        engine.pool.run(slot_work.keep_workspaces, on=live, units=every, building=sorted(building))
        self._built &= {slot_work.workspace_key(u) for u in every}
        stage_of = {
            u.unit_id: ms.stage
            for ms in workload.model_stages()
            if not persists(ms)
            for u in units[ms.name]
        }
        new = [
            u
            for u in every
            if u.unit_id in stage_of and slot_work.workspace_key(u) not in self._built
        ]
        joining = self._joining(units, new)
        # New derived units (a transition's, or the first step's) are built now, every slot at
        # once, rather than one after another when each stage first syncs weights into them;
        # those joining, while the step generates.
        derived = sorted((u for u in new if u not in joining), key=_build_key)
        for took in engine.pool.run(
            slot_work.build_workspaces, on=live, units=derived, frozen=self._frozen_weights()
        ):
            for unit_id, seconds in took.items():
                stage = stage_of[unit_id]
                rebuild_s[stage] = max(rebuild_s.get(stage, 0.0), seconds)
        self._built.update(slot_work.workspace_key(u) for u in derived)
        if not joining:
            return rebuild_s, None
        joining = tuple(sorted(joining, key=_build_key))
        pending = engine.pool.start(
            slot_work.build_workspaces,
            on=sorted({s for u in joining for s in u.slots}),
            units=list(joining),
            frozen=self._frozen_weights(),
        )
        return rebuild_s, _Joining(units=joining, pending=pending, stage_of=stage_of)

    @staticmethod
    def _joining(units: dict[str, tuple[Unit, ...]], new: list[Unit]) -> tuple[Unit, ...]:
        """Of the derived units not built yet (``new``), those built while the step generates
        on the generation units that are built (``TransitionDag.joining``): new generation
        units join from the next step, and the inference stage waits for its units."""
        generating = {s for u in units["actor@generation"] if u not in new for s in u.slots}
        keys = joining_units(
            generating,
            [(u.model_stage, u.slots) for u in new],
            [u.slots for u in units["actor@training"]],
        )
        return tuple(u for u in new if (u.model_stage, u.slots) in keys)

    @staticmethod
    def _dp_groups(units) -> list[tuple[int, ...]]:
        """Training's groups: each position across the data-parallel units (gradients) and each
        tensor rank's chain of pipeline stages (the pipeline schedule)."""
        out = []
        for name, group in units.items():
            if not name.endswith("@training"):
                continue
            if len(group) > 1:
                out += [tuple(u.slots[i] for u in group) for i in range(len(group[0].slots))]
            for unit in group:
                tp, pp = unit.layout.tp, unit.layout.pp
                if pp > 1:
                    out += [tuple(unit.slots[p * tp + t] for p in range(pp)) for t in range(tp)]
        return out

    def _sync(self, engine: UnitEngine, *pairs: tuple[tuple[Unit, ...], tuple[Unit, ...]]) -> int:
        """Each pair's training units' parameters into the workspaces of its target units: every
        target at once, in one call on the slots involved."""
        syncs = []
        for sources, targets in pairs:
            source_of: dict[int, Unit] = {}
            held = {}
            for unit in sources:
                for position, slot in enumerate(unit.slots):
                    source_of[slot] = unit
                    held[slot] = [s for s in unit.layout.shards(position) if "::" not in s.key]
            for target in targets:
                wanted = {
                    slot: target.layout.shards(position)
                    for position, slot in enumerate(target.slots)
                }
                copies = plan_copies(held, wanted)
                syncs.append(slot_work.TargetSync(copies=copies, sources=source_of, target=target))
        slots = sorted({s for sync in syncs for c in sync.copies for s in (c.src_slot, c.dst_slot)})
        if not slots:
            return 0
        return sum(engine.pool.run(slot_work.sync_weights, on=slots, syncs=syncs))

    def step(self, engine: UnitEngine, plan: Plan, workload: PpoWorkload, step: int) -> StepReport:
        """One PPO step on ``plan``. ``step`` is the caller's count; the data, the sampling and
        the update are those of the job's own next step (behind it after a resume)."""
        self.check_plan(plan, workload)
        self.updating = False
        reported, step = step, self.state.next_step
        c = self.config
        started = time.perf_counter()
        units = self.units_for(engine, plan, workload)
        rebuild_s, joining = self._prepare(engine, units, workload)
        stage_s: dict[str, float] = {}
        self._measured: dict[str, float] = {}

        # 1. generation, on the units that are built (``_joining``)
        t0 = time.perf_counter()
        prompts = self.tasks.sample(c.batch_size, seed=_step_seed(c.seed, step, 0))
        params = c.sampling(_step_seed(c.seed, step, 1))
        ran, generators, training = plan, units["actor@generation"], units["actor@training"]
        if joining is not None:
            generators = tuple(u for u in generators if u not in joining.units)
            ran = on_ready(
                plan,
                workload,
                default_catalog().accelerator(plan.accelerator),
                {(u.model_stage, u.slots) for u in joining.units},
            )
            # Weights from the training units off the building slots.
            building = set(joining.pending.slots)
            training = tuple(u for u in training if not building & set(u.slots))
        sync_bytes = self._sync(engine, (training, generators))
        micro_batches = ran.micro_batches(workload.micro_batch)
        rollout = self._generate(
            engine, generators, prompts, params, micro_batches["actor@generation"]
        )
        self._measured["actor@generation"] = time.perf_counter() - t0
        if joining is not None:  # the next stages run on every slot: the builds end first
            for took in joining.pending.wait():
                for unit_id, seconds in took.items():
                    stage = joining.stage_of[unit_id]
                    rebuild_s[stage] = max(rebuild_s.get(stage, 0.0), seconds)
            self._built.update(slot_work.workspace_key(u) for u in joining.units)
        stage_s["generation"] = time.perf_counter() - t0

        # 2. inference
        t0 = time.perf_counter()
        sync_bytes += self._sync(
            engine,
            (units["actor@training"], units["actor@inference"]),
            (units["critic@training"], units["critic@inference"]),
        )
        scored = self._infer(
            engine,
            units,
            rollout,
            modes={s.stage: s.mode for s in plan.stages},
            micro_batches=micro_batches,
        )
        sequences, mask = rollout["sequences"], rollout["response_mask"].float()
        if self.reward is None:
            scores = scored["reward"]
        else:
            scores = torch.tensor(
                [self.reward(p, r) for p, r in zip(prompts, rollout["responses"], strict=True)]
            )
        kl_coef = self.kl.value
        rewards, kl = ppo.kl_penalized_rewards(
            scores, scored["actor"], scored["ref"], mask, kl_coef=kl_coef
        )
        advantages, returns = ppo.gae(
            rewards, scored["critic"], mask, gamma=c.ppo.gamma, lam=c.ppo.lam
        )
        if c.ppo.whiten_advantages:
            advantages = ppo.masked_whiten(advantages, mask)
        _check_finite(step, None, rewards=scores)
        _check_finite(
            step,
            mask,
            actor_logprobs=scored["actor"],
            ref_logprobs=scored["ref"],
            values=scored["critic"],
            advantages=advantages,
        )
        stage_s["inference"] = time.perf_counter() - t0

        # 3. training
        t0 = time.perf_counter()
        self.updating = True
        totals = self._train(
            engine,
            units,
            micro_batches,
            sequences=sequences,
            attention_mask=rollout["attention_mask"],
            prompt_length=rollout["prompt_length"],
            mask=mask,
            old_logprobs=scored["actor"],
            old_values=scored["critic"],
            advantages=advantages,
            returns=returns,
        )
        for name in ("actor@training", "critic@training"):
            for unit in units[name]:
                engine.verified.pop(unit.unit_id, None)  # its state changed
        if totals.pop("nonfinite_updates", 0.0) or not all(map(math.isfinite, totals.values())):
            raise NonFiniteError(
                f"step {step}: the training loss is not finite ({_shown(totals)}); the updates "
                "it reached were not made, and nothing of this step is saved"
            )
        stage_s["training"] = time.perf_counter() - t0

        mean_kl = float(kl.sum(dim=1).mean())
        self.kl.update(mean_kl, c.batch_size)
        lengths = rollout["response_mask"].sum(dim=1).float()
        stats = StepStats(
            step=step,
            mean_reward=float(scores.mean()),
            kl=mean_kl,
            kl_coef=kl_coef,
            mean_response_length=float(lengths.mean()),
            **totals,
        )
        self.stats.append(stats)
        samples = self._samples(ran, workload, stage_s["training"])
        self.state.next_step = step + 1
        self.state.kl_coef = self.kl.value
        peak = max(m["peak_bytes"] for m in self._memory(engine))
        # The update is whole: the units are at the next step's boundary, and a failure while
        # they are saved (a slot lost, a disk full) leaves them so.
        self.updating = False
        if c.checkpoint_every and (step + 1) % c.checkpoint_every == 0:
            self.save_checkpoint(engine)
        return StepReport(
            step=reported,
            ok=True,
            seconds=time.perf_counter() - started,
            gen_len=float(lengths.mean()),
            stage_seconds=stage_s,
            peak_memory=peak / default_catalog().accelerator(plan.accelerator).memory_bytes,
            samples=samples,
            rebuild_seconds=rebuild_s,
            extra={
                "stats": stats.to_json(),
                "sync_bytes": sync_bytes,
                "ppo_step": step,
                "generated_on": [u.unit_id for u in generators],
            },
        )

    def _samples(self, plan: Plan, workload: PpoWorkload, training_s: float):
        """Calibration samples of this step (see ``calibration.samples_from_stages``): at the
        length it generated."""
        measured = dict(self._measured)
        return samples_from_stages(
            plan,
            workload.with_gen_len(self._gen_len_for(workload)),
            default_catalog().accelerator(plan.accelerator),
            measured=measured,
            training_s=training_s,
        )

    def _gen_len_for(self, workload: PpoWorkload) -> int:
        last = self.stats[-1].mean_response_length if self.stats else workload.gen_len
        return max(1, round(last))

    def _memory(self, engine: UnitEngine) -> list[dict]:
        live = sorted(set(range(engine.pool.num_slots)) - engine.lost_slots)
        return [m for i, m in enumerate(engine.pool.memory(reset_peak=True)) if i in live]

    def _generate(self, engine, units, prompts, params, micro_batch: int) -> dict:
        """Each unit samples its share of the prompts, ``micro_batch`` at a time (0: all)."""
        calls = []
        for unit, rows in zip(units, _split(len(prompts), len(units)), strict=True):
            if rows:
                chosen = [list(prompts[r].tokens) for r in rows]
                calls += [
                    (slot, {"unit": unit, "prompts": chosen, "rows": list(rows)})
                    for slot in unit.slots
                ]
        results = engine.pool.run(
            slot_work.generate,
            [kw for _, kw in calls],
            on=[slot for slot, _ in calls],
            params=params,
            pad_token_id=PAD,
            backend=self.config.generation_backend,
            micro_batch=micro_batch,
        )
        parts = sorted((r for r in results if r is not None), key=lambda r: r["rows"][0])
        joined = slot_work.join_responses(parts, PAD)
        response_tokens, response_mask = joined["response_tokens"], joined["response_mask"]
        prompt_tokens, prompt_mask = left_pad(
            [p.tokens for p in prompts], pad_token_id=PAD, device="cpu"
        )
        lengths = response_mask.sum(dim=1)
        return {
            "prompt_length": prompt_tokens.shape[1],
            "sequences": torch.cat((prompt_tokens, response_tokens), dim=1),
            "attention_mask": torch.cat((prompt_mask, response_mask), dim=1),
            "response_mask": response_mask,
            "responses": [
                row[:n].tolist() for row, n in zip(response_tokens, lengths, strict=True)
            ],
        }

    def _infer(self, engine, units, rollout, *, modes, micro_batches) -> dict[str, torch.Tensor]:
        outputs = {"actor": "logprobs", "ref": "logprobs", "critic": "values", "reward": "reward"}
        jobs: list[tuple[str, Callable[[], torch.Tensor]]] = []
        for role, output in outputs.items():
            group = units[f"{role}@inference"]

            def run(group=group, output=output, role=role) -> torch.Tensor:
                calls = []
                for unit, rows in zip(
                    group, _split(len(rollout["responses"]), len(group)), strict=True
                ):
                    if rows:
                        sl = slice(rows.start, rows.stop)
                        kw = {
                            "unit": unit,
                            "sequences": rollout["sequences"][sl],
                            "attention_mask": rollout["attention_mask"][sl],
                        }
                        calls += [(slot, kw) for slot in unit.slots]
                results = engine.pool.run(
                    slot_work.score,
                    [kw for _, kw in calls],
                    on=[slot for slot, _ in calls],
                    prompt_length=rollout["prompt_length"],
                    output=output,
                    micro_batch=micro_batches[f"{role}@inference"],
                    temperature=self.config.temperature,
                )
                return torch.cat([r for r in results if r is not None])

            jobs.append((role, run))
        slots = {role: {s for u in units[f"{role}@inference"] for s in u.slots} for role in outputs}
        disjoint = modes.get("inference") == "disjoint" and all(
            not (slots[a] & slots[b]) for a in outputs for b in outputs if a < b
        )

        def timed(role, run):
            started = time.perf_counter()
            out = run()
            self._measured[f"{role}@inference"] = time.perf_counter() - started
            return out

        if disjoint:  # model-stages on their own slots run at once
            with ThreadPoolExecutor(len(jobs)) as pool:
                futures = {role: pool.submit(timed, role, run) for role, run in jobs}
                return {role: f.result() for role, f in futures.items()}
        return {role: timed(role, run) for role, run in jobs}

    def _train(self, engine, units, micro_batches: dict[str, int], **batch) -> dict[str, float]:
        """One PPO update of actor and critic; each model-stage in the plan's micro-batches.
        A minibatch smaller than the data parallelism (the last, ``batch_size %
        minibatch_size`` rows) leaves some units no rows: they take part in the gradients' sum
        with zeros (``slot_work._train_one``), so the update is the same on any layout."""
        c = self.config
        totals: dict[str, float] = {}
        count = 0
        for rows in ppo.minibatches(
            batch["mask"].shape[0],
            minibatch_size=c.ppo.minibatch_size,
            epochs=c.ppo.epochs,
            generator=self.shuffle,
        ):
            per_slot: dict[int, list] = {}
            tokens_total = float(batch["mask"][rows].sum().clamp(min=1))
            for role in ("actor", "critic"):
                self.state.optimizer_steps[role] += 1
                group = units[f"{role}@training"]
                for unit, part in zip(group, _split(len(rows), len(group)), strict=True):
                    mine = rows[part.start : part.stop]
                    task = slot_work.TrainTask(
                        role=role,
                        unit=unit,
                        dp_group=(),
                        sequences=batch["sequences"][mine],
                        attention_mask=batch["attention_mask"][mine],
                        prompt_length=batch["prompt_length"],
                        mask=batch["mask"][mine],
                        old_logprobs=batch["old_logprobs"][mine],
                        old_values=batch["old_values"][mine],
                        advantages=batch["advantages"][mine],
                        returns=batch["returns"][mine],
                        weight=float(batch["mask"][mine].sum()) / tokens_total,
                        clip_ratio=c.ppo.clip_ratio,
                        value_clip=c.ppo.value_clip,
                        entropy_coef=c.ppo.entropy_coef,
                        lr=c.actor_lr if role == "actor" else c.critic_lr,
                        max_grad_norm=c.max_grad_norm,
                        optimizer_step=self.state.optimizer_steps[role],
                        micro_batch=micro_batches[f"{role}@training"],
                        temperature=c.temperature,
                    )
                    for position, slot in enumerate(unit.slots):
                        dp = tuple(u.slots[position] for u in group)
                        per_slot.setdefault(slot, []).append(dataclasses.replace(task, dp_group=dp))
            slots = sorted(per_slot)
            results = engine.pool.run(
                slot_work.train, [{"tasks": per_slot[s]} for s in slots], on=slots
            )
            for stats in (s for result in results for s in result if s is not None):
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
            count += 1
        return {key: total / count for key, total in totals.items()}

    def regrouped(self) -> None:
        """The slots' group was re-formed: every group and workspace must be made again."""
        self._grouped.clear()
        self._built.clear()
        self._ahead = None  # their groups, and maybe their processes, are gone

    def lost_state(self) -> None:
        """A step failed part-way: the units are gone; a restart resumes from a checkpoint."""
        self._grouped.clear()
        self._built.clear()
        self._ahead = None

    # --- checkpoints ----------------------------------------------------------------------------

    def fence(self) -> None:
        """Raise ``SupersededError`` when another driver has taken the job over: called before the
        job's files (checkpoints, exports) are written. Between steps the driver stops on its
        own; this catches a driver taken over in the middle of a step, which would otherwise
        write a checkpoint or an export after the new driver resumed."""
        if not self.still_current():
            raise SupersededError("another driver took the job over; this one writes nothing more")

    @property
    def checkpoint_root(self) -> Path:
        return self.workdir / "checkpoints"

    def save_checkpoint(self, engine: UnitEngine) -> Path:
        """Save one replica of each training model-stage with DCP and the driver's state, then
        mark the checkpoint committed (a checkpoint without the mark is never resumed from).

        All of it is written into a hidden folder beside ``step-N/`` that is renamed into place
        once complete and on disk (``files.replace_folder``), so a driver killed while saving
        leaves no ``step-N/`` or the whole of one, never a mix of two writers' files. Only the
        job's current driver saves (``fence``)."""
        self.fence()
        self.finish_ahead()  # the groups below are made on every slot
        step = self.state.next_step
        root = self.checkpoint_root / f"step-{step:06d}"
        files.sweep_leftovers(root)
        partial = root.with_name(f".{root.name}.partial-{uuid.uuid4().hex[:8]}")
        held: dict[str, Unit] = {}
        for unit in sorted(engine.units.values(), key=lambda u: u.unit_id):
            held.setdefault(unit.model_stage, unit)
        try:
            engine.pool.run(checkpoint.ensure_unit_groups, units=list(held.values()))
            for name, unit in held.items():
                path = partial / name.replace("@", "_")
                engine.pool.run(checkpoint.save_unit, on=unit.slots, unit=unit, path=str(path))
            self.save_state(partial / "state.json")
            sums = {name: f"{engine.checksum(unit):#018x}" for name, unit in held.items()}
            mark = {"step": step, "units": sorted(held), "checksums": sums}
            files.write_file(partial / export.COMMITTED, json.dumps(mark))
            self.fence()  # a driver superseded while it saved leaves the folder unused
            files.replace_folder(partial, root)
        except SlotError as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise SlotError(f"saving checkpoint {root}: {exc}") from exc
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return root

    def last_checkpoint(self) -> Checkpoint | None:
        """The newest committed checkpoint whose mark reads whole, or None."""
        return next(iter(self.checkpoints()), None)

    def checkpoints(self) -> list[Checkpoint]:
        """The committed checkpoints whose mark reads whole, newest first (a restart falls back
        to an older one where a newer one cannot be loaded)."""
        return [
            Checkpoint(
                step=c.step,
                units={name: c.folder / name.replace("@", "_") for name in c.units},
                state=c.folder / "state.json",
                checksums=c.checksums,
            )
            for c in reversed(export.committed_checkpoints(self.checkpoint_root))
        ]

    def read_state(self, path: Path) -> dict:
        """The driver's state saved at ``path``, checked whole (``UnusableCheckpointError`` naming the
        file otherwise), before any unit is loaded beside it."""
        try:
            data = json.loads(path.read_text())
            JobState(**data)
            torch.tensor(data["shuffle_state"], dtype=torch.uint8)
            float(data["kl_coef"])
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise UnusableCheckpointError(f"{path}: unreadable driver state ({exc})") from exc
        return data

    def resume(self, ckpt: Checkpoint) -> None:
        """Take the driver's state from ``ckpt`` (its units were loaded by the engine)."""
        self.load_state(ckpt.state)
        del self.stats[ckpt.step :]
        self._grouped.clear()
        self._built.clear()

    def release(self, engine: UnitEngine) -> None:
        """Drop this job's workspaces on every live slot (its units are the engine's to free)."""
        live = sorted(set(range(engine.pool.num_slots)) - engine.lost_slots)
        engine.pool.run(slot_work.keep_workspaces, on=live, units=[])
        self._grouped.clear()
        self._built.clear()

    # --- the trained model ----------------------------------------------------------------------

    @property
    def export_root(self) -> Path:
        return self.workdir / "export"

    def export(self, engine: UnitEngine, role: str = "actor") -> Path:
        """Write ``role``'s weights, as its units hold them now, as a Hugging Face folder under
        ``export_root`` (``runtime.ppo.export``); returns the folder."""
        if role not in export.ROLES:
            raise export.ExportError(
                f"role: expected one of {', '.join(export.ROLES)}, got {role!r}"
            )
        self.fence()
        self.finish_ahead()  # reading the units makes groups on their slots
        return export.write_hf_folder(
            self.export_root / role,
            self.model,
            self.parameters(engine, role),
            scalar_head=role == "critic",
            dtype="float32",  # the job trains in fp32: nothing is rounded away
            source={"role": role, "step": self.state.next_step, "init_from": self.config.init_from},
            before_replace=self.fence,  # a driver taken over while it wrote leaves nothing
            **self.export_fields(),
        )

    def export_fields(self) -> dict:
        """What a folder of this job's model says beyond its weights (its special tokens)."""
        return {
            "generation": {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD},
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "pad_token_id": PAD,
        }

    # --- state ----------------------------------------------------------------------------------

    def parameters(self, engine: UnitEngine, role: str) -> dict[str, torch.Tensor]:
        """The full parameters of a training model, assembled on the driver from one replica."""
        unit = next(u for u in engine.units.values() if u.model_stage == f"{role}@training")
        pieces: dict[str, list] = {}
        for held in engine.pool.run(slot_work.read_parameters, on=unit.slots, unit=unit):
            for key, pair in held.items():
                pieces.setdefault(key, []).append(pair)
        return assemble(pieces)

    def save_state(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.state.shuffle_state = self.shuffle.get_state().tolist()
        self.state.kl_coef = self.kl.value
        files.write_file(path, json.dumps(self.state.to_json()))

    def load_state(self, path: Path) -> None:
        data = self.read_state(path)
        self.state = JobState(**data)
        self.shuffle.set_state(torch.tensor(data["shuffle_state"], dtype=torch.uint8))
        self.kl.value = data["kl_coef"]


def plan_by_hand(
    workload: PpoWorkload,
    layouts: Mapping[str, tuple[int, int, int]],
    *,
    num_slots: int,
    accelerator: str = CPU_SLOT,
    slots: Mapping[str, tuple[int, ...]] | None = None,
) -> Plan:
    """A plan whose model-stages have the given ``(dp, tp, pp)``, every one's units on consecutive
    slots from slot 0 (or from ``slots[name]``), all stages colocated: for tests, benchmarks
    and fixed-plan runs. A model-stage not named gets ``(1, 1, 1)``."""
    from runtime.planner.plan import Layout

    out = {}
    for ms in workload.model_stages():
        dp, tp, pp = layouts.get(ms.name, (1, 1, 1))
        chosen = (slots or {}).get(ms.name, tuple(range(num_slots)))
        width = tp * pp
        if len(chosen) < dp * width:
            raise ValueError(f"layouts.{ms.name}: ({dp},{tp},{pp}) needs {dp * width} slots")
        units = tuple(tuple(chosen[i * width : (i + 1) * width]) for i in range(dp))
        out[ms.name] = (Layout(dp=dp, tp=tp, pp=pp), units)
    return Plan.of_units(accelerator=accelerator, num_slots=num_slots, layouts=out)


class NonFiniteError(ArithmeticError):
    """A NaN or an infinity in what a step trains on, or in its loss: the job stops before it
    trains on it or saves it (a checkpoint of NaN weights would be resumed from)."""


def _check_finite(step: int, mask: torch.Tensor | None, **tensors: torch.Tensor) -> None:
    """``NonFiniteError`` naming the first of ``tensors`` (per sequence, or per response token
    where ``mask`` is set) holding a NaN or an infinity, and the sequences that do."""
    for name, tensor in tensors.items():
        bad = ~torch.isfinite(tensor)
        if mask is not None:
            bad &= mask.bool()
        if bool(bad.any()):
            rows = sorted({int(i) for i in bad.nonzero()[:, 0]})
            raise NonFiniteError(
                f"step {step}: {name} is not finite for sequences {rows[:8]}"
                f"{' …' if len(rows) > 8 else ''}; the step trains on nothing of it"
            )


def _shown(values: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.4g}" for key, value in sorted(values.items()))
