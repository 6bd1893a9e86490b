"""`pyengine bench paging`: the model-free KV-waste replay and the command-line surface."""
import argparse
import json
import os
import sys

import pytest

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


def test_hf_baseline_plumbing(tmp_path):
    """--hf-python: the job (model, prompts, steps) goes to the other interpreter as JSON on stdin, its last
    JSON line comes back; a failing interpreter ends the bench with its error, not a traceback."""
    fake = tmp_path / "fakepython"
    fake.write_text(f"#!{sys.executable}\n"
                    "import json, os, sys\n"
                    "job = json.load(sys.stdin)\n"
                    "assert os.path.basename(sys.argv[1]) == 'hf_batched.py' and os.path.exists(sys.argv[1])\n"
                    "assert os.path.exists(job['model'])\n"
                    "print('loading...')\n"
                    "print(json.dumps({'decode_tok_s': float(sum(map(len, job['prompts']))), "
                    "'threads': job['steps']}))\n")
    fake.chmod(0o755)
    args = argparse.Namespace(hf_python=os.fspath(fake), model=None)
    assert paging._hf_batched_rate(args, [[1, 2, 3], [4, 5]], 7) == {"decode_tok_s": 5.0, "threads": 7}
    broken = tmp_path / "broken"
    broken.write_text(f"#!{sys.executable}\nimport sys\nsys.exit('no module named torch')\n")
    broken.chmod(0o755)
    with pytest.raises(SystemExit, match="(?s)HF baseline failed.*no module named torch"):
        paging._hf_batched_rate(argparse.Namespace(hf_python=os.fspath(broken), model=None), [[1]], 1)
