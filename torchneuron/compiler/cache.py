"""The on-disk compile cache: one JSON file per compiled kernel, holding the host code Inductor generated for
it.

Layout (TORCHNEURON_CACHE_DIR, default $XDG_CACHE_HOME/torchneuron or ~/.cache/torchneuron):
    kernels/<key[:2]>/<key>.json   {"format", "key", "graph", "source", "output_strides", "sha256"}
    inductor/                      Inductor's kernel build directory while the neuron compiler runs (the
                                   compiled .so files), unless TORCHINDUCTOR_CACHE_DIR is set

Safety: nothing is unpickled. An entry is text that is only used when its sha256 matches its content and its
key matches its name; anything else is a corrupt entry: warned about, deleted and rebuilt. Writes go to a
temporary file in the same directory and are renamed into place (atomic), so concurrent processes never see
half an entry. The directory must belong to the user and not be writable by others; otherwise the cache is
off, with a warning."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

from ..hardware.config import setting

FORMAT = 1


def root() -> Path:
    env = setting("TORCHNEURON_CACHE_DIR").strip()
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchneuron"


def _private_dir(path: Path) -> bool:
    """Create `path` (mode 0700) if needed; True if it is ours and nobody else can write to it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


class Cache:
    def __init__(self, path: Path | None = None):
        self.path = path or root()
        self.enabled = _private_dir(self.path)
        if not self.enabled:
            warnings.warn(f"torchneuron: compile cache {self.path} is not private to this user (owner or "
                          "permissions); the cache is off. Point TORCHNEURON_CACHE_DIR at a directory of "
                          "your own.", stacklevel=2)

    def _file(self, key: str) -> Path:
        return self.path / "kernels" / key[:2] / f"{key}.json"

    def load(self, key: str) -> dict | None:
        """The entry stored under `key`, or None (missing, or corrupt: then it is deleted and a warning says
        so)."""
        f = self._file(key)
        if not self.enabled or not f.exists():
            return None
        try:
            entry = json.loads(f.read_text())
            body = {k: v for k, v in entry.items() if k != "sha256"}
            problem = ("wrong format" if entry.get("format") != FORMAT
                       else "key mismatch" if entry.get("key") != key
                       else "checksum mismatch" if entry.get("sha256") != digest(body) else None)
        except (OSError, ValueError, AttributeError) as e:
            problem = f"unreadable ({type(e).__name__})"
        if problem is None:
            return entry
        warnings.warn(f"torchneuron: corrupt compile-cache entry {f} ({problem}); recompiling it",
                      stacklevel=2)
        with contextlib.suppress(OSError):
            f.unlink()
        return None

    def store(self, key: str, entry: dict) -> None:
        if not self.enabled:
            return
        body = {**entry, "format": FORMAT, "key": key}
        data = json.dumps({**body, "sha256": digest(body)})
        f = self._file(key)
        f.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=f.parent, prefix=f".{key[:8]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as out:
                out.write(data)
            os.replace(tmp, f)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def inductor_dir(self) -> Iterator[None]:
        """Inductor builds and finds its compiled kernels under the cache while the neuron compiler runs,
        unless the user chose a TORCHINDUCTOR_CACHE_DIR (Inductor itself writes its default into the
        environment)."""
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if not self.enabled or old not in (None, os.path.abspath(default_cache_dir())):
            yield
            return
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.path / "inductor")
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
