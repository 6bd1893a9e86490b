"""S01/S14/S15: the sampling half of a step — the logits rows of each sampled sequence, the plain rows through the
batch sampler (with S15's grammar masks and issue 32's token masks), the sequences with drafts through their
verification (engine/spec_step.py). The engine loop (engine/llm_engine.py) appends what this returns.
"""
from __future__ import annotations


def first_rows(sampled) -> list[int]:
    """The first logits row of each sampled sequence: one row each, k + 1 for a sequence with k drafts."""
    rows, row = [], 0
    for s in sampled:
        rows.append(row)
        row += 1 + len(s.spec_token_ids)
    return rows


def sample_step(sampler, drafts, sampled, reqs, logits) -> list[tuple[list[int], list]]:
    """(tokens, their logprob infos) per sampled sequence (``reqs``: their requests): plain rows through
    ``sampler`` in one batch, sequences with drafts through ``drafts.verify``."""
    rows = first_rows(sampled)
    plain = [i for i, s in enumerate(sampled) if not s.spec_token_ids]
    results: list = [None] * len(sampled)
    if plain:
        sel = logits if len(plain) == len(logits) else logits[[rows[i] for i in plain]]
        allowed = None                      # S15: the grammar's token mask of each constrained row
        if any(reqs[i].matchers is not None for i in plain):
            allowed = [reqs[i].matchers[sampled[i].index].allowed_mask() if reqs[i].matchers is not None
                       else None for i in plain]
        token_masks = None                  # issue 32: allowed_token_ids, bad_words, min_tokens, thinking
        if any(reqs[i].token_masks is not None for i in plain):
            token_masks = [reqs[i].token_masks[sampled[i].index] if reqs[i].token_masks is not None
                           else None for i in plain]
        tokens, infos = sampler.sample(
            sel, [reqs[i].params for i in plain], [sampled[i].prompt_token_ids for i in plain],
            [sampled[i].output_token_ids for i in plain], [reqs[i].rngs[sampled[i].index] for i in plain],
            allowed=allowed, token_masks=token_masks)
        for i, tok, info in zip(plain, tokens.tolist(), infos):
            results[i] = ([int(tok)], [info])
    for i, seq in enumerate(sampled):
        if results[i] is None:
            results[i] = drafts.verify(seq, reqs[i], logits[rows[i]:rows[i] + 1 + len(seq.spec_token_ids)])
    return results
