"""A digest of every byte of a model's weights, part of the identity its KV is stored under.

A sample of the weights (the safetensors header and 16 x 4 KiB per file) gave an edited model
(one matrix of every layer changed, as a ROME-style edit does) its base model's identity, and
the edited model loaded the base model's KV; `.bin`/`.pt` checkpoints were not fingerprinted
at all. Here every weights file (`WEIGHT_SUFFIXES`) is read whole and hashed (SHA-256), files
in parallel. The launcher computes it before any worker starts; each file's digest is cached
by path, size, mtime and inode in kvtier's cache directory, so the workers, and later launches
of the same files, read the cache instead of the weights. A file rewritten in place gets a new
mtime, hence a fresh digest.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

__all__ = ["WEIGHT_SUFFIXES", "weights_digest", "weight_files"]

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_READ_BYTES = 8 << 20
_HASH_THREADS = 4  # hashlib releases the GIL on large updates: files hash side by side
_RACY_NS = 2_000_000_000  # files written this recently are hashed again at the next call


class _Stamp(NamedTuple):
    size: int
    mtime_ns: int
    inode: int


def weight_files(model_dir: str) -> list[str]:
    """The weights files directly in `model_dir`, by name."""
    return sorted(e.name for e in os.scandir(model_dir)
                  if e.is_file() and e.name.endswith(WEIGHT_SUFFIXES)
                  and not e.name.startswith("."))


def weights_digest(model_dir: str, cache: Path | None = None) -> str | None:
    """SHA-256 over every weights file of `model_dir` (names, sizes and each file's full
    SHA-256), or None when it has none. `cache`: the directory of the per-file digest cache
    (default: kvtier's cache directory)."""
    names = weight_files(model_dir)
    if not names:
        return None
    root = os.path.realpath(model_dir)
    cache_file = _cache_file(root, cache)
    known = _read_cache(cache_file)
    stamps = {n: _stamp(os.stat(os.path.join(root, n))) for n in names}
    todo = [n for n in names if known.get(n, (None,))[0] != list(stamps[n])]
    if todo:
        start = time.monotonic()
        nbytes = sum(stamps[n].size for n in todo)
        with ThreadPoolExecutor(min(_HASH_THREADS, len(todo))) as pool:
            for name, digest in zip(todo, pool.map(
                    lambda n: _file_digest(os.path.join(root, n)), todo), strict=True):
                known[name] = (list(stamps[name]), digest)
        seconds = time.monotonic() - start
        logger.info("kvtier: read all %.2f GB of the weights of %s for the model's identity in "
                    "%.1f s (%.2f GB/s; cached for the next launch)", nbytes / 1e9, root,
                    seconds, nbytes / 1e9 / max(seconds, 1e-9))
        # A file changed within the timestamp granularity of its last write (a few ms on
        # Linux) could change again with the same mtime: such digests are not cached.
        settled = time.time_ns() - _RACY_NS
        _write_cache(cache_file, {n: known[n] for n in names if stamps[n].mtime_ns < settled})
    total = hashlib.sha256()
    for name in names:
        total.update(f"{name}\0{stamps[name].size}\0{known[name][1]}\n".encode())
    return total.hexdigest()


def _stamp(st: os.stat_result) -> _Stamp:
    return _Stamp(st.st_size, st.st_mtime_ns, st.st_ino)


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _cache_file(root: str, cache: Path | None) -> Path:
    if cache is None:
        from kvtier.kernels.build import cache_dir

        cache = cache_dir() / "weights"
    return cache / (hashlib.sha256(root.encode()).hexdigest()[:32] + ".json")


def _read_cache(path: Path) -> dict[str, tuple[list[int], str]]:
    """The cached digests: {file name: (its stamp, its SHA-256)}; {} when missing or unusable
    (a cache never decides anything it cannot show)."""
    try:
        raw = json.loads(path.read_text())
        return {str(k): (list(v[0]), str(v[1])) for k, v in raw.items()}
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return {}


def _write_cache(path: Path, entries: dict[str, tuple[list[int], str]]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)
    except OSError as exc:  # no cache: the next launch reads the weights again
        logger.warning("kvtier: cannot cache the weights digest at %s: %s", path, exc)
