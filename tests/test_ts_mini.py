"""S22: the TypeScript mini-picoLM's own suite (node:test) — tokenizer ids and greedy tokens against the committed
golden files, GGUF parsing errors, dequantization against the `gguf` package — run as part of the Python suite so
CI has one runner. scripts/setup_web.sh installs the TypeScript compiler (npm ci) and builds ts-mini/dist.

The model-dependent node tests skip themselves when PYENGINE_MODEL is unset; here it is always set (a missing
model makes default_model_path() raise, with the fix), so any skip is a failure, in CI or not."""
import os
import re
import shutil
import subprocess

import pytest

from pyengine.model_files import default_model_path

TS_MINI = os.path.join(os.path.dirname(__file__), "..", "ts-mini")


@pytest.mark.slow
def test_ts_mini_node_suite():
    npm = shutil.which("npm")
    assert npm, "npm is required for the TypeScript engine's tests"
    env = dict(os.environ, PYENGINE_MODEL=default_model_path())
    proc = subprocess.run([npm, "test"], cwd=TS_MINI, env=env, capture_output=True, text=True, timeout=1200)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    # node:test ends with "# tests N", "# pass N", "# fail N", "# cancelled N", "# skipped N", "# todo N".
    summary = {k: int(v) for k, v in re.findall(r"^# (tests|pass|fail|cancelled|skipped|todo) (\d+)$",
                                                  proc.stdout, re.M)}
    assert set(summary) == {"tests", "pass", "fail", "cancelled", "skipped", "todo"}, tail
    assert summary["pass"] == summary["tests"] > 0, summary
    assert summary["fail"] == summary["cancelled"] == summary["skipped"] == summary["todo"] == 0, (summary, tail)
