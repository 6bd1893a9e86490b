"""`pyengine bench spec` runs end to end on a tiny setting and prints one row per (workload, streams, method)
with the plain run's tokens as the reference for "same tokens"."""
import pytest

from pyengine.cli import main

pytestmark = pytest.mark.slow


def test_bench_spec_tiny_run(capsys):
    rc = main(["bench", "spec", "--only", "code-edit", "--streams", "1,2", "--max-tokens", "12",
               "--draft-model", "none", "--llama-cpp", "/nonexistent/python"])
    out, err = capsys.readouterr()
    rows = [line.split() for line in out.splitlines() if line.startswith("code-edit")]
    assert [(r[1], r[2]) for r in rows] == [("1", "plain"), ("1", "ngram"), ("2", "plain"), ("2", "ngram")]
    assert all(r[-1] in ("1/1", "2/2") for r in rows)         # greedy: speculation changes no token
    assert "slowest speculative run" in out
    assert rc == 1 and "not found" in err                       # the llama.cpp comparison needs its Python
