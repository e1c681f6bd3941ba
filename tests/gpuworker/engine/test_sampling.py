"""The batched sampler on synthetic logits (the torch path, as on the CPU): filters, distributions,
penalties, seeds, greedy and logprobs. The Triton kernel is checked against the same torch path, draw
for draw, in tests/kernels/test_sampling_kernel.py."""

from __future__ import annotations

import pytest
import torch

from gpuworker.engine.sampling import Penalties, Sampler
from gpuworker.engine.sampling_params import SamplingParams
from gpuworker.engine.sequence import Sequence, SequenceGroup
from gpuworker.kernels.sampling.sample import kept_mask_reference, sample_reference

VOCAB = 40
CPU = torch.device("cpu")


def seq_for(params: SamplingParams, prompt: list[int] = (1, 2, 3), output: list[int] = (), index: int = 0) -> Sequence:
    group = SequenceGroup("r", list(prompt), params, 0, 100, first_seq_id=0)
    seq = group.seqs[index] if index < len(group.seqs) else Sequence(index, group, index)
    seq.token_ids += list(output)
    return seq


def sample(logits: torch.Tensor, seqs: list[Sequence], eos: list[int] = (), seed: int = 0) -> list[int]:
    sampler = Sampler(CPU, seed)
    return sampler(logits, sampler.metadata(seqs, logits.shape[1], list(eos))).token_ids.tolist()


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


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=5), lambda probs: probs >= probs.topk(5).values[-1]),
        (SamplingParams(top_p=0.6), lambda probs: _top_p_set(probs, 0.6)),
        (SamplingParams(min_p=0.3), lambda probs: probs >= 0.3 * probs.max()),
        (SamplingParams(temperature=0.5, top_p=0.8), lambda probs: _top_p_set(probs, 0.8)),
    ],
)
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
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    kept = kept_mask_reference(x, torch.tensor([2, 4]), torch.tensor([1.0, 0.5]), None)
    assert kept.tolist() == [[True, True, False, False], [True, False, False, False]]


def test_tied_tokens_stay_or_go_together():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    # The 2nd largest value is shared by three tokens: top-2 keeps all of them.
    assert kept_mask_reference(x, torch.tensor([2]), None, None).tolist() == [[True, False, True, True, True, False]]
    # Mass strictly above the tied tokens is that of the 3.0 alone (~0.45 < 0.5): all three stay.
    kept = kept_mask_reference(x, None, torch.tensor([0.5]), None)
    assert kept.tolist() == [[True, False, True, True, True, False]]
    kept = kept_mask_reference(x, None, torch.tensor([0.4]), None)
    assert kept.tolist() == [[True, False, False, False, False, False]]


# Chi-square tests: COUNT draws of one fixed logits row, each with its own seed (so the test is
# deterministic), against the filtered softmax computed here from its definition. A wrong filter or
# a biased draw fails by far (see test_the_chi_square_test_catches_a_wrong_distribution).
COUNT = 20000
ALPHA = 1e-4


def draw_counts(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """How often each token comes out of COUNT draws (seeds 0..COUNT-1) of the sampler's torch path."""
    rows = torch.ones(COUNT)
    tokens, _ = sample_reference(
        logits.expand(COUNT, -1),
        rows * params.temperature,
        seeds=torch.arange(COUNT),
        top_k=(rows * (params.top_k if params.top_k > 0 else len(logits))).long(),
        top_p=rows * params.top_p,
        min_p=rows * params.min_p,
    )
    return torch.bincount(tokens, minlength=len(logits))


def expected_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the filters define, written out token by token."""
    x = (logits / params.temperature).tolist()
    order = sorted(range(len(x)), key=lambda i: -x[i])
    kept = set(order)
    if params.top_k > 0:
        kth = x[order[params.top_k - 1]]
        kept = {i for i in kept if x[i] >= kth}
    if params.top_p < 1.0:
        weights = {i: torch.tensor(x[i]).exp().item() for i in kept}
        total = sum(weights.values())
        kept = {i for i in kept if sum(w for j, w in weights.items() if x[j] > x[i]) / total < params.top_p}
    if params.min_p > 0:
        best = max(x[i] for i in kept)
        kept = {i for i in kept if torch.tensor(x[i] - best).exp().item() >= params.min_p}
    mask = torch.tensor([i in kept for i in range(len(x))])
    return torch.softmax(torch.where(mask, torch.tensor(x), float("-inf")), dim=-1)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the observed counts under probs (tokens with probability 0 must never appear)."""
    assert counts[probs == 0].sum() == 0, "a filtered-out token was drawn"
    expected = probs[probs > 0].double() * counts.sum()
    observed = counts[probs > 0].double()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor(len(expected) - 1, dtype=torch.float64)
    return torch.special.gammaincc(dof / 2, statistic / 2).item()


CHI_SQUARE_CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(top_k=6),
    "top_p": SamplingParams(top_p=0.8),
    "min_p": SamplingParams(min_p=0.2),
    "combined": SamplingParams(temperature=1.3, top_k=12, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("params", CHI_SQUARE_CASES.values(), ids=CHI_SQUARE_CASES.keys())
def test_draws_follow_the_filtered_distribution(params):
    # bfloat16-valued logits, as a real lm_head gives: ties included.
    logits = (torch.randn(24, generator=torch.Generator().manual_seed(11)) * 1.5).bfloat16().float()
    logits[5] = logits[9]
    assert chi_square_p_value(draw_counts(logits, params), expected_probs(logits, params)) > ALPHA


def test_the_chi_square_test_catches_a_wrong_distribution():
    logits = (torch.randn(24, generator=torch.Generator().manual_seed(11)) * 1.5).bfloat16().float()
    counts = draw_counts(logits, SamplingParams(temperature=0.7))
    # The same draws against a slightly different temperature, or a top-p set one token short.
    assert chi_square_p_value(counts, expected_probs(logits, SamplingParams(temperature=0.75))) < ALPHA
    top_p = SamplingParams(top_p=0.8)
    counts = draw_counts(logits, top_p)
    probs = expected_probs(logits, top_p)
    smallest = torch.where(probs > 0, probs, 1.0).argmin()
    probs[smallest] = 0.0
    with pytest.raises(AssertionError, match="filtered-out token"):
        chi_square_p_value(counts, probs / probs.sum())


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
    sibling = [sample(logits, [seq_for(SamplingParams(seed=5, n=2), output=[1] * pos, index=1)])[0] for pos in range(8)]
    assert sibling != first


def test_penalties_follow_openai_and_vllm_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    # prompt has token 1; the output has token 2 twice and token 4 once.
    seq = seq_for(params, prompt=[1], output=[2, 2, 4])
    penalised = Penalties.build([seq], 5, CPU).apply(logits)
    expected = torch.tensor(
        [
            [
                2.0,  # unseen: unchanged
                -2.0 * 2.0,  # prompt only, negative: multiplied by the repetition penalty
                1.0 / 2.0 - 0.25 * 2 - 0.5,  # output twice: divided, then frequency x2 and presence
                0.5,
                3.0 / 2.0 - 0.25 - 0.5,
            ]
        ]
    )
    torch.testing.assert_close(penalised, expected)


def test_penalties_per_row_with_repeats_and_ids_past_the_vocabulary():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5], [1.0, -1.0, 2.0, 0.5]])
    first = seq_for(SamplingParams(repetition_penalty=2.0), prompt=[0, 0, 9], output=[0, 3])
    second = seq_for(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5), prompt=[1], output=[2, 2, 2, 1])
    penalised = Penalties.build([first, second], 4, CPU).apply(logits.clone())
    expected = torch.tensor(
        [
            [1.0 / 2.0, -1.0, 2.0, 0.5 / 2.0],  # each seen token divided once, however often seen
            [1.0, -1.0 - 1.0 - 0.5, 2.0 - 3.0 - 0.5, 0.5],  # the prompt alone adds no frequency/presence
        ]
    )
    torch.testing.assert_close(penalised, expected)


def test_penalty_steers_greedy_away_from_repeats():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    plain = seq_for(SamplingParams(temperature=0.0), output=[0])
    penalised = seq_for(SamplingParams(temperature=0.0, frequency_penalty=0.5), output=[0])
    assert sample(logits.repeat(2, 1), [plain, penalised]) == [0, 1]


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])
    early, late = seq_for(params, output=[3]), seq_for(params, output=[3, 3])
    assert sample(logits.repeat(2, 1), [early, late], eos=[0]) == [2, 0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_of_the_raw_logits(temperature):
    logits = random_logits(2, seed=4)
    seqs = [seq_for(SamplingParams(temperature=temperature, logprobs=3, repetition_penalty=1.5), output=[0, 1])] * 2
    sampler = Sampler(CPU, 0)
    out = sampler(logits.clone(), sampler.metadata(seqs, VOCAB, []))
    reference = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, reference.topk(3).values)
    assert out.top_ids.tolist() == reference.topk(3).indices.tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans_tokens_only_in_its_own_rows(temperature):
    logits = random_logits(4, seed=6)
    top = logits.argmax(-1).tolist()
    forced = next(t for t in range(VOCAB) if t != top[0])
    plain = SamplingParams(temperature=temperature)
    seqs = [
        seq_for(SamplingParams(temperature=temperature, logit_bias={forced: 100})),
        seq_for(plain),
        seq_for(SamplingParams(temperature=temperature, logit_bias={top[2]: -100})),
        seq_for(plain),
    ]
    for seed in range(20):
        tokens = sample(logits.clone(), seqs, seed=seed)
        assert tokens[0] == forced and tokens[2] != top[2]
        if temperature == 0.0:
            assert tokens[1::2] == top[1::2]  # the rows without a bias are untouched
            assert tokens[2] == logits[2].topk(2).indices[1].item()  # the next best once the best is banned
    if temperature == 1.0:  # the unbiased rows still sample, exactly as in a batch without biased rows
        assert sample(logits.clone(), seqs, seed=3)[1::2] == sample(logits.clone(), [seq_for(plain)] * 4, seed=3)[1::2]


def test_logit_bias_shifts_the_sampled_distribution_by_its_value():
    logits = torch.zeros(1, VOCAB)
    # exp(ln 3) = 3: token 5 three times as likely as any other token.
    draws_5 = draws(logits[0], SamplingParams(logit_bias={5: float(torch.log(torch.tensor(3.0)))}), count=2000)
    expected = 3 / (VOCAB - 1 + 3)
    assert abs(draws_5.count(5) / 2000 - expected) < 4 * (expected * (1 - expected) / 2000) ** 0.5


def test_logit_bias_leaves_logprobs_raw_and_adds_to_penalties():
    logits = random_logits(1, seed=8)
    low = logits[0].argmin().item()
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias={low: 100}, presence_penalty=2.0)
    sampler = Sampler(CPU, 0)
    out = sampler(logits.clone(), sampler.metadata([seq_for(params, output=[low])], VOCAB, []))
    assert out.token_ids.tolist() == [low]  # +100, less the presence penalty of 2, still wins
    reference = torch.log_softmax(logits, dim=-1)  # as in vLLM: the model's own logprobs
    torch.testing.assert_close(out.logprobs, reference[:, low])
    assert out.top_ids.tolist() == reference.topk(2).indices.tolist()


def test_a_grammar_mask_outranks_logit_bias():
    from gpuworker.engine.grammar_masks import TokenBitmask

    logits = random_logits(2, seed=9)
    bitmask = torch.zeros(2, (VOCAB + 31) // 32, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) | (1 << 4)  # row 0 may only say token 3 or 4
    params = SamplingParams(temperature=0.0, logit_bias={10: 100})
    sampler = Sampler(CPU, 0)
    out = sampler(
        logits.clone(), sampler.metadata([seq_for(params), seq_for(params)], VOCAB, []), TokenBitmask(bitmask, [0])
    )
    assert out.token_ids.tolist() == [3 + int(logits[0, 4] > logits[0, 3]), 10]
