"""Llama-architecture decoders in plain PyTorch, with Hugging Face parameter names.

The four PPO models share one backbone (``model.*``: token embedding, decoder layers with
grouped-query attention, RoPE and SwiGLU, a final RMSNorm) and differ in their head:

- actor and reference: ``LlamaForCausalLM``, an LM head giving next-token logits;
- critic and reward model: ``LlamaForScore``, the scalar ``score`` head of Hugging Face's
  ``LlamaForSequenceClassification``; the critic reads it at every token, the reward model at the
  last non-pad token.

Parameter names and shapes equal ``runtime.emu.layout.model_tensors`` (and hence real Hugging Face
checkpoints), so a state dict moves between this module, the shard layouts and checkpoints by name.
Projections infer their number of heads from their output, so the same code runs on the local
shards of a tensor-parallel model (``runtime.ppo.parallel``).

Sequences are left-padded: ``attention_mask`` marks real tokens, positions count real tokens only,
and a query always sees itself so that pad rows never become all-masked (their outputs are unused).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime.planner.catalog import ModelConfig, RopeScaling

INIT_STD = 0.02
"""Standard deviation of the normal initialisation (Hugging Face's ``initializer_range``)."""


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as Hugging Face's ``LlamaRMSNorm``."""

    def __init__(self, hidden_size: int, *, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class KVCache:
    """Keys and values of every layer for incremental decoding, preallocated up to ``max_len``.

    Buffers are allocated on first use from the shapes the layers produce, so a tensor-parallel
    layer caches only its local heads.
    """

    def __init__(self, *, num_layers: int, max_len: int):
        self.max_len = max_len
        self.length = 0
        """Positions already cached (equal for every row: sequences are left-padded)."""
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one layer's new ``(batch, heads, new, head_dim)`` keys/values; return all so far."""
        new = keys.shape[2]
        if self.length + new > self.max_len:
            raise RuntimeError(f"KV cache overflow: {self.length} + {new} > {self.max_len}")
        if self._keys[layer] is None:
            shape = (keys.shape[0], keys.shape[1], self.max_len, keys.shape[3])
            self._keys[layer] = keys.new_empty(shape)
            self._values[layer] = values.new_empty(shape)
        stop = self.length + new
        self._keys[layer][:, :, self.length : stop] = keys
        self._values[layer][:, :, self.length : stop] = values
        return self._keys[layer][:, :, :stop], self._values[layer][:, :, :stop]

    def advance(self, num_positions: int) -> None:
        """Mark ``num_positions`` more positions as cached, once every layer has been updated."""
        self.length += num_positions


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """RoPE's ``head_dim / 2`` angular frequencies, with Llama 3.1's scaling where given: a
    frequency whose wavelength exceeds ``original / low_freq_factor`` positions is divided by
    ``factor``, one whose wavelength is under ``original / high_freq_factor`` is kept, and one
    between moves linearly (in ``original / wavelength``) from the first to the second."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    # 0 at the long-wavelength edge of the band, 1 at the short one, clamped outside it.
    cycles = scaling.original_max_position_embeddings * inv_freq / (2 * math.pi)
    keep = (cycles - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    keep = keep.clamp(0.0, 1.0)
    return inv_freq * (keep + (1.0 - keep) / scaling.factor)


def rotary_cos_sin(
    positions: torch.Tensor,
    *,
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of RoPE for ``(batch, seq)`` positions, shaped ``(batch, 1, seq, head_dim)``."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate query or key heads (Hugging Face's half-split convention, not interleaved pairs)."""
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, kv = config.hidden_size, config.kv_dim
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(h, h, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        *,
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q, k, v = (
            proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, config: ModelConfig, *, layer: int, eps: float):
        super().__init__()
        self.layer = layer
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)

    def forward(
        self,
        x: torch.Tensor,
        *,
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        cache: KVCache | None,
    ) -> torch.Tensor:
        attn = self.self_attn(
            self.input_layernorm(x), rotary=rotary, mask=mask, cache=cache, layer=self.layer
        )
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


def attention_mask_4d(key_mask: torch.Tensor, num_queries: int) -> torch.Tensor:
    """Boolean ``(batch, 1, queries, keys)`` mask: causal, real keys only, each query sees itself.

    The queries are the last ``num_queries`` of the ``keys`` positions.
    """
    num_keys = key_mask.shape[1]
    query_pos = torch.arange(num_keys - num_queries, num_keys, device=key_mask.device)
    key_pos = torch.arange(num_keys, device=key_mask.device)
    causal = key_pos[None, :] <= query_pos[:, None]
    diagonal = key_pos[None, :] == query_pos[:, None]
    return ((causal & key_mask.bool()[:, None, :]) | diagonal)[:, None]


class LlamaModel(nn.Module):
    """The shared backbone (``model.*``): embedding, decoder layers and final norm."""

    def __init__(self, config: ModelConfig, *, rope_theta: float, rms_norm_eps: float):
        super().__init__()
        self.config = config
        self.rope_theta = rope_theta
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer=i, eps=rms_norm_eps) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=rms_norm_eps)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cosines and sines at ``positions``, for every layer (and pipeline stage)."""
        return rotary_cos_sin(
            positions,
            head_dim=self.config.head_dim,
            theta=self.rope_theta,
            scaling=self.config.rope_scaling,
        )

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``(batch, seq, hidden)`` of ``tokens``.

        ``attention_mask`` covers the cached positions and ``tokens`` (``(batch, cached + seq)``,
        1 for real tokens); omitted, every position is real.
        """
        batch, length = tokens.shape
        past = cache.length if cache is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(
                batch, past + length, dtype=torch.long, device=tokens.device
            )
        if attention_mask.shape != (batch, past + length):
            raise ValueError(
                f"attention_mask: shape {tuple(attention_mask.shape)} != (batch, cached + new) = "
                f"{(batch, past + length)}"
            )
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        rotary = self.rotary(positions)
        mask = attention_mask_4d(attention_mask, length)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, rotary=rotary, mask=mask, cache=cache)
        if cache is not None:
            cache.advance(length)
        return self.norm(x)


class _Decoder(nn.Module):
    """What both heads share: the backbone, its configuration and seeded initialisation."""

    def __init__(self, config: ModelConfig, *, rope_theta: float, rms_norm_eps: float):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps)

    def init_weights(self, seed: int) -> None:
        """Normal(0, 0.02) matrices, zero biases, unit norms; the same for a seed on any machine."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(self.named_parameters(), key=lambda item: item[0]):
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    values = torch.randn(param.shape, generator=generator) * INIT_STD
                    param.copy_(values.to(param.dtype))

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(num_layers=self.config.num_layers, max_len=max_len)


class LlamaForCausalLM(_Decoder):
    """Actor and reference: next-token logits from an LM head (tied to the embedding if asked)."""

    def __init__(self, config: ModelConfig, *, rope_theta: float, rms_norm_eps: float):
        super().__init__(config, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps)
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)``; position ``i`` predicts token ``i + 1``. With
        ``last_only``, ``(batch, 1, vocab)`` at the last position alone (what sampling needs)."""
        hidden = self.model(tokens, attention_mask=attention_mask, cache=cache)
        if last_only:
            hidden = hidden[:, -1:]
        if self.config.tie_embeddings:
            return F.linear(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden)


class LlamaForScore(_Decoder):
    """Critic and reward model: a scalar ``score`` head (Hugging Face's sequence classifier)."""

    def __init__(self, config: ModelConfig, *, rope_theta: float, rms_norm_eps: float):
        super().__init__(config, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps)
        self.score = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Per-token scalars ``(batch, seq)``: the critic's values."""
        hidden = self.model(tokens, attention_mask=attention_mask, cache=cache)
        return self.score(hidden).squeeze(-1)

    def last_token_score(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The scalar at each row's last real token ``(batch,)``: the reward model's score."""
        scores = self(tokens, attention_mask=attention_mask)
        last = attention_mask.shape[1] - 1 - attention_mask.long().flip(-1).argmax(-1)
        return scores.gather(1, last[:, None]).squeeze(1)


def build_model(
    config: ModelConfig,
    *,
    scalar_head: bool,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM | LlamaForScore:
    """A seeded model: the LM head for actor/reference, the scalar head for critic/reward; its
    RoPE base and RMSNorm epsilon are the configuration's (Hugging Face's fields of those names)."""
    cls = LlamaForScore if scalar_head else LlamaForCausalLM
    model = cls(config, rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps)
    model.init_weights(seed)
    return model.to(dtype)
