"""S09: batched decode attention (one query per sequence over padded contexts + a length mask) equals the
per-sequence grouped path and a float64 loop, whatever the padding rows hold."""
import numpy as np
import pytest

from pyengine.layers.attention import decode_attention, grouped_attention, padding_mask


def naive_last_query(q, k, v):
    """float64 softmax attention of one query (H, hd) over all keys (Tk, Hkv, hd)."""
    h, hd = q.shape
    g = h // k.shape[1]
    out = np.zeros((h, hd))
    for head in range(h):
        s = k[:, head // g].astype(np.float64) @ q[head] / np.sqrt(hd)
        p = np.exp(s - s.max())
        out[head] = (p / p.sum()) @ v[:, head // g]
    return out


@pytest.mark.parametrize("B,L,h,hkv", [(1, 1, 9, 3), (5, 40, 9, 3), (8, 144, 9, 3), (3, 17, 4, 4), (6, 33, 8, 1),
                                      (4, 600, 9, 3), (2, 512, 4, 1)])    # several key chunks
def test_decode_attention_equals_per_sequence(B, L, h, hkv):
    rng = np.random.default_rng(B * 100 + L)
    lens = rng.integers(1, L + 1, B)
    lens[0] = L                                                   # one sequence fills the padding length
    q = rng.standard_normal((B, h, 64)).astype(np.float32) * 2
    k = rng.standard_normal((B, L, hkv, 64)).astype(np.float32) * 2
    v = rng.standard_normal((B, L, hkv, 64)).astype(np.float32)
    for b in range(B):                                            # padding: stale but finite, some huge
        k[b, lens[b]:] = 1e30
        v[b, lens[b]:] = -3e30
    out = np.empty_like(q)
    scratch = np.zeros(B * h * L, np.float32)
    assert decode_attention(q, k, v, lens, out=out, scratch=scratch) is out
    assert np.all(np.isfinite(out))
    for b in range(B):
        n = lens[b]
        alone = grouped_attention(q[b:b + 1], k[b, :n], v[b, :n])[0]
        assert np.abs(out[b] - alone).max() <= 1e-5, b
        assert np.abs(out[b] - naive_last_query(q[b], k[b, :n], v[b, :n])).max() <= 1e-5, b
    # the engine's form: the padding mask built once (per step) instead of the lengths
    assert np.array_equal(decode_attention(q, k, v, pad=padding_mask(lens, L), scratch=scratch), out)


def test_decode_attention_validates():
    q = np.zeros((2, 9, 64), np.float32)
    k = np.zeros((2, 8, 3, 64), np.float32)
    with pytest.raises(ValueError, match="lens"):
        decode_attention(q, k, k, np.array([0, 3]))
    with pytest.raises(ValueError, match="lens"):
        decode_attention(q, k, k, np.array([9, 3]))
    with pytest.raises(ValueError, match="2 context lengths"):
        decode_attention(q, k, k, np.array([3]))
    with pytest.raises(ValueError, match="2 context lengths"):
        decode_attention(q, k, k, pad=padding_mask(np.array([3, 3, 3]), 8))
    with pytest.raises(ValueError, match="scratch"):
        decode_attention(q, k, k, np.array([8, 3]), scratch=np.zeros(10, np.float32))
