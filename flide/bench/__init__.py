"""The benchmark suite: YAML configs (configs/bench/) -> a grid of models x workloads x engines -> results.

    python -m flide.bench configs/bench/cpu_smoke.yaml      # writes benchmarks/results/cpu_smoke.{json,md,png}

- `config.py`: the YAML file -> a frozen `BenchConfig` (unknown keys are errors listing the valid ones),
- `workloads.py`: the named workloads (race1, race, quality1, quality, multirc, sweep) from `flide.workloads`,
- `engines.py`: flide, pipeline, and the plain-transformers baselines of benchmarks/baselines behind
  `decide(requests) -> answers`,
- `runner.py`: measures the grid and writes the results (`main(argv)` is the command line),
- `server.py` + `loadgen.py`: the `http` engine's `flide serve` subprocess and its closed-loop HTTP clients
  (`python -m flide.bench.loadgen --url ... --requests FILE` drives any System One server),
- `fidelity.py`: `mode: fidelity`, answers against a float32 reference (Agr., TV, P99, Flip, Stab.),
- `report.py`: the markdown tables and the plots.

Importing this package loads nothing heavy; torch and transformers come with the runner.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """`python -m flide.bench CONFIG.yaml [--out DIR] [--workloads ...] [--engines ...]`: see `flide.bench.runner`."""
    from .runner import main as run_main

    return run_main(argv)
