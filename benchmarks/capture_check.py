"""Which op breaks CUDA-graph capture, if any: the flat forward captured EAGERLY with `torch.cuda.graph`.

cudagraph trees (what `torch.compile(mode="reduce-overhead")` records with) report a capture broken anywhere only at
`capture_end` ("operation failed due to a previous error during capture"). Capturing the eager flat forward instead
makes the first op that is not capturable raise where it is called, with its Python traceback. Then the graph is
replayed with another round written into the same buffers and compared with an eager forward of that round.

    python benchmarks/capture_check.py [--dtypes float32 bfloat16] [--models qwen3_5_text llama] [--tokens 512]
GPU only.
"""

from __future__ import annotations

import argparse
import random
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flide
from flide.graphs.buckets import bucket_shape
from flide.models.tiny import tiny_model, tiny_tokenizer
from flide.round import build_round
from flide.testing import random_request


def check(model_type: str, dtype: torch.dtype, tokens: int) -> bool:
    torch.manual_seed(0)
    tok = tiny_tokenizer()
    model = tiny_model(model_type).to("cuda", dtype)
    engine = flide.patch(model, tok, config={"runtime": {"device": "cuda", "graphs": "off"}})
    shape = bucket_shape(tokens, engine.config.capacities, engine.max_options)
    rng = random.Random(5)

    def round_tensors():
        requests = []
        while len(requests) < 4:
            request = engine.prepare(random_request(rng, max_questions=4, max_words=12))
            if requests and sum(r.stream_tokens for r in requests) + request.stream_tokens > tokens // 2:
                break
            if request.stream_tokens <= tokens:
                requests.append(request)
        round_ = build_round(requests, shape, engine.pad_id)
        return round_, round_.tensors.to("cuda")

    label = f"{model_type} {str(dtype).removeprefix('torch.')} T={tokens}"
    _, static = round_tensors()
    with torch.inference_mode():
        for _ in range(2):  # warm-up: compiles, autotunes
            engine.flat(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                out = engine.flat(static)
        except Exception:  # noqa: BLE001 (a diagnostic: report whatever breaks the capture)
            print(f"[{label}] CAPTURE FAILED:")
            traceback.print_exc()
            return False
        second, fresh = round_tensors()
        for (_, dst), (_, src) in zip(static.items(), fresh.items()):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        expected = engine.flat(fresh)
        rows = len(second.reads)
        diff = (out[:rows].float() - expected[:rows].float()).abs().max().item()
    print(f"[{label}] captured; replay with another round vs eager: max |diff| {diff:.3g} over {rows} reads")
    return diff <= (1e-5 if dtype == torch.float32 else 1e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3_5_text", "llama"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    ok = True
    for model_type in args.models:
        for dtype in args.dtypes:
            try:
                ok &= check(model_type, getattr(torch, dtype), args.tokens)
            except Exception:  # noqa: BLE001 (report and go on with the next case)
                print(f"[{model_type} {dtype}] FAILED outside capture:")
                traceback.print_exc()
                ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
