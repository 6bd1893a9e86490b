"""`pyengine pull SPEC`: fetch a GGUF by name, as `ollama pull` / llama.cpp's `-hf` do.

SPEC is one of
- ``org/repo/path/file.gguf``: that file of a Hugging Face model repo, through ``huggingface_hub`` (its download,
  retries with HTTP Range resume inside a run, and its cache; ``HF_ENDPOINT`` and ``HF_TOKEN`` are honoured);
- ``org/repo`` or ``org/repo:QUANT``: the repo's one GGUF, or the one whose name contains QUANT (e.g. ``Q4_K_M``);
  several candidates are listed, never guessed;
- ``https://.../file.gguf``: a plain URL, downloaded into pyengine's store with a progress line; an interrupted
  download keeps its ``.part`` file and the next `pull` resumes it with a Range request.

Every download is checked: against the sha256 the hub records for LFS files (the blob's name in its cache), or the
``--sha256`` given, and the file must open as a GGUF. A failed check deletes the file. Offline, one clear line.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time

from pyengine.model_files import extras_hint, find_models, looks_pullable, store_dir

_SHA256 = re.compile(r"[0-9a-f]{64}")
HUB_HINT = f"`pyengine pull` needs huggingface_hub and httpx: {extras_hint('hub')}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC", help="org/repo/file.gguf, org/repo[:QUANT] or an https:// URL")
    p.add_argument("--revision", default="main", help="hub branch, tag or commit (default: main)")
    p.add_argument("--sha256", default=None, help="expected sha256 of the file (checked after the download)")
    p.add_argument("--force", action="store_true", help="download again even if the model is already here")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output")


class PullError(RuntimeError):
    """A pull that could not complete: the message is the one line printed."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_file(path: str, expected: str | None) -> str:
    """sha256 of the file, checked against `expected`; the file must be a GGUF. Deletes the file on failure."""
    from pyengine.gguf import GGUFError
    from pyengine.gguf.reader import GGUFFile
    digest = sha256_file(path)
    try:
        if expected and digest != expected.lower():
            raise PullError(f"checksum mismatch for {os.path.basename(path)}: expected sha256 {expected}, "
                            f"got {digest}; the file was deleted")
        try:
            GGUFFile(path)
        except (GGUFError, ValueError, OSError) as e:
            raise PullError(f"{os.path.basename(path)} is not a readable GGUF ({e}); the file was deleted") from None
    except PullError:
        os.unlink(path)
        raise
    return digest


def _split_hub_spec(spec: str) -> tuple[str, str | None, str | None]:
    """org/repo[/path/file.gguf][:QUANT] -> (repo_id, filename or None, quant or None)."""
    quant = None
    if ":" in spec:
        spec, quant = spec.rsplit(":", 1)
    parts = spec.split("/")
    repo_id = "/".join(parts[:2])
    filename = "/".join(parts[2:]) or None
    return repo_id, filename, quant


def _connection_error(e: Exception, where: str) -> PullError:
    return PullError(f"cannot reach {where} ({type(e).__name__}: {e}); check the network, a proxy, or "
                     "HF_ENDPOINT for a mirror. Models already here still work: `pyengine models` lists them")


def _pick_repo_file(api, repo_id: str, revision: str, quant: str | None) -> str:
    files = [f for f in api.list_repo_files(repo_id, revision=revision) if f.lower().endswith(".gguf")]
    # a split model is pulled by its first part; the other parts come with it
    firsts = [f for f in files if not re.search(r"-\d{5}-of-\d{5}\.gguf$", f) or "-00001-of-" in f]
    if quant:
        firsts = [f for f in firsts if quant.casefold() in os.path.basename(f).casefold()]
    if len(firsts) == 1:
        return firsts[0]
    if not firsts:
        raise PullError(f"{repo_id} has no GGUF file" + (f" matching {quant!r}" if quant else "")
                        + (f" (its GGUF files: {', '.join(files)})" if files else ""))
    raise PullError(f"{repo_id} has {len(firsts)} GGUF files; name one as {repo_id}/FILE or {repo_id}:QUANT: "
                    + ", ".join(firsts))


def pull_hub(spec: str, revision: str = "main", sha256: str | None = None, force: bool = False,
             quiet: bool = False) -> str:
    """Download org/repo/file.gguf (and the other parts of a split file) into HF's cache; returns the path."""
    try:
        import huggingface_hub
        from huggingface_hub.utils import HfHubHTTPError
    except ImportError:
        raise PullError(HUB_HINT) from None
    from huggingface_hub.errors import LocalEntryNotFoundError
    repo_id, filename, quant = _split_hub_spec(spec)
    api = huggingface_hub.HfApi()
    try:
        if filename is None:
            filename = _pick_repo_file(api, repo_id, revision, quant)
        names = [filename]
        m = re.search(r"-00001-of-(\d{5})\.gguf$", filename)
        if m:
            names += [filename.replace("-00001-of-", f"-{i:05d}-of-") for i in range(2, int(m.group(1)) + 1)]
        paths = []
        for name in names:
            if not quiet:
                print(f"pulling {repo_id}/{name} from {huggingface_hub.constants.ENDPOINT}", file=sys.stderr)
            # the hub's ETag of an LFS file is its sha256: what the download must hash to
            meta = huggingface_hub.get_hf_file_metadata(huggingface_hub.hf_hub_url(repo_id, name, revision=revision))
            etag = (meta.etag or "").lower()
            expected = sha256 if (sha256 and name == filename) else (etag if _SHA256.fullmatch(etag) else None)
            path = huggingface_hub.hf_hub_download(repo_id, name, revision=revision, force_download=force)
            if expected:
                digest = sha256_file(path)
                if digest != expected.lower():
                    for p in {os.path.realpath(path), os.path.join(os.path.dirname(os.path.realpath(path)), etag)}:
                        if etag and os.path.isfile(p):
                            os.unlink(p)
                    os.unlink(path)
                    raise PullError(f"checksum mismatch for {repo_id}/{name}: expected sha256 {expected}, got "
                                    f"{digest}; the file was deleted, pull again")
            paths.append(path)
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise PullError(f"{repo_id} needs access (HTTP {status}): accept its licence on the hub and set "
                            "HF_TOKEN") from None
        if status == 404:
            raise PullError(f"not found on the hub: {repo_id}" + (f"/{filename}" if filename else "")
                            + f" at revision {revision}") from None
        raise PullError(f"the hub refused {spec}: {e}") from None
    except LocalEntryNotFoundError as e:       # the library's word for "no connection and not in the cache"
        raise _connection_error(e.__cause__ or e, huggingface_hub.constants.ENDPOINT) from None
    except PullError:
        raise
    except Exception as e:                     # the library's HTTP client's transport errors (httpx / httpx2)
        if type(e).__module__.split(".")[0].startswith("httpx") or isinstance(e, OSError):
            raise _connection_error(e, huggingface_hub.constants.ENDPOINT) from None
        raise
    from pyengine.gguf.reader import GGUFFile
    try:
        GGUFFile(paths[0])
    except (ValueError, OSError) as e:
        raise PullError(f"{repo_id}/{filename} is not a readable GGUF: {e}") from None
    return paths[0]


def _progress(quiet: bool):
    state = {"t": 0.0}

    def show(done: int, total: int | None, final: bool = False) -> None:
        now = time.monotonic()
        if quiet or (now - state["t"] < 0.5 and not final):
            return
        state["t"] = now
        mib = done / 2**20
        text = (f"\r  {mib:8.1f} / {total / 2**20:.1f} MiB  {100 * done / total:5.1f}%" if total
                else f"\r  {mib:8.1f} MiB")
        print(text, end="\n" if final else "", file=sys.stderr, flush=True)
    return show


def pull_url(url: str, sha256: str | None = None, force: bool = False, quiet: bool = False) -> str:
    """Download a GGUF from a plain URL into the store, resuming a `.part` file left by an interrupted pull."""
    try:
        import httpx
    except ImportError:
        raise PullError(HUB_HINT) from None
    name = os.path.basename(url.split("?", 1)[0].split("#", 1)[0]) or "model.gguf"
    if not name.lower().endswith(".gguf"):
        name += ".gguf"
    folder = store_dir()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    if os.path.isfile(path) and not force:
        return path
    part = path + ".part"
    have = os.path.getsize(part) if os.path.isfile(part) else 0
    show = _progress(quiet)
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0)) as client:
            with client.stream("GET", url, headers=headers) as r:
                if r.status_code == 416 and have:          # the .part is already whole
                    total = have
                elif r.status_code not in (200, 206):
                    raise PullError(f"{url} answered HTTP {r.status_code}")
                else:
                    if r.status_code == 200:                 # the server ignored the Range: start over
                        have = 0
                    elif not r.headers.get("content-range", "").startswith(f"bytes {have}-"):
                        raise PullError(f"{url} answered a Range request with {r.headers.get('content-range')!r}")
                    length = r.headers.get("content-length")
                    total = have + int(length) if length else None
                    if not quiet:
                        print(f"pulling {url}" + (f" (resuming at {have / 2**20:.1f} MiB)" if have else ""),
                              file=sys.stderr)
                    with open(part, "ab" if have else "wb") as f:
                        try:
                            for chunk in r.iter_bytes():     # as received: a cut keeps every byte that arrived
                                f.write(chunk)
                                have += len(chunk)
                                show(have, total)
                        except httpx.TransportError as e:
                            raise PullError(f"the transfer of {url} was cut at {have} bytes ({e}); they are kept "
                                            "in the store: run the same pull again to resume") from None
                    show(have, total, final=True)
                    if total is not None and have != total:
                        raise PullError(f"{url}: the transfer stopped at {have} of {total} bytes; run the same "
                                        "pull again to resume")
    except httpx.TransportError as e:
        raise _connection_error(e, url) from None
    os.replace(part, path)
    digest = _check_file(path, sha256)
    with open(path + ".json", "w", encoding="utf-8") as f:
        json.dump({"url": url, "sha256": digest, "size": os.path.getsize(path)}, f)
    return path


def pull(spec: str, revision: str = "main", sha256: str | None = None, force: bool = False,
         quiet: bool = False) -> str:
    if spec.startswith(("http://", "https://")):
        return pull_url(spec, sha256, force, quiet)
    if not looks_pullable(spec):
        raise PullError(f"{spec!r} is neither org/repo[/file.gguf][:QUANT] nor an https:// URL")
    return pull_hub(spec, revision, sha256, force, quiet)


def run(args) -> int:
    if not args.force and not args.spec.startswith(("http://", "https://")):
        here = [m for m in find_models(args.spec, local_folder=None) if m.source == "hub"]
        if len(here) == 1 and args.revision == "main":
            print(f"{here[0].name} is already here: {here[0].path} (--force downloads it again)")
            return 0
    try:
        path = pull(args.spec, args.revision, args.sha256, args.force, args.quiet)
    except PullError as e:
        print(f"pyengine pull: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
