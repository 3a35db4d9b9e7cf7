"""Host-side cost of turning requests into tokens: Flide's split tokenization (each state once) against every prompt
whole (Flide's `tokenization: full`) and against transformers' `prepare_inputs`, on the QuALITY articles, RACE and
MultiRC. Flide's piece and question caches are off: every request costs what it costs the first time it is seen.

    python benchmarks/tokenization.py [--tokenizer ../shared/models/qwen3_5] [--out benchmarks/results/tokenization.json]

`--piece-chars 2048 1024 512` adds a `flide-split@<n>` row per size: a long state cut into pieces of about n
characters (`PromptTokenizer.PIECE_CHARS`), which the Rust tokenizer encodes in parallel, one CPU a piece;
`--engines flide-split` leaves out the others (transformers' prepare_inputs reads the vocabulary per request);
`flide-split-rust` (not run by default) encodes every piece with the Rust tokenizer, none with `ascii_bpe`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.decision import DecisionConfig, prepare_inputs  # noqa: E402

from flide import workloads  # noqa: E402
from flide.loading import load_tokenizer  # noqa: E402
from flide.piece_cache import PieceCache  # noqa: E402
from flide.requests import PromptTokenizer, parse_request  # noqa: E402


def median_ms(fn, requests, repeat: int) -> float:
    """Median over requests of the median over `repeat` runs, in ms."""
    per_request = []
    for request in requests:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn(request)
            times.append((time.perf_counter() - start) * 1e3)
        per_request.append(statistics.median(times))
    return statistics.median(per_request)


def main() -> None:
    here = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", default=str(here.parent / "shared" / "models" / "qwen3_5"))
    parser.add_argument("--out", default=str(here / "benchmarks" / "results" / "tokenization.json"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["quality", "race", "multirc"])
    parser.add_argument("--engines", nargs="+", default=["flide-split", "flide-full", "transformers-prepare_inputs"],
                        choices=["flide-split", "flide-split-rust", "flide-full", "transformers-prepare_inputs"])
    parser.add_argument("--piece-chars", nargs="+", type=int, default=[],
                        help="also flide-split with a long state cut into pieces of about this many characters")
    args = parser.parse_args()

    tok = load_tokenizer(args.tokenizer)
    config = DecisionConfig()
    split, full = (PromptTokenizer(tok, config, mode, piece_cache=PieceCache(0), question_cache_entries=0)
                   for mode in ("split", "full"))
    rust = PromptTokenizer(tok, config, "split", piece_cache=PieceCache(0), question_cache_entries=0)
    rust.ascii_bpe = None  # every piece through the Rust tokenizer's parallel batch, none through ascii_bpe
    tok.get_vocab()  # the sentinels are added by now; warm the vocabulary cache transformers reads per request
    sets = {"quality": lambda: workloads.quality(), "race": lambda: workloads.race(limit=64),
            "multirc": lambda: workloads.multirc(limit=16)}
    rows = []
    hardware = f"{platform.processor() or platform.machine()} (1 process, {len(os.sched_getaffinity(0))} CPUs)"
    for name in args.workloads:
        requests = sets[name]()
        parsed = [parse_request(r, config, 64) for r in requests]
        questions = statistics.mean(len(q) for _, q in parsed)
        state_tokens = statistics.mean(len(split.prepare(s, q).trunks[0]) for s, q in parsed)
        engines = [("flide-split", lambda p: split.prepare(*p), parsed),
                   ("flide-split-rust", lambda p: rust.prepare(*p), parsed),
                   ("flide-full", lambda p: full.prepare(*p), parsed),
                   ("transformers-prepare_inputs", lambda r: prepare_inputs(config, r, tok), requests)]
        engines = [e for e in engines if e[0] in args.engines]
        for chars in args.piece_chars:
            pieces = PromptTokenizer(tok, config, "split", piece_cache=PieceCache(0), question_cache_entries=0)
            pieces.PIECE_CHARS = chars
            engines.append((f"flide-split@{chars}", lambda p, t=pieces: t.prepare(*p), parsed))
        for engine, fn, items in engines:
            value = median_ms(fn, items, args.repeat)
            rows.append({"workload": name, "engine": engine, "metric": "tokenize_ms_per_request", "value": value,
                         "unit": "ms", "hardware": hardware, "questions_per_request": questions,
                         "state_tokens": state_tokens})
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"{'workload':8} {'engine':28} {'ms/request':>10}  (questions/request, state tokens)")
    for row in rows:
        print(f"{row['workload']:8} {row['engine']:28} {row['value']:10.2f}  ({row['questions_per_request']:.1f}, "
              f"{row['state_tokens']:.0f})")


if __name__ == "__main__":
    main()
