"""Run under mpiexec by tests/test_disagg_tp.py: a tensor-parallel runner's whole KV blocks (kv_transfer.KVBlocks
over parallel/mpi.py's kv_gather / kv_scatter). Rank 0 prefills a prompt into blocks TABLE, gathers them (every
rank's KV heads), scatters that copy into blocks MOVED (each rank its heads, replicas included) and runs the same
decode step on both tables, then saves the gathered blocks and both logits for the test to compare with one
process.

    mpiexec -n 2 python tests/mpi_kv_check.py --model M --tp 2 --kv-dtype q8_0 --out DIR
"""
import argparse
import os

import numpy as np

TABLE, MOVED = [5, 9, 2], [11, 12, 13]
PROMPT_LEN, NEXT = 40, 7                  # 2 full blocks of 16 and a partial one; the decode step's token
RUNNER_KW = dict(max_model_len=128, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=64)


def prompt(vocab: int) -> np.ndarray:
    return np.random.default_rng(19).integers(3, vocab, PROMPT_LEN)


def prefill_and_decode(runner, table: list[int], ids: np.ndarray, decode_table: list[int] | None = None):
    """Prefill ``ids`` into ``table``; returns the logits of one decode step over ``decode_table`` (default
    ``table``)."""
    from pyengine.engine.forward_batch import ForwardBatch
    n = len(ids)
    if table is not None:
        runner.run(ForwardBatch(ids, np.arange(n), [n], [n], [np.array(table, np.int32)], np.array([n - 1])))
    t = np.array(decode_table or table, np.int32)
    return runner.run(ForwardBatch(np.array([NEXT]), np.array([n]), [1], [n + 1], [t], np.array([0]))).copy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from pyengine.disagg.kv_transfer import KVBlocks
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.parallel.executor import MPIExecutor
    from pyengine.parallel.mpi import MPIGroup

    group = MPIGroup(a.tp, 1)
    runner = ModelRunner(a.model, shard=group, kv_cache_dtype=a.kv_dtype, **RUNNER_KW)
    if group.rank != 0:
        group.worker_loop(runner)
        return
    ex = MPIExecutor(runner, group)           # rank 0 drives every rank's runner
    try:
        blocks = KVBlocks(ex)
        ids = prompt(runner.config.vocab_size)
        logits_a = prefill_and_decode(ex, TABLE, ids)
        gathered = blocks.read(TABLE)
        blocks.write(MOVED, gathered)
        logits_b = prefill_and_decode(ex, None, ids, MOVED)
        np.savez(os.path.join(a.out, "kv.npz"), gathered=gathered, logits_a=logits_a, logits_b=logits_b,
                 heads=np.array([p.kv_heads[0] for p in group.parts]))
    finally:
        ex.close()


if __name__ == "__main__":
    main()
