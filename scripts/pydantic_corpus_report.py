"""Issue 32 item 7: how many schemas of the pydantic corpus (tests/data/pydantic_corpus.py) compile, and how many
random-logits samples of them (three each) validate with jsonschema and with the pydantic model.

    .venv/bin/python scripts/pydantic_corpus_report.py
    PYTHONPATH=/tmp/old .venv/bin/python scripts/pydantic_corpus_report.py    # an older tree: git archive REV pyengine
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "data"))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402
from pydantic import ValidationError  # noqa: E402
from pydantic_corpus import corpus  # noqa: E402
from structured_support import default_validator, sample_random_model, vocab  # noqa: E402

import pyengine  # noqa: E402
from pyengine.structured import GrammarError, compile_grammar  # noqa: E402


def main() -> None:
    rng = np.random.default_rng(7)
    compiled = valid_js = valid_model = n = 0
    for name, model, _ in corpus():
        schema = model.model_json_schema()
        try:
            g = compile_grammar(("json", schema), vocab())
        except GrammarError as e:
            print(f"{name}: refused ({e.keyword}): {str(e)[:100]}")
            continue
        compiled += 1
        validator = default_validator(schema)
        for _ in range(3):
            _, data = sample_random_model(g, rng, budget=20)
            value = json.loads(data)
            n += 1
            valid_js += validator.is_valid(value)
            try:
                model.model_validate(value)
                valid_model += 1
            except ValidationError:
                pass
    print(f"{pyengine.__file__}: compiled {compiled}/{len(corpus())}; samples {n}: valid (jsonschema) {valid_js}, "
          f"valid (pydantic model) {valid_model}")


if __name__ == "__main__":
    main()
