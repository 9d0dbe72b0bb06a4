"""`fleetctl stage`: put into each node's cache directory the tensors the next load sends it by hash.

Which tensors, as the pinned llama.cpp (0.3.36) loads a plan (`-sm layer`, every layer offloaded;
see fleetd/fleet/plan.py): a node gets every `blk.N.*` tensor of its layers, and the last node
the output layer (`output.weight`, or `token_embd.weight` where the output is tied, and
`output_norm.*`). Of those, the client sends by hash exactly the ones of more than HASH_THRESHOLD
bytes (`ggml-rpc.cpp`: `size > HASH_THRESHOLD` into a weights buffer, and every model tensor is in
one); each is set whole, so its hash is the FNV-1a 64 of its bytes in the GGUF, and the file is
named `%016x` of it, as fleetd's cache directory and the stock server name theirs.

    shares = plan_shares(plan_doc)                       pure: the plan's stages
    wanted = node_tensors(model, share)                  pure: that node's hashed tensors
    result = stage_node(model, node, wanted, progress)   I/O: hash, compare, send, manifest

A manifest `stage-<model>.manifest.json` beside the tensors says which model's files they are
(name, size + mtime key, hashes and sizes), so `fleetctl status` can say "k of n staged". fleetd's
cache budget counts and evicts only files named by a hash (16 hex digits): manifests are never
evicted (tensor files can be, and status then shows fewer staged).

The coordinator sends each byte once per node; node-to-node staging over peer links is not done.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gguf
import numpy as np

from fleetd.compute.native import fnv1a_64
from fleetd.errors import UsageError
from fleetd.fleet.node import Node
from fleetd.fleet.plan import PLAN_VERSION
from fleetd.fleet.stage_store import NoCacheDir, Progress, open_store
from fleetd.wire.hashing import FNV_OFFSET, cache_file_name

# ggml-rpc.cpp (0.3.36) `HASH_THRESHOLD`: a weight tensor of more bytes than this goes by hash.
HASH_THRESHOLD = 10 * 1024 * 1024
MANIFEST_VERSION = 1
MANIFEST_PREFIX, MANIFEST_SUFFIX = "stage-", ".manifest.json"
HASH_STEP = 64 << 20  # hash this much at a time, so a huge tensor's pages are not all mapped at once
OUTPUT_NAMES = ("output.weight", "output.bias", "output_norm.weight", "output_norm.bias")


# -- the model -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """One tensor of the GGUF: its name, where its bytes start in the file and how many."""

    name: str
    offset: int
    size: int


class Model:
    """A GGUF opened for staging: its tensor table and its bytes, mapped (never read whole)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            reader = gguf.GGUFReader(str(self.path))
        except (OSError, ValueError) as exc:
            raise UsageError(f"{self.path}: not a GGUF file: {exc}") from exc
        self.data: np.memmap = reader.data
        self.tensors = {t.name: Tensor(t.name, int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
        st = self.path.stat()
        self.key = f"{st.st_size}:{st.st_mtime_ns}"

    @property
    def name(self) -> str:
        return self.path.name

    def view(self, t: Tensor) -> memoryview:
        """The tensor's bytes in the file, mapped: no copy."""
        return memoryview(self.data[t.offset : t.offset + t.size])

    def hash(self, t: Tensor) -> int:
        """FNV-1a 64 of the tensor's bytes: fleetd.compute.native's (C, or the pure Python
        reference when the library is missing), as fleetd names its cache files."""
        h, view = FNV_OFFSET, self.view(t)
        for at in range(0, t.size, HASH_STEP):
            h = fnv1a_64(view[at : at + HASH_STEP], h)
        return h


# -- the plan: who gets what (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class Share:
    """One stage of the plan: the node's name, its layers [first, stop) and whether it is last."""

    name: str
    endpoint: str
    first: int
    stop: int
    output: bool


def plan_shares(doc: dict) -> list[Share]:
    """The stages of a plan file (fleetctl plan --json, version 1); UsageError when it is not one."""
    if not isinstance(doc, dict) or doc.get("version") != PLAN_VERSION:
        raise UsageError(f"not a version {PLAN_VERSION} plan file (fleetctl plan --json writes one)")
    if doc.get("fits") is False:
        raise UsageError(f"the plan says the model does not fit: {doc.get('error', '')}")
    try:
        return [
            Share(s["name"], s["endpoint"], int(s["layers"][0]), int(s["layers"][1]), bool(s["output"]))
            for s in doc["stages"]
        ]
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise UsageError(f"plan file: a stage without name, endpoint, layers or output ({exc})") from None


def node_tensors(tensors: dict[str, Tensor], share: Share) -> list[Tensor]:
    """The tensors this node receives by hash at the next load (see the module docstring)."""
    names = [n for n in tensors if _layer(n) is not None and share.first <= _layer(n) < share.stop]
    if share.output:
        names += [n for n in OUTPUT_NAMES if n in tensors]
        if "output.weight" not in tensors and "token_embd.weight" in tensors:
            names.append("token_embd.weight")  # tied output: llama.cpp loads a copy here
    return [tensors[n] for n in names if tensors[n].size > HASH_THRESHOLD]


def _layer(name: str) -> int | None:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def check_model(model: Model, doc: dict) -> None:
    """The plan is for a model of this shape: the same layer count."""
    want = doc.get("model", {}).get("n_layer")
    have = 1 + max((_layer(n) for n in model.tensors if _layer(n) is not None), default=-1)
    if want is not None and want != have:
        raise UsageError(f"the plan is for a model of {want} layers, {model.name} has {have}")


# -- one node ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hashed:
    """A tensor to stage: its cache file name and size (tensors with equal bytes share a file)."""

    file: str
    size: int
    tensor: Tensor


@dataclass
class NodeResult:
    """What stage did on one node: files and bytes sent, and already there."""

    node: str
    cache_dir: str
    files: int = 0
    bytes: int = 0
    sent_files: int = 0
    sent_bytes: int = 0
    present_files: int = 0
    present_bytes: int = 0
    seconds: float = 0.0
    tensors: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        doc = asdict(self)
        doc.pop("tensors")
        return doc


def hashed(model: Model, tensors: list[Tensor]) -> list[Hashed]:
    """Each tensor's cache file, once per distinct file."""
    out: dict[str, Hashed] = {}
    for t in tensors:
        name = cache_file_name(model.hash(t))
        out.setdefault(name, Hashed(name, t.size, t))
    return list(out.values())


def manifest_name(model_name: str) -> str:
    return MANIFEST_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", model_name) + MANIFEST_SUFFIX


def manifest(model: Model, share: Share, files: list[Hashed]) -> dict:
    return {
        "version": MANIFEST_VERSION,
        "model": model.name,
        "key": model.key,
        "node": share.name,
        "layers": [share.first, share.stop],
        "output": share.output,
        "staged_at": time.time(),
        "tensors": [{"name": f.tensor.name, "file": f.file, "size": f.size} for f in files],
    }


def stage_node(
    model: Model,
    node: Node,
    share: Share,
    started: Callable[[int], None] = lambda total: None,
    progress: Progress = lambda n: None,
) -> NodeResult:
    """Hash the node's tensors, send those its cache directory lacks (or holds at another size),
    then write the manifest. `started(bytes to send)` once, then `progress(bytes)` per chunk."""
    t0 = time.monotonic()
    store = open_store(node)
    try:
        files = hashed(model, node_tensors(model.tensors, share))
        have = store.sizes()
        missing = [f for f in files if have.get(f.file) != f.size]
        result = NodeResult(node.name, store.where, len(files), sum(f.size for f in files))
        result.sent_files, result.sent_bytes = len(missing), sum(f.size for f in missing)
        result.present_files = result.files - result.sent_files
        result.present_bytes = result.bytes - result.sent_bytes
        started(result.sent_bytes)
        for f in missing:
            store.put(f.file, model.view(f.tensor), progress)
        store.write_text(manifest_name(model.name), json.dumps(manifest(model, share, files), indent=1))
        result.tensors = [{"name": f.tensor.name, "file": f.file, "size": f.size} for f in files]
    finally:
        store.close()
    result.seconds = time.monotonic() - t0
    return result


# -- what a node holds (fleetctl status) -------------------------------------------------------------


@dataclass(frozen=True)
class StagedModel:
    """One manifest on a node: the model and how many of its files are there at their size."""

    model: str
    key: str
    files: int
    bytes: int
    present_files: int
    present_bytes: int

    def line(self) -> str:
        return (
            f"model {self.model}: {self.present_files} of {self.files} tensors "
            f"({_mib(self.present_bytes)} of {_mib(self.bytes)}) staged"
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def staged_models(node: Node) -> list[StagedModel]:
    """The manifests in the node's cache directory, each checked against the files there. A node
    without a known cache directory holds none."""
    try:
        store = open_store(node)
    except NoCacheDir:
        return []
    try:
        sizes = store.sizes()
        out = []
        for name in sorted(sizes):
            if name.startswith(MANIFEST_PREFIX) and name.endswith(MANIFEST_SUFFIX):
                doc = _manifest_doc(store.read_text(name))
                if doc is not None:
                    out.append(_staged(doc, sizes))
        return out
    finally:
        store.close()


def _manifest_doc(text: str | None) -> dict | None:
    try:
        doc = json.loads(text or "")
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and doc.get("version") == MANIFEST_VERSION else None


def _staged(doc: dict, sizes: dict[str, int]) -> StagedModel:
    files = [t for t in doc.get("tensors", []) if isinstance(t, dict)]
    there = [t for t in files if sizes.get(t.get("file")) == t.get("size")]
    return StagedModel(
        model=str(doc.get("model", "?")),
        key=str(doc.get("key", "")),
        files=len(files),
        bytes=sum(int(t.get("size", 0)) for t in files),
        present_files=len(there),
        present_bytes=sum(int(t["size"]) for t in there),
    )
