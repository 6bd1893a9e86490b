"""Perplexity and KL divergence (S08) against independent references: HF transformers' perplexity on the same
token windows (golden from scripts/make_golden_perplexity.py), the statistics module for the standard error,
and direct definitions of the KL divergence."""
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from pyengine import perplexity as P
from pyengine.bench.corpus import sample_text
from pyengine.cli import main
from pyengine.cli.perplexity import make_runner
from pyengine.model_files import default_model_path

GOLDEN = json.loads((Path(__file__).parent / "golden" / "perplexity_smollm2.json").read_text())


@pytest.fixture(scope="module")
def runner():
    return make_runner(default_model_path(), GOLDEN["ctx"])


def test_windows_are_the_golden_ones(runner):
    tok = runner.tokenizer
    assert not tok.add_bos_token                       # SmolLM2: llama.cpp adds no BOS, neither do we
    ids = tok.encode(sample_text(), add_special_tokens=True, parse_special=False)
    assert len(ids) == GOLDEN["hf"]["total_tokens"]
    wins = P.windows(ids, GOLDEN["ctx"])[:len(GOLDEN["windows"])]
    assert [w.tolist() for w in wins] == GOLDEN["windows"]


def test_perplexity_matches_hf_fp32(runner):
    wins = [np.array(w) for w in GOLDEN["windows"]]
    seen = []
    got = P.perplexity(runner, wins, on_window=lambda i, n, est: seen.append((i, n, est.ppl)))
    ref = GOLDEN["hf"]
    assert got.n_tokens == ref["n_tokens"] == len(wins) * (GOLDEN["ctx"] // 2 - 1)
    assert abs(got.ppl / ref["ppl"] - 1) < 1e-3, (got, ref["ppl"])
    assert abs(got.err / ref["ppl_err"] - 1) < 1e-2
    assert [s[:2] for s in seen] == [(i, len(wins)) for i in range(len(wins))]
    assert seen[-1][2] == got.ppl


def test_standard_error_is_the_mean_nlls():
    rng = np.random.default_rng(0)
    nll = rng.gamma(2.0, 1.5, size=500)
    est = P.ppl_estimate(nll)
    assert est.ppl == pytest.approx(math.exp(statistics.fmean(nll)), rel=1e-12)
    # llama.cpp's sqrt((E[x^2] - E[x]^2) / (N - 1)) is the sample standard deviation over sqrt(N)
    assert est.err == pytest.approx(est.ppl * statistics.stdev(nll) / math.sqrt(len(nll)), rel=1e-9)


def test_windows_replace_the_first_token_by_bos():
    wins = P.windows(np.arange(10, 30), 8, bos_token_id=1)
    assert len(wins) == 2 and [w[0] for w in wins] == [1, 1] and wins[1][1:].tolist() == list(range(19, 26))
    with pytest.raises(ValueError, match="fewer than one window"):
        P.windows(np.arange(5), 8)


def test_logprob_storage_roundtrip_and_kl_definition():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 4, size=(7, 300)).astype(np.float32)
    lp = P.log_softmax(logits)
    lo, scale, q = P.quantize_logprobs(lp)
    back = P.dequantize_logprobs(lo, scale, q)
    kept = lp >= (lp.max(axis=1) - P.LOGPROB_RANGE)[:, None]
    assert np.abs(back - lp)[kept].max() < float(scale.max())       # half a step, plus the renormalization
    # KL(base || q) of a shifted distribution: against the textbook sum p log(p / q)
    other = logits + rng.normal(0, 0.3, size=logits.shape).astype(np.float32)
    stats = P.KLStats()
    targets = rng.integers(0, 300, size=7)
    stats.add(lp, other, targets)
    p, qd = np.exp(lp), np.exp(P.log_softmax(other))
    want = (p * np.log(p / qd)).sum(axis=1)
    assert np.allclose(np.concatenate(stats.kl), want, rtol=1e-9, atol=1e-12)
    s = stats.summary()
    assert s["same_top"] == np.mean(lp.argmax(1) == other.argmax(1))
    assert s["kl_max"] == pytest.approx(want.max()) and s["kl_mean"] == pytest.approx(want.mean())


def test_cli_perplexity_and_kl_self_comparison(tmp_path, capsys, runner):
    text = tmp_path / "genesis.txt"
    text.write_text(sample_text(), encoding="utf-8")
    base = tmp_path / "base.kld"
    assert main(["perplexity", "--file", str(text), "--ctx", "64", "--chunks", "3",
                 "--kl-divergence-base", str(base)]) == 0
    out = capsys.readouterr().out
    line = [l for l in out.splitlines() if l.startswith("Final estimate: PPL = ")]
    ppl, err = (float(x) for x in line[0].removeprefix("Final estimate: PPL = ").split(" +/- "))
    ids = runner.tokenizer.encode(sample_text(), add_special_tokens=True, parse_special=False)
    small = make_runner(default_model_path(), 64)
    want = P.perplexity(small, P.windows(ids, 64)[:3])
    assert (ppl, err) == (round(want.ppl, 4), round(want.err, 5))
    assert base.stat().st_size == 8 + 16 + 4 * 3 * 64 + 3 * 31 * (8 + 2 * small.config.vocab_size)
    # the same model against its own base: no divergence, the same top token everywhere
    assert main(["perplexity", "--file", str(text), "--kl-divergence-base", str(base), "--kl-divergence"]) == 0
    out = capsys.readouterr().out
    kl = float(next(l for l in out.splitlines() if l.startswith("Mean    KLD:")).split()[2])
    assert 0 <= kl < 1e-6
    assert "Same top p: 100.000" in out
    # a q4_0 KV cache against the float32 base: the error shows as KL and a lower top-1 agreement
    assert main(["perplexity", "--file", str(text), "--kl-divergence-base", str(base), "--kl-divergence",
                 "--kv-cache-dtype", "q4_0"]) == 0
    out = capsys.readouterr().out
    kl4 = float(next(l for l in out.splitlines() if l.startswith("Mean    KLD:")).split()[2])
    top4 = float(next(l for l in out.splitlines() if l.startswith("Same top p:")).split()[3])
    assert 1e-3 < kl4 < 1 and top4 < 100
    with pytest.raises(SystemExit):
        main(["perplexity"])                                   # --file is required
    assert main(["perplexity", "--file", str(text), "--kl-divergence"]) == 1   # needs the base file
    bad = tmp_path / "bad.kld"
    bad.write_bytes(b"not a base file at all")
    assert main(["perplexity", "--file", str(text), "--kl-divergence-base", str(bad), "--kl-divergence"]) == 1
    assert "bad magic" in capsys.readouterr().err
