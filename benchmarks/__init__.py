"""conveyor's benchmarks: one command, ``python -m benchmarks`` (see benchmarks/README.md)."""
