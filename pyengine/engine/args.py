"""`EngineArgs`: every engine option in one dataclass (vLLM's arg_utils, nano-vllm's `Config`).

    args = EngineArgs(model=path, max_num_seqs=8)        # or EngineArgs.from_cli_args(parsed)
    engine = args.create_engine()                         # validate -> resolve(gguf) -> runner -> executor -> engine

One place for: the options and their defaults (`LLM(**kw)`, every CLI command, the server, disagg, the benches and
the browser worker build engines through it), their checks (`validate`), the defaults that depend on the model
(`resolve`: context length, sampling defaults, KV budget) and the CLI flags (`add_cli_args` / `from_cli_args`, one
spelling on every command). More than one rank (tensor x pipeline parallel) needs an executor from
`pyengine.parallel` (the engine layer never imports it): `pyengine.llm.build_engine` passes one in.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field

from pyengine.engine.kv_cache import KV_DTYPES, PagedKVCache

# Cap of the default num_blocks: SmolLM2's server defaults (64 sequences x 2048 tokens) would need 6 GB of KV.
DEFAULT_KV_BUDGET_BYTES = 512 << 20
WEIGHTS_MODES = ("resident", "lean")
# Limits an engine plans for when not given (the context length: when no model is there to ask); an engine over an
# injected runner takes the runner's own limits (it was sized for them).
DEFAULT_LIMITS = {"max_model_len": 2048, "max_num_seqs": 64, "max_num_batched_tokens": 2048}


def runner_limits(runner) -> dict:
    """The limits a `Runner` (engine/executor.py) was built for, by `DEFAULT_LIMITS`' names (None: it has none)."""
    return {"max_model_len": runner.max_model_len, "max_num_seqs": runner.max_num_seqs,
            "max_num_batched_tokens": runner.max_num_batched_tokens}


def _positive_int(name: str, value, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__") or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if none_ok else ''}, got {value!r}")


def default_max_model_len(gguf, block_size: int = 16, floor: int = 2048) -> int:
    """The model's trained context, when one full-length sequence's KV cache fits the runner's default KV
    budget and a quarter of the memory available now; else the longest halving of it that does (at
    least `floor`, or the context if shorter)."""
    from pyengine.models import load_config

    c = load_config(gguf)                 # the architecture's own reading (e.g. phi3's partial rotary)
    context = int(c.context_length or floor)
    per_token = PagedKVCache.bytes_per_block(c.n_layers, block_size, c.n_kv_heads, c.head_dim) / block_size
    budget = DEFAULT_KV_BUDGET_BYTES
    available = available_memory()
    if available is not None:
        budget = min(budget, available // 4)
    length = context
    while length > floor and length * per_token > budget:
        length //= 2
    return max(min(length, context), min(floor, context))


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux), else None (e.g. in a browser)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class EngineArgs:
    """Every option of an engine. ``None`` on a model-dependent field means "resolve from the model"."""
    model: object = None                     # GGUF path, bytes, GGUFFile, or None for the default model
    max_model_len: int | None = None         # None: the model's context when one sequence's KV fits (resolve)
    block_size: int = 16
    num_blocks: int | None = None            # None: every sequence at full length, within kv_budget_bytes
    kv_budget_bytes: int = DEFAULT_KV_BUDGET_BYTES
    max_num_seqs: int | None = None          # None: 64 (an injected runner's own)
    max_num_batched_tokens: int | None = None  # None: 2048, lean 8 (an injected runner's own)
    max_logits: int | None = None            # logits rows planned per step (default max_num_seqs)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_waiting: int | None = None
    seed: int | None = None
    watermark: float = 0.03
    aging_steps: int = 64
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    parallel_timeout: float | None = None    # seconds a step may wait on another rank (None: 60)
    speculative_config: object = None        # S14: vLLM's dict, or its JSON text
    weights_mode: str = "resident"           # "resident" (float32) or "lean" (quantized, dequantized per matrix)
    kv_cache_dtype: str | None = None        # None: the weights mode's (engine/lean_mode.py: "auto", lean "q8_0")
    target_itl_ms: float | None = None       # S11: None derives the target, 0 turns it off
    enforce_eager: bool = False              # S13: no captured steps
    threads: int | None = None               # BLAS threads (None: engine/threads.py picks; Pyodide: 1)
    # resolved (by `resolve`): the model's trained context and its recommended sampling defaults
    model_context: int | None = field(default=None, repr=False)
    sampling_defaults: dict = field(default_factory=dict, repr=False)

    # --- checks --------------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def validate(self) -> "EngineArgs":
        """ValueError naming the first bad option (before anything loads); returns self."""
        for name in ("block_size", "tensor_parallel_size", "pipeline_parallel_size", "aging_steps", "kv_budget_bytes"):
            _positive_int(name, getattr(self, name))
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_blocks", "max_logits",
                     "threads"):
            _positive_int(name, getattr(self, name), none_ok=True)
        if self.max_waiting is not None and (isinstance(self.max_waiting, bool) or not isinstance(
                self.max_waiting, int) or self.max_waiting < 0):
            raise ValueError(f"max_waiting must be >= 0 or None, got {self.max_waiting}")
        if self.weights_mode not in WEIGHTS_MODES:
            raise ValueError(f"weights mode must be 'resident' or 'lean', got {self.weights_mode!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.target_itl_ms is not None:
            from pyengine.engine.chunk_budget import check_target_itl_ms
            check_target_itl_ms(self.target_itl_ms)
        if self.parallel_timeout is not None and not (isinstance(self.parallel_timeout, (int, float))
                                                      and math.isfinite(self.parallel_timeout)
                                                      and self.parallel_timeout > 0):
            raise ValueError(f"parallel_timeout must be a positive number of seconds, got {self.parallel_timeout!r}")
        if isinstance(self.speculative_config, str):         # the command line's JSON text
            from pyengine.engine.spec_decode import parse_speculative_config
            self.speculative_config = parse_speculative_config(self.speculative_config)
        if self.num_ranks > 1 and self.weights_mode != "resident":
            raise ValueError("a parallel runner takes resident weights (lean ones are not split yet)")
        return self

    # --- model-dependent defaults ------------------------------------------------------------------
    def model_path(self):
        """The model as a path (None / a name resolved to the installed file), or as given (bytes, GGUFFile)."""
        if self.model is None or isinstance(self.model, str):
            from pyengine.model_files import resolve_model
            return resolve_model(self.model)
        return self.model

    def resolve(self, gguf, runner=None) -> "EngineArgs":
        """Fill the defaults that depend on the model (``gguf``: a GGUFFile, or None when an injected ``runner``
        stands for it): the context length (the model's trained context when one full-length sequence's KV
        cache fits the KV budget, as ``pyengine generate`` has done), the model's recommended sampling
        defaults, the batch limits (`DEFAULT_LIMITS`, or an injected runner's own); ValueError if
        ``max_model_len`` exceeds the trained context. Returns self."""
        from pyengine.engine.lean_mode import mode_defaults
        from pyengine.models import load_config
        from pyengine.sampling_params import model_sampling_defaults

        if gguf is None:          # an injected runner has its own KV type and batch: the resident defaults
            self.kv_cache_dtype = self.kv_cache_dtype or "auto"
        else:                     # S21: lean mode's q8_0 KV cache and short batches (engine/lean_mode.py)
            config = load_config(gguf)
            self.kv_cache_dtype, self.max_num_batched_tokens = mode_defaults(
                self.weights_mode, self.kv_cache_dtype, self.max_num_batched_tokens, config.head_dim)
        have = {} if runner is None else runner_limits(runner)
        for name, default in DEFAULT_LIMITS.items():
            if getattr(self, name) is None and (name != "max_model_len" or gguf is None):
                setattr(self, name, have[name] if isinstance(have.get(name), int) else default)
        if gguf is None:
            return self
        self.model_context = int(config.context_length or 0) or None
        if self.max_model_len is None:
            self.max_model_len = default_max_model_len(gguf, self.block_size)
        elif self.model_context and self.max_model_len > self.model_context:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's context length "
                             f"{self.model_context}")
        self.sampling_defaults = model_sampling_defaults(gguf.metadata)
        return self

    def runner_kwargs(self) -> dict:
        """The options a `ModelRunner` (or a rank's part of one) is built with."""
        return dict(max_model_len=self.max_model_len, num_blocks=self.num_blocks, block_size=self.block_size,
                    max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                    weights_mode=self.weights_mode, kv_cache_dtype=self.kv_cache_dtype,
                    kv_budget_bytes=self.kv_budget_bytes, max_logits=self.max_logits,
                    enforce_eager=self.enforce_eager)

    # --- building ---------------------------------------------------------------------------------------
    def load_model(self):
        """validate, then the GGUFFile (read once) and the resolved defaults."""
        from pyengine.gguf.reader import GGUFFile

        self.validate()
        model = self.model_path()
        gguf = model if isinstance(model, GGUFFile) else GGUFFile(model)
        self.resolve(gguf)
        return gguf

    def create_runner(self, gguf=None):
        """This process's whole `ModelRunner` (one rank)."""
        from pyengine.engine.model_runner import ModelRunner

        gguf = self.load_model() if gguf is None else gguf
        return ModelRunner(gguf, **self.runner_kwargs())

    def local_executor(self, runner=None):
        """A `LocalExecutor` over ``runner`` (an injected one: the options that build a runner must stay at their
        defaults), else over a new `ModelRunner` of these options, its BLAS threads set first (one rank only)."""
        from pyengine.engine.executor import LocalExecutor
        from pyengine.engine.threads import apply_threads

        self.validate()
        if runner is not None:
            if self.num_ranks != 1 or self.kv_cache_dtype not in (None, "auto"):
                raise ValueError("tensor_parallel_size, pipeline_parallel_size and kv_cache_dtype build the runner: "
                                 "pass them to the runner you inject")
            self.resolve(None, runner)
            if self.enforce_eager:
                runner.enforce_eager = True
            return LocalExecutor(runner)
        if self.num_ranks > 1:
            from pyengine.model_files import extras_hint
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {self.num_ranks} ranks run over MPI: start this "
                f"program with mpiexec -n {self.num_ranks} ({extras_hint('parallel')}), or use pyengine "
                f"serve, which starts its ranks")
        self.threads = apply_threads(self.threads)
        return LocalExecutor(self.create_runner())

    def attach(self, executor):
        """Check these options and resolve them against ``executor``'s runner (built already); returns it."""
        self.validate().resolve(None, executor.runner)
        return executor

    def check_runner(self, runner) -> None:
        """ValueError if the engine's limits exceed those ``runner`` was built for."""
        for name, have in runner_limits(runner).items():
            want = getattr(self, name)
            if isinstance(have, int) and want > have:
                raise ValueError(f"{name}={want} exceeds the model runner's {name}={have}")

    def create_engine(self, executor=None, *, runner=None, tokenizer=None, draft_runner=None):
        """The `LLMEngine` of these options. ``executor``: one built already (e.g. an `MPIExecutor` from
        `pyengine.parallel`); else a `LocalExecutor` over ``runner`` or over a new `ModelRunner` (one rank only:
        more ranks need the executor `pyengine.llm.build_engine` builds)."""
        from pyengine.engine.llm_engine import LLMEngine

        if executor is None:
            executor = self.local_executor(runner)
        return LLMEngine(self, executor, tokenizer=tokenizer, draft_runner=draft_runner)

    # --- the command line -------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser, groups=("model",)) -> argparse.ArgumentParser:
        """The engine's flags, one spelling on every command. ``groups``: "model" (--model, --max-model-len,
        --kv-cache-dtype, --enforce-eager, --weights, --threads), "speculative", "target_itl", "batching"
        (--max-num-seqs, --max-num-batched-tokens, --no-prefix-cache, --no-chunked-prefill), "parallel"."""
        if "model" in groups:
            p.add_argument("--model", metavar="PATH", default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
            p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                           help="context length (default: the model's, when one sequence's KV cache fits the memory)")
            p.add_argument("--kv-cache-dtype", default=None, choices=KV_DTYPES,
                           help="KV cache storage: auto (float32), fp16, q8_0, q4_0 (S08; default: auto, with "
                                "--weights lean q8_0)")
            p.add_argument("--enforce-eager", action="store_true",
                           help="run every step plain: no captured step replayed (S13, vLLM's option)")
            p.add_argument("--weights", dest="weights_mode", default="resident", choices=WEIGHTS_MODES,
                           help="resident: float32 weights (fastest); lean: quantized, dequantized per matrix "
                                "(S21, less memory)")
            p.add_argument("--threads", type=int, default=None, metavar="N",
                           help="BLAS threads (default: the cores this process may use, 1 when they are busy)")
        if "speculative" in groups:
            p.add_argument("--speculative-config", default=None, metavar="JSON",
                           help='S14 speculative decoding: ngram (prompt lookup, 4 drafts a step), ngram:K, or '
                                'vLLM\'s dict, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                                '{"method": "draft_model", "model": PATH, ...}')
        if "target_itl" in groups:
            p.add_argument("--target-itl-ms", type=float, default=None, metavar="MS",
                           help="S11: size each step's prompt chunks so a step with running decodes is predicted "
                                "to take at most MS ms (cost model fitted to measured steps); default: 2.9 / (1 + "
                                "the measured spread of such steps) x the decodes' own step, 2-2.9x; "
                                "0 = off (chunks fill --max-num-batched-tokens)")
        if "batching" in groups:
            p.add_argument("--max-num-seqs", type=int, default=DEFAULT_LIMITS["max_num_seqs"])
            p.add_argument("--max-num-batched-tokens", type=int, default=None,
                           help=f"tokens one step may run (default {DEFAULT_LIMITS['max_num_batched_tokens']}; "
                                "with --weights lean 8)")
            p.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
            p.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
        if "parallel" in groups:
            p.add_argument("--tensor-parallel-size", type=int, default=1,
                           help="S17: ranks splitting every layer by heads / FFN columns (MPI; one Allreduce per "
                                "sub-layer); S18: with --prefill-instances, the ranks of every instance")
            p.add_argument("--pipeline-parallel-size", type=int, default=1,
                           help="S17: pipeline stages of contiguous layers (MPI; N x M ranks with "
                                "--tensor-parallel-size); M groups of sequences, a step of each in flight, keep the "
                                "stages busy")
            p.add_argument("--parallel-timeout", type=float, default=None,
                           help="seconds a step may wait on another rank before the server declares it stuck "
                                "(default 60)")
        return p

    @classmethod
    def from_cli_args(cls, args, **override) -> "EngineArgs":
        """The options a parsed command line gave (flags a command does not have keep their defaults)."""
        kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if f.init and f.name not in ("model_context", "sampling_defaults") and hasattr(args, f.name)}
        if hasattr(args, "no_prefix_cache"):
            kw["enable_prefix_caching"] = not args.no_prefix_cache
        if hasattr(args, "no_chunked_prefill"):
            kw["enable_chunked_prefill"] = not args.no_chunked_prefill
        kw.update(override)
        return cls(**kw)


def engine_config(config, executor, runner, options: dict):
    """`LLMEngine`'s (config, executor): as given (a resolved `EngineArgs` and its executor), or built from the
    keyword form ``LLMEngine(model, max_model_len=.., ...)`` (any `EngineArgs` field) with an injected ``runner``
    (a local executor over it) or ``executor``."""
    if isinstance(config, EngineArgs):
        if options or runner is not None:
            raise ValueError("LLMEngine(config, executor) takes no other options: set them on the EngineArgs")
        return config, executor
    if "model" in options:                  # LLMEngine(model=path, ...): the keyword form of the first one
        if config is not None:
            raise TypeError("LLMEngine got the model twice (positionally and as model=)")
        config = options.pop("model")
    config = EngineArgs(model=config, **options)
    return config, config.local_executor(runner) if executor is None else config.attach(executor)
