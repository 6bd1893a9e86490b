"""S14: verifying k drafted tokens with one forward pass, keeping the output distribution the model's.

The model scored the sequence's last token and its k drafts d_1..d_k in one pass, giving k+1 rows of logits:
row i is the model's next-token distribution after the context plus d_1..d_i. Each row first goes through the
request's own pipeline (logit bias, penalties over the output *including the drafts before it*, temperature,
top-k/p, min-p), so ``p_i`` below is exactly the distribution plain decoding would sample from there.

Greedy: accept drafts while each equals the argmax of its row; the first row that disagrees gives the
model's own token (the correction), and when all k agree row k gives one more (the bonus token).

Sampled (Leviathan et al. 2023, Chen et al. 2023): draft i came from the drafter's distribution q_i. Accept it
with probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection draw the replacement from the normalised
residual max(0, p_i - q_i) and stop; if all k pass, draw a bonus token from p_k. Every emitted token is then
distributed exactly as under p. A drafter that proposes one token for sure (n-gram lookup) has q_i one-hot on
d_i: it is accepted with probability p_i(d_i), and a rejection draws from p_i with d_i removed.

The sampling law (docs/sampling.md) realises that one-hot rule with the sequence's own stream: row i draws
the token plain decoding would draw there (`sample_row`, one uniform double) and the draft is accepted when
it is that token. Accepting with probability p_i(d_i) and otherwise emitting a token of p_i without d_i is
exactly what that draw does, and the stream is consumed one double per emitted token as in plain decoding,
so a seeded sequence's text does not depend on how many drafts each step verified (batch composition,
adaptive draft lengths, timing). A seeded sequence with a draft *model* uses the same coupled rule: its
drafts are drawn from q_i with the uniform its row will use (`peek_uniform`) and handed over without q;
drafts that come with q (unseeded draft-model rows) keep the maximal coupling above, which accepts more often.
"""
from __future__ import annotations

import numpy as np

from pyengine.layers.sampler import distribution_logits, law_draw, law_weights, process_logits, softmax
from pyengine.sampling_params import SamplingParams


def target_distribution(logits: np.ndarray, params: SamplingParams, prompt_ids=(), output_ids=()) -> np.ndarray:
    """(V,) float64: the distribution `sample_row` draws from for one row (the whole pipeline, no draw)."""
    x = process_logits(logits, params, prompt_ids, output_ids)
    if params.greedy:
        p = np.zeros(x.shape[-1])
        p[int(np.argmax(x))] = 1.0
        return p
    x, live = distribution_logits(x, params)
    probs = softmax(x)
    if live is None:
        return probs
    full = np.zeros(len(logits))
    full[live] = probs
    return full


def law_distribution(logits: np.ndarray, params: SamplingParams, prompt_ids=(), output_ids=()) -> np.ndarray:
    """(V,) float64: the law's unnormalised weights `sample_row` walks for one sampled row (0 on every removed
    token), so `draw(law_distribution(...), rng)` is bit for bit the token `sample_row` draws."""
    x, live = distribution_logits(process_logits(logits, params, prompt_ids, output_ids), params)
    w = law_weights(x)
    if live is None:
        return w
    full = np.zeros(len(logits))
    full[live] = w
    return full


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One index of an (unnormalised) probability vector by inverting its CDF with one uniform number
    (the law's walk: ascending index, running sum in float64)."""
    return law_draw(probs, rng.random())


def rejection_sample(draft_ids, target_probs: np.ndarray, draft_probs: np.ndarray | None,
                     rng: np.random.Generator) -> list[int]:
    """Tokens to emit (1..k+1 of them) for k drafts. ``target_probs`` (k+1, V) are the p_i; ``draft_probs``
    (k, V) the q_i, or None for a one-hot drafter."""
    k = len(draft_ids)
    out: list[int] = []
    if draft_probs is None:
        # one-hot drafter, the law's coupled form: row i's own draw; the draft is accepted iff it is that token
        for i, d in enumerate(draft_ids):
            out.append(draw(target_probs[i], rng))
            if out[-1] != int(d):
                return out
        out.append(draw(target_probs[k], rng))
        return out
    for i, d in enumerate(draft_ids):
        p = target_probs[i]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        # accept with min(1, p/q): u * q < p  (q_d > 0: the drafter did propose d)
        if rng.random() * q_d < p[d]:
            out.append(int(d))
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - draft_probs[i], 0.0)
        if not residual.sum() > 0.0:                 # p == q up to rounding: the residual is empty
            residual = p
        out.append(draw(residual, rng))
        return out
    out.append(draw(target_probs[k], rng))
    return out


def peek_uniform(rng: np.random.Generator, ahead: int) -> float:
    """The uniform double ``rng.random()`` will return after ``ahead`` more draws, without consuming any
    (each double is one 64-bit step of the bit generator, so a copy advanced by ``ahead`` gives it)."""
    bg = type(rng.bit_generator)()
    bg.state = rng.bit_generator.state
    if ahead:
        bg.advance(ahead)
    return float(np.random.Generator(bg).random())


def verify_greedy(draft_ids, argmax_ids) -> list[int]:
    """Greedy verification: the longest prefix of drafts equal to the rows' argmax, then the model's token."""
    out: list[int] = []
    for d, a in zip(draft_ids, argmax_ids):
        out.append(int(a))
        if int(d) != int(a):
            return out
    out.append(int(argmax_ids[len(draft_ids)]))
    return out


def verify(logits: np.ndarray, draft_ids, draft_probs, params: SamplingParams, rng, prompt_ids, output_ids
           ) -> list[int]:
    """Verify one sequence's k drafts against its (k+1, V) logits rows (raw, as the model gave them).
    Row i's processors see ``output_ids + draft_ids[:i]``, as plain decoding would have."""
    k = len(draft_ids)
    shaped = bool(params.logit_bias) or params.has_penalties
    if params.greedy and not shaped:
        return verify_greedy(draft_ids, np.argmax(logits[:k + 1], axis=-1))
    outputs = [list(output_ids) + [int(t) for t in draft_ids[:i]] for i in range(k + 1)]
    if params.greedy:
        out: list[int] = []
        for i in range(k + 1):          # row by row: a disagreement makes the later rows irrelevant
            a = int(np.argmax(process_logits(logits[i], params, prompt_ids, outputs[i])))
            out.append(a)
            if i == k or a != int(draft_ids[i]):
                return out
    if rng is None:
        raise ValueError("a random generator is required for temperature > 0")
    if draft_probs is None:
        # the law (docs/sampling.md): each row's plain draw, one double per emitted token (a seeded draft
        # model's guesses were drawn coupled to those doubles and come without q: proposers.py)
        law = np.stack([law_distribution(logits[i], params, prompt_ids, outputs[i]) for i in range(k + 1)])
        return rejection_sample(draft_ids, law, None, rng)
    target = np.stack([target_distribution(logits[i], params, prompt_ids, outputs[i]) for i in range(k + 1)])
    return rejection_sample(draft_ids, target, draft_probs, rng)
