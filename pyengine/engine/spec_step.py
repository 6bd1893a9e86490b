"""S14 x S15: the engine's draft step — drafts for the sequences about to decode, constrained drafts cut where
their grammar stops allowing them, and the verification of each sequence's k + 1 rows.

`engine/spec_decode.py` decides how many drafts each sequence gets (the back-off) and counts them; the proposers
(`engine/proposers.py`) guess them; `layers/rejection_sampler.py` accepts a prefix. This is the glue the engine
loop calls: ``propose`` before scheduling a step, ``verify`` per sequence with drafts once its logits are back.
"""
from __future__ import annotations

import numpy as np

from pyengine.layers.rejection_sampler import verify
from pyengine.layers.sampler import token_logprobs
from pyengine.structured import processor as grammar      # module: tests swap its functions


class DraftStep:
    """``spec``: the engine's `SpeculativeDecoder`. ``draft_masks``: seq_id -> the grammar masks of its
    verification rows (S15), for the step in flight."""

    def __init__(self, spec):
        self.spec = spec
        self.draft_masks: dict[int, list] = {}

    def propose(self, running, owner) -> int:
        """S14: drafts for every running sequence about to decode (``owner``: seq_id -> its request). Returns the
        draft tokens the grammars cut (S15)."""
        seqs, rngs = [], []
        for seq in running:
            seq.spec_token_ids, seq.spec_draft_probs = [], None
            if seq.num_tokens - seq.num_computed_tokens == 1 and seq.params.speculative:
                req = owner[seq.seq_id]
                seqs.append(seq)
                rngs.append(req.rngs[seq.index])
                # S15: a drafter may mask its own guesses with the sequence's grammar
                seq.spec_grammar = req.matchers[seq.index] if req.matchers is not None else None
        if seqs:
            self.spec.propose(seqs, rngs)
            return self.check_drafts(seqs)
        return 0

    def check_drafts(self, seqs) -> int:
        """S15: cut each constrained draft at the first token its grammar forbids; keep the masks of its
        verification rows for `verify` (see structured/processor.py). Returns the tokens cut."""
        cut = 0
        self.draft_masks.clear()
        for seq in seqs:
            if seq.spec_grammar is None or not seq.spec_token_ids:
                continue
            k = len(seq.spec_token_ids)
            seq.spec_token_ids, seq.spec_draft_probs, masks = grammar.check_draft(
                seq.spec_grammar, seq.spec_token_ids, seq.spec_draft_probs)
            cut += k - len(seq.spec_token_ids)
            if seq.spec_token_ids:
                self.draft_masks[seq.seq_id] = masks
        return cut

    def verify(self, seq, req, rows) -> tuple[list[int], list]:
        """S14: the tokens one verification emits (accepted drafts + the model's own) and their logprobs."""
        p = req.params
        raw, masks = rows, self.draft_masks.get(seq.seq_id)
        if masks is not None:                   # S15: row i masked with the grammar after the first i drafts
            rows = grammar.mask_rows(rows, masks)
        if req.token_masks is not None:         # issue 32: row i after the first i drafts
            tm, drafts = req.token_masks[seq.index], seq.spec_token_ids
            rows = np.stack([tm.apply(rows[i], seq.output_token_ids, drafts[:i]) for i in range(len(rows))])
        toks = verify(rows, seq.spec_token_ids, seq.spec_draft_probs, p, req.rngs[seq.index],
                      seq.prompt_token_ids, seq.output_token_ids)
        infos = [token_logprobs(raw[j], t, p.logprobs) if p.logprobs is not None else None
                 for j, t in enumerate(toks)]
        return toks, infos

    def accepted(self, seq, req, accepted: int) -> int:
        """S14: ``accepted`` of ``seq``'s drafts were kept: the back-off's record and the request's metrics."""
        k = len(seq.spec_token_ids)
        self.spec.record(seq, k, accepted)
        m = req.metrics
        m.num_drafts += 1
        m.num_draft_tokens += k
        m.num_accepted_tokens += accepted
        return accepted

    def done(self, scheduled) -> None:
        """A step is back: its sequences' drafts and masks are spent."""
        for seq, _ in scheduled:
            seq.spec_token_ids, seq.spec_draft_probs = [], None
        self.draft_masks.clear()
