"""The sampling law's cross-runtime cases (docs/sampling.md), shared by CPython and Pyodide: the tiny tie model and
the case list are built here, `run_cases` generates them through `LLMEngine` (the user-facing engine), and
tests/twin_ts_cases.mjs runs the same list in ts-mini. tests/test_sampling_law.py compares the three."""
from __future__ import annotations

import itertools

import numpy as np

N_TOKENS = 32
TIE_IDS = range(96, 296)           # 200 of the tie model's 320 output rows are zero: their logits are exactly 0.0


def write_tie_model(path, flat: bool = False) -> str:
    """tests/tiny_models.py's llama with a byte-level tokenizer (tokens ``t0``.. spell themselves) and 200 zero
    rows in its output head: every step has a 200-way exact tie at logit 0 among ~120 spread logits, so top-k
    and top-p cuts land inside a tie group (identically in every runtime: 0 * x sums to 0 in any order).
    ``flat``: the final norm's weight is 0 too, so every logit is exactly 0.0 in every runtime whatever its
    matmul order: the cases' logit bias and penalties alone shape the distribution, and the three runtimes
    feed the law bit-identical scores (the law's own claim, free of forward-pass rounding)."""
    import gguf
    from tiny_models import D, F, H, HKV, LAYERS, VOCAB, _arch_tensors, write_tensors

    w = gguf.GGUFWriter(str(path), "llama")
    for key, v in (("block_count", LAYERS), ("embedding_length", D), ("attention.head_count", H),
                   ("attention.head_count_kv", HKV), ("feed_forward_length", F), ("context_length", 512)):
        w.add_uint32(f"llama.{key}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_tokenizer_model("gpt2")
    names = [f"t{i}" for i in range(VOCAB)]
    names[0], names[3], names[4] = "t", "0", "t0"                # the one merge's parts and result
    w.add_token_list(names)
    w.add_token_merges(["t 0"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    t = _arch_tensors("llama", np.random.default_rng(28))
    t["output.weight"] = t["output.weight"] * 0.35       # logits of about +-2: the zero group holds real mass
    t["output.weight"][list(TIE_IDS)] = 0.0
    if flat:
        t["output_norm.weight"] = np.zeros_like(t["output_norm.weight"])
    q8 = gguf.GGMLQuantizationType.Q8_0
    write_tensors(w, {name: (gguf.quants.quantize(a.astype(np.float32), q8), q8) if a.ndim >= 2 else
                      a.astype(np.float32) for name, a in t.items()})
    return str(path)


def tie_cases(n: int = 240) -> list[dict]:
    """``n`` seeded cases over the tie model: token-id prompts, every combination family of temperature, top-k
    (some cutting inside the zero group), top-p (some crossing inside it), min-p and penalties, greedy too."""
    rng = np.random.default_rng(2028)
    temps = [0.0, 0.4, 0.7, 1.0, 1.3, 2.0]
    top_ks = [0, 1, 5, 40, 130, 180, 250]
    top_ps = [1.0, 0.3, 0.5, 0.65, 0.8, 0.95]
    min_ps = [0.0, 0.0, 0.02, 0.1, 0.3]
    pens = [{}, {}, {"repetition_penalty": 1.3}, {"repetition_penalty": 0.8}, {"presence_penalty": 0.7},
            {"frequency_penalty": 0.5, "presence_penalty": -0.3}, {"logit_bias": {"5": 2.5, "100": 1.0, "300": -4.0}}]
    cases = []
    for i, (t, k, p) in zip(range(n), itertools.cycle(itertools.product(temps, top_ks, top_ps))):
        prompt = rng.integers(3, 320, int(rng.integers(1, 12))).tolist()
        seed = int(rng.integers(0, 2**31)) if i % 5 else int(rng.integers(2**40, 2**53))
        cases.append({"model": "tie", "prompt": prompt, "seed": seed, "temperature": t, "top_k": k, "top_p": p,
                      "min_p": min_ps[i % len(min_ps)], **pens[i % len(pens)]})
    return cases


def flat_cases(n: int = 200) -> list[dict]:
    """``n`` cases over the flat model: each gives all 320 tokens a logit bias from a grid of 0.25 (so dozens
    of exact ties, at the top-k and top-p cuts too), with every temperature / top-k / top-p / min-p / penalty
    family; the penalties then move the scores as tokens are generated."""
    rng = np.random.default_rng(2029)
    temps = [0.0, 0.5, 0.8, 1.0, 1.5]
    top_ks = [0, 1, 3, 10, 25, 60]
    top_ps = [1.0, 0.2, 0.5, 0.75, 0.9]
    min_ps = [0.0, 0.0, 0.05, 0.2]
    pens = [{}, {"repetition_penalty": 1.4}, {"repetition_penalty": 0.7}, {"presence_penalty": 0.5},
            {"frequency_penalty": 0.75, "presence_penalty": -0.25}, {"frequency_penalty": 1.5}]
    cases = []
    for i, (t, k, p) in zip(range(n), itertools.cycle(itertools.product(temps, top_ks, top_ps))):
        bias = {str(j): float(b) for j, b in enumerate(rng.integers(-12, 13, 320) * 0.25) if b}
        cases.append({"model": "flat", "prompt": rng.integers(3, 320, int(rng.integers(1, 12))).tolist(),
                      "seed": int(rng.integers(0, 2**53)), "temperature": t, "top_k": k, "top_p": p,
                      "min_p": min_ps[i % len(min_ps)], "logit_bias": bias, **pens[i % len(pens)]})
    return cases


SMOL_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Write a haiku about rain.",
                "The three primary colors are", "My favourite food is", "In 1969, astronauts",
                "Explain gravity to a child.", "List three fruits:", "The quick brown fox"]


def smol_cases() -> list[dict]:
    settings = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=40), dict(temperature=0.7, min_p=0.05),
                dict(temperature=1.2, top_k=50, top_p=0.95, min_p=0.02), dict(temperature=0.9, repetition_penalty=1.2),
                dict(temperature=1.0), dict(temperature=0.6, top_p=0.5, presence_penalty=0.5),
                dict(temperature=1.5, top_k=20), dict(temperature=0.8, frequency_penalty=0.8, top_p=0.8),
                dict(temperature=0.0)]
    return [{"model": "smol", "prompt": p, "seed": 7 + 1000 * i, **s}
            for i, (p, s) in enumerate(zip(SMOL_PROMPTS, settings))]


def params_of(case: dict):
    from pyengine.sampling_params import SamplingParams
    kw = {k: case[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                               "frequency_penalty", "logit_bias", "seed") if k in case}
    return SamplingParams(max_tokens=N_TOKENS, ignore_eos=True, **kw)


def run_cases(models, cases: list[dict], **engine_kw) -> list[list[int]]:
    """Generate every case through `LLMEngine` (one engine per model, its requests all batched): their token ids.
    ``models``: one model (path or bytes) for every case, or {case["model"]: model}."""
    from pyengine.engine.llm_engine import LLMEngine
    out: dict[str, list[int]] = {}
    for name in dict.fromkeys(c["model"] for c in cases):
        eng = LLMEngine(model=models[name] if isinstance(models, dict) else models, max_model_len=160, **engine_kw)
        for i, c in enumerate(cases):
            if c["model"] == name:
                prompt = c["prompt"] if isinstance(c["prompt"], str) else {"prompt_token_ids": c["prompt"]}
                eng.add_request(str(i), prompt, params_of(c))
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[str(i)] for i in range(len(cases))]
