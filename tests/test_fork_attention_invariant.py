"""The batch-invariant Triton fork attention (flide/ops/fork_attention/triton_invariant.py) on the CPU, through
Triton's interpreter:

(a) equal to the reference within fp32 tolerance: random rounds, odd lengths, partial tiles, GQA groups 1-3, head
    dims that need padding, Dv != D, states of 0-2 tokens, a request whose questions of two states interleave in the
    stream (rows of one state not contiguous), every output element written;
(b) invariant: a request's output rows have exactly the same bits (torch.equal) laid out alone in a short stream and
    at any offset inside a longer one among other requests (states and questions both moved, other requests before,
    after and between its segments), with questions so short that several share a query block, query blocks that
    straddle two requests, and a state several query blocks long;
(c) a forked question has the same bits as the same question laid out with its state alone (no sibling questions),
    and (with a state a whole number of key tiles long) as the state and question laid out as ONE causal segment;
plus which tiles a program visits (a block of short questions of one state scans the state once).

The interpreter runs the kernel with numpy, so (b) and (c) check the tile order and masking logic, not the GPU's
arithmetic: tests/gpu/test_fork_attention_invariant_gpu.py repeats them on the device (bf16 too, which the
interpreter's dots get wrong in this triton, see tests/test_triton_kernels.py). One substitution: the interpreter's
`tl.dot` is `np.matmul`, i.e. OpenBLAS sgemm, whose rows' bits depend on their POSITION in the matrix (edge rows go
through other micro-kernels: a row moved within a 16 x 16 product changes in the last bit). A GPU's dot has no such
dependence (each output element of an MMA, or of the FMA loop of an IEEE fp32 dot, is summed over k in one fixed
order whatever its row), and the kernel relies on it: a row's position in its query block changes with the layout.
So here `tl.dot` is replaced by a k-sequential numpy dot with the same property (`_dot_by_k`, fixture below).

As in tests/test_triton_kernels.py, `TRITON_INTERPRET` must be set when the kernel's module is imported, so a normal
run starts a child pytest on this file with TRITON_INTERPRET=1, where the checks below run.
`TRITON_INTERPRET=1 python -m pytest tests/test_fork_attention_invariant.py` runs them directly.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:
    from flide.testing import run_in_triton_interpreter

    def test_in_the_triton_interpreter():
        """Runs this file's `test_invariant_*` checks in a child process with TRITON_INTERPRET=1."""
        run_in_triton_interpreter(__file__, "test_invariant_", 10)

else:
    from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder

    from flide.ops.fork_attention import reference as attn_ref
    from flide.ops.fork_attention import triton_invariant as kernel
    from flide.requests import Branch, PreparedRequest
    from flide.round import Shape, build_round
    from flide.testing import (checkpoint_prefix, interpreter_dot_by_k, random_round_tensors, resume_states,
                               synthetic_request)

    @pytest.fixture(autouse=True)
    def dots_by_k(monkeypatch):
        monkeypatch.setattr(InterpreterBuilder, "create_dot", interpreter_dot_by_k)

    Config = kernel.Config
    SMALL = Config(16, 16, 4, 1)  # 16 rows: 8 tokens a query block at GQA 2, 16 keys a tile

    def randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)

    def poisoned(*shape, dtype=torch.float32) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype)

    def run(q, k, v, r, scale, config=None, **kwargs):
        return kernel.fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, scale, config=config, **kwargs)

    # -----------------------------------------------------------------------------------------------------------------
    # Layouts of requests
    # -----------------------------------------------------------------------------------------------------------------

    def request(rng: random.Random, state: int, questions: list[int]) -> PreparedRequest:
        return synthetic_request([rng.randrange(1000) for _ in range(state)],
                                 [[rng.randrange(1000) for _ in range(n)] for n in questions])

    def two_state_request(rng: random.Random, states: tuple[int, int], questions: list[tuple[int, int]]):
        """A request with two states (Jev's template: one per question type); `questions`: (state, length)."""
        trunks = [np.array([rng.randrange(1000) for _ in range(n)], dtype=np.int64) for n in states]
        branches = [Branch(t, np.array([rng.randrange(1000) for _ in range(n)], dtype=np.int64),
                           np.array([states[t] + n - 1]), [object()], np.zeros(0, dtype=np.int64), [[1, 2]])
                    for t, n in questions]
        return PreparedRequest(trunks, branches)

    def lay_out(requests: list[PreparedRequest], pad: int = 0):
        """The round of `requests` in a stream of exactly their tokens + `pad`, and each request's stream rows (its
        states, then its questions, in the order build_round lays them out)."""
        tokens = sum(p.stream_tokens for p in requests) + pad
        states = sum(len(p.trunks) for p in requests)
        branches = sum(len(p.branches) for p in requests)
        r = build_round(requests, Shape(tokens, max(states, 1), max(branches, 1), max(branches, 1), 2), 0).tensors
        rows, s0, b0 = [], 0, 0
        for p in requests:
            segs = [(int(r.state_start[s]), int(r.state_len[s])) for s in range(s0, s0 + len(p.trunks))]
            segs += [(int(r.branch_start[b]), int(r.branch_len[b])) for b in range(b0, b0 + len(p.branches))]
            rows.append(torch.cat([torch.arange(a, a + n) for a, n in segs]))
            s0, b0 = s0 + len(p.trunks), b0 + len(p.branches)
        return r, rows

    def invariance(requests: list[PreparedRequest], target: int, heads, config, pad_inside: int, pad_alone: int,
                   seed: int, dtype=torch.float32):
        """Runs the kernel on `requests` laid out together and on requests[target] alone, with the target's q / k / v
        rows identical in both; returns (inside round, target's rows inside, out inside, out alone, rows alone)."""
        hq, hkv, d = heads
        r_in, rows_in = lay_out(requests, pad_inside)
        r_al, (rows_al,) = lay_out([requests[target]], pad_alone)
        t_in, t_al = r_in.seg_lo.shape[0], r_al.seg_lo.shape[0]
        qkv_in = [randn(t_in, h, d, seed=seed + i, dtype=dtype) for i, h in enumerate((hq, hkv, hkv))]
        qkv_al = [randn(t_al, h, d, seed=seed + 10 + i, dtype=dtype) for i, h in enumerate((hq, hkv, hkv))]
        for x_al, x_in in zip(qkv_al, qkv_in):
            x_al[rows_al] = x_in[rows_in[target]]
        out_in = run(*qkv_in, r_in, d ** -0.5, config, out=poisoned(t_in, hq, d, dtype=dtype))
        out_al = run(*qkv_al, r_al, d ** -0.5, config, out=poisoned(t_al, hq, d, dtype=dtype))
        # both against the reference as well: equal bits of two wrong answers would prove nothing
        for qkv, r, out in ((qkv_in, r_in, out_in), (qkv_al, r_al, out_al)):
            want = attn_ref.fork_attention_naive(*(x.float() for x in qkv), r.seg_lo, r.trunk_lo, r.trunk_hi,
                                                 d ** -0.5)
            tol = 1e-5 if dtype == torch.float32 else 3e-3
            torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
        return r_in, rows_in[target], out_in, out_al, rows_al

    def tokens_per_block(heads, config) -> int:
        return kernel._tiles(config, heads[2], torch.float32, heads[0] // heads[1]).block_m // (heads[0] // heads[1])

    # -----------------------------------------------------------------------------------------------------------------
    # (a) against the reference
    # -----------------------------------------------------------------------------------------------------------------

    def test_invariant_kernel_is_interpreted():
        assert isinstance(kernel._fork_attention_invariant_kernel, InterpretedFunction)

    CASES = [  # tokens, (Hq, Hkv, D), config
        (1, (2, 2, 16), None),
        (17, (4, 2, 16), SMALL),
        (65, (3, 1, 16), SMALL),  # group 3: 5 tokens x 3 heads per 16 rows, one row idle
        (150, (4, 2, 16), SMALL),
        (150, (2, 2, 8), Config(32, 16, 4, 1)),  # dim 8: padded to 16
        (131, (6, 2, 24), Config(32, 16, 4, 1)),  # dim 24: padded to 32, group 3
        (200, (4, 2, 16), None),  # the default fp32 tiles (32 x 32)
    ]

    @pytest.mark.parametrize("tokens,heads,config", CASES,
                             ids=[f"T{t}-Hq{h[0]}-Hkv{h[1]}-D{h[2]}-{'default' if c is None else f'M{c.block_m}N{c.block_n}'}"
                                  for t, h, c in CASES])
    def test_invariant_matches_reference(tokens, heads, config):
        hq, hkv, d = heads
        r = random_round_tensors(random.Random(tokens + hq), tokens, max_requests=6, max_questions=6, max_state=40,
                                 max_question=12)
        q, k, v = randn(tokens, hq, d, seed=1), randn(tokens, hkv, d, seed=2), randn(tokens, hkv, d, seed=3)
        out = run(q, k, v, r, d ** -0.5, config, out=poisoned(tokens, hq, d))
        want = attn_ref.fork_attention_naive(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, d ** -0.5)
        assert out.shape == (tokens, hq, d) and out.dtype == torch.float32
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # NaN anywhere (an unwritten element) fails

    def test_invariant_reads_strided_key_and_value_rows_with_the_same_bits():
        """The model hands v over as a column slice of the fused q/k/v projection (flide/models/layers.py): rows of
        any stride give the bits of contiguous ones."""
        tokens, (hq, hkv, d) = 150, (4, 2, 16)
        r = random_round_tensors(random.Random(7), tokens, max_requests=6, max_questions=6, max_state=40,
                                 max_question=12)
        q, k, v = randn(tokens, hq, d, seed=1), randn(tokens, hkv, d, seed=2), randn(tokens, hkv, d, seed=3)
        wide = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)], 1)
        k_slice = wide[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
        v_slice = wide[:, (hq + hkv) * d:].view(tokens, hkv, d)
        assert not v_slice.is_contiguous()
        want = run(q, k, v, r, d ** -0.5, SMALL, out=poisoned(tokens, hq, d))
        assert torch.equal(run(q, k_slice, v_slice, r, d ** -0.5, SMALL, out=poisoned(tokens, hq, d)), want)

    def test_invariant_short_states_value_dim_and_fp16():
        """States of 0-2 tokens (questions without a state next to questions with one, one-token states), Dv != D;
        fp16 in, fp16 out, within fp16 rounding of the fp32 reference."""
        tokens = 120
        r = random_round_tensors(random.Random(4), tokens, max_requests=6, max_questions=8, max_state=2,
                                 max_question=7)
        used = r.branch_len > 0
        assert (used & (r.state_len[r.branch_state] == 0)).any() and (used & (r.state_len[r.branch_state] > 0)).any()
        q, k, v = randn(tokens, 4, 16, seed=7), randn(tokens, 2, 16, seed=8), randn(tokens, 2, 32, seed=9)
        out = run(q, k, v, r, 0.25, SMALL, out=poisoned(tokens, 4, 32))
        torch.testing.assert_close(out, attn_ref.fork_attention_naive(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25),
                                   atol=1e-5, rtol=1e-5)
        q16, k16, v16 = q.half(), k.half(), v.half()
        out16 = run(q16, k16, v16, r, 0.25, SMALL)
        want16 = attn_ref.fork_attention(q16.float(), k16.float(), v16.float(), r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25)
        assert out16.dtype == torch.float16
        torch.testing.assert_close(out16.float(), want16, atol=3e-3, rtol=3e-3)

    @pytest.mark.parametrize("dv", [32, 24], ids=["Dv32", "Dv24-padded"])
    def test_invariant_value_parts_have_the_bits_of_one_program(dv):
        """`v_parts=2` (`V_SPLIT_DIM`: each (query block, KV head) as two programs, each with the same scores and
        half the value columns) gives every element the bits of the one-program kernel, padded value columns
        included, and the same tile counts; a split that leaves parts under 16 columns is refused."""
        tokens, hq, hkv, d = 150, 4, 2, 32
        r = random_round_tensors(random.Random(dv), tokens, max_requests=6, max_questions=6, max_state=40,
                                 max_question=12)
        q, k, v = randn(tokens, hq, d, seed=11), randn(tokens, hkv, d, seed=12), randn(tokens, hkv, dv, seed=13)
        blocks = kernel.query_blocks(tokens, hq, hkv, d, torch.float32, SMALL)
        stats = [torch.zeros(blocks * hkv, dtype=torch.int32) for _ in range(2)]
        one = run(q, k, v, r, d ** -0.5, SMALL, out=poisoned(tokens, hq, dv), v_parts=1, stats=stats[0])
        two = run(q, k, v, r, d ** -0.5, SMALL, out=poisoned(tokens, hq, dv), v_parts=2, stats=stats[1])
        assert torch.equal(two, one) and torch.equal(stats[1], stats[0]) and (stats[0] > 0).all()
        torch.testing.assert_close(one, attn_ref.fork_attention_naive(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi,
                                                                      d ** -0.5), atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="v_parts"):
            run(q, k, v, r, d ** -0.5, SMALL, v_parts=4)

    def test_invariant_interleaved_states():
        """Metadata written by hand: two states, then questions alternating between them (rows of one state are not
        contiguous in a query block), then pads. The kernel walks each distinct state of a block once."""
        s0, s1, n = 21, 13, 3  # states [0, 21) and [21, 34), then 10 questions of 3 tokens alternating
        seg_lo, trunk_lo, trunk_hi = [0] * s0 + [s0] * s1, [0] * (s0 + s1), [0] * (s0 + s1)
        t = s0 + s1
        for i in range(10):
            lo, hi = (0, s0) if i % 2 == 0 else (s0, s0 + s1)
            seg_lo += [t] * n
            trunk_lo += [lo] * n
            trunk_hi += [hi] * n
            t += n
        tokens = t + 5
        seg_lo += list(range(t, tokens))
        trunk_lo += [0] * 5
        trunk_hi += [0] * 5
        r = type("R", (), {})()
        r.seg_lo, r.trunk_lo, r.trunk_hi = (torch.tensor(x, dtype=torch.int64) for x in (seg_lo, trunk_lo, trunk_hi))
        q, k, v = randn(tokens, 4, 16, seed=1), randn(tokens, 2, 16, seed=2), randn(tokens, 2, 16, seed=3)
        stats = torch.full((2 * kernel.query_blocks(tokens, 4, 2, 16, torch.float32, SMALL),), -1, dtype=torch.int32)
        out = run(q, k, v, r, 0.25, SMALL, out=poisoned(tokens, 4, 16), stats=stats)
        torch.testing.assert_close(out, attn_ref.fork_attention_naive(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25),
                                   atol=1e-5, rtol=1e-5)
        # the block of tokens 40..47: questions 2-4 (states 0, 1, 0): state 0 once (2 tiles), state 1 once (1 tile),
        # its 3 question segments (1 tile each)
        assert stats.view(2, -1)[0, 5].item() == 2 + 1 + 3

    # -----------------------------------------------------------------------------------------------------------------
    # (b) invariance
    # -----------------------------------------------------------------------------------------------------------------

    def target_request(rng: random.Random) -> PreparedRequest:
        """A state of 70 tokens (9 query blocks of 8 tokens; 5 key tiles of 16), questions of 1-9 tokens: several
        share a query block."""
        return request(rng, 70, [1, 2, 3, 2, 1, 5, 9, 2])

    def others(rng: random.Random, n: int) -> list[PreparedRequest]:
        return [request(rng, rng.randint(0, 30), [rng.randint(1, 6) for _ in range(rng.randint(1, 4))])
                for _ in range(n)]

    def straddles(r, rows: torch.Tensor, per_block: int) -> tuple[bool, bool]:
        """(some query block holds question rows of the target and of another state; some query block holds rows of
        two or more of the target's questions)."""
        two_states = several_questions = False
        own = set(rows.tolist())
        for b in {int(t) // per_block for t in rows.tolist()}:
            block = range(b * per_block, min((b + 1) * per_block, r.seg_lo.shape[0]))
            mine = [t for t in block if t in own and r.trunk_hi[t] > r.trunk_lo[t]]
            if not mine:
                continue
            states = {int(r.trunk_lo[t]) for t in block if r.trunk_hi[t] > r.trunk_lo[t]}
            two_states |= len(states) > 1
            several_questions |= len({int(r.seg_lo[t]) for t in mine}) > 1
        return two_states, several_questions

    @pytest.mark.parametrize("where", ["first", "middle", "last"])
    def test_invariant_alone_vs_inside(where):
        """The target request alone (short stream, a few pads) and at three places among 5 other requests (their
        states before / after its state, their questions before / after its questions): the target's rows equal."""
        rng = random.Random({"first": 1, "middle": 2, "last": 3}[where])
        target = target_request(rng)
        rest = others(rng, 5)
        i = {"first": 0, "middle": 2, "last": 5}[where]
        requests = rest[:i] + [target] + rest[i:]
        heads = (4, 2, 16)
        r_in, rows_in, out_in, out_al, rows_al = invariance(requests, i, heads, SMALL, pad_inside=11, pad_alone=3,
                                                            seed=10)
        assert int(rows_in[0]) != int(rows_al[0]) or where == "first"
        two_states, several = straddles(r_in, rows_in, tokens_per_block(heads, SMALL))
        assert several
        if where != "first":  # the target's first questions share a block with the previous request's last ones
            assert two_states
        assert torch.equal(out_in[rows_in], out_al[rows_al])

    @pytest.mark.parametrize("heads,config", [((3, 1, 16), SMALL), ((4, 4, 24), Config(32, 16, 4, 1)),
                                              ((6, 2, 16), None)],
                             ids=["group3-M16N16", "group1-D24-M32N16", "group3-default"])
    def test_invariant_random_layouts(heads, config):
        """Random targets among random other requests (two of the layouts hold a request with two states, whose
        question blocks hold both), other GQA groups, padded head dims and tiles."""
        rng = random.Random(sum(heads))
        for trial in range(2):
            if trial == 0:
                target = two_state_request(rng, (33, 18), [(0, 3), (1, 2), (0, 1), (1, 4), (0, 2), (1, 1)])
            else:
                target = request(rng, rng.randint(20, 60), [rng.randint(1, 7) for _ in range(rng.randint(2, 6))])
            rest = others(rng, rng.randint(2, 5))
            i = rng.randint(0, len(rest))
            _, rows_in, out_in, out_al, rows_al = invariance(rest[:i] + [target] + rest[i:], i, heads, config,
                                                             pad_inside=rng.randint(0, 9), pad_alone=rng.randint(0, 9),
                                                             seed=20 + trial)
            assert torch.equal(out_in[rows_in], out_al[rows_al]), (heads, trial)

    @pytest.mark.parametrize("lean", [True, False], ids=["lean-tiles", "one-path-tiles"])
    def test_invariant_with_and_without_lean_tiles(lean, monkeypatch):
        """Both tile forms (`LEAN_TILES`: the default's full-tile loop, the one-path A/B baseline) keep a request's
        bits alone and inside a round: a long state (its own rows' full tiles depend on where the query blocks cut
        it) under questions that share blocks with another request's."""
        monkeypatch.setattr(kernel, "LEAN_TILES", lean)
        rng = random.Random(7)
        target = request(rng, 90, [4, 1, 6, 2, 3])
        rest = others(rng, 3)
        _, rows_in, out_in, out_al, rows_al = invariance(rest[:1] + [target] + rest[1:], 1, (4, 2, 16), SMALL,
                                                         pad_inside=5, pad_alone=2, seed=40)
        assert torch.equal(out_in[rows_in], out_al[rows_al])

    def test_invariant_rows_that_see_only_themselves():
        """Pads, one-token states, states' first tokens and first tokens of questions without a state share one run
        of tiles per block, each row scored in whatever column it falls: GQA 1 with 32 tokens a block and 16 keys a
        tile (a block of pads spans two tiles). Equal to the reference, and each request's rows equal alone."""
        rng = random.Random(3)
        requests = [request(rng, rng.choice([0, 1, 1, 2, 5]), [rng.choice([1, 1, 2, 3]) for _ in range(3)])
                    for _ in range(12)]
        heads, config = (2, 2, 16), Config(32, 16, 4, 1)
        for target in (0, 5, 11):
            r_in, rows_in, out_in, out_al, rows_al = invariance(requests, target, heads, config, pad_inside=70,
                                                                pad_alone=40, seed=50 + target)
            assert torch.equal(out_in[rows_in], out_al[rows_al]), target
        alone = (r_in.seg_lo == torch.arange(r_in.seg_lo.shape[0])) & (r_in.trunk_hi <= r_in.trunk_lo)
        assert alone.sum() > 80

    def test_invariant_fp16_alone_vs_inside():
        rng = random.Random(7)
        requests = others(rng, 2) + [target_request(rng)] + others(rng, 2)
        _, rows_in, out_in, out_al, rows_al = invariance(requests, 2, (4, 2, 16), SMALL, 5, 0, seed=30,
                                                          dtype=torch.float16)
        assert torch.equal(out_in[rows_in], out_al[rows_al])

    # -----------------------------------------------------------------------------------------------------------------
    # (c) a forked question and its state alone
    # -----------------------------------------------------------------------------------------------------------------

    def test_invariant_forked_question_equals_state_and_question_alone():
        """A state of 48 tokens (3 key tiles of 16) with 6 questions, among other requests; each question laid out
        with its state alone (its siblings gone) gives the same bits, and so does the state + question as one
        causal segment (one state, no question: the tiles fall at the same keys because 48 is a whole number of
        tiles, and trunk and own tiles run the same code)."""
        rng = random.Random(11)
        hq, hkv, d = 4, 2, 16
        state = [rng.randrange(1000) for _ in range(48)]
        questions = [[rng.randrange(1000) for _ in range(n)] for n in (5, 1, 12, 3, 2, 7)]
        full = synthetic_request(state, questions)
        requests = others(rng, 2) + [full] + others(rng, 1)
        r_in, rows = lay_out(requests, pad=6)
        rows = rows[2]
        t_in = r_in.seg_lo.shape[0]
        q, k, v = randn(t_in, hq, d, seed=40), randn(t_in, hkv, d, seed=41), randn(t_in, hkv, d, seed=42)
        out_in = run(q, k, v, r_in, d ** -0.5, SMALL)
        state_rows, cursor = rows[:48], 48
        for question in questions:
            q_rows = rows[cursor: cursor + len(question)]
            cursor += len(question)
            mine = torch.cat([state_rows, q_rows])
            forked, _ = lay_out([synthetic_request(state, [question])])
            # the same stream as one segment: a state of 48 + n tokens (and a one-token question of nothing)
            joined, _ = lay_out([synthetic_request(state + question, [[0]])])
            for r in (forked, joined):
                n = r.seg_lo.shape[0]
                x = [torch.zeros(n, h, d) for h in (hq, hkv, hkv)]
                for xi, src in zip(x, (q, k, v)):
                    xi[: len(mine)] = src[mine]
                out = run(*x, r, d ** -0.5, SMALL)
                assert torch.equal(out[: len(mine)], out_in[mine])
        torch.testing.assert_close(out_in, attn_ref.fork_attention_naive(q, k, v, r_in.seg_lo, r_in.trunk_lo,
                                                                         r_in.trunk_hi, d ** -0.5),
                                   atol=1e-5, rtol=1e-5)

    # -----------------------------------------------------------------------------------------------------------------
    # (d) checkpoint prefixes: resumed states see their first m keys from pk / pv
    # -----------------------------------------------------------------------------------------------------------------

    def resumed_round(rng: random.Random, m: int):
        """Other requests around two requests whose states (of m + 3 and m + 20 tokens) resume at m, and the cuts."""
        targets = [request(rng, m + 3, [4, 1, 9]), request(rng, m + 20, [2, 6])]
        requests = others(rng, 2) + [targets[0]] + others(rng, 1) + [targets[1]] + others(rng, 1)
        r, rows = lay_out(requests, pad=5)
        cuts = [(int(rows[i][0]), m) for i in (2, 4)]
        return r, cuts

    @pytest.mark.parametrize("m", [32, 48])
    def test_invariant_prefix_matches_reference_and_fresh_bits(m):
        """Resumed states (their first m keys as checkpoint rows in pk / pv) among requests without checkpoints: the
        output equals the reference's `fork_attention_prefix`, and, m being a whole number of key tiles, every kept
        row has the bits the same row gets in the fresh stream (the same tiles in the same order)."""
        rng = random.Random(m)
        hq, hkv, d = 4, 2, 16
        r, cuts = resumed_round(rng, m)
        T = r.seg_lo.shape[0]
        q, k, v = randn(T, hq, d, seed=50), randn(T, hkv, d, seed=51), randn(T, hkv, d, seed=52)
        fresh = run(q, k, v, r, d ** -0.5, SMALL)
        rows, seg_lo, trunk_lo, trunk_hi, checkpoint = resume_states(r.seg_lo, r.trunk_lo, r.trunk_hi, cuts)
        pre_lo, pre_hi, cut = checkpoint_prefix(checkpoint, cuts)
        assert (pre_hi > pre_lo).sum() > 0 and (pre_hi == pre_lo).sum() > 0
        args = (q[rows], k[rows], v[rows], seg_lo, trunk_lo, trunk_hi)
        got = kernel.fork_attention(*args, d ** -0.5, config=SMALL, out=poisoned(len(rows), hq, d),
                                    prefix=(k[cut], v[cut], pre_lo, pre_hi))
        want = attn_ref.fork_attention_prefix(*args, k[cut], v[cut], pre_lo, pre_hi, d ** -0.5)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got, fresh[rows])

    def test_invariant_prefix_without_prefix_rows_is_the_plain_kernel():
        """A prefix argument whose ranges are all empty (and an empty pk) changes no bit of any row."""
        rng = random.Random(3)
        r, _ = resumed_round(rng, 16)
        T = r.seg_lo.shape[0]
        q, k, v = randn(T, 4, 16, seed=60), randn(T, 2, 16, seed=61), randn(T, 2, 16, seed=62)
        none = torch.zeros(T, dtype=torch.long)
        got = run(q, k, v, r, 0.25, SMALL, prefix=(k[:0], v[:0], none, none))
        assert torch.equal(got, run(q, k, v, r, 0.25, SMALL))

    # -----------------------------------------------------------------------------------------------------------------
    # The tiles each program visits
    # -----------------------------------------------------------------------------------------------------------------

    def test_invariant_visits_shared_state_tiles():
        """One 100-token state, then 16 questions of 2 tokens, then 4 pads; GQA 4/2 in 16 rows = 8 tokens a block,
        16 keys a tile. Per query block (stats: tiles visited):
        - state rows [8b, 8b + 8) (b >= 1): the causal run from key 0 up to the block's last row;
        - a block of 4 questions: the state's 7 tiles once (shared by its 4 questions), then 1 tile per question;
        - the block holding the state's end and the first 2 questions: 7 tiles of its state rows, 7 of the state
          for the questions, 2 for their own tokens;
        - rows that see only themselves (the state's first token, pads): one shared run of tiles from the first of them
          (one tile here)."""
        request_ = synthetic_request(list(range(100)), [[7] * 2 for _ in range(16)])
        r = build_round([request_], Shape(tokens=136, states=1, branches=16, readout_rows=16, options=2),
                        pad_id=0).tensors
        tokens, hq, hkv, d = 136, 4, 2, 16
        q, k, v = randn(tokens, hq, d, seed=1), randn(tokens, hkv, d, seed=2), randn(tokens, hkv, d, seed=3)
        blocks = kernel.query_blocks(tokens, hq, hkv, d, torch.float32, SMALL)
        assert blocks == 17
        stats = torch.full((hkv * blocks,), -1, dtype=torch.int32)
        out = run(q, k, v, r, 0.25, SMALL, stats=stats, out=poisoned(tokens, hq, d))
        torch.testing.assert_close(out, attn_ref.fork_attention_naive(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25),
                                   atol=1e-5, rtol=1e-5)
        stats = stats.view(hkv, blocks)
        assert torch.equal(stats[0], stats[1])
        want = [1 + 1] + [-(-(8 * b + 8) // 16) for b in range(1, 12)]  # state blocks (block 0: + token 0 alone)
        want += [7 + 7 + 2]  # tokens 96..103: state 96..99, questions at 100, 102
        want += [7 + 4] * 3  # tokens 104..127: 4 questions each
        want += [7 + 2 + 1]  # tokens 128..135: 2 questions (128..131) and 4 pads
        assert stats[0].tolist() == want

    def test_invariant_takes_int32_and_int64_tables_with_the_same_bits():
        r = random_round_tensors(random.Random(4), 96, max_state=40, max_question=12)
        assert r.seg_lo.dtype == torch.int32
        q, k, v = randn(96, 4, 16, seed=1), randn(96, 2, 16, seed=2), randn(96, 2, 16, seed=3)
        got = run(q, k, v, r, 0.25, SMALL)
        wide = type("R", (), {})()
        wide.seg_lo, wide.trunk_lo, wide.trunk_hi = (t.long() for t in (r.seg_lo, r.trunk_lo, r.trunk_hi))
        assert torch.equal(run(q, k, v, wide, 0.25, SMALL), got)

    def test_invariant_rejects_bad_inputs():
        q, k = randn(8, 4, 16, seed=1), randn(8, 2, 16, seed=2)
        meta = torch.zeros(8, dtype=torch.int64)
        with pytest.raises(ValueError, match="seg_lo"):
            kernel.fork_attention(q, k, k, meta.short(), meta, meta, 0.25)
        with pytest.raises(ValueError, match="dtypes"):
            kernel.fork_attention(q, k, k.half(), meta, meta, meta, 0.25)
        with pytest.raises(ValueError, match="multiple"):
            kernel.fork_attention(randn(8, 3, 16, seed=1), k, k, meta, meta, meta, 0.25)
        with pytest.raises(ValueError, match="trunk_hi"):
            kernel.fork_attention(q, k, k, meta, meta, meta[:4], 0.25)
