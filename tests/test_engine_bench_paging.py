"""`pyengine bench paging`: the model-free KV-waste replay and the command-line surface."""
import argparse

from pyengine.bench import paging


def test_kv_waste_replay_paged_wastes_only_the_last_partial_block():
    r = paging.kv_waste(60, max_model_len=2048, block_size=16, num_blocks=2048, max_num_seqs=16, seed=3)
    assert r["steps"] > 60
    for key in ("waste_paged", "waste_slab_max_len", "waste_slab_request"):
        assert 0.0 <= r[key] < 1.0
    # paging wastes at most one partly filled block per sequence: < 16 tokens of every ~hundreds
    assert r["waste_paged"] < 0.05
    assert r["waste_slab_max_len"] > r["waste_slab_request"] > r["waste_paged"]


def test_cli_options_and_waste_only_run(capsys):
    p = argparse.ArgumentParser()
    paging.add_arguments(p)
    args = p.parse_args(["--only", "waste", "--quick"])
    assert args.only == ["waste"] and args.quick
    assert paging.run(args) == 0
    out = capsys.readouterr().out
    assert "paged, 16-token blocks" in out and "ratio" in out
