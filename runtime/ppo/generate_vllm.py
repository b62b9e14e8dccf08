"""Generation with vLLM, behind the same interface as ``TorchGenerationBackend``.

Where vLLM and a GPU exist (the ``gpu`` extra), the actor's generation units can sample with vLLM
instead of the torch backend: the actor's weights are written once as a Hugging Face Llama folder
(``runtime.ppo.export``'s folder: ``config.json`` and a safetensors file) for vLLM to
start from, and every step's new weights go in place through vLLM's worker extension hook
(``worker_extension_cls`` and ``LLM.collective_rpc``, the pattern of vLLM's RLHF examples),
without restarting the engine. Prompts go in as token ids (no tokenizer: the tasks are token-level).

This module imports vLLM only when a backend is made, so the CPU install never needs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from runtime.ppo.generate import Rollout, SamplingParams, left_pad


class WeightSync:
    """Methods vLLM adds to its workers (``worker_extension_cls``)."""

    def nereus_load_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        model = self.model_runner.model  # the worker's model (vLLM's LlamaForCausalLM)
        model.load_weights(weights=state_dict.items())
        return len(state_dict)


class VllmGenerationBackend:
    """Sampling with a vLLM engine on this process's GPU(s)."""

    def __init__(
        self,
        folder: str | Path,
        *,
        pad_token_id: int,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.3,
    ):
        from vllm import LLM

        self.pad_token_id = pad_token_id
        self.llm = LLM(
            model=str(folder),
            skip_tokenizer_init=True,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype="bfloat16",
            enforce_eager=True,
            worker_extension_cls=f"{__name__}.WeightSync",
        )

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """The actor's new weights, in place, on every vLLM worker."""
        weights = {k: v.detach().to(torch.bfloat16).cpu() for k, v in state_dict.items()}
        self.llm.collective_rpc("nereus_load_weights", args=(weights,))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[int] | None = None,
    ) -> Rollout:
        """Sample a response to each prompt; ``seeds``: one per prompt (a response then depends
        on its own seed, not on the batch it ran in), else ``params.seed`` for all."""
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt

        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} for {len(prompts)} prompts")

        def sampling_for(seed: int):
            return VllmSampling(
                n=1,
                temperature=params.temperature,
                top_k=params.top_k or -1,
                top_p=params.top_p,
                max_tokens=params.max_new_tokens,
                seed=seed,
                logprobs=0,  # the sampled token's log-probability
                stop_token_ids=[] if params.eos_token_id is None else [params.eos_token_id],
                detokenize=False,
            )

        sampling = (
            sampling_for(params.seed) if seeds is None else [sampling_for(seed) for seed in seeds]
        )
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling, use_tqdm=False
        )
        prompt_tokens, prompt_mask = left_pad(prompts, pad_token_id=self.pad_token_id, device="cpu")
        width = max(len(o.outputs[0].token_ids) for o in outputs)
        tokens = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(prompts), width))
        for row, output in enumerate(outputs):
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            tokens[row, : len(ids)] = torch.tensor(ids)
            for column, (token, entry) in enumerate(zip(ids, sample.logprobs or [], strict=False)):
                logprobs[row, column] = entry[token].logprob
        lengths = torch.tensor([len(o.outputs[0].token_ids) for o in outputs])
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        return Rollout(
            prompt_tokens=prompt_tokens,
            prompt_mask=prompt_mask,
            response_tokens=tokens,
            response_mask=mask,
            logprobs=logprobs,
            response_lengths=lengths,
        )
