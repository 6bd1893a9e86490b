"""S21: the prompt cache — a prompt's KV blocks saved to a file and reused by a later run (picoLM's ``--cache``,
llama-server's slot save / restore).

A file holds the K and V of a prompt's *full* blocks (every layer, as the cache stores them: float32, fp16 or
quantized rows), the token ids they were computed from, and what makes them valid: the model's identity, the KV
type and the block geometry. Restoring puts the blocks of the longest prefix the new prompt shares with the
file into the engine's prefix cache (engine/block_manager.py): the scheduler then finds them like any cached
prefix and computes only the rest. Layout::

    b"PYEPCACHE1\\n" | u32 header bytes | header (JSON) | K/V data | sha256 of all before it (32 bytes)

Refused, with the reason, never silently used: a file that is not one, cut short or altered (checksum), one
written for another model (``model_fingerprint``: metadata, tensor layout and samples of every tensor's bytes),
another KV type or another block geometry.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import weakref

import numpy as np

from pyengine.engine.block_manager import hash_block

MAGIC = b"PYEPCACHE1\n"
_SAMPLE = 4096      # bytes of each tensor's start and end in the fingerprint


class PromptCacheError(ValueError):
    """A prompt cache file that cannot be used here; the message says why."""


def model_fingerprint(gguf) -> str:
    """A name for the model's weights: its metadata scalars, every tensor's name, shape, type and offset, and the
    first and last 4 KiB of every tensor (two different trainings of one shape differ there; hashing whole
    tensors would read the whole file at every start)."""
    h = hashlib.sha256()
    for key in sorted(gguf.metadata):
        v = gguf.metadata[key]
        if isinstance(v, (str, int, float, bool)):
            h.update(f"{key}={v!r}\n".encode())
    for name in sorted(gguf.tensors):
        t = gguf.tensors[name]
        h.update(f"{name}:{t.shape}:{t.ggml_type}:{t.offset}\n".encode())
        data = t.data.reshape(-1)
        h.update(np.ascontiguousarray(data[:_SAMPLE]).tobytes())
        h.update(np.ascontiguousarray(data[-_SAMPLE:]).tobytes())
    return h.hexdigest()


def _target(engine):
    """(runner, kv cache, block manager) of an engine with a local KV cache."""
    from pyengine.engine.executor import KVRunner, LocalExecutor
    runner = engine.runner
    if not isinstance(engine.executor, LocalExecutor) or runner.gguf is None or not isinstance(runner, KVRunner):
        raise PromptCacheError("the prompt cache needs an engine with a local model runner (not a parallel one)")
    return runner, runner.kv_cache, engine.block_manager


def _geometry(runner, kv) -> dict:
    L, _, bs, h, row = kv.k.shape
    return {"layers": int(L), "block_size": int(bs), "kv_heads": int(h), "row": int(row), "dtype": kv.k.dtype.str}


def _chain(token_ids, bs: int, n: int) -> list[bytes]:
    hashes, h = [], None
    for i in range(n):
        h = hash_block(h, token_ids[i * bs:(i + 1) * bs])
        hashes.append(h)
    return hashes


_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # GGUFFile -> model_fingerprint


def _fingerprint(runner) -> str:
    fp = _FINGERPRINTS.get(runner.gguf)
    if fp is None:
        fp = _FINGERPRINTS[runner.gguf] = model_fingerprint(runner.gguf)
    return fp


def save(engine, token_ids, path) -> int:
    """Write the cached KV blocks of ``token_ids``'s leading full blocks (as far as the engine's prefix cache
    holds them, e.g. right after the prompt ran) to ``path`` (replaced atomically); returns the tokens saved."""
    runner, kv, bm = _target(engine)
    ids = [int(t) for t in token_ids]
    bs = bm.block_size
    blocks = []
    for h in _chain(ids, bs, len(ids) // bs):
        b = bm.cached.get(h)
        if b is None:
            break
        blocks.append(b)
    ids = ids[:len(blocks) * bs]
    data = kv.block_data(len(blocks))
    for j, b in enumerate(blocks):
        data[0, j], data[1, j] = kv.k[:, b], kv.v[:, b]
    header = json.dumps({"model": _fingerprint(runner), "model_name": runner.gguf.get("general.name"),
                         "kv_cache_dtype": runner.kv_cache_dtype, **_geometry(runner, kv),
                         "n_blocks": len(blocks), "token_ids": ids}).encode()
    h = hashlib.sha256()
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        for part in (MAGIC, struct.pack("<I", len(header)), header, data.tobytes()):
            h.update(part)
            f.write(part)
        f.write(h.digest())
    os.replace(tmp, path)
    return len(ids)


def read(path) -> tuple[dict, bytes]:
    """(header, K/V bytes) of a prompt cache file, or PromptCacheError saying why it is not usable as one."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise PromptCacheError(f"cannot read prompt cache {path}: {exc.strerror or exc}") from None
    if not raw.startswith(MAGIC):
        raise PromptCacheError(f"{path} is not a pyengine prompt cache (no {MAGIC[:-1].decode()} header)")
    if len(raw) < len(MAGIC) + 4 + 32 or hashlib.sha256(raw[:-32]).digest() != raw[-32:]:
        raise PromptCacheError(f"prompt cache {path} is corrupt (checksum mismatch: cut short or altered)")
    n = struct.unpack_from("<I", raw, len(MAGIC))[0]
    start = len(MAGIC) + 4
    try:
        header = json.loads(raw[start:start + n])
    except ValueError:
        raise PromptCacheError(f"prompt cache {path} is corrupt (unreadable header)") from None
    return header, raw[start + n:-32]


def check(header: dict, engine, path="prompt cache") -> None:
    """PromptCacheError unless the file's blocks fit this engine: same model, KV type and block geometry."""
    runner, kv, _ = _target(engine)
    if header.get("model") != _fingerprint(runner):
        raise PromptCacheError(f"{path} was written for another model ({header.get('model_name')!r}, fingerprint "
                               f"{str(header.get('model'))[:12]}), not this one ({runner.gguf.get('general.name')!r})")
    if header.get("kv_cache_dtype") != runner.kv_cache_dtype:
        raise PromptCacheError(f"{path} holds a {header.get('kv_cache_dtype')} KV cache; this engine's KV cache is "
                               f"{runner.kv_cache_dtype} (--kv-cache-dtype)")
    want = _geometry(runner, kv)
    have = {k: header.get(k) for k in want}
    if have != want:
        raise PromptCacheError(f"{path} has blocks of another geometry ({have}; this engine: {want})")


def restore(engine, path, token_ids=None) -> int:
    """Put the file's blocks into the engine's prefix cache: those of the longest prefix shared with
    ``token_ids`` (all of them when None). Returns the tokens now cached; PromptCacheError (nothing changed)
    for a file that does not fit."""
    header, data = read(path)
    check(header, engine, path)
    runner, kv, bm = _target(engine)
    ids = header["token_ids"]
    bs, n_blocks = bm.block_size, int(header["n_blocks"])
    shape = kv.block_data(0).shape
    try:
        arr = np.frombuffer(data, kv.k.dtype).reshape(2, n_blocks, *shape[2:])
    except ValueError:
        raise PromptCacheError(f"prompt cache {path} is corrupt (its data does not match its header)") from None
    if len(ids) != n_blocks * bs:
        raise PromptCacheError(f"prompt cache {path} is corrupt ({len(ids)} token ids for {n_blocks} blocks)")
    n = n_blocks
    if token_ids is not None:
        want = [int(t) for t in token_ids]
        same = 0
        while same < min(len(want), len(ids)) and want[same] == ids[same]:
            same += 1
        n = min(n, same // bs)
    for i, h in enumerate(_chain(ids, bs, n)):
        if h in bm.cached:
            continue
        b = bm.adopt_block(h, ids[i * bs:(i + 1) * bs])
        if b is None:                      # no free block left: the rest stays uncached
            return i * bs
        kv.write_blocks([b], arr[:, i:i + 1])
    return n * bs


def erase(path) -> bool:
    """Delete a prompt cache file (after checking it is one); False when there was none."""
    if not os.path.exists(path):
        return False
    read(path)
    os.remove(path)
    return True


# --- the command line's --prompt-cache FILE (generate, chat) ----------------------------------------------------
def add_argument(p) -> None:
    p.add_argument("--prompt-cache", metavar="FILE", default=None,
                   help="S21: reuse the longest prefix of the prompt whose KV blocks FILE holds (if it exists), "
                        "then save this prompt's blocks to FILE (picoLM's --cache); a file of another model or "
                        "KV type, or a corrupt one, is refused with the reason")


def before_run(engine, path) -> str | None:
    """Put the blocks ``path`` holds into the prefix cache (nothing when there is no such file): the scheduler
    reuses the longest prefix the prompt shares with them. The line to report."""
    if not path or not os.path.exists(path):
        return None
    n = restore(engine, path)
    return f"prompt cache {path}: {n} tokens' KV blocks restored"


def after_run(engine, path, token_ids) -> str | None:
    """Save the prompt's blocks to ``path``: the line to report."""
    if not path:
        return None
    n = save(engine, token_ids, path)
    return f"prompt cache {path}: saved {n} prompt tokens"


# --- the server's POST /prompt_cache/{save,restore,erase} (llama-server's slot save / restore / erase) ----------
ACTIONS = ("save", "restore", "erase")


def serve_action(engine, directory, action: str, body: dict) -> dict:
    """One request of the server's prompt-cache routes; files live in ``directory`` (``serve
    --prompt-cache-dir``). Body: {"filename": NAME, "prompt": text or "prompt_token_ids": [ids]} (the prompt:
    required by save, optional for restore: then only the prefix it shares with the file). Answers
    {"filename", "n_saved_tokens" | "n_restored_tokens" | "erased"}. PromptCacheError for a bad request or file,
    FileNotFoundError for a missing one. The caller holds the engine (no step runs meanwhile)."""
    if directory is None:
        raise PromptCacheError("the prompt cache routes are off: start the server with --prompt-cache-dir DIR")
    if action not in ACTIONS:
        raise PromptCacheError(f"unknown prompt cache action {action!r} (one of {', '.join(ACTIONS)})")
    name = body.get("filename") if isinstance(body, dict) else None
    if not isinstance(name, str) or not name or os.path.basename(name) != name or name.startswith("."):
        raise PromptCacheError("'filename' must be a plain file name (no directories), e.g. \"chat.kvc\"")
    path = os.path.join(directory, name)
    ids = None
    if "prompt" in body or "prompt_token_ids" in body:
        prompt = {"prompt_token_ids": body["prompt_token_ids"]} if "prompt_token_ids" in body else body["prompt"]
        try:
            _, ids = engine.input_processor.encode(prompt)
        except (ValueError, TypeError) as exc:
            raise PromptCacheError(f"bad prompt: {exc}") from None
    if action == "save":
        if ids is None:
            raise PromptCacheError("save needs the prompt ('prompt' or 'prompt_token_ids') whose blocks to save")
        return {"filename": name, "n_saved_tokens": save(engine, ids, path)}
    if not os.path.exists(path):
        raise FileNotFoundError(f"no prompt cache {name!r}")
    if action == "restore":
        return {"filename": name, "n_restored_tokens": restore(engine, path, ids)}
    return {"filename": name, "erased": erase(path)}
