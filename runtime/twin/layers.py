"""One pipeline stage of a Llama decoder on one tensor-parallel rank: the kernels of its passes.

A layer runs, per pass, its four projections (QKV, output, gate-and-up, down) as GEMMs split
column- and row-wise over the tensor-parallel ranks (Megatron's split), flash attention over its
heads, and the streaming work between (two RMSNorms, RoPE, SwiGLU, two residual adds), with two
all-reduces of the activations when ``tp > 1``. The first stage also gathers embeddings; the last
applies the final norm and the head (the vocabulary projection and its fp32 log-softmax, or a
scalar head). Backward is twice the GEMMs (input and weight gradients), flash attention's
backward, and the streaming work again.
"""

from __future__ import annotations

import dataclasses
import functools

from runtime.planner.catalog import ModelConfig
from runtime.twin import kernels
from runtime.twin.hardware import Device, Link
from runtime.twin.kernels import Work

STREAM_BYTES_PER_VALUE = 20
"""Bytes each token's hidden value moves through a layer's streaming kernels (norms, RoPE,
SwiGLU, residuals), reads and writes together, in one pass."""
STREAM_KERNELS = 8
LOGSOFTMAX_PASSES = 3
"""fp32 logits are written, normalised and read for the chosen tokens' log-probabilities."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shard:
    """The layers one rank holds: ``layers`` of ``model`` split ``tp`` ways, with the embedding
    (``first``) and the head (``last``)."""

    model: ModelConfig
    tp: int
    layers: float
    first: bool
    last: bool
    scalar_head: bool
    nbytes: int = 2

    @classmethod
    def of(cls, model: ModelConfig, tp: int, pp: int, stage: int, *, scalar_head, nbytes):
        return cls(
            model=model,
            tp=tp,
            layers=model.num_layers / pp,
            first=stage == 0,
            last=stage == pp - 1,
            scalar_head=scalar_head,
            nbytes=nbytes,
        )

    @functools.cached_property
    def key(self) -> tuple:
        """The shard as a tuple (hashed once, where the dataclass would hash its model each
        time)."""
        return (
            self.model.name,
            dataclasses.astuple(self.model),
            self.tp,
            self.layers,
            self.first,
            self.last,
            self.scalar_head,
            self.nbytes,
        )

    @property
    def kv_heads_per_rank(self) -> float:
        """Key/value heads one rank caches (replicated when ``tp`` exceeds them)."""
        return max(1.0, self.model.num_kv_heads / self.tp)

    @property
    def kv_bytes_per_token(self) -> float:
        """Cached key and value bytes per token on this rank, over its layers."""
        return 2 * self.layers * self.kv_heads_per_rank * self.model.head_dim * self.nbytes

    @property
    def params(self) -> float:
        """Parameters this rank holds."""
        m = self.model
        n = self.layers * m.params_per_layer / self.tp
        if self.first:
            n += m.vocab_size * m.hidden_size / self.tp
        if self.last:
            head = m.hidden_size if self.scalar_head else m.vocab_size * m.hidden_size
            n += m.hidden_size + (head if self.scalar_head else head / self.tp)
        return n

    def _vocab(self) -> float:
        return 1 if self.scalar_head else self.model.vocab_size / self.tp


def _layer(dev: Device, shard: Shard, rows: float, link: Link, *, slow, stream_kernels) -> Work:
    """One layer's four projections, its streaming work and its all-reduces over ``rows``
    tokens, attention aside."""
    m, tp, b = shard.model, shard.tp, shard.nbytes
    h, inter = m.hidden_size, m.intermediate_size
    layer = Work()
    layer.add(kernels.gemm(dev, rows, (h + 2 * m.kv_dim) / tp, h, b))
    layer.add(kernels.gemm(dev, rows, h, h / tp, b))
    layer.add(kernels.gemm(dev, rows, 2 * inter / tp, h, b))
    layer.add(kernels.gemm(dev, rows, h, inter / tp, b))
    layer.add(kernels.stream(dev, rows * h * b * STREAM_BYTES_PER_VALUE, stream_kernels))
    if tp > 1:
        layer.comm_s += 2 * kernels.all_reduce(link, rows * h * b, tp, slow=slow)
        layer.kernels += 2
    return layer


def forward(
    dev: Device, shard: Shard, tokens: float, lengths_sq: float, link: Link, *, slow: float = 1.0
) -> Work:
    """A forward pass of ``tokens`` tokens (sequences whose squared lengths sum to
    ``lengths_sq``) through the shard."""
    m, tp, b = shard.model, shard.tp, shard.nbytes
    h = m.hidden_size
    layer = _layer(dev, shard, tokens, link, slow=slow, stream_kernels=STREAM_KERNELS)
    layer.add(kernels.attention(dev, lengths_sq, h / tp))
    if dev.eager_ops:
        layer.kernels = round(dev.eager_ops[2])
    work = Work().add(layer, shard.layers)
    if dev.eager_ops:
        work.kernels += round(dev.eager_ops[3])
    if shard.first:
        work.add(kernels.stream(dev, tokens * h * b * 2))
    if shard.last:
        work.add(kernels.gemm(dev, tokens, shard._vocab(), h, b))
        if not shard.scalar_head:
            work.add(kernels.stream(dev, tokens * shard._vocab() * 4 * LOGSOFTMAX_PASSES, 3))
            if tp > 1:  # the softmax's max and sum over the split vocabulary
                work.comm_s += 2 * kernels.all_reduce(link, tokens * 4, tp, slow=slow)
    return work


def backward(
    dev: Device,
    shard: Shard,
    tokens: float,
    lengths_sq: float,
    link: Link,
    *,
    recompute: bool,
    slow: float = 1.0,
) -> Work:
    """The backward pass of the same micro-batch (with the forward again first when
    activations are recomputed)."""
    m, tp, b = shard.model, shard.tp, shard.nbytes
    h, inter = m.hidden_size, m.intermediate_size
    fwd = forward(dev, shard, tokens, lengths_sq, link, slow=slow)
    work = Work().add(fwd) if recompute else Work()
    layer = Work()
    eager = dev.eager_ops
    for n, k in (((h + 2 * m.kv_dim) / tp, h), (h, h / tp), (2 * inter / tp, h), (h, inter / tp)):
        layer.add(kernels.gemm(dev, tokens, k, n, b))  # input gradient
        layer.add(kernels.gemm(dev, n, k, tokens, b))  # weight gradient
    layer.add(kernels.attention(dev, lengths_sq, h / tp, backward=True))
    layer.add(kernels.stream(dev, 2 * tokens * h * b * STREAM_BYTES_PER_VALUE, STREAM_KERNELS))
    if tp > 1:
        layer.comm_s += 2 * kernels.all_reduce(link, tokens * h * b, tp, slow=slow)
        layer.kernels += 2
    if eager:  # what a forward-and-backward counts beyond its forward
        layer.kernels = round(eager[4] - eager[2])
    work.add(layer, shard.layers)
    if eager:
        work.kernels += round(max(0.0, eager[5] - eager[3]))
    if shard.last:
        work.add(kernels.gemm(dev, tokens, h, shard._vocab(), b))
        work.add(kernels.gemm(dev, shard._vocab(), h, tokens, b))
        if not shard.scalar_head:
            work.add(kernels.stream(dev, tokens * shard._vocab() * 4 * 2, 2))
    return work


def decode_step(
    dev: Device, shard: Shard, batch: float, link: Link, *, graphs: bool, slow=1.0
) -> Work:
    """One decode iteration of ``batch`` sequences through the shard, without reading the KV
    cache (``kv_read_s`` prices that, per cached token). ``graphs``: the iteration replays a
    captured graph (a serving engine), one launch instead of one per kernel."""
    b, h = shard.nbytes, shard.model.hidden_size
    layer = _layer(dev, shard, batch, link, slow=slow, stream_kernels=STREAM_KERNELS + 1)
    if dev.eager_ops:
        layer.kernels = round(dev.eager_ops[0])
    work = Work().add(layer, shard.layers)
    if shard.last:
        work.add(kernels.gemm(dev, batch, shard._vocab(), h, b))
        work.add(kernels.stream(dev, batch * shard._vocab() * 4 * 2, 2))  # sampling
    if dev.eager_ops:
        work.kernels += round(dev.eager_ops[1])
    if graphs:
        work.kernels = 1
    return work


def kv_read_s(dev: Device, shard: Shard) -> float:
    """Device seconds per cached token a decode iteration reads (its keys and values)."""
    return shard.kv_bytes_per_token / dev.hbm_rate


_MEMO: dict[tuple, float] = {}
_MEMO_MAX = 1 << 18
"""Seconds of passes already priced, by their shape: a run asks again and again for the same
shapes (micro-batches are padded), and hashing the shapes' tuples is cheap."""


def _memo(key: tuple, price) -> float:
    seconds = _MEMO.get(key)
    if seconds is None:
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        seconds = _MEMO[key] = price()
    return seconds


def forward_s(
    dev: Device, shard: Shard, tokens: float, lengths_sq: float, link: Link, slow: float, slowdown
) -> float:
    """``forward``'s wall seconds (remembered)."""
    key = ("f", dev.key, shard.key, tokens, lengths_sq, link.key, slow, slowdown)
    return _memo(
        key,
        lambda: forward(dev, shard, tokens, lengths_sq, link, slow=slow).seconds(
            dev, slowdown=slowdown
        ),
    )


def backward_s(
    dev: Device,
    shard: Shard,
    tokens: float,
    lengths_sq: float,
    link: Link,
    slow: float,
    slowdown: float,
    recompute: bool,
) -> float:
    """``backward``'s wall seconds (remembered)."""
    key = ("b", dev.key, shard.key, tokens, lengths_sq, link.key, slow, slowdown, recompute)
    return _memo(
        key,
        lambda: backward(
            dev, shard, tokens, lengths_sq, link, recompute=recompute, slow=slow
        ).seconds(dev, slowdown=slowdown),
    )


def decode_s(
    dev: Device, shard: Shard, batch: int, link: Link, graphs: bool, slow: float, slowdown
) -> float:
    """``decode_step``'s wall seconds (remembered)."""
    key = ("d", dev.key, shard.key, batch, link.key, graphs, slow, slowdown)
    return _memo(
        key,
        lambda: decode_step(dev, shard, batch, link, graphs=graphs, slow=slow).seconds(
            dev, slowdown=slowdown
        ),
    )
