"""S11: the chunk budget, chosen every step from a target inter-token latency (Sarathi-Serve's rule).

A prompt chunk shares its step with the running decodes, so every token it computes delays every decode's next
token. A fixed token budget ("17 tokens a step") is a guess at what a step may cost; here the scheduler asks
instead: *how many prompt tokens fit in this step so that the step is predicted to take at most the target
inter-token latency (ITL)?*

The prediction comes from a cost model fitted online to the engine's own measured step times, so it follows
the host (a slower phase of a shared machine makes the chunks smaller, a quiet one larger). A step's shape is
four numbers (`StepShape.x`):

    1                       fixed cost of a step (Python, plan, the weights streamed once)
    tokens                  rows through the linear layers (decodes, their drafts and prompt chunks alike)
    decodes                 sequences decoding (a decode-attention call, a sampled row each)
    attention pairs / 2**20 (query, key) pairs: a decode of n tokens ending at context c has n * c, a prompt
                            chunk of n tokens from position s attends to s + 1 .. s + n keys, n * (s + (n + 1) / 2)

and step seconds = features @ theta, theta >= 0, fitted by exponentially weighted least squares (recent steps
weigh most: host-speed drift) with robust reweighting (a step the OS descheduled does not move the fit).
Decode-only steps and steps with prompt work are kept in separate windows, each weighted by its own recency,
so a long calm stretch of decodes does not make the model forget what a prompt token costs, nor a long prompt
what a step of decodes alone costs.

The budget rule for one step, given the decodes already planned (they always run first):

* target = the configured target ITL, or (``target_itl_ms=None``) m x the predicted cost of this step's decodes
  alone, with m = ``tuning.ITL_GOAL_MULT`` / (1 + spread): the spread is how far above its prediction a step
  with prompt work ran, measured when it ran (the ``tuning.ITL_SPREAD_QUANTILE`` quantile, 1: the largest, of
  the window's time / predicted - 1), so a steady host gets chunks close to the ITL goal and a noisy one keeps
  a margin for the p99 (m within ``tuning.TARGET_ITL_MIN_MULT`` .. ``ITL_GOAL_MULT``; ``tuning.TARGET_ITL_DECODE_MULT``
  until ``tuning.ITL_SPREAD_MIN_STEPS`` such steps are measured);
* each prompt chunk gets the largest n with predicted(step + chunk) <= target, capped by the token budget and by
  a trust region: at most ``tuning.CHUNK_GROWTH`` x the largest chunk the model has measured (the model is
  linear; it is never asked to extrapolate far beyond the shapes it has seen);
* the first chunk of a step gets at least ``tuning.CHUNK_MIN_TOKENS`` (or what the token budget leaves), so a
  prompt always progresses, however tight the target;
* a step with no decodes has no ITL to protect: its prompts take the whole token budget.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from pyengine import tuning

NUM_FEATURES = 4
FEATURE_NAMES = ("fixed", "token", "decode", "attention_pair_m")
# One attention term for decodes and chunks alike: with a separate decode-key term, the decodes' contexts (which
# grow by one token a step) soaked up any drift of the host during a long prompt, and inflated the derived target.


class StepShape:
    """The features of one step as the scheduler plans it (see the module docstring)."""

    def __init__(self):
        self.x = np.zeros(NUM_FEATURES)
        self.x[0] = 1.0
        self.decodes_x = self.x.copy()          # the step with its decodes alone (the derived target's base)
        self.num_decodes = 0
        self.num_chunks = 0
        self.max_chunk = 0

    def add_decode(self, context: int, n: int) -> None:
        """A decode computing ``n`` tokens (1 + its drafts) whose context ends at ``context`` keys."""
        f = np.array([0.0, n, 1.0, n * context / 2**20])
        self.x += f
        self.decodes_x += f
        self.num_decodes += 1

    def add_chunk(self, start: int, n: int) -> None:
        """A prompt chunk of ``n`` tokens at positions ``start .. start + n - 1``."""
        self.x += chunk_features(start, n)
        self.num_chunks += 1
        self.max_chunk = max(self.max_chunk, n)


def chunk_features(start: int, n: int) -> np.ndarray:
    f = np.zeros(NUM_FEATURES)
    f[1] = n
    f[3] = n * (start + (n + 1) / 2) / 2**20
    return f


class StepCostModel:
    """Step seconds = features @ theta, fitted online (weighted least squares, theta >= 0, robust weights)."""

    def __init__(self, window: int | None = None, half_life: float | None = None):
        self.window = window or tuning.STEP_COST_WINDOW
        self.half_life = half_life or tuning.STEP_COST_HALF_LIFE
        self.decode_only: deque = deque(maxlen=self.window)  # (observation number, features, seconds, max chunk,
        self.with_chunks: deque = deque(maxlen=self.window)  #  seconds / what the model predicted before - 1)
        self.num_observed = 0
        self.theta = np.zeros(NUM_FEATURES)
        self._stale = False

    def observe(self, shape: StepShape, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        self.num_observed += 1
        # the model as it was when the step was planned (a step with chunks always asked it): its error then, if
        # the step's chunk was no larger than one measured before (the trust region's ramp is the model
        # extrapolating, not the host's noise)
        before = float(shape.x @ self.theta)
        seen = before > 0 and shape.max_chunk <= self.largest_chunk_seen()
        error = seconds / before - 1 if seen else math.nan
        (self.with_chunks if shape.num_chunks else self.decode_only).append(
            (self.num_observed, shape.x.copy(), float(seconds), shape.max_chunk, error))
        self._stale = True

    def spread(self) -> float | None:
        """How far above its prediction a step with prompt work ran: the ``tuning.ITL_SPREAD_QUANTILE``
        quantile of the window's time / predicted - 1 (each against the model that planned it; steps whose chunk
        was larger than any measured before are left out), or None while fewer than
        ``tuning.ITL_SPREAD_MIN_STEPS`` such steps are measured."""
        errors = [row[4] for row in self.with_chunks if math.isfinite(row[4])]
        if len(errors) < tuning.ITL_SPREAD_MIN_STEPS:
            return None
        return float(np.quantile(errors, tuning.ITL_SPREAD_QUANTILE))

    def largest_chunk_seen(self) -> int:
        """The largest prompt chunk in the windows, in tokens (0 before any)."""
        return max((row[3] for row in self.with_chunks), default=0)

    def predict(self, x: np.ndarray) -> float:
        if self._stale:
            self.fit()
        return float(x @ self.theta)

    def fit(self) -> np.ndarray:
        rows = list(self.decode_only) + list(self.with_chunks)
        self._stale = False
        if not rows:
            return self.theta
        X = np.array([row[1] for row in rows])
        y = np.array([row[2] for row in rows])
        # age within each window (newest = 0): a long prompt's many chunk steps do not age the decode-only
        # measurements away, which the derived target and the fixed cost rest on
        age = np.concatenate([np.arange(len(q))[::-1] for q in (self.decode_only, self.with_chunks)])
        w = 0.5 ** (age / self.half_life)
        theta = _fit_nonnegative(X, y, w)
        # robust reweighting: Huber passes (big residuals count linearly) until the fit is near the bulk of the
        # steps, then two Tukey bisquare passes (a step the OS descheduled, several times too slow, ends up with
        # no weight at all)
        for bisquare in [False] * 6 + [True] * 2:
            r = y - X @ theta
            # (a floor of 2% of a typical step: no host times its steps more steadily than that)
            scale = max(1.4826 * float(np.median(np.abs(r))), 0.02 * float(np.median(y)), 1e-12)
            if bisquare:
                robust = np.clip(1 - (r / (4.685 * scale)) ** 2, 0, None) ** 2
            else:
                robust = np.minimum(1.0, 1.345 * scale / np.maximum(np.abs(r), 1e-300))
            theta = _fit_nonnegative(X, y, w * robust)
        self.theta = theta
        return theta


def _fit_nonnegative(X: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """argmin sum w (X theta - y)^2 + ridge, theta >= 0 (an active set: a negative coefficient is dropped and
    the rest refitted). Columns are scaled to unit weighted RMS so the small ridge treats them alike; a column
    never seen (all zero) gets 0."""
    sw = np.sqrt(w)
    Xw, yw = X * sw[:, None], y * sw
    scale = np.sqrt(np.mean(Xw ** 2, axis=0))
    active = scale > 0
    theta = np.zeros(X.shape[1])
    while active.any():
        A = Xw[:, active] / scale[active]
        k = A.shape[1]
        gram = A.T @ A + tuning.STEP_COST_RIDGE * len(y) * np.eye(k)
        beta = np.linalg.solve(gram, A.T @ yw)
        if (beta >= 0).all():
            theta[active] = beta / scale[active]
            break
        idx = np.flatnonzero(active)
        active[idx[np.argmin(beta)]] = False
    return theta


class ChunkBudget:
    """The scheduler's per-step choice of prompt-chunk sizes (see the module docstring).

    ``target_itl_ms``: the step time to stay within while decodes run, in milliseconds; None derives it from
    the decodes' own predicted cost (``multiplier()`` x), so it follows the model, the host and its noise."""

    def __init__(self, target_itl_ms: float | None = None, min_chunk: int | None = None,
                 model: StepCostModel | None = None):
        self.target_itl = check_target_itl_ms(target_itl_ms) / 1000 if target_itl_ms is not None else None
        self.min_chunk = min_chunk or tuning.CHUNK_MIN_TOKENS
        if self.target_itl is not None and self.target_itl <= 0:
            raise ValueError("a ChunkBudget needs a target ITL > 0 (0 = off: the engine builds none)")
        self.model = model or StepCostModel()
        self.last_target = None        # seconds: the target of the last step that had decodes (for stats)

    def target(self, shape: StepShape) -> float:
        if self.target_itl is not None:
            return self.target_itl
        return self.multiplier() * self.model.predict(shape.decodes_x)

    def multiplier(self) -> float:
        """The derived target / the decodes' predicted step: ITL_GOAL_MULT / (1 + the measured spread), clipped
        to TARGET_ITL_MIN_MULT .. ITL_GOAL_MULT; TARGET_ITL_DECODE_MULT before the spread is measured."""
        spread = self.model.spread()
        if spread is None:
            return tuning.TARGET_ITL_DECODE_MULT
        return min(tuning.ITL_GOAL_MULT, max(tuning.TARGET_ITL_MIN_MULT, tuning.ITL_GOAL_MULT / (1 + max(spread, 0.0))))

    def max_chunk(self, shape: StepShape, start: int, limit: int) -> int:
        """Prompt tokens (<= ``limit``) a chunk starting at position ``start`` may compute in the step planned
        so far (``shape``: its decodes and earlier chunks). 0 = not this step."""
        if limit <= 0:
            return 0
        if shape.num_decodes == 0:
            return limit                                          # no inter-token latency to protect
        floor = min(self.min_chunk, limit) if shape.num_chunks == 0 else 0
        trust = max(self.min_chunk, int(tuning.CHUNK_GROWTH * self.model.largest_chunk_seen()))
        hi = min(limit, trust)
        target = self.last_target = self.target(shape)
        if hi <= floor:
            return hi
        # the predicted step time grows with n (theta >= 0): bisect for the largest n within the target
        lo = floor
        if self.model.predict(shape.x + chunk_features(start, hi)) <= target:
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.model.predict(shape.x + chunk_features(start, mid)) <= target:
                lo = mid
            else:
                hi = mid
        return lo

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.model.observe(shape, seconds)

    def stats(self) -> dict:
        theta = self.model.theta
        target = self.target_itl if self.target_itl is not None else self.last_target
        out = {"target_itl_ms": None if target is None else 1000 * target,
               **{f"step_cost_{name}": float(v) for name, v in zip(FEATURE_NAMES, theta)}}
        spread = self.model.spread()
        if spread is not None:                      # measured: the derived target's multiplier follows it
            out["step_cost_spread"] = spread
        if self.target_itl is None:
            out["target_itl_multiplier"] = self.multiplier()
        return out


def check_target_itl_ms(value) -> float:
    """A target ITL in ms: a finite number >= 0 (0 = off: the token budget alone decides)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"target_itl_ms must be a finite number of milliseconds >= 0 (0 = off), got {value!r}")
    return float(value)
