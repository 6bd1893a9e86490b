"""Shared pieces of the structured-output tests: the real SmolLM2 vocabulary, the schema corpus (the JSON
Schema Test Suite from npm, the schema-store copies vendored by check-jsonschema, feature schemas written
here), a random-logits "model" sampled through the grammar mask, and the serialiser of the engine's
whitespace policy used to feed valid instances back."""
from __future__ import annotations

import functools
import json
from collections import deque
from decimal import Decimal
from pathlib import Path

import numpy as np

from pyengine.bench.structured_schemas import FEATURE_SCHEMAS  # noqa: F401 (re-exported)
from pyengine.layers.sampler import sample_from_logits
from pyengine.structured import GrammarMatcher, TokenVocabulary
from pyengine.structured.automaton import compile_rules
from pyengine.structured.json_schema import compile_json_schema

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / ".cache" / "json-schema-test-suite" / "package" / "tests" / "draft4"


@functools.lru_cache(maxsize=1)
def tokenizer():
    from pyengine.model_files import default_model_path
    from pyengine.tokenizer.tokenizer import Tokenizer
    return Tokenizer.from_gguf(default_model_path())


@functools.lru_cache(maxsize=1)
def vocab() -> TokenVocabulary:
    return TokenVocabulary.from_tokenizer(tokenizer())


@functools.lru_cache(maxsize=1)
def byte_tokens() -> dict[int, int]:
    """byte value -> the id of its single-byte token (SmolLM2 has one for every byte a completion needs
    but a few control bytes and bytes UTF-8 never uses)."""
    out = {}
    for i, b in enumerate(vocab().token_bytes):
        if b is not None and len(b) == 1:
            out.setdefault(b[0], i)
    assert len(out) >= 230
    return out


# --- the corpus --------------------------------------------------------------------------------------
def suite_cases():
    """(name, schema, tests) of the JSON Schema Test Suite's draft 4 files (npm json-schema-test-suite,
    fetched into .cache by scripts/test.sh)."""
    if not SUITE.is_dir():
        raise FileNotFoundError(f"{SUITE} missing: run bash scripts/test.sh (it fetches the npm package)")
    out = []
    for path in sorted(SUITE.glob("*.json")):
        if path.stem in ("refRemote",):
            continue
        for k, group in enumerate(json.loads(path.read_text())):
            out.append((f"suite/{path.stem}/{k}", group["schema"], group["tests"]))
    return out


def store_schemas():
    """(name, schema) of the schema-store copies that check-jsonschema vendors."""
    import check_jsonschema
    folder = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor"
    return [(f"store/{p.stem}", json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]




def default_validator(schema):
    import jsonschema
    from jsonschema import validators
    cls = validators.validator_for(schema, default=jsonschema.Draft202012Validator) \
        if isinstance(schema, dict) else jsonschema.Draft202012Validator
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


# --- sampling through the mask -----------------------------------------------------------------------
def shortest_completion(automaton, state: int, limit: int = 50_000) -> bytes:
    """The shortest byte string of single-byte tokens that takes ``state`` to an accepting state (BFS). Past
    ``limit`` states (distinct object names are states of their own: every byte of a name branches) the
    search goes depth first instead."""
    try:
        return _bfs_completion(automaton, state, limit, sorted(byte_tokens()))
    except _SearchLimit:
        return _dfs_completion(automaton, state, limit)


def _dfs_completion(automaton, state: int, limit: int, depth: int = 256) -> bytes:
    """A (not the shortest) completion: depth first, closing bytes tried first, every state visited once."""
    first = b'"}]:0,abc'
    order = list(first) + [b for b in sorted(byte_tokens()) if b not in first]
    seen = {state}
    stack = [(state, iter(order))]
    path: list[int] = []
    while stack:
        s, it = stack[-1]
        if automaton.is_accepting(s):
            return bytes(path)
        for b in it:
            t = automaton.step(s, bytes([b]))
            if t and t not in seen and len(path) < depth:
                seen.add(t)
                if len(seen) > limit:
                    raise AssertionError("no completion found within the search limit")
                stack.append((t, iter(order)))
                path.append(b)
                break
        else:
            stack.pop()
            if path:
                path.pop()
    raise AssertionError("the grammar cannot be completed from this state")


class _SearchLimit(AssertionError):
    pass


def _bfs_completion(automaton, state: int, limit: int, usable) -> bytes:
    prev = {state: None}
    queue = deque([state])
    while queue:
        s = queue.popleft()
        if automaton.is_accepting(s):
            path = []
            while prev[s] is not None:
                s, b = prev[s]
                path.append(b)
            return bytes(reversed(path))
        for b in usable:
            t = automaton.step(s, bytes([b]))
            if t and t not in prev:
                prev[t] = (s, b)
                queue.append(t)
                if len(prev) > limit:
                    raise _SearchLimit("no completion found within the search limit")
    raise AssertionError("the grammar cannot be completed from this state")


def sample_random_model(grammar, rng, budget: int = 40) -> tuple[list[int], bytes]:
    """A 'model' whose logits are random over the whole vocabulary, masked by the grammar and sampled at
    temperature 1.0; after ``budget`` tokens the shortest completion is written with single-byte tokens,
    each of them still checked against the mask. Returns (token ids, output bytes)."""
    m = GrammarMatcher(grammar)
    v = grammar.vocab
    ids = []
    for _ in range(budget):
        logits = rng.standard_normal(v.size) * 3.0
        tid = sample_from_logits(m.mask_logits(logits), rng)
        if tid in v.eos_token_ids:
            assert m.is_complete() or not m.can_continue()
            return ids, b"".join(v.token_bytes[i] for i in ids)
        assert m.advance(tid), tid
        ids.append(tid)
    bt = byte_tokens()
    for b in shortest_completion(grammar.automaton, m.state):
        tid = bt[b]
        assert m.allowed_mask()[tid]
        assert m.advance(tid)
        ids.append(tid)
    assert m.is_complete() and m.allowed_mask()[v.eos_token_ids].any()
    return ids, b"".join(v.token_bytes[i] for i in ids)


def accepts_tokens(grammar, ids) -> bool:
    """Every token of ``ids`` is allowed by the mask in turn and the result is complete (EOS allowed)."""
    m = GrammarMatcher(grammar)
    for tid in ids:
        if not m.allowed_mask()[tid] or not m.advance(tid):
            return False
    return m.is_complete() and bool(m.allowed_mask()[grammar.vocab.eos_token_ids].any())


def accepts_text(grammar, text: str) -> bool:
    return accepts_tokens(grammar, tokenizer().encode(text))


# --- the engine's serialisation policy ---------------------------------------------------------------
def strict(schema):
    """The schema under the engine's policy: objects without additionalProperties admit no extra keys."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "definitions", "$defs"):
            out[k] = {n: strict(s) for n, s in v.items()} if isinstance(v, dict) else v
        elif k in ("items", "additionalProperties", "additionalItems", "anyOf", "oneOf", "allOf", "prefixItems"):
            out[k] = strict(v)
        else:
            out[k] = v
    if "type" not in out and not {"anyOf", "oneOf", "allOf", "$ref", "enum", "const"} & set(out):
        # policy: without "type", the types whose keywords the schema uses (all types if none)
        from pyengine.structured.json_schema import TYPE_KEYWORDS
        found = [t for t, kws in TYPE_KEYWORDS.items() if kws & set(out)]
        if found:
            out["type"] = found + (["integer"] if "number" in found else [])
    items = out.get("items")
    if out.get("uniqueItems") is True and not (isinstance(items, dict) and ("enum" in items or "const" in items)):
        out["maxItems"] = min(out.get("maxItems", 1), 1)       # policy: such arrays hold at most one item
    is_object = out.get("type") in ("object", ["object"]) or "properties" in out or "required" in out
    if is_object and "additionalProperties" not in out and "$ref" not in out:
        out["additionalProperties"] = False
    return out


def serialize(value, schema, compiler) -> str:
    """Compact JSON with object keys in the schema's declared order and floats written positionally."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        if "e" in text or "E" in text:
            text = format(Decimal(text), "f")
        return text
    schema = _effective(value, schema, compiler)
    if isinstance(value, list):
        items = schema.get("items", True) if isinstance(schema, dict) else True
        prefix = schema.get("prefixItems", []) if isinstance(schema, dict) else []
        if isinstance(items, list):
            prefix, items = items, schema.get("additionalItems", True)
        if isinstance(schema, dict) and schema.get("uniqueItems") is True and isinstance(items, dict) \
                and "enum" in items:                             # policy: distinct enum items in declared order
            order = [json.dumps(v, sort_keys=True) for v in items["enum"]]
            value = sorted(value, key=lambda v: order.index(json.dumps(v, sort_keys=True))
                           if json.dumps(v, sort_keys=True) in order else len(order))
        return "[" + ",".join(serialize(x, prefix[i] if i < len(prefix) else items, compiler)
                              for i, x in enumerate(value)) + "]"
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    addl = schema.get("additionalProperties", True) if isinstance(schema, dict) else True
    keys = [k for k in props if k in value] + [k for k in schema.get("required", []) if k in value and
                                               k not in props] + \
        [k for k in value if k not in props and k not in (schema.get("required", []) if isinstance(schema, dict)
                                                          else [])]
    return "{" + ",".join(json.dumps(k, ensure_ascii=False) + ":" +
                          serialize(value[k], props.get(k, addl), compiler) for k in keys) + "}"


def _effective(value, schema, compiler):
    """The subschema whose layout the grammar follows for ``value``: $ref resolved, allOf merged, the first
    anyOf/oneOf branch that validates."""
    from pyengine.structured.json_schema import merge_schemas
    import jsonschema
    for _ in range(50):
        if not isinstance(schema, dict):
            return {}
        if "$ref" in schema:
            schema = compiler.deref(schema)
            continue
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for sub in schema["allOf"]:
                merged = merge_schemas(merged, compiler.deref(sub))
            schema = merged
            continue
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                for b in schema[key]:
                    cand = merge_schemas(rest, compiler.deref(b)) if rest else compiler.deref(b)
                    full = dict(compiler.schema) if isinstance(compiler.schema, dict) else {}
                    full.update(cand if isinstance(cand, dict) else {})
                    try:
                        jsonschema.Draft202012Validator(full).validate(value) if isinstance(cand, dict) else None
                    except jsonschema.ValidationError:
                        continue
                    schema = cand
                    break
                else:
                    return {}
                break
        else:
            return schema
    return schema


def automaton_of(schema):
    """A JSON Schema's automaton, compiled without the caches or the budget."""
    return compile_rules(*compile_json_schema(schema))


def accepts(a, text: str) -> bool:
    """Whether the automaton's language holds ``text`` (its UTF-8 bytes)."""
    state = a.step(a.initial(), text.encode("utf-8"))
    return bool(state) and a.is_accepting(state)
