"""S14 is reachable from every front door: `LLM(speculative_config=...)`, `pyengine generate/chat/serve
--speculative-config '<json>'`, and the OpenAI server (metrics on /metrics, per-request opt-out
``{"speculative": false}``). The reference for the text is the same path without speculation (greedy)."""
import json

import httpx
import pytest

from pyengine.cli import main
from pyengine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "Rewrite both functions with type hints:\n\n")


@pytest.fixture(scope="module")
def llms():
    from pyengine.llm import LLM
    return LLM(max_model_len=512, max_num_seqs=4), LLM(max_model_len=512, max_num_seqs=4, speculative_config=NGRAM)


def test_llm_generate_and_stream_with_speculation(llms):
    plain, spec = llms
    params = SamplingParams(temperature=0, max_tokens=40)
    a = plain.generate([CODE, "The capital of France is"], params)
    b = spec.generate([CODE, "The capital of France is"], params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    m = b[0].metrics
    assert m.num_drafts > 0 and m.num_accepted_tokens > 0 and m.mean_acceptance_length > 1
    assert a[0].metrics.num_drafts == 0
    st = spec.llm_engine.stats()
    assert st["spec_decode_num_accepted_tokens"] >= m.num_accepted_tokens
    stream = spec.stream(CODE, params)
    assert "".join(stream) == a[0].outputs[0].text
    off = spec.generate(CODE, params.clone(speculative=False))[0]
    assert off.metrics.num_drafts == 0 and off.outputs[0].token_ids == a[0].outputs[0].token_ids


def test_cli_generate_with_speculative_config(capsys):
    base = ["generate", CODE, "--temperature", "0", "--max-tokens", "24", "--max-model-len", "256"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base + ["--speculative-config", json.dumps(NGRAM)]) == 0
    out, err = capsys.readouterr()
    assert out == plain
    assert "speculative decoding: ngram" in err and "drafts accepted, mean acceptance length" in err


@pytest.mark.parametrize("value, word", [("{bad", "not valid JSON"), ('{"method": "eagle"}', "method"),
                                         ('{"method": "ngram", "num_speculative_tokens": 99}',
                                          "num_speculative_tokens")])
def test_cli_bad_speculative_config_fails_before_loading(capsys, value, word):
    for cmd in (["generate", "hi"], ["chat"], ["serve"]):
        assert main(cmd + ["--speculative-config", value]) == 1
        err = capsys.readouterr().err
        assert word in err and "loading" not in err and "Traceback" not in err


def test_server_reports_spec_metrics_and_honours_the_opt_out():
    from pyengine.engine.llm_engine import LLMEngine
    from pyengine.model_files import default_model_path
    from pyengine.server.app import create_app
    from pyengine.server.http_server import ServerThread

    engine = LLMEngine(default_model_path(), max_model_len=512, max_num_seqs=4, speculative_config=NGRAM)
    with ServerThread(create_app(engine, model_id="m")) as srv:
        body = {"model": "m", "prompt": CODE, "max_tokens": 24, "temperature": 0}
        off = httpx.post(srv.url + "/v1/completions", json={**body, "speculative": False}, timeout=120).json()
        assert engine.stats()["spec_decode_num_drafts"] == 0
        on = httpx.post(srv.url + "/v1/completions", json=body, timeout=120).json()
        assert on["choices"][0]["text"] == off["choices"][0]["text"]
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == off["choices"][0]["text"]
        st = engine.stats()
        assert st["spec_decode_num_drafts"] > 0
        bad = httpx.post(srv.url + "/v1/completions", json={**body, "speculative": "no"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"
        metrics = httpx.get(srv.url + "/metrics", timeout=60).text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("pyengine_spec_decode")}
    assert values["pyengine_spec_decode_num_drafts_total"] == st["spec_decode_num_drafts"]
    assert values["pyengine_spec_decode_num_accepted_tokens_total"] == st["spec_decode_num_accepted_tokens"]
    assert values["pyengine_spec_decode_mean_acceptance_length"] == pytest.approx(
        st["spec_decode_mean_acceptance_length"])
    vllm = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
            if line.startswith("vllm:spec_decode")}                # vLLM's names, labelled as vLLM labels them
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert vllm[f'vllm:spec_decode_{name}_total{{model_name="m"}}'] == st[f"spec_decode_{name}"]
