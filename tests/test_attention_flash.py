"""S03/S06/S12: attention forms agree — reference (repeat K/V, full scores), grouped (no repeat), tiled
flash (online softmax) — on random and real activations, and attention through shuffled block tables is exact."""
import numpy as np
import pytest

from pyengine.arena import Arena
from pyengine.engine.kv_cache import ContextView, PagedKVCache, contiguous_start, slot_mapping
from pyengine.layers.attention import _reduce_keys, attention, flash_attention, grouped_attention
from pyengine.tuning import KEY_TREE_MIN

RNG = np.random.default_rng(0)


def qkv(tq, tk, h, hkv, hd=64, rng=RNG, scale=1.0):
    return (rng.standard_normal((tq, h, hd)).astype(np.float32) * scale,
            rng.standard_normal((tk, hkv, hd)).astype(np.float32) * scale,
            rng.standard_normal((tk, hkv, hd)).astype(np.float32))


def naive(q, k, v, offset):
    """Loop-per-query float64 softmax attention: the independent baseline."""
    tq, h, hd = q.shape
    g = h // k.shape[1]
    out = np.zeros(q.shape)
    for i in range(tq):
        for head in range(h):
            keys = k[:offset + i + 1, head // g].astype(np.float64)
            s = keys @ q[i, head] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[i, head] = (p / p.sum()) @ v[:offset + i + 1, head // g]
    return out


@pytest.mark.parametrize("tq,tk,h,hkv", [(1, 1, 9, 3), (1, 50, 9, 3), (6, 6, 4, 4), (5, 40, 9, 3),
                                          (17, 17, 8, 1), (70, 130, 6, 2),
                                          # key counts where the halving reductions take over (odd and even)
                                          (1, 513, 9, 3), (8, 1000, 9, 3), (3, 256, 4, 2),
                                          (64, 300, 4, 4)])           # Tq*g == hd: the output layout is unambiguous
def test_reference_and_grouped_match_naive(tq, tk, h, hkv):
    q, k, v = qkv(tq, tk, h, hkv)
    want = naive(q, k, v, tk - tq)
    assert np.abs(attention(q, k, v) - want).max() < 1e-5
    assert np.abs(grouped_attention(q, k, v) - want).max() < 1e-5


@pytest.mark.parametrize("n", [1, 2, 7, KEY_TREE_MIN - 1, KEY_TREE_MIN, KEY_TREE_MIN + 1, 1000, 4097])
def test_reduce_keys_equals_numpy(n):
    s = np.random.default_rng(n).standard_normal((3, n, 5)).astype(np.float32)
    before = s.copy()
    for op in (np.maximum, np.add):
        want = op.reduce(s.astype(np.float64), axis=1, keepdims=True)
        for tmp in (None, np.zeros(3 * n * 5, np.float32), np.zeros(4, np.float32)):   # too small: allocates
            got = _reduce_keys(op, s, tmp)
            assert got.shape == (3, 1, 5) and got.dtype == np.float32
            assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    assert np.array_equal(s, before)                      # the input is only read


SHAPES = [(1, 300, 9, 3), (64, 64, 9, 3), (50, 250, 9, 3), (300, 300, 9, 3), (257, 400, 8, 2), (33, 33, 4, 4)]
TILES = [(1, 1), (7, 5), (64, 32), (128, None), (512, 128)]


# tile 1 (one key per step) only on the smaller shapes: it is slow and adds nothing on the big ones
@pytest.mark.parametrize("tq,tk,h,hkv,tile,q_tile", [s + t for s in SHAPES for t in TILES
                                                     if t[0] > 1 or s[0] * s[1] <= 20000])
def test_flash_equals_plain(tq, tk, h, hkv, tile, q_tile):
    q, k, v = qkv(tq, tk, h, hkv, rng=np.random.default_rng(tq * 1000 + tk), scale=2.0)   # peaky softmax
    plain = grouped_attention(q, k, v)
    flash = flash_attention(q, k, v, tile=tile, q_tile=q_tile)
    assert np.abs(flash - plain).max() <= 1e-5


def test_flash_uses_caller_scratch_and_bounded_memory():
    q, k, v = qkv(256, 256, 9, 3)
    scratch = np.zeros(3 * 64 * 32 * 3, np.float32)
    out = np.empty_like(q)
    assert flash_attention(q, k, v, tile=64, q_tile=32, out=out, scratch=scratch) is out
    assert np.abs(out - grouped_attention(q, k, v)).max() <= 1e-5
    with pytest.raises(ValueError, match="scratch"):
        flash_attention(q, k, v, tile=128, q_tile=32, scratch=scratch)
    with pytest.raises(ValueError, match="tile"):
        flash_attention(q, k, v, tile=0)


@pytest.fixture(scope="module")
def real_qkv():
    """q, k, v of layer 1 of SmolLM2 for a 96-token prompt (real activation statistics)."""
    from pyengine.gguf.reader import GGUFFile
    from pyengine.layers.norm import rms_norm
    from pyengine.layers.rotary import apply_rope, rope_cos_sin
    from pyengine.model_files import default_model_path
    from pyengine.models import load_model
    c, w, model = load_model(GGUFFile(default_model_path()), mode="lean")
    ids = np.random.default_rng(3).integers(0, c.vocab_size, 96)
    x = w.embed(ids)
    L = w.layers[1]
    qkv_ = rms_norm(x, L.attn_norm, c.rms_eps) @ L.wqkv
    cos, sin = rope_cos_sin(np.arange(96), model.kinds[0].inv_freq)
    q = apply_rope(qkv_[:, :576].reshape(96, 9, 64), cos, sin)
    k = apply_rope(qkv_[:, 576:768].reshape(96, 3, 64), cos, sin)
    return q, k, np.ascontiguousarray(qkv_[:, 768:].reshape(96, 3, 64))


def test_flash_equals_plain_on_real_activations(real_qkv):
    q, k, v = real_qkv
    ref = attention(q, k, v)
    assert np.abs(grouped_attention(q, k, v) - ref).max() <= 1e-5
    for tile, q_tile in ((16, 16), (32, 96), (96, 8)):
        assert np.abs(flash_attention(q, k, v, tile=tile, q_tile=q_tile) - ref).max() <= 1e-5
    # decode-like: last 3 queries over the full context
    assert np.abs(flash_attention(q[-3:], k, v, tile=16) - ref[-3:]).max() <= 1e-5


def make_cache(num_blocks=32, block_size=4, hkv=3, hd=64):
    arena = Arena(2 * num_blocks * block_size * hkv * hd * 4 + 256)
    return PagedKVCache(arena, 1, num_blocks, block_size, hkv, hd)


def test_slots_and_contiguity():
    table = np.array([5, 2, 9], np.int32)
    assert list(slot_mapping(np.arange(10), table, 4)) == [20, 21, 22, 23, 8, 9, 10, 11, 36, 37]
    assert contiguous_start(np.array([3, 4, 5, 0], np.int32), 12, 4) == 12   # only the covering blocks matter
    assert contiguous_start(np.array([3, 5], np.int32), 5, 4) is None
    assert contiguous_start(np.array([7], np.int32), 3, 4) == 28


def test_attention_through_shuffled_block_table_is_exact():
    """The same K/V written through a contiguous and a shuffled table give identical attention outputs."""
    ctx, tq, bs = 37, 5, 4
    q, k, v = qkv(tq, ctx, 9, 3)
    want = grouped_attention(q, k, v)
    for table in (np.arange(10, dtype=np.int32), np.random.default_rng(7).permutation(32)[:10].astype(np.int32)):
        kv = make_cache(block_size=bs)
        kv.write(0, slot_mapping(np.arange(ctx), table, bs), k, v)
        view = ContextView(table, ctx, bs)
        assert (view.start is not None) == (table[1] == table[0] + 1)
        scratch_k, scratch_v = np.zeros((64, 3, 64), np.float32), np.zeros((64, 3, 64), np.float32)
        kc, vc = view.kv(kv, 0, scratch_k, scratch_v)
        assert np.array_equal(kc, k) and np.array_equal(vc, v)
        assert np.shares_memory(kc, kv.k) == (view.start is not None)     # zero-copy slice when contiguous
        got = grouped_attention(q, kc, vc)
        assert np.abs(got - want).max() <= 1e-6
        assert np.abs(flash_attention(q, kc, vc, tile=8) - want).max() <= 1e-5


def test_sliding_window_attention_all_forms_agree():
    """A sliding window (Gemma's local layers): the reference masks keys at distance >= window; the plain and
    tiled forms (with tiles that start inside the window, and key ranges that start past key 0) match it, and a
    window as long as the context changes nothing."""
    q, k, v = qkv(70, 90, 8, 2, rng=np.random.default_rng(4))
    for window in (1, 7, 33, 90):
        ref = attention(q, k, v, window=window)
        # direct: query i at position 20 + i sees keys max(0, 20 + i - window + 1) .. 20 + i
        i, pos = 50, 70
        keep = np.arange(90)[(np.arange(90) <= pos) & (pos - np.arange(90) < window)]
        one = attention(q[i:i + 1], k[keep], v[keep], offset=len(keep) - 1)
        assert np.abs(ref[i] - one[0]).max() <= 1e-6
        assert np.abs(grouped_attention(q, k, v, window=window) - ref).max() <= 1e-5
        for tile, q_tile in ((16, 16), (8, 32), (64, 8)):
            assert np.abs(flash_attention(q, k, v, tile=tile, q_tile=q_tile, window=window) - ref).max() <= 1e-5
    assert np.abs(attention(q, k, v, window=200) - attention(q, k, v)).max() == 0
    # a key range that starts at key 30 (the runner reads only the window's blocks): offsets shift, output equal
    ref = attention(q, k, v, window=16)
    assert np.abs(grouped_attention(q[-5:], k[30:], v[30:], offset=90 - 5 - 30, window=16) - ref[-5:]).max() <= 1e-5
