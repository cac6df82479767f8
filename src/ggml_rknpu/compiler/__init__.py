"""Pure functions: matmul shape + dtypes -> ``Program`` (regcmd words, task table,
relocations). No I/O; deterministic; golden-testable."""
