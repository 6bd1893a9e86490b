"""S01 `LLM`: the offline, vLLM-style front door to the engine.

    llm = LLM()                                     # default model (SmolLM2-135M-Instruct)
    outs = llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(temperature=0))
    reply = llm.chat([{"role": "user", "content": "Hi!"}])[0].outputs[0].text
    for piece in (s := llm.stream("Once upon a time")): print(piece, end="")
    s.output                                        # the final RequestOutput

All prompts of one `generate` call go into the engine together, so they share every forward pass
(continuous batching). Requests are validated and queued all-or-nothing before the first step: a
bad prompt or parameter raises ValueError without any model work.
"""
from __future__ import annotations

import itertools
import numbers
import sys
import time
from collections import deque

from pyengine.sampling_params import SamplingParams


def build_engine(engine_args, *, comm=None, runner=None, tokenizer=None, draft_runner=None):
    """The `LLMEngine` of ``engine_args`` (an `EngineArgs`), the one path every front end takes (LLM, the CLI
    commands, the server, disagg, the benches). One rank: a local executor. More (tensor x pipeline parallel) inside
    an MPI job (``mpiexec -n N*M``, or ``comm``: a disaggregated instance's ranks): an `MPIExecutor` from
    pyengine.parallel; rank 0 gets the engine, the other ranks compute in here until rank 0 is done, then exit.
    ``runner`` (extension) injects a runner of one rank."""
    engine_args.validate()
    executor = None
    if runner is None and engine_args.num_ranks > 1:
        from pyengine.parallel.mpi import launched_under_mpi    # lazy: mpi4py only when asked for
        if comm is not None or launched_under_mpi():
            from pyengine.parallel.launch import mpi_executor
            executor = mpi_executor(engine_args, comm=comm)
    return engine_args.create_engine(executor, runner=runner, tokenizer=tokenizer, draft_runner=draft_runner)


class LLM:
    def __init__(self, model=None, *, runner=None, tokenizer=None, draft_runner=None, **engine_kwargs):
        """``model``: None (default model), a GGUF path, or the file's bytes. Other keyword arguments are
        `EngineArgs` fields (max_model_len, block_size, num_blocks, max_num_seqs, seed, threads, weights_mode, ...),
        among them S14's ``speculative_config={"method": "ngram", "num_speculative_tokens": 4}`` (or "draft_model"
        + "model"). ``max_model_len`` defaults to the model's trained context when one full-length sequence's KV
        cache fits (as ``pyengine generate``). ``runner=`` (extension) injects a model runner."""
        from pyengine.engine.args import EngineArgs   # lazy: `import pyengine` stays light

        self.engine_args = EngineArgs(model=model, **engine_kwargs)
        self._start(build_engine(self.engine_args, runner=runner, tokenizer=tokenizer, draft_runner=draft_runner))

    @classmethod
    def from_engine_args(cls, engine_args, executor=None) -> "LLM":
        """An `LLM` over the engine of ``engine_args`` (and of ``executor``, when one is built already)."""
        llm = cls.__new__(cls)
        llm.engine_args = engine_args
        llm._start(build_engine(engine_args) if executor is None else engine_args.create_engine(executor))
        return llm

    def _start(self, engine) -> None:
        self.llm_engine = engine
        self._ids = itertools.count()
        # Outputs of each request this object is waiting for. Several consumers (a stream left open
        # while generate() runs) step the same engine, so every step's outputs are routed by id.
        self._inbox: dict[str, deque] = {}

    # --- public API -------------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling_params uses: the model's GGUF recommendations
        (`general.sampling.*`) over vLLM's defaults, with max_tokens 16 as in vLLM."""
        from pyengine.sampling_params import model_sampling_defaults
        if self.engine_args.sampling_defaults:
            return SamplingParams(**self.engine_args.sampling_defaults)
        gguf = self.llm_engine.runner.gguf       # an injected runner: ask its file (None: it has none)
        return SamplingParams(**model_sampling_defaults(gguf.metadata if gguf is not None else None))

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False, priority=None) -> list:
        """Complete each prompt; returns the final `RequestOutput`s in input order.

        A prompt is a str, ``{"prompt_token_ids": [...]}`` (optionally with "prompt" text), or a
        list of those; ``sampling_params`` is one `SamplingParams` for all, or a list (one each).
        ``priority`` (vLLM's): one int per prompt (or one for all); lower is scheduled earlier.
        """
        prompts = self._prompt_list(prompts)
        ids = self._add_all(prompts, self._params_list(sampling_params, len(prompts)),
                            self._priorities(priority, len(prompts)))
        return self._run_to_completion(ids, use_tqdm)

    def chat(self, messages, sampling_params=None, add_generation_prompt: bool = True,
             use_tqdm: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list:
        """Reply to one conversation (a list of {"role", "content"} dicts) or to a list of them,
        formatted with the model's chat template. Returns one `RequestOutput` per conversation.
        `tools` (JSON tool definitions) and `chat_template_kwargs` (e.g. {"enable_thinking": False}) go to
        templates that take them (Qwen2.5, Qwen3), as in vLLM's LLM.chat; a template without tools refuses them."""
        convs = self._conversations(messages)
        extra = self._template_kwargs(tools, chat_template_kwargs)
        from pyengine.engine.input_processor import ChatEncoder    # lazy: `import pyengine` stays light
        tok = self.get_tokenizer()
        if isinstance(tok, ChatEncoder):     # message text stays plain text: control-token strings in it are
            prompts = []                     # characters, so no message can open a forged turn
            for c in convs:
                text, ids = tok.encode_chat(c, add_generation_prompt=add_generation_prompt, **extra)
                prompts.append({"prompt": text, "prompt_token_ids": ids})
        else:
            prompts = [self.chat_prompt(c, add_generation_prompt, tools, chat_template_kwargs) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> str:
        """The conversation rendered by the tokenizer's chat template (text, special tokens inline)."""
        if len(self._conversations(conversation)) != 1:
            raise ValueError("chat_prompt takes one conversation (a list of message dicts)")
        return self.get_tokenizer().apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=False,
            **self._template_kwargs(tools, chat_template_kwargs))

    @staticmethod
    def _template_kwargs(tools, chat_template_kwargs) -> dict:
        extra = dict(chat_template_kwargs or {})
        if not isinstance(chat_template_kwargs or {}, dict) or not all(
                isinstance(k, str) and k.isidentifier() for k in extra):
            raise ValueError("chat_template_kwargs must be a dict of template variable names to values")
        for reserved in ("messages", "add_generation_prompt", "tools", "chat_template", "tokenize"):
            if reserved in extra:
                raise ValueError(f"chat_template_kwargs may not set {reserved!r}")
        if tools is not None:
            extra["tools"] = tools
        return extra

    def embed(self, prompts, pooling_params=None, use_tqdm: bool = False) -> list:
        """S19: each prompt's pooled final hidden state (engine/pooling.py: a decoder LM's state, "last" token by
        default or "mean", L2-normalized unless ``PoolingParams(normalize=False)``), computed by the engine as a
        prefill-only request. Prompts as for `generate`; returns `EmbeddingRequestOutput`s in input order
        (``.outputs.embedding``: a list of floats)."""
        from pyengine.engine.pooling import EmbeddingRequestOutput, PoolingParams
        params = PoolingParams() if pooling_params is None else pooling_params
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        prompts = self._prompt_list(prompts)
        outs = self._run_to_completion(self._add_all(prompts, [params] * len(prompts)), use_tqdm)
        return [EmbeddingRequestOutput.from_request_output(o) for o in outs]

    def stream(self, prompt, sampling_params=None) -> "TextStream":
        """Start one request and return a `TextStream`: iterate it for text deltas as they are
        decided; afterwards ``.output`` is the final `RequestOutput`. ``close()`` aborts it early."""
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise ValueError(f"stream() yields one completion; got n={params.n} (use generate for n > 1)")
        (rid,) = self._add_all(self._single(prompt), [params])
        return TextStream(self, rid)

    # --- input checking ---------------------------------------------------------------------------
    @staticmethod
    def _check_prompt(p):
        if isinstance(p, str):
            return p
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                ids = p["prompt_token_ids"]
                if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                    raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
                ids = list(ids)
                bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
                if bad:
                    raise ValueError(f"prompt_token_ids must contain ints, got {bad[0]!r}")
                if not ids:
                    raise ValueError("prompt_token_ids is empty")
                out = {"prompt_token_ids": [int(t) for t in ids]}
                if isinstance(p.get("prompt"), str):
                    out["prompt"] = p["prompt"]
                return out
            if isinstance(p.get("prompt"), str):
                return p["prompt"]
            raise ValueError("a dict prompt needs 'prompt_token_ids' (list of ints) or 'prompt' (str)")
        raise ValueError(f"a prompt must be a str or {{'prompt_token_ids': [...]}}, got {type(p).__name__}")

    def _prompt_list(self, prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [self._check_prompt(prompts)]
        if isinstance(prompts, (list, tuple)):
            if not prompts:
                raise ValueError("prompts is empty")
            if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
                raise ValueError("a list of ints is ambiguous as prompts: pass {'prompt_token_ids': [...]}")
            return [self._check_prompt(p) for p in prompts]
        raise ValueError(f"prompts must be a str, a dict or a list of them, got {type(prompts).__name__}")

    def _single(self, prompt) -> list:
        items = self._prompt_list(prompt)
        if len(items) != 1:
            raise ValueError(f"stream() takes one prompt, got {len(items)}")
        return items

    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != n:
                raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
            for p in sampling_params:
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
            return list(sampling_params)
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, "
                         f"got {type(sampling_params).__name__}")

    @staticmethod
    def _priorities(priority, n: int) -> list[int]:
        if priority is None:
            return [0] * n
        values = [priority] * n if not isinstance(priority, (list, tuple)) else list(priority)
        if len(values) != n:
            raise ValueError(f"got {len(values)} priorities for {n} prompts")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"priority must be an int (or a list of ints), got {v!r}")
        return [int(v) for v in values]

    @staticmethod
    def _conversations(messages) -> list[list[dict]]:
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of such lists)")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        for conv in convs:
            if not isinstance(conv, (list, tuple)) or not conv:
                raise ValueError("each conversation must be a non-empty list of messages")
            for m in conv:
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise ValueError(f"each message needs string 'role' and 'content', got {m!r}")
        return [list(c) for c in convs]

    # --- driving the engine -----------------------------------------------------------------------
    def _add_all(self, prompts: list, params: list[SamplingParams], priorities: list[int] | None = None) -> list[str]:
        """Queue every request or none: the engine validates each one in add_request (prompt length
        vs max_model_len, token ids vs vocab, params vs vocab); on the first error the ones already
        queued are withdrawn before any step ran."""
        engine = self.llm_engine
        added: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = f"llm-{next(self._ids)}"
                engine.add_request(rid, prompt, p, priorities[i] if priorities else 0)
                added.append(rid)
                self._inbox[rid] = deque()
        except BaseException:
            self._abort(added)
            raise
        return added

    def _abort(self, request_ids) -> None:
        for rid in request_ids:
            self._inbox.pop(rid, None)
            self.llm_engine.abort_request(rid)

    def _step(self) -> None:
        for out in self.llm_engine.step():
            box = self._inbox.get(out.request_id)
            if box is not None:
                box.append(out)

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list:
        final: dict[str, object] = {}
        progress = _Progress(len(request_ids)) if use_tqdm else None
        try:
            while len(final) < len(request_ids):
                if not self.llm_engine.has_unfinished_requests():
                    missing = [r for r in request_ids if r not in final]
                    raise RuntimeError(f"engine has no unfinished requests but {missing} did not finish")
                self._step()
                for rid in request_ids:
                    box = self._inbox.get(rid)
                    while box:
                        out = box.popleft()
                        if out.finished:
                            final[rid] = out
                            del self._inbox[rid]
                            if progress:
                                progress.update(out)
                            break
        except BaseException:          # Ctrl-C or an engine error: leave the engine clean
            self._abort([r for r in request_ids if r not in final])
            raise
        finally:
            if progress:
                progress.close()
        return [final[r] for r in request_ids]


class TextStream:
    """Iterator of text deltas of one request (see `LLM.stream`).

    ``output`` holds the latest `RequestOutput` (the final one once iteration ends); ``close()``
    aborts the request if it is still running (use it, or ``with``, on Ctrl-C).
    """

    def __init__(self, llm: LLM, request_id: str):
        self._llm = llm
        self.request_id = request_id
        self.output = None
        self.done = False

    def __iter__(self):
        return self

    def __next__(self) -> str:
        box = self._llm._inbox.get(self.request_id)
        while True:
            while box:
                self.output = box.popleft()
                if self.output.finished:
                    self.done = True
                    self._llm._inbox.pop(self.request_id, None)
                delta = self.output.outputs[0].delta_text
                if delta:
                    return delta
            if self.done:
                raise StopIteration
            if not self._llm.llm_engine.has_unfinished_requests():
                raise RuntimeError(f"request {self.request_id} vanished from the engine before finishing")
            try:
                self._llm._step()
            except BaseException:      # Ctrl-C or an engine error: withdraw the request
                self.close()
                raise

    def close(self) -> None:
        if not self.done:
            self.done = True
            self._llm._inbox.pop(self.request_id, None)
            out = self._llm.llm_engine.abort_request(self.request_id)
            if out is not None:
                self.output = out

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Progress:
    """A one-line progress counter on stderr (no tqdm dependency)."""

    def __init__(self, total: int):
        self.total, self.done, self.tokens, self.start = total, 0, 0, time.monotonic()
        self._draw()

    def update(self, out) -> None:
        self.done += 1
        self.tokens += sum(len(c.token_ids) for c in out.outputs)
        self._draw()

    def _draw(self) -> None:
        dt = max(time.monotonic() - self.start, 1e-9)
        sys.stderr.write(f"\rProcessed prompts: {self.done}/{self.total}  "
                         f"({self.tokens} tokens, {self.tokens / dt:.1f} tok/s)")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()
