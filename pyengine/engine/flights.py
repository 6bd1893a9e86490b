"""S17 cross-step pipelining: the engine's steps in flight, from their scheduling until their logits are back.

With an executor over M > 1 pipeline stages the engine deals its running sequences into M groups and keeps one
step of each group in flight (`LLMEngine._pipelined_step`); this is the bookkeeping of those steps, oldest first.
"""
from __future__ import annotations


class Flight:
    """One scheduled step, from its scheduling until its logits are back (S17: several may be in flight)."""

    def __init__(self, group, sched, batch, sampled, decode_only, t_step, t_start, extra=None):
        self.group, self.sched, self.batch, self.sampled = group, sched, batch, sampled
        self.extra = extra                      # S19: the step's prompt-logprob / pooled rows (PromptPass)
        self.decode_only, self.t_step, self.t_start = decode_only, t_step, t_start


class InFlight:
    """The steps launched and not finished, in launch order (at most one per group); ``max_groups``: the most
    that were ever in flight at once (the engine's ``max_groups_in_flight``)."""

    def __init__(self):
        self.steps: list[Flight] = []
        self.max_groups = 0

    def __bool__(self) -> bool:
        return bool(self.steps)

    def groups(self) -> set[int]:
        """The groups with a step in flight (not to be scheduled again yet)."""
        return {f.group for f in self.steps}

    def seq_ids(self) -> set[int]:
        """The sequences of the steps in flight (an abort frees their blocks only when their step is back)."""
        return {s.seq_id for f in self.steps for s, _ in f.sched.scheduled}

    def add(self, flight: Flight) -> None:
        self.steps.append(flight)

    def launched(self) -> int:
        """After a round of launches: the steps in flight now (counted in ``max_groups``)."""
        self.max_groups = max(self.max_groups, len(self.steps))
        return len(self.steps)

    def oldest(self) -> Flight:
        return self.steps.pop(0)

    def drop(self, free) -> None:
        """No step is in flight any more (e.g. a lost rank): ``free(sched)`` for each, then forget them."""
        for f in self.steps:
            free(f.sched)
        self.steps.clear()
