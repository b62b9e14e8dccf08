"""PPO's work on the slots: each function runs inside a slot actor through ``SlotPool.run``.

A unit of a model-stage is a ``tp × pp`` grid of slots (``runtime.emu.layout``). On each of its
slots the model runs as a *workspace*: the decoder with this pipeline stage's layers in use and its
projections sharded over the stage's tensor-parallel mesh by DTensor (``runtime.ppo.parallel``).
Training runs pipeline-parallel units through ``torch.distributed.pipelining`` (a 1F1B schedule
over each tensor rank's chain of stages, in microbatches; GPipe when there are fewer microbatches
than stages). Inference and generation pass
activations to the same tensor rank of the next stage point to point (a KV-cached decode loop is
not a schedule the library offers), and decoded tokens go from the last stage back to the
earlier ones.

Where the weights come from:

- training units (actor, critic) hold the job's mutable state in the unit store that the
  transition primitives move (``ctx.state["units"]``): parameters and Adam state. Their workspace
  is refreshed from that state before each use; Adam updates the state itself.
- the actor's generation and inference units and the critic's inference units receive the
  training units' parameters every step (``sync_weights``: the reshard planner's copies, local
  where a slot already holds the slice, point to point otherwise).
- the frozen reference and reward models are read from the job's weight file, once per unit.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.emu import checkpoint, slot_ops
from runtime.emu.layout import REPLICATED, ShardSpec
from runtime.emu.primitives import Unit
from runtime.emu.reshard import Copy
from runtime.engine.slots import SlotContext
from runtime.ppo import algorithm as ppo
from runtime.ppo.generate import SamplingParams, filter_logits, left_pad
from runtime.ppo.model import KVCache, attention_mask_4d, build_model
from runtime.ppo.parallel import apply_tensor_parallel

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


# --- workspaces -----------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Workspace:
    """One slot's part of one unit, ready to compute."""

    unit: Unit
    model: nn.Module
    locals: dict[str, torch.Tensor]
    """Key → the local tensor (a DTensor's shard) that holds this position's slice of it."""
    shards: dict[str, ShardSpec]
    replicated: frozenset[str]
    pp_rank: int
    tp_rank: int
    layers: range
    prev_slot: int | None
    next_slot: int | None
    last_stage_slot: int
    """The slot at the last pipeline stage with this slot's tensor rank."""
    earlier_slots: tuple[int, ...]
    """On the last stage: the slots of earlier stages with this tensor rank (they get tokens)."""
    frozen_loaded: bool = False

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.next_slot is None

    @property
    def reports(self) -> bool:
        """The one slot of the unit that returns results to the driver."""
        return self.last and self.tp_rank == 0


def workspace_key(unit: Unit) -> tuple:
    """What names a unit's workspace on a slot (a unit reshaped or moved is another one)."""
    return (unit.unit_id, unit.layout.tp, unit.layout.pp, unit.slots)


def workspace(ctx: SlotContext, unit: Unit) -> Workspace:
    """This slot's workspace of ``unit`` (built on first use; the unit's meshes must exist)."""
    cache = ctx.state.setdefault("ppo_workspaces", {})
    found = cache.get(workspace_key(unit))
    if found is not None:
        return found
    layout = unit.layout
    position = unit.position_of(ctx.rank)
    pp_rank, tp_rank = divmod(position, layout.tp)
    model = build_model(layout.model, scalar_head=layout.scalar_head, seed=0).to(ctx.device)
    if layout.tp > 1:
        apply_tensor_parallel(model, checkpoint._mesh(ctx, unit))
    named = dict(model.named_parameters())
    shards = {s.key: s for s in layout.shards(position) if "::" not in s.key}
    styles = {t.key: t.style for t in layout.tensors()}
    locals_ = {}
    for key in shards:
        param = named[key]
        locals_[key] = param.to_local() if isinstance(param, DTensor) else param.data
    per_stage = layout.model.num_layers // layout.pp

    def at(pp: int) -> int:
        return unit.slots[pp * layout.tp + tp_rank]

    ws = Workspace(
        unit=unit,
        model=model,
        locals=locals_,
        shards=shards,
        replicated=frozenset(k for k in shards if styles[k] == REPLICATED),
        pp_rank=pp_rank,
        tp_rank=tp_rank,
        layers=range(pp_rank * per_stage, (pp_rank + 1) * per_stage),
        prev_slot=at(pp_rank - 1) if pp_rank > 0 else None,
        next_slot=at(pp_rank + 1) if pp_rank < layout.pp - 1 else None,
        last_stage_slot=at(layout.pp - 1),
        earlier_slots=tuple(at(p) for p in range(layout.pp - 1)),
    )
    cache[workspace_key(unit)] = ws
    return ws


def build_workspaces(
    ctx: SlotContext, *, units: list[Unit], frozen: dict[str, str] | None = None
) -> dict[str, float]:
    """Build this slot's workspaces of ``units`` that it has not built yet, in the order given
    (the same on every slot, so that a unit's members meet in its collectives), before the step
    needs them, reading the weights of frozen model-stages (``frozen``: model-stage → weights
    file) into theirs. Returns the seconds each new one took, by unit id, timed from when all its
    members had arrived (not counting the wait for members still building earlier units)."""
    cache = ctx.state.setdefault("ppo_workspaces", {})
    frozen = frozen or {}
    took = {}
    for unit in units:
        if ctx.rank in unit.slots and workspace_key(unit) not in cache:
            if len(unit.slots) > 1:
                dist.barrier(group=checkpoint._group(ctx, unit.slots))
            started = time.perf_counter()
            workspace(ctx, unit)
            if unit.model_stage in frozen:
                load_frozen(ctx, unit=unit, path=frozen[unit.model_stage])
            took[unit.unit_id] = time.perf_counter() - started
    return took


def workspaces(ctx: SlotContext) -> list[str]:
    """The unit ids of the workspaces this slot holds."""
    return sorted(key[0] for key in ctx.state.get("ppo_workspaces", {}))


def keep_workspaces(ctx: SlotContext, *, units: list[Unit], building: Sequence[int] = ()) -> int:
    """Drop the workspaces of units not in ``units`` (replaced by a transition); returns the count.

    A workspace whose unit has a member among ``building`` (slots still running a build, which
    this call does not reach) is kept: a unit's workspace goes on all of its members at once or
    on none, since ``build_workspaces`` skips members that hold it and the others would wait at
    the unit's barrier alone. A later call, once those slots are done, drops it everywhere."""
    cache = ctx.state.setdefault("ppo_workspaces", {})
    keep = {workspace_key(u) for u in units}
    busy = set(building)
    gone = [k for k in cache if k not in keep and not busy & set(k[3])]
    for k in gone:
        del cache[k]
    return len(gone)


def _stored(ctx: SlotContext, unit: Unit) -> dict[str, torch.Tensor]:
    return slot_ops._units(ctx)[unit.unit_id]


def _refresh(ws: Workspace, state: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for key, local in ws.locals.items():
            local.copy_(state[key])


# --- the pipeline ---------------------------------------------------------------------------------


def _recv(shape, dtype, src: int, device: torch.device) -> torch.Tensor:
    """Receive into a buffer on this slot's device (NCCL sends and receives device memory)."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, src=src)
    return buffer


def _layers(ws: Workspace, x: torch.Tensor, mask: torch.Tensor, cache: KVCache | None = None):
    """This stage's decoder layers on ``x``; ``mask`` covers the cached positions and ``x``'s."""
    backbone = ws.model.model
    length = x.shape[1]
    past = cache.length if cache is not None else 0
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    rotary = backbone.rotary(positions)
    mask4 = attention_mask_4d(mask, length)
    for i in ws.layers:
        x = backbone.layers[i](x, rotary=rotary, mask=mask4, cache=cache)
    if cache is not None:
        cache.advance(length)
    return x


def _head(ws: Workspace, x: torch.Tensor) -> torch.Tensor:
    """The last stage's final norm and head: logits, or the scalar per token."""
    model, backbone = ws.model, ws.model.model
    hidden = backbone.norm(x)
    if hasattr(model, "score"):
        return model.score(hidden).squeeze(-1)
    if backbone.config.tie_embeddings:
        return torch.nn.functional.linear(hidden, backbone.embed_tokens.weight)
    return model.lm_head(hidden)


def _stage_forward(
    ws: Workspace,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    *,
    cache: KVCache | None = None,
    last_only: bool = False,
) -> torch.Tensor | None:
    """Run this slot's pipeline stage on ``tokens`` (every slot knows them; the first stage embeds
    them, the others receive the previous stage's hidden states). Returns the head's output on
    the last stage (``last_only``: at the last position only, as sampling needs: a prompt's
    logits at every position would take batch × prompt × vocab floats); the others send their
    output on and return None."""
    batch, length = tokens.shape
    if ws.first:
        x = ws.model.model.embed_tokens(tokens)
    else:
        x = _recv(
            (batch, length, ws.model.config.hidden_size), torch.float32, ws.prev_slot, tokens.device
        )
    x = _layers(ws, x, mask, cache)
    if not ws.last:
        dist.send(x.detach().contiguous(), dst=ws.next_slot)
        return None
    return _head(ws, x[:, -1:] if last_only else x)


# --- generation -----------------------------------------------------------------------------------


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of one prompt of a step: the same however the batch is split."""
    return zlib.crc32(f"{seed}:{row}".encode()) & 0x7FFFFFFF


class _GumbelNoise:
    """Gumbel-max sampling noise, one generator per prompt: a response depends on its prompt's
    row, not on which unit generated it or how the batch was cut. Drawn a step at a time on the
    logits' device (all of a wave's steps at once would be rows × max_new_tokens × vocab
    floats)."""

    def __init__(self, rows: list[int], seed: int, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.generators = [
            torch.Generator(device=device).manual_seed(row_seed(seed, r)) for r in rows
        ]

    def next(self) -> torch.Tensor:
        u = torch.stack(
            [torch.rand(self.vocab, generator=g, device=self.device) for g in self.generators]
        ).clamp_(min=1e-10, max=1 - 1e-7)
        return -torch.log(-torch.log(u))


def _sample(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor):
    logits = logits.float()
    if params.temperature == 0:
        return logits.argmax(-1), logits.log_softmax(-1).max(-1).values
    scaled = logits / params.temperature
    logprobs = scaled.log_softmax(-1)
    filtered = filter_logits(scaled, top_k=params.top_k, top_p=params.top_p)
    tokens = (filtered + noise).argmax(-1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


@torch.no_grad()
def generate(
    ctx: SlotContext,
    *,
    unit: Unit,
    prompts: list[list[int]],
    rows: list[int],
    params: SamplingParams,
    pad_token_id: int,
    backend: str = "torch",
    micro_batch: int = 0,
) -> dict | None:
    """Sample a response to each prompt on ``unit``; the reporting slot returns them.
    ``backend``: ``torch`` (the workspace, any layout) or ``vllm`` (a vLLM engine on the slot's
    GPU, fed the workspace's weights each step; one-slot units). ``micro_batch``: the most
    prompts decoded at once, as many as the plan's KV cache holds (0: all); the rest wait for
    later waves. A response depends only on its prompt and row, not on the wave it ran in."""
    run = generator_for(backend)
    ws = workspace(ctx, unit)
    waves = [
        run(ctx, ws, prompts[r.start : r.stop], rows[r.start : r.stop], params, pad_token_id)
        for r in _row_chunks(len(rows), micro_batch or len(rows))
    ]
    return None if waves[0] is None else {"rows": rows, **join_responses(waves, pad_token_id)}


def generator_for(backend: str) -> Callable[..., dict | None]:
    """The function that runs one wave of ``generate`` on ``backend`` (one of
    ``GENERATION_BACKENDS``); an unknown one is refused, naming the job's field, not run as
    torch. Choosing ``vllm`` imports nothing: vLLM is imported when its first wave runs."""
    try:
        return _GENERATORS[backend]
    except (KeyError, TypeError):
        raise ValueError(
            f"generation_backend: expected one of {', '.join(GENERATION_BACKENDS)}, got {backend!r}"
        ) from None


def join_responses(parts: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Batches of responses (waves of a unit, or units' shares) as one, in order, each padded
    on the right to the longest: tokens with the pad token, the mask and log-probabilities
    with zeros."""
    width = max(p["response_tokens"].shape[1] for p in parts)
    pads = {"response_tokens": pad_token_id, "response_mask": 0, "logprobs": 0.0}
    return {
        key: torch.cat(
            [
                torch.nn.functional.pad(p[key], (0, width - p[key].shape[1]), value=pad)
                for p in parts
            ]
        )
        for key, pad in pads.items()
    }


def _generate_torch(ctx, ws: Workspace, prompts, rows, params, pad_token_id) -> dict | None:
    """One wave of ``generate`` on the workspace's own model (any layout)."""
    unit = ws.unit
    tokens, mask = left_pad(prompts, pad_token_id=pad_token_id, device=ctx.device)
    config = unit.layout.model
    noise = _GumbelNoise(rows, params.seed, config.vocab_size, ctx.device) if ws.last else None
    cache = KVCache(num_layers=config.num_layers, max_len=tokens.shape[1] + params.max_new_tokens)
    batch = tokens.shape[0]
    head = _stage_forward(ws, tokens, mask, cache=cache, last_only=True)
    finished = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    out_tokens, out_logprobs, alive_masks = [], [], []
    key_mask = mask
    for step in range(params.max_new_tokens):
        if ws.last:
            token, logprob = _sample(head[:, -1], params, noise.next())
            for slot in ws.earlier_slots:
                dist.send(token, dst=slot)
        else:
            token = _recv((batch,), torch.int64, ws.last_stage_slot, tokens.device)
            logprob = torch.zeros(batch, device=tokens.device)
        alive = ~finished
        out_tokens.append(torch.where(alive, token, pad_token_id))
        out_logprobs.append(torch.where(alive, logprob, 0.0))
        alive_masks.append(alive.long())
        if params.eos_token_id is not None:
            finished = finished | (token == params.eos_token_id)
        if bool(finished.all()) or step == params.max_new_tokens - 1:
            break
        key_mask = torch.cat((key_mask, torch.ones_like(key_mask[:, :1])), dim=1)
        head = _stage_forward(ws, token[:, None], key_mask, cache=cache, last_only=True)
    if not ws.reports:
        return None
    return {  # to the driver, from the host
        "rows": rows,
        "response_tokens": torch.stack(out_tokens, dim=1).cpu(),
        "response_mask": torch.stack(alive_masks, dim=1).cpu(),
        "logprobs": torch.stack(out_logprobs, dim=1).cpu(),
    }


def _generate_vllm(ctx, ws: Workspace, prompts, rows, params, pad_token_id) -> dict:
    from runtime.ppo.export import write_hf_folder
    from runtime.ppo.generate_vllm import VllmGenerationBackend

    if len(ws.unit.slots) != 1:
        raise ValueError(f"{ws.unit.unit_id}: the vLLM backend runs one-slot generation units")
    weights = {k: v for k, v in ws.model.state_dict().items()}
    engine = ctx.state.get("vllm")
    if engine is None:
        import tempfile

        folder = write_hf_folder(tempfile.mkdtemp(prefix="nereus-vllm-"), ws.model.config, weights)
        engine = ctx.state["vllm"] = VllmGenerationBackend(folder, pad_token_id=pad_token_id)
    else:
        engine.load_weights(weights)
    rollout = engine.generate(prompts, params, seeds=[row_seed(params.seed, r) for r in rows])
    return {
        "rows": rows,
        "response_tokens": rollout.response_tokens,
        "response_mask": rollout.response_mask,
        "logprobs": rollout.logprobs,
    }


GENERATION_BACKENDS = ("torch", "vllm")
"""How generation units sample: ``torch``, the units' own model in any layout; ``vllm``, a vLLM
engine on a one-slot unit's GPU (``runtime/ppo/generate_vllm.py``)."""
_GENERATORS = {"torch": _generate_torch, "vllm": _generate_vllm}


# --- inference ------------------------------------------------------------------------------------


@torch.no_grad()
def score(
    ctx: SlotContext,
    *,
    unit: Unit,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    output: str,
    micro_batch: int = 0,
    temperature: float = 1.0,
) -> torch.Tensor | None:
    """Per-token log-probabilities (``logprobs``, at the sampling ``temperature``), values
    (``values``) or the last token's scalar (``reward``) of the sequences' responses,
    ``micro_batch`` rows at a time (0: all at once); the reporting slot returns them."""
    ws = workspace(ctx, unit)
    sequences, attention_mask = sequences.to(ctx.device), attention_mask.to(ctx.device)
    parts = [
        _score_rows(
            ws,
            sequences[r.start : r.stop],
            attention_mask[r.start : r.stop],
            prompt_length,
            output,
            temperature,
        )
        for r in _row_chunks(sequences.shape[0], micro_batch or sequences.shape[0])
    ]
    return torch.cat(parts).cpu() if ws.reports else None  # to the driver, from the host


def _score_rows(
    ws: Workspace,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    output: str,
    temperature: float,
) -> torch.Tensor | None:
    head = _stage_forward(ws, sequences, attention_mask)
    if not ws.reports:
        return None
    start = prompt_length - 1
    if output == "logprobs":
        return ppo.token_logprobs(head[:, start:-1], sequences[:, prompt_length:], temperature)
    if output == "values":
        return head[:, start:-1].contiguous()
    last = attention_mask.shape[1] - 1 - attention_mask.long().flip(-1).argmax(-1)
    return head.gather(1, last[:, None]).squeeze(1)


# --- weights --------------------------------------------------------------------------------------


def _slice_of(t: torch.Tensor, spec: ShardSpec, copy: Copy) -> torch.Tensor:
    return slot_ops._narrow(t, spec, copy.dim, copy.start, copy.stop)


@dataclasses.dataclass(frozen=True)
class TargetSync:
    """One target unit's weight sync: the reshard planner's copies into ``target`` from the
    training units ``sources`` (the unit each source slot holds)."""

    copies: list[Copy]
    sources: dict[int, Unit]
    target: Unit


@torch.no_grad()
def sync_weights(ctx: SlotContext, *, syncs: list[TargetSync]) -> int:
    """Fill this slot's part of every target's workspace: local copies in place, the rest packed
    per peer and exchanged point to point, all targets' messages posted as one batch before any
    is waited on (NCCL runs a pair's sends and receives in posting order on one stream, so two
    slots that each receive from the other first would wait forever unless they are grouped;
    each target's messages carry its own tag, and every slot posts them in the same order, so
    two between the same pair never cross). Returns the bytes this slot received."""
    ops, received = [], []
    for tag, sync in enumerate(syncs):
        mine_src = sync.sources.get(ctx.rank)
        src_state = _stored(ctx, mine_src) if mine_src is not None else {}
        src_specs = (
            {s.key: s for s in mine_src.layout.shards(mine_src.position_of(ctx.rank))}
            if mine_src is not None
            else {}
        )
        ws = workspace(ctx, sync.target) if ctx.rank in sync.target.slots else None
        outgoing: dict[int, list[Copy]] = defaultdict(list)
        incoming: dict[int, list[Copy]] = defaultdict(list)
        for c in sync.copies:
            if c.src_slot == ctx.rank and c.dst_slot == ctx.rank:
                dst = _slice_of(ws.locals[c.key], ws.shards[c.key], c)
                dst.copy_(_slice_of(src_state[c.key], src_specs[c.key], c))
            elif c.src_slot == ctx.rank:
                outgoing[c.dst_slot].append(c)
            elif c.dst_slot == ctx.rank:
                incoming[c.src_slot].append(c)
        for src, group in sorted(incoming.items()):
            sizes = [_slice_of(ws.locals[c.key], ws.shards[c.key], c).numel() for c in group]
            buffer = torch.empty(sum(sizes), dtype=torch.float32, device=ctx.device)
            received.append((ws, group, buffer, sizes))
            ops.append(dist.P2POp(dist.irecv, buffer, src, tag=tag))
        for dst, group in sorted(outgoing.items()):
            packed = torch.cat(
                [
                    _slice_of(src_state[c.key], src_specs[c.key], c).reshape(-1).float()
                    for c in group
                ]
            )
            ops.append(dist.P2POp(dist.isend, packed, dst, tag=tag))  # alive until it is sent
    for request in dist.batch_isend_irecv(ops) if ops else ():
        request.wait()
    nbytes = 0
    for ws, group, buffer, sizes in received:
        for c, piece in zip(group, buffer.split(sizes), strict=True):
            dst = _slice_of(ws.locals[c.key], ws.shards[c.key], c)
            dst.copy_(piece.view(dst.shape))
        nbytes += buffer.numel() * buffer.element_size()
    return nbytes


def load_frozen(ctx: SlotContext, *, unit: Unit, path: str) -> bool:
    """Read this slot's slices of a frozen model (reference, reward) into its workspace, once."""
    ws = workspace(ctx, unit)
    if ws.frozen_loaded:
        return False
    full = torch.load(path, mmap=True, weights_only=True)
    with torch.no_grad():
        for key, local in ws.locals.items():
            local.copy_(ws.shards[key].view_of(full[key]))
    ws.frozen_loaded = True
    return True


@torch.no_grad()
def place_training_unit(ctx: SlotContext, *, unit: Unit, path: str) -> int:
    """Create this slot's part of a training unit from full weights: parameters and their fp32
    master copies from ``path``, Adam's moments zero. Returns the bytes placed."""
    if ctx.rank not in unit.slots:
        return 0
    full = torch.load(path, mmap=True, weights_only=True)
    shards = unit.layout.shards(unit.position_of(ctx.rank))
    state = slot_ops._allocate(shards, ctx.device)
    for spec in shards:
        key, _, kind = spec.key.partition("::")
        if kind in ("exp_avg", "exp_avg_sq"):
            state[spec.key].zero_()
        else:
            state[spec.key].copy_(spec.view_of(full[key]))
    slot_ops._units(ctx)[unit.unit_id] = state
    return sum(t.numel() * t.element_size() for t in state.values())


def read_parameters(ctx: SlotContext, *, unit: Unit) -> dict[str, tuple[ShardSpec, torch.Tensor]]:
    """This slot's parameter shards of a training unit (for assembling full weights)."""
    if ctx.rank not in unit.slots:
        return {}
    state = _stored(ctx, unit)
    return {
        s.key: (s, state[s.key].detach().to("cpu", copy=True))  # the driver has no GPU
        for s in unit.layout.shards(unit.position_of(ctx.rank))
        if "::" not in s.key and s.replica_id == 0
    }


# --- training -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainTask:
    """One model's share of one minibatch on one data-parallel unit."""

    role: str
    """``actor`` (clipped policy loss) or ``critic`` (clipped value loss)."""
    unit: Unit
    dp_group: tuple[int, ...]
    """The slots at this slot's position in every unit of the model-stage (gradients summed)."""
    sequences: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    old_values: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    weight: float
    """This unit's share of the minibatch's real tokens: losses are sums over the global count."""
    clip_ratio: float
    value_clip: float
    entropy_coef: float
    lr: float
    max_grad_norm: float
    optimizer_step: int
    """Adam's step count after this update (its bias correction)."""
    temperature: float = 1.0
    """The sampling temperature: the actor's ratio and entropy are taken under it."""
    micro_batch: int = 4
    """Rows per micro-batch: a pipeline's, or those whose gradients accumulate (the plan's)."""


def train(ctx: SlotContext, *, tasks: list[TrainTask]) -> list[dict | None]:
    """One optimizer step per task, in the order given (every slot of a unit sees the same)."""
    return [_train_one(ctx, task) for task in tasks if ctx.rank in task.unit.slots]


def _on_device(task: TrainTask, device: torch.device) -> TrainTask:
    """The task with its tensors on this slot's device (the driver sends them from the host)."""
    moved = {
        f.name: getattr(task, f.name).to(device)
        for f in dataclasses.fields(task)
        if isinstance(getattr(task, f.name), torch.Tensor)
    }
    return dataclasses.replace(task, **moved)


def _train_one(ctx: SlotContext, task: TrainTask) -> dict | None:
    task = _on_device(task, ctx.device)
    ws = workspace(ctx, task.unit)
    state = _stored(ctx, task.unit)
    _refresh(ws, state)
    ws.model.zero_grad(set_to_none=True)
    if task.sequences.shape[0] == 0:
        # No rows of this minibatch (its last, smaller than the data parallelism): every slot
        # of the unit skips the forward, the backward and the pipeline schedule, which are the
        # unit's own, and joins the sum of gradients and their norm with zeros (``_gradients``);
        # its weight in the loss is 0, so the update is that of the units with rows.
        stats = {}
    elif task.unit.layout.pp > 1:
        stats = _train_pipelined(ctx, ws, task)
    else:  # gradients accumulated over the micro-batches, each weighted by its tokens
        targets, chunks, tokens, total = _micro_batches(task)
        stats = {}
        for rows, count in zip(chunks, tokens, strict=True):
            head = _stage_forward(
                ws,
                task.sequences[rows.start : rows.stop],
                task.attention_mask[rows.start : rows.stop],
            )
            loss, part = _loss(
                task, head, targets[rows.start : rows.stop], task.weight * count / total
            )
            loss.backward()
            for key, value in part.items():
                stats[key] = stats.get(key, 0.0) + value
    grads, norm = _gradients(ctx, ws, task)
    if math.isfinite(norm):
        _adam(state, grads, ws, task)
    else:
        # A NaN or infinity in the loss (a reward, an overflow) reached the gradients: the
        # update is not made, on every slot of every replica alike (they share the norm), and
        # the driver fails the step before anything is saved.
        stats["nonfinite_updates"] = 1.0
    return stats if ws.reports else None


_TARGETS = ("tokens", "mask", "old_logprobs", "old_values", "advantages", "returns")


def _targets(task: TrainTask) -> torch.Tensor:
    """What the loss needs per response token, packed ``(rows, response, 6)`` so that a pipeline
    schedule can cut it into microbatches with the sequences (token ids are exact in fp32)."""
    tokens = task.sequences[:, task.prompt_length :].float()
    return torch.stack(
        [tokens, task.mask, task.old_logprobs, task.old_values, task.advantages, task.returns],
        dim=-1,
    )


def _loss(task: TrainTask, head: torch.Tensor, targets: torch.Tensor, weight: float):
    """The actor's clipped policy loss (less the entropy bonus) or the critic's clipped value
    loss over ``targets``' rows, times ``weight`` (their share of the minibatch's real tokens)."""
    t = dict(zip(_TARGETS, targets.unbind(-1), strict=True))
    out = head[:, task.prompt_length - 1 : -1]
    mask = t["mask"]
    if task.role == "actor":
        logprobs = ppo.token_logprobs(out, t["tokens"].long(), task.temperature)
        policy_loss, clip_fraction = ppo.policy_loss(
            logprobs, t["old_logprobs"], t["advantages"], mask, clip_ratio=task.clip_ratio
        )
        entropy = ppo.entropy(out, mask, task.temperature)
        loss = (policy_loss - task.entropy_coef * entropy) * weight
        stats = {"policy_loss": policy_loss, "clip_fraction": clip_fraction, "entropy": entropy}
    else:
        value_loss, _ = ppo.value_loss(
            out, t["old_values"], t["returns"], mask, value_clip=task.value_clip
        )
        loss = value_loss * weight
        stats = {
            "value_loss": value_loss,
            "value_error": ppo.masked_mean((out - t["returns"]) ** 2, mask),
        }
    return loss, {k: float(v.detach()) * weight for k, v in stats.items()}


class _PipelineStageModule(nn.Module):
    """One pipeline stage of a workspace as ``torch.distributed.pipelining`` runs it: the
    attention mask travels down the pipeline beside the hidden states."""

    def __init__(self, ws: Workspace):
        super().__init__()
        self.model = ws.model
        self.ws = ws

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        if self.ws.first:
            x = self.model.model.embed_tokens(x)
        x = _layers(self.ws, x, mask)
        return _head(self.ws, x) if self.ws.last else (x, mask)


def schedule_class(micro_batches: int, stages: int):
    """The pipeline schedule: 1F1B once there are at least as many micro-batches as stages, so
    that a stage holds the activations of at most ``stages`` micro-batches (the memory model's
    count, ``runtime.planner.memory``), where GPipe holds all of them until the backward; with
    fewer, GPipe (1F1B needs as many as there are stages), which then holds fewer anyway."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return Schedule1F1B if micro_batches >= stages else ScheduleGPipe


def _train_pipelined(ctx: SlotContext, ws: Workspace, task: TrainTask) -> dict | None:
    """Forward and backward through a ``torch.distributed.pipelining`` schedule
    (``schedule_class``) over this tensor rank's pipeline group, in microbatches of
    ``task.micro_batch`` rows."""
    from torch.distributed.pipelining import PipelineStage

    layout, unit = task.unit.layout, task.unit
    chain = tuple(unit.slots[p * layout.tp + ws.tp_rank] for p in range(layout.pp))
    group = ctx.state["groups"][tuple(sorted(chain))]
    stage = PipelineStage(_PipelineStageModule(ws), ws.pp_rank, layout.pp, ctx.device, group=group)
    # Group ranks follow the slots' order; pipeline stage p is the slot at position p.
    ordered = sorted(chain)
    stage.stage_index_to_group_rank = {p: ordered.index(slot) for p, slot in enumerate(chain)}
    targets, chunks, _, total = _micro_batches(task)
    micro = len(chunks)
    collected: list[dict] = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        share = task.weight * float(target[:, :, 1].sum()) / total
        loss, stats = _loss(task, output, target, share)
        collected.append(stats)
        return loss

    schedule = schedule_class(micro, layout.pp)(stage, micro, loss_fn=loss_fn, scale_grads=False)
    if ws.first:
        schedule.step(task.sequences, task.attention_mask)
    elif ws.last:
        schedule.step(target=targets)
    else:
        schedule.step()
    if not ws.last:
        return None
    out: dict[str, float] = {}
    # The schedule's set-up calls the loss once more, first, on a shape-inference pass.
    for stats in collected[-micro:]:
        for key, value in stats.items():
            out[key] = out.get(key, 0.0) + value
    return out


def _micro_batches(task: TrainTask) -> tuple[torch.Tensor, list[range], list[float], float]:
    """The task's targets, its rows cut into micro-batches of at most ``task.micro_batch``, the
    response tokens of each, and their total (at least 1): a micro-batch's loss is weighted by
    its share of the tokens, so the accumulated gradient is the whole batch's."""
    targets = _targets(task)
    chunks = _row_chunks(task.sequences.shape[0], task.micro_batch)
    tokens = [float(targets[r.start : r.stop, :, 1].sum()) for r in chunks]
    return targets, chunks, tokens, max(sum(tokens), 1.0)


def _row_chunks(rows: int, micro_batch: int) -> list[range]:
    """``rows`` cut into the fewest micro-batches of at most ``micro_batch`` rows, as even as
    they come (training, scoring and generation's waves cut alike)."""
    micro = max(1, min(rows, -(-rows // micro_batch)))
    return _ranges([len(c) for c in torch.arange(rows).tensor_split(micro)])


def _ranges(sizes: list[int]) -> list[range]:
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


def _gradients(
    ctx: SlotContext, ws: Workspace, task: TrainTask
) -> tuple[dict[str, torch.Tensor], float]:
    """The unit's gradients, summed over its replicas and clipped, and their global norm
    before clipping (the same on every slot of every replica)."""
    named = dict(ws.model.named_parameters())
    grads = {}
    for key, local in ws.locals.items():
        grad = named[key].grad
        if grad is None:
            grad = torch.zeros_like(local)
        elif isinstance(grad, DTensor):
            # A gradient may come back partial or replicated; give it the parameter's placement.
            grad = grad.redistribute(grad.device_mesh, named[key].placements).to_local()
        grads[key] = grad.detach().float().contiguous()
    if len(task.dp_group) > 1:  # data parallelism: sum the replicas' gradients, one buffer
        keys = sorted(grads)
        flat = torch.cat([grads[k].reshape(-1) for k in keys])
        dist.all_reduce(flat, group=ctx.state["groups"][tuple(sorted(task.dp_group))])
        for k, piece in zip(keys, flat.split([grads[k].numel() for k in keys]), strict=True):
            grads[k] = piece.view_as(grads[k])
    # The global norm: each slice once (a replicated tensor on tensor rank 0 only), summed on
    # the slot's device (NCCL reduces device memory) and read once.
    squares = [
        g.pow(2).sum().double()
        for k, g in grads.items()
        if k not in ws.replicated or ws.tp_rank == 0
    ]
    total = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    if squares:
        total += torch.stack(squares).sum()
    if len(ws.unit.slots) > 1:
        dist.all_reduce(total, group=checkpoint._group(ctx, tuple(ws.unit.slots)))
    norm = math.sqrt(float(total))
    coef = min(1.0, task.max_grad_norm / (norm + 1e-6))
    if coef < 1.0:
        for g in grads.values():
            g.mul_(coef)
    return grads, norm


def _adam(state: dict, grads: dict, ws: Workspace, task: TrainTask) -> None:
    """torch.optim.Adam's update (no weight decay) on the unit's own state."""
    beta1, beta2 = ADAM_BETAS
    t = task.optimizer_step
    bias1, bias2 = 1 - beta1**t, 1 - beta2**t
    with torch.no_grad():
        for key, grad in grads.items():
            m, v = state[f"{key}::exp_avg"], state[f"{key}::exp_avg_sq"]
            master = state[f"{key}::master"]
            m.mul_(beta1).add_(grad, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(bias2)).add_(ADAM_EPS)
            master.addcdiv_(m, denom, value=-task.lr / bias1)
            state[key].copy_(master)


def timed(ctx: SlotContext, *, fn, kwargs: dict) -> tuple[object, float]:
    """Run another slot function and return its result with the seconds it took here."""
    started = time.perf_counter()
    return fn(ctx, **kwargs), time.perf_counter() - started
