"""S16 from the user-facing paths: `pyengine generate --model <tiny MoE GGUF>` and `pyengine serve --model ...`
(a subprocess on a free port, driven by the official openai client) give HF transformers' greedy tokens
(tests/golden/moe_*.json), and /metrics shows the expert load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from moe_models import write_moe
from pyengine.cli import main
from pyengine.model_files import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_support import free_port, stop_process, wait_http  # noqa: E402

HERE = Path(__file__).resolve().parent


def golden(variant):
    return json.loads((HERE / "golden" / f"moe_{variant}.json").read_text())


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "qwen3moe.gguf"
    assert write_moe(path, "qwen3moe", default_model_path()) == golden("qwen3moe")["digest"]
    return str(path)


def hf_text(path, case, n):
    from pyengine.tokenizer import Tokenizer
    from pyengine.gguf.reader import GGUFFile
    return Tokenizer.from_gguf(GGUFFile(path)).decode(case["greedy_ids"][:n])


def test_cli_generate_moe(qwen3moe, capsys):
    case = golden("qwen3moe")["cases"][0]
    rc = main(["generate", case["prompt"], "--model", qwen3moe, "--temperature", "0", "--max-tokens", "8",
               "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.rstrip("\n") == hf_text(qwen3moe, case, 8)


def test_serve_moe_with_openai_client(tmp_path):
    path = tmp_path / "mixtral.gguf"
    g = golden("mixtral")
    assert write_moe(path, "mixtral", default_model_path()) == g["digest"]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pyengine", "serve", "--model", str(path), "--port", str(port),
                             "--max-model-len", "256", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, timeout=120)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        for case in g["cases"][1:]:
            r = client.completions.create(model=model, prompt=case["prompt_ids"], max_tokens=12, temperature=0)
            assert r.choices[0].text == hf_text(str(path), case, 12)
        metrics = httpx.get(url + "/metrics").text
        assert 'pyengine_moe_expert_load_balance{layer="2"}' in metrics
        routed = [float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith('pyengine_moe_expert_tokens{') and 'layer="0"' in line]
        assert len(routed) == 8 and sum(routed) > 0 and sum(routed) % 2 == 0
    finally:
        stop_process(proc, timeout=20)


def test_info_describes_the_experts(qwen3moe, capsys):
    assert main(["info", qwen3moe]) == 0
    out = capsys.readouterr().out
    assert "architecture    : qwen3moe\n" in out
    assert "experts (S16)   : 8 of 64 rows, top-2 (softmax, renormalised), shared expert none" in out
