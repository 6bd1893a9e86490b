"""Time a tensor-parallel instance's whole-block KV reads and writes (kv_transfer.KVBlocks over parallel/mpi.py's
kv_gather / kv_scatter) against the same bytes moved in one process, in the same run (docs/disaggregation.md).

    python scripts/time_tp_kv_blocks.py [--kv-dtype auto] [--tp 2] [--reps 20]

re-runs itself under the MPI wheel's mpiexec with --tp ranks; rank 0 prints, per block: the bytes of a whole block,
the bytes its followers send (gather) or receive (scatter), and ms per block of the prefill side packing a
window of 32 blocks (one gather, then a CRC'd message per block) and of the decode side adopting one arriving block
(its check, then the write: rank 0's part; the followers' writes run on their own cores), each next to one
process doing the same with every head (its ratio) and with the gather / scatter alone.
"""
import argparse
import os
import sys
import time
from types import SimpleNamespace

import numpy as np


def best(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    from pyengine.parallel.mpi import launched_under_mpi
    if not launched_under_mpi():
        import subprocess
        from pyengine.parallel.launch import mpiexec_command, rank_env
        sys.exit(subprocess.run(mpiexec_command(a.tp, [os.path.abspath(__file__)] + sys.argv[1:]),
                                env=rank_env()).returncode)
    from pyengine.arena import Arena
    from pyengine.disagg.kv_transfer import KVBlocks, check_block, pack_data
    from pyengine.engine.args import EngineArgs
    from pyengine.engine.executor import LocalExecutor
    from pyengine.engine.kv_cache import PagedKVCache
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.parallel.executor import MPIExecutor
    from pyengine.parallel.mpi import MPIGroup
    eargs = EngineArgs(model=a.model, kv_cache_dtype=a.kv_dtype, max_model_len=1024, num_blocks=80, max_num_seqs=2,
                       max_num_batched_tokens=64)
    gguf = eargs.load_model()
    group = MPIGroup(a.tp, 1)
    runner = ModelRunner(gguf, shard=group, **eargs.runner_kwargs())
    if group.rank != 0:
        group.worker_loop(runner)
        return
    executor = MPIExecutor(runner, group)
    try:
        kv = runner.kv_cache
        tp_blocks = KVBlocks(executor)
        L, nb, bs, _, row = kv.k.shape
        specs = PagedKVCache.arena_specs(L, nb, bs, group.n_kv_heads, kv.head_dim, kv.dtype)
        full = PagedKVCache(Arena.from_specs(specs), L, nb, bs, group.n_kv_heads, kv.head_dim, kv.dtype)
        one = KVBlocks(LocalExecutor(SimpleNamespace(kv_cache=full)))   # one process, every head: the same bytes
        ids32, data1 = list(range(32)), tp_blocks.read([40])
        follower = 2 * sum(int(np.prod(one.shape[:2])) * (group._kv_contrib(r)[1] - group._kv_contrib(r)[0])
                           * row * kv.k.dtype.itemsize for r in range(1, a.tp))
        scattered = 2 * sum(int(np.prod(one.shape[:2])) * (group._kv_heads(r)[1] - group._kv_heads(r)[0])
                            * row * kv.k.dtype.itemsize for r in range(1, a.tp))
        def pack(blocks):                         # the prefill side's window: read 32 blocks, pack each
            for j, (k, v) in enumerate(blocks.views(ids32)):
                pack_data(k, v, 1, j, None)

        msg = pack_data(data1[0, 0], data1[1, 0], 1, 0, None)

        def adopt(blocks):                        # the decode side, per arriving block: check it, write it
            blocks.write([50], check_block(blocks, msg, None)[:, None])

        rows = [("prefill: pack a window of 32 blocks", best(lambda: pack(tp_blocks), a.reps) / 32,
                 best(lambda: pack(one), a.reps) / 32, follower),
                ("  of it, the gather of 32 at once", best(lambda: tp_blocks.read(ids32), a.reps) / 32,
                 best(lambda: one.read(ids32), a.reps) / 32, follower),
                ("decode: adopt 1 block (rank 0)", best(lambda: adopt(tp_blocks), a.reps),
                 best(lambda: adopt(one), a.reps), scattered),
                ("  of it, the scatter", best(lambda: tp_blocks.write([50], data1), a.reps),
                 best(lambda: one.write([50], data1), a.reps), scattered)]
        group._reap(wait=True)
        print(f"{runner.config.n_kv_heads} KV heads over {a.tp} ranks, kv {a.kv_dtype}: a whole block "
              f"{one.nbytes / 1e6:.3f} MB")
        for name, t_tp, t_one, moved in rows:
            print(f"  {name:34s} {t_tp * 1e3:7.3f} ms/block  one process {t_one * 1e3:7.3f} ms/block  "
                  f"ratio {t_tp / t_one:5.2f}x  followers' bytes {moved / 1e6:.3f} MB/block")
    finally:
        executor.close()


if __name__ == "__main__":
    main()
