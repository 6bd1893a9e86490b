"""S05: the arena carves aligned, non-overlapping views out of one buffer and reports its carve-up."""
import numpy as np
import pytest

from pyengine.arena import ALIGNMENT, Arena, plan_nbytes, spec


def test_views_are_aligned_disjoint_and_share_the_buffer():
    specs = [spec("act.x", (3, 5)), spec("act.ids", 7, np.int64), spec("kv.k", (2, 4, 3)),
             spec("b.bytes", 13, np.uint8)]
    arena = Arena.from_specs(specs)
    assert arena.nbytes == plan_nbytes(specs)
    views = [arena[s.name] for s in specs]
    for s, v in zip(specs, views):
        assert v.shape == s.shape and v.dtype == s.dtype
        assert v.__array_interface__["data"][0] % ALIGNMENT == 0
        assert np.shares_memory(v, arena.buffer) and not v.any()
    for i, v in enumerate(views):
        v[...] = i + 1                       # writing one region leaves every other intact
    for i, v in enumerate(views):
        assert np.all(v == i + 1)


def test_full_and_duplicate_and_missing():
    arena = Arena(1024)
    arena.alloc("a", 100)
    with pytest.raises(ValueError, match="'a'"):
        arena.alloc("a", 1)
    with pytest.raises(MemoryError, match="'big'"):
        arena.alloc("big", 1000)
    with pytest.raises(KeyError, match="nope"):
        arena["nope"]
    with pytest.raises(ValueError, match="negative"):
        arena.alloc("neg", (-1, 2))


def test_summary_groups_regions():
    arena = Arena.from_specs([spec("kv_cache.k", 2**18), spec("kv_cache.v", 2**18), spec("act.x", 1000)])
    text = arena.summary()
    lines = text.splitlines()
    assert lines[0].startswith("arena 2.0 MiB")
    assert lines[1].split()[0] == "kv_cache" and "2.00 MiB" in lines[1]
    assert lines[2].split()[0] == "act"
