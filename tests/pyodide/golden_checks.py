"""Golden-file checks shared by CPython and Pyodide (pure Python + NumPy, no file system, no pytest).

The Pyodide tests copy this file into Pyodide's in-memory FS and import it, so the same comparison
runs in both interpreters. Each check returns a list of human-readable failures (empty = pass), which
the caller asserts on; a failure names the case, position and token so a diff is actionable.
"""
from __future__ import annotations

import numpy as np

LOGPROB_TOL = 1e-3


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _first_diff(got: list, want: list) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"first difference at {i}: got {got[i:i + 5]} want {want[i:i + 5]}"


def check_tokenizer(tok, golden: dict) -> list[str]:
    """Every section of a tests/golden/tokenizer_*.json file (HF transformers' output):
    cases          encode(text) == ids (add_special_tokens=False, special tokens parsed); decode(ids) == text
    lossy_cases    encode(text) == ids; decode(ids) == decoded (text that does not survive a round trip)
    special_cases  encode(text, add_special_tokens, parse_special) == ids
    decode_cases   decode(ids) == text; decode(ids, skip_special_tokens=True) == text_skip_special"""
    failures = []
    for k, case in enumerate(golden.get("cases", []) + golden.get("lossy_cases", [])):
        text, want = case["text"], list(case["ids"])
        got = list(tok.encode(text, add_special_tokens=False))
        if got != want:
            failures.append(f"encode {text[:40]!r}: {_first_diff(got, want)}")
            continue
        back, expect = tok.decode(want), case.get("decoded", text)
        if back != expect:
            failures.append(f"decode of {text[:40]!r}: {back[:40]!r} != {expect[:40]!r}")
    for case in golden.get("special_cases", []):
        got = list(tok.encode(case["text"], add_special_tokens=case["add_special_tokens"],
                              parse_special=case["parse_special"]))
        if got != list(case["ids"]):
            failures.append(f"encode {case['text'][:40]!r} add_special_tokens={case['add_special_tokens']} "
                            f"parse_special={case['parse_special']}: {_first_diff(got, list(case['ids']))}")
    for case in golden.get("decode_cases", []):
        for skip, key in ((False, "text"), (True, "text_skip_special")):
            got = tok.decode(case["ids"], skip_special_tokens=skip)
            if got != case[key]:
                failures.append(f"decode {case['ids'][:6]} skip_special_tokens={skip}: {got[:40]!r} != "
                                f"{case[key][:40]!r}")
    return failures


def full_forward_logits(runner, token_ids: list[int], positions: list[int]) -> dict[int, np.ndarray]:
    """{position: logits} for one sequence, through ModelRunner.run: a chunked prefill of blocks 0, 1, 2, ...
    that ends a chunk at each wanted position (so the runner needs only one logits row per run and
    at most max_num_batched_tokens tokens per batch), i.e. the cost of a single forward pass."""
    from pyengine.engine.forward_batch import ForwardBatch

    limit = getattr(runner, "max_num_batched_tokens", len(token_ids))
    ends = sorted(set(int(p) + 1 for p in positions))
    out: dict[int, np.ndarray] = {}
    start = 0
    while start < ends[-1]:
        stop = min(next(e for e in ends if e > start), start + limit)
        n = stop - start
        batch = ForwardBatch(
            token_ids=np.asarray(token_ids[start:stop], dtype=np.int64),
            positions=np.arange(start, stop, dtype=np.int64),
            query_lens=[n],
            context_lens=[stop],
            block_tables=[np.arange(-(-stop // runner.block_size), dtype=np.int32)],
            logits_indices=np.asarray([n - 1], dtype=np.int64),
        )
        logits = runner.run(batch)
        if stop in ends:
            out[stop - 1] = np.array(logits[0], dtype=np.float32)   # copy: the runner reuses its buffer
        start = stop
    return out


def check_top_logprobs(logits_at: dict[int, np.ndarray], case: dict, tol: float = LOGPROB_TOL) -> list[str]:
    """Our log-softmax at each golden position, read at the golden top-20 ids, within `tol`."""
    failures = []
    for entry in case["top_logprobs"]:
        p = entry["position"]
        ours = log_softmax(logits_at[p])
        got = ours[np.asarray(entry["ids"])]
        want = np.asarray(entry["logprobs"], dtype=np.float64)
        err = np.abs(got - want)
        if not np.all(err <= tol):
            worst = int(err.argmax())
            failures.append(f"{case['prompt'][:30]!r} position {p}: |dlogprob| {err.max():.2e} > {tol} "
                            f"at token {entry['ids'][worst]} (got {got[worst]:.6f}, want {want[worst]:.6f})")
    return failures


def check_greedy(got: list[int], case: dict, n: int, stop_ids=()) -> list[str]:
    """The first n greedy tokens equal the reference's. A shorter output is right only if it ends with one
    of `stop_ids` (the engine stops there; the reference ran on). A divergence is tolerated only after a step
    whose top1-top2 margin is below 1e-3 (fp32 rounding may legitimately flip such a tie)."""
    want = list(case["greedy_ids"][:n])
    got = list(got[:n])
    if got == want:
        return []
    if got and len(got) < n and got == want[:len(got)] and got[-1] in set(stop_ids):
        return []
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if first in set(case.get("tiny_margin_steps", [])):
        return []
    margins = case.get("greedy_margins") or []
    margin = margins[first] if first < len(margins) else None
    return [f"{case['prompt'][:30]!r}: greedy differs at step {first} (margin {margin}): "
            f"got {got[first:first + 5]} want {want[first:first + 5]}"]


def cases_without_stops(golden: dict, n: int, stop_ids, k: int) -> list[dict]:
    """The k shortest-prompt cases whose first n greedy tokens contain no stop token (so an engine that
    stops at end-of-turn must produce all n of them)."""
    ok = [c for c in golden["cases"] if not set(c["greedy_ids"][:n]) & set(stop_ids)]
    return sorted(ok, key=lambda c: len(c["prompt_ids"]))[:k]


def engine_greedy(engine, prompt_ids: list[int], n: int, request_id: str = "golden") -> list[int]:
    """n greedy tokens from an LLMEngine (ignore_eos so the length is fixed)."""
    from pyengine import SamplingParams

    engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)},
                       SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                ids = list(out.outputs[0].token_ids)
    return ids


def metadata_digest(metadata: dict) -> dict[str, str]:
    """A short fingerprint per GGUF metadata key (value type + value), so two runtimes' readers can be
    compared without shipping a 262k-entry vocabulary around."""
    import hashlib

    out = {}
    for key, value in metadata.items():
        if isinstance(value, np.ndarray):
            blob = f"ndarray {value.dtype.str} {value.shape} ".encode() + np.ascontiguousarray(value).tobytes()
        elif isinstance(value, (list, tuple)):
            # str() not repr(): repr's escaping follows the interpreter's Unicode tables (3.11 != 3.13)
            blob = ("list " + "\x00".join(f"{type(v).__name__}:{v}" for v in value)).encode("utf-8", "surrogatepass")
        else:
            blob = f"{type(value).__name__} {value}".encode("utf-8", "surrogatepass")
        out[key] = hashlib.sha256(blob).hexdigest()[:16]
    return out
