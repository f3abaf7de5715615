"""Sampler: penalties and filters against hand-computed expectations."""

from __future__ import annotations

import pytest
import torch

from hearth.engine.sampling import SamplingParams, apply_penalties, filter_logits, sample_token


def test_greedy_picks_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert sample_token(logits, SamplingParams(temperature=0), [], [], None) == 1


def test_repetition_penalty_follows_transformers_rule():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]


def test_presence_and_frequency_penalties():
    logits = torch.zeros(4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, params, prompt=[3], output=[1, 1, 2])
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0]


def test_top_k_keeps_k_best():
    out = filter_logits(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(top_k=2))
    assert torch.isfinite(out).tolist() == [False, True, True, False]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = filter_logits(probs.log(), SamplingParams(top_p=0.75))
    assert torch.isfinite(out).tolist() == [True, True, False, False]


def test_min_p_is_relative_to_the_best_token():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    out = filter_logits(probs.log(), SamplingParams(min_p=0.2))
    assert torch.isfinite(out).tolist() == [True, True, False, False]


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 2.0])
    assert torch.allclose(filter_logits(logits, SamplingParams(temperature=0.5)), torch.tensor([2.0, 4.0]))


def test_seeded_sampling_repeats_and_follows_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0]).log_softmax(-1)
    params = SamplingParams(temperature=1.0)
    draw = [sample_token(logits, params, [], [], torch.Generator().manual_seed(7)) for _ in range(5)]
    assert len(set(draw)) == 1
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample_token(logits, params, [], [], gen) for _ in range(3000)]), minlength=3)
    expected = logits.softmax(-1) * 3000
    assert torch.all((counts - expected).abs() < 150)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
