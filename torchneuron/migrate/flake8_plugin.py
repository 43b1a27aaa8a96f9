"""flake8 plugin: the `check` rules as flake8 errors (`NRN001 ...`); flake8 itself handles `# noqa`."""
from __future__ import annotations

from collections.abc import Iterator
from importlib import metadata

from .check import analyze


class Plugin:
    name = "torchneuron"
    try:
        version = metadata.version("torchneuron")
    except metadata.PackageNotFoundError:
        version = "0"

    def __init__(self, tree: object, lines: list[str], filename: str = "<stdin>"):
        self.lines, self.filename = lines, filename  # the source text, not flake8's ast `tree`: we need libcst

    def run(self) -> Iterator[tuple[int, int, str, type]]:
        for f in analyze("".join(self.lines), self.filename, noqa=False).findings:
            yield f.line, f.col - 1, f"{f.code} {f.message}", type(self)
