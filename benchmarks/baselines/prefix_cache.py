"""The strongest plain-transformers baseline: each state computed once, then its cache copied for every question.

Per request and per state (trunk): one forward pass over the state's tokens with `use_cache=True`; then for each
question, a copy of that cache (`copy.deepcopy`: for Qwen3.5 it holds the attention layers' keys/values *and* the
Gated DeltaNet layers' recurrent and conv states, which transformers updates in place and cannot crop back) and one
forward pass of the question's own tokens on the copy, reading the label logits where the pipeline reads them. The
last question of a state takes the cache itself (nothing reads it afterwards).

Same tokens, same model, same positions as `pipeline("decision")`: exact up to float rounding (the chunked Gated
DeltaNet splits its chunks at a different place), which tests/test_bench.py checks to 1e-5 in fp32.
"""

from __future__ import annotations

import copy

import torch

from flide.requests import PreparedRequest

try:
    from .common import PlainBaseline, as_ids
except ImportError:  # run as a script
    from common import PlainBaseline, as_ids


class PrefixCacheBaseline(PlainBaseline):
    """`decide(requests)`: each request alone, its state once with a KV/GDN cache, each question on a copy."""

    name = "prefix-cache"

    def _scores(self, prepared: PreparedRequest) -> dict[str, torch.Tensor]:
        device, model = self.device, self.model
        logits: dict[str, torch.Tensor] = {}
        for index, trunk in enumerate(prepared.trunks):
            branches = [b for b in prepared.branches if b.trunk == index]
            n = len(trunk)
            cache, in_trunk = None, {}
            if n:
                rows = sorted({int(r) for b in branches for r in b.reads if r < n})
                # logits_to_keep=0 would mean every row: keep the last one when no read falls in the state
                keep = torch.tensor(rows, device=device) if rows else 1
                out = model(input_ids=as_ids(trunk, device), use_cache=True, logits_to_keep=keep)
                cache = out.cache
                in_trunk = {r: out.logits[0, i] for i, r in enumerate(rows)}
            for position, branch in enumerate(branches):
                later = [int(r) - n for r in branch.reads if r >= n]
                rows_out = None
                if later:
                    last = position == len(branches) - 1
                    own = None if cache is None else (cache if last else copy.deepcopy(cache))
                    out = model(input_ids=as_ids(branch.tokens, device), cache=own, use_cache=own is not None,
                                logits_to_keep=torch.tensor(later, device=device))
                    rows_out = out.logits[0]
                j = 0
                for question, read in zip(branch.questions, branch.reads):
                    if read < n:
                        logits[question.name] = in_trunk[int(read)]
                    else:
                        logits[question.name] = rows_out[j]
                        j += 1
        return logits
