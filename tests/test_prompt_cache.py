"""S21: the prompt cache (engine/prompt_cache.py; `pyengine generate/chat --prompt-cache FILE`): a prompt's KV
blocks saved with the model's identity, the KV type and the token ids, checksummed; the longest shared prefix
reused by a later engine with the same tokens as computing it; another model's, another KV type's, a corrupt or a
foreign file refused with the reason, nothing changed."""
from __future__ import annotations

import numpy as np
import pytest

from pyengine import LLM, SamplingParams
from pyengine.cli import generate as generate_cli
from pyengine.cli import main
from pyengine.engine import prompt_cache
from pyengine.engine.prompt_cache import PromptCacheError
from pyengine.gguf.random_llama import LlamaShape, write_random_llama

SHAPE = LlamaShape(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab=512, context=256)
P1 = [1] + list(range(300, 345))                   # 46 tokens: 2 full blocks of 16
P2 = P1[:40] + list(range(400, 420))               # shares 40 tokens (2 whole blocks) with P1
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("pc")
    write_random_llama(d / "a.gguf", SHAPE, seed=1)
    write_random_llama(d / "b.gguf", SHAPE, seed=2)             # same shape, other weights
    return d


def _llm(path, kv="q8_0", mode="lean"):
    return LLM(str(path), weights_mode=mode, kv_cache_dtype=kv, max_model_len=128, max_num_seqs=1)


def _run(llm, ids):
    out = llm.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0]
    return out.token_ids, [lp[t] if isinstance(lp[t], float) else lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def test_round_trip_reuses_the_longest_shared_prefix(models, tmp_path):
    f = tmp_path / "p1.kvc"
    first = _llm(models / "a.gguf")
    _run(first, P1)
    assert prompt_cache.save(first.llm_engine, P1, f) == 32
    fresh = _llm(models / "a.gguf")
    want = _run(fresh, P2)
    again = _llm(models / "a.gguf")
    assert prompt_cache.restore(again.llm_engine, f, P2) == 32
    bm = again.llm_engine.block_manager
    got = _run(again, P2)
    assert bm.hit_tokens == 32                               # the restored blocks were used, not recomputed
    assert got[0] == want[0]
    assert np.allclose(got[1], want[1], atol=1e-5)
    # a prompt sharing less than a block reuses nothing
    other = _llm(models / "a.gguf")
    assert prompt_cache.restore(other.llm_engine, f, P1[:10] + [5] * 30) == 0


def test_refusals_name_the_reason_and_change_nothing(models, tmp_path):
    f = tmp_path / "p1.kvc"
    a = _llm(models / "a.gguf")
    _run(a, P1)
    prompt_cache.save(a.llm_engine, P1, f)
    raw = f.read_bytes()
    cases = {"another model": _llm(models / "b.gguf"), "KV cache is fp16": _llm(models / "a.gguf", kv="fp16")}
    for why, llm in cases.items():
        with pytest.raises(PromptCacheError, match=why):
            prompt_cache.restore(llm.llm_engine, f, P1)
        assert llm.llm_engine.block_manager.num_cached_blocks() == 0
    target = _llm(models / "a.gguf")
    bad = tmp_path / "bad.kvc"
    for why, data in (("corrupt", raw[:100] + bytes([raw[100] ^ 1]) + raw[101:]), ("corrupt", raw[:-40]),
                      ("not a pyengine prompt cache", b"GGUF" + raw[4:])):
        bad.write_bytes(data)
        with pytest.raises(PromptCacheError, match=why):
            prompt_cache.restore(target.llm_engine, bad, P1)
    assert target.llm_engine.block_manager.num_cached_blocks() == 0
    with pytest.raises(PromptCacheError, match="cannot read"):
        prompt_cache.restore(target.llm_engine, tmp_path / "missing.kvc", P1)


def test_cli_generate_prompt_cache(models, tmp_path, monkeypatch, capsys):
    """Second run: the prompt's blocks come from the file, same text; a file of another KV type: a clean error."""
    f = tmp_path / "cli.kvc"
    prompt = "hello world " * 5
    args = ["generate", prompt, "--temperature", "0", "--max-tokens", "5", "--ignore-eos", "--prompt-cache", str(f)]
    outs = []
    for _ in range(2):
        llm = _llm(models / "a.gguf")
        monkeypatch.setattr(generate_cli, "load_llm", lambda a, llm=llm: llm)
        assert main(args) == 0
        out, err = capsys.readouterr()
        outs.append(out)
        assert "saved 48 prompt tokens" in err
    assert "48 tokens' KV blocks restored" in err
    assert llm.llm_engine.block_manager.hit_tokens == 48          # the prompt's blocks came from the file
    assert outs[0] == outs[1]
    llm = _llm(models / "a.gguf", kv="fp16")
    monkeypatch.setattr(generate_cli, "load_llm", lambda a: llm)
    assert main(args) != 0
    _, err = capsys.readouterr()
    assert "KV cache is fp16" in err


def test_server_save_restore_erase(models, tmp_path):
    """POST /prompt_cache/{save,restore,erase}: a prompt's blocks saved from one server, restored into a fresh one
    (its next request reuses them), erased; bad names, other KV types and missing files answered 4xx."""
    import httpx

    from pyengine.server.app import create_app
    from pyengine.server.http_server import ServerThread

    def completion(c, ids):
        r = c.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    first = _llm(models / "a.gguf").llm_engine
    with ServerThread(create_app(first, model_id="m", prompt_cache_dir=str(tmp_path))) as srv:
        c = httpx.Client(base_url=srv.url, timeout=60)
        want = completion(c, P1)
        r = c.post("/prompt_cache/save", json={"filename": "p1.kvc", "prompt_token_ids": P1})
        assert r.status_code == 200 and r.json() == {"filename": "p1.kvc", "n_saved_tokens": 32}
        for body, status in (({"filename": "../x.kvc", "prompt_token_ids": P1}, 400),
                             ({"filename": "p1.kvc"}, 400), ({"filename": "nope.kvc"}, 404)):
            action = "save" if "prompt_token_ids" in body or body["filename"] == "p1.kvc" else "restore"
            assert c.post(f"/prompt_cache/{action}", json=body).status_code == status
    fresh = _llm(models / "a.gguf").llm_engine
    with ServerThread(create_app(fresh, model_id="m", prompt_cache_dir=str(tmp_path))) as srv:
        c = httpx.Client(base_url=srv.url, timeout=60)
        r = c.post("/prompt_cache/restore", json={"filename": "p1.kvc"})
        assert r.status_code == 200 and r.json()["n_restored_tokens"] == 32
        assert completion(c, P1) == want and fresh.block_manager.hit_tokens == 32
        r = c.post("/prompt_cache/erase", json={"filename": "p1.kvc"})
        assert r.json() == {"filename": "p1.kvc", "erased": True} and not (tmp_path / "p1.kvc").exists()
    other = _llm(models / "a.gguf", kv="fp16").llm_engine
    prompt_cache.save(first, P1, tmp_path / "p1.kvc")
    with ServerThread(create_app(other, model_id="m", prompt_cache_dir=str(tmp_path))) as srv:
        r = httpx.post(srv.url + "/prompt_cache/restore", json={"filename": "p1.kvc"}, timeout=60)
        assert r.status_code == 400 and "fp16" in r.json()["error"]["message"]
