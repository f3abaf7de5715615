"""The sampler: penalties, temperature, top-k, top-p, min-p and seeds (the parameters are a contract:
:class:`hearth.proto.contracts.SamplingParams`)."""

from __future__ import annotations

import torch

from hearth.proto.contracts import SamplingParams, TokenLogprob


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Repetition penalty (over prompt and output, as in transformers), OpenAI presence/frequency
    penalties (over the output), then ``logit_bias``. ``logits``: [V] fp32."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        if seen.numel():
            picked = logits[seen]
            penalised = torch.where(picked < 0, picked * params.repetition_penalty, picked / params.repetition_penalty)
            # An extreme penalty (1e-300, 1e300) overflows to +-inf, and a row of +inf samples NaN:
            # keep the finite logits finite (a -inf from a grammar mask stays -inf).
            big = torch.finfo(logits.dtype).max
            penalised = torch.where(picked.isfinite(), penalised.clamp(-big, big), picked)
            logits = logits.index_copy(0, seen, penalised)
    if output and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
        penalty = params.frequency_penalty * counts.float() + params.presence_penalty
        logits = logits.index_add(0, ids, -penalty)
    if params.logit_bias:  # OpenAI's logit_bias: added last, to the logits the sampler reads
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        logits = logits.index_add(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype))
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking. ``logits``: [V] fp32, with a finite maximum.

    Every mask keeps the likeliest token, so that any valid parameters (a temperature or top-p of
    5e-324 included) give a distribution to sample from rather than NaN."""
    # Shifted so the largest is 0 (softmax does not change): a tiny temperature then divides into
    # 0 and -inf, never +inf; the best stays 0 where the temperature rounds to 0 in fp32 (0/0).
    shifted = logits - logits.max()
    logits = torch.where(shifted == 0, shifted, shifted / params.temperature)
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the token crossing top_p
        drop[0] = False  # a top_p below fp32's smallest number compares as 0
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def greedy_token(logits: torch.Tensor) -> int:
    """The index of the largest logit (the first on ties; the first NaN if any, as torch.argmax).
    For CPU fp32 logits numpy's argmax: about 3 us for 32k logits on 2 cores where torch's takes
    about 40 us, a visible share of a batched decode step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt: list[int],
    output: list[int],
    generator: torch.Generator | None,
) -> int:
    """Pick the next token from one sequence's fp32 logits [V]. Logits on a GPU come to the host
    when anything but plain greedy applies: the penalties' index tensors and a seed's generator are
    host-side, and a seed then draws the same tokens on every device."""
    plain_greedy = params.greedy and params.repetition_penalty == 1.0 and not params.logit_bias and not (
        output and (params.presence_penalty or params.frequency_penalty))
    if logits.device.type != "cpu" and not plain_greedy:
        logits = logits.cpu()
    logits = apply_penalties(logits, params, prompt, output)
    if params.greedy or not bool(torch.isfinite(logits.max())):
        return greedy_token(logits)  # (a NaN or +inf logit is the model's, and sampling cannot use it)
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """``token``'s log-probability under the model's own distribution (the raw logits [V], before
    penalties, temperature and filtering, as OpenAI reports them) and the ``top`` likeliest tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logp, min(top, logp.numel()))
        alternatives = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logp[token]), alternatives)
