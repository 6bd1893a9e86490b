"""S03: ModelConfig.from_gguf reads llama.cpp's hyper-parameter keys (checked against the gguf package's
reader on the real files, and against synthetic files written with the gguf package's writer)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyengine.config import ModelConfig
from pyengine.gguf import GGUFError
from pyengine.gguf.reader import GGUFFile
from pyengine.model_files import default_model_path
from pyengine.models import load_config

import gguf

from model_paths import gemma_gguf


def _ref_scalar(reader, key):
    return reader.fields[key].contents()


def test_smollm2_config_matches_reference_reader():
    path = default_model_path()
    ref = gguf.GGUFReader(path)
    cfg = ModelConfig.from_gguf(path)
    assert cfg.arch == "llama"
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads) == (30, 576, 9, 3)
    assert (cfg.head_dim, cfg.ffn_dim, cfg.vocab_size, cfg.n_rep) == (64, 1536, 49152, 3)
    assert cfg.context_length == _ref_scalar(ref, "llama.context_length") == 8192
    assert np.float32(cfg.rope_theta) == np.float32(_ref_scalar(ref, "llama.rope.freq_base")) == 100000
    assert np.float32(cfg.rms_eps) == np.float32(_ref_scalar(ref, "llama.attention.layer_norm_rms_epsilon"))
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_orig_context) == ("none", 1.0, 8192)
    assert cfg.tie_embeddings is True and "output.weight" not in [t.name for t in ref.tensors]
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert cfg.n_params == sum(int(t.n_elements) for t in ref.tensors) == 134515008
    assert ModelConfig.from_gguf(GGUFFile(path)) == cfg
    assert ModelConfig.from_gguf(Path(path).read_bytes()) == cfg
    assert cfg.to_dict()["d_model"] == 576


def test_gemma3_is_readable_for_info():
    cfg = ModelConfig.from_gguf(gemma_gguf())
    assert cfg.arch == "gemma3"
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (18, 640, 4, 1, 256)
    assert (cfg.vocab_size, cfg.ffn_dim, cfg.bos_token_id, cfg.eos_token_id) == (262144, 2048, 2, 1)
    assert cfg.rope_theta == 1e6 and cfg.tie_embeddings
    full = load_config(GGUFFile(gemma_gguf()))                    # the architecture's own keys on top
    assert full.to_dict() == {**cfg.to_dict(), **{k: full.to_dict()[k] for k in
                                                  ("sliding_window", "sliding_pattern", "rope_local_theta",
                                                   "attn_scale")}}
    assert (full.sliding_window, full.sliding_pattern, full.rope_local_theta) == (512, 6, 10000.0)
    assert full.attn_scale == 256 ** -0.5
    assert [i for i in range(18) if not full.is_sliding(i)] == [5, 11, 17]


LLAMA_KEYS = {
    "block_count": 2, "embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": 2,
    "feed_forward_length": 96, "context_length": 256, "attention.layer_norm_rms_epsilon": 1e-5,
}


def _write(tmp_path: Path, arch="llama", keys=None, extra=None, vocab=32, output=False, embd_rows=None) -> Path:
    keys = dict(LLAMA_KEYS if keys is None else keys)
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    if vocab:
        w.add_token_list([f"t{i}" for i in range(vocab)])
    extra = {"tokenizer.ggml.bos_token_id": (1, gguf.GGUFValueType.UINT32),
             "tokenizer.ggml.eos_token_id": (2, gguf.GGUFValueType.UINT32), **(extra or {})}
    for key, (value, vtype) in extra.items():
        w.add_key_value(key, value, vtype)
    w.add_tensor("token_embd.weight", np.zeros((embd_rows or vocab or 32, 64), np.float32))
    if output:
        w.add_tensor("output.weight", np.zeros((vocab, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_synthetic_llama_defaults(tmp_path):
    cfg = ModelConfig.from_gguf(_write(tmp_path, output=True))
    assert (cfg.head_dim, cfg.rope_theta, cfg.tie_embeddings) == (16, 10000.0, False)
    assert cfg.n_params == 2 * 32 * 64 and cfg.vocab_size == 32
    keys = dict(LLAMA_KEYS)
    del keys["attention.head_count_kv"]
    assert ModelConfig.from_gguf(_write(tmp_path, keys=keys)).n_kv_heads == 4   # default: no GQA


@pytest.mark.parametrize("missing", ["block_count", "embedding_length", "attention.head_count",
                                     "feed_forward_length", "context_length",
                                     "attention.layer_norm_rms_epsilon"])
def test_missing_required_key_is_named(tmp_path, missing):
    keys = {k: v for k, v in LLAMA_KEYS.items() if k != missing}
    with pytest.raises(GGUFError, match=f"llama.{missing}"):
        ModelConfig.from_gguf(_write(tmp_path, keys=keys))


def test_rope_scaling_and_head_dim_keys(tmp_path):
    vt = gguf.GGUFValueType
    extra = {"llama.rope.scaling.type": ("linear", vt.STRING), "llama.rope.scaling.factor": (4.0, vt.FLOAT32),
             "llama.rope.scaling.original_context_length": (64, vt.UINT32),
             "llama.rope.freq_base": (500000.0, vt.FLOAT32)}
    cfg = ModelConfig.from_gguf(_write(tmp_path, extra=extra))
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_orig_context) == ("linear", 4.0, 64)
    assert cfg.rope_theta == 500000.0
    old = ModelConfig.from_gguf(_write(tmp_path, extra={"llama.rope.scale_linear": (2.0, vt.FLOAT32)}))
    assert (old.rope_scaling_type, old.rope_scaling_factor) == ("linear", 2.0)
    wide = ModelConfig.from_gguf(_write(tmp_path, extra={"llama.attention.key_length": (32, vt.UINT32),
                                                         "llama.rope.dimension_count": (32, vt.UINT32)}))
    assert wide.head_dim == 32
    with pytest.raises(GGUFError, match="rope.dimension_count"):
        ModelConfig.from_gguf(_write(tmp_path, extra={"llama.rope.dimension_count": (8, vt.UINT32)}))


def test_inconsistent_files_are_refused(tmp_path):
    vt = gguf.GGUFValueType
    with pytest.raises(GGUFError, match="not a multiple of llama.attention.head_count_kv"):
        ModelConfig.from_gguf(_write(tmp_path, keys={**LLAMA_KEYS, "attention.head_count_kv": 3}))
    with pytest.raises(GGUFError, match=r"'mamba' is not supported \(supported: gemma2, gemma3, granitemoe, llama, olmoe, phi3, qwen2, qwen2moe, qwen3, qwen3moe\)"):
        load_config(GGUFFile(_write(tmp_path, arch="mamba")))      # the registry decides what runs
    with pytest.raises(GGUFError, match="token_embd.weight' has 40 rows but the vocab has 32"):
        ModelConfig.from_gguf(_write(tmp_path, embd_rows=40))
    with pytest.raises(GGUFError, match="llama.block_count' must be an integer"):
        ModelConfig.from_gguf(_write(tmp_path, keys={**LLAMA_KEYS, "block_count": 2.5}))
    with pytest.raises(GGUFError, match="llama.context_length.*positive"):
        ModelConfig.from_gguf(_write(tmp_path, keys={**LLAMA_KEYS, "context_length": 0}))
    with pytest.raises(GGUFError, match="eos_token_id"):
        ModelConfig.from_gguf(_write(tmp_path, extra={"tokenizer.ggml.eos_token_id": (999, vt.UINT32)}))
    # no token list: vocab from the embedding rows
    assert ModelConfig.from_gguf(_write(tmp_path, vocab=0, embd_rows=48)).vocab_size == 48
