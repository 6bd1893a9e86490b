"""The README's Python blocks marked `<!-- runnable ... -->` run as written on the default model, and every
`print(...)  # "text"` line's quoted text appears in what the block printed (issue 33: a block that cannot run
as written is a broken promise to a new user). A block marked `runnable under mpiexec -n N` runs under MPI."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
MARK = re.compile(r"<!-- runnable(?P<mpi> under mpiexec -n (?P<n>\d+))?[^>]*-->\n```python\n(?P<code>.*?)```", re.S)


def blocks():
    return [(m.group("code"), int(m.group("n")) if m.group("mpi") else 0) for m in MARK.finditer(README.read_text())]


def promised(code: str) -> list[str]:
    """The quoted outputs the block's comments promise: `print(...)   # "text"` or `# 'text'`."""
    out = []
    for line in code.splitlines():
        m = re.match(r"\s*print\(.*\)\s+#\s*(\"[^\"]*\"|'[^']*')\s*$", line)
        if m:
            out.append(ast.literal_eval(m.group(1)))
    return out


def test_readme_has_runnable_blocks():
    found = blocks()
    assert [n for _, n in found] == [0, 2], "the README's runnable blocks moved or lost their markers"
    assert len(promised(found[0][0])) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1])
def test_readme_block_runs_as_written(tmp_path, index):
    code, ranks = blocks()[index]
    script = tmp_path / "block.py"
    script.write_text(code)
    if ranks:
        pytest.importorskip("mpi4py")
        from pyengine.parallel.launch import mpiexec_command, rank_env
        cmd, env = mpiexec_command(ranks, [str(script)]), rank_env()
    else:
        cmd, env = [sys.executable, str(script)], None
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    for text in promised(code):
        assert text in p.stdout, (text, p.stdout)
    assert p.stdout.endswith("\n")
