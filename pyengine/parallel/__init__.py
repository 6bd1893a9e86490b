"""S17: tensor and pipeline parallelism over MPI (mpi4py + an MPI from PyPI wheels: the `parallel` extra).

    layout.py   who computes what: heads / FFN columns / vocabulary per tensor rank, layers per stage (NumPy)
    shard.py    one rank's slice of the weights and its model object (the architecture's own class)
    mpi.py      the runtime: the step plan broadcast by rank 0, micro-batched stages, collectives with deadlines
    launch.py   `pyengine serve --tensor-parallel-size N --pipeline-parallel-size M`: start the ranks via mpiexec

The tensor-parallel layers themselves are `Linear`s in pyengine/layers/parallel_linear.py. CPython only (the
browser has no MPI); nothing here is imported by ``import pyengine``.
"""
