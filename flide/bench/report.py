"""Results rows -> a markdown report and a PNG plot (matplotlib, optional).

Speed runs (`markdown`, `plot`): tables workload x engine per metric, the http engine's closed-loop levels in a table of
their own. Fidelity runs (`fidelity_markdown`, `fidelity_plot`): a table like the paper's Table 4 (Agr., TV, P99,
Flip, Stab. per workload and engine) and the distribution of the per-question TV per engine.
"""

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


_METRIC_ORDER = ("tokens_per_request", "latency_p50_ms", "latency_p90_ms", "prepare_p50_ms", "latency_submit_p50_ms",
                 "latency_inprocess_p50_ms", "latency_http_gap_p50_ms", "requests_per_s",
                 "latency_p50_ms@", "peak_memory_gib", "peak_reserved_gib")
# Metrics of the http engine only: its own table ("HTTP server"), not one table each
_HTTP_METRICS = ("http_max_abs_diff", "latency_p99_ms@", "errors@", "answered@", "mean_round_requests@",
                 "client_cpu_share@", "slow_")


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
            (f"- latency alone: {config.repeats} timed run(s) of each of the first {config.latency_requests} requests "
             f"after {config.warmup} warm-up run(s); throughput: N in-process submitter threads for "
             f"{config.throughput_seconds:g} s, one request at a time each: Flide's threads submit through "
             f"`Engine.submit`, which packs concurrent requests into shared rounds (as `flide serve` does), the "
             f"baselines run each request on its own; the `http` engine: `flide serve` with N closed-loop HTTP "
             f"clients; sweep rows: latency alone only"), ""]
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
        metrics = sorted(_ordered(r["metric"] for r in mine if r["engine"] != "-" and r["metric"] != "error"
                                  and not r["metric"].startswith(_HTTP_METRICS)), key=_metric_key)
        titles = {"latency_p50_ms": "Latency of one request alone, median (ms)",
                  "latency_p90_ms": "Latency of one request alone, p90 (ms)",
                  "prepare_p50_ms": "Of which preparing it (validating, rendering, tokenizing: Engine.prepare), "
                                    "median (ms)",
                  "latency_submit_p50_ms": "Latency of one request alone through Engine.submit (the server's path), "
                                           "median (ms)",
                  "latency_inprocess_p50_ms": "Latency of the same requests alone in process (the HTTP engine's twin, "
                                              "each timed right after its HTTP request), median (ms)",
                  "latency_http_gap_p50_ms": "HTTP minus in-process latency of one request alone, median of the pairs "
                                             "(ms)",
                  "tokens_per_request": "Tokens computed per request",
                  "peak_memory_gib": "Peak GPU memory allocated during the runs (GiB, weights included)",
                  "peak_reserved_gib": "Peak GPU memory reserved (GiB: weights, CUDA graphs' pools, allocator cache)"}
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
        out += _http_table(mine, workloads)
        errors = [r for r in mine if r["metric"] == "error"]
        if errors:
            out += ["### Failed cells", ""] + [f"- {r['engine']} / {r['workload']}: {r['unit']}" for r in errors] + [""]
    return "\n".join(out)


def _http_table(rows: list[dict], workloads: list[str]) -> list[str]:
    """The http engine's closed-loop levels: one line per workload and client count."""
    mine = {(r["workload"], r["metric"]): r for r in rows if r["engine"] == "http"}
    levels = sorted({(w, int(m.split("@")[1])) for w, m in mine if m.startswith("requests_per_s@")},
                    key=lambda wn: (workloads.index(wn[0]) if wn[0] in workloads else len(workloads), wn[1]))
    if not levels:
        return []

    def value(workload, metric):
        row = mine.get((workload, metric))
        if row is None:
            return None
        if row["value"] is None and str(row["unit"]).startswith("skipped"):
            return "skipped"
        return row["value"]

    out = ["### HTTP server (`flide serve`, closed-loop clients)", "",
           ("Each client posts a request, waits for its answer, posts the next (keep-alive connection each). Latencies "
            "are of answered requests; errors are non-200 answers and failed connections; mean round: requests per "
            "round of the server meanwhile (its /metrics); client CPU: busy share of the busiest client process; "
            "slow: the server's rounds / prepares / queue waits meanwhile over 0.25 s (where a latency tail comes "
            "from)."), "",
           "| workload | clients | requests/s | p50 ms | p99 ms | answered | errors | mean round | client CPU | slow |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for workload, n in levels:
        errors = mine.get((workload, f"errors@{n}"))
        error_text = _fmt(value(workload, f"errors@{n}"))
        if errors and errors["value"]:
            error_text += f" ({str(errors['unit']).partition('(')[2].rstrip(')')})"
        out.append(f"| {workload} | {n} | {_fmt(value(workload, f'requests_per_s@{n}'))} | "
                   f"{_fmt(value(workload, f'latency_p50_ms@{n}'))} | {_fmt(value(workload, f'latency_p99_ms@{n}'))} | "
                   f"{_fmt(value(workload, f'answered@{n}'))} | {error_text} | "
                   f"{_fmt(value(workload, f'mean_round_requests@{n}'))} | "
                   f"{_fmt(value(workload, f'client_cpu_share@{n}'))} | "
                   + " / ".join(_fmt(value(workload, f"slow_{w}@{n}")) for w in ("rounds", "prepares", "queue_waits"))
                   + " |")
    checks = [(w, r["value"]) for (w, m), r in mine.items() if m == "http_max_abs_diff"]
    if checks:
        out += ["", "Answers over HTTP against the in-process engine (the first requests, each alone), largest "
                    "probability difference: " + ", ".join(f"{w} {_fmt(v) if v else '0'}" for w, v in checks) + "."]
    return out + [""]


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


# ---- fidelity ----
FIDELITY_COLUMNS = (("agreement_pct", "Agr."), ("tv_points", "TV"), ("p99_points", "P99"), ("flip_pct", "Flip"),
                    ("stability_pct", "Stab."))


def _pct(value) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 0.01:
        return f"{value:.2f}"
    return f"{value:.1e}"


def fidelity_markdown(rows: list[dict], config: BenchConfig) -> str:
    """The fidelity report: what the reference was, then per model a Table-4-like table (rows: workload x engine;
    columns: questions, Agr., TV, P99, Flip, Stab.; all in percent)."""
    models = _ordered(r["model"] for r in rows) or ["(none)"]
    out = [f"# Answer fidelity `{config.name}`", ""]
    if any(m.startswith(TINY_PREFIX) for m in config.models):
        out += ["**Tiny random models on a CPU: this run checks that the metrics work; the values carry no claim.**",
                ""]
    if config.notes:
        out += [config.notes, ""]
    hardware = ", ".join(_ordered(r["hardware"] for r in rows)) or "-"
    commits = ", ".join(_ordered(r["commit"] for r in rows)) or "-"
    scale = config.final_norm_scale
    if scale == "auto":  # the picked scales, from the rows
        picked = _ordered(f"{r['value']:g}" for r in rows if r["metric"] == "final_norm_scale")
        scale_text = f"auto: {', '.join(picked) or 'not picked yet'}"
    else:
        scale_text = f"{scale:g}" if scale else ""
    low, high = config.fidelity.top_probability_range
    out += [f"- hardware: {hardware}", f"- commit: {commits}; written {datetime.date.today().isoformat()}",
            (f"- engines in {config.dtype}; Flide config overrides: "
             f"`{json.dumps(config.flide) if config.flide else 'none (configs/default.yaml)'}`"),
            ("- reference: transformers' `pipeline(\"decision\")` on a float32 copy of the same weights, same device, "
             "each question in its own forward pass; TF32 off; transformers' torch path for the Gated DeltaNet and "
             "its conv (fla / causal-conv1d kernels replaced when installed: with fla the float32 pipeline itself "
             "drifts by up to 3e-3)"),
            (f"- random weights; final_norm_scale: {scale_text} (the final norm's gain x that, so answers are peaked "
             f"like a trained model's; " + ("picked at the start of the run, the candidate whose typical top "
                                           "probability is nearest 0.7)" if scale == "auto" else
                                           "picked with `python -m flide.bench CONFIG --top-probability ...`)"))
            if scale else "- random weights, final norm as drawn (answers close to uniform: no final_norm_scale)",
            ("- Agr.: % of questions with the reference's top answer; TV: mean total variation distance (points, "
             "x100); P99: 99th percentile of the largest change of one option's probability (points); Flip: % of "
             "0.5-threshold decisions taken differently (noul: P(yes) > 0.5, one per question; choice/score: each "
             "option's probability > 0.5, one per option); Stab.: % of questions whose top answer with "
             f"{config.fidelity.stability_threads} in-process submitters (Flide: rounds of random composition, up to "
             f"{config.fidelity.stability_max_group} requests) equals the one with a single submitter"), ""]
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        values = {(r["workload"], r["engine"], r["metric"]): r["value"] for r in mine}
        workloads = _ordered(r["workload"] for r in mine if r["engine"] not in ("-", "reference"))
        engines = [e for e in _ordered(r["engine"] for r in mine) if e not in ("-", "reference")]
        out += [f"## {model}", "", "| workload | requests | questions | reference mean top probability |",
                "| --- | --- | --- | --- |"]
        for workload in _ordered(r["workload"] for r in mine):
            top = values.get((workload, "reference", "mean_top_probability"))
            flag = " (outside the aimed range)" if top is not None and not low <= top <= high else ""
            questions = values.get((workload, "-", "questions_per_request"))
            requests = values.get((workload, "-", "requests"))
            total = round(questions * requests) if questions is not None and requests is not None else None
            out.append(f"| {workload} | {_fmt(requests)} | {_fmt(total)} | "
                       f"{'-' if top is None else f'{top:.3f}'}{flag} |")
        replaced = [r for r in mine if r["metric"] == "gdn_kernels_replaced"]
        if replaced:
            out += ["", f"Reference kernels replaced by transformers' torch functions: {replaced[0]['unit']}."]
        out += ["", "| workload | engine | " + " | ".join(title for _, title in FIDELITY_COLUMNS) + " |",
                "| --- | --- |" + " --- |" * len(FIDELITY_COLUMNS)]
        for workload in workloads:
            for engine in engines:
                if not any((workload, engine, metric) in values for metric, _ in FIDELITY_COLUMNS):
                    continue
                out.append(f"| {workload} | {engine} | " + " | ".join(_pct(values.get((workload, engine, metric)))
                                                                    for metric, _ in FIDELITY_COLUMNS) + " |")
        out.append("")
        errors = [r for r in mine if r["metric"] == "error"]
        if errors:
            out += ["### Failed cells", ""] + [f"- {r['engine']} / {r['workload']}: {r['unit']}" for r in errors] + [""]
    return "\n".join(out)


def fidelity_plot(rows: list[dict], config: BenchConfig, path: str | Path) -> bool:
    """A PNG: per workload, the distribution (CDF through the stored percentiles) of the per-question total variation
    distance of each engine from the float32 reference, log scale. False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    floor = 1e-6  # points: a TV of exactly 0 (bitwise equal answers) is drawn here
    models = _ordered(r["model"] for r in rows)
    quantiles = [r for r in rows if r["metric"].startswith("tv_points_q") and r["value"] is not None]
    panels = _ordered((r["model"], r["workload"]) for r in quantiles)
    if not panels:
        return False
    cols = min(3, len(panels))
    fig, axes = plt.subplots(math.ceil(len(panels) / cols), cols, figsize=(5 * cols, 4 * math.ceil(len(panels) / cols)),
                             squeeze=False)
    axes = axes.ravel()
    engines = _ordered(r["engine"] for r in quantiles)
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(engines)}
    for ax, (model, workload) in zip(axes, panels):
        for engine in engines:
            points = sorted((int(r["metric"][len("tv_points_q"):]), r["value"]) for r in quantiles
                            if r["model"] == model and r["workload"] == workload and r["engine"] == engine)
            if points:
                ax.plot([max(v, floor) for _, v in points], [k / 100 for k, _ in points], marker=".",
                        label=engine, color=colors[engine])
        ax.set_xscale("log")
        ax.set_xlabel(f"total variation distance from float32 (points; 0 drawn at {floor:g})")
        ax.set_ylabel("share of questions")
        ax.set_title(workload if len(models) == 1 else f"{workload} ({model})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.axis("off")
    title = f"{config.name}: answers against a float32 reference ({', '.join(_ordered(r['hardware'] for r in rows))})"
    if config.final_norm_scale:
        title += f"\nfinal_norm_scale {config.final_norm_scale}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
