"""Issue 30: malformed files of the new architectures are refused with a message naming what is wrong."""
import pytest

from pyengine.gguf import GGUFError
from pyengine.gguf.reader import GGUFFile
from pyengine.models import load_model
from tiny_models import write_tiny


def load(path):
    return load_model(GGUFFile(str(path)))


def test_phi3_needs_both_longrope_tables_of_the_rotary_width(tmp_path):
    def one(t):
        del t["rope_factors_short.weight"]
    with pytest.raises(GGUFError, match="LongRoPE needs both tensors 'rope_factors_short.weight'"):
        load(write_tiny(tmp_path / "a.gguf", "phi3", edit=one))

    def wide(t):
        t["rope_factors_long.weight"] = t["rope_factors_long.weight"].repeat(2)
    with pytest.raises(ValueError, match="rope_factors_long.weight"):
        load(write_tiny(tmp_path / "b.gguf", "phi3", edit=wide))


def test_qwen2_without_its_biases_and_qwen3_with_routers_are_refused(tmp_path):
    def no_bias(t):
        del t["blk.1.attn_k.bias"]
    with pytest.raises(Exception, match="blk.1.attn_k.bias"):
        load(write_tiny(tmp_path / "a.gguf", "qwen2", edit=no_bias))

    def router(t):
        import numpy as np
        t["blk.0.ffn_gate_inp.weight"] = np.zeros((8, 64), np.float32)
    with pytest.raises(GGUFError, match="should be 'qwen3moe'"):
        load(write_tiny(tmp_path / "b.gguf", "qwen3", edit=router))


def test_gemma2_window_must_be_positive(tmp_path):
    path = write_tiny(tmp_path / "a.gguf", "gemma2", extra_meta={"gemma2.attention.sliding_window": 0})
    with pytest.raises(GGUFError, match="sliding_window. = 0 must be a positive integer"):
        load(path)
