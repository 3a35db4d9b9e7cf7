"""Nested forks: lines that several prompts of one trunk share after it, found in a request's rendered tails.

A judge asking whether each of several candidate answers is right renders one prompt per candidate; after the state
they share the question's line(s) and differ from the candidate on. Cut at a safe boundary (flide/requests.py:
right after a newline that no other line break follows), those shared lines tokenize to the same ids alone as in
every prompt, so they can be computed once as a *sub-trunk* (`PreparedRequest.subs`) that each prompt's own tokens
(a leaf, `Branch.sub`) fork from, as the questions fork from their state (`runtime.nested_forks`).

`cuts` finds where, in the text; `keep_useful` undoes, after tokenizing, the sub-trunks that would not pay or not be
exact. One level only: a sub-trunk does not fork from another.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
from transformers.decision.template_utils import MARK, SPLIT

from .requests import Branch, SubTrunk, common_prefix_length, safe_cut

# a sub-trunk holds at least this many tokens (at least the conv's window - 1: a leaf's first conv window lies in it,
# Qwen3.5's window is 4) and has two or more branches
MIN_SUB_TOKENS = 8


def cuts(trunk_texts: list[str], tails: list[str]) -> list[int]:
    """Per prompt, where its sub-trunk ends in its tail (0: none): the longest run of whole lines (cut at a safe
    boundary, so `tokens(tail) == tokens(tail[:cut]) + tokens(tail[cut:])`, as for the trunk) that it shares with a
    neighbour in sorted order, kept where two or more prompts of the same trunk share that same run. A cut leaves at
    least one character to the leaf, and a run holding a sentinel (a mark) is not shared."""
    out = [0] * len(tails)
    by_trunk: dict[str, list[int]] = {}
    for i, trunk in enumerate(trunk_texts):
        by_trunk.setdefault(trunk, []).append(i)
    for members in by_trunk.values():
        if len(members) < 2:
            continue
        order = sorted(members, key=tails.__getitem__)
        best = dict.fromkeys(order, 0)
        for a, b in pairwise(order):
            shared = common_prefix_length(tails[a], tails[b])
            if shared < MIN_SUB_TOKENS:  # fewer characters than the tokens a sub-trunk needs (RACE's tails)
                continue
            for i in (a, b):
                limit = min(shared, len(tails[i]) - 1)
                if limit > best[i]:  # safe_cut(text, limit) <= limit: no larger cut otherwise
                    best[i] = max(best[i], safe_cut(tails[i], limit))
        runs: dict[str, list[int]] = {}
        for i, cut in best.items():
            run = tails[i][:cut]
            if cut and MARK not in run and SPLIT not in run:
                runs.setdefault(run, []).append(i)
        for run, sharing in runs.items():
            if len(sharing) >= 2:
                for i in sharing:
                    out[i] = len(run)
    return out


def keep_useful(subs: list[SubTrunk], branches: list[Branch], trunks: list) -> list[SubTrunk]:
    """Undoes the sub-trunks that would not pay or not be exact: fewer than MIN_SUB_TOKENS tokens, fewer than two
    branches, or a branch that reads inside it (a template marking before the leaf); such a sub-trunk's tokens go back
    to the front of its branches (the same tokens: the cut is safe). Renumbers the rest. `trunks`: the request's
    trunks as `PromptTokenizer.prepare` holds them (`kept_count`: tokens without sentinels)."""
    leaves: dict[int, list[Branch]] = {}
    for branch in branches:
        if branch.sub >= 0:
            leaves.setdefault(branch.sub, []).append(branch)
    kept: list[SubTrunk] = []
    for index, sub in enumerate(subs):
        members = leaves.get(index, [])
        first_own = trunks[sub.trunk].kept_count + len(sub.tokens)
        # (min of the reads' list: numpy's reduction cost ~5 us a leaf, a judge's request has dozens)
        if (len(sub.tokens) >= MIN_SUB_TOKENS and len(members) >= 2
                and all(min(b.reads.tolist()) >= first_own for b in members)):
            for branch in members:
                branch.sub = len(kept)
            kept.append(sub)
        else:
            for branch in members:
                branch.tokens, branch.sub = np.concatenate([sub.tokens, branch.tokens]), -1
    return kept
