"""Issue 26: the server's own options in one object (`ServerArgs`), beside `EngineArgs`: the flags of
`pyengine serve` become it (the limits included), its checks name the flag, and the app built from it serves with
those options."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pyengine.server.args import ServerArgs
from pyengine.server.limits import ServerLimits


def parse(argv: list[str]) -> argparse.Namespace:
    from pyengine.cli import serve
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(argv)


def test_defaults_and_flags_become_server_args():
    d = ServerArgs.from_cli_args(parse([])).validate()
    assert d.limits == ServerLimits(tokenizer_process=True)      # the CLI's one difference: a tokenizer process
    assert (d.host, d.port, d.max_body_bytes, d.disaggregated, d.log_level) == ("127.0.0.1", 8000, 1 << 20, False,
                                                                                "info")
    a = ServerArgs.from_cli_args(parse([
        "--host", "0.0.0.0", "--port", "0", "--served-model-name", "m", "--api-key", "k", "--max-body-bytes", "99",
        "--max-waiting", "3", "--max-tokens-per-request", "0", "--shutdown-timeout", "0", "--allowed-hosts", "a.b",
        "--max-grammar-states", "77", "--no-tokenizer-process", "--prefill-instances", "1", "--decode-instances", "2",
        "--decode-tensor-parallel-size", "2", "--with-demo", "--log-level", "debug"])).validate()
    assert (a.host, a.port, a.served_model_name, a.api_key, a.max_body_bytes, a.max_grammar_states) == \
        ("0.0.0.0", 0, "m", "k", 99, 77)
    assert (a.limits.bind_host, a.limits.max_waiting, a.limits.max_tokens_per_request, a.limits.shutdown_timeout,
            a.limits.allowed_hosts, a.limits.tokenizer_process) == ("0.0.0.0", 3, None, 0.0, ["a.b"], False)
    assert a.disaggregated and a.role_tp(1) == (1, 2) and a.with_demo and a.log_level == "debug"


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port must be 0..65535"),
    (["--max-connections", "0"], "--max-connections must be an integer >= 1"),
    (["--max-waiting", "-1"], "--max-waiting must be an integer >= 0"),
    (["--max-tokens-per-request", "-5"], "--max-tokens-per-request must be an integer >= 1"),
    (["--body-timeout", "0"], "--body-timeout must be a positive number of seconds"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be a non-negative number"),
    (["--max-grammar-compile-s", "-1"], "--max-grammar-compile-s must be a positive"),
    (["--prefill-instances", "1", "--decode-instances", "1", "--prompt-cache-dir", "/tmp/x"],
     "--prompt-cache-dir is not served by a disaggregated server"),
])
def test_bad_options_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs.from_cli_args(parse(argv)).validate()


def test_serve_refuses_a_bad_option_before_loading_anything():
    r = subprocess.run([sys.executable, "-m", "pyengine", "serve", "--max-connections", "0", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "pyengine serve: error: --max-connections must be an integer >= 1, got 0" in r.stderr
    assert "loading" not in r.stderr and "Traceback" not in r.stderr


def test_app_from_server_args_applies_them():
    """create_app_from_args: the model id and its aliases, the key, the body limit and the limits reach the app."""
    import httpx

    from engine_fakes import make_engine
    from pyengine.server.app import create_app_from_args, served_names
    from pyengine.server.http_server import ServerThread
    engine = make_engine(max_model_len=128)
    sargs = ServerArgs.from_cli_args(parse(["--api-key", "sekrit", "--max-body-bytes", "200", "--served-model-name",
                                            "mine", "--no-tokenizer-process", "--max-tokens-per-request", "9"]))
    model_id, aliases = served_names("/m/tiny.Q8_0.gguf", sargs.served_model_name)
    assert (model_id, aliases) == ("mine", ["tiny", "tiny.Q8_0"])
    with ServerThread(create_app_from_args(engine, sargs.validate(), model_id=model_id, aliases=aliases)) as srv:
        auth = {"authorization": "Bearer sekrit"}
        assert httpx.get(srv.url + "/v1/models", timeout=30).status_code == 401
        models = httpx.get(srv.url + "/v1/models", headers=auth, timeout=30).json()
        assert [m["id"] for m in models["data"]][0] == "mine"
        big = httpx.post(srv.url + "/v1/completions", headers=auth, timeout=30,
                         json={"model": "tiny", "prompt": "x" * 300})
        assert big.status_code == 413
        many = httpx.post(srv.url + "/v1/completions", headers=auth, timeout=30,
                          json={"model": "tiny", "prompt": "a", "max_tokens": 10})
        assert many.status_code == 400 and "max-tokens-per-request" in many.text
        ok = httpx.post(srv.url + "/v1/completions", headers=auth, timeout=30,
                        json={"model": "tiny.Q8_0", "prompt": "a", "max_tokens": 2})
        assert ok.status_code == 200, ok.text
