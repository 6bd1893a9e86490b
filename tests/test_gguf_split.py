"""Split GGUF (llama.cpp's gguf-split layout): a model in N files opens from its first part, tensors resolved
across parts, a missing or mismatched part refused by name; a split copy of SmolLM2 generates the same tokens
as the single file (LLM API and `pyengine generate --model`)."""
import os

import numpy as np
import pytest

from pyengine.cli import main
from pyengine.gguf import GGUFError, GGUFFile
from pyengine.gguf.split import part_name, write_split
from pyengine.llm import LLM
from pyengine.model_files import default_model_path
from pyengine.sampling_params import SamplingParams
from tiny_models import write_tiny


@pytest.fixture
def tiny(tmp_path):
    return write_tiny(tmp_path / "tiny.gguf", "llama")


def test_split_roundtrip_same_tensors_and_metadata(tiny, tmp_path):
    whole = GGUFFile(tiny)
    paths = write_split(whole, str(tmp_path / "m"), max_tensors=4)
    n = -(-len(whole.tensors) // 4)
    assert len(paths) == n >= 3 and paths[0].endswith(f"m-00001-of-{n:05d}.gguf")
    split = GGUFFile(paths[0])
    assert split.tensors.keys() == whole.tensors.keys()
    for name, t in whole.tensors.items():
        s = split.tensors[name]
        assert (s.shape, s.ggml_type) == (t.shape, t.ggml_type)
        assert np.array_equal(s.data, t.data), name
    assert {k: v for k, v in split.metadata.items() if not k.startswith("split.")}.keys() == whole.metadata.keys()
    assert split.metadata["split.count"] == n and len(split.part_sizes) == n
    assert sum(split.part_sizes) == sum(os.path.getsize(p) for p in paths)
    # parts given explicitly (a browser hands over buffers, not paths)
    bufs = [open(p, "rb").read() for p in paths]
    from_bufs = GGUFFile(bufs[0], parts=bufs[1:])
    assert np.array_equal(from_bufs.dequantize("output_norm.weight"), whole.dequantize("output_norm.weight"))


def test_missing_mismatched_and_wrong_part_refused_by_name(tiny, tmp_path):
    whole = GGUFFile(tiny)
    paths = write_split(whole, str(tmp_path / "m"), max_tensors=4)
    n = len(paths)
    with pytest.raises(GGUFError, match="open the first part"):
        GGUFFile(paths[1])
    with pytest.raises(GGUFError, match="needs .* more parts"):
        GGUFFile(open(paths[0], "rb").read(), parts=[])
    with pytest.raises(GGUFError, match="pass the other parts"):
        GGUFFile(open(paths[0], "rb").read())
    # a part of another split (other count) in place of part 2
    other = write_split(whole, str(tmp_path / "o"), max_tensors=5)
    assert len(other) != n
    os.replace(other[1], paths[1])
    with pytest.raises(GGUFError, match=rf"part .*{os.path.basename(paths[1])} does not belong here"):
        GGUFFile(paths[0])
    # a missing part is named
    os.remove(paths[2])
    with pytest.raises(GGUFError, match=rf"part .*{os.path.basename(paths[2])} is missing"):
        GGUFFile(paths[0])
    # a first part that does not follow the naming cannot find the rest
    renamed = tmp_path / "renamed.gguf"
    os.replace(paths[0], renamed)
    with pytest.raises(GGUFError, match="must be opened by its first part"):
        GGUFFile(renamed)


def test_tensor_count_mismatch_refused(tiny, tmp_path):
    whole = GGUFFile(tiny)
    paths = write_split(whole, str(tmp_path / "m"), max_tensors=4)
    # drop the last part's tensors by rewriting it empty but still claiming its place
    from pyengine.gguf.writer import write_gguf
    n = len(paths)
    with open(paths[-1], "wb") as f:
        write_gguf(f, {"split.no": n - 1, "split.count": n, "split.tensors.count": len(whole.tensors)}, [],
                   {"split.no": 2, "split.count": 2, "split.tensors.count": 5})
    with pytest.raises(GGUFError, match="split.tensors.count"):
        GGUFFile(paths[0])


def test_split_smollm2_generates_the_same_tokens(tmp_path, capsys):
    single = default_model_path()
    paths = write_split(GGUFFile(single), str(tmp_path / "smol"), max_tensors=100)
    assert len(paths) == 3
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    want = [o.outputs[0].token_ids for o in LLM(model=single, max_model_len=256).generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in LLM(model=paths[0], max_model_len=256).generate(prompts, params)]
    assert got == want
    rc = main(["generate", "The capital of France is", "--model", paths[0], "--temperature", "0", "--max-tokens", "4"])
    out, _ = capsys.readouterr()
    assert rc == 0 and out.startswith(" Paris")
