"""The cluster twin: one PPO step, a transition's primitives, a restart, on a simulated cluster.

A step is played from the plan's units and the step's sequences, each with its own response
length:

- **Generation**: the actor's training weights are resharded into each generation unit's layout
  (every training rank sends its shard to every replica that needs it, over the links between
  them); each unit then serves its share of the prompts (``serving``), its KV cache sized from
  what its fullest slot has free. The stage lasts as long as its slowest unit.
- **Inference**: the actor's and critic's inference units are resharded from their training
  units, the reference and reward models gathered from the shards they rest in over the pool;
  each unit forwards its sequences in micro-batches padded to their longest, through its
  pipeline (``pipeline.forward_only``).
- **Training**: per PPO epoch and minibatch, each unit runs its micro-batches through the 1F1B
  schedule (``pipeline.one_f_one_b``), then the data-parallel replicas all-reduce their fp32
  gradients and step Adam. Replicas wait for the slowest.
- A stage's model-stages run one after another (colocated) or at once (disjoint), where
  model-stages whose groups cross nodes share the fabric and slow each other (``contention``),
  and CPU slots share the host's cores.
- **Memory**: every slot holds the actor's and critic's training state and its share of the
  frozen models at rest; each stage adds its own (weights, KV cache, activations of the
  micro-batches in flight, fp32 logits). The allocator fails a step in which a slot's peak
  passes the device's memory (less what the runtime reserves).
- **The world moving**: inter-node links slow along a wave of other tenants' traffic
  (``interference``), and every model-stage's time has lognormal noise.

What it leaves out: overlap of the data-parallel all-reduce with the backward pass, sequence
packing, speculative decoding, prefix caching, the optimizer's all-gather under ZeRO, failures of
links (only whole slots fail), NUMA and PCIe topology inside a node, and GPU clock throttling.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence

from runtime.emu.primitives import Destroy, Extend, Merge, Split
from runtime.planner.catalog import ModelConfig
from runtime.planner.plan import Plan
from runtime.planner.workload import PpoWorkload
from runtime.transition.units import bytes_on
from runtime.twin import kernels, layers, pipeline, serving
from runtime.twin.hardware import Device, Link
from runtime.twin.layers import Shard

ADAM_BYTES = 12
"""fp32 master weights and Adam's two moments, per parameter."""
GRAD_BYTES = 4
"""fp32 gradients per parameter (reduced and applied in fp32)."""
OPTIMIZER_BYTES = 36
"""Bytes an Adam step streams per parameter: gradient, master, moments read; master, moments,
weight written."""
SERVING_UTILISATION = 0.9
"""Of a device, what a serving engine takes for its weights and KV cache (vLLM's
``gpu_memory_utilization``)."""
TENSORS_PER_LAYER = 9
"""Parameter tensors of a Llama layer: each is sent in a reshard as a message of its own."""
TRAINED = ("actor", "critic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TwinStep:
    """One step as the twin played it."""

    model_stage_seconds: dict[str, float]
    stage_seconds: dict[str, float]
    peak_fraction: float
    """The fullest slot's peak over its device's memory (what a device's monitor reports)."""
    failure: str = ""
    """Why the step could not run (out of memory), or empty."""
    preempted: int = 0
    """Sequences the generation units' KV caches preempted."""

    @property
    def seconds(self) -> float:
        return sum(self.stage_seconds.values())


def _share(items: Sequence[int], parts: int) -> list[list[int]]:
    """``items`` cut into ``parts`` contiguous shares, as a batch is scattered over replicas."""
    size = math.ceil(len(items) / parts) if items else 0
    return [list(items[i * size : (i + 1) * size]) for i in range(parts)]


PAD_TO = 64
"""Tokens a micro-batch's sequences are padded to a multiple of (beyond its longest)."""


def _padded(tokens: int) -> int:
    return -(-tokens // PAD_TO) * PAD_TO


def _micro_batches(lengths: Sequence[int], size: int) -> list[list[int]]:
    return [list(lengths[i : i + size]) for i in range(0, len(lengths), max(1, size))]


@dataclasses.dataclass
class ClusterTwin:
    """A simulated cluster of ``device`` slots."""

    device: Device
    seed: int = 0
    noise: float = 0.03
    interference: float = 0.3
    """How much slower inter-node links get at the crest of other tenants' traffic."""
    interference_period_s: float = 4 * 3600.0
    contention: float = 0.25
    """Slow-down of inter-node collectives per other model-stage crossing nodes at once."""
    phase: float = 0.0

    @classmethod
    def draw(cls, device: Device, seed: int, **overrides) -> ClusterTwin:
        """A cluster whose tenants' traffic starts at a phase drawn from ``seed``."""
        rng = random.Random(f"twin:{seed}")
        fields = {"phase": rng.uniform(0, 2 * math.pi)}
        fields.update(overrides)
        return cls(device=device, seed=seed, **fields)

    # --- the world ------------------------------------------------------------------------------

    def inter_slow(self, at_s: float) -> float:
        """How much slower inter-node links are at simulated time ``at_s``."""
        wave = 0.5 * (1 - math.cos(2 * math.pi * at_s / self.interference_period_s + self.phase))
        return 1 + self.interference * wave

    def _slow(self, link: Link, at_s: float, sharing: int = 1) -> float:
        """How much slower ``link`` is now (to 1%: the twin remembers passes by their shape)."""
        if link.inter:
            slow = self.inter_slow(at_s) * (1 + self.contention * max(0, sharing - 1))
            return round(slow, 2)
        return 1.0

    # --- a step ---------------------------------------------------------------------------------

    def step(
        self,
        plan: Plan,
        workload: PpoWorkload,
        *,
        lengths: Sequence[int],
        at_s: float = 0.0,
        backend: str = "continuous",
        rng: random.Random | None = None,
    ) -> TwinStep:
        """The step ``plan`` runs for sequences whose responses have ``lengths`` tokens, at
        simulated time ``at_s``; ``rng``: draw each model-stage's noise from it (None: none).
        ``backend``: ``continuous`` (a serving engine) or ``static`` (a plain decode loop)."""
        if backend in ("torch",):
            backend = "static"
        elif backend in ("vllm",):
            backend = "continuous"
        if backend not in ("continuous", "static"):
            raise ValueError(f"backend: expected 'continuous' or 'static', got {backend!r}")
        if len(lengths) != workload.global_batch:
            raise ValueError(
                f"lengths: {len(lengths)} responses for a batch of {workload.global_batch}"
            )
        run = _Step(self, plan, workload, [max(1, int(n)) for n in lengths], at_s, backend)
        seconds = run.model_stage_seconds()
        if rng is not None and self.noise:
            seconds = {k: v * math.exp(rng.gauss(0, self.noise)) for k, v in seconds.items()}
        modes = {s.stage: s.mode for s in plan.stages}
        stages: dict[str, float] = {}
        for ms in workload.model_stages():
            t = seconds.get(ms.name, 0.0)
            if modes.get(ms.stage, "colocated") == "disjoint":
                stages[ms.stage] = max(stages.get(ms.stage, 0.0), t)
            else:
                stages[ms.stage] = stages.get(ms.stage, 0.0) + t
        failure = run.failure
        peak = run.peak_bytes()
        if not failure and peak > run.capacity():
            slot, name = run.fullest
            failure = (
                f"out of memory on slot {slot} in {name}: {peak / 2**30:.1f} GiB of the "
                f"{run.capacity() / 2**30:.1f} GiB a step may use (simulated)"
            )
        return TwinStep(
            model_stage_seconds=seconds,
            stage_seconds=stages,
            peak_fraction=peak / self.device.hbm_bytes,
            failure=failure,
            preempted=run.preempted,
        )


class _Step:
    """The arithmetic of one step (see ``ClusterTwin.step``)."""

    def __init__(self, twin, plan, workload, lengths, at_s, backend):
        self.twin, self.dev = twin, twin.device
        self.plan, self.w = plan, workload
        self.lengths, self.at_s, self.backend = lengths, at_s, backend
        self.b = workload.bytes_per_value
        self.failure = ""
        self.preempted = 0
        self._shards: dict[tuple[str, str], list[Shard]] = {}
        self.usage: dict[int, dict[str, float]] = {}
        """slot -> model-stage -> its bytes there beside the resident ones (a stage's
        model-stages run one after another on a slot, or on other slots)."""
        self.resident = self._resident()
        self.fullest = (0, "")

    # --- placement ----------------------------------------------------------------------------

    def units(self, name: str) -> tuple[tuple[int, ...], ...]:
        return self.plan.model_stage(name).units

    def layout(self, name: str):
        return self.plan.model_stage(name).layout

    def model(self, role: str) -> ModelConfig:
        return self.w.models[role]

    def shards(self, role: str, name: str) -> list[Shard]:
        if (role, name) not in self._shards:
            self._shards[(role, name)] = self._make_shards(role, name)
        return self._shards[(role, name)]

    def _make_shards(self, role: str, name: str) -> list[Shard]:
        lay = self.layout(name)
        return [
            Shard.of(
                self.model(role),
                lay.tp,
                lay.pp,
                p,
                scalar_head=role in ("critic", "reward"),
                nbytes=self.b,
            )
            for p in range(lay.pp)
        ]

    def _concurrent(self, stage: str, name: str) -> tuple[int, int]:
        """(slots computing at once, model-stages crossing nodes at once) while ``name`` runs."""
        modes = {s.stage: s.mode for s in self.plan.stages}
        together = modes.get(stage) == "disjoint"
        names = [ms.name for ms in self.w.model_stages(stage)] if together else [name]
        busy = set()
        crossing = 0
        for n in names:
            slots = {s for u in self.units(n) for s in u}
            busy |= slots
            if self.dev.link(slots).inter:
                crossing += 1
        return len(busy), max(1, crossing)

    def _slowdown(self, busy: int) -> float:
        """How much slower a slot computes with ``busy`` slots sharing the host's cores."""
        if not math.isfinite(self.dev.cores):
            return 1.0
        table = self.dev.sharing
        if 1 <= busy <= len(table):
            return max(1.0, table[busy - 1])
        beyond = table[-1] * busy / len(table) if table else busy / self.dev.cores
        return max(1.0, beyond)

    def _width(self, micro: Sequence[int]) -> int:
        """Tokens each sequence of a micro-batch is padded to: its longest (a serving engine's
        rollouts, regrouped), or the whole batch's longest (a plain decode loop's rollout is one
        padded tensor, cut into micro-batches as it is)."""
        longest = self.w.prompt_len + (
            max(self.lengths) if self.backend == "static" else max(micro)
        )
        return longest if math.isfinite(self.dev.cores) else _padded(longest)

    # --- memory ---------------------------------------------------------------------------------

    def _resident(self) -> dict[int, float]:
        """Bytes each slot holds through the whole step: training state and frozen models."""
        out: dict[int, float] = dict.fromkeys(range(self.plan.num_slots), 0.0)
        for role in TRAINED:
            name = f"{role}@training"
            lay = self.layout(name)
            shards = self.shards(role, name)
            opt = ADAM_BYTES / (lay.dp if self.w.distributed_optimizer else 1)
            for unit in self.units(name):
                for pos, slot in enumerate(unit):
                    params = shards[pos // lay.tp].params
                    out[slot] = out.get(slot, 0.0) + params * (self.b + GRAD_BYTES + opt)
        frozen = sum(self.model(r).num_params(scalar_head=r == "reward") for r in ("ref", "reward"))
        for slot in out:
            out[slot] += frozen * self.b / self.plan.num_slots
        return out

    def _use(self, slot: int, name: str, nbytes: float) -> None:
        per = self.usage.setdefault(slot, {})
        per[name] = max(per.get(name, 0.0), nbytes)

    def capacity(self) -> float:
        """Bytes a step may use on a slot: the device less what its runtime reserves."""
        return self.dev.hbm_bytes - self.dev.reserved_bytes

    def peak_bytes(self) -> float:
        """The fullest slot's peak (and which slot, in which model-stage: ``fullest``)."""
        worst = 0.0
        for slot, base in self.resident.items():
            for name, extra in self.usage.get(slot, {"": 0.0}).items():
                if base + extra > worst:
                    worst, self.fullest = base + extra, (slot, name or "the step")
        return worst

    # --- moving weights -------------------------------------------------------------------------

    def reshard_s(self, source: str, target: str, role: str, stage: str) -> float:
        """Seconds to build ``target``'s units from ``source``'s slots (every receiving slot
        takes its shard; every source slot sends what its replicas need), tensor by tensor."""
        src_slots = [s for u in self.units(source) for s in u]
        dst_units = self.units(target)
        shards = self.shards(role, target)
        lay = self.layout(target)
        biggest = max(sh.params for sh in shards) * self.b
        everything = set(src_slots) | {s for u in dst_units for s in u}
        link = self.dev.link(everything)
        _, crossing = self._concurrent(stage, target)
        bw = link.bus_bytes_per_s / self.twin._slow(link, self.at_s, crossing)
        total = sum(sh.params for sh in shards) * self.b * lay.tp * len(dst_units)
        out_per_source = total / max(1, len(src_slots))
        messages = TENSORS_PER_LAYER * self.model(role).num_layers / lay.pp
        same = set(src_slots) == {s for u in dst_units for s in u} and (
            self.layout(source).tp,
            self.layout(source).pp,
        ) == (lay.tp, lay.pp)
        move = 0.0 if same else max(biggest, out_per_source) / bw + messages * link.latency_s
        copy = kernels.stream(self.dev, 2 * biggest, kernels=round(messages))
        return move + copy.seconds(self.dev) + 2 * self.dev.call_s

    # --- the stages -----------------------------------------------------------------------------

    def model_stage_seconds(self) -> dict[str, float]:
        out = {"actor@generation": self.generation()}
        for role in ("actor", "ref", "critic", "reward"):
            out[f"{role}@inference"] = self.inference(role)
        for role in TRAINED:
            out[f"{role}@training"] = self.training(role)
        return out

    def generation(self) -> float:
        name = "actor@generation"
        lay = self.layout(name)
        shards = self.shards("actor", name)
        busy, crossing = self._concurrent("generation", name)
        slow = self._slowdown(busy)
        sync = self.reshard_s("actor@training", name, "actor", "generation")
        prompt = self.w.prompt_len
        usable = (
            self.capacity()
            if self.backend == "static"
            else (self.dev.hbm_bytes * SERVING_UTILISATION - self.dev.reserved_bytes)
        )
        slowest = 0.0
        max_seqs = self.plan.model_stage(name).micro_batch
        for unit, share in zip(self.units(name), _share(self.lengths, lay.dp), strict=True):
            if not share:
                continue
            stages = [unit[p * lay.tp : (p + 1) * lay.tp] for p in range(lay.pp)]
            weights = [sh.params * self.b for sh in shards]
            free = min(
                usable - self.resident[s] - weights[p]
                for p, group in enumerate(stages)
                for s in group
            )
            try:
                took, pre, held = serve_unit(
                    self.twin,
                    shards,
                    unit,
                    share,
                    prompt=prompt,
                    max_seqs=max_seqs,
                    free_bytes=free,
                    backend=self.backend,
                    at_s=self.at_s,
                    crossing=crossing,
                    slowdown=slow,
                    gen_micro_batch=self.w.gen_micro_batch,
                )
                self.preempted += pre
            except serving.DoesNotFitError as exc:
                self.failure = self.failure or f"out of memory in {name}: {exc} (simulated)"
                took, held = 0.0, 0
            for p, group in enumerate(stages):
                for s in group:
                    self._use(s, name, weights[p] + held * shards[p].kv_bytes_per_token)
            slowest = max(slowest, took)
        return sync + slowest + 2 * self.dev.call_s

    def _forward_unit(self, shards, unit, lay, share, mb, crossing, slow):
        """One unit's forward of its share, micro-batch by micro-batch through its pipeline;
        and its activations' peak on each stage."""
        h = shards[0].model.hidden_size
        stages = [unit[p * lay.tp : (p + 1) * lay.tp] for p in range(lay.pp)]
        tp_links = [self.dev.link(g) for g in stages]
        pp_link = self.dev.link(unit)
        fwd = [[] for _ in stages]
        sends = 0.0
        peak = [0.0] * lay.pp
        for micro in _micro_batches(share, mb):
            longest = self._width(micro)
            tokens = float(len(micro) * longest)
            for p, (sh, link) in enumerate(zip(shards, tp_links, strict=True)):
                s = self.twin._slow(link, self.at_s, crossing)
                fwd[p].append(
                    layers.forward_s(
                        self.dev, sh, tokens, float(len(micro) * longest**2), link, s, slow
                    )
                )
                peak[p] = max(peak[p], _activations(sh, tokens, inference=True))
            sends = max(sends, kernels.send(pp_link, tokens * h * self.b))
        return fwd, sends, stages, peak

    def inference(self, role: str) -> float:
        name = f"{role}@inference"
        lay = self.layout(name)
        shards = self.shards(role, name)
        busy, crossing = self._concurrent("inference", name)
        slow = self._slowdown(busy)
        if role in TRAINED:
            prep = self.reshard_s(f"{role}@training", name, role, "inference")
        else:
            prep = self.gather_frozen_s(role, name, crossing)
        mb = self.plan.model_stage(name).micro_batch or self.w.micro_batch
        slowest = 0.0
        for unit, share in zip(self.units(name), _share(self.lengths, lay.dp), strict=True):
            if not share:
                continue
            fwd, send_s, stages, peak = self._forward_unit(
                shards, unit, lay, share, min(mb, len(share)), crossing, slow
            )
            slowest = max(slowest, pipeline.forward_only(fwd, send_s))
            for p, group in enumerate(stages):
                for s in group:
                    self._use(s, name, shards[p].params * self.b + peak[p])
        return prep + slowest + 2 * self.dev.call_s

    def gather_frozen_s(self, role: str, name: str, crossing: int) -> float:
        """Seconds to assemble a frozen model's units from its shards at rest over the pool."""
        lay = self.layout(name)
        shards = self.shards(role, name)
        slots = {s for u in self.units(name) for s in u} | set(range(self.plan.num_slots))
        link = self.dev.link(slots)
        nbytes = max(sh.params for sh in shards) * self.b
        slow = self.twin._slow(link, self.at_s, crossing)
        messages = TENSORS_PER_LAYER * self.model(role).num_layers / lay.pp
        move = kernels.all_gather(link, nbytes, min(self.plan.num_slots, 64), slow=slow)
        return move + messages * link.latency_s + 2 * self.dev.call_s

    def training(self, role: str) -> float:
        name = f"{role}@training"
        lay = self.layout(name)
        shards = self.shards(role, name)
        busy, crossing = self._concurrent("training", name)
        slow = self._slowdown(busy)
        w = self.w
        mb = self.plan.model_stage(name).micro_batch or w.micro_batch
        units = self.units(name)
        h = shards[0].model.hidden_size
        minibatch = math.ceil(len(self.lengths) / w.ppo_minibatches)
        total = 0.0
        peak = [0.0] * lay.pp
        grads = [sh.params * GRAD_BYTES for sh in shards]
        priced: dict[tuple, tuple[list[float], list[float], list[float], float]] = {}

        def micro_batch(links, pp_link, count: int, longest: int):
            """Per stage: forward and backward seconds and activations of one micro-batch of
            ``count`` sequences padded to ``longest`` tokens, and its message between stages."""
            key = (tuple(link.key for link in links), pp_link.key, count, longest)
            if key not in priced:
                tokens = float(count * longest)
                sq = float(count * longest**2)
                fwd, bwd, act = [], [], []
                for sh, link in zip(shards, links, strict=True):
                    s = self.twin._slow(link, self.at_s, crossing)
                    fwd.append(layers.forward_s(self.dev, sh, tokens, sq, link, s, slow))
                    bwd.append(
                        layers.backward_s(self.dev, sh, tokens, sq, link, s, slow, w.recompute)
                    )
                    act.append(_activations(sh, tokens, recompute=w.recompute))
                priced[key] = (fwd, bwd, act, kernels.send(pp_link, tokens * h * self.b))
            return priced[key]

        for _ in range(w.ppo_epochs):
            for k in range(w.ppo_minibatches):
                batch = self.lengths[k * minibatch : (k + 1) * minibatch]
                slowest = 0.0
                for unit, share in zip(units, _share(batch, lay.dp), strict=True):
                    if not share:
                        continue
                    stages = [unit[p * lay.tp : (p + 1) * lay.tp] for p in range(lay.pp)]
                    tp_links = [self.dev.link(g) for g in stages]
                    pp_link = self.dev.link(unit)
                    fwd = [[] for _ in stages]
                    bwd = [[] for _ in stages]
                    send_s = 0.0
                    micros = _micro_batches(share, min(mb, len(share)))
                    for micro in micros:
                        longest = self._width(micro)
                        f, b, act, sent = micro_batch(tp_links, pp_link, len(micro), longest)
                        for p in range(lay.pp):
                            fwd[p].append(f[p])
                            bwd[p].append(b[p])
                            peak[p] = max(peak[p], min(lay.pp - p, len(micros)) * act[p])
                        send_s = max(send_s, sent)
                    slowest = max(slowest, pipeline.one_f_one_b(fwd, bwd, send_s))
                reduce_s = 0.0
                for pos in range(lay.tp * lay.pp):
                    group = [u[pos] for u in units]
                    link = self.dev.link(group)
                    reduce_s = max(
                        reduce_s,
                        kernels.all_reduce(
                            link,
                            grads[pos // lay.tp],
                            lay.dp,
                            slow=self.twin._slow(link, self.at_s, crossing),
                        ),
                    )
                opt = max(sh.params for sh in shards) * OPTIMIZER_BYTES
                if w.distributed_optimizer:
                    opt /= lay.dp
                optimizer_s = kernels.stream(self.dev, opt, kernels=4).seconds(
                    self.dev, slowdown=slow
                )
                total += slowest + reduce_s + optimizer_s + 2 * self.dev.call_s
        for unit in units:
            for pos, s in enumerate(unit):
                self._use(s, name, peak[pos // lay.tp])
        return total


def serve_unit(
    twin: ClusterTwin,
    shards: Sequence[Shard],
    unit: Sequence[int],
    lengths: Sequence[int],
    *,
    prompt: int,
    max_seqs: int,
    free_bytes: float,
    backend: str = "continuous",
    at_s: float = 0.0,
    crossing: int = 1,
    slowdown: float = 1.0,
    gen_micro_batch: int = 64,
) -> tuple[float, int, int]:
    """One generation unit (``shards`` on ``unit``'s slots, stage by stage) serving ``lengths``
    after ``prompt``-token prompts, its KV cache in the ``free_bytes`` its fullest slot has:
    seconds, preemptions, and the most cache tokens held. Raises ``serving.DoesNotFitError``."""
    dev = twin.device
    tp, pp = shards[0].tp, len(shards)
    stages = [unit[p * tp : (p + 1) * tp] for p in range(pp)]
    tp_links = [dev.link(g) for g in stages]
    nbytes = shards[0].nbytes
    send_s = kernels.send(dev.link(unit), gen_micro_batch * shards[0].model.hidden_size * nbytes)
    kv_per_token = max(sh.kv_bytes_per_token for sh in shards)
    kv_tokens = int(max(0.0, free_bytes) // kv_per_token)
    graphs = backend == "continuous"

    def fixed_stage(b: int) -> float:
        device = max(
            layers.decode_s(dev, sh, b, link, graphs, twin._slow(link, at_s, crossing), slowdown)
            for sh, link in zip(shards, tp_links, strict=True)
        )
        host = dev.decode_host_s + dev.decode_host_per_seq_s * b if graphs else 0.0
        return device + host

    kv_stage = max(layers.kv_read_s(dev, sh) for sh in shards)
    if math.isfinite(dev.cores):
        kv_stage *= slowdown
    fixed, kv = serving.pipelined(fixed_stage, kv_stage, pp, send_s)

    def prefill(contexts: Sequence[int]) -> float:
        tokens = float(sum(contexts))
        sq = float(sum(c * c for c in contexts))
        return (
            sum(
                layers.forward(
                    dev, sh, tokens, sq, link, slow=twin._slow(link, at_s, crossing)
                ).seconds(dev, slowdown=slowdown)
                for sh, link in zip(shards, tp_links, strict=True)
            )
            + (pp - 1) * send_s
        )

    costs = serving.Costs(fixed_s=fixed, kv_s=kv, prefill_s=prefill)
    if backend == "static":
        took = serving.static(costs, prompt, lengths, max_seqs=max_seqs, kv_tokens=kv_tokens)
        seats = min(len(lengths), max_seqs or len(lengths))
        return took, 0, seats * (prompt + max(lengths))
    return serving.continuous(costs, prompt, lengths, max_seqs=max_seqs, kv_tokens=kv_tokens)


ACTIVATION_BYTES_PER_HIDDEN = 10.0
ACTIVATION_BYTES_PER_HIDDEN_TP = 24.0
"""A transformer layer keeps ``h (10 + 24 / tp)`` bytes per token for its backward pass with
flash attention (no score matrix) and no sequence parallelism (Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", 2022, table 2, at 2-byte values)."""


def _activations(shard: Shard, tokens: float, *, recompute=False, inference=False) -> float:
    """Bytes of one micro-batch's activations on a rank: kept for backward (all layers, or
    their inputs when recomputed), or a forward's working set (one layer at a time); plus the
    fp32 logits on the last stage."""
    h, tp = shard.model.hidden_size, shard.tp
    per_layer = tokens * h * (ACTIVATION_BYTES_PER_HIDDEN + ACTIVATION_BYTES_PER_HIDDEN_TP / tp)
    if inference:
        kept = per_layer
    elif recompute:
        kept = shard.layers * tokens * h * shard.nbytes + per_layer
    else:
        kept = shard.layers * per_layer
    if shard.last and not shard.scalar_head:
        kept += tokens * shard.model.vocab_size / tp * 4 * 2
    return kept


def lengths_of(mean: float, count: int) -> list[int]:
    """``count`` responses of one length (a trace without a length distribution)."""
    return [max(1, round(mean))] * count


Lengths = Mapping[int, Sequence[int]]


# --- moving state: primitives, builds, restarts, probes ---------------------------------------


def primitive_seconds(twin: ClusterTwin, primitive, *, at_s: float = 0.0) -> float:
    """Seconds one primitive takes on the twin: its messages over the links between its slots,
    the copies and checksums on each slot, and its calls from the driver (group set-up where
    it makes a new group)."""
    dev = twin.device
    calls = 2 * dev.call_s
    if isinstance(primitive, Destroy):
        return calls
    if isinstance(primitive, Merge):
        target = bytes_on(primitive.target())
        return calls + kernels.stream(dev, 2 * max(target.values())).seconds(dev)
    if isinstance(primitive, Split):
        old = bytes_on(primitive.unit)
        slowest = 0.0
        for group in primitive.peer_groups():
            link = dev.link(group)
            width = max(old[s] for s in group)
            move = kernels.all_gather(
                link, len(group) * width, len(group), slow=twin._slow(link, at_s)
            )
            local = kernels.stream(dev, 2 * len(group) * width).seconds(dev)
            slowest = max(slowest, move + local)
        return calls + dev.group_s + slowest
    if isinstance(primitive, Extend):
        source = bytes_on(primitive.source)
        busy: dict[int, float] = {}
        local = 0.0
        for src, dst in primitive.broadcast_groups():
            if src == dst:
                local = max(local, kernels.stream(dev, 2 * source[src]).seconds(dev))
                continue
            link = dev.link((src, dst))
            took = kernels.send(link, source[src], slow=twin._slow(link, at_s))
            for slot in (src, dst):  # a slot in two pairs sends and receives in turn
                busy[slot] = busy.get(slot, 0.0) + took
            local = max(local, kernels.stream(dev, source[src]).seconds(dev))
        return calls + dev.group_s + max(busy.values(), default=0.0) + local
    raise TypeError(f"primitive: not a primitive: {primitive!r}")


def build_seconds(twin: ClusterTwin, stage: str, unit_bytes_per_slot: float, slots) -> float:
    """Seconds to build one derived unit of ``stage`` (generation: a serving engine's start-up,
    graph capture included; inference: a forward-only unit's) on ``slots``, its weights sent from
    the training units."""
    dev = twin.device
    link = dev.link(slots)
    start = dev.serving_start_s if stage == "generation" else dev.unit_start_s
    return start + kernels.send(link, unit_bytes_per_slot) + 2 * dev.call_s


def restart_seconds(twin: ClusterTwin, state_bytes: float, num_slots: int, passes: int) -> float:
    """A checkpoint/restart: processes and communicators again, and ``passes`` trips of the
    persistent state through the nodes' storage bandwidth."""
    dev = twin.device
    nodes = max(1, math.ceil(num_slots / dev.gpus_per_node))
    return dev.restart_s + passes * state_bytes / (dev.storage_bytes_per_s * nodes)


def probe_seconds(twin: ClusterTwin, pattern: str, slots, nbytes: int, *, at_s: float) -> float:
    """One run of a calibration probe alone on its slots: an all-reduce or a send of
    ``nbytes``."""
    dev = twin.device
    link = dev.link(slots)
    slow = twin._slow(link, at_s)
    if pattern == "all_reduce":
        return kernels.all_reduce(link, nbytes, len(slots), slow=slow) + dev.call_s
    return kernels.send(link, nbytes, slow=slow) + dev.call_s
