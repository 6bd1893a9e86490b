"""Issue 30 (Gemma 2): attention-logit soft-capping, s -> c * tanh(s / c) on the scaled scores before the mask
and softmax, in every attention form: the reference, the plain grouped softmax, the tiled flash form (with a
sliding window), the batched decode form and the stored-KV (fp16 cache) decode path, against a float64
formula written out here; and a tiny gemma2 model decoding over an fp16 KV cache against its reference."""
import numpy as np
import pytest

from pyengine.layers.attention import attention, decode_attention, flash_attention, grouped_attention, padding_mask

CAP = 1.5


def formula(q, k, v, scale, cap, window=None):
    """float64 causal GQA attention with capped scores, the new queries being the last ones."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    Tq, H, hd = q.shape
    Tk, Hkv, _ = k.shape
    g = H // Hkv
    out = np.zeros((Tq, H, hd))
    for i in range(Tq):
        pos = Tk - Tq + i
        for h in range(H):
            s = k[:pos + 1, h // g] @ q[i, h] * scale
            s = cap * np.tanh(s / cap)
            if window is not None:
                s[:max(0, pos - window + 1)] = -np.inf
            p = np.exp(s - s.max())
            out[i, h] = p @ v[:pos + 1, h // g] / p.sum()
    return out


@pytest.fixture
def qkv():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((40, 4, 16)).astype(np.float32) * 2
    k = rng.standard_normal((40, 2, 16)).astype(np.float32) * 2
    v = rng.standard_normal((40, 2, 16)).astype(np.float32)
    return q, k, v


def test_every_form_caps_the_scores(qkv):
    q, k, v = qkv
    want = formula(q, k, v, 0.25, CAP)
    assert np.abs(want - formula(q, k, v, 0.25, 1e6)).max() > 0.1          # the cap matters at these scores
    for got in (attention(q, k, v, scale=0.25, softcap=CAP),
                grouped_attention(q, k, v, scale=0.25, softcap=CAP),
                flash_attention(q, k, v, scale=0.25, tile=7, q_tile=5, softcap=CAP)):
        np.testing.assert_allclose(got, want, atol=2e-5)
    w = formula(q, k, v, 0.25, CAP, window=6)
    np.testing.assert_allclose(flash_attention(q, k, v, scale=0.25, tile=7, q_tile=5, window=6, softcap=CAP), w,
                               atol=2e-5)
    np.testing.assert_allclose(grouped_attention(q, k, v, scale=0.25, window=6, softcap=CAP), w, atol=2e-5)


def test_decode_form_caps_the_scores(qkv):
    q, k, v = qkv
    lens = np.array([40, 23])
    kb, vb = np.stack([k, k]), np.stack([v, v])
    got = decode_attention(np.stack([q[39], q[22]]), kb, vb, scale=0.25, pad=padding_mask(lens, 40), softcap=CAP)
    np.testing.assert_allclose(got[0], formula(q, k, v, 0.25, CAP)[-1], atol=2e-5)
    np.testing.assert_allclose(got[1], formula(q[:23], k[:23], v[:23], 0.25, CAP)[-1], atol=2e-5)


def test_gemma2_decodes_over_an_fp16_cache(tmp_path):
    """The stored-KV decode path (fp16 rows converted tile by tile) with the cap: decode steps of the tiny
    gemma2 model equal its float32 reference to fp16 rounding."""
    from pyengine.engine.model_runner import ModelRunner
    from tiny_models import write_tiny
    path = write_tiny(tmp_path / "g2.gguf", "gemma2", seed=3)
    r = ModelRunner(str(path), max_model_len=128, kv_cache_dtype="fp16", block_size=8)
    assert r.model.attn_softcap == 2.0 and r.kv_cache.converts
    toks = np.random.default_rng(1).integers(3, 300, 50)
    ref = r.model.forward_reference(toks)
    r.run(r.contiguous_batch(toks[:40], 0))
    for p in range(40, 50):
        got = r.run(r.contiguous_batch(toks[p:p + 1], p))[0]
        assert np.abs(got - ref[p]).max() <= 2e-2 * np.abs(ref[p]).max(), p
