"""Schemas as users write them (issue 32 item 7): pydantic's JSON Schemas through ``response_format``, and
the constructs they use checked against jsonschema (the independent reference): format / pattern /
minLength / maxLength intersected, min/maxProperties counted over listed, optional and additional members.
Every sampled output validates with jsonschema and (where the model checks no more than its schema says)
with the pydantic model itself; every refusal names its keyword; the budgets hold."""
import itertools
import json
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from pyengine.server.constraints import parse_structured
from pyengine.structured import GrammarError, compile_grammar
from pyengine.structured.budget import Budget, GrammarTooLarge, compile_budget
from pyengine.structured.json_schema import FORMATS, dumps
from structured_support import accepts, automaton_of, default_validator, sample_random_model, vocab

sys.path.insert(0, str(Path(__file__).parent / "data"))
from pydantic_corpus import corpus  # noqa: E402

BEFORE_COMPILED = 9          # main at 788bb5c compiled 9 of the 24 corpus schemas (see the module docstring)


def walk(a, rng, stop: float = 0.15, limit: int = 400) -> bytes | None:
    """A random byte string of the automaton's language: random allowed bytes, stopping at an accepting
    state with probability ``stop`` (None if the walk got no further within ``limit`` bytes)."""
    state, out = a.initial(), bytearray()
    for _ in range(limit):
        if a.is_accepting(state) and (rng.random() < stop or not a.can_continue(state)):
            return bytes(out)
        nxt = [b for b in range(256) if a.step(state, bytes([b]))]
        b = int(rng.choice(nxt))
        out.append(b)
        state = a.step(state, bytes([b]))
    return None


def response_format(schema) -> dict:
    so, _ = parse_structured({"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": schema}}}, chat=True)
    return so.json


# --- the pydantic corpus ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled_corpus():
    out = []
    for name, model, exact in corpus():
        schema = response_format(model.model_json_schema())
        out.append((name, model, exact, schema, compile_grammar(("json", schema), vocab())))
    return out


def test_pydantic_corpus_compiles_and_validates(compiled_corpus):
    """Every corpus schema compiles (main at 788bb5c: 9 of 24); two random-logits samples of each validate
    with jsonschema, and with the pydantic model wherever the model checks no more than its schema."""
    from pydantic import ValidationError
    assert len(compiled_corpus) == len(corpus()) > BEFORE_COMPILED
    rng = np.random.default_rng(7)
    n = pyd_ok = 0
    for name, model, exact, schema, g in compiled_corpus:
        validator = default_validator(schema)
        for _ in range(2):
            _, data = sample_random_model(g, rng, budget=20)
            value = json.loads(data.decode("utf-8"))
            errors = list(validator.iter_errors(value))
            assert not errors, f"{name}: {data!r}: {errors[0].message}"
            try:
                model.model_validate(value)
                pyd_ok += 1
            except ValidationError as e:
                assert not exact, f"{name}: {data!r} fails the pydantic model: {e}"
            n += 1
    assert n == 2 * len(compiled_corpus) and pyd_ok >= n - 6


def test_pydantic_models_through_the_server_with_the_openai_client():
    """The user path on SmolLM2: the official client's ``chat.completions.parse(response_format=Model)`` for
    models whose schemas main refused (a dict with max keys, a pattern with lengths), answered with valid
    JSON the model parses; a schema asking for two patternProperties members beside a listed one is a 400
    naming minProperties."""
    import openai
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.model_files import default_model_path
    from pyengine.server.app import create_app, served_names
    from pyengine.server.http_server import ServerThread
    picked = {n: m for n, m, _ in corpus() if n in ("Settings", "Versioned")}
    path = default_model_path()
    engine = LLMEngine(path, max_model_len=512, max_num_seqs=4)
    model_id, aliases = served_names(path)
    with ServerThread(create_app(engine, model_id=model_id, aliases=aliases)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        finished = 0
        for k, (name, model) in enumerate(picked.items()):
            r = client.chat.completions.parse(
                model=model_id, response_format=model, temperature=1.0, seed=k, max_tokens=64,
                messages=[{"role": "user", "content": f"Reply with a JSON {name}."}])
            choice = r.choices[0]
            assert choice.finish_reason in ("stop", "length")
            if choice.finish_reason == "stop":
                assert isinstance(choice.message.parsed, model)
                jsonschema.validate(json.loads(choice.message.content), model.model_json_schema(),
                                    format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
                finished += 1
        assert finished >= 1
        # two additional properties count since distinct.py, beside listed ones too; patternProperties not
        bad = {"type": "object", "properties": {"a": {"type": "integer"}},
               "patternProperties": {"^x": {"type": "integer"}}, "minProperties": 3}
        with pytest.raises(openai.BadRequestError, match="minProperties") as e:
            client.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
        assert e.value.status_code == 400


# --- strings: format / pattern / minLength / maxLength intersected -------------------------------------
ALPHABET = ["a", "b", "Z", "0", "é", "\n", '"', "\\", "\U0001F600"]


def test_pattern_with_lengths_exhaustive_against_jsonschema():
    """Every string of up to 4 characters over an alphabet with escapes and multi-byte characters: the
    grammar accepts its JSON spelling iff jsonschema says the value is valid (lengths count code points,
    an escape such as \\n or \\" is one character)."""
    schemas = [{"type": "string", "pattern": "^[ab]", "minLength": 2, "maxLength": 4},
               {"type": "string", "pattern": "[^a-z]$", "maxLength": 3},
               {"type": "string", "pattern": "a", "minLength": 3},
               {"type": "string", "pattern": "^a*$", "minLength": 1, "maxLength": 2}]
    for schema in schemas:
        a = automaton_of(schema)
        v = jsonschema.Draft202012Validator(schema)
        for n in range(5):
            for chars in itertools.product(ALPHABET, repeat=n):
                s = "".join(chars)
                assert accepts(a, dumps(s)) == v.is_valid(s), (schema, s)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_format_with_lengths_sound_and_complete(fmt):
    """Strings of the format (random walks of its own grammar) are accepted under bounds iff their length
    is within them; walks of the bounded grammar validate with jsonschema (format checker on)."""
    rng = np.random.default_rng(sorted(FORMATS).index(fmt))
    plain = automaton_of({"type": "string", "format": fmt})
    samples = [json.loads(w) for w in (walk(plain, rng, stop=0.5) for _ in range(40)) if w is not None]
    lengths = sorted(len(s) for s in samples)
    hi = min(lengths[3 * len(lengths) // 4], 40)    # bounds the exact product holds (no lowered cap)
    lo = min(lengths[len(lengths) // 4], hi)
    schema = {"type": "string", "format": fmt, "minLength": lo, "maxLength": hi}
    bounded = automaton_of(schema)
    v = default_validator(schema)
    for s in samples:
        assert accepts(bounded, dumps(s)) == (lo <= len(s) <= hi), (fmt, s)
    for _ in range(20):
        w = walk(bounded, rng)
        if w is not None:
            value = json.loads(w)
            assert v.is_valid(value) and lo <= len(value) <= hi, (fmt, w)


def test_format_with_pattern_and_large_maxlength():
    """format with pattern is the intersection; a maxLength the format can never reach costs nothing;
    HttpUrl's maxLength 2083 is exact (counted at run time: tests/test_structured_counted.py)."""
    a = automaton_of({"type": "string", "format": "date", "pattern": "^2024-0[1-3]"})
    assert accepts(a, '"2024-02-28"') and not accepts(a, '"2024-04-01"') and not accepts(a, '"2024-02-30"')
    uuid = automaton_of({"type": "string", "format": "uuid", "maxLength": 100000})
    assert uuid.num_states == automaton_of({"type": "string", "format": "uuid"}).num_states
    url = automaton_of({"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083})
    assert accepts(url, '"https://example.com/a?b=c"') and not accepts(url, '""')
    assert not accepts(url, dumps("http://x/" + "a" * 2100))


def test_unsatisfiable_intersections_are_refused_naming_the_keyword():
    for schema, keyword in [({"type": "string", "format": "uuid", "maxLength": 35}, "maxLength"),
                            ({"type": "string", "format": "date", "pattern": "^x"}, "pattern"),
                            ({"type": "string", "format": "email", "minLength": 500}, "minLength"),
                            ({"type": "object", "properties": {"d": {"type": "string", "format": "ipv4",
                              "maxLength": 6}}, "required": ["d"]}, "maxLength")]:
        with pytest.raises(GrammarError) as e:
            compile_grammar(("json", schema), vocab())
        assert e.value.keyword == keyword and keyword in str(e.value), (schema, str(e.value))
        assert "admits no" in str(e.value)
    # an optional property whose string is unsatisfiable is simply never written
    a = automaton_of({"type": "object", "properties": {"d": {"type": "string", "format": "uuid", "maxLength": 3},
                                                       "n": {"type": "integer"}}})
    assert accepts(a, '{"n":1}') and not accepts(a, '{"d":"abc"}')


# --- objects: minProperties / maxProperties counted -------------------------------------------------
def _objects(listed, extras):
    """Every object over the listed names (in declared order) then extra names, values 0/1."""
    for k in range(len(listed) + 1):
        for names in itertools.combinations(listed, k):
            for j in range(len(extras) + 1):
                for more in itertools.combinations(extras, j):
                    keys = list(names) + list(more)
                    for values in itertools.product([0, 1], repeat=min(len(keys), 2)):
                        vals = list(values) + [0] * (len(keys) - len(values))
                        yield dict(zip(keys, vals))


@pytest.mark.parametrize("lo,hi", [(0, 0), (0, 2), (1, 3), (2, 2), (2, None), (3, 4), (4, None), (0, 5)])
def test_property_counts_exhaustive_against_jsonschema(lo, hi):
    """Listed required / optional properties and additionalProperties under min/maxProperties: every object
    the grammar accepts is valid; every valid one is accepted, except those reaching minProperties only
    with two or more additional properties (two may share a name, so one counts: documented)."""
    schema = {"type": "object", "properties": {"r": {"type": "integer"}, "o1": {"type": "integer"},
                                               "o2": {"type": "integer"}},
              "required": ["r"], "additionalProperties": {"type": "integer"}, "minProperties": lo}
    if hi is not None:
        schema["maxProperties"] = hi
    try:
        a = automaton_of(schema)
    except GrammarError as e:
        assert hi is not None and hi < 1 and e.keyword in ("maxProperties", None)
        return
    v = jsonschema.Draft202012Validator(schema)
    checked = 0
    for value in _objects(["r", "o1", "o2"], ["x", "y", "zz"]):
        ok = accepts(a, dumps(value))
        valid = v.is_valid(value)
        assert not ok or valid, (schema, value)
        listed = sum(1 for k in value if k in ("r", "o1", "o2"))
        if valid and listed + min(len(value) - listed, 1) >= lo:
            assert ok, (schema, value)
        checked += 1
    assert checked > 100


def test_dict_with_bounded_keys_random_walks_validate():
    """pydantic's dict[str, int] with max_length / min_length: random walks validate (duplicate names only
    make fewer properties, which maxProperties allows)."""
    rng = np.random.default_rng(5)
    for schema in [{"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
                   {"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 1,
                    "maxProperties": 2},
                   {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                    "additionalProperties": {"type": "string", "maxLength": 3}, "maxProperties": 2},
                   # 30 optional properties, at most 5: too many states for one DFA, members become rules
                   {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 10} for i in range(30)},
                    "maxProperties": 5}]:
        a = automaton_of(schema)
        v = jsonschema.Draft202012Validator(schema)
        for _ in range(15):
            w = walk(a, rng, stop=0.3)
            if w is not None:
                value = json.loads(w)
                assert v.is_valid(value), (schema, w)


def test_property_count_refusals_name_the_keyword_and_hold_the_budget():
    """A count that cannot be met names minProperties; a huge maxProperties over many optional keys is
    refused by the state budget (at once, naming maxProperties), not unrolled."""
    with pytest.raises(GrammarError) as e:
        # distinct.py counts additional properties beside listed ones; patternProperties beside them not
        compile_grammar(("json", {"type": "object", "properties": {"a": {"type": "integer"}},
                                  "patternProperties": {"^x": {"type": "integer"}},
                                  "minProperties": 3}), vocab())
    assert e.value.keyword == "minProperties" and "minProperties" in str(e.value)
    props = {f"p{i}": {"type": "string", "format": "date-time"} for i in range(2000)}
    huge = {"type": "object", "properties": props, "additionalProperties": {"type": "integer"},
            "maxProperties": 1500}
    with compile_budget(Budget(seconds=30.0)):
        with pytest.raises(GrammarTooLarge) as e:
            compile_grammar(("json", huge), vocab())
    assert e.value.keyword == "maxProperties" and "maxProperties" in str(e.value)
    assert "limit" in str(e.value)


HYPOTHESIS_SCHEMAS = [
    {"type": "string", "pattern": "^[a-z]+[0-9]*$", "minLength": 3, "maxLength": 8},
    {"type": "string", "format": "date", "pattern": "^20"},
    {"type": "string", "format": "ipv4", "minLength": 9, "maxLength": 12},
    {"type": "string", "format": "uuid", "maxLength": 40},
    {"type": "string", "format": "time", "minLength": 9, "maxLength": 14},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a"],
     "additionalProperties": {"type": "string", "maxLength": 2}, "minProperties": 2, "maxProperties": 3},
]


@pytest.mark.parametrize("k", range(len(HYPOTHESIS_SCHEMAS)))
def test_hypothesis_instances_of_the_new_constructs(k):
    """hypothesis-jsonschema's instances (valid and invalid: it generates from the schema, then jsonschema
    judges): a valid instance is accepted (strings: when the format's own grammar accepts it, the format
    being a conservative subset; objects: unless minProperties needs two additional properties), and an
    accepted one is valid."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis_jsonschema import from_schema
    from pyengine.structured.json_schema import SchemaCompiler
    from structured_support import serialize
    schema = HYPOTHESIS_SCHEMAS[k]
    a = automaton_of(schema)
    v = default_validator(schema)
    plain = automaton_of({"type": "string", "format": schema["format"]}) if "format" in schema else None
    comp = SchemaCompiler(schema)
    loose = {key: val for key, val in schema.items() if key not in ("minLength", "maxLength", "minProperties",
                                                                    "maxProperties")}

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(from_schema(loose))
    def check(value):
        text = serialize(value, schema, comp)
        ok, valid = accepts(a, text), v.is_valid(value)
        assert not ok or valid, (schema, text)
        if not valid:
            return
        if plain is not None and not accepts(plain, text):
            return
        if isinstance(value, dict) and sum(1 for key in value if key in ("a", "b")) + 1 < 2 and len(value) >= 2:
            return
        assert ok, (schema, text)

    check()
