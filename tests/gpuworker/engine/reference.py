"""transformers as the reference the engine is checked against (float32, CPU)."""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=4)
def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), never stopping at EOS."""
    return greedy_generate(hf_model(path), prompts, max_new_tokens)


def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """hf_greedy on a transformers model already built."""
    config = copy.deepcopy(model.generation_config)
    # None would fall back to the model's own EOS (transformers 5); no token id is -1.
    config.eos_token_id = -1
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of one sequence, in float32."""
    with torch.no_grad():
        return hf_model(path)(torch.tensor([token_ids])).logits[0].float()


def random_prompts(lengths: tuple[int, ...], vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]
