"""`pyengine rm NAME`: delete a pulled model (from the hub cache or pyengine's store). Packaged models belong to
their pip package and local files to you: those are refused, never deleted."""
from __future__ import annotations

import argparse
import os
import sys

from pyengine.model_files import find_models


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="a name from `pyengine models`")


def _remove_hub_file(path: str) -> None:
    """A hub snapshot entry is a link to a blob: remove the link, and the blob when no other snapshot uses it."""
    blob = os.path.realpath(path)
    os.unlink(path)
    repo = blob.split(os.sep + "blobs" + os.sep)[0]
    snapshots = os.path.join(repo, "snapshots")
    for folder, _, files in os.walk(snapshots):
        for f in files:
            if os.path.realpath(os.path.join(folder, f)) == blob:
                return
    if blob != path and os.path.isfile(blob):
        os.unlink(blob)


def run(args) -> int:
    hits = find_models(args.name, local_folder=None)
    if not hits:
        print(f"pyengine rm: error: no pulled model named {args.name!r} (`pyengine models` lists them)",
              file=sys.stderr)
        return 1
    if len(hits) > 1:
        print(f"pyengine rm: error: {args.name!r} names {len(hits)} models: "
              + ", ".join(m.name for m in hits), file=sys.stderr)
        return 1
    m = hits[0]
    if m.source == "packaged":
        print(f"pyengine rm: error: {m.name} comes with the pip package {m.origin}; `pip uninstall` it instead",
              file=sys.stderr)
        return 1
    if m.source == "hub":
        _remove_hub_file(m.path)
    else:
        os.unlink(m.path)
        if os.path.isfile(m.path + ".json"):
            os.unlink(m.path + ".json")
    print(f"removed {m.name} ({m.path})")
    return 0
