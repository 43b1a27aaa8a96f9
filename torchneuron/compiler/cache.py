"""The on-disk compile cache: one JSON file per compiled kernel, holding the host code Inductor generated for
it.

Layout (TORCHNEURON_CACHE_DIR, default $XDG_CACHE_HOME/torchneuron or ~/.cache/torchneuron):
    kernels/<key[:2]>/<key>.json   {"format", "key", "graph", "source", "output_strides", "sha256"}
    inductor/                      Inductor's kernel build directory while the neuron compiler runs (the
                                   compiled .so files), unless TORCHINDUCTOR_CACHE_DIR is set

Safety: nothing is unpickled. An entry is text that is only used when its sha256 matches its content and its
key matches its name; anything else is a corrupt entry: warned about, deleted and rebuilt. Writes go to a
temporary file in the same directory and are renamed into place (atomic), so concurrent processes never see
half an entry. Inductor's artifacts are verified before Inductor uses them (`verified_artifacts`): a source file
must hold exactly the source it is named after, and a compiled object or library must match the sha256 recorded
next to it (`<file>.sha256`) when it was built; otherwise it is rebuilt (a truncated library would crash the
process when loaded). The directory must belong to the user and not be writable by others, and be usable;
otherwise the cache is off, with one warning per process."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..hardware import config
from ..runtime import patches

FORMAT = 1


def root() -> Path:
    return config.current().cache_dir


def _private_dir(path: Path) -> bool:
    """Create `path` (mode 0700) if needed; True if it is ours and nobody else can write to it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def digest(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


_unusable: set[str] = set()  # cache directories found unusable: off for the rest of the process, warned once


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class Cache:
    def __init__(self, path: Path | None = None):
        self.path = path or root()
        self.enabled = str(self.path) not in _unusable
        if not self.enabled:
            return
        try:
            private = all(_private_dir(p) for p in (self.path, self.path / "kernels", self.path / "inductor"))
        except OSError as e:
            self._off(f"cannot be used ({type(e).__name__}: {e})")
        else:
            if not private:
                self._off("is not private to this user (owner or permissions)")

    def _off(self, why: str) -> None:
        """An unusable cache turns itself off (compiles go on without it), with one warning."""
        self.enabled = False
        if str(self.path) not in _unusable:
            _unusable.add(str(self.path))
            warnings.warn(f"torchneuron: compile cache {self.path} {why}; the cache is off. Point "
                          "TORCHNEURON_CACHE_DIR at a directory of your own.", stacklevel=3)

    def _file(self, key: str) -> Path:
        return self.path / "kernels" / key[:2] / f"{key}.json"

    def load(self, key: str) -> dict | None:
        """The entry stored under `key`, or None (missing, or corrupt: then it is deleted and a warning says
        so)."""
        f = self._file(key)
        try:
            if not self.enabled or not f.exists():
                return None
        except OSError as e:
            self._off(f"cannot be read ({type(e).__name__}: {e})")
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
        try:
            f.unlink()
        except OSError as e:
            self._off(f"holds a corrupt entry that cannot be removed ({type(e).__name__}: {e})")
        return None

    def store(self, key: str, entry: dict) -> None:
        if not self.enabled:
            return
        body = {**entry, "format": FORMAT, "key": key}
        data = json.dumps({**body, "sha256": digest(body)})
        f = self._file(key)
        tmp = None
        try:
            f.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=f.parent, prefix=f".{key[:8]}.", suffix=".tmp")
            with os.fdopen(fd, "w") as out:
                out.write(data)
            os.replace(tmp, f)
        except OSError as e:
            self._off(f"cannot be written ({type(e).__name__}: {e})")
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    @contextlib.contextmanager
    def inductor_dir(self) -> Iterator[None]:
        """Inductor builds and finds its compiled kernels under the cache while the neuron compiler runs,
        unless the user chose a TORCHINDUCTOR_CACHE_DIR (Inductor itself writes its default into the
        environment)."""
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        user = config.current().inductor_cache_dir
        if not self.enabled or user not in (None, os.path.abspath(default_cache_dir())):
            with verified_artifacts():
                yield
            return
        with config.scoped_env("TORCHINDUCTOR_CACHE_DIR", str(self.path / "inductor")), verified_artifacts():
            yield


def _corrupt(path: str, why: str) -> None:
    warnings.warn(f"torchneuron: corrupt compile artifact {path} ({why}); rebuilding it", stacklevel=3)


def _write_verified(content: str | bytes, extension: str, *args: Any, **kwargs: Any) -> tuple[str, str]:
    """Inductor's `write` (sources named by the hash of their content) keeps a file that already exists; here
    an existing file must also hold that content, else it is rewritten."""
    from torch._inductor import codecache

    basename, path = _INDUCTOR_WRITE(content, extension, *args, **kwargs)
    try:
        with open(path, "rb") as f:
            same = f.read() == (content.encode() if isinstance(content, str) else content)
    except OSError:
        same = False
    if not same:
        _corrupt(path, "content does not match its name")
        codecache.write_atomic(path, content, make_dirs=True)
    return basename, path


def _build_verified(lock_path: str, builders: Sequence[Any]) -> None:
    """Inductor's C++ build step (`_worker_compile_cpp`: build each target that does not exist), where an
    existing target is kept only when it matches the sha256 recorded when it was built, and every target built
    gets its sha256 recorded. A target without a record (a build that was interrupted) is rebuilt."""
    from torch._inductor.codecache import LOCK_TIMEOUT
    from torch.utils._filelock import FileLock

    with FileLock(lock_path, timeout=LOCK_TIMEOUT):
        for builder in builders:
            target = builder.get_target_file_path()
            record = f"{target}.sha256"
            if os.path.exists(target):
                try:
                    with open(record) as f:
                        expected = f.read().strip()
                except OSError:
                    expected = None
                if expected == _file_sha256(target):
                    continue
                if expected is not None:
                    _corrupt(target, "checksum mismatch")
                os.unlink(target)
            builder.build()
            tmp = f"{record}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(_file_sha256(target))
            os.replace(tmp, record)


_INDUCTOR_WRITE: Callable[..., tuple[str, str]] = None  # type: ignore[assignment]  (Inductor's, when patched)


def _verify_artifacts(done: patches.Applied) -> None:
    global _INDUCTOR_WRITE
    from torch._inductor import codecache

    _INDUCTOR_WRITE = codecache.write
    done.replace(codecache, "write", _write_verified)
    done.replace(codecache, "_worker_compile_cpp", _build_verified)


VERIFIED_ARTIFACTS = patches.declare(
    "verified-inductor-artifacts", "torch._inductor.codecache.write, torch._inductor.codecache._worker_compile_cpp "
    "(while the neuron compiler runs)", "a damaged compiled artifact in the cache is rebuilt instead of loaded",
    "tests/test_compile_cache.py::test_corrupt_compiled_artifacts_are_rebuilt", _verify_artifacts, when="on demand")


@contextlib.contextmanager
def verified_artifacts() -> Iterator[None]:
    """While the neuron compiler runs, Inductor writes and builds its artifacts through the verifying versions
    of its two file steps (`write`, `_worker_compile_cpp`), whatever its cache directory."""
    if patches.is_active(VERIFIED_ARTIFACTS):  # nested
        yield
        return
    patches.apply(VERIFIED_ARTIFACTS)
    try:
        yield
    finally:
        patches.undo(VERIFIED_ARTIFACTS)
