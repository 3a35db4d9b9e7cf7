"""The markdown table beside an op benchmark's JSON rows (`{"workload", "model", "engine", "value", "floor_ms",
"x_floor", ...}`): one line per row, in the order measured.

    python benchmarks/ops/tables.py benchmarks/results/ops_fork_attention_h200.json   # writes the .md beside it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def markdown(rows: list[dict]) -> str:
    lines = ["| workload | model | engine | tokens | ms | floor ms | x floor |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['model']} | {r['engine']} | {r.get('tokens', '')} | {r['value']:.4f} | "
                     f"{r['floor_ms']:.4f} | {r['x_floor']:.1f} |")
    hardware = sorted({r.get("hardware", "") for r in rows} - {""})
    return (f"Hardware: {', '.join(hardware) or 'unknown'}. Medians of CUDA-graph replays.\n\n" if rows else "") + \
        "\n".join(lines) + "\n"


def write_beside(json_path: str | Path, rows: list[dict]) -> Path:
    out = Path(json_path).with_suffix(".md")
    out.write_text(markdown(rows))
    return out


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(write_beside(name, json.loads(Path(name).read_text())))
