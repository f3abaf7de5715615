"""Sampler: penalties and filters against hand-computed expectations."""

from __future__ import annotations

import pytest
import torch

from hearth.engine.sampling import SamplingParams, apply_penalties, filter_logits, greedy_token, sample_token


def test_greedy_picks_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert sample_token(logits, SamplingParams(temperature=0), [], [], None) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_greedy_token_is_torch_argmax(dtype):
    """numpy's argmax (the fp32 CPU path) and torch's agree on ties (first), NaN (first NaN), -inf
    and a strided row."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 32000, generator=gen).to(dtype)
    rows[1, 100] = rows[1, 7] = rows[1].max() + 1  # a tie: the first wins
    rows[2, 5] = rows[2, 9] = float("nan")
    rows[3].fill_(float("-inf"))
    rows[4, :] = 0.0
    for row in [*rows, rows[5, ::2]]:
        assert greedy_token(row) == int(torch.argmax(row))


def test_repetition_penalty_follows_transformers_rule():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]


def test_presence_and_frequency_penalties():
    logits = torch.zeros(4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, params, prompt=[3], output=[1, 1, 2])
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0]


def test_logit_bias_is_added_last_and_steers_greedy():
    logits = torch.tensor([1.0, 2.0, 3.0, float("-inf")])
    params = SamplingParams(temperature=0, logit_bias={0: 5.0, 2: -100.0, 3: 100.0}, presence_penalty=1.0)
    out = apply_penalties(logits, params, prompt=[], output=[0])
    assert out[:3].tolist() == [5.0, 2.0, -97.0] and out[3] == float("-inf")  # a grammar's -inf stays -inf
    assert sample_token(logits, params, [], [0], None) == 0
    for bad in ({-1: 1.0}, {1: 101.0}, {1: float("nan")}, {i: 1.0 for i in range(301)}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


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
    # up to a constant, which softmax ignores
    assert torch.allclose(filter_logits(logits, SamplingParams(temperature=0.5)).softmax(-1),
                          torch.tensor([2.0, 4.0]).softmax(-1))


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
        ({"temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": 2}, "min_p"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_params_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logprobs_are_the_log_softmax_of_the_engines_logits_and_match_transformers(checkpoint):
    """Each token's reported log-probability (and its top alternatives) equals the log-softmax of
    the logits the engine sampled from (<= 1e-5 in fp32), before temperature and penalties; and the
    greedy path's values match transformers' logits (fp32, <= 1e-4)."""
    from hearth.engine.llm import LLM
    from tests.helpers import hf_greedy, record_logits, reference

    path, _ = checkpoint("qwen3_moe")
    llm = LLM(path)
    recorded = record_logits(llm)
    engine = llm.engine
    for params in (SamplingParams(temperature=0.9, seed=3, max_tokens=6, logprobs=4, presence_penalty=1.0),
                   SamplingParams(temperature=0, max_tokens=6, logprobs=0)):
        rid = engine.add_request([5, 9, 13, 2], params)
        chunks = []
        while engine.has_unfinished():
            chunks += [o.chunk for o in engine.step()]
        rows = recorded.pop(rid)
        got = [lp for c in chunks for lp in c.logprobs]
        assert [lp.token_id for lp in got] == [t for c in chunks for t in c.token_ids]
        for lp, row in zip(got, rows, strict=True):
            expected = torch.log_softmax(row.float(), -1)
            assert abs(lp.logprob - float(expected[lp.token_id])) <= 1e-5
            assert len(lp.top) == params.logprobs
            if lp.top:
                values, ids = torch.topk(expected, params.logprobs)
                assert [t for t, _ in lp.top] == ids.tolist()
                assert max(abs(v - e) for (_, v), e in zip(lp.top, values.tolist(), strict=True)) <= 1e-5
    tokens, ref_logits = hf_greedy(reference(path), [5, 9, 13, 2], 6)
    assert [lp.token_id for lp in got] == tokens
    ref = [float(torch.log_softmax(row.float(), -1)[t]) for row, t in zip(ref_logits, tokens, strict=True)]
    assert max(abs(a.logprob - b) for a, b in zip(got, ref, strict=True)) <= 1e-4


@pytest.mark.parametrize("kwargs", [
    {"temperature": 5e-324}, {"top_p": 5e-324}, {"min_p": 1.0}, {"repetition_penalty": 5e-324},
    {"repetition_penalty": 1e300}, {"temperature": 2.0, "top_p": 5e-324, "min_p": 1.0, "top_k": 1},
    {"temperature": 1e-30, "repetition_penalty": 1e-30, "presence_penalty": 2, "frequency_penalty": -2},
])
def test_extreme_valid_params_still_sample(kwargs):
    """Any parameters the contract accepts give a token, never a NaN distribution (a sampler error
    fails the whole engine step, every running request with it)."""
    params = SamplingParams(seed=0, **kwargs)
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([3.0, -1.0, 2.5, -40.0, 0.0, float("-inf")])
    for output in ([], [0, 2, 1]):
        token = sample_token(logits, params, [0, 1, 3], output, gen)
        assert 0 <= token < 5
    # the best token survives every mask: a vanishing temperature or top-p becomes greedy
    if kwargs.get("repetition_penalty", 1.0) == 1.0:
        assert sample_token(logits, params, [], [], gen) == 0


def test_a_request_whose_sampling_fails_ends_alone(checkpoint):
    """A logits processor (or grammar, or sampler) that raises for one request ends that request
    with finish_reason "error" in the same step as the others, which go on to their full length."""
    from hearth.engine.llm import LLM

    path, _ = checkpoint("qwen3_moe")
    llm = LLM(path)
    engine = llm.engine

    def fail_one(prompt, output, logits):
        if prompt[0] == 7 and len(output) == 2:
            raise RuntimeError("processor bug")
        return logits

    engine.logits_processors = (fail_one,)
    bad = engine.add_request([7, 9, 13], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    good = engine.add_request([5, 9, 13], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = (out.chunk.finish_reason, len(out.token_ids))
    assert finished == {bad: ("error", 2), good: ("length", 6)}
    assert engine.num_unfinished() == 0 and not engine._requests  # nothing left behind
