"""The sampler as a pure policy: greedy, top-k, top-p, temperature, seeds, parameter checks."""

import math
import threading

import pytest
import torch

from loraplex.replica.cpu_threads import flush_denormals
from loraplex.replica.sampling import SamplingParams, sample

NUCLEUS_PROBS = [0.5, 0.3, 0.15, 0.05]


def _draw(
    logits: list[float] | torch.Tensor, params: SamplingParams, n: int, seed: int = 0
) -> list[int]:
    """n draws for one row of logits, all from one seeded generator."""
    row = torch.as_tensor(logits, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    return sample(row.expand(n, -1).clone(), [params] * n, [generator] * n)


def _counts(tokens: list[int], vocab: int) -> list[int]:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).tolist()


def _chi_square(observed: list[int], probs: torch.Tensor) -> float:
    n = sum(observed)
    expected = probs.double() * n
    obs = torch.tensor(observed, dtype=torch.float64)
    return float(((obs - expected) ** 2 / expected).sum())


# 99.9th percentile of the chi-square distribution by degrees of freedom (scipy.stats.chi2.ppf)
CHI2_999 = {3: 16.27, 4: 18.47, 7: 24.32}


def test_greedy_takes_the_argmax_of_every_row():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    generators = [torch.Generator().manual_seed(i) for i in range(16)]
    tokens = sample(logits, [SamplingParams(temperature=0.0)] * 16, generators)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.5).greedy


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)] * 3
    generators = [torch.Generator().manual_seed(i) for i in range(6)]
    assert sample(logits, params, generators) == logits.argmax(dim=-1).tolist()


def test_top_k_1_equals_greedy_at_any_temperature():
    logits = torch.randn(30, generator=torch.Generator().manual_seed(3))
    for temperature in (0.5, 1.0, 5.0, 100.0):
        tokens = _draw(logits, SamplingParams(temperature=temperature, top_k=1), 200)
        assert set(tokens) == {int(logits.argmax())}, temperature


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_never_samples_outside_the_k_best(k: int):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(10 + k))
    best = set(torch.topk(logits, k).indices.tolist())
    # a high temperature flattens the distribution, so tokens outside the top k would show up
    tokens = _draw(logits, SamplingParams(temperature=5.0, top_k=k), 3000, seed=k)
    assert set(tokens) == best


@pytest.mark.parametrize("disabled", [0, -1])
def test_top_k_0_and_minus_1_disable_the_cut(disabled: int):
    logits = torch.zeros(8)
    tokens = _draw(logits, SamplingParams(top_k=disabled), 2000)
    assert set(tokens) == set(range(8))


def test_top_k_larger_than_the_vocab_keeps_every_token():
    tokens = _draw(torch.zeros(5), SamplingParams(top_k=50), 1000)
    assert set(tokens) == set(range(5))


@pytest.mark.parametrize(
    ("top_p", "nucleus"),
    [
        (0.3, {0}),  # the top token alone already reaches top_p
        (0.5, {0}),  # ... exactly
        (0.51, {0, 1}),
        (0.7, {0, 1}),
        (0.8, {0, 1}),  # 0.5 + 0.3 reaches 0.8 exactly: token 2 is not needed
        (0.81, {0, 1, 2}),
        (0.95, {0, 1, 2}),
        (0.96, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_samples_only_the_smallest_set_reaching_top_p(top_p: float, nucleus: set[int]):
    logits = torch.tensor(NUCLEUS_PROBS).log()
    tokens = _draw(logits, SamplingParams(top_p=top_p), 3000, seed=4)
    assert set(tokens) == nucleus


def test_top_p_renormalises_inside_the_nucleus():
    logits = torch.tensor(NUCLEUS_PROBS).log()
    tokens = _draw(logits, SamplingParams(top_p=0.7), 4000, seed=5)
    counts = _counts(tokens, 4)
    kept = torch.tensor([0.5, 0.3]) / 0.8
    assert counts[2:] == [0, 0]
    assert _chi_square(counts[:2], kept) < 10.83  # chi2(1 dof) 99.9th percentile


def test_top_p_is_order_independent_in_the_vocab():
    """The nucleus is defined by probability, not by token position."""
    perm = [2, 0, 3, 1]  # token perm[i] gets probability NUCLEUS_PROBS[i]
    logits = torch.empty(4)
    for i, token in enumerate(perm):
        logits[token] = math.log(NUCLEUS_PROBS[i])
    tokens = _draw(logits, SamplingParams(top_p=0.7), 2000, seed=6)
    assert set(tokens) == {perm[0], perm[1]}


def test_top_k_is_applied_before_top_p():
    """Like Hugging Face's warpers: top-p runs on the distribution renormalised over the top k.
    probs [0.4, 0.3, 0.2, 0.1], top_k=2 -> [4/7, 3/7]; top_p=0.5 then keeps only token 0."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    assert set(_draw(logits, SamplingParams(top_k=2, top_p=0.5), 1000, seed=7)) == {0}
    assert set(_draw(logits, SamplingParams(top_k=2, top_p=0.6), 2000, seed=7)) == {0, 1}


def test_temperature_is_applied_before_top_p():
    """At T=1 the nucleus for top_p=0.7 is {0, 1}; at T=0.25 token 0 alone holds > 0.7."""
    logits = torch.tensor(NUCLEUS_PROBS).log()
    assert set(_draw(logits, SamplingParams(temperature=1.0, top_p=0.7), 2000, seed=8)) == {0, 1}
    assert set(_draw(logits, SamplingParams(temperature=0.25, top_p=0.7), 2000, seed=8)) == {0}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_softmax_of_logits_over_temperature(temperature: float):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 6000
    tokens = _draw(logits, SamplingParams(temperature=temperature), n, seed=9)
    expected = torch.softmax(logits / temperature, dim=-1)
    statistic = _chi_square(_counts(tokens, 5), expected)
    assert statistic < CHI2_999[4], (statistic, _counts(tokens, 5), (expected * n).tolist())


def test_lower_temperature_concentrates_on_the_best_token():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    share = {
        t: _counts(_draw(logits, SamplingParams(temperature=t), 3000), 5)[0]
        for t in (0.3, 1.0, 3.0)
    }
    assert share[0.3] > share[1.0] > share[3.0]


def test_a_tiny_temperature_behaves_like_greedy():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(11)) * 5
    generators = [torch.Generator().manual_seed(i) for i in range(8)]
    tokens = sample(logits, [SamplingParams(temperature=1e-4)] * 8, generators)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_temperatures_whose_division_would_overflow_are_greedy():
    """logits / 1e-40 is inf in float32 and the softmax NaN: below 1e-5 sampling is argmax."""
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(12)) * 5
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    params = [SamplingParams(temperature=t) for t in (1e-40, 1e-20, 9e-6, 1e-300)]
    assert all(p.greedy for p in params)
    assert sample(logits, params, generators) == logits.argmax(dim=-1).tolist()


def test_the_smallest_float32_top_p_keeps_exactly_the_top_token():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(13))
    generator = [torch.Generator().manual_seed(0)]
    params = [SamplingParams(temperature=1.0, top_p=1.4e-45)]
    assert sample(logits, params, generator) == logits.argmax(dim=-1).tolist()


def test_a_denormal_top_p_keeps_the_top_token_on_a_thread_that_flushes_denormals():
    """The engine's thread flushes denormals (replica/cpu_threads.py), which reads a top_p
    of 1e-44 (a float32 denormal, accepted at the edge) as 0: every token's mass before it
    then reached top_p, all were dropped, and the draw failed (the ingress answered 500)."""
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(13))
    params = [SamplingParams(temperature=1.0, top_p=1e-44)]  # checked off the engine's thread
    drawn: list[int | BaseException] = []

    def draw() -> None:
        flush_denormals()
        try:
            drawn.extend(sample(logits, params, [torch.Generator().manual_seed(0)]))
        except BaseException as e:
            drawn.append(e)

    thread = threading.Thread(target=draw)
    thread.start()
    thread.join()
    assert drawn == logits.argmax(dim=-1).tolist()


def test_same_seed_gives_the_same_draws_and_other_seeds_differ():
    logits = torch.zeros(1000)
    first = _draw(logits, SamplingParams(), 50, seed=123)
    again = _draw(logits, SamplingParams(), 50, seed=123)
    other = _draw(logits, SamplingParams(), 50, seed=124)
    assert first == again
    assert first != other


def test_a_rows_draw_does_not_depend_on_the_other_rows_in_the_batch():
    """Each row samples with its own generator, so a request's tokens do not change with
    whatever else is batched with it."""
    torch.manual_seed(0)  # the global generator must not matter either
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(12))
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * 4
    alone = [
        sample(logits[i : i + 1], params[:1], [torch.Generator().manual_seed(i)])[0]
        for i in range(4)
    ]
    torch.manual_seed(99)
    together = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(4)])
    assert together == alone
    reordered = sample(
        logits.flip(0), params, [torch.Generator().manual_seed(i) for i in (3, 2, 1, 0)]
    )
    assert reordered == alone[::-1]


def test_default_params_are_valid_and_sample():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (16, 1.0, 1.0, 0, None)
    assert p.stop == () and p.stop_token_ids == () and not p.ignore_eos
    assert len(_draw(torch.zeros(10), p, 5)) == 5


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ("ok", "")}, "stop"),
        ({"stop": (3,)}, "stop"),
        ({"seed": "7"}, "seed"),
        # positive as Python floats, 0 as the float32 the sampler uses (the replica-killing
        # request of issue 14), and seeds torch.Generator.manual_seed refuses
        ({"top_p": 1e-46}, "top_p"),
        ({"top_p": float("inf")}, "top_p"),
        ({"temperature": float("inf")}, "temperature"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_invalid_sampling_params_raise_a_clear_value_error(kwargs: dict, field: str):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    value = next(iter(kwargs.values()))
    if not isinstance(value, tuple):  # the message shows the offending value
        assert repr(value) in str(info.value) or str(value) in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"temperature": 0.0},
        {"temperature": 100.0},
        {"top_p": 1e-9},
        {"top_p": 1.0},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"seed": 0},
        {"seed": 2**64 - 1},
        {"seed": -(2**63)},
        {"top_p": 1.4e-45},  # float32's smallest subnormal: still keeps the top token
        {"stop": ("\n", "END")},
        {"stop_token_ids": (5, 6)},
    ],
)
def test_boundary_sampling_params_are_accepted(kwargs: dict):
    SamplingParams(**kwargs)


def test_a_bare_stop_string_is_not_split_into_characters():
    """stop="END" must not silently mean stop at any of 'E', 'N', 'D': either it is rejected
    (the field takes a tuple of strings) or it is taken as the single stop string."""
    try:
        params = SamplingParams(stop="END")
    except (TypeError, ValueError):
        return
    assert params.stop == ("END",)
