"""`pyengine bench replay`: S13's claim in numbers — a captured step cuts the host's share of a decode step.

Two measurements, each plain (``enforce_eager``) and replayed in the same run, interleaved block by block on one
runner (the captured steps stay in its cache between blocks; a block that crosses a block boundary captures
its new bucket, so the figures include the captures):
  tiny    random llama GGUFs of d=64 (4 heads, Q8_0, written here with the `gguf` package) whose arithmetic
          is negligible: the time per decode step is the host's overhead. At 4 layers the per-step work
          (validating the batch, binding its data) weighs most; at 30 (SmolLM2's depth) the per-layer calls
          do. Target: >= 2x less.
  real    the default model (SmolLM2-135M): the share of a decode step spent outside NumPy's kernels. Method:
          K = the time of running the captured step's bound calls alone (``CapturedStep.replay`` on the same
          data: NumPy kernels plus one ``partial`` dispatch each, so an upper bound on kernel time); a step
          taking t then spends (t - K) / t outside the kernels, for t = the plain step and t = the replayed
          step (validation, plan, binding included).
Both at one sequence and at a batch of 8 (8 decodes in one step). Times are CPU time of this process
(time.process_time), steadier than wall-clock on a shared host.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

HELP = "S13: decode step time plain vs captured-and-replayed (tiny d=64 model), host share (default model)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=40, help="decode steps per timed block")
    p.add_argument("--blocks", type=int, default=6, help="timed blocks per mode, interleaved")
    p.add_argument("--model", default=None, help="the real model (default: SmolLM2-135M)")
    p.add_argument("--skip-real", action="store_true", help="only the tiny model")
    p.add_argument("--layers", type=int, nargs="+", default=[4, 30], help="depths of the tiny model")
    p.add_argument("--quick", action="store_true", help="few steps (smoke test)")


def write_tiny(path: str, seed: int = 0, d: int = 64, layers: int = 4, vocab: int = 512, heads: int = 4) -> str:
    """A random llama GGUF of width ``d`` and ``heads`` query heads (half as many KV heads; Q8_0 matrices, like a
    real file)."""
    import gguf   # dev dependency: the benchmark writes its model

    rng = np.random.default_rng(seed)
    H, Hkv, F = heads, max(1, heads // 2), 4 * d
    w = gguf.GGUFWriter(path, "llama")
    for key, v in (("block_count", layers), ("embedding_length", d), ("attention.head_count", H),
                   ("attention.head_count_kv", Hkv), ("feed_forward_length", F), ("context_length", 2048)):
        w.add_uint32(f"llama.{key}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_token_list([f"t{i}" for i in range(vocab)])

    def mat(name, shape):
        x = (rng.standard_normal(shape) * shape[1] ** -0.5).astype(np.float32)
        q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    mat("token_embd.weight", (vocab, d))
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + n + ".weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
        mat(p + "attn_q.weight", (H * d // H, d))
        mat(p + "attn_k.weight", (Hkv * d // H, d))
        mat(p + "attn_v.weight", (Hkv * d // H, d))
        mat(p + "attn_output.weight", (d, d))
        mat(p + "ffn_gate.weight", (F, d))
        mat(p + "ffn_up.weight", (F, d))
        mat(p + "ffn_down.weight", (d, F))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class _Decoder:
    """``n`` sequences decoding in one runner, each in its own consecutive blocks (as the allocator gives)."""

    def __init__(self, runner, n: int, prompt: int = 40):
        from pyengine.engine.forward_batch import ForwardBatch
        self.ForwardBatch, self.runner, self.n = ForwardBatch, runner, n
        self.span = -(-runner.max_model_len // runner.block_size)
        self.lens = [0] * n
        for s in range(n):          # prompts, plain (long queries are never captured)
            ids = np.arange(1, prompt + 1) % runner.config.vocab_size
            self._run([(s, ids)])
        self.tables = [np.arange(s * self.span, (s + 1) * self.span, dtype=np.int32) for s in range(n)]

    def _run(self, work):
        ids = np.concatenate([t for _, t in work]).astype(np.int64)
        pos, ql, cl, tables, last = [], [], [], [], []
        for s, t in work:
            pos.append(np.arange(self.lens[s], self.lens[s] + len(t)))
            self.lens[s] += len(t)
            ql.append(len(t))
            cl.append(self.lens[s])
            tables.append(np.arange(s * self.span, (s + 1) * self.span, dtype=np.int32))
            last.append(sum(ql) - 1)
        batch = self.ForwardBatch(token_ids=ids, positions=np.concatenate(pos), query_lens=ql, context_lens=cl,
                                  block_tables=tables, logits_indices=np.array(last))
        return self.runner.run(batch)

    def steps(self, k: int) -> float:
        """CPU seconds for k decode steps of all n sequences (CPU time: the steadier figure on a shared host)."""
        t0 = time.process_time()
        for _ in range(k):
            self._run([(s, np.array([7 + s])) for s in range(self.n)])
        return time.process_time() - t0


def _interleaved(runner, n: int, steps: int, blocks: int):
    """(plain, replayed seconds per step, the StepGraphs, the decoder) for n sequences, the two modes
    alternating block by block."""
    from pyengine.engine.graph_replay import StepGraphs
    dec, graphs = _Decoder(runner, n), StepGraphs()
    runner.graphs = graphs
    dec.steps(3)                                     # capture the first bucket
    plain = replay = 0.0
    for _ in range(blocks):
        runner.graphs = None
        plain += dec.steps(steps)
        runner.graphs = graphs
        replay += dec.steps(steps)
    total = blocks * steps
    return plain / total, replay / total, graphs, dec


def _kernels_only(graphs, dec, reps: int) -> float:
    """Seconds per run of the most recent captured step's bound calls alone."""
    step = next(reversed(graphs.steps.values()))
    step.replay()
    t0 = time.process_time()
    for _ in range(reps):
        step.replay()
    return (time.process_time() - t0) / reps


def run(args) -> int:
    from pyengine.engine.model_runner import ModelRunner
    steps, blocks = (8, 2) if args.quick else (args.steps, args.blocks)
    print("S13 captured step: plain (enforce_eager) vs replayed, interleaved blocks of "
          f"{steps} decode steps x {blocks}; OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', '-')}")
    for layers in args.layers[:1] if args.quick else args.layers:
        with tempfile.TemporaryDirectory() as tmp:
            runner = ModelRunner(write_tiny(os.path.join(tmp, "tiny.gguf"), layers=layers), max_model_len=1024,
                                 max_num_seqs=8)
            print(f"\ntiny model (d=64, {layers} layers): time per decode step")
            for n in (1, 8):
                plain, replay, g, _ = _interleaved(runner, n, steps, blocks)
                print(f"  {n} seq: plain {plain * 1e6:7.0f} us  replayed {replay * 1e6:7.0f} us  -> "
                      f"{plain / replay:.2f}x less  ({g.captures} captures, {g.replays} replays, {g.unplanned} "
                      "of them without planning the step)")
    if args.skip_real:
        return 0
    from pyengine.model_files import resolve_model
    runner = ModelRunner(resolve_model(args.model), max_model_len=512, max_num_seqs=8)
    print(f"\nreal model ({runner.config.arch}, d={runner.config.d_model}, {runner.config.n_layers} layers): "
          "share of a decode step outside NumPy kernels")
    for n in (1, 8):
        plain, replay, graphs, dec = _interleaved(runner, n, max(4, steps // 4), blocks)
        k = _kernels_only(graphs, dec, max(4, steps // 4))
        print(f"  {n} seq: plain {plain * 1e3:6.2f} ms ({max(0.0, plain - k) / plain:5.1%} outside)  "
              f"replayed {replay * 1e3:6.2f} ms ({max(0.0, replay - k) / replay:5.1%} outside)  "
              f"kernels-only {k * 1e3:6.2f} ms;  step {plain / replay:.2f}x faster")
    return 0
