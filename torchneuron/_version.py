"""The package version (pyproject.toml's), low enough for every layer to read (the compile cache keys on it)."""
__version__ = "0.1.0"
