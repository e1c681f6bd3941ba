"""The sampling kernel against its full-sort torch reference: the same kept sets (exactly) and, with
the same Philox noise, the same tokens; on a GPU at Llama-3's vocabulary with rows split over
programs, in the interpreter at a small vocabulary."""

from __future__ import annotations

import pytest
import torch

from gpuworker.kernels.sampling.sample import SamplingConfig, gumbel_noise, philox_bits, sample, sample_reference

ON_CUDA = torch.cuda.is_available()
VOCAB = 128256 if ON_CUDA else 600
TOLERANCE = 1e-5
# Row settings, cycled over the batch: (temperature, top_k, top_p, min_p); top_k 0 is off.
SETTINGS = [
    (0.0, 0, 1.0, 0.0),  # greedy
    (0.8, 0, 1.0, 0.0),
    (0.8, 200, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (0.8, 0, 0.95, 0.0),
    (1.0, 5, 1.0, 0.0),
    (1.1, 50, 0.8, 0.0),
    (0.9, 0, 1.0, 0.1),
    (1.3, 40, 0.9, 0.02),
    (0.6, 1, 1.0, 0.0),
]


def row_params(num_rows: int, device: str) -> dict:
    rows = [SETTINGS[i % len(SETTINGS)] for i in range(num_rows)]
    temperature, top_k, top_p, min_p = (list(column) for column in zip(*rows))
    return dict(
        temperature=torch.tensor(temperature, device=device),
        top_k=torch.tensor([k if k > 0 else VOCAB for k in top_k], device=device),
        top_p=torch.tensor(top_p, device=device),
        min_p=torch.tensor(min_p, device=device),
        seeds=torch.arange(num_rows, device=device) * 7919 + 2**40,
    )


def kept_band(logits: torch.Tensor, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The fewest and the most tokens the reference keeps with top_p and min_p moved by TOLERANCE:
    the kept counts that are right within rounding."""
    lowest = sample_reference(
        logits, **{**params, "top_p": params["top_p"] * (1 - TOLERANCE), "min_p": params["min_p"] * (1 + TOLERANCE)}
    )[1]
    highest = sample_reference(
        logits,
        **{
            **params,
            "top_p": (params["top_p"] * (1 + TOLERANCE)).clamp(max=1.0),
            "min_p": params["min_p"] * (1 - TOLERANCE),
        },
    )[1]
    return lowest, highest


def make_logits(kind: str, num_rows: int, generator: torch.Generator, device: str) -> torch.Tensor:
    # Roughly what a Llama-3-8B-shaped model with random weights gives: flat, so top-p keeps thousands.
    logits = torch.randn(num_rows, VOCAB, generator=generator) * 1.3
    if kind == "bfloat16":  # a real lm_head's values: many ties
        logits = logits.bfloat16().float()
    elif kind == "peaked":  # a trained model's: a few likely tokens
        logits = logits * 4
    elif kind == "masked":  # banned tokens and grammar masks; a row of equal logits
        logits[:, ::3] = float("-inf")
        logits[-1] = 0.5
    return logits.to(device)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "peaked", "masked"])
def test_same_kept_sets_and_tokens_as_the_reference(kind, device, generator):
    num_rows = 300 if ON_CUDA else 2 * len(SETTINGS)
    logits = make_logits(kind, num_rows, generator, device)
    params = row_params(num_rows, device)
    num_kept = torch.zeros(num_rows, dtype=torch.int32, device=device)
    tokens = sample(logits, num_kept=num_kept, **params)
    expected_tokens, expected_kept = sample_reference(logits, **params)
    # Top-k keeps by count: exactly the reference's set. Top-p and min-p compare sums of exp(x),
    # added in another order than the reference's cumsum: where the boundary falls within rounding
    # of top_p (likely on a GPU, with 128k tokens of ~1e-5 each), either side of it is right.
    lowest, highest = kept_band(logits, params)
    assert ((lowest <= num_kept) & (num_kept <= highest)).all(), (num_kept, expected_kept)
    same_set = num_kept == expected_kept
    assert same_set.float().mean() > 0.9
    # The same kept set and the same noise: the same token.
    assert tokens[same_set].tolist() == expected_tokens[same_set].tolist()
    # Counting kept tokens takes the threshold search; without num_kept the rows without top-k draw
    # first and check after, and draw the same tokens.
    num_passes = torch.zeros(num_rows, dtype=torch.int32, device=device)
    drawn_first = sample(logits, num_passes=num_passes, **params)
    assert drawn_first[same_set].tolist() == expected_tokens[same_set].tolist()
    # A sampled row without filters takes the stats pass alone (its draw comes with it), as a greedy row.
    unfiltered = torch.tensor([SETTINGS[i % len(SETTINGS)][1:] == (0, 1.0, 0.0) for i in range(num_rows)])
    assert num_passes[unfiltered.to(device)].tolist() == [1] * int(unfiltered.sum())


def test_filters_are_optional_and_logits_may_be_bfloat16(device, generator):
    logits = make_logits("float32", 6, generator, device).bfloat16()
    params = row_params(6, device)
    tokens = sample(logits, params["temperature"], seeds=params["seeds"])
    expected, _ = sample_reference(logits.float(), params["temperature"], seeds=params["seeds"])
    assert tokens.tolist() == expected.tolist()
    only_top_p = sample(logits, params["temperature"], seeds=params["seeds"], top_p=params["top_p"])
    expected, _ = sample_reference(logits.float(), params["temperature"], seeds=params["seeds"], top_p=params["top_p"])
    assert only_top_p.tolist() == expected.tolist()


def test_a_row_draws_the_same_whatever_the_batch(device, generator):
    # A batch of one spreads its row over many programs on a GPU; a large batch gives each row one.
    num_rows = 200 if ON_CUDA else 4
    logits = make_logits("bfloat16", num_rows, generator, device)
    params = row_params(num_rows, device)
    together = sample(logits, **params)
    for row in (0, 3, num_rows - 1):
        alone = sample(logits[row : row + 1], **{name: value[row : row + 1] for name, value in params.items()})
        assert alone.item() == together[row].item()


@pytest.mark.parametrize("max_draws", [1, 3])
def test_candidates_failing_top_p_or_min_p_are_drawn_again_then_searched(max_draws, device, generator):
    # Low top-p and high min-p reject most first candidates (the mass above a candidate drawn from
    # the row is about uniform in [0, Z]): rows are accepted at their first, second and third check,
    # or fall back to the threshold search, and all draw the reference's token.
    num_rows = 480 if ON_CUDA else 48  # enough rows of each kind to take every path
    logits = make_logits("float32", num_rows, generator, device)
    # (top_p, min_p), cycled over the rows.
    cycle = [(0.05, 0.0), (0.2, 0.0), (0.5, 0.0), (1.0, 0.5), (1.0, 0.0), (0.5, 0.3)]
    params = {
        "temperature": torch.full((num_rows,), 0.8, device=device),
        "seeds": torch.arange(num_rows, device=device) * 7919 + 2**40,
        "top_p": torch.tensor([cycle[i % 6][0] for i in range(num_rows)], device=device),
        "min_p": torch.tensor([cycle[i % 6][1] for i in range(num_rows)], device=device),
    }
    num_passes = torch.zeros(num_rows, dtype=torch.int32, device=device)
    tokens = sample(logits, num_passes=num_passes, config=SamplingConfig(max_draws=max_draws), **params)
    num_kept = torch.zeros(num_rows, dtype=torch.int32, device=device)
    searched = sample(logits, num_kept=num_kept, **params)
    expected_tokens, expected_kept = sample_reference(logits, **params)
    same_set = num_kept == expected_kept
    assert same_set.float().mean() > 0.9
    assert tokens[same_set].tolist() == expected_tokens[same_set].tolist()
    assert tokens[same_set].tolist() == searched[same_set].tolist()
    # A top-p row takes a stats pass (which draws) and a check per candidate, a draw before every
    # check after the first; past max_draws checks, a search and a draw.
    passes = num_passes.view(-1, len(cycle)).T.cpu()
    top_p_rows = set(passes[:3].flatten().tolist())
    accepted = {2 * draws for draws in range(1, max_draws + 1)}
    assert accepted <= top_p_rows
    assert max(top_p_rows) > 2 * max_draws + 1  # the fallback
    # Min-p alone: the stats pass's candidate, or (min-p 0.5 rejects most) one more draw among the
    # tokens above it, which min-p then keeps; without filters the stats pass alone.
    min_p_rows = set(passes[3].tolist())
    assert 2 in min_p_rows and min_p_rows <= {1, 2}
    assert set(passes[4].tolist()) == {1}


def test_seed_and_token_id_alone_decide_the_noise():
    # Random123's known answer for Philox-4x32-10 with key 0 at counter 0.
    assert philox_bits(torch.tensor([0]), torch.tensor([0])).item() == 0x6627E8D5
    seeds = torch.tensor([5, 5, 6, 2**62 + 5])
    bits = philox_bits(seeds, torch.tensor([9, 9, 9, 9]))
    assert bits[0] == bits[1] and len(set(bits.tolist())) == 3
    noise = gumbel_noise(torch.full((20000,), 3), torch.arange(20000))
    # Standard Gumbel: mean is Euler's constant, variance pi^2 / 6.
    assert abs(noise.mean().item() - 0.5772) < 0.03 and abs(noise.var().item() - 1.6449) < 0.08


def test_rejects_bad_arguments(device):
    logits = torch.zeros(2, 16, device=device)
    temperature = torch.ones(2, device=device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="temperature must have shape"):
        sample(logits, torch.ones(3, device=device), seeds=seeds)
    with pytest.raises(ValueError, match="seeds must have dtype"):
        sample(logits, temperature, seeds=seeds.int())
    with pytest.raises(ValueError, match="top_k must have shape"):
        sample(logits, temperature, seeds=seeds, top_k=torch.ones(1, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="logits must have dtype"):
        sample(logits.long(), temperature, seeds=seeds)


# Launch configs at their extremes: tiny blocks (many loop steps and, on a GPU, many programs per
# row), few and many thresholds, no value passes and many, prefetching 0 to 3 blocks ahead.
CONFIGS = [
    SamplingConfig(
        block=16, search_block=16, num_thresholds=2, value_passes=0, num_warps=1, prefetch=3, list_capacity=64
    ),
    SamplingConfig(
        block=64,
        search_block=32,
        num_thresholds=4,
        value_passes=8,
        num_warps=2,
        programs_per_sm=4,
        prefetch=2,
        list_capacity=0,
    ),
    SamplingConfig(
        block=256, search_block=128, num_thresholds=16, value_passes=1, num_warps=4, prefetch=1, max_registers=64
    ),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda config: config.name)
def test_the_launch_config_does_not_change_what_is_drawn(config, device, generator):
    num_rows = 64 if ON_CUDA else len(SETTINGS)
    logits = make_logits("bfloat16", num_rows, generator, device)
    params = row_params(num_rows, device)
    num_kept = torch.zeros(num_rows, dtype=torch.int32, device=device)
    default_kept = torch.zeros(num_rows, dtype=torch.int32, device=device)
    tokens = sample(logits, num_kept=num_kept, config=config, **params)
    default_tokens = sample(logits, num_kept=default_kept, **params)
    expected_tokens, expected_kept = sample_reference(logits, **params)
    # Split rows add their sums of exp(x) in another order: a top-p boundary within rounding of
    # top_p may fall on either side of a group of tied tokens (seen on the H200: 10 of 65k tokens,
    # the kept mass 1.1e-6 below top_p), as against the reference.
    lowest, highest = kept_band(logits, params)
    assert ((lowest <= num_kept) & (num_kept <= highest)).all(), (num_kept, default_kept)
    same = num_kept == default_kept
    assert same.float().mean() > 0.9
    assert tokens[same].tolist() == default_tokens[same].tolist()
    # On a GPU the first launch of a variant learns how many of its programs an SM holds; later ones
    # split rows up to config.programs_per_sm programs an SM.
    again_kept = torch.zeros_like(num_kept)
    assert sample(logits, num_kept=again_kept, config=config, **params).tolist() == tokens.tolist()
    assert again_kept.tolist() == num_kept.tolist()
    same_set = num_kept == expected_kept
    assert same_set.float().mean() > 0.9
    assert tokens[same_set].tolist() == expected_tokens[same_set].tolist()


# Enough tokens that two thresholds a pass need more than 16 passes after 8 value passes.
WIDE_VOCAB = 128256 if ON_CUDA else 20000


@pytest.mark.parametrize(
    "config", [SamplingConfig(num_thresholds=2, value_passes=8), SamplingConfig()], ids=lambda config: config.name
)
def test_logits_spread_over_every_binade_are_searched_to_the_end(config, device, generator):
    # Value-spaced thresholds shrink such a row's key interval a binade or so a pass, and two
    # thresholds a pass shrink it only 3-fold: a search stopped at a pass limit short of
    # config.max_passes would keep tokens that top-k and top-p drop.
    num_rows, vocab = 4, WIDE_VOCAB
    negative = -(10.0 ** torch.linspace(-30, 38, vocab - 8))
    positive = torch.arange(1, 9) * 1e-30
    order = torch.randperm(vocab, generator=generator)
    logits = torch.cat([negative, positive])[order].repeat(num_rows, 1).to(device)
    # Top-k's boundary and top-p's (all tokens within ~1 of zero weigh about the same) fall among
    # the negative logits of magnitude below 1, 30 binades that differ in value by less than 1.
    params = {
        "temperature": torch.ones(num_rows, device=device),
        "seeds": torch.arange(num_rows, device=device),
        "top_k": torch.tensor([vocab // 6, vocab, vocab, vocab // 5], device=device),
        "top_p": torch.tensor([1.0, 0.5, 0.9, 0.5], device=device),
    }
    num_kept = torch.zeros(num_rows, dtype=torch.int32, device=device)
    tokens = sample(logits, num_kept=num_kept, config=config, **params)
    expected_tokens, expected_kept = sample_reference(logits, **params)
    # Top-k keeps by count: exactly. Top-p compares sums of thousands of exp(x) ~ 1: within rounding.
    lowest = sample_reference(logits, **{**params, "top_p": params["top_p"] * (1 - TOLERANCE)})[1]
    highest = sample_reference(logits, **{**params, "top_p": (params["top_p"] * (1 + TOLERANCE)).clamp(max=1.0)})[1]
    assert num_kept[0].item() == expected_kept[0].item()
    assert ((lowest <= num_kept) & (num_kept <= highest)).all(), (num_kept, expected_kept)
    same_set = num_kept == expected_kept
    assert same_set[0] and tokens[same_set].tolist() == expected_tokens[same_set].tolist()


def test_config_values_are_checked():
    with pytest.raises(ValueError, match="num_thresholds must be a power of two"):
        SamplingConfig(num_thresholds=6)
    with pytest.raises(ValueError, match="num_thresholds must be a power of two"):
        SamplingConfig(num_thresholds=32)
    with pytest.raises(ValueError, match="block must be a power of two"):
        SamplingConfig(block=1000)
    with pytest.raises(ValueError, match="value_passes must be in"):
        SamplingConfig(value_passes=-1)
    with pytest.raises(ValueError, match="programs_per_sm must be in"):
        SamplingConfig(programs_per_sm=0)
    with pytest.raises(ValueError, match="prefetch must be in"):
        SamplingConfig(prefetch=4)
    with pytest.raises(ValueError, match="list_capacity must be a multiple of search_block"):
        SamplingConfig(search_block=1024, list_capacity=1000)
    with pytest.raises(ValueError, match="max_registers must be None or in"):
        SamplingConfig(max_registers=16)
    with pytest.raises(ValueError, match="max_draws must be in"):
        SamplingConfig(max_draws=-1)
