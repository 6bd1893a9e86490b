"""S17: `pyengine bench parallel` — one process, tensor parallelism and pipeline parallelism over MPI, measured
in the same run on the same workload.

Per setup (each its own job: `mpiexec -n N python -m pyengine.bench.parallel --job ...`, or one process):
single-stream greedy decode, the aggregate decode of 32 sequences (median step), a 512-token prefill, the
float32 weights and KV cache each rank holds, and per rank the share of the measured steps it computed (stage
utilisation: with pipeline stages, how much they overlap) and waited on messages (communication per step).
A setup with pipeline stages runs with cross-step pipelining (the
engine keeps a step of each of its M groups of sequences in flight) and, in the same run, in the within-step
mode (one step at a time cut into micro-batches: row "pp2/within"), for comparison (parallel/mpi.py).
Then the latency and bandwidth of the messages those setups send (Allreduce of a decode's / a 32-sequence
step's / a prefill's activations, Send+Recv of the same), over shared memory and over forced TCP. With
``--hf-python PY``: HF transformers' batched generate on the 32 sequences' prompts, as `bench paging` does.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HELP = "S17: decode / prefill / memory / communication for 1 process, TP and PP over MPI"
SETUPS = {"one": (1, 1, None), "tp2": (2, 1, "mpi"), "pp2": (1, 2, "mpi"), "tp2pp2": (2, 2, "mpi")}
MSG_ROWS = (1, 32, 512)              # activations of a decode, of a 32-sequence step, of a 512-token prefill


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--setups", default="one,tp2,pp2", help=f"comma list of {', '.join(SETUPS)}")
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--steps", type=int, default=12, help="decode steps timed per setup")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--hf-python", default=None, help="interpreter with torch + transformers for the HF baseline")
    p.add_argument("--no-transport", action="store_true", help="skip the Allreduce / Send-Recv measurements")
    p.add_argument("--pipeline-modes", default="cross-step,within-step",
                   help="with pipeline stages: cross-step (M groups of sequences in flight) and/or within-step")
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)


# --- inside one setup's job ----------------------------------------------------------------------------
def _job(spec: dict) -> None:
    from pyengine.engine.args import EngineArgs
    from pyengine.engine.executor import LocalExecutor
    from pyengine.engine.model_runner import ModelRunner
    from pyengine.sampling_params import SamplingParams
    tp, pp, backend = spec["tp"], spec["pp"], spec["backend"]
    n, steps = spec["sequences"], spec["steps"]
    eargs = EngineArgs(model=spec["model"], max_model_len=1024, max_num_batched_tokens=max(spec["prefill"], n),
                       max_num_seqs=n, num_blocks=640)
    gguf = eargs.load_model()
    group = None
    if backend == "mpi":
        from pyengine.parallel.executor import MPIExecutor
        from pyengine.parallel.mpi import MPIGroup
        group = MPIGroup(tp, pp, cross_step=spec.get("cross_step", True))
        runner = ModelRunner(gguf, shard=group, **eargs.runner_kwargs())
        if group.rank != 0:
            group.worker_loop(runner)
            return
        executor = MPIExecutor(runner, group)
    else:
        runner = eargs.create_runner(gguf)
        executor = LocalExecutor(runner)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1000, 30000, size=int(rng.integers(8, 48))).tolist() for _ in range(n)]
    out = {}

    def decode(count: int) -> float:
        eng = eargs.create_engine(executor)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(count):
            eng.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params)
        while eng.stats()["running"] < count or any(s.is_prefill for s in eng.scheduler.running):
            eng.step()
        eng.step()
        if group is not None:
            group.stats()                              # reset the counters: only the timed steps count
        # a rate per round of engine steps: one step of each group of sequences (cross-step: pp groups), so
        # that every sequence gets a token per round
        rates, t0, k = [], time.perf_counter(), eng.pipeline_groups
        for _ in range(steps):
            t = time.perf_counter()
            made = sum(len(o.outputs[0].delta_token_ids) for _ in range(k) for o in eng.step())
            rates.append(made / (time.perf_counter() - t))
        wall = time.perf_counter() - t0
        if group is not None:
            out[f"ranks_{count}"] = [dict(s, wall_s=wall) for s in group.stats()]
        for i in range(count):
            eng.abort_request(f"r{i}")
        while eng.has_unfinished_requests():           # a step still in flight comes back
            eng.step()
        return float(np.median(rates))

    out["decode_1"] = decode(1)
    out["decode_n"] = decode(n)
    ids = rng.integers(1000, 30000, size=spec["prefill"])
    times = []
    for _ in range(2):
        t = time.perf_counter()
        executor.run(runner.contiguous_batch(ids, 0))
        times.append(time.perf_counter() - t)
    out["prefill"] = spec["prefill"] / min(times)
    if group is None:
        w = sum(lin.nbytes for _, lin in runner.weights.linears())
        out["held"] = [{"weights_bytes": w, "kv_bytes": runner.kv_cache.k.nbytes * 2}]
    else:
        out["held"] = [{k: s[k] for k in ("weights_bytes", "kv_bytes")} for s in out[f"ranks_{n}"]]
    executor.close()
    print("RESULT " + json.dumps(out), flush=True)


def _transport_job() -> None:
    """Two ranks: Allreduce and Send+Recv latency of the message sizes the setups use."""
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    r = c.Get_rank()
    res = {}
    for rows in MSG_ROWS:
        buf = np.ones((rows, 576), np.float32)
        reps = max(5, 2000 // rows)
        for name in ("allreduce", "sendrecv"):
            c.Barrier()
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                if name == "allreduce":
                    c.Iallreduce(MPI.IN_PLACE, buf).Wait()
                elif r == 0:
                    c.Send(buf, 1, 5)
                    c.Recv(buf, 1, 6)
                else:
                    c.Recv(buf, 0, 5)
                    c.Send(buf, 0, 6)
                times.append((time.perf_counter() - t) / (2 if name == "sendrecv" else 1))
            # the fastest repetitions: the transport's own cost (on a shared host most are descheduled)
            res[f"{name}_{rows}"] = float(np.percentile(times, 10))
    if r == 0:
        print("RESULT " + json.dumps(res), flush=True)


# --- the driver --------------------------------------------------------------------------------------
def _launch(n: int, argv: list[str], tcp: bool = False) -> dict:
    from pyengine.parallel.launch import mpiexec_command, rank_env
    cmd = mpiexec_command(n, argv) if n > 1 or tcp else [sys.executable] + argv
    env = rank_env(tcp) if n > 1 else dict(os.environ)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"bench job failed ({' '.join(cmd[:4])} ...):\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
    return json.loads(line[7:])


def _mb(x: float) -> str:
    return f"{x / 2**20:.0f}"


def run(args) -> int:
    if args.job:
        spec = json.loads(args.job)
        if spec.get("transport"):
            _transport_job()
        else:
            _job(spec)
        return 0
    from pyengine.model_files import resolve_model
    model = os.fspath(resolve_model(args.model))
    names = [s for s in args.setups.split(",") if s]
    for s in names:
        if s not in SETUPS:
            raise SystemExit(f"unknown setup {s!r} (known: {', '.join(SETUPS)})")
    modes = [m for m in args.pipeline_modes.split(",") if m]
    if not modes or set(modes) - {"cross-step", "within-step"}:
        raise SystemExit(f"--pipeline-modes takes cross-step and/or within-step, got {args.pipeline_modes!r}")
    results, rows = {}, []
    for s in names:
        tp, pp, backend = SETUPS[s]
        for mode in modes if pp > 1 else ["cross-step"]:
            row = s if mode == "cross-step" else f"{s}/within"
            spec = dict(model=model, tp=tp, pp=pp, backend=backend, sequences=args.sequences, steps=args.steps,
                        prefill=args.prefill, cross_step=mode == "cross-step")
            argv = ["-m", "pyengine.bench.parallel", "--job", json.dumps(spec)]
            results[row] = _launch(tp * pp if backend == "mpi" else 1, argv)
            rows.append(row)
    n = args.sequences
    base = results.get("one")
    print(f"S17 parallel setups on {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} ({n} sequences, "
          f"{args.steps} decode rounds timed (a step of every sequence), median round; ratios against one process "
          f"in the same run):")
    print(f"  {'setup':10} {'1-stream tok/s':>15} {f'{n}-seq tok/s':>13} {'prefill tok/s':>14}   "
          f"weights / KV MiB per rank       comm ms/step, busy % per rank")
    for s in rows:
        r = results[s]
        rel = (lambda k: f" ({r[k] / base[k]:.2f}x)" if base and s != "one" else "")
        held = ", ".join(f"{_mb(h['weights_bytes'])}/{_mb(h['kv_bytes'])}" for h in r["held"])
        ranks = r.get(f"ranks_{n}")
        comm = ", ".join(f"{1e3 * q['comm_s'] / max(q['steps'], 1):.1f}/{100 * q['busy_s'] / q['wall_s']:.0f}%"
                         for q in ranks) if ranks else "-"
        print(f"  {s:10} {r['decode_1']:8.1f}{rel('decode_1'):>7} {r['decode_n']:7.1f}{rel('decode_n'):>7} "
              f"{r['prefill']:7.0f}{rel('prefill'):>7}   {held:30}  {comm}")
    if args.hf_python:
        from types import SimpleNamespace

        from pyengine.bench.paging import _hf_batched_rate
        rng = np.random.default_rng(0)
        prompts = [rng.integers(1000, 30000, size=int(rng.integers(8, 48))).tolist() for _ in range(n)]
        hf = _hf_batched_rate(SimpleNamespace(model=model, hf_python=args.hf_python), prompts, args.steps)
        for s in rows:
            print(f"  {s} / HF transformers batched generate ({hf['threads']} threads), {n}-sequence decode: "
                  f"{results[s]['decode_n'] / hf['decode_tok_s']:.2f}x ({hf['decode_tok_s']:.1f} tok/s)")
    if not args.no_transport:
        argv = ["-m", "pyengine.bench.parallel", "--job", json.dumps({"transport": True})]
        print("  message latency, 10th percentile of the repetitions (2 ranks; float32 rows of 576): " + "; ".join(
            f"{rows} row{'s' if rows > 1 else ''} ({rows * 576 * 4 / 1024:.1f} KiB)" for rows in MSG_ROWS))
        for label, tcp in (("shared memory", False), ("TCP (btl=tcp,self)", True)):
            t = _launch(2, argv, tcp=tcp)
            cells = []
            for name in ("allreduce", "sendrecv"):
                cells.append(name + " " + ", ".join(
                    f"{1e6 * t[f'{name}_{rows}']:.0f} us ({rows * 576 * 4 / t[f'{name}_{rows}'] / 1e9:.2f} GB/s)"
                    for rows in MSG_ROWS))
            print(f"    {label:20} " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(run(p.parse_args()))
