"""Medians of `flide serve`'s request-log phases (JSON log: read_ms, prepare_ms, wait_ms, ms) for the one-client gap
of issue 4: where a request's time goes inside the server, next to the bench's HTTP and in-process latencies.

    python benchmarks/http_phases.py /tmp/flide_bench_http_*/server_*.log
"""

from __future__ import annotations

import json
import statistics
import sys


def phases(lines) -> dict[str, float]:
    """Median of each phase over the successful request lines (status 200)."""
    rows = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("msg") == "request" and entry.get("status") == 200:
            rows.append(entry)
    keys = ("read_ms", "prepare_ms", "wait_ms", "ms")
    out = {"requests": len(rows)}
    for key in keys:
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = round(statistics.median(values), 3)
    return out


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            print(path, json.dumps(phases(f)))
