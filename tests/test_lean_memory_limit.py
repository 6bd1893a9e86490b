"""S21: the streaming lean mode runs a model under a memory limit its float32 (resident) weights alone exceed,
with the resident mode's greedy tokens. The limit is set by the test on the process it starts (a cgroup: v1's
memory.limit_in_bytes, or v2's memory.max); the same limit kills a resident run, so the limit is known to bite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyengine.gguf.random_llama import LlamaShape, write_random_llama

# ~16M weights: 64 MiB as float32, 9 MiB in the file (Q4_K_M)
SHAPE = LlamaShape(d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=1536, vocab=4096, context=512)
LIMIT = 64 << 20     # lean peaks at ~18 MiB charged here, resident at ~172 MiB
PROMPT = "hello world, a small model streamed from its file"
N_TOKENS = 12

CHILD = r"""
import json, os, sys
cg, path, mode = sys.argv[1:4]
with open(os.path.join(cg, "cgroup.procs"), "w") as f:      # join the limited group before anything is loaded
    f.write(str(os.getpid()))
from pyengine import LLM, SamplingParams
llm = LLM(path, weights_mode=mode, kv_cache_dtype="q8_0", max_model_len=256, max_num_seqs=1)
out = llm.generate([sys.argv[4]], SamplingParams(max_tokens=int(sys.argv[5]), temperature=0.0, ignore_eos=True))
print(json.dumps(out[0].outputs[0].token_ids))
"""


def _memory_cgroup(name: str, limit: int) -> tuple[Path, str] | None:
    """A new memory cgroup with ``limit`` bytes (v1, else v2), or None where cgroups cannot be made here."""
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    try:
        if (v1 / "cgroup.procs").exists():
            d = v1 / name
            d.mkdir()
            (d / "memory.limit_in_bytes").write_text(str(limit))
            if (d / "memory.memsw.limit_in_bytes").exists():     # no escape into swap
                (d / "memory.memsw.limit_in_bytes").write_text(str(limit))
            return d, "memory.max_usage_in_bytes"
        if "memory" in (v2 / "cgroup.controllers").read_text().split():
            d = v2 / name
            d.mkdir()
            (d / "memory.max").write_text(str(limit))
            (d / "memory.swap.max").write_text("0")
            return d, "memory.peak"
    except OSError:
        return None
    return None


def _run_limited(tmp_path: Path, path: Path, mode: str) -> tuple[subprocess.CompletedProcess, int]:
    made = _memory_cgroup(f"pyengine-test-{os.getpid()}-{mode}", LIMIT)
    if made is None:
        pytest.skip("cannot create a memory cgroup here (needs root and cgroup v1 or v2 with the memory controller)")
    d, peak_file = made
    try:
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        p = subprocess.run([sys.executable, "-c", CHILD, str(d), str(path), mode, PROMPT, str(N_TOKENS)],
                           capture_output=True, text=True, timeout=300, env=env)
        peak = int((d / peak_file).read_text()) if (d / peak_file).exists() else -1
        return p, peak
    finally:
        d.rmdir()


def test_lean_mode_runs_under_a_memory_limit_that_kills_resident(tmp_path):
    from pyengine import LLM, SamplingParams
    path = tmp_path / "random-llama.gguf"
    write_random_llama(path, SHAPE, seed=7)
    ref = LLM(str(path), weights_mode="resident", kv_cache_dtype="q8_0", max_model_len=256, max_num_seqs=1)
    want = ref.generate([PROMPT], SamplingParams(max_tokens=N_TOKENS, temperature=0.0,
                                                 ignore_eos=True))[0].outputs[0].token_ids
    del ref
    lean, peak = _run_limited(tmp_path, path, "lean")
    assert lean.returncode == 0, lean.stderr[-2000:]
    assert json.loads(lean.stdout.strip().splitlines()[-1]) == list(want)
    assert 0 < peak <= LIMIT
    resident, _ = _run_limited(tmp_path, path, "resident")
    assert resident.returncode != 0, "the resident weights fit under the limit: it does not test anything"
