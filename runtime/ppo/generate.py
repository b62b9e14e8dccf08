"""Generation of PPO rollouts behind one small interface, with a torch backend that always works.

``GenerationBackend`` is what the PPO step needs from generation: sample responses to a batch of
prompts, and take the actor's new weights after each update. ``TorchGenerationBackend`` runs any
``LlamaForCausalLM`` (also tensor-parallel) with a KV cache; a vLLM backend can implement the same
two methods where vLLM and GPUs exist.

Sampling is reproducible: the same model, prompts and ``SamplingParams`` (including ``seed``) give
the same tokens. Under tensor parallelism every rank sees the same all-gathered logits and draws
from the same seeded generator, so ranks agree without communicating.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from runtime.ppo.model import LlamaForCausalLM
from runtime.ppo.weights import load_weights


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How responses are sampled."""

    max_new_tokens: int
    """Most tokens generated per response, the EOS token included."""
    eos_token_id: int | None
    """The token that ends a response (kept in it); None: responses run to ``max_new_tokens``."""
    temperature: float = 1.0
    """Divides the logits; 0 means greedy decoding."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens only; 0 disables the filter."""
    top_p: float = 1.0
    """Sample within the smallest set of tokens whose probability reaches ``top_p`` (nucleus)."""
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens: must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be at least 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Rollout:
    """A batch of prompts and sampled responses, laid out as the models read them.

    Prompts are left-padded and responses right-padded, so every response starts at column
    ``prompt_length`` of ``sequences`` and the token at column ``c`` is predicted at ``c - 1``.
    """

    prompt_tokens: torch.Tensor
    """``(batch, prompt_length)``, left-padded."""
    prompt_mask: torch.Tensor
    response_tokens: torch.Tensor
    """``(batch, num_generated)``, right-padded; includes the EOS token when one was sampled."""
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    """Log-probability of each response token under the temperature-scaled policy (0 at pads)."""
    response_lengths: torch.Tensor
    """``(batch,)`` tokens per response, EOS included."""

    @property
    def prompt_length(self) -> int:
        return self.prompt_tokens.shape[1]

    @property
    def sequences(self) -> torch.Tensor:
        return torch.cat((self.prompt_tokens, self.response_tokens), dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat((self.prompt_mask, self.response_mask), dim=1)

    def responses(self) -> list[list[int]]:
        """Each response's tokens without padding."""
        return [
            row[:length].tolist()
            for row, length in zip(self.response_tokens, self.response_lengths, strict=True)
        ]


class GenerationBackend(Protocol):
    """What the PPO step needs from generation."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        """Sample one response per prompt."""
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Take the actor's current weights (Hugging Face names)."""
        ...


def filter_logits(logits: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` with the tokens outside the top-k and the top-p nucleus set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        outside = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(outside.scatter(-1, order, outside), -math.inf)
    return logits


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``(batch, vocab)`` logits and its log-probability.

    The log-probability is under the temperature-scaled distribution before top-k/top-p filtering
    (the policy PPO optimizes); greedy decoding reports it under the unscaled logits.
    """
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1)
    else:
        scaled = logits / params.temperature
        logprobs = scaled.log_softmax(dim=-1)
        probs = filter_logits(scaled, top_k=params.top_k, top_p=params.top_p).softmax(dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def left_pad(
    prompts: Sequence[Sequence[int]], *, pad_token_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as ``(batch, longest)`` tokens and mask, padded on the left."""
    if not prompts:
        raise ValueError("prompts: need at least one prompt")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: every prompt needs at least one token")
    length = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, length - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask[row, length - len(prompt) :] = 1
    return tokens.to(device), mask.to(device)


class TorchGenerationBackend:
    """Generation with a torch ``LlamaForCausalLM`` and its KV cache."""

    def __init__(self, model: LlamaForCausalLM, *, pad_token_id: int):
        self.model = model
        self.pad_token_id = pad_token_id

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy full (unsharded) weights into the model by name."""
        load_weights(self.model, state_dict)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Rollout:
        device = next(self.model.parameters()).device
        prompt_tokens, prompt_mask = left_pad(
            prompts, pad_token_id=self.pad_token_id, device=device
        )
        batch = prompt_tokens.shape[0]
        cache = self.model.new_cache(prompt_tokens.shape[1] + params.max_new_tokens)
        generator = torch.Generator(device=device).manual_seed(params.seed)
        logits = self.model(prompt_tokens, attention_mask=prompt_mask, cache=cache, last_only=True)[
            :, -1
        ]
        key_mask = prompt_mask
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        tokens, logprobs, alive_masks = [], [], []
        for step in range(params.max_new_tokens):
            token, logprob = sample_next(logits, params, generator)
            alive = ~finished
            tokens.append(torch.where(alive, token, self.pad_token_id))
            logprobs.append(torch.where(alive, logprob, 0.0))
            alive_masks.append(alive.long())
            if params.eos_token_id is not None:
                finished = finished | (token == params.eos_token_id)
            if bool(finished.all()) or step == params.max_new_tokens - 1:
                break
            # Finished rows keep decoding pads; their outputs are masked out above.
            key_mask = torch.cat((key_mask, torch.ones_like(key_mask[:, :1])), dim=1)
            logits = self.model(
                tokens[-1][:, None], attention_mask=key_mask, cache=cache, last_only=True
            )[:, -1]
        response_mask = torch.stack(alive_masks, dim=1)
        return Rollout(
            prompt_tokens=prompt_tokens,
            prompt_mask=prompt_mask,
            response_tokens=torch.stack(tokens, dim=1),
            response_mask=response_mask,
            logprobs=torch.stack(logprobs, dim=1),
            response_lengths=response_mask.sum(dim=1),
        )
