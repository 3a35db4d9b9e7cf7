"""`flide` command line.

    flide decide [--model PATH_OR_HUB_ID] [--config YAML] [--random-weights] [--tokenizer PATH] [--batch-invariant]
                 REQUEST.json|-
    flide bench  CONFIG.yaml [--workloads ...] [--engines ...] [--out DIR] [--dry-run]
    flide serve  [--model PATH_OR_HUB_ID] [--config YAML] [--random-weights] [--tokenizer PATH] [--batch-invariant]
                 [--host 127.0.0.1] [--port 8000] [--timeout S] [--max-queue N] [--prepare-processes N]
                 [--log-format text|json] [--checkpoint-cache-gb GB]

REQUEST.json holds one System One request or a list of them ('-' reads standard input); the answers are printed as
JSON. `serve` answers POST /v1/systemone over HTTP (see flide/serve). Without --model, an embedded tiny Qwen3.5 with
random weights answers (offline; it says so on stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _build_engine(args):
    import flide
    from flide.config import load_config

    cfg = load_config(args.config)
    if args.batch_invariant:
        cfg = cfg.replace(kernels={"batch_invariant": True})
    if args.model is None:
        from flide.models.tiny import tiny_model, tiny_tokenizer

        print("flide: no --model given: answering with the embedded tiny Qwen3.5 (qwen3_5_text) whose weights are "
              "RANDOM; its answers carry no meaning. Pass --model PATH for a real checkpoint.", file=sys.stderr)
        return flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer(), cfg)
    if args.random_weights:
        from flide.loading import load_tokenizer, random_model

        model = random_model(args.model, dtype="float32" if cfg.runtime.dtype == "auto" else cfg.runtime.dtype,
                             device=cfg.runtime.device)
        print(f"flide: {args.model}: RANDOM weights in the shapes of its config; answers carry no meaning.",
              file=sys.stderr)
        return flide.patch(model, load_tokenizer(args.tokenizer or args.model), cfg)
    return flide.Engine.from_pretrained(args.model, config=cfg)


def _read_requests(path: str):
    text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise SystemExit(f"flide: {path}: not valid JSON ({error.msg} at line {error.lineno} column {error.colno}).")


def cmd_decide(args) -> int:
    from flide.requests import RequestError

    try:
        requests = _read_requests(args.request)
    except OSError as error:
        print(f"flide: cannot read {args.request}: {error.strerror}", file=sys.stderr)
        return 2
    try:
        engine = _build_engine(args)
    except ValueError as error:
        print(f"flide: {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        answers = engine.decide(requests)
    except RequestError as error:
        print(f"flide: bad request: {error}", file=sys.stderr)
        return 2
    if args.timing:
        print(f"flide: answered in {(time.perf_counter() - start) * 1e3:.1f} ms", file=sys.stderr)
    print(json.dumps(answers, indent=2, ensure_ascii=False))
    return 0


TINY_NAME = "flide-tiny-qwen3.5-random"


def cmd_serve(args) -> int:
    from flide.config import load_config

    from flide.serve.logs import setup_logging

    setup_logging(args.log_format, logging.DEBUG if args.verbose else logging.INFO)
    log = logging.getLogger("flide.serve")
    overrides = {key: value for key, value in (("request_timeout_s", args.timeout), ("max_queue", args.max_queue),
                                               ("prepare_processes", args.prepare_processes)) if value is not None}
    try:
        cfg = load_config(args.config)
        if overrides:
            cfg = cfg.replace(serve=overrides)
        if args.checkpoint_cache_gb is not None:  # > 0: checkpoints on with this budget; 0: off
            gb = args.checkpoint_cache_gb
            cfg = cfg.replace(checkpoints={"enabled": gb > 0, **({"cache_gb": gb} if gb > 0 else {})})
    except ValueError as error:
        print(f"flide: {error}", file=sys.stderr)
        return 2
    args.config = cfg
    start = time.perf_counter()
    log.info("loading %s", args.model or "the embedded tiny model (no --model)")
    try:
        engine = _build_engine(args)
    except ValueError as error:
        print(f"flide: {error}", file=sys.stderr)
        return 2
    from flide.serve import create_app, model_name_of, run_server

    name = TINY_NAME if args.model is None else model_name_of(engine, args.model)
    model = engine.model
    params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %s, %.1fM parameters, %s on %s; loaded in %.1f s", name, model.config.model_type, params / 1e6,
             str(next(model.parameters()).dtype).replace("torch.", ""), engine.device, time.perf_counter() - start)
    kernels = engine.kernels
    log.info("kernels: %s%s", ", ".join(f"{op} {getattr(kernels, op)}" for op in ("fork_attention", "gated_delta",
                                                                              "fork_conv", "gated_norm", "linear",
                                                                              "gated_mlp", "readout")),
             "; batch-invariant mode" if kernels.batch_invariant else "")
    if engine.checkpoints is not None:
        log.info("checkpoints on: cache %.2f GiB, states from %d tokens, margin %d", cfg.checkpoints.cache_gb,
                 cfg.checkpoints.min_state_tokens, cfg.checkpoints.margin_tokens)
    warm = time.perf_counter()
    engine.decide({"state": "Warm-up.", "questions": {"ok": {"type": "noul", "instructions": "Ready?"}}})
    log.info("warm-up round: %.0f ms", (time.perf_counter() - warm) * 1e3)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s: the server has no authentication; anyone who reaches it can use it", args.host)
    log.info("serving %s on http://%s:%d (POST /v1/systemone, GET /health, /v1/models, /metrics, /docs)", name,
             args.host, args.port)
    run_server(create_app(engine, name, cfg.serve), args.host, args.port)
    return 0


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint folder or hub id (default: the embedded tiny random model)")
    parser.add_argument("--config", help="engine YAML config (default: configs/default.yaml's values)")
    parser.add_argument("--random-weights", action="store_true",
                        help="build --model from its config.json with random weights (benchmarks, tests)")
    parser.add_argument("--tokenizer", help="tokenizer folder, when it is not the model's")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="batch-invariant mode (kernels.batch_invariant): every answer has the same bits whatever "
                             "else shares its round")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark runner owns its arguments (see `flide bench --help`)
        from flide.bench import main as bench_main

        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="flide", description="Flat-graph inference for decision models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")
    sub = parser.add_subparsers(dest="command", required=True)
    decide = sub.add_parser("decide", help="answer System One requests from a JSON file and print the answers")
    decide.add_argument("request", help="a JSON file with one request or a list of requests; '-' for stdin")
    _model_arguments(decide)
    decide.add_argument("--timing", action="store_true", help="print the answering time on stderr")
    decide.set_defaults(func=cmd_decide)
    serve = sub.add_parser("serve", help="serve POST /v1/systemone over HTTP (continuous rounds)")
    _model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--timeout", type=float, help="seconds from arrival to answer, else 504 "
                                                     "(default: serve.request_timeout_s of the config, 60)")
    serve.add_argument("--max-queue", type=int, help="requests waiting for a round before 503s "
                                                     "(default: serve.max_queue of the config, 1024)")
    serve.add_argument("--prepare-processes", type=int,
                       help="worker processes that render and tokenize requests (0: threads only; default: "
                            "serve.prepare_processes of the config, 0)")
    serve.add_argument("--checkpoint-cache-gb", type=float,
                       help="turn checkpoints of growing states on with this cache budget in GiB (0: off; default: "
                            "checkpoints.* of the config, off)")
    serve.add_argument("--log-format", choices=("text", "json"), default="text",
                       help="text, or one JSON object per line")
    serve.set_defaults(func=cmd_serve)
    sub.add_parser("bench", help="run a YAML-configured benchmark grid (configs/bench/*.yaml): flide bench CONFIG",
                   add_help=False)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
