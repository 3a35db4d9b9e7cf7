"""Where `Engine.prepare` (validating, rendering, tokenizing a request: the host's share of latency alone) spends its
time, per bench workload, on this machine's CPUs. No GPU: the engine is a tiny random Qwen3.5 sized to the real
tokenizer's vocabulary, which is all `prepare` reads of a model (its head's label rows).

    python benchmarks/profile_prepare.py [--tokenizer shared/models/qwen3_5] [--data DIR]
        [--workloads sweep1 sweep64 quality multirc race] [--top 15] [--out FILE.json]

Per workload: the median ms of `prepare` over its requests (each run `--repeat` times, medians of medians, as the
bench's `prepare_p50_ms`; piece and question caches off, as the speed grids run), then a cProfile of the same calls
sorted by own time. `--rust-pieces`: also the Rust tokenizer's batch call alone on the workload's states, cut as
`encode_trunk` cuts them, at each `--piece-chars` size, with the thread count the Rust side runs (RAYON_NUM_THREADS
in the environment sets it; it is read once per process).
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flide  # noqa: E402
from flide.bench import workloads as bench_workloads  # noqa: E402
from flide.loading import load_tokenizer  # noqa: E402
from flide.models.tiny import tiny_model  # noqa: E402
from flide.requests import piece_cuts  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenization import median_ms  # noqa: E402


def requests_of(name: str, tokenizer, data: str | None, limit: int) -> list[dict]:
    """`sweep<n>`: the sweep's request of n questions; else a bench workload's first `limit` requests."""
    if name.startswith("sweep"):
        return bench_workloads.build("sweep", tokenizer, 1, data_dir=data)[f"sweep/q{name[5:]}"]
    return bench_workloads.build(name, tokenizer, limit, data_dir=data)[name]


def profile_rows(fn, items, top: int) -> list[dict]:
    profile = cProfile.Profile()
    profile.enable()
    for item in items:
        fn(item)
    profile.disable()
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = []
    for (path, line, func), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{Path(path).name}:{line}({func})", "calls": calls, "own_ms": own * 1e3 / len(items),
                     "cumulative_ms": cumulative * 1e3 / len(items)})
    return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def ab_rounds(prepare, items, args) -> list[dict]:
    """Medians of `prepare` with the class defaults and with `args.ab`'s settings, alternating round by round."""
    from flide.requests import PromptTokenizer

    settings = {}
    for pair in args.ab:
        name, _, value = pair.partition("=")
        if not hasattr(PromptTokenizer, name):
            raise ValueError(f"--ab: PromptTokenizer has no setting {name!r}")
        settings[name] = ast.literal_eval(value)
    defaults = {name: getattr(PromptTokenizer, name) for name in settings}
    rounds = []
    for _ in range(args.ab_rounds):
        row = {"default": median_ms(prepare, items, args.repeat)}
        for name, value in settings.items():
            setattr(PromptTokenizer, name, value)
        try:
            row["set"] = median_ms(prepare, items, args.repeat)
        finally:
            for name, value in defaults.items():
                setattr(PromptTokenizer, name, value)
        rounds.append(row)
    return rounds


def main() -> None:
    here = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=str(here / "shared" / "models" / "qwen3_5"))
    parser.add_argument("--data", default=None, help="the shared data folder (default: flide.workloads' own)")
    parser.add_argument("--workloads", nargs="+", default=["sweep1", "sweep64", "quality", "multirc", "race"])
    parser.add_argument("--limit", type=int, default=8, help="requests per workload (sweep: one)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--rust-pieces", action="store_true")
    parser.add_argument("--piece-chars", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    parser.add_argument("--ab", nargs="+", default=[], metavar="NAME=VALUE",
                        help="also time prepare with these PromptTokenizer class settings (e.g. SPLIT_BATCHES=False), "
                             "interleaved with the defaults in the same process: prepare_ms_ab, ab_rounds")
    parser.add_argument("--ab-rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    engine = flide.patch(tiny_model("qwen3_5_text", vocab_size=len(tokenizer)), tokenizer,
                         config={"runtime": {"piece_cache_chars": 0, "question_cache_entries": 0}})
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rayon = os.environ.get("RAYON_NUM_THREADS", "default")
    print(f"{cpus} CPUs, RAYON_NUM_THREADS={rayon}")
    out = []
    for name in args.workloads:
        items = requests_of(name, tokenizer, args.data, args.limit)
        for item in items[:2]:
            engine.prepare(item)
        row = {"workload": name, "requests": len(items), "cpus": cpus, "rayon_threads": rayon,
               "prepare_ms": median_ms(engine.prepare, items, args.repeat),
               "profile": profile_rows(engine.prepare, items * args.repeat, args.top)}
        print(f"\n{name}: prepare {row['prepare_ms']:.2f} ms (median of {len(items)} requests)")
        if args.ab:
            row["ab"], row["ab_rounds"] = " ".join(args.ab), ab_rounds(engine.prepare, items, args)
            a, b = (statistics.median(r[k] for r in row["ab_rounds"]) for k in ("default", "set"))
            row["prepare_ms_default"], row["prepare_ms_ab"] = a, b
            print(f"  A/B over {args.ab_rounds} interleaved rounds: default {a:.3f} ms, {row['ab']} {b:.3f} ms")
        for r in row["profile"]:
            print(f"  {r['own_ms']:7.3f} own {r['cumulative_ms']:7.3f} cum ms {r['calls']:6d} calls  {r['function']}")
        if args.rust_pieces:
            backend = tokenizer._tokenizer
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            states = [item["state"] for item in items if isinstance(item["state"], str)]
            row["rust_pieces_ms"] = {}
            for chars in args.piece_chars:
                batches = []
                for text in states:
                    cuts = [0, *piece_cuts(text, chars), len(text)]
                    batches.append([text[a:b] for a, b in zip(cuts, cuts[1:])])
                ms = median_ms(lambda b: encode(b, add_special_tokens=False), batches, args.repeat)
                row["rust_pieces_ms"][chars] = ms
                print(f"  rust batch of a state's pieces of ~{chars} characters: {ms:.2f} ms")
            whole = median_ms(lambda t: encode([t], add_special_tokens=False), states, args.repeat)
            row["rust_pieces_ms"]["whole"] = whole
            print(f"  rust, each state whole: {whole:.2f} ms")
        out.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
