"""Issue 30.9: the new architectures are reachable from every user-facing path, not only the runner: the `LLM`
API (prompt text in, greedy tokens = HF's, tests/golden/arch_*.json), `pyengine generate --model` (its streamed
text = the decoded golden tokens) and the OpenAI-compatible server (a completion's text, likewise). The tiny
seeded models of tests/arch_models.py carry SmolLM2's tokenizer, so text goes through. (The browser worker:
tests/test_pyodide_arch.py.)"""
from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "pyodide"))
from arch_models import write_arch
from golden_checks import check_greedy
from pyengine import SamplingParams
from pyengine.cli import main
from pyengine.llm import LLM
from pyengine.model_files import default_model_path

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
N = 12


def golden_of(variant):
    with open(os.path.join(GOLDEN, f"arch_{variant}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("arch")
    out = {}
    for v in ("qwen2", "qwen3", "gemma2", "phi3"):      # (writing one costs ~0.3 s)
        assert write_arch(d / f"{v}.gguf", v, default_model_path()) == golden_of(v)["digest"]
        out[v] = str(d / f"{v}.gguf")
    return out


def clear_case(golden):
    """A case whose first N greedy steps have no near tie (so the decoded text is fixed)."""
    return next(c for c in golden["cases"] if not [k for k in c["tiny_margin_steps"] if k < N])


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_llm_api_prompt_text_to_golden_tokens(paths, variant):
    golden = golden_of(variant)
    llm = LLM(model=paths[variant], max_model_len=128)
    assert llm.llm_engine.runner.config.arch == golden["arch"]
    outs = llm.generate([c["prompt"] for c in golden["cases"]],
                        SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True))
    bad = [f for c, o in zip(golden["cases"], outs) for f in check_greedy(list(o.outputs[0].token_ids), c, N)]
    assert not bad, bad


def test_cli_generate_runs_a_new_architecture(paths, capsys):
    golden = golden_of("gemma2")
    case = clear_case(golden)
    rc = main(["generate", case["prompt"], "--model", paths["gemma2"], "--temperature", "0", "--max-tokens",
               str(N), "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    from pyengine.engine.llm_engine import LLMEngine
    tok = LLMEngine(paths["gemma2"], max_model_len=64).get_tokenizer()
    assert out.rstrip("\n") == tok.decode(case["greedy_ids"][:N])


def test_server_completion_on_a_new_architecture(paths):
    import openai

    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.server.app import create_app, served_names
    from pyengine.server.http_server import ServerThread
    golden = golden_of("phi3")
    case = clear_case(golden)
    engine = LLMEngine(paths["phi3"], max_model_len=128, max_num_seqs=4)
    model_id, aliases = served_names(paths["phi3"])
    with ServerThread(create_app(engine, model_id=model_id, aliases=aliases)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model=model_id, prompt=case["prompt"], max_tokens=N, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert r.choices[0].text == engine.get_tokenizer().decode(case["greedy_ids"][:N])
