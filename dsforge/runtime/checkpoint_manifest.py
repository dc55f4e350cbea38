"""The integrity manifest of a checkpoint: every file's size and digest, written before `latest` moves.

A save digests the tag's files in parallel (each rank a share, balanced by bytes) once every rank
has written its part; rank 0 merges the shares into ``dsforge-manifest.json`` as part of the commit,
before the tag is renamed into place and ``latest`` names it (dsforge.runtime.checkpoint). On resume
each rank checks its share again before anything is loaded, and every rank learns every problem
(one all_gather), so all ranks take the same decision: refuse naming the file, or, with
``training.checkpoint.if_damaged: fall_back``, resume from the newest checkpoint that passes.
`dsforge export` checks the whole manifest in one process.

A flipped byte changes the digest, a truncated file its size, a deleted one is missing; a file
added to the tag after the commit is reported too; the markers and the manifest itself are not
listed. The digest is xxHash's XXH3-128 (the ``xxhash`` package of the runtime extra): measured on
the loaded 2-core development machine at 0.12 s per GiB in memory against BLAKE2b's 2.7
(benchmarks/checkpoint_checks.py), so reading the files, not hashing them, is the cost. Not a
defence against tampering, only against damage; without xxhash BLAKE2b-256 (hashlib) is used, and
the manifest names its algorithm.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dsforge.runtime.errors import CheckpointError

MANIFEST = "dsforge-manifest.json"
SHARE = ".rank{rank}.digests.json"  # one rank's share of the digests, merged by the commit
XXH3, BLAKE2B = "xxh3-128", "blake2b-256"
CHUNK = 8 << 20
VERSION = 1


class DamagedCheckpoint(CheckpointError):
    """A checkpoint's files disagree with its manifest; ``problems`` name each file (DSF615)."""

    def __init__(self, tag_dir: Path, problems: list[str], fix: str = "") -> None:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        super().__init__(
            f"DSF615: the checkpoint {tag_dir} is damaged: {shown}" + (f"; {fix}" if fix else "")
        )
        self.tag_dir, self.problems = tag_dir, problems

    def with_fix(self, fix: str) -> DamagedCheckpoint:
        """The same refusal, with what to do."""
        return DamagedCheckpoint(self.tag_dir, self.problems, fix)


def _skipped(name: str) -> bool:
    """Files that are not part of the checkpoint's content: markers, digest shares, the manifest."""
    base = name.rsplit("/", 1)[-1]
    return base == MANIFEST or (base.startswith(".rank") and base.endswith((".done", ".digests.json")))


def listing(tag_dir: Path) -> dict[str, int]:
    """Every file under ``tag_dir`` (relative POSIX path -> size), without markers and the manifest."""
    out = {}
    for root, dirs, files in os.walk(tag_dir):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            rel = path.relative_to(tag_dir).as_posix()
            if not _skipped(rel):
                out[rel] = path.stat().st_size
    return out


def _hasher(algorithm: str) -> Any:
    """A fresh hash object of ``algorithm``; CheckpointError when this installation cannot compute it."""
    if algorithm == XXH3:
        try:
            import xxhash
        except ImportError:
            raise CheckpointError(f"this checkpoint's manifest uses {XXH3}, which needs the xxhash package: "
                                  "pip install 'dsforge[runtime]'") from None
        return xxhash.xxh3_128()
    if algorithm == BLAKE2B:
        return hashlib.blake2b(digest_size=32)
    raise CheckpointError(f"the manifest names the digest {algorithm!r}, which this dsforge does not know")


def default_algorithm() -> str:
    """xxh3-128 where the xxhash package is installed (the runtime extra has it), else BLAKE2b-256."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return BLAKE2B
    return XXH3


def digest(path: Path, algorithm: str = BLAKE2B) -> str:
    """The ``algorithm`` digest of a file, read in 8 MiB chunks."""
    h = _hasher(algorithm)
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return str(h.hexdigest())


def share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` digests: largest first, each to the rank with the fewest bytes so
    far."""
    loads = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (loads[i], i))
        loads[r] += sizes[name]
        if r == rank:
            mine.append(name)
    return mine


def write_share(tag_dir: Path, rank: int, world: int) -> None:
    """Digest this rank's share of the files of ``tag_dir`` into its share file (every file is already
    written)."""
    sizes, algorithm = listing(tag_dir), default_algorithm()
    entries = {n: {"size": sizes[n], "digest": digest(tag_dir / n, algorithm), "algorithm": algorithm}
               for n in share(sizes, rank, world)}
    (tag_dir / SHARE.format(rank=rank)).write_text(json.dumps(entries), encoding="utf-8")


def write_manifest(tag_dir: Path, world: int) -> dict[str, Any]:
    """Merge the ranks' shares into the manifest (digesting whatever no share covers); written synced."""
    sizes, algorithm = listing(tag_dir), default_algorithm()
    files: dict[str, dict[str, Any]] = {}
    for rank in range(world):
        try:
            files.update(json.loads((tag_dir / SHARE.format(rank=rank)).read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    for name in sizes:
        entry = files.get(name)
        if entry is None or entry.get("size") != sizes[name] or entry.get("algorithm") != algorithm:
            files[name] = {"size": sizes[name], "digest": digest(tag_dir / name, algorithm)}
        else:
            files[name] = {"size": entry["size"], "digest": entry["digest"]}
    files = {n: files[n] for n in sorted(sizes)}
    doc = {"version": VERSION, "algorithm": algorithm, "files": files, "bytes": sum(sizes.values())}
    path = tag_dir / MANIFEST
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=0)
        fh.flush()
        os.fsync(fh.fileno())
    for rank in range(world):
        (tag_dir / SHARE.format(rank=rank)).unlink(missing_ok=True)
    return doc


def read_manifest(tag_dir: Path) -> dict[str, Any] | None:
    """The manifest of ``tag_dir``; None when it has none (saved by a dsforge before manifests)."""
    path = tag_dir / MANIFEST
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DamagedCheckpoint(tag_dir, [f"its manifest {path} cannot be read ({exc})"]) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
        raise DamagedCheckpoint(tag_dir, [f"its manifest {path} is not a dsforge manifest"])
    return doc


def check(tag_dir: Path, names: Iterable[str] | None = None,
          manifest: dict[str, Any] | None = None) -> list[str]:
    """What is wrong with the files of ``tag_dir`` (``names``: only these, default all): one line per file.

    Sizes are compared first (no read); a digest is computed only for a file of the right size.
    """
    doc = manifest if manifest is not None else read_manifest(tag_dir)
    if doc is None:
        return []
    files: dict[str, Any] = doc["files"]
    wanted = sorted(files) if names is None else list(names)
    problems = []
    for name in wanted:
        entry, path = files[name], tag_dir / name
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{path} is missing")
            continue
        if size != entry.get("size"):
            problems.append(f"{path} has {size:,} bytes, the manifest "
                            f"{entry.get('size'):,} (truncated or rewritten)")
        elif digest(path, str(doc.get("algorithm", BLAKE2B))) != entry.get("digest"):
            problems.append(f"{path} differs from its digest in the "
                            f"manifest (its bytes changed since the save)")
    if names is None:
        extra = sorted(set(listing(tag_dir)) - set(files))
        problems += [f"{tag_dir / n} is not in the manifest (added after the save)" for n in extra]
    return problems


def check_share(tag_dir: Path, rank: int, world: int) -> list[str]:
    """This rank's share of the check of ``tag_dir`` (rank 0 also reports files the manifest does not
    list)."""
    doc = read_manifest(tag_dir)
    if doc is None:
        return []
    sizes = {n: int(e.get("size", 0)) for n, e in doc["files"].items()}
    problems = check(tag_dir, share(sizes, rank, world), doc)
    if rank == 0:
        present = set(listing(tag_dir))
        problems += [f"{tag_dir / n} is not in the manifest (added after the "
                     f"save)" for n in sorted(present - set(sizes))]
    return problems
