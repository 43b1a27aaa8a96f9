"""Migration off CUDA: `check` finds lock-in, `fix` rewrites what is safe; both static (no torch import).

The rule catalogue is `rules.RULES`; docs/migration.md is generated from it.
"""
