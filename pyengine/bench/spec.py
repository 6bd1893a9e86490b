"""`pyengine bench spec` (S14): what speculative decoding buys, measured in one run.

For three workloads — code editing (the prompt holds the code the answer repeats with changes), summarising a
given passage, open-ended chat — greedy decode tok/s of one stream and of 8 sequences at once, without
speculation, with the n-gram proposer and with a draft model, and each proposer's acceptance. Every figure is
a ratio to the same workload's plain decode in the same run: plain runs before and after each round of the
other methods, each run counts against the mean of the two plain runs around it, and ``--rounds N`` reports
the median over N such rounds (the shared host's speed drifts). Each method keeps one engine for the whole
run, as a server does, warmed up once per batch size on the first workload: its back-off then prices draft
lengths by step costs it measured there instead of exploring them again in every timed run. The decode phase is timed from the step at which every
sequence has its first token to the end (prefill excluded).

``--draft-model`` defaults to a copy of the target's first 24 layers written with the `gguf` package (the only
model with SmolLM2's vocabulary at hand; it accepts rarely, which shows the back-off). ``--llama-cpp PY``
(a Python with llama-cpp-python, or ``auto`` for /work/llamacpp-venv/bin/python) also times llama.cpp's greedy
single-stream decode of the same GGUF on the same prompt tokens, in a subprocess, as a ratio.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HELP = "speculative decoding: decode tok/s with and without each proposer on three workloads (+ llama.cpp)"
LLAMA_CPP_AUTO = "/work/llamacpp-venv/bin/python"

CODE = """class {name}:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f"{name}({{self.x}}, {{self.y}})"

    def add(self, other):
        return {name}(self.x + other.x, self.y + other.y)

    def scale(self, factor):
        return {name}(self.x * factor, self.y * factor)

    def dot(self, other):
        return self.x * other.x + self.y * other.y
"""
NAMES = [("Point", "Vector"), ("Vec2", "Pair"), ("Coord", "Position"), ("Pair", "Couple"), ("Vector", "Arrow"),
         ("Pos", "Place"), ("Step", "Move"), ("Offset", "Shift")]
PASSAGE = ("The {city} public library opened in 1902 with a single reading room and four thousand books. Over "
           "the following century it grew into a network of twelve branches. In the 1960s the main building was "
           "extended with a children's wing, and in 1998 the library became one of the first in the country to "
           "offer free internet access. Today it lends more than two million items a year, runs language classes "
           "for newcomers, and keeps a local history archive with photographs, maps and letters going back to the "
           "founding of the town.")
CITIES = ["Springfield", "Riverton", "Lakeside", "Hillcrest", "Fairview", "Oakdale", "Brookfield", "Milton"]
CHAT = ["Tell me a story about a dragon who learns to paint.", "What should I pack for a week of hiking?",
        "Give me some ideas for a rainy Sunday afternoon.", "Why do cats like boxes?",
        "Describe your perfect breakfast.", "How can I get better at chess?",
        "What would you do on a trip to the Moon?", "Write a short poem about autumn leaves."]


def workloads() -> dict[str, list[list[dict]]]:
    code = [[{"role": "user", "content": f"Rename the class {a} to {b} and show the whole code:\n\n```python\n"
              + CODE.format(name=a) + "```"}] for a, b in NAMES]
    summ = [[{"role": "user", "content": PASSAGE.format(city=c) + "\n\nSummarise the passage above in a few "
              "sentences."}] for c in CITIES]
    chat = [[{"role": "user", "content": q}] for q in CHAT]
    return {"code-edit": code, "summarise": summ, "chat": chat}


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="GGUF path (default: the bundled SmolLM2-135M)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per sequence (default 64)")
    # 8: code edit copies in long runs (mean acceptance length 5.2 at k = 8 vs 3.6-3.8 at k = 4, single stream),
    # and the back-off picks shorter drafts where acceptance is lower (docs/performance.md)
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens (default 8)")
    p.add_argument("--streams", default="1,8", help="sequences decoding at once (default 1,8)")
    p.add_argument("--repeat", "--rounds", type=int, default=1,
                   help="rounds per row, each running every method once after plain (plain also runs once "
                        "more, last); a method's ratio is the median over rounds of its run over the mean of "
                        "the two plain runs around it")
    p.add_argument("--only", default="", help="comma list of workloads (code-edit,summarise,chat)")
    p.add_argument("--draft-model", default=None,
                   help="draft GGUF ('none': skip draft_model; default: the target's first 24 layers)")
    p.add_argument("--llama-cpp", default=None, metavar="PYTHON_OR_auto",
                   help="a Python with llama-cpp-python: also time llama.cpp's greedy decode (ratio)")
    # 1 by default: on the shared 2-core host llama.cpp's 2-thread pool took 2.3 s per token (spinning threads
    # preempted) against 13 ms with one thread; compare with OPENBLAS_NUM_THREADS=1 on our side
    p.add_argument("--llama-threads", type=int, default=1, help="llama.cpp threads (default 1)")


def write_truncated(src: str, dst, n_layers: int, rename_token: int | None = None) -> None:
    """A copy of a llama-family GGUF keeping its first ``n_layers`` blocks, written with the `gguf` package
    (quantized tensors copied as they are). ``rename_token`` alters one token string (a vocabulary that
    differs, for the draft check's tests)."""
    import gguf
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = n_layers if name == f"{arch}.block_count" else f.contents()
        if name == "tokenizer.ggml.tokens" and rename_token is not None:
            value = list(value)
            value[rename_token] += "_x"
        vtype = f.types[0]
        w.add_key_value(name, value, vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layers):
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _truncated_copy(src: str, n_layers: int) -> str | None:
    """The target's first ``n_layers`` blocks as a GGUF in a temp dir (None without the `gguf` package)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        return None
    path = os.path.join(tempfile.mkdtemp(prefix="pyengine-draft-"), f"draft-{n_layers}-layers.gguf")
    write_truncated(src, path, n_layers)
    return path


def _engine(runner, draft_runner, spec):
    """One method's engine for the whole run, as a server keeps one: its back-off measures what a step with m
    drafts costs once (in the warm-up), not again in every timed run."""
    from pyengine.engine.llm_engine import LLMEngine
    return LLMEngine(runner=runner, enable_prefix_caching=False, speculative_config=spec, draft_runner=draft_runner if spec and spec["method"] == "draft_model"
                     else None)


def _decode(eng, prompts: list[list[int]], max_tokens: int):
    """(decode tok/s, tokens, acceptance rate, mean acceptance length, draft tokens, decode tokens per CPU
    second) for these prompts decoding together in the engine ``eng`` (its spec counters: this run's)."""
    from pyengine.engine.spec_decode import mean_acceptance_length
    from pyengine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    names = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    before = eng.stats()
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": ids}, params)
    seqs = [s for r in eng.requests.values() for s in r.seqs]
    while not all(s.num_output_tokens for s in seqs):
        eng.step()
    t0, c0, n0 = time.perf_counter(), time.process_time(), sum(s.num_output_tokens for s in seqs)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = sum(len(t) for t in outs.values()) - n0
    after = eng.stats()
    drafts, drafted, accepted = (after[x] - before[x] for x in names)
    return n / dt, [outs[str(i)] for i in range(len(prompts))], accepted / drafted if drafted else 0.0, \
        mean_acceptance_length(drafts, accepted), drafted, n / cpu


LLAMA_CPP_SCRIPT = r'''
import json, sys, time
from llama_cpp import Llama
job = json.load(sys.stdin)
llm = Llama(model_path=job["model"], n_ctx=2048, n_threads=job["threads"], n_batch=512, verbose=False)
out = []
for ids in job["prompts"]:
    llm.reset()
    llm.eval(ids)
    toks = []
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(job["max_tokens"]):
        t = int(llm.sample(top_k=1, temp=0.0))
        toks.append(t)
        llm.eval([t])
    out.append({"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "tokens": toks})
json.dump(out, sys.stdout)
'''


def _llama_cpp(python: str, model: str, prompts: list[list[int]], max_tokens: int, threads: int) -> list[dict]:
    job = json.dumps({"model": model, "prompts": prompts, "max_tokens": max_tokens, "threads": threads})
    res = subprocess.run([python, "-c", LLAMA_CPP_SCRIPT], input=job, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"llama-cpp-python failed: {res.stderr.strip()[-400:]}")
    return json.loads(res.stdout)


def _bracketed(rs: list, plain: list, field: int, is_plain: bool) -> float:
    """A method's rate over plain's: per round, its run over the mean of the plain runs just before and after
    it (round i runs plain i, the methods, then plain i + 1 opens the next round), the median over rounds.
    Plain itself: 1.0."""
    if is_plain:
        return 1.0
    return float(np.median([r[field] / ((plain[i][field] + plain[i + 1][field]) / 2) for i, r in enumerate(rs)]))


def run(args) -> int:
    from pyengine.engine.args import EngineArgs
    from pyengine.model_files import resolve_model

    path = resolve_model(args.model)
    streams = [int(s) for s in args.streams.split(",") if s]
    k = args.k
    runner = EngineArgs(model=path, max_model_len=1024, max_num_seqs=max(streams), max_num_batched_tokens=4096,
                        max_logits=max(streams) * (k + 1)).create_runner()
    tok = runner.tokenizer
    draft_path = args.draft_model
    if draft_path is None:
        draft_path = _truncated_copy(path, 24)
    elif draft_path == "none":
        draft_path = None
    draft_runner = None
    if draft_path is not None:
        draft_runner = EngineArgs(model=draft_path, max_model_len=1024, max_num_seqs=max(streams),
                                  max_num_batched_tokens=4096, max_logits=max(streams)).create_runner()
    configs = {"plain": None, "ngram": {"method": "ngram", "num_speculative_tokens": k}}
    if draft_runner is not None:
        configs["draft"] = {"method": "draft_model", "model": draft_path, "num_speculative_tokens": k}
    loads = workloads()
    if args.only:
        loads = {w: loads[w] for w in args.only.split(",")}
    prompts = {w: [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
                   for c in convs] for w, convs in loads.items()}
    print(f"pyengine bench spec: {os.path.basename(path)}, k={k}, {args.max_tokens} greedy tokens per sequence"
          + (f", draft {os.path.basename(draft_path)}" if draft_path else ""))
    engines = {name: _engine(runner, draft_runner, spec) for name, spec in configs.items()}
    warm = prompts[next(iter(prompts))]
    for B in streams:          # warm-up: every method at every batch size (captured steps, measured step costs)
        for eng in engines.values():
            _decode(eng, warm[:B], args.max_tokens // 2)
    rows = []
    print(f"{'workload':<10} {'seqs':>4} {'method':<6} {'tok/s':>7} {'x plain':>8} {'cpu x':>6} {'accept':>7} "
          f"{'mean len':>8} {'same tokens':>11}")
    ours_single: dict[tuple[str, str], tuple[float, float]] = {}   # (workload, method) -> (tok/s, per CPU s)
    for w, ps in prompts.items():
        for B in streams:
            # plain before and after each round of the other methods: the host's speed drifts (_bracketed)
            runs: dict[str, list] = {name: [] for name in configs}
            order = [n for _ in range(args.repeat) for n in configs] + ["plain"]
            for name in order:
                runs[name].append(_decode(engines[name], ps[:B], args.max_tokens))
            base_toks = runs["plain"][0][1]
            for name, rs in runs.items():
                rate = float(np.median([r[0] for r in rs]))
                wall = _bracketed(rs, runs["plain"], 0, name == "plain")
                cpu = _bracketed(rs, runs["plain"], 5, name == "plain")
                _, toks, acc, mal, drafted, _ = rs[-1]
                same = sum(a == b for a, b in zip(toks, base_toks))
                rows.append((w, B, name, rate, wall, acc, mal, cpu))
                if B == 1:
                    ours_single[(w, name)] = (rate, float(np.median([r[5] for r in rs])))
                print(f"{w:<10} {B:>4} {name:<6} {rate:>7.1f} {wall:>7.2f}x {cpu:>5.2f}x "
                      f"{acc if drafted else float('nan'):>7.2f} {mal if drafted else float('nan'):>8.2f} "
                      f"{same:>5}/{len(toks):<5}", flush=True)
    worst = min(r[4] for r in rows if r[2] != "plain")
    worst_cpu = min(r[7] for r in rows if r[2] != "plain")
    load = f"; load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(f"slowest speculative run: {worst:.2f}x its plain decode, {worst_cpu:.2f}x in CPU time "
          f"(target >= 0.95){load}")
    if args.llama_cpp:
        py = LLAMA_CPP_AUTO if args.llama_cpp == "auto" else args.llama_cpp
        if not os.path.exists(py):
            print(f"llama.cpp: {py} not found (build llama-cpp-python into a venv, see the issue)", file=sys.stderr)
            return 1
        for w, ps in prompts.items():
            res = _llama_cpp(py, path, ps[:1], args.max_tokens, args.llama_threads)[0]
            lc, lc_cpu = len(res["tokens"]) / res["seconds"], len(res["tokens"]) / res["cpu_seconds"]
            line = f"llama.cpp {w:<10} 1 stream {lc:7.1f} tok/s; ours / llama.cpp:"
            for name in configs:
                ours, ours_cpu = ours_single[(w, name)]
                line += f" {name} {ours / lc:.2f}x ({ours_cpu / lc_cpu:.2f}x CPU time)"
            print(line, flush=True)
    return 0
