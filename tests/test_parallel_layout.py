"""S17's split of a model over ranks (pyengine/parallel/layout.py) and the step messages (parallel/mpi.py's
encode/decode and micro-batch cutting), without MPI: uneven head splits by KV group, replicated KV heads, FFN
columns balancing the ranks' weights, stages, refusals that say what to change; a batch cut into micro-batches
keeps every token, its position, its context and its logits row."""
import subprocess
import sys

import numpy as np
import pytest

from model_paths import model_path
from pyengine.engine.forward_batch import ForwardBatch
from pyengine.parallel.layout import plan_ranks, rank_config, split_experts, split_heads, split_layers
from pyengine.parallel.wire import decode_batch, encode_batch, split_batch


def smollm2():
    from pyengine.gguf.reader import GGUFFile
    from pyengine.models import load_config
    return load_config(GGUFFile(model_path("smollm2")))


def test_heads_split_by_kv_group_unevenly():
    assert split_heads(9, 3, 2) == [((0, 1, 2, 3, 4, 5), (0, 1)), ((6, 7, 8), (2,))]
    assert split_heads(9, 3, 3) == [((0, 1, 2), (0,)), ((3, 4, 5), (1,)), ((6, 7, 8), (2,))]
    # more ranks than KV heads: the KV head is replicated, its query heads split (Gemma 3 270M: 4 / 1)
    assert split_heads(4, 1, 2) == [((0, 1), (0,)), ((2, 3), (0,))]
    assert split_heads(9, 3, 6) == [((0, 1), (0,)), ((2,), (0,)), ((3, 4), (1,)), ((5,), (1,)), ((6, 7), (2,)),
                                    ((8,), (2,))]


def test_bad_configurations_say_what_to_change():
    with pytest.raises(ValueError, match="at most 3 ranks or a multiple of 3"):
        split_heads(9, 3, 4)
    with pytest.raises(ValueError, match="at most 9 ranks"):
        split_heads(9, 3, 12)
    with pytest.raises(ValueError, match="at most 30 stages"):
        split_layers(30, 31)
    with pytest.raises(ValueError, match="positive integer"):
        plan_ranks(smollm2(), 0, 1)
    with pytest.raises(ValueError, match="exceeds the model's 8 experts .* at most 8 ranks"):
        split_experts(8, 9)


def test_experts_split_whole_and_unevenly():
    assert split_experts(8, 2) == [(0, 4), (4, 8)]
    assert split_experts(8, 3) == [(0, 3), (3, 6), (6, 8)]


def test_plan_balances_each_sublayer_and_stages():
    c = smollm2()
    parts = plan_ranks(c, 2, 2)
    assert [(p.stage, p.tp_rank) for p in parts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    (f0, f1), (g0, g1) = parts[0].ffn, parts[1].ffn
    # the MLP ends in its own Allreduce: its columns are split evenly even though the heads cannot be (6 + 3)
    assert (f0, f1, g0, g1) == (0, c.ffn_dim // 2, c.ffn_dim // 2, c.ffn_dim)
    assert [len(p.q_heads) for p in parts[:2]] == [6, 3]
    assert [q1 - q0 for q0, q1 in (p.ffn for p in plan_ranks(c, 3, 1))] == [512, 512, 512]
    (a0, a1), (b0, b1) = parts[0].layers, parts[2].layers
    assert (a0, b1, a1) == (0, 30, b0) and a1 < 15            # stage 0 also holds the LM head
    rc = rank_config(c, parts[1])
    assert (rc.n_heads, rc.n_kv_heads, rc.ffn_dim, rc.n_layers) == (3, 1, g1 - g0, a1)
    assert parts[0].vocab == (0, 24576) and parts[1].vocab == (24576, c.vocab_size)


def batch():
    # a 9-token prompt chunk, two decodes, a 5-token chunk at position 20; logits rows not in row order
    ql, cl = [9, 1, 1, 5], [9, 40, 17, 25]
    pos = np.concatenate([np.arange(c - q, c) for q, c in zip(ql, cl)])
    tables = [np.arange(k, k + 3, dtype=np.int32) for k in (0, 10, 20, 30)]
    return ForwardBatch(np.arange(100, 116), pos, ql, cl, tables, np.array([15, 8, 9, 10]))


def test_step_message_round_trips():
    b = batch()
    got = decode_batch(*encode_batch(b))
    for f in ("token_ids", "positions", "logits_indices"):
        np.testing.assert_array_equal(getattr(got, f), getattr(b, f))
    assert got.query_lens == b.query_lens and got.context_lens == b.context_lens
    assert all(np.array_equal(x, y) for x, y in zip(got.block_tables, b.block_tables))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 16])
def test_micro_batches_cut_sequences_consistently(n):
    b = batch()
    parts = split_batch(b, n)
    assert np.array_equal(np.concatenate([m.token_ids for m, _ in parts]), b.token_ids)
    sel = np.concatenate([s for _, s in parts])
    assert sorted(sel.tolist()) == [0, 1, 2, 3]
    row0 = 0
    for m, s in parts:
        m.validate(16, 64, 1000)                                   # positions match context - query per piece
        np.testing.assert_array_equal(m.logits_indices + row0, b.logits_indices[s])
        row0 += m.num_tokens


def test_serve_refuses_a_bad_split_before_starting_ranks():
    p = subprocess.run([sys.executable, "-m", "pyengine", "serve", "--tensor-parallel-size", "4"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "at most 3 ranks or a multiple of 3" in p.stderr


def test_serve_under_a_mismatched_mpiexec_says_what_to_change():
    """The user's mpiexec (or hostfile) gives 2 ranks for TP 3: every rank refuses with the numbers."""
    from pyengine.parallel.launch import mpiexec_command, rank_env
    p = subprocess.run(mpiexec_command(2, ["-m", "pyengine", "serve", "--tensor-parallel-size", "3"]),
                       env=rank_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "the MPI job has 2 ranks but tensor_parallel_size 3 x pipeline_parallel_size 1 = 3" in p.stderr
    assert "mpiexec -n 3" in p.stderr


@pytest.mark.parametrize("ft", [True, False], ids=["ulfm", "no-ft"])
def test_driver_warns_when_a_dying_rank_would_end_the_job(tmp_path, ft):
    """Ranks started without Open MPI's fault tolerance (a hand-written mpiexec without --with-ft ulfm): rank 0
    warns at start that a dying rank will end the whole job, and says the flag; with it, no warning."""
    from pyengine.parallel.launch import mpiexec_command, rank_env
    script = tmp_path / "g.py"
    script.write_text("import logging\nlogging.basicConfig()\nfrom pyengine.parallel.mpi import MPIGroup\n"
                      "g = MPIGroup(2, 1)\nif g.rank: g.recv_step()\nelse: g.stop()\n")
    cmd = mpiexec_command(2, [str(script)])
    if not ft:
        i = cmd.index("--with-ft")
        del cmd[i:i + 2]
    p = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert ("start it with mpiexec --with-ft ulfm" in p.stderr) is not ft


def test_a_rank_that_cannot_load_its_part_fails_the_start_naming_it(tmp_path):
    """One host of a job lacks the model file (here: rank 1 is given a missing path): that rank prints its own
    error, and rank 0 fails at start — a ValueError naming the rank — instead of waiting for it forever."""
    from pyengine.parallel.launch import mpiexec_command, rank_env
    script = tmp_path / "start.py"
    script.write_text("import os, sys\nfrom pyengine.parallel.launch import mpi_runner\n"
                      "path = sys.argv[1] if os.environ['OMPI_COMM_WORLD_RANK'] == '0' else sys.argv[2]\n"
                      "try:\n    mpi_runner(path, 2, 1, max_model_len=64).close()\n"
                      "except ValueError as exc:\n    print('ERR ' + str(exc), flush=True)\n")
    p = subprocess.run(mpiexec_command(2, [str(script), model_path("smollm2"), str(tmp_path / "missing.gguf")]),
                       env=rank_env(), capture_output=True, text=True, timeout=300)
    assert "missing.gguf" in p.stderr                          # the failing rank's own reason
    err = [ln for ln in p.stdout.splitlines() if ln.startswith("ERR ")]
    assert len(err) == 1 and "did not start: rank 1 (pid" in err[0] and "dead" in err[0], p.stdout + p.stderr[-2000:]
