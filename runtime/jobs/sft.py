"""The SFT job's work on each slot: a tiny decoder trained data-parallel on a synthetic task.

The task is arithmetic progressions modulo the vocabulary (``t[i] = (a + i*k) mod V``), learnable
from two tokens of context, so the loss visibly falls within a few dozen steps on CPU slots.
Functions here run inside slot actors through ``SlotPool.run``; they receive the ``SlotContext``.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.engine.slots import SlotContext
from runtime.jobs.spec import SftJobSpec


class _Block(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.attn_norm = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.gate_up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(batch, length, hidden))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyDecoder(nn.Module):
    """A pre-norm causal decoder with SwiGLU MLPs: the shape of Llama, at toy size."""

    def __init__(self, *, vocab_size: int, hidden: int, num_layers: int, num_heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.layers = nn.ModuleList(_Block(hidden, num_heads) for _ in range(num_layers))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def synthetic_batch(spec: SftJobSpec, *, step: int, rank: int) -> torch.Tensor:
    """The micro-batch of one rank at one step; different per rank, reproducible from the seed."""
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + step * 4099 + rank)
    start = torch.randint(0, spec.vocab_size, (spec.micro_batch, 1), generator=gen)
    stride = torch.randint(1, 8, (spec.micro_batch, 1), generator=gen)
    positions = torch.arange(spec.seq_len).unsqueeze(0)
    return (start + positions * stride) % spec.vocab_size


def setup_replica(ctx: SlotContext, *, spec_json: dict) -> int:
    """Build the model and optimizer on this slot; all replicas start from rank 0's weights."""
    spec = SftJobSpec.from_json(spec_json)
    torch.manual_seed(spec.seed)
    model = TinyDecoder(
        vocab_size=spec.vocab_size,
        hidden=spec.hidden,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
    ).to(ctx.device)
    for param in model.parameters():
        dist.broadcast(param.data, src=0)
    ctx.state["spec"] = spec
    ctx.state["model"] = model
    ctx.state["optimizer"] = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    return sum(p.numel() for p in model.parameters())


def train_step(ctx: SlotContext, *, step: int) -> dict:
    """One optimizer step: local forward/backward, then the gradient all-reduce across replicas."""
    spec: SftJobSpec = ctx.state["spec"]
    model: TinyDecoder = ctx.state["model"]
    optimizer: torch.optim.Optimizer = ctx.state["optimizer"]
    tokens = synthetic_batch(spec, step=step, rank=ctx.rank).to(ctx.device)

    started = time.perf_counter()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, spec.vocab_size), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    compute_s = time.perf_counter() - started

    started = time.perf_counter()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])  # one bucket: one collective per step
    dist.all_reduce(flat)
    flat /= ctx.world_size
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    comm_s = time.perf_counter() - started

    # The same all-reduced gradients on every replica: a NaN or an infinity in them (from any
    # replica's loss) skips the update on all of them alike, and the driver fails the job.
    finite = bool(torch.isfinite(flat).all())
    if finite:
        optimizer.step()
    return {
        "finite": finite,
        "loss": loss.item(),
        "tokens": tokens.numel(),
        "compute_s": compute_s,
        "comm_s": comm_s,
        "allreduce_bytes": flat.numel() * flat.element_size(),
    }


def replica_checksum(ctx: SlotContext) -> str:
    """SHA-256 over every parameter's bytes: equal on all ranks when the replicas agree."""
    digest = hashlib.sha256()
    for name, param in ctx.state["model"].state_dict().items():
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
