"""The batched sampler on synthetic logits: filters, penalties, seeds, greedy and logprobs."""

from __future__ import annotations

import pytest
import torch

from gpuworker.engine.sampling import Penalties, Sampler, SamplingMetadata, apply_top_k_top_p
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.sequence import Sequence, SequenceGroup

VOCAB = 40
CPU = torch.device("cpu")


def seq_for(params: SamplingParams, prompt: list[int] = (1, 2, 3), output: list[int] = (),
            index: int = 0) -> Sequence:
    group = SequenceGroup("r", list(prompt), params, 0, 100, first_seq_id=0)
    seq = group.seqs[index] if index < len(group.seqs) else Sequence(index, group, index)
    seq.token_ids += list(output)
    return seq


def sample(logits: torch.Tensor, seqs: list[Sequence], eos: list[int] = (), seed: int = 0) -> list[int]:
    meta = SamplingMetadata.build(seqs, logits.shape[1], list(eos), CPU)
    return Sampler(CPU, seed)(logits, meta).token_ids.tolist()


def random_logits(rows: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def draws(logits_row: torch.Tensor, params: SamplingParams, count: int = 300) -> list[int]:
    """`count` draws from one logits row, each row with its own seed so the draws differ."""
    seqs = [seq_for(SamplingParams(**{**vars(params), "seed": i})) for i in range(count)]
    return sample(logits_row.expand(count, -1).clone(), seqs)


def test_greedy_is_the_argmax_even_in_a_mixed_batch():
    logits = random_logits(6)
    seqs = [seq_for(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, seed=i)) for i in range(6)]
    tokens = sample(logits, seqs)
    assert tokens[0::2] == logits.argmax(-1)[0::2].tolist()


def test_all_greedy_batch():
    logits = random_logits(4)
    assert sample(logits, [seq_for(SamplingParams(temperature=0.0))] * 4) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=5), lambda probs: probs >= probs.topk(5).values[-1]),
    (SamplingParams(top_p=0.6), lambda probs: _top_p_set(probs, 0.6)),
    (SamplingParams(min_p=0.3), lambda probs: probs >= 0.3 * probs.max()),
    (SamplingParams(temperature=0.5, top_p=0.8), lambda probs: _top_p_set(probs, 0.8)),
])
def test_filters_never_emit_tokens_outside_their_set(params, allowed):
    logits = random_logits(1, seed=3)[0]
    probs = torch.softmax(logits / params.temperature, dim=-1)
    allowed_ids = set(torch.nonzero(allowed(probs)).flatten().tolist())
    seen = set(draws(logits, params))
    assert seen <= allowed_ids
    assert len(seen) > 1  # it really samples


def _top_p_set(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(descending=True)
    keep = (sorted_probs.cumsum(0) - sorted_probs) < top_p
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[order[keep]] = True
    return mask


def test_top_k_and_top_p_per_row():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 4]), torch.tensor([2.0, 0.5]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False], [True, False, False, False]]


def test_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    counts = torch.bincount(torch.tensor(draws(logits, SamplingParams(), count=4000)), minlength=4)
    assert torch.allclose(counts / 4000, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)


def test_seeded_rows_ignore_the_rest_of_the_batch():
    logits = random_logits(5, seed=1)
    target = seq_for(SamplingParams(seed=1234), output=[7, 8])
    alone = sample(logits[2:3], [target], seed=0)
    others = [seq_for(SamplingParams(temperature=0.7 + i / 10)) for i in range(4)]
    batched = sample(logits, others[:2] + [target] + others[2:], seed=99)
    assert batched[2] == alone[0]


def test_seeded_noise_depends_on_position_and_choice():
    logits = torch.zeros(1, VOCAB)  # uniform: the token is decided by the noise alone
    first = [sample(logits, [seq_for(SamplingParams(seed=5), output=[1] * pos)])[0] for pos in range(8)]
    again = [sample(logits, [seq_for(SamplingParams(seed=5), output=[1] * pos)])[0] for pos in range(8)]
    assert first == again and len(set(first)) > 1
    sibling = [sample(logits, [seq_for(SamplingParams(seed=5, n=2), output=[1] * pos, index=1)])[0]
               for pos in range(8)]
    assert sibling != first


def test_penalties_follow_openai_and_vllm_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    # prompt has token 1; the output has token 2 twice and token 4 once.
    seq = seq_for(params, prompt=[1], output=[2, 2, 4])
    penalised = Penalties.build([seq], 5, CPU).apply(logits)
    expected = torch.tensor([[
        2.0,  # unseen: unchanged
        -2.0 * 2.0,  # prompt only, negative: multiplied by the repetition penalty
        1.0 / 2.0 - 0.25 * 2 - 0.5,  # output twice: divided, then frequency x2 and presence
        0.5,
        3.0 / 2.0 - 0.25 - 0.5,
    ]])
    torch.testing.assert_close(penalised, expected)


def test_penalty_steers_greedy_away_from_repeats():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = seq_for(SamplingParams(temperature=0.0), output=[0])
    penalised = seq_for(SamplingParams(temperature=0.0, frequency_penalty=0.5), output=[0])
    assert sample(logits, [plain, penalised]) == [0, 1]


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    early, late = seq_for(params, output=[3]), seq_for(params, output=[3, 3])
    assert sample(logits.repeat(2, 1), [early, late], eos=[0]) == [2, 0]


def test_logprobs_are_of_the_raw_logits():
    logits = random_logits(2, seed=4)
    seqs = [seq_for(SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5), output=[0, 1])] * 2
    meta = SamplingMetadata.build(seqs, VOCAB, [], CPU)
    out = Sampler(CPU, 0)(logits, meta)
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, reference.topk(3).values)
    assert out.top_ids.tolist() == reference.topk(3).indices.tolist()
