"""S03: every RoPE scaling pyengine accepts against HF transformers' own rope init functions.

tests/golden/rope_scaling.json (scripts/make_golden_rope.py, run outside CI) holds, per case, the inverse
frequencies HF computes and the cos/sin tables of its rotary embedding at a few positions. pyengine's
`rope_inv_freq` must give the same frequencies three ways: from keyword arguments, from the fields
`ModelConfig.from_gguf` reads out of a GGUF carrying llama.cpp's scaling keys, and (llama3) from the
per-dimension factors llama.cpp's converter stores as the rope_freqs.weight tensor. HF works in float32,
so values agree to float32 rounding (rtol 1e-6); a wrong band, factor or interpolation weight is off by far more.
"""
import json
from pathlib import Path

import numpy as np
import pytest

import gguf
from pyengine.config import ModelConfig
from pyengine.layers.rotary import rope_cos_sin, rope_inv_freq, yarn_attention_factor
from pyengine.models.base import rope_kind
from test_config_model import LLAMA_KEYS, _write

GOLDEN = json.loads((Path(__file__).parent / "golden" / "rope_scaling.json").read_text())
CASES = {c["name"]: c for c in GOLDEN["cases"]}
RTOL = 1e-6            # float32 rounding of HF's arithmetic (pyengine computes in float64)


def pyengine_kwargs(case) -> dict:
    """HF's rope_parameters -> rope_inv_freq's arguments. A rope_type without a mapping fails: a case added to
    the golden file must come with the pyengine arguments that should reproduce it."""
    r = case["rope"]
    kind = r["rope_type"]
    if kind == "default":
        return dict(scaling_type="none")
    if kind == "linear":
        return dict(scaling_type="linear", factor=r["factor"])
    if kind == "llama3":
        return dict(scaling_type="llama3", factor=r["factor"], orig_context=r["original_max_position_embeddings"],
                    low_freq_factor=r["low_freq_factor"], high_freq_factor=r["high_freq_factor"])
    if kind == "yarn":
        return dict(scaling_type="yarn", factor=r["factor"], orig_context=r["original_max_position_embeddings"],
                    beta_fast=r.get("beta_fast", 32.0), beta_slow=r.get("beta_slow", 1.0))
    raise AssertionError(f"golden case {case['name']!r}: rope_type {kind!r} has no pyengine mapping in this test")


def attention_scaling(case) -> float:
    """pyengine's factor on cos and sin for the case (YaRN's; 1 for the others)."""
    r = case["rope"]
    return yarn_attention_factor(r["factor"]) if r["rope_type"] == "yarn" else 1.0


def test_golden_file_covers_every_scaling_type():
    assert GOLDEN["source"].startswith("transformers ")
    kinds = {c["rope"]["rope_type"] for c in GOLDEN["cases"]}
    assert {"default", "linear", "llama3", "yarn"} <= kinds
    for c in GOLDEN["cases"]:
        # only YaRN rescales cos/sin among these types: the value pyengine applies is HF's
        assert c["attention_scaling"] == pytest.approx(attention_scaling(c), rel=1e-12)
        assert (c["attention_scaling"] != 1.0) == (c["rope"]["rope_type"] == "yarn")
        if c["rope"]["rope_type"] == "llama3":    # each llama3 case has all three bands
            ratio = np.array(c["unscaled_inv_freq"]) / np.array(c["inv_freq"])
            f = c["rope"]["factor"]
            assert np.any(np.isclose(ratio, 1.0)) and np.any(np.isclose(ratio, f))
            assert np.sum(~np.isclose(ratio, 1.0) & ~np.isclose(ratio, f)) >= 2


@pytest.mark.parametrize("name", list(CASES))
def test_inv_freq_matches_hf(name):
    case = CASES[name]
    inv = rope_inv_freq(case["head_dim"], case["rope"]["rope_theta"], **pyengine_kwargs(case))
    assert inv.shape == (case["head_dim"] // 2,)
    np.testing.assert_allclose(inv, case["inv_freq"], rtol=RTOL, atol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_cos_sin_tables_match_hf(name):
    case = CASES[name]
    inv = rope_inv_freq(case["head_dim"], case["rope"]["rope_theta"], **pyengine_kwargs(case))
    cos, sin = rope_cos_sin(np.array(case["positions"]), inv)
    m = np.float32(attention_scaling(case))
    cos, sin = cos * m, sin * m
    # HF multiplies float32 frequencies by float32 positions: angles up to ~4000 rad carry ~4000 * 2^-24 of
    # rounding, so the tables agree to 5e-4 absolute at the largest position, far tighter below.
    for table, ref in ((cos, case["cos"]), (sin, case["sin"])):
        ref = np.array(ref)
        for row, pos in enumerate(case["positions"]):
            np.testing.assert_allclose(table[row], ref[row], rtol=0, atol=1e-6 + pos * 1.2e-7)


GGUF_CASES = [n for n, c in CASES.items() if c["gguf"] is not None]


@pytest.mark.parametrize("name", GGUF_CASES)
def test_config_reader_scaling_keys_reach_the_same_frequencies(tmp_path, name):
    """The GGUF route: llama.cpp's keys -> ModelConfig -> rope_inv_freq, with the arguments the model passes."""
    case = CASES[name]
    vt = gguf.GGUFValueType
    g = case["gguf"]
    keys = dict(LLAMA_KEYS, **{"embedding_length": case["head_dim"] * case["n_heads"],
                               "attention.head_count": case["n_heads"], "attention.head_count_kv": case["n_heads"],
                               "context_length": case["context"]})
    extra = {"llama.rope.freq_base": (case["rope"]["rope_theta"], vt.FLOAT32)}
    if g["type"] != "none":
        extra.update({"llama.rope.scaling.type": (g["type"], vt.STRING),
                      "llama.rope.scaling.factor": (g["factor"], vt.FLOAT32),
                      "llama.rope.scaling.original_context_length": (g["orig"], vt.UINT32)})
    for beta in ("beta_fast", "beta_slow"):
        if beta in g:
            extra[f"llama.rope.scaling.yarn_{beta}"] = (g[beta], vt.FLOAT32)
    c = ModelConfig.from_gguf(_write(tmp_path, keys=keys, extra=extra))
    assert c.head_dim == case["head_dim"]
    inv = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_type, c.rope_scaling_factor, c.rope_orig_context,
                        beta_fast=c.rope_beta_fast, beta_slow=c.rope_beta_slow)
    np.testing.assert_allclose(inv, case["inv_freq"], rtol=RTOL, atol=0)
    kind = rope_kind(c)                  # what every architecture's layers use: frequencies and cos/sin factor
    np.testing.assert_allclose(kind.inv_freq, case["inv_freq"], rtol=RTOL, atol=0)
    assert (1.0 if kind.mscale is None else kind.mscale) == pytest.approx(case["attention_scaling"], rel=1e-6)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c["rope"]["rope_type"] == "llama3"])
def test_llama3_as_llama_cpp_freq_factors(name):
    """llama.cpp keeps llama3 scaling as per-dimension divisors (rope_freqs.weight, float32) on unscaled RoPE."""
    case = CASES[name]
    factors = (np.array(case["unscaled_inv_freq"], np.float64) / np.array(case["inv_freq"], np.float64))
    inv = rope_inv_freq(case["head_dim"], case["rope"]["rope_theta"], freq_factors=factors.astype(np.float32))
    np.testing.assert_allclose(inv, case["inv_freq"], rtol=RTOL, atol=0)
    with pytest.raises(ValueError, match="freq_factors"):
        rope_inv_freq(case["head_dim"], case["rope"]["rope_theta"], freq_factors=factors[:-1])


def test_unsupported_scaling_is_refused_by_name():
    with pytest.raises(ValueError, match="dynamic"):
        rope_inv_freq(64, 10000.0, "dynamic", 4.0, 2048)
    with pytest.raises(ValueError, match="original context"):
        rope_inv_freq(64, 10000.0, "yarn", 4.0, None)
    with pytest.raises(ValueError, match="original context"):
        rope_inv_freq(64, 10000.0, "llama3", 8.0, None)
