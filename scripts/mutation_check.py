"""Planted-bug check (outside CI): does the suite catch one-line bugs?

Each mutation below replaces one exact piece of text in one file of a *temporary copy* of the package and
runs the tests that guard that code; the mutation is caught when those tests fail. Every mutation must be
caught. The checkout itself is never modified.

    .venv/bin/python scripts/mutation_check.py              # all mutations, then a markdown table
    .venv/bin/python scripts/mutation_check.py --only topp  # the mutations whose name contains "topp"
    .venv/bin/python scripts/mutation_check.py --list

Exit status 1 if a mutation survives, its text is not found exactly once (stale after a refactor: update
the entry), or the unmutated tests do not pass.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name, file, exact old text (must occur once), new text, tests to run (paths relative to the repo root)
MUTATIONS = [
    # --- the two bugs issue 20 found surviving the suite
    ("sampler-topp-fastpath-capped-512", "pyengine/layers/sampler.py",
     "if np.all(np.sum(top, axis=-1) >= p):", "if True:", ["tests/test_sampling_large_vocab.py"]),
    ("rotary-llama3-mid-band-weights-swapped", "pyengine/layers/rotary.py",
     "mid = (1 - smooth) * inv / factor + smooth * inv", "mid = smooth * inv / factor + (1 - smooth) * inv",
     ["tests/test_rope_scaling.py"]),
    # --- sampler
    ("sampler-topp-fastpath-any-row", "pyengine/layers/sampler.py",
     "if np.all(np.sum(top, axis=-1) >= p):", "if np.any(np.sum(top, axis=-1) >= p):",
     ["tests/test_sampling_large_vocab.py"]),
    ("sampler-topk-keeps-k-minus-1", "pyengine/layers/sampler.py",
     "kth = np.partition(x, V - k, axis=-1)[..., V - k:V - k + 1]",
     "kth = np.partition(x, V - k + 1, axis=-1)[..., V - k + 1:V - k + 2]", ["tests/test_sampling_processors.py"]),
    ("sampler-presence-penalty-dropped", "pyengine/layers/sampler.py",
     "out[..., ids] -= frequency * counts + presence", "out[..., ids] -= frequency * counts",
     ["tests/test_sampling_processors.py"]),
    ("sampler-repetition-penalty-sign", "pyengine/layers/sampler.py",
     "np.where(sel > 0, sel / penalty, sel * penalty)", "np.where(sel > 0, sel * penalty, sel / penalty)",
     ["tests/test_sampling_processors.py"]),
    ("sampler-minp-threshold-squared-root", "pyengine/layers/sampler.py",
     "floor = np.max(x, axis=-1, keepdims=True) + np.log(min_p)",
     "floor = np.max(x, axis=-1, keepdims=True) + np.log(min_p) / 2", ["tests/test_sampling_large_vocab.py"]),
    ("sampler-seeded-choices-share-a-stream", "pyengine/layers/sampler.py",
     "        if index == 0:\n            return np.random.default_rng(params.seed)",
     "        if index >= 0:\n            return np.random.default_rng(params.seed)",
     ["tests/test_sampling_processors.py"]),
    # --- rotary
    ("rotary-linear-multiplies", "pyengine/layers/rotary.py",
     "        inv = inv / factor\n", "        inv = inv * factor\n", ["tests/test_rope_scaling.py"]),
    ("rotary-apply-rope-sign", "pyengine/layers/rotary.py",
     "    o2 += tmp\n", "    o2 -= tmp\n", ["tests/test_model_layers.py"]),
    # --- attention
    ("attention-flash-rescale-inverted", "pyengine/layers/attention.py",
     "corr = np.exp(m - m_new)", "corr = np.exp(m_new - m)", ["tests/test_attention_flash.py"]),
    ("attention-causal-mask-hides-self", "pyengine/layers/attention.py",
     "masked = keys > qpos", "masked = keys >= qpos", ["tests/test_attention_flash.py"]),
    # --- the runner's step plan and paged attention (S06, the model/runner split)
    ("paged-window-off-by-one", "pyengine/layers/paged_attention.py",
     "hidden |= qpos - keys >= window", "hidden |= qpos - keys > window", ["tests/test_model_contracts.py"]),
    ("paged-short-query-positions-shifted", "pyengine/layers/paged_attention.py",
     "qpos = (lens[:, None] - q_len + np.arange(q_len)[None, :])[:, :, None]",
     "qpos = (lens[:, None] - q_len + 1 + np.arange(q_len)[None, :])[:, :, None]", ["tests/test_model_contracts.py"]),
    ("plan-window-reads-whole-context", "pyengine/engine/step_plan.py",
     "first = 0 if window is None else max(0, ctx - qlen - window + 1)", "first = 0",
     ["tests/test_model_contracts.py"]),
    ("attention-decode-padding-off-by-one", "pyengine/layers/attention.py",
     "return (np.arange(L) >= lens[:, None])[:, None, None, :]",
     "return (np.arange(L) > lens[:, None])[:, None, None, :]", ["tests/test_attention_decode.py"]),
    # --- kv_cache
    ("kv-cache-gapped-table-read-as-contiguous", "pyengine/engine/kv_cache.py",
     "bool(np.all(np.diff(table) == 1))", "bool(np.all(np.diff(table) >= 1))",
     ["tests/test_attention_flash.py", "tests/test_block_manager_paging.py"]),
    ("kv-cache-slot-offset-dropped", "pyengine/engine/kv_cache.py",
     "[positions // block_size] * block_size + positions % block_size",
     "[positions // block_size] * block_size", ["tests/test_attention_flash.py", "tests/test_block_manager_paging.py"]),
    # --- block manager
    ("block-manager-prefix-hit-covers-last-token", "pyengine/engine/block_manager.py",
     "num_full = (seq.num_tokens - 1) // bs", "num_full = seq.num_tokens // bs",
     ["tests/test_block_manager_paging.py", "tests/test_engine_fake_runner.py"]),
    ("block-manager-duplicate-hash-overwrites-cache", "pyengine/engine/block_manager.py",
     "if self.block_hash[b] is None and h not in self.cached:", "if self.block_hash[b] is None:",
     ["tests/test_block_manager_paging.py", "tests/test_engine_fake_runner.py"]),
    ("block-manager-revived-hits-not-counted", "pyengine/engine/block_manager.py",
     "return self.num_free_blocks() - revived - need >= reserve", "return self.num_free_blocks() - need >= reserve",
     ["tests/test_block_manager_paging.py", "tests/test_engine_fake_runner.py"]),
    # --- scheduler
    ("scheduler-preempts-most-urgent", "pyengine/engine/scheduler.py",
     "victim = max(self.running, key=self.key)", "victim = min(self.running, key=self.key)",
     ["tests/test_scheduler_policy.py"]),
    ("scheduler-no-watermark", "pyengine/engine/scheduler.py",
     "reserve = self.watermark_blocks if self.running else 0", "reserve = 0", ["tests/test_scheduler_policy.py"]),
    # --- S11 chunk budget
    ("chunk-budget-no-floor", "pyengine/engine/chunk_budget.py",
     "floor = min(self.min_chunk, limit) if shape.num_chunks == 0 else 0", "floor = 0",
     ["tests/test_chunk_budget.py"]),
    ("chunk-budget-pairs-ignored", "pyengine/engine/chunk_budget.py",
     "f[3] = n * (start + (n + 1) / 2) / 2**20", "f[3] = 0.0", ["tests/test_chunk_budget.py"]),
    ("chunk-budget-derived-target-on-whole-step", "pyengine/engine/chunk_budget.py",
     "self.model.predict(shape.decodes_x)", "self.model.predict(shape.x)", ["tests/test_chunk_budget.py"]),
    # --- stop checker
    ("stop-checker-first-start-not-first-end", "pyengine/engine/stop_checker.py",
     "key = (i + len(s), i)", "key = (i, i + len(s))", ["tests/test_stop_checker.py"]),
    ("stop-checker-holdback-one-short", "pyengine/engine/stop_checker.py",
     "for k in range(min(len(s) - 1, len(text)), longest, -1):",
     "for k in range(min(len(s) - 2, len(text)), longest, -1):", ["tests/test_stop_checker.py"]),
    ("stop-checker-length-one-late", "pyengine/engine/stop_checker.py",
     "self.num_tokens >= self.max_tokens", "self.num_tokens > self.max_tokens", ["tests/test_stop_checker.py"]),
    # --- tokenizer
    ("tokenizer-spm-one-fffd-per-bad-run", "pyengine/tokenizer/detokenize.py",
     'return "\\ufffd" * len(run)', 'return "\\ufffd"', ["tests/test_tokenizer_golden.py"]),
    ("tokenizer-bpe-merge-rightmost-tie", "pyengine/tokenizer/merge.py",
     "heap.append((m[0], i, m[1]))", "heap.append((m[0], n - i, m[1]))", ["tests/test_tokenizer_golden.py"]),
    ("tokenizer-detok-keeps-special-text", "pyengine/tokenizer/detokenize.py",
     "if self.skip_special_tokens and token_id in self.tokenizer.special_ids:",
     "if not self.skip_special_tokens and token_id in self.tokenizer.special_ids:",
     ["tests/test_tokenizer_golden.py"]),
    # --- chat templates
    ("chat-chatml-generation-prompt-newline", "pyengine/tokenizer/chat_template.py",
     'out.append("<|im_start|>assistant\\n")', 'out.append("<|im_start|>assistant")',
     ["tests/test_chat_templates.py"]),
    ("chat-gemma-content-not-stripped", "pyengine/tokenizer/chat_template.py",
     "{_text(m, i).strip()}<end_of_turn>", "{_text(m, i)}<end_of_turn>", ["tests/test_chat_templates.py"]),
    # --- quants
    ("quants-q4_0-offset-7", "pyengine/gguf/quants.py",
     "    q = _nibbles(b[\"qs\"], np.int8)\n    q -= 8\n", "    q = _nibbles(b[\"qs\"], np.int8)\n    q -= 7\n",
     ["tests/test_quants_formats.py"]),
    ("quants-high-nibble-shift-3", "pyengine/gguf/quants.py",
     "np.right_shift(qs, 4, out=q[:, 1], casting=\"unsafe\")", "np.right_shift(qs, 3, out=q[:, 1], casting=\"unsafe\")",
     ["tests/test_quants_formats.py"]),
    # --- server (OpenAI logprobs)
    ("server-top-logprobs-carry-the-sampled-value", "pyengine/server/shaping.py",
     "alts.setdefault(token_text(tokenizer, aid)[0], _safe_lp(alp))",
     "alts.setdefault(token_text(tokenizer, aid)[0], _safe_lp(lp))",
     ["tests/test_server_openai.py::test_completion_logprobs_match_transformers"]),
    # --- sampling params
    ("sampling-params-top-p-zero-accepted", "pyengine/sampling_params.py",
     "if not 0.0 < self.top_p <= 1.0:", "if not 0.0 <= self.top_p <= 1.0:", ["tests/test_sampling_params.py"]),
    ("sampling-params-stop-duplicates-kept", "pyengine/sampling_params.py",
     "return list(dict.fromkeys(stop))", "return list(stop)", ["tests/test_sampling_params.py"]),
    # --- structured output x speculative decoding (S15 x S14)
    ("structured-spec-rows-masked-with-the-first-state", "pyengine/structured/processor.py",
     "apply_allowed_mask(rows[i], masks[i])", "apply_allowed_mask(rows[i], masks[0])",
     ["tests/test_structured_spec.py"]),
    ("structured-spec-draft-q-not-renormalised", "pyengine/structured/processor.py",
     "return prefix, q / q.sum(axis=-1, keepdims=True), masks",
     "return prefix, np.array(draft_probs[:k], dtype=np.float64), masks", ["tests/test_structured_spec.py"]),
    ("structured-spec-draft-model-guesses-unmasked", "pyengine/engine/proposers.py",
     "row = apply_allowed_mask(row, grammar.mask_after(drafts[i]))", "row = row",
     ["tests/test_structured_spec.py"]),
]

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("pyengine", "tests")                 # copied (the mutation target and the tests that import it)
LINKED = (".cache", "web", "e2e", "ts-mini", "scripts", "docs", "pyproject.toml")   # read-only, shared


def make_copy() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="pyengine-mutation-"))
    for name in COPIED:
        shutil.copytree(ROOT / name, tmp / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in LINKED:
        if (ROOT / name).exists():
            os.symlink(ROOT / name, tmp / name)
    return tmp


def env_for(tmp: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tmp), OPENBLAS_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def run_tests(python: str, tmp: Path, tests: list[str], timeout: float) -> tuple[int, str]:
    cmd = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=tmp, env=env_for(tmp), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, "timeout"
    return proc.returncode, proc.stdout + proc.stderr


def first_failure(output: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", output, re.M)
    if m:
        return m.group(1)
    m = re.search(r"^E\s+(.{0,80})", output, re.M)
    return m.group(1) if m else output.strip().splitlines()[-1][:80] if output.strip() else "?"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the mutations whose name contains this text")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or args.only in m[0]]
    if args.list:
        for name, path, *_ , tests in chosen:
            print(f"{name:48s} {path:36s} {' '.join(tests)}")
        return 0
    if not chosen:
        print(f"no mutation matches {args.only!r}", file=sys.stderr)
        return 2
    names = [m[0] for m in MUTATIONS]
    assert len(set(names)) == len(names), "mutation names must be unique"

    tmp = make_copy()
    try:
        where = subprocess.run([args.python, "-c", "import pyengine; print(pyengine.__file__)"], cwd=tmp,
                               env=env_for(tmp), capture_output=True, text=True).stdout.strip()
        if not where.startswith(str(tmp)):
            print(f"the copy is not the package under test (pyengine imported from {where!r})", file=sys.stderr)
            return 1
        test_sets = sorted({t for m in chosen for t in m[4]})
        rc, out = run_tests(args.python, tmp, test_sets, args.timeout)
        if rc != 0:
            print(f"the unmutated tests fail: {first_failure(out)}\n{out[-3000:]}", file=sys.stderr)
            return 1
        rows, bad = [], 0
        for name, path, old, new, tests in chosen:
            target = tmp / path
            pristine = (ROOT / path).read_text(encoding="utf-8")
            count = pristine.count(old)
            if count != 1:
                rows.append((name, path, f"STALE: old text found {count} times", "-"))
                bad += 1
                continue
            target.write_text(pristine.replace(old, new), encoding="utf-8")
            t0 = time.perf_counter()
            try:
                rc, out = run_tests(args.python, tmp, tests, args.timeout)
            finally:
                target.write_text(pristine, encoding="utf-8")
            seconds = f"{time.perf_counter() - t0:.0f}"
            if rc in (1, 2):        # tests failed, or collection/import failed because of the mutation
                rows.append((name, path, first_failure(out), seconds))
            else:
                rows.append((name, path, "SURVIVED" if rc == 0 else f"pytest exit {rc}", seconds))
                bad += 1
            print(f"{name}: {rows[-1][2]}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("| mutation | file | caught by (first failing test) | s |")
    print("|---|---|---|---|")
    for name, path, caught, seconds in rows:
        print(f"| {name} | `{path}` | {caught} | {seconds} |")
    print(f"\n{len(rows) - bad}/{len(rows)} mutations caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
