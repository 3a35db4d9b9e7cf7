"""Results rows -> a markdown report (tables: workload x engine per metric) and a PNG plot (matplotlib, optional)."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

from .config import TINY_PREFIX, BenchConfig

TINY_WARNING = ("**Tiny random model on a CPU: these numbers show that the suite runs end to end; they mean nothing "
                "for speed claims.**")


def _fmt(value) -> str:
    if isinstance(value, str):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 100:
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def _ordered(values) -> list:
    return list(dict.fromkeys(values))


def _workload_key(workload: str):
    """Sweep rows in question-count order, after the other workloads (in their first-seen order)."""
    if workload.startswith("sweep/q"):
        return (1, int(workload[len("sweep/q"):]))
    return (0, 0)


_METRIC_ORDER = ("tokens_per_request", "latency_p50_ms", "latency_p90_ms", "requests_per_s", "latency_p50_ms@",
                 "peak_memory_gib")


def _metric_key(metric: str):
    """Tables in a reading order: tokens, latency alone, throughput by concurrency, latency under load, memory."""
    base, at, n = metric.partition("@")
    group = base + at if base == "latency_p50_ms" and at else base
    rank = _METRIC_ORDER.index(group) if group in _METRIC_ORDER else len(_METRIC_ORDER)
    return (rank, int(n) if n.isdigit() else 0, metric)


def _table(rows: list[dict], metric: str, workloads: list[str], engines: list[str]) -> list[str]:
    cells = {(r["workload"], r["engine"]): ("skipped" if r["value"] is None and str(r["unit"]).startswith("skipped")
                                            else r["value"]) for r in rows if r["metric"] == metric}
    used = [w for w in workloads if any((w, e) in cells for e in engines)]
    if not used:
        return []
    lines = ["| workload | " + " | ".join(engines) + " |", "| --- |" + " --- |" * len(engines)]
    for workload in used:
        lines.append(f"| {workload} | " + " | ".join(_fmt(cells.get((workload, e))) for e in engines) + " |")
    return lines


def markdown(rows: list[dict], config: BenchConfig) -> str:
    """The report of a run: what ran where, then one table per metric (rows: workloads; columns: engines)."""
    models = _ordered(r["model"] for r in rows) or ["(none)"]
    out = [f"# Benchmark `{config.name}`", ""]
    if any(m.startswith(TINY_PREFIX) for m in config.models):
        out += [TINY_WARNING, ""]
    if config.notes:
        out += [config.notes, ""]
    hardware = ", ".join(_ordered(r["hardware"] for r in rows)) or "-"
    commits = ", ".join(_ordered(r["commit"] for r in rows)) or "-"
    tiny = all(m.startswith(TINY_PREFIX) for m in config.models)
    out += [f"- hardware: {hardware}", f"- commit: {commits}; written {datetime.date.today().isoformat()}",
            f"- {config.dtype}, random weights{'' if tiny else ' in the real shapes'}; Flide config overrides: "
            f"`{json.dumps(config.flide) if config.flide else 'none (configs/default.yaml)'}`"
            + "".join(f"; `flide:{name}` = `{json.dumps(o)}`" for name, o in config.ablations.items()),
            f"- latency alone: {config.repeats} timed run(s) of each of the first {config.latency_requests} requests "
            f"after {config.warmup} warm-up run(s); throughput: N in-process submitter threads for "
            f"{config.throughput_seconds:g} s, each `decide([r])` on its own (concurrent requests are not batched, "
            f"for Flide either); sweep rows: latency alone only", ""]
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        workloads = sorted(_ordered(r["workload"] for r in mine), key=_workload_key)
        engines = [e for e in _ordered(r["engine"] for r in mine) if e != "-"]
        out += [f"## {model}", ""]
        facts = {(r["workload"], r["metric"]): r["value"] for r in mine if r["engine"] == "-"}
        if facts:
            out += ["| workload | requests | questions / request | state tokens / request |",
                    "| --- | --- | --- | --- |"]
            for w in workloads:
                out.append(f"| {w} | {_fmt(facts.get((w, 'requests')))} | "
                           f"{_fmt(facts.get((w, 'questions_per_request')))} | "
                           f"{_fmt(facts.get((w, 'state_tokens_per_request')))} |")
            out.append("")
        metrics = sorted(_ordered(r["metric"] for r in mine if r["engine"] != "-" and r["metric"] != "error"),
                         key=_metric_key)
        titles = {"latency_p50_ms": "Latency of one request alone, median (ms)",
                  "latency_p90_ms": "Latency of one request alone, p90 (ms)",
                  "tokens_per_request": "Tokens computed per request",
                  "peak_memory_gib": "Peak GPU memory (GiB, weights included)"}
        for metric in metrics:
            if metric.startswith("requests_per_s@"):
                title = f"Requests/s, concurrency {metric.split('@')[1]}"
            elif metric.startswith("latency_p50_ms@"):
                title = f"Median latency under load, concurrency {metric.split('@')[1]} (ms)"
            else:
                title = titles.get(metric, metric)
            table = _table(mine, metric, workloads, engines)
            if table:
                out += [f"### {title}", ""] + table + [""]
        errors = [r for r in mine if r["metric"] == "error"]
        if errors:
            out += ["### Failed cells", ""] + [f"- {r['engine']} / {r['workload']}: {r['unit']}" for r in errors] + [""]
    return "\n".join(out)


def plot(rows: list[dict], config: BenchConfig, path: str | Path) -> bool:
    """A PNG: latency alone per workload, latency against the sweep's question count, and requests/s against
    concurrency per workload. Returns False (and writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = _ordered(r["model"] for r in rows)

    def series(r):
        return r["engine"] if len(models) == 1 else f"{r['engine']} ({r['model']})"

    measured = [r for r in rows if r["engine"] != "-" and r["metric"] != "error" and r["value"] is not None]
    names = _ordered(series(r) for r in measured)
    plain = sorted(_ordered(r["workload"] for r in measured if not r["workload"].startswith("sweep/")),
                   key=_workload_key)
    sweep = sorted(_ordered(r["workload"] for r in measured if r["workload"].startswith("sweep/")), key=_workload_key)
    concurrent = [w for w in plain if any(r["workload"] == w and r["metric"].startswith("requests_per_s@")
                                          for r in measured)]
    panels = 2 + len(concurrent)
    cols = 3
    fig, axes = plt.subplots(math.ceil(panels / cols), cols, figsize=(5 * cols, 4 * math.ceil(panels / cols)),
                             squeeze=False)
    axes = axes.ravel()
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}

    ax = axes[0]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        values = {r["workload"]: r["value"] for r in measured if series(r) == name and r["metric"] == "latency_p50_ms"}
        xs = [j + i * width for j, w in enumerate(plain) if w in values]
        ax.bar(xs, [values[w] for w in plain if w in values], width, label=name, color=colors[name])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(plain))], plain, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title("one request alone, median latency")
    ax.legend(fontsize=7)

    ax = axes[1]
    for name in names:
        points = sorted((int(r["workload"][len("sweep/q"):]), r["value"]) for r in measured
                        if series(r) == name and r["metric"] == "latency_p50_ms" and r["workload"] in sweep)
        if points:
            ax.plot(*zip(*points), marker="o", label=name, color=colors[name])
    counts = sorted({int(w[len("sweep/q"):]) for w in sweep})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if counts:
        ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_xlabel("questions on one state")
    ax.set_ylabel("ms")
    ax.set_title("sweep: latency against questions")
    if sweep:
        ax.legend(fontsize=7)

    for ax, workload in zip(axes[2:], concurrent):
        for name in names:
            points = sorted((int(r["metric"].split("@")[1]), r["value"]) for r in measured
                            if series(r) == name and r["workload"] == workload
                            and r["metric"].startswith("requests_per_s@"))
            if points:
                ax.plot(*zip(*points), marker="o", label=name, color=colors[name])
        levels = sorted({int(r["metric"].split("@")[1]) for r in measured if r["workload"] == workload
                         and r["metric"].startswith("requests_per_s@")})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("concurrent submitters")
        ax.set_ylabel("requests/s")
        ax.set_title(f"{workload}: throughput")
        ax.legend(fontsize=7)
    for ax in axes[panels:]:
        ax.axis("off")
    title = f"{config.name} ({', '.join(models)}; {', '.join(_ordered(r['hardware'] for r in rows))})"
    if any(m.startswith(TINY_PREFIX) for m in config.models):
        title += "\ntiny random model on a CPU: not a speed result"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
