"""`pyengine bench structured`: S15 grammar engines side by side on the same schemas and vocabulary.

For every schema (the benchmark's own set, the schema-store copies vendored by check-jsonschema when it is
installed, the pydantic models of tests/data/pydantic_corpus.py when pydantic is installed, and the JSON Schema
Test Suite when ``--suite DIR`` points at it) and every engine (pyengine,
and llguidance / xgrammar / outlines-core when importable: ``pip install -e '.[bench]'``):

- compile: time to turn the schema into a matcher, or the refusal (pyengine names the keyword);
- mask: time of each per-token allowed-token mask on the model's vocabulary during a walk where a
  random-logits "model" (masked, temperature 1.0, nudged towards closing brackets after half the budget)
  picks the tokens; p50 / p99 over all walks;
- validity: outputs that reached EOS, parsed and checked with jsonschema (when installed).

``--speculative`` adds constrained generation on the model itself: the same JSON-Schema requests (greedy) without
speculation and with n-gram drafts checked against the grammar, in one run: model forward passes, wall time,
drafts cut by the grammar, mean acceptance length, and whether the tokens are the same (drafting forced at
every decode, and with the default back-off).

All engines get the same schemas, vocabulary (SmolLM2's 49152 tokens by default) and seeds in one run,
so the printed ratios compare like with like.
"""
from __future__ import annotations

import json
import time

import numpy as np

HELP = "structured output: compile time, per-token mask time p50/p99, coverage and validity vs peers"
CLOSERS = b'"}]'


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="GGUF whose tokenizer gives the vocabulary (default SmolLM2)")
    p.add_argument("--tokens", type=int, default=40, help="token budget of each walk (default 40)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N schemas")
    p.add_argument("--suite", default=None, help="JSON Schema Test Suite tests/draft4 folder to add")
    p.add_argument("--engines", default="pyengine,llguidance,xgrammar,outlines-core")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--speculative", action="store_true",
                   help="also: constrained greedy generation on the model, plain vs n-gram speculation (S14)")
    p.add_argument("--timeout", type=float, default=2.0,
                   help="seconds per schema and engine for compile + walk (each runs in a forked process); "
                        "past it the schema counts as not compiled (default 2: keeps the run near 2 minutes)")


def bench_schemas(suite: str | None = None) -> list[tuple[str, object]]:
    from pyengine.bench.structured_schemas import FEATURE_SCHEMAS
    out = [(f"builtin/{i}", s) for i, s in enumerate(FEATURE_SCHEMAS)]
    try:
        import pathlib
        import check_jsonschema
        folder = pathlib.Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor"
        out += [(f"store/{p.stem}", json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]
    except ImportError:
        pass
    out += pydantic_schemas()
    if suite:
        import pathlib
        for path in sorted(pathlib.Path(suite).glob("*.json")):
            if path.stem != "refRemote":
                out += [(f"suite/{path.stem}/{k}", g["schema"]) for k, g in enumerate(json.loads(path.read_text()))]
    return out


def pydantic_schemas() -> list[tuple[str, object]]:
    """The JSON Schemas of the pydantic models of tests/data/pydantic_corpus.py (schemas as users write them),
    when pydantic is installed and the checkout's tests are next to the package."""
    import importlib.util
    import pathlib
    import sys
    path = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "pydantic_corpus.py"
    if not path.is_file() or importlib.util.find_spec("pydantic") is None:
        return []
    spec = importlib.util.spec_from_file_location("pyengine_bench_pydantic_corpus", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # pydantic resolves the models' annotations through it
    spec.loader.exec_module(module)
    return [(f"pydantic/{name}", model.model_json_schema()) for name, model, _ in module.corpus()]


# --- engines: compile(schema) -> matcher with mask() -> bool array, advance(token) -> bool ---------------
class PyEngine:
    name = "pyengine"

    def __init__(self, tok, vocab):
        self.vocab = vocab

    def compile(self, schema):
        from pyengine.structured import GrammarMatcher, compile_grammar
        g = compile_grammar(("json", schema), self.vocab)
        m = GrammarMatcher(g)
        return m.allowed_mask, m.advance


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab):
        import llguidance
        import llguidance.numpy as lln
        self.ll, self.lln = llguidance, lln

        class _Wrap:       # llguidance's TokenizerWrapper contract over our tokenizer
            eos_token_id = vocab.eos_token_ids[0]
            bos_token_id = None
            tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
            special_token_ids = sorted(tok.special_ids)

            def __call__(self, s):
                return tok.encode(s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s)

        self.tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrap()), eos_token=vocab.eos_token_ids)
        self.size = vocab.size

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.ll.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        bitmask = self.lln.allocate_token_bitmask(1, self.tok.vocab_size)

        def mask():
            self.lln.fill_next_token_bitmask(m, bitmask, 0)
            return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:self.size].astype(bool)

        return mask, m.consume_token


class Outlines:
    name = "outlines-core"

    def __init__(self, tok, vocab):
        import outlines_core
        self.oc = outlines_core
        eos = vocab.eos_token_ids[0]
        table: dict = {}
        for i, b in enumerate(vocab.token_bytes):
            if b is not None and i not in vocab.eos_token_ids:
                table.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, table)
        self.size = vocab.size

    def compile(self, schema):
        from outlines_core.json_schema import build_regex_from_schema
        regex = build_regex_from_schema(json.dumps(schema))
        guide = self.oc.Guide(self.oc.Index(regex, self.vocabulary))
        words = np.zeros((self.size + 31) // 32, dtype=np.int32)

        def mask():
            guide.write_mask_into(words.ctypes.data, words.size, 4)
            return np.unpackbits(words.view(np.uint8), bitorder="little")[:self.size].astype(bool)

        def advance(t):
            guide.advance(t, return_tokens=False)
            return True

        return mask, advance


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab):
        import xgrammar as xgr
        self.xgr = xgr
        info = xgr.TokenizerInfo([tok.token_bytes(i) for i in range(tok.vocab_size)],
                                 vocab_type=xgr.VocabType.RAW, vocab_size=vocab.size,
                                 stop_token_ids=vocab.eos_token_ids)
        self.compiler = xgr.GrammarCompiler(info)
        self.size = vocab.size

    def compile(self, schema):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        m = self.xgr.GrammarMatcher(compiled)
        bitmask = np.zeros((1, (self.size + 31) // 32), dtype=np.int32)     # xgrammar fills NumPy arrays too

        def mask():
            m.fill_next_token_bitmask(bitmask)
            return np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:self.size].astype(bool)

        return mask, m.accept_token


PEERS = {"pyengine": PyEngine, "llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": Outlines}


def walk(mask_fn, advance_fn, vocab, rng, budget, closers):
    """One random-logits walk; returns (mask times in s, output bytes or None if unfinished/broken)."""
    times, out = [], []
    eos = np.asarray(vocab.eos_token_ids)
    for step in range(budget):
        t0 = time.perf_counter()
        mask = mask_fn()
        times.append(time.perf_counter() - t0)
        if not mask.any():
            return times, None
        logits = rng.standard_normal(vocab.size) * 2.0
        if step >= budget // 2:
            logits[closers] += 6.0
            logits[eos] += 6.0
        logits[~mask] = -np.inf
        p = np.exp(logits - logits.max())
        tid = int(rng.choice(vocab.size, p=p / p.sum()))
        if tid in vocab.eos_token_ids:
            return times, b"".join(out)
        if not advance_fn(tid):
            return times, None
        out.append(vocab.token_bytes[tid] or b"")
    return times, None


def _one(eng, schema, vocab, seed, budget, closers) -> dict:
    t0 = time.perf_counter()
    try:
        mask_fn, advance_fn = eng.compile(schema)
    except Exception as e:
        return {"refused": getattr(e, "keyword", None) or str(e)[:60]}
    compile_s = time.perf_counter() - t0
    times, data = walk(mask_fn, advance_fn, vocab, np.random.default_rng(seed), budget, closers)
    return {"compile": compile_s, "mask": times, "data": data}


def _isolated(fn, timeout: float, *a) -> dict:
    """fn(*a) in a forked child with a time limit (a native compiler cannot be interrupted otherwise)."""
    import multiprocessing as mp
    try:
        ctx = mp.get_context("fork")
    except ValueError:                      # no fork (Windows, Pyodide): run inline, no limit
        return fn(*a)
    recv, send = ctx.Pipe(duplex=False)

    def child():
        import os
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)                    # peers' native warnings would bury the table
        os.dup2(null, 2)
        send.send(fn(*a))
        send.close()

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()
    out = recv.recv() if recv.poll(timeout) else {"refused": f"timeout ({timeout:g} s)"}
    proc.join(1.0)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return out


def _valid(data: bytes, schema) -> bool:
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    try:
        import jsonschema
    except ImportError:
        return True                          # parsed; no validator to say more
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(value)


def run(args) -> int:
    from pyengine.model_files import resolve_model
    from pyengine.structured import TokenVocabulary
    from pyengine.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve_model(args.model))
    vocab = TokenVocabulary.from_tokenizer(tok)
    closers = np.array([i for i, b in enumerate(vocab.token_bytes) if b is not None and len(b) == 1
                        and b in [bytes([c]) for c in CLOSERS]])
    schemas = bench_schemas(args.suite)[:args.limit]
    engines = []
    for name in args.engines.split(","):
        try:
            engines.append(PEERS[name](tok, vocab))
        except Exception as e:           # not installed (or not importable here): say so, go on
            print(f"{name}: not available ({type(e).__name__}: {str(e)[:80]})")
    print(f"{len(schemas)} schemas, vocabulary {vocab.size} tokens, walks of <= {args.tokens} tokens\n")
    results = {}
    for eng in engines:
        t_engine = time.perf_counter()
        r = results[eng.name] = {"compiled": set(), "refused": {}, "compile": [], "mask": [], "finished": 0,
                                 "valid": 0}
        for k, (sname, schema) in enumerate(schemas):
            one = _isolated(_one, args.timeout, eng, schema, vocab, args.seed + k, args.tokens, closers)
            if "refused" in one:
                r["refused"][sname] = one["refused"]
                continue
            r["compile"].append(one["compile"])
            r["compiled"].add(sname)
            r["mask"].extend(one["mask"])
            if one["data"] is not None:
                r["finished"] += 1
                r["valid"] += _valid(one["data"], schema)
        print(f"  {eng.name}: {time.perf_counter() - t_engine:.1f} s", flush=True)
    print(f"{'engine':<14} {'compiled':>9} {'compile p50':>12} {'compile max':>12} {'mask p50':>9} {'mask p99':>9}"
          f" {'finished':>9} {'valid':>7}")
    for name, r in results.items():
        c = np.array(r["compile"] or [np.nan]) * 1e3
        m = np.array(r["mask"] or [np.nan]) * 1e3
        print(f"{name:<14} {len(r['compiled']):>4}/{len(schemas):<4} {np.median(c):>10.1f}ms {c.max():>10.0f}ms "
              f"{np.median(m):>7.3f}ms {np.percentile(m, 99):>7.2f}ms {r['finished']:>9} "
              f"{r['valid']:>4}/{r['finished']:<3}")
    ours = results.get("pyengine")
    if ours:
        from collections import Counter
        print("\npyengine refusals by keyword:", dict(Counter(ours["refused"].values()).most_common()))
        for name, r in results.items():
            if name == "pyengine" or not r["mask"]:
                continue
            print(f"vs {name}: mask p50 ratio {np.median(ours['mask']) / np.median(r['mask']):.2f}x, "
                  f"p99 ratio {np.percentile(ours['mask'], 99) / np.percentile(r['mask'], 99):.2f}x, "
                  f"compile p50 ratio {np.median(ours['compile']) / np.median(r['compile']):.2f}x, "
                  f"coverage {len(ours['compiled'])} vs {len(r['compiled'])} "
                  f"(only {name}: {len(r['compiled'] - ours['compiled'])}, "
                  f"only pyengine: {len(ours['compiled'] - r['compiled'])})")
    if getattr(args, "speculative", False):
        speculative_section(resolve_model(args.model))
    return 0


SPEC_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "London", "Rome", "Berlin"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}
SPEC_PROMPTS = [   # records in the prompt (as extraction or listing tasks have): what prompt lookup drafts from
    'People as JSON:\n{"name":"Alice","age":31,"city":"Paris"}\n{"name":"Bob","age":42,"city":"Rome"}\n',
    'Records:\n{"name":"Maria","age":25,"city":"Berlin"}\n{"name":"Tom","age":58,"city":"London"}\n',
    'Users: {"name":"Ana","age":19,"city":"Rome"} {"name":"Luc","age":33,"city":"Paris"} ',
    'Employee list:\n{"name":"Sam","age":44,"city":"London"}\n',
]


def speculative_section(model_path: str, max_tokens: int = 48) -> None:
    """Greedy constrained generation of SPEC_PROMPTS, one request at a time, plain vs n-gram speculation."""
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.sampling_params import SamplingParams, StructuredOutputsParams

    runner = ModelRunner(model_path, max_model_len=512, max_num_seqs=4, max_logits=32)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(json=SPEC_SCHEMA))
    rows = {}
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    # "forced": every decode drafts (counts independent of timing); "adaptive": the default back-off (S14)
    for name, spec in (("plain", None), ("forced", {**ngram, "adaptive": False}), ("adaptive", ngram)):
        eng = LLMEngine(runner=runner, speculative_config=spec)
        eng.add_request("warm", SPEC_PROMPTS[0], params.clone(max_tokens=2))   # first-use costs: vocabulary, grammar
        while eng.has_unfinished_requests():
            eng.step()
        steps0, toks, t0 = eng.stats()["steps"], [], time.perf_counter()
        for i, prompt in enumerate(SPEC_PROMPTS):
            eng.add_request(f"q{i}", prompt, params)
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished:
                        toks.append(out.outputs[0].token_ids)
        st = eng.stats()
        rows[name] = (time.perf_counter() - t0, st["steps"] - steps0, sum(map(len, toks)), toks, st)
    print(f"\nconstrained greedy generation ({len(SPEC_PROMPTS)} JSON-Schema requests, one at a time), plain and "
          f"with n-gram speculation (k = 4):")
    print(f"{'':<10} {'tokens':>7} {'steps':>6} {'seconds':>8} {'time ratio':>11} {'accept len':>11} "
          f"{'grammar cuts':>13}")
    base = rows["plain"][0]
    for name, (secs, steps, ntok, _, st) in rows.items():
        print(f"{name:<10} {ntok:>7} {steps:>6} {secs:>8.2f} {secs / base:>10.2f}x "
              f"{st['spec_decode_mean_acceptance_length']:>11.2f} {st['spec_decode_num_grammar_cut_tokens']:>13}")
    for name in ("forced", "adaptive"):
        same = rows["plain"][3] == rows[name][3]
        print(f"{name} vs plain: {base / rows[name][0]:.2f}x faster, same tokens: {'yes' if same else 'no'}")
