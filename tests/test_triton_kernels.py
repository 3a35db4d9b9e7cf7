"""The Triton variants (`fork_conv: triton`, `fork_attention: triton`, the question call of `gated_delta: fla`) on the CPU, through Triton's interpreter,
against the pure-torch references: tiny random rounds, odd lengths, partial tiles, GQA groups of 1-3, head dims
that need padding, every output element written, and (attention) which key blocks each program visits.

How the interpreter is switched on: in triton 3.x `triton.jit` reads `TRITON_INTERPRET` (through
`triton.knobs.runtime.interpret`) when it *decorates* a kernel, i.e. when the kernel's module is imported, and
returns an `InterpretedFunction` instead of a `JITFunction`. The rest of the suite may already have imported these
modules, and setting the variable later changes nothing; so in a normal run this file only starts a child pytest
on itself with TRITON_INTERPRET=1, one per kernel, and in that child (the variable set) the checks below run.
`TRITON_INTERPRET=1 python -m pytest tests/test_triton_kernels.py` runs them directly.

Not here: bf16, whose dots the interpreter gets wrong in this triton (a 16x16 bf16 dot came out ~1e10 off), and
speed. Both are in tests/gpu (test_fork_conv_gpu.py, test_fork_attention_triton_gpu.py) and benchmarks/ops.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:
    from flide.testing import run_in_triton_interpreter

    @pytest.mark.parametrize("kernel", ["fork_conv", "fork_attention", "gated_delta_branches", "gated_delta_l2norm",
                                        "gated_delta_questions_wy", "gated_delta_questions_chunked", "gated_delta_w_u",
                                        "gated_delta_kkt_solve", "gated_delta_state_chain", "gated_norm",
                                        "qk_prep"])
    def test_in_the_triton_interpreter(kernel):
        """Runs this file's `test_<kernel>_*` checks in a child process with TRITON_INTERPRET=1."""
        run_in_triton_interpreter(__file__, f"test_{kernel}_", 4)

else:
    from triton.runtime.interpreter import InterpretedFunction

    from flide.ops.fork_attention import reference as attn_ref
    from flide.ops.fork_attention import triton as attn_triton
    from flide.ops.fork_conv import reference as conv_ref
    from flide.ops.fork_conv import triton as conv_triton
    from flide.ops.gated_delta import branches as delta_branches
    from flide.ops.gated_delta import kkt_solve as delta_kkt
    from flide.ops.gated_delta import l2norm as delta_l2norm
    from flide.ops.gated_delta import questions_chunked as delta_chunked
    from flide.ops.gated_delta import questions_wy as delta_wy
    from flide.ops.gated_delta import reference as delta_ref
    from flide.ops.gated_delta import state_chain as delta_chain
    from flide.ops.gated_delta import wy_form as delta_w_u
    from flide.ops.gated_norm import reference as norm_ref
    from flide.ops.gated_norm import triton as norm_triton
    from flide.ops.qk_prep import reference as prep_ref
    from flide.ops.qk_prep import triton as prep_triton
    from flide.testing import random_round_tensors, resume_states

    def tiny_round(tokens: int, seed: int, max_state: int = 40, max_question: int = 12, max_questions: int = 6):
        return random_round_tensors(random.Random(seed), tokens, max_requests=6, max_questions=max_questions,
                                    max_state=max_state, max_question=max_question)

    def randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)

    def poisoned(*shape, dtype) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype)

    def segment_rows(tokens: int, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[tokens] bool: the rows that the segments (starts, lengths) cover."""
        rows = torch.zeros(tokens, dtype=torch.bool)
        for start, length in zip(starts.tolist(), lengths.tolist()):
            rows[start:start + length] = True
        return rows

    def solved_poisoned(solved: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The solved rows A [T, Hv, chunk] with NaN wherever fla's kkt + solve launch writes nothing (the upper
        part of each chunk's rows, rows outside the segments), as `fla._solve` leaves them unfilled for our kernels."""
        T, chunk = solved.shape[0], solved.shape[-1]
        keep = torch.zeros(T, chunk, dtype=torch.bool)
        for start, length in zip(starts.tolist(), lengths.tolist()):
            within = torch.arange(length) % chunk  # a token's row within its chunk (chunks from the segment start)
            keep[start:start + length] = torch.arange(chunk)[None, :] <= within[:, None]
        return torch.where(keep[:, None, :], solved, torch.full_like(solved, float("nan")))

    # -----------------------------------------------------------------------------------------------------------------
    # fork_conv
    # -----------------------------------------------------------------------------------------------------------------

    def test_fork_conv_kernel_is_interpreted():
        assert isinstance(conv_triton._fork_conv_kernel, InterpretedFunction)

    @pytest.mark.parametrize("tokens", [1, 5, 64, 65, 200])
    @pytest.mark.parametrize("channels", [16, 40])
    @pytest.mark.parametrize("silu", [True, False], ids=["silu", "nosilu"])
    @pytest.mark.parametrize("tiles", [(16, 16), None], ids=["tiles16x16", "tiles-default"])
    def test_fork_conv_matches_reference(tokens, channels, silu, tiles):
        r = tiny_round(tokens, seed=tokens * 7 + channels)
        x, weight = randn(tokens, channels, seed=1), randn(channels, 4, seed=2)
        kwargs = {} if tiles is None else {"block_t": tiles[0], "block_d": tiles[1]}
        out = conv_triton.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, silu,
                                    out=poisoned(tokens, channels, dtype=torch.float32), **kwargs)
        want = conv_ref.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, silu)
        assert out.shape == want.shape and out.dtype == torch.float32
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # NaN anywhere (an unwritten element) fails

    @pytest.mark.parametrize("normalize", [True, False], ids=["l2norm", "plain"])
    @pytest.mark.parametrize("tokens,key_heads,value_heads,dim", [(1, 1, 1, 16), (65, 2, 4, 16), (130, 1, 2, 32)])
    def test_fork_conv_qkv_matches_reference_and_the_plain_conv(tokens, key_heads, value_heads, dim, normalize):
        """The conv with q | k | v laid out as the gated delta kernels read them (`fork_conv_qkv`): equal to the
        reference (conv, split, per-head L2 norm), x read in place as a column slice, three new contiguous tensors;
        v (and q / k unnormalised) with the plain Triton conv's bits at the same tile (one head a channel tile)."""
        D = (2 * key_heads + value_heads) * dim
        r = tiny_round(tokens, seed=tokens + D)
        x = randn(tokens, D + 24, seed=11)[:, 8:8 + D]
        weight = randn(D, 4, seed=12)
        q, k, v = conv_triton.fork_conv_qkv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, key_heads, dim, normalize)
        want = conv_ref.fork_conv_qkv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, key_heads, dim, normalize)
        assert [y.shape for y in (q, k, v)] == [(tokens, key_heads, dim)] * 2 + [(tokens, value_heads, dim)]
        assert all(y.is_contiguous() for y in (q, k, v))
        for got, ref in zip((q, k, v), want):
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        plain = conv_triton.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True, block_d=dim)
        assert torch.equal(v.reshape(tokens, -1), plain[:, 2 * key_heads * dim:])
        if not normalize:
            assert torch.equal(torch.cat([q, k], 1).reshape(tokens, -1), plain[:, :2 * key_heads * dim])
        else:
            norms = torch.cat([q, k], 1).norm(dim=-1)
            live = torch.cat([want[0], want[1]], 1).abs().amax(-1) > 0
            torch.testing.assert_close(norms[live], torch.ones_like(norms[live]), atol=1e-4, rtol=0)

    @pytest.mark.parametrize("channels_fastest", [False, True], ids=["tokens-first", "channels-first"])
    def test_fork_conv_grid_orders_keep_the_bits(monkeypatch, channels_fastest):
        """`CHANNELS_FASTEST` (the grid's first axis walks channel tiles) changes the order programs run in, not
        what they sum: both conv launches (plain, and laid out with the gates) keep the bits of the other order, and
        of the token-tiles-first grid it falls back to past the grid's second axis."""
        tokens, key_heads, value_heads, dim = 70, 1, 3, 16
        D = (2 * key_heads + value_heads) * dim
        r = tiny_round(tokens, seed=5)
        x, weight = randn(tokens, D, seed=21), randn(D, 4, seed=22)
        proj = randn(tokens, 2 * value_heads, seed=23)
        gates = (proj[:, :value_heads], proj[:, value_heads:], randn(value_heads, seed=24), randn(value_heads, seed=25))

        def both():
            return (conv_triton.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True, block_t=16, block_d=32),
                    *conv_triton.fork_conv_qkv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, key_heads, dim, True,
                                               gates))

        monkeypatch.setattr(conv_triton, "CHANNELS_FASTEST", not channels_fastest)
        want = both()
        monkeypatch.setattr(conv_triton, "CHANNELS_FASTEST", channels_fastest)
        got = both()
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        torch.testing.assert_close(got[0], conv_ref.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True),
                                   atol=1e-5, rtol=1e-5)
        monkeypatch.setattr(conv_triton, "_MAX_GRID_Y", 2)  # token tiles past the second axis: the first again
        assert conv_triton._grid(5, 3) == ((5, 3), False)
        assert all(torch.equal(g, w) for g, w in zip(both(), want))

    @pytest.mark.parametrize("value_heads", [1, 3, 16])
    def test_fork_conv_qkv_gates_match_transformers_formulas(value_heads):
        """With `gates` the fused conv also writes the GDN layer's g = -exp(A_log) * softplus(a + dt_bias) (fp32) and
        beta = sigmoid(b) from a / b read in place as column slices (one more column of programs), the conv's outputs
        unchanged. bf16 inputs as a model's; large a + dt_bias take softplus's linear branch (x > 20)."""
        tokens, dim = 37, 16
        D = (2 + value_heads) * dim
        r = tiny_round(tokens, seed=value_heads)
        x, weight = randn(tokens, D, seed=13), randn(D, 4, seed=14)
        proj = (randn(tokens, 2 * value_heads + 5, seed=15) * 8).to(torch.bfloat16)
        a, b = proj[:, 3:3 + value_heads], proj[:, 3 + value_heads:3 + 2 * value_heads]
        a_log = randn(value_heads, seed=16).to(torch.bfloat16)
        dt_bias = (randn(value_heads, seed=17) * 3).to(torch.bfloat16)
        dt_bias[0] = 25.0  # head 0's a + dt_bias mostly above 20: softplus's linear branch
        gates = (a, b, a_log, dt_bias)
        got = conv_triton.fork_conv_qkv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, 1, dim, True, gates)
        want = conv_ref.fork_conv_qkv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, 1, dim, True, gates)
        plain = conv_triton.fork_conv_qkv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, 1, dim, True)
        assert len(got) == 5 and all(torch.equal(y, z) for y, z in zip(got[:3], plain))
        g, beta = got[3:]
        assert g.dtype == torch.float32 and beta.dtype == torch.bfloat16 and g.is_contiguous() and beta.is_contiguous()
        assert ((a.float() + dt_bias.float()) > 20).any()  # the linear branch is exercised
        torch.testing.assert_close(g, want[3], atol=1e-5, rtol=1e-5)
        # this triton's interpreter truncates float32 -> bf16: within one bf16 step here (the GPU test checks bits)
        torch.testing.assert_close(beta.float(), want[4].float(), atol=8e-3, rtol=8e-3)
        with pytest.raises(ValueError, match="dt_bias"):
            conv_triton.fork_conv_qkv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, 1, dim, True,
                                      (a, b, a_log, dt_bias[:1]) if value_heads > 1 else (a, b, a_log, dt_bias[:0]))

    def test_fork_conv_qkv_rows_keep_their_bits_in_a_longer_stream():
        """A request's q / k / v rows have the same bits alone and after other requests (fixed tiles, per-row
        norms): batch-invariant."""
        r = tiny_round(70, seed=21)
        x, weight = randn(70, 64, seed=22), randn(64, 4, seed=23)
        alone = conv_triton.fork_conv_qkv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, 1, 16, True)
        pad = 19  # rows of another segment before it: every table index shifts by pad
        x2 = torch.cat([randn(pad, 64, seed=24), x])
        lo = torch.cat([torch.zeros(pad, dtype=r.seg_lo.dtype), r.seg_lo + pad])
        tlo = torch.cat([torch.zeros(pad, dtype=r.seg_lo.dtype), r.trunk_lo + pad])
        thi = torch.cat([torch.zeros(pad, dtype=r.seg_lo.dtype), r.trunk_hi + pad])
        inside = conv_triton.fork_conv_qkv(x2, weight, lo, tlo, thi, 1, 16, True)
        for a, b in zip(alone, inside):
            assert torch.equal(b[pad:], a)

    def test_fork_conv_qkv_refuses_layouts_it_cannot_tile():
        r = tiny_round(8, seed=1)
        x, weight = randn(8, 48, seed=1), randn(48, 4, seed=2)
        with pytest.raises(ValueError, match="power of two"):
            conv_triton.fork_conv_qkv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, 1, 12, True)
        with pytest.raises(ValueError, match="not q \\| k"):
            conv_triton.fork_conv_qkv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, 2, 16, True)

    @pytest.mark.parametrize("width", [1, 2, 3, 4, 6])
    def test_fork_conv_short_states_and_widths(width):
        """States of 0-3 tokens (shorter than the window): a question's window reaches past its state's start and
        must read zeros there, never a previous request's rows."""
        r = tiny_round(120, seed=width, max_state=3, max_question=6, max_questions=8)
        assert ((r.trunk_hi - r.trunk_lo) < width - 1).any() or width <= 2
        x, weight = randn(120, 24, seed=3), randn(24, width, seed=4)
        out = conv_triton.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True, block_t=16, block_d=16)
        want = conv_ref.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)

    def test_fork_conv_strided_inputs_and_fp16():
        """x a column slice of a wider tensor (rows not contiguous), weight the [D, 1, W] conv weight squeezed; fp16
        in, fp16 out, fp32 sums: within one fp16 rounding of the fp32 reference."""
        r = tiny_round(90, seed=5)
        wide = randn(90, 64, seed=6)
        x = wide[:, 8:40]
        weight = randn(32, 1, 4, seed=7).squeeze(1)
        out = conv_triton.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True, block_t=16, block_d=16)
        torch.testing.assert_close(out, conv_ref.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True),
                                   atol=1e-5, rtol=1e-5)
        x16, w16 = x.half(), weight.half()
        out16 = conv_triton.fork_conv(x16, w16, r.seg_lo, r.trunk_lo, r.trunk_hi, True)
        want = conv_ref.fork_conv(x16.float(), w16.float(), r.seg_lo, r.trunk_lo, r.trunk_hi, True)
        assert out16.dtype == torch.float16
        torch.testing.assert_close(out16.float(), want, atol=1e-3, rtol=2 ** -10)

    @pytest.mark.parametrize("width", [2, 4])
    def test_fork_conv_resumes_from_checkpoint_windows(width):
        """States resumed at m (their first m rows cut out of the stream, the W-1 inputs before m given as checkpoint
        windows) next to states without checkpoints: equal to the reference's `fork_conv_window`, and every kept row
        has the bits the same row gets in the full stream (the same inputs reach each tap)."""
        tokens, channels = 200, 24
        r = tiny_round(tokens, seed=36 + width, max_state=40)  # seeds with two states over 12 tokens, with questions
        long = [s for s in range(len(r.state_len)) if int(r.state_len[s]) > 12]
        assert len(long) >= 2
        cuts = [(int(r.state_start[s]), 4 + 3 * i) for i, s in enumerate(long[:2])]  # m = 4, 7
        x, weight = randn(tokens, channels, seed=31), randn(channels, width, seed=32)
        fresh = conv_triton.fork_conv(x, weight, r.seg_lo, r.trunk_lo, r.trunk_hi, True, block_t=16, block_d=16)
        rows, seg_lo, trunk_lo, trunk_hi, checkpoint = resume_states(r.seg_lo, r.trunk_lo, r.trunk_hi, cuts)
        windows = torch.stack([x[a + m - (width - 1): a + m] for a, m in cuts])
        args = (x[rows], weight, seg_lo, trunk_lo, trunk_hi)
        out = conv_triton.fork_conv(*args, True, block_t=16, block_d=16, window=(windows, checkpoint),
                                    out=poisoned(len(rows), channels, dtype=torch.float32))
        torch.testing.assert_close(out, conv_ref.fork_conv_window(*args, windows, checkpoint, True),
                                   atol=1e-5, rtol=1e-5)
        assert torch.equal(out, fresh[rows])
        none = torch.full_like(checkpoint, -1)  # no window used: the plain kernel's bits
        plain = conv_triton.fork_conv(*args, True, block_t=16, block_d=16)
        assert torch.equal(conv_triton.fork_conv(*args, True, block_t=16, block_d=16, window=(windows[:0], none)),
                           plain)

    def test_fork_conv_int32_and_int64_tables_give_the_same_bits():
        """A round's tables are int32 (the kernel widens them: its row offsets are int64); int64 ones, and a mix,
        give the same bits, windows included."""
        r = tiny_round(150, seed=3)
        assert r.seg_lo.dtype == torch.int32
        x, weight = randn(150, 40, seed=1), randn(40, 4, seed=2)
        narrow = (r.seg_lo, r.trunk_lo, r.trunk_hi)
        got = conv_triton.fork_conv(x, weight, *narrow, True, block_t=16, block_d=16)
        for tables in ([t.long() for t in narrow], [narrow[0].long(), narrow[1], narrow[2].long()]):
            assert torch.equal(conv_triton.fork_conv(x, weight, *tables, True, block_t=16, block_d=16), got)
        windows, index = randn(2, 3, 40, seed=4), (torch.arange(150) % 3 - 1)  # -1: no window
        with_window = conv_triton.fork_conv(x, weight, *narrow, True, block_t=16, block_d=16, window=(windows, index))
        assert torch.equal(conv_triton.fork_conv(x, weight, *narrow, True, block_t=16, block_d=16,
                                                 window=(windows, index.int())), with_window)

    def test_fork_conv_rejects_bad_metadata():
        x, weight = randn(8, 16, seed=1), randn(16, 4, seed=2)
        meta = torch.zeros(8, dtype=torch.int64)
        with pytest.raises(ValueError, match="seg_lo"):
            conv_triton.fork_conv(x, weight, meta.short(), meta, meta, True)
        with pytest.raises(ValueError, match="weight"):
            conv_triton.fork_conv(x, weight[:8], meta, meta, meta, True)

    # -----------------------------------------------------------------------------------------------------------------
    # fork_attention
    # -----------------------------------------------------------------------------------------------------------------

    Config = attn_triton.Config

    def test_fork_attention_kernel_is_interpreted():
        assert isinstance(attn_triton._fork_attention_kernel, InterpretedFunction)

    CASES = [  # tokens, (Hq, Hkv, D), config
        (1, (2, 2, 16), None),
        (17, (4, 2, 16), Config(16, 16, 4, 1)),
        (64, (4, 2, 32), Config(16, 16, 4, 1)),
        (65, (3, 1, 16), Config(16, 16, 4, 1)),  # group 3: 5 tokens x 3 heads per 16 rows, one row idle
        (150, (4, 2, 16), Config(16, 16, 4, 1)),
        (150, (2, 2, 8), Config(32, 16, 4, 1)),  # dim 8: padded to 16
        (130, (6, 2, 24), Config(32, 16, 4, 1)),  # dim 24: padded to 32, group 3
        (200, (4, 2, 16), None),  # the default fp32 tiles
    ]

    @pytest.mark.parametrize("tokens,heads,config", CASES,
                             ids=[f"T{t}-Hq{h[0]}-Hkv{h[1]}-D{h[2]}-{'default' if c is None else f'M{c.block_m}N{c.block_n}'}"
                                  for t, h, c in CASES])
    def test_fork_attention_matches_reference(tokens, heads, config):
        hq, hkv, d = heads
        r = tiny_round(tokens, seed=tokens + hq)
        q, k, v = randn(tokens, hq, d, seed=1), randn(tokens, hkv, d, seed=2), randn(tokens, hkv, d, seed=3)
        scale = d ** -0.5
        out = attn_triton.fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, scale, config=config,
                                         out=poisoned(tokens, hq, d, dtype=torch.float32))
        want = attn_ref.fork_attention_naive(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, scale)
        assert out.shape == (tokens, hq, d) and out.dtype == torch.float32
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)  # NaN anywhere (an unwritten element) fails

    def test_fork_attention_short_states():
        """States of 0-2 tokens: question rows whose state is empty (trunk_lo == trunk_hi, not necessarily 0) sit
        in the same query blocks as rows with a state, so the block's state range and its unmasked part must ignore
        them, and the rows themselves must see only their own tokens."""
        tokens = 120
        r = tiny_round(tokens, seed=4, max_state=2, max_question=7, max_questions=8)
        used = r.branch_len > 0
        stateless = used & (r.state_len[r.branch_state] == 0)  # questions of a 0-token state
        assert stateless.any() and (used & (r.state_len[r.branch_state] > 0)).any()
        q, k, v = randn(tokens, 4, 16, seed=7), randn(tokens, 2, 16, seed=8), randn(tokens, 2, 16, seed=9)
        out = attn_triton.fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25, config=Config(16, 16, 4, 1))
        want = attn_ref.fork_attention_naive(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)

    def test_fork_attention_value_dim_and_fp16():
        """Dv != D; fp16 inputs (fp16 out, fp32 softmax) within fp16 rounding of the fp32 reference."""
        tokens = 70
        r = tiny_round(tokens, seed=9)
        q, k, v = randn(tokens, 4, 16, seed=4), randn(tokens, 2, 16, seed=5), randn(tokens, 2, 32, seed=6)
        out = attn_triton.fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25, config=Config(16, 16, 4, 1))
        want = attn_ref.fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25)
        assert out.shape == (tokens, 4, 32)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        q16, k16, v16 = q.half(), k.half(), v.half()
        out16 = attn_triton.fork_attention(q16, k16, v16, r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25,
                                           config=Config(16, 16, 4, 1))
        want16 = attn_ref.fork_attention(q16.float(), k16.float(), v16.float(), r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25)
        assert out16.dtype == torch.float16
        torch.testing.assert_close(out16.float(), want16, atol=3e-3, rtol=3e-3)

    def test_fork_attention_visits_the_planned_key_blocks():
        """One 100-token state, then 6 questions of 10 tokens, then 4 pad tokens; GQA 4/2 packed in 16 rows = 8
        tokens a block, 16 keys a step. Per query block (stats: masked, unmasked key blocks):
        - a block of question rows only: the whole state unmasked but its last partial block (6 + 1), plus 1 or 2
          masked blocks of its own questions (at most 8 + 9 keys from the earliest own start);
        - a state block [8b, 8b + 8): causal; unmasked up to its first row, so floor((8b + 1) / 16) blocks, and at
          most 2 masked blocks on the diagonal;
        - the block that holds both the state's end and the first question's start: all masked, none skipped.
        The output is checked against the reference too, so a block wrongly skipped or unmasked fails twice."""
        from flide.round import Shape, build_round
        from flide.testing import synthetic_request

        request = synthetic_request(list(range(100)), [[7] * 10 for _ in range(6)])
        r = build_round([request], Shape(tokens=164, states=1, branches=6, readout_rows=6, options=2), pad_id=0).tensors
        tokens, hq, hkv, d = 164, 4, 2, 16
        config = Config(16, 16, 4, 1)
        q, k, v = randn(tokens, hq, d, seed=1), randn(tokens, hkv, d, seed=2), randn(tokens, hkv, d, seed=3)
        blocks = attn_triton.query_blocks(tokens, hq, hkv, d, torch.float32, config)
        assert blocks == 21
        stats = torch.full((hkv * blocks, 2), -1, dtype=torch.int32)
        out = attn_triton.fork_attention(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25, config=config, stats=stats)
        torch.testing.assert_close(out, attn_ref.fork_attention_naive(q, k, v, r.seg_lo, r.trunk_lo, r.trunk_hi, 0.25),
                                   atol=1e-5, rtol=1e-5)
        stats = stats.view(hkv, blocks, 2)
        assert torch.equal(stats[0], stats[1])  # both KV heads: the same plan
        for b in range(blocks):
            masked, full = stats[0, b].tolist()
            lo, hi = 8 * b, 8 * b + 8
            if hi <= 100:  # state rows only
                assert full == (8 * b + 1) // 16, (b, masked, full)
                assert 1 <= masked <= 2, (b, masked, full)
            elif lo >= 100 and lo < 160:  # question rows (and, in the last block, pad rows)
                assert full == 6, (b, masked, full)
                assert 2 <= masked <= 3, (b, masked, full)  # the state's last 4 keys, then 1-2 own blocks
            elif lo < 100:  # rows 96..103: the state's end and the first question's start: keys 0..103 in one
                assert full == 0 and masked == 7, (b, masked, full)  # masked run, not split around key 100
            else:  # pad rows only (160..163): each sees itself
                assert full == 0 and masked == 1, (b, masked, full)

    def test_fork_attention_int32_and_int64_tables_give_the_same_bits():
        r = tiny_round(130, seed=5)
        assert r.seg_lo.dtype == torch.int32
        q, k, v = randn(130, 4, 16, seed=1), randn(130, 2, 16, seed=2), randn(130, 2, 16, seed=3)
        narrow = (r.seg_lo, r.trunk_lo, r.trunk_hi)
        got = attn_triton.fork_attention(q, k, v, *narrow, 0.25, config=Config(16, 16, 4, 1))
        assert torch.equal(attn_triton.fork_attention(q, k, v, *[t.long() for t in narrow], 0.25,
                                                      config=Config(16, 16, 4, 1)), got)

    def test_fork_attention_rejects_bad_inputs():
        q, k = randn(8, 4, 16, seed=1), randn(8, 2, 16, seed=2)
        meta = torch.zeros(8, dtype=torch.int64)
        with pytest.raises(ValueError, match="seg_lo"):
            attn_triton.fork_attention(q, k, k, meta.short(), meta, meta, 0.25)
        with pytest.raises(ValueError, match="dtypes"):
            attn_triton.fork_attention(q, k, k.half(), meta, meta, meta, 0.25)
        with pytest.raises(ValueError, match="multiple"):
            attn_triton.fork_attention(randn(8, 3, 16, seed=1), k, k, meta, meta, meta, 0.25)
        with pytest.raises(ValueError, match="trunk_hi"):
            attn_triton.fork_attention(q, k, k, meta, meta, meta[:4], 0.25)

    # -----------------------------------------------------------------------------------------------------------------
    # gated_delta: the question call of the fork (each branch from its state's final recurrent state, by index)
    # -----------------------------------------------------------------------------------------------------------------

    def test_gated_delta_branches_kernel_is_interpreted():
        assert isinstance(delta_branches._branch_kernel, InterpretedFunction)
        assert isinstance(delta_branches._branch_chunk_kernel, InterpretedFunction)

    BRANCH_CASES = [  # tokens, (Hk, Hv, K, V), l2norm, longest question
        (1, (1, 1, 16, 16), True, 12),
        (65, (2, 4, 16, 32), True, 12),  # grouped value heads (2 per key head)
        (150, (2, 2, 24, 44), True, 12),  # K padded to 32, V over partial tiles (8 recurrent, 32 chunked)
        (200, (1, 3, 16, 16), False, 12),  # 3 value heads per key head, no l2norm
        (260, (1, 2, 16, 16), True, 50),  # questions over several 16-token chunks, the last one partial
        (40, (8, 32, 16, 40), True, 8),  # 32 value heads: 32 value columns a program (recurrent), partial last tile
    ]

    @pytest.mark.parametrize("form", delta_branches.FORMS)
    @pytest.mark.parametrize("tokens,heads,l2norm,longest", BRANCH_CASES,
                             ids=[f"T{t}-Hk{h[0]}-Hv{h[1]}-K{h[2]}-V{h[3]}-{'l2' if n else 'nol2'}-Q{m}"
                                  for t, h, n, m in BRANCH_CASES])
    def test_gated_delta_branches_match_the_reference_fork(tokens, heads, l2norm, longest, form):
        """The question call on a random round's branch tables, from the states' final states of the reference's
        state call: every question row equal to the reference's question call (fp32), written (NaN-poisoned)."""
        Hk, Hv, K, V = heads
        r = tiny_round(tokens, seed=tokens + Hv, max_question=longest)
        q, k = randn(tokens, Hk, K, seed=1), randn(tokens, Hk, K, seed=2)
        v = randn(tokens, Hv, V, seed=3)
        g = -torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(4)) * 0.7
        beta = torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(5))
        none = torch.full_like(r.state_start, -1)
        empty = torch.zeros(0, Hv, K, V)
        _, finals = delta_ref.gated_delta(q, k, v, g, beta, r.state_start, r.state_len, empty, none, 0.3, l2norm)
        want, _ = delta_ref.gated_delta(q, k, v, g, beta, r.branch_start, r.branch_len, finals, r.branch_state, 0.3,
                                        l2norm)
        out = delta_branches.branches(q, k, v, g, beta, r.branch_start, r.branch_len, finals, r.branch_state, 0.3,
                                      l2norm, out=poisoned(tokens, Hv, V, dtype=torch.float32), form=form)
        rows = segment_rows(tokens, r.branch_start, r.branch_len)
        assert rows.any() and (r.branch_len.max() > 16 or longest < 16)
        # recurrent vs chunked sums in fp32: rounding relative to the outputs' size (without l2norm they grow)
        scale = max(1.0, want[rows].abs().max().item())
        torch.testing.assert_close(out[rows], want[rows], atol=2e-5 * scale, rtol=1e-5)

    def gdn_inputs(tokens: int, heads: tuple[int, int, int, int], seed: int, decay: float):
        """Random fp32 gated-delta inputs (q, k L2-normalised; log decays in [-decay, 0]; beta in [0, 1]), each from
        its own seed (seed, seed + 1, ...)."""
        Hk, Hv, K, V = heads
        q = delta_ref.l2norm(randn(tokens, Hk, K, seed=seed))
        k = delta_ref.l2norm(randn(tokens, Hk, K, seed=seed + 1))
        v = randn(tokens, Hv, V, seed=seed + 2)
        g = -torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(seed + 3)) * decay
        beta = torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(seed + 4))
        return q, k, v, g, beta

    WY_CASES = [  # tokens, (Hk, Hv, K, V), longest question
        (70, (1, 1, 16, 16), 12),
        (300, (2, 4, 16, 32), 150),  # grouped value heads; questions over 1-3 64-token chunks, the last partial
        (260, (1, 3, 24, 44), 150),  # K and V padded to 32 / 64 (partial value tiles), 3 value heads per key head
    ]

    @pytest.mark.parametrize("tokens,heads,longest", WY_CASES,
                             ids=[f"T{t}-Hk{h[0]}-Hv{h[1]}-K{h[2]}-V{h[3]}-Q{m}" for t, h, m in WY_CASES])
    def test_gated_delta_questions_wy_match_the_reference_fork(tokens, heads, longest):
        """The chunked (WY) question call on a random round's branch tables, its chunk-local part from
        `wy_reference`, from the reference state call's final states: every question row equal to the reference's
        question call (fp32), and only those rows written (NaN-poisoned output)."""
        Hk, Hv, K, V = heads
        r = tiny_round(tokens, seed=tokens + Hv, max_question=longest)
        q, k, v, g, beta = gdn_inputs(tokens, heads, seed=11, decay=0.7)
        none = torch.full_like(r.state_start, -1)
        _, finals = delta_ref.gated_delta(q, k, v, g, beta, r.state_start, r.state_len, torch.zeros(0, Hv, K, V),
                                          none, 0.3, False)
        want, _ = delta_ref.gated_delta(q, k, v, g, beta, r.branch_start, r.branch_len, finals, r.branch_state, 0.3,
                                        False)
        w, u, gamma = delta_wy.wy_reference(k, v, g, beta, r.branch_start, r.branch_len)
        out = delta_wy.questions_wy(q, k, w, u, gamma, r.branch_start, r.branch_len, finals, r.branch_state, 0.3,
                                    out=poisoned(tokens, Hv, V, dtype=torch.float32))
        rows = segment_rows(tokens, r.branch_start, r.branch_len)
        assert rows.any() and (r.branch_len.max() > 64 or longest <= 64)
        assert out[~rows].isnan().all()
        scale = max(1.0, want[rows].abs().max().item())
        torch.testing.assert_close(out[rows], want[rows], atol=2e-5 * scale, rtol=1e-5)

    def test_gated_delta_questions_wy_kernel_is_interpreted():
        assert isinstance(delta_wy._chain_kernel, InterpretedFunction)

    CHUNKED_CASES = [  # tokens, (Hk, Hv, K, V), longest question
        (70, (1, 1, 16, 16), 12),
        (300, (2, 4, 16, 32), 150),  # grouped value heads; questions over 1-3 64-token chunks, the last partial
        (260, (1, 3, 32, 48), 150),  # 3 value heads per key head; V in a full and a partial 32-column tile
    ]

    @pytest.mark.parametrize("tokens,heads,longest", CHUNKED_CASES,
                             ids=[f"T{t}-Hk{h[0]}-Hv{h[1]}-K{h[2]}-V{h[3]}-Q{m}" for t, h, m in CHUNKED_CASES])
    def test_gated_delta_questions_chunked_match_the_reference_fork(tokens, heads, longest):
        """The chunked question call (w / u formed in the kernel from the solved rows A, as fla's kkt + solve step
        gives them: `wy_reference(with_solve=True)`) on a random round's branch tables, from the reference state
        call's final states: every question row equal to the reference's question call (fp32), only those rows
        written (NaN-poisoned output), A read only where the kkt + solve launch writes it (NaN elsewhere)."""
        Hk, Hv, K, V = heads
        r = tiny_round(tokens, seed=tokens + Hv, max_question=longest)
        q, k, v, g, beta = gdn_inputs(tokens, heads, seed=31, decay=0.3)
        none = torch.full_like(r.state_start, -1)
        _, finals = delta_ref.gated_delta(q, k, v, g, beta, r.state_start, r.state_len, torch.zeros(0, Hv, K, V),
                                          none, 0.3, False)
        want, _ = delta_ref.gated_delta(q, k, v, g, beta, r.branch_start, r.branch_len, finals, r.branch_state, 0.3,
                                        False)
        _, _, gamma, solved = delta_wy.wy_reference(k, v, g, beta, r.branch_start, r.branch_len, with_solve=True)
        solved = solved_poisoned(solved, r.branch_start, r.branch_len)  # only the lower triangle written
        out = delta_chunked.questions_chunked(q, k, v, beta, gamma, solved, r.branch_start, r.branch_len, finals,
                                              r.branch_state, 0.3, out=poisoned(tokens, Hv, V, dtype=torch.float32))
        # programs taking the rows in turns of 3 (or one row each): the same bits, each row's sums its own
        for programs in (3, r.branch_len.shape[0]):
            again = delta_chunked.questions_chunked(q, k, v, beta, gamma, solved, r.branch_start, r.branch_len,
                                                    finals, r.branch_state, 0.3, row_programs=programs,
                                                    out=poisoned(tokens, Hv, V, dtype=torch.float32))
            assert torch.equal(again.nan_to_num(7.0), out.nan_to_num(7.0))
        rows = segment_rows(tokens, r.branch_start, r.branch_len)
        assert rows.any() and (r.branch_len.max() > 64 or longest <= 64)
        assert out[~rows].isnan().all()
        scale = max(1.0, want[rows].abs().max().item())
        torch.testing.assert_close(out[rows], want[rows], atol=2e-5 * scale, rtol=1e-5)
        # the 16-bit tiles (BLOCK_V: 64 value columns a program, V=48 in one partial tile, V=16 / 32 in one capped
        # to the head), on the same fp32 inputs: the reference's values
        assert delta_chunked.BLOCK_V == 64
        wide = delta_chunked.questions_chunked(q, k, v, beta, gamma, solved, r.branch_start, r.branch_len, finals,
                                               r.branch_state, 0.3, out=poisoned(tokens, Hv, V, dtype=torch.float32),
                                               tiles=sixteen_bit_tiles())
        assert wide[~rows].isnan().all()
        torch.testing.assert_close(wide[rows], want[rows], atol=2e-5 * scale, rtol=1e-5)

    def sixteen_bit_tiles() -> tuple[int, int, int]:
        """The chunked question launch's tiles for 16-bit inputs (fp32 inputs take FP32_TILES by default)."""
        return delta_chunked.BLOCK_V, delta_chunked.NUM_WARPS, delta_chunked.NUM_STAGES

    def nested_question_call(sub_len: int, seed: int):
        """test_gated_delta_nested's hand-built nested stream (a sub-trunk of `sub_len` tokens; 2 value heads, K 16,
        V 32, fp32), the reference state call's final states and the reference's nested question call: (stream,
        (q, k, v, g, beta), finals, wanted output)."""
        from test_gated_delta_nested import inputs, nested_stream

        s = nested_stream(sub_len)
        Hv, K, V = 2, 16, 32
        x = inputs(s.T, (1, Hv, K, V), l2norm=False, seed=seed)
        none = torch.full_like(s.state_start, -1)
        _, finals = delta_ref.gated_delta(*x, s.state_start, s.state_len, torch.zeros(0, Hv, K, V), none, 0.3, False)
        want, _ = delta_ref.gated_delta(*x, s.branch_start, s.branch_len, finals, s.branch_state, 0.3, False,
                                        s.sub_lo, s.sub_hi)
        return s, x, finals, want

    def split_nested_call(s, x, finals, want, plain_len, nested_len, group_len=None):
        """`questions_split_nested` on the hand-built stream split by `plain_len` / `nested_len` (/ `group_len`: the
        long leaves' groups), A solved over the chunked rows' chunks (as the combined tables leave the nested rows
        out), checked: the flags zero after, every question row equal to the reference's nested call (fp32), nothing
        else written. Returns (gamma, solved, flags, out, question rows)."""
        from flide.ops.gated_delta import new_sub_flags

        q, k, v, g, beta = x
        Hv, V = v.shape[1:]
        chunked_len = plain_len if group_len is None else plain_len + group_len
        _, _, gamma, solved = delta_wy.wy_reference(k, v, g, beta, s.branch_start, chunked_len, with_solve=True)
        flags = new_sub_flags(Hv, V)
        out = delta_chunked.questions_split_nested(q, k, v, g, beta, gamma, solved, s.branch_start, plain_len,
                                                   nested_len, finals, s.branch_state, s.sub_lo, s.sub_hi, s.slots(),
                                                   flags, 0.3, out=poisoned(s.T, Hv, V, dtype=torch.float32),
                                                   group_len=group_len)
        assert not flags.any()
        rows = segment_rows(s.T, s.branch_start, s.branch_len)
        assert out[~rows].isnan().all()
        scale = max(1.0, want[rows].abs().max().item())
        torch.testing.assert_close(out[rows], want[rows], atol=2e-5 * scale, rtol=1e-5)
        return gamma, solved, flags, out, rows

    @pytest.mark.parametrize("sub_len", [9, 70], ids=["sub9", "sub70"])
    def test_gated_delta_questions_chunked_nested_leaves_continue_their_sub_trunk(sub_len, monkeypatch):
        """A nested fork's question call in chunked form: each leaf runs its sub-trunk's chunks (one or two: a
        sub-trunk of 9 or 70 tokens) from its state's final state, then its own, as the reference's nested call
        (`reference.gated_delta(sub_lo, sub_hi)`); every other row as the plain call. Hand-built stream: a leaf
        before its sub-trunk, plain questions between, a spare row, padding."""
        from flide.ops.gated_delta import SUB_STATE_SLOTS

        s, (q, k, v, g, beta), finals, want = nested_question_call(sub_len, seed=3)
        Hv, V = v.shape[1:]
        sub = (s.sub_lo, s.sub_hi)
        _, _, gamma, solved = delta_wy.wy_reference(k, v, g, beta, s.branch_start, s.branch_len, with_solve=True)
        out = delta_chunked.questions_chunked(q, k, v, beta, gamma, solved, s.branch_start, s.branch_len, finals,
                                              s.branch_state, 0.3, sub=sub,
                                              out=poisoned(s.T, Hv, V, dtype=torch.float32))
        plain = delta_chunked.questions_chunked(q, k, v, beta, gamma, solved, s.branch_start, s.branch_len, finals,
                                                s.branch_state, 0.3)
        rows = segment_rows(s.T, s.branch_start, s.branch_len)
        assert out[~rows].isnan().all() and s.leaves
        scale = max(1.0, want[rows].abs().max().item())
        torch.testing.assert_close(out[rows], want[rows], atol=2e-5 * scale, rtol=1e-5)
        for leaf, parent in s.leaves:  # the leaves differ from a plain call's: their sub-trunk was run first
            lo, n = int(s.branch_start[leaf]), int(s.branch_len[leaf])
            assert not torch.allclose(out[lo:lo + n], plain[lo:lo + n], atol=1e-3)
        for row in s.plain:  # sub-trunks and plain questions: the plain call's bits
            lo, n = int(s.branch_start[row]), int(s.branch_len[row])
            assert torch.equal(out[lo:lo + n], plain[lo:lo + n])
        # stored sub-trunk states (two launches): every slotted leaf from its sub-trunk's state, the others (a cap of
        # one slot) re-running theirs: the bits of the one-launch call
        for cap in (SUB_STATE_SLOTS, 1):
            slots = s.slots(cap)
            assert (slots >= 0).any() and (cap > 1 or (slots[[leaf for leaf, _ in s.leaves]] < 0).any())
            monkeypatch.setattr(delta_chunked, "STORED_SUB_STATES", True)
            stored = delta_chunked.questions_chunked(q, k, v, beta, gamma, solved, s.branch_start, s.branch_len,
                                                     finals, s.branch_state, 0.3, sub=sub, sub_slot=slots,
                                                     out=poisoned(s.T, Hv, V, dtype=torch.float32))
            assert torch.equal(stored.nan_to_num(7.0), out.nan_to_num(7.0))
        # the 16-bit tiles (64 columns: the head's whole V in one program here), one launch and stored: the
        # reference's values, each form the other's bits
        wide = [delta_chunked.questions_chunked(q, k, v, beta, gamma, solved, s.branch_start, s.branch_len, finals,
                                                s.branch_state, 0.3, sub=sub, sub_slot=slots,
                                                out=poisoned(s.T, Hv, V, dtype=torch.float32),
                                                tiles=sixteen_bit_tiles()) for slots in (None, s.slots())]
        torch.testing.assert_close(wide[0][rows], want[rows], atol=2e-5 * scale, rtol=1e-5)
        assert torch.equal(wide[1].nan_to_num(7.0), wide[0].nan_to_num(7.0))

    @pytest.mark.parametrize("sub_len", [9, 70], ids=["sub9", "sub70"])
    def test_gated_delta_questions_chunked_split_nested_match_the_reference(sub_len, monkeypatch):
        """A nested fork's question call split by rows (`questions_split_nested`): the leaves and the sub-trunks they
        continue by the recurrent nested kernel (raw gates; the sub-trunks' stored states, flags zero again after),
        the other rows in chunked form from the solved rows of their own chunks only (as the combined tables leave
        the nested rows out). Every question row equal to the reference's nested call (fp32), nothing else written;
        each part's rows with the bits of its kernel called alone on its rows."""
        from flide.ops.gated_delta import nested_rows, split_question_lens

        s, (q, k, v, g, beta), finals, want = nested_question_call(sub_len, seed=5)
        Hv, V = v.shape[1:]
        sub = (s.sub_lo, s.sub_hi)
        nested = nested_rows(s.branch_start, s.branch_len, *sub)
        assert set(nested.nonzero().flatten().tolist()) == {row for pair in s.leaves for row in pair}
        plain_len, nested_len = split_question_lens(s.branch_start, s.branch_len, *sub)
        assert torch.equal(nested_len > 0, nested) and torch.equal(plain_len + nested_len, s.branch_len)
        gamma, solved, flags, out, rows = split_nested_call(s, (q, k, v, g, beta), finals, want, plain_len, nested_len)
        recurrent = delta_branches.branches(q, k, v, g, beta, s.branch_start, nested_len, finals, s.branch_state,
                                            0.3, False, sub=sub)
        chunked = delta_chunked.questions_chunked(q, k, v, beta, gamma, solved, s.branch_start, plain_len, finals,
                                                  s.branch_state, 0.3)
        for part, lens in ((recurrent, nested_len), (chunked, plain_len)):
            part_rows = segment_rows(s.T, s.branch_start, lens)
            assert part_rows.any() and torch.equal(out[part_rows], part[part_rows])
        # the nested launch with row programs taking blocks of rows (questions_chunked.NESTED_ROW_PROGRAMS: one
        # program over every row, three, more programs than rows) or a program a row (0): the same bits, the flags
        # zero again
        for programs in (0, 1, 3, 64):
            monkeypatch.setattr(delta_chunked, "NESTED_ROW_PROGRAMS", programs)
            turns = delta_chunked.questions_split_nested(q, k, v, g, beta, gamma, solved, s.branch_start, plain_len,
                                                         nested_len, finals, s.branch_state, *sub, s.slots(), flags,
                                                         0.3, out=poisoned(s.T, Hv, V, dtype=torch.float32))
            assert not flags.any() and torch.equal(turns[rows], out[rows]) and turns[~rows].isnan().all()
        # the nested launch's own value-column width (NESTED_BLOCK_V: 32, the head's whole V here, against 16) in a
        # stream of NESTED_BLOCK_V_MIN_TOKENS tokens or more: other sums over K, the reference's values; the chunked
        # rows untouched. One token short of it, or with fixed tiles (batch-invariant mode: no width that follows the
        # bucket): the recurrent kernel's own width, the bits above
        monkeypatch.setattr(delta_chunked, "NESTED_BLOCK_V", 32)
        plain_rows = segment_rows(s.T, s.branch_start, plain_len)
        scale = max(1.0, want[rows].abs().max().item())
        tiles = []  # the nested launch's `tiles` argument, call by call
        launch = delta_branches.branches
        monkeypatch.setattr(delta_branches, "branches",
                            lambda *a, **kw: tiles.append(kw.get("tiles")) or launch(*a, **kw))
        for min_tokens, fixed_tiles in ((s.T, False), (s.T + 1, False), (s.T, True)):
            monkeypatch.setattr(delta_chunked, "NESTED_BLOCK_V_MIN_TOKENS", min_tokens)
            tiles.clear()
            wide = delta_chunked.questions_split_nested(q, k, v, g, beta, gamma, solved, s.branch_start, plain_len,
                                                        nested_len, finals, s.branch_state, *sub, s.slots(), flags,
                                                        0.3, out=poisoned(s.T, Hv, V, dtype=torch.float32),
                                                        fixed_tiles=fixed_tiles)
            assert not flags.any() and wide[~rows].isnan().all() and torch.equal(wide[plain_rows], out[plain_rows])
            torch.testing.assert_close(wide[rows], want[rows], atol=2e-5 * scale, rtol=1e-5)
            if min_tokens > s.T or fixed_tiles:
                assert tiles == [None] and torch.equal(wide[rows], out[rows])
            else:
                assert tiles == [(32, delta_branches.NUM_WARPS)]
        # a split call in a round without nested forks: its nested table all empty, nothing written by it
        empty = delta_branches.branches(q, k, v, g, beta, s.branch_start, torch.zeros_like(nested_len), finals,
                                        s.branch_state, 0.3, False, sub=sub, row_programs=3,
                                        out=poisoned(s.T, Hv, V, dtype=torch.float32))
        assert empty.isnan().all()

    @pytest.mark.parametrize("leaf_tokens", [1, 0], ids=["leaves-over-1", "leaves-over-0"])
    def test_gated_delta_questions_chunked_split_nested_sends_long_leaves_chunked(leaf_tokens, monkeypatch):
        """`NESTED_CHUNKED_LEAF_TOKENS` L: a sub-trunk whose every leaf has more than L tokens goes chunked with its
        leaves (each re-running its sub-trunk's chunks there: `group_len`, a launch of the nested form of its own),
        the others stay recurrent, the plain rows chunked in the plain form. The hand-built stream's sub-trunk P has
        leaves of 3, 4 and 1 tokens, P2 one of 2: at L = 1 P's group stays recurrent and P2's goes chunked, at L = 0
        both go chunked. Every question row equal to the reference's nested call (fp32), the flags zero after, each
        part with the bits of its kernel alone on its rows."""
        from flide.ops import gated_delta as delta_pkg
        from flide.ops.gated_delta import split_question_lens

        s, (q, k, v, g, beta), finals, want = nested_question_call(9, seed=6)
        sub = (s.sub_lo, s.sub_hi)
        monkeypatch.setattr(delta_pkg, "NESTED_CHUNKED_LEAF_TOKENS", leaf_tokens)
        plain_len, nested_len, group_len = split_question_lens(s.branch_start, s.branch_len, *sub)
        assert torch.equal(plain_len + nested_len + group_len, s.branch_len)
        assert not ((plain_len > 0) & (nested_len > 0) | (plain_len > 0) & (group_len > 0)
                    | (nested_len > 0) & (group_len > 0)).any()
        groups = {}  # sub-trunk row -> its leaves' rows
        for leaf, parent in s.leaves:
            groups.setdefault(parent, []).append(leaf)
        recurrent = {row for parent, leaves in groups.items()
                     if min(int(s.branch_len[leaf]) for leaf in leaves) <= leaf_tokens for row in [parent, *leaves]}
        grouped = {row for parent, leaves in groups.items() for row in [parent, *leaves]}
        assert set((nested_len > 0).nonzero().flatten().tolist()) == recurrent
        assert set((group_len > 0).nonzero().flatten().tolist()) == grouped - recurrent
        assert (len(recurrent) > 0) == (leaf_tokens == 1) and grouped - recurrent
        lens = (plain_len, nested_len, group_len)
        gamma, solved, _, out, rows = split_nested_call(s, (q, k, v, g, beta), finals, want, *lens)
        plain = delta_chunked.questions_chunked(q, k, v, beta, gamma, solved, s.branch_start, plain_len, finals,
                                                s.branch_state, 0.3)
        chunked = delta_chunked.questions_chunked(q, k, v, beta, gamma, solved, s.branch_start, group_len, finals,
                                                  s.branch_state, 0.3, sub=sub)
        for part, part_len in ((plain, plain_len), (chunked, group_len)):
            part_rows = segment_rows(s.T, s.branch_start, part_len)
            assert part_rows.any() and torch.equal(out[part_rows], part[part_rows])
        if recurrent:
            alone = delta_branches.branches(q, k, v, g, beta, s.branch_start, nested_len, finals, s.branch_state, 0.3,
                                            False, sub=sub)
            part_rows = segment_rows(s.T, s.branch_start, nested_len)
            assert torch.equal(out[part_rows], alone[part_rows])
        # the chunked groups' leaves from their sub-trunks' stored states (STORED_SUB_STATES): the same bits
        monkeypatch.setattr(delta_chunked, "STORED_SUB_STATES", True)
        _, _, _, stored, _ = split_nested_call(s, (q, k, v, g, beta), finals, want, *lens)
        assert torch.equal(stored[rows], out[rows])

    @pytest.mark.parametrize("tokens,heads,longest", CHUNKED_CASES,
                             ids=[f"T{t}-Hk{h[0]}-Hv{h[1]}-K{h[2]}-V{h[3]}-S{m}" for t, h, m in CHUNKED_CASES])
    def test_gated_delta_w_u_matches_the_reference(tokens, heads, longest):
        """The w / u step over a random round's state chunk table (spare rows included: they write nothing) from the
        reference's solved rows (NaN where the kkt + solve launch writes nothing): w and u equal to `wy_reference`'s
        on every state token (fp32)."""
        from flide.ops.gated_delta import fla as delta_fla

        Hk, Hv, K, V = heads
        r = tiny_round(tokens, seed=tokens + 5, max_state=longest)
        _, k, v, g, beta = gdn_inputs(tokens, heads, seed=41, decay=0.3)
        w_ref, u_ref, gamma, solved = delta_wy.wy_reference(k, v, g, beta, r.state_start, r.state_len,
                                                            with_solve=True)
        cu = delta_fla.bounds(r.state_start, r.state_len)
        chunks = delta_fla.chunk_table(cu, tokens // 64 + r.state_start.shape[0] + 1)
        solved = solved_poisoned(solved, r.state_start, r.state_len)  # only the lower triangle written
        w, u = delta_w_u.w_u(k[None], v[None], beta[None], solved[None], gamma[None], cu, chunks)
        rows = segment_rows(tokens, r.state_start, r.state_len)
        assert rows.any() and (r.state_len.max() > 64 or longest <= 64)
        torch.testing.assert_close(w[0][rows], w_ref[rows], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(u[0][rows], u_ref[rows], atol=2e-5 * max(1.0, u_ref.abs().max().item()),
                                   rtol=1e-5)

    KKT_CASES = [(1, 1, 16), (2, 4, 32), (1, 3, 16)]  # (Hk, Hv, K): grouped value heads, 3 value heads a key head

    @pytest.mark.parametrize("heads", KKT_CASES, ids=[f"Hk{h[0]}-Hv{h[1]}-K{h[2]}" for h in KKT_CASES])
    def test_gated_delta_kkt_solve_matches_the_reference(heads):
        """The kkt + solve step (fla's arithmetic, the diagonal blocks' substitutions side by side) over sequences of
        70, 1, 64, 130, 15 and 35 tokens (chunks of 1 to 64 tokens, every partial 16-token block) and spare chunk
        rows: each chunk's lower triangle equal to the float64 solve of `wy_reference` (fp32), nothing written in the
        upper blocks nor past the sequences (NaN-poisoned A)."""
        from flide.ops.gated_delta import fla as delta_fla

        Hk, Hv, K = heads
        lens = torch.tensor([70, 1, 64, 130, 15, 35])
        starts = lens.cumsum(0) - lens
        tokens = int(lens.sum()) + 20
        _, k, v, g, beta = gdn_inputs(tokens, (Hk, Hv, K, 16), seed=51, decay=0.5)
        _, _, gamma, solved = delta_wy.wy_reference(k, v, g, beta, starts, lens, with_solve=True)
        cu = delta_fla.bounds(starts, lens)
        chunks = delta_fla.chunk_table(cu, tokens // 64 + lens.shape[0] + 3)
        A = torch.full((1, tokens, Hv, 64), float("nan"))
        delta_kkt.kkt_solve(k[None], gamma[None], beta[None], cu, chunks, A)
        lower = ~solved_poisoned(solved, starts, lens).isnan()
        assert lower.any()
        torch.testing.assert_close(A[0][lower], solved[lower], atol=1e-5, rtol=1e-5)
        # written: each chunk's lower blocks (the diagonal ones whole: zero above their diagonal); nothing else
        t = torch.arange(tokens)
        seq = (torch.searchsorted(cu, t, right=True) - 1).clamp(max=lens.shape[0] - 1)
        within = torch.where(t < int(cu[-1]), (t - starts[seq]) % 64, -1)
        blocks = (within // 16)[:, None] >= (torch.arange(64) // 16)[None, :]  # [T, 64]: lower blocks of a row
        written = ~A[0].isnan()
        assert torch.equal(written, (blocks & (within >= 0)[:, None])[:, None, :].expand_as(written))
        assert (A[0][written & ~lower] == 0).all()

    def test_gated_delta_kkt_solve_kernel_is_interpreted():
        assert isinstance(delta_kkt._kkt_solve_kernel, InterpretedFunction)

    def test_gated_delta_w_u_kernel_is_interpreted():
        assert isinstance(delta_w_u._w_u_kernel, InterpretedFunction)

    def test_gated_delta_questions_chunked_kernel_is_interpreted():
        assert isinstance(delta_chunked._questions_chunked_kernel, InterpretedFunction)

    CHAIN_CASES = [  # tokens, (Hk, Hv, K, V), longest state
        (70, (1, 1, 16, 16), 40),
        (400, (2, 4, 16, 32), 200),  # grouped value heads; states over 1-4 64-token chunks, the last partial
        (300, (1, 3, 32, 48), 150),  # 3 value heads per key head; V in a full and a partial 32-column tile
    ]

    @pytest.mark.parametrize("tokens,heads,longest", CHAIN_CASES,
                             ids=[f"T{t}-Hk{h[0]}-Hv{h[1]}-K{h[2]}-V{h[3]}-S{m}" for t, h, m in CHAIN_CASES])
    @pytest.mark.parametrize("initial", [False, True], ids=["from-zero", "from-states"])
    def test_gated_delta_state_chain_matches_the_reference(tokens, heads, longest, initial, monkeypatch):
        """The fused h + o steps on a random round's states (their chunk-local WY form from `wy_reference`, as
        fla's intra step gives it): every state row and every final state (spare sequences' included: their
        initial state) equal to the reference's state call in fp32, and only the state rows written."""
        from flide.ops.gated_delta import fla as delta_fla

        Hk, Hv, K, V = heads
        r = tiny_round(tokens, seed=tokens + Hv, max_state=longest)
        # mild decays: a state carries over its chunks (strong ones would leave the last chunk's terms only)
        q, k, v, g, beta = gdn_inputs(tokens, heads, seed=21, decay=0.05)
        n = r.state_start.shape[0]
        h0 = randn(n, Hv, K, V, seed=26) * 0.3 if initial else torch.zeros(0, Hv, K, V)
        index = torch.arange(n) if initial else torch.full_like(r.state_start, -1)
        want, want_final = delta_ref.gated_delta(q, k, v, g, beta, r.state_start, r.state_len, h0, index, 0.3, False)
        cu = delta_fla.bounds(r.state_start, r.state_len)[:-1]  # the states' sequences (the layout: contiguous)
        w, u, gamma = delta_wy.wy_reference(k, v, g, beta, r.state_start, r.state_len)
        out, final = delta_chain.state_chain(q, k, w, u, gamma, cu, 0.3, h0 if initial else None)
        rows = segment_rows(tokens, r.state_start, r.state_len)
        assert rows.any() and (r.state_len.max() > 64 or longest <= 64) and (r.state_len == 0).any()
        scale = max(1.0, want[rows].abs().max().item())
        torch.testing.assert_close(out[rows], want[rows], atol=2e-5 * scale, rtol=1e-5)
        torch.testing.assert_close(final, want_final, atol=2e-5 * max(1.0, want_final.abs().max().item()), rtol=1e-5)
        if initial:  # an empty sequence's final state is then its initial state: it must be stored
            with pytest.raises(ValueError, match="empty_finals"):
                delta_chain.state_chain(q, k, w, u, gamma, cu, 0.3, h0, empty_finals=False)
        else:  # the fork's form: the same rows and the same final states of every non-empty sequence
            out_skip, final_skip = delta_chain.state_chain(q, k, w, u, gamma, cu, 0.3, empty_finals=False)
            used = r.state_len > 0
            assert torch.equal(out_skip[rows], out[rows]) and torch.equal(final_skip[used], final[used])
            # programs taking the sequences in turns (fewer programs than sequences) or one each: the same bits
            for programs in (2, 0):
                monkeypatch.setattr(delta_chain, "ROW_PROGRAMS", programs)
                out_rows, final_rows = delta_chain.state_chain(q, k, w, u, gamma, cu, 0.3, empty_finals=False)
                assert torch.equal(out_rows[rows], out[rows]) and torch.equal(final_rows[used], final[used])
            assert len(r.state_len) > 2

    def chunk_outputs_reference(q, k, v_new, h, gamma, cu, chunks, scale):
        """fla's o step in torch (fp32): each chunk row r = (sequence, chunk) of `chunks` takes the state h[r] before
        its chunk and the chunk's new values, o_i = scale (2^g_i q_i h + sum_{j <= i} 2^(g_i - g_j) (q_i . k_j)
        v_j); rows of no chunk row stay NaN."""
        T, Hk, K = q.shape
        Hv = v_new.shape[1]
        o = torch.full_like(v_new, float("nan"))
        kq = q.repeat_interleave(Hv // Hk, dim=1)
        kk = k.repeat_interleave(Hv // Hk, dim=1)
        for r, (n, c) in enumerate(chunks.tolist()):
            lo, hi = int(cu[n]) + c * 64, min(int(cu[n]) + (c + 1) * 64, int(cu[n + 1]))
            if lo >= hi:
                continue
            qc, kc, vc, gc = kq[lo:hi], kk[lo:hi], v_new[lo:hi], gamma[lo:hi]  # [L, Hv, *], [L, Hv]
            inter = torch.einsum("lhk,hkv->lhv", qc, h[r]) * torch.exp2(gc)[..., None]
            a = torch.einsum("ihk,jhk->hij", qc, kc) * torch.exp2(gc.T[:, :, None] - gc.T[:, None, :])
            a = a.tril()
            o[lo:hi] = (inter + torch.einsum("hij,jhv->ihv", a, vc)) * scale
        return o

    @pytest.mark.parametrize("split", [40, 100])
    def test_gated_delta_state_chain_split_matches_the_reference(split):
        """`state_chain_split`: sequences over `split` tokens through the LONG chain (states and new values stored at
        the rows of `fla.split_tables`) and an o step over their chunk rows (here fla's in torch), the others
        through the SHORT fused chain into the same output: every state row and final state equal to the reference's
        state call in fp32, the LONG part's states and new values those of the one-step chain."""
        from flide.ops.gated_delta import fla as delta_fla

        Hk, Hv, K, V = 2, 4, 16, 32
        tokens = 600
        r = tiny_round(tokens, seed=split, max_state=220)
        q, k, v, g, beta = gdn_inputs(tokens, (Hk, Hv, K, V), seed=33, decay=0.05)
        n = r.state_start.shape[0]
        want, want_final = delta_ref.gated_delta(q, k, v, g, beta, r.state_start, r.state_len, torch.zeros(0, Hv, K, V),
                                                 torch.full_like(r.state_start, -1), 0.3, False)
        cu_all = delta_fla.bounds(r.state_start, r.state_len)  # the states, then the trailing empty sequence
        long_chunks, long_offsets = delta_fla.split_tables(cu_all, tokens // 64 + n + 1, split)
        lens = r.state_len
        assert ((lens > split).any() and ((lens > 0) & (lens <= split)).any() and (lens == 0).any())
        w, u, gamma = delta_wy.wy_reference(k, v, g, beta, r.state_start, r.state_len)
        stored = {}

        def outputs(h, v_new):
            stored.update(h=h.clone(), v_new=v_new.clone())
            return chunk_outputs_reference(q, k, v_new, h, gamma, cu_all, long_chunks, 0.3)

        out, final = delta_chain.state_chain_split(q, k, w, u, gamma, cu_all, 0.3, split, long_chunks, long_offsets,
                                                   outputs)
        # and with its own outputs kernel (the default): the same outputs as the oracle's o step
        own, own_final = delta_chain.state_chain_split(q, k, w, u, gamma, cu_all, 0.3, split, long_chunks,
                                                       long_offsets)
        rows = segment_rows(tokens, r.state_start, r.state_len)
        scale = max(1.0, want[rows].abs().max().item())
        torch.testing.assert_close(out[rows], want[rows], atol=2e-5 * scale, rtol=1e-5)
        torch.testing.assert_close(final, want_final, atol=2e-5 * max(1.0, want_final.abs().max().item()), rtol=1e-5)
        torch.testing.assert_close(own[rows], out[rows], atol=2e-5 * scale, rtol=1e-5)
        torch.testing.assert_close(own_final, final, atol=0, rtol=0)
        if split == 100:  # the fork's form (`empty_finals=False`): the same except the empty sequences' final rows
            skip, skip_final = delta_chain.state_chain_split(q, k, w, u, gamma, cu_all, 0.3, split, long_chunks,
                                                             long_offsets, empty_finals=False)
            assert torch.equal(skip[rows], own[rows]) and torch.equal(skip_final[lens > 0], own_final[lens > 0])
        # the LONG part stored, for each long sequence's chunk, the state the reference has before it
        for s_i in torch.nonzero(lens > split).flatten().tolist():
            length = int(lens[s_i])
            for c in range(0, (length + 63) // 64):
                _, before = delta_ref.gated_delta(q, k, v, g, beta, r.state_start[s_i:s_i + 1],
                                                  torch.tensor([c * 64]), torch.zeros(0, Hv, K, V),
                                                  torch.tensor([-1]), 0.3, False)
                torch.testing.assert_close(stored["h"][int(long_offsets[s_i]) + c], before[0], atol=2e-5 * scale,
                                           rtol=1e-5)

    @pytest.mark.parametrize("split,segment", [(100, 64), (60, 128)])
    def test_gated_delta_state_chain_segments_match_the_reference(split, segment):
        """`state_chain_segments`: sequences over `split` tokens in segments of `segment` tokens (transitions [S0 | M]
        in parallel, the combine scan, each segment's fused chain from its start state), the others whole: every
        state row and final state equal to the reference's state call in fp32; a long sequence's first segment the
        one-step chain's bits, a short sequence's all of them; with `empty_finals=False` the same rows."""
        from flide.ops.gated_delta import fla as delta_fla
        from flide.ops.gated_delta import segment_scan

        Hk, Hv, K, V = 2, 4, 16, 32
        tokens = 600
        r = tiny_round(tokens, seed=6, max_state=300)  # states of 293, 15, 43 and 123 tokens
        q, k, v, g, beta = gdn_inputs(tokens, (Hk, Hv, K, V), seed=35, decay=0.05)
        want, want_final = delta_ref.gated_delta(q, k, v, g, beta, r.state_start, r.state_len, torch.zeros(0, Hv, K, V),
                                                 torch.full_like(r.state_start, -1), 0.3, False)
        cu_all = delta_fla.bounds(r.state_start, r.state_len)
        lens = r.state_len
        # a sequence of 3+ segments (two combine steps), a short one and an empty one
        assert (lens > 2 * segment).any() and ((lens > 0) & (lens <= split)).any() and (lens == 0).any()
        tables = segment_scan.segment_tables(cu_all, split, tokens, segment)
        seg_cu = segment_scan.unpack(*tables, tokens, segment)[0]
        assert torch.equal(seg_cu[0], cu_all[0]) and (seg_cu[1:] >= seg_cu[:-1]).all() and seg_cu[-1] == cu_all[-1]
        w, u, gamma = delta_wy.wy_reference(k, v, g, beta, r.state_start, r.state_len)
        n = lens.shape[0]
        out, final = segment_scan.state_chain_segments(q, k, w, u, gamma, tables, n, 0.3, segment)
        rows = segment_rows(tokens, r.state_start, lens)
        scale = max(1.0, want[rows].abs().max().item())
        torch.testing.assert_close(out[rows], want[rows], atol=2e-5 * scale, rtol=1e-5)
        torch.testing.assert_close(final, want_final, atol=2e-5 * max(1.0, want_final.abs().max().item()), rtol=1e-5)
        whole, _ = delta_chain.state_chain(q, k, w, u, gamma, cu_all[:-1], 0.3)
        for s_i in torch.nonzero(lens > split).flatten().tolist():
            lo, first = int(r.state_start[s_i]), min(segment, int(lens[s_i]))
            assert torch.equal(out[lo:lo + first], whole[lo:lo + first])
        short = (lens > 0) & (lens <= split)
        for s_i in torch.nonzero(short).flatten().tolist():
            lo, hi = int(r.state_start[s_i]), int(r.state_start[s_i] + lens[s_i])
            assert torch.equal(out[lo:hi], whole[lo:hi])
        # the fork's form: nothing stored for empty sequences or outside the states
        o_skip, f_skip = segment_scan.state_chain_segments(q, k, w, u, gamma, tables, n, 0.3, segment,
                                                           empty_finals=False)
        assert torch.equal(o_skip[rows], out[rows]) and torch.equal(f_skip[lens > 0], final[lens > 0])

    def test_gated_delta_chunk_outputs_match_the_reference_and_skip_spare_rows():
        """`chunk_outputs` (the split call's o step): each chunk row's outputs from a given state before the chunk and
        the chunk's new values, as fla's o step computes them (fp32 here); rows naming the trailing empty sequence
        (a bucket's spare rows) and tokens of no listed chunk are left as they were."""
        from flide.ops.gated_delta import fla as delta_fla

        Hk, Hv, K, V = 2, 4, 16, 32
        lens = torch.tensor([150, 0, 70, 200, 0])  # the last one: the trailing empty sequence
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        tokens = int(cu[-1]) + 30  # a tail in no sequence
        chunks = delta_fla._chunk_rows(torch.where(lens > 100, lens, 0), 12)  # sequences 0 and 3, then 5 spare rows
        assert (chunks[:, 0] == 4).sum() == 5
        q, k = randn(tokens, Hk, K, seed=40), randn(tokens, Hk, K, seed=41)
        v_new = randn(tokens, Hv, V, seed=42)
        h = randn(chunks.shape[0], Hv, K, V, seed=43) * 0.2
        gamma = -torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(44)).cumsum(0) % 3
        want = chunk_outputs_reference(q, k, v_new, h, gamma, cu, chunks, 0.3)
        got = delta_chain.chunk_outputs(q, k, v_new, h, gamma, cu, chunks, 0.3, torch.full_like(v_new, float("nan")))
        listed = ~want[:, 0, 0].isnan()
        assert listed.sum() == 350 and listed[:150].all() and listed[220:420].all()
        torch.testing.assert_close(got[listed], want[listed], atol=2e-5 * max(1.0, want[listed].abs().max().item()),
                                   rtol=1e-5)
        assert got[~listed].isnan().all()

    def test_gated_delta_state_chain_kernel_is_interpreted():
        assert isinstance(delta_chain._state_chain_kernel, InterpretedFunction)

    @pytest.mark.parametrize("form", delta_branches.FORMS)
    def test_gated_delta_branches_from_zero_and_empty_rows(form):
        """Index -1 starts from a zero state (no state tensor at all: M = 0), and length-0 rows (the bucket's spare
        capacity) write nothing."""
        tokens, Hk, Hv, K, V = 40, 1, 2, 16, 16
        q, k, v = randn(tokens, Hk, K, seed=6), randn(tokens, Hk, K, seed=7), randn(tokens, Hv, V, seed=8)
        g = -torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(9))
        beta = torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(10))
        start, length = torch.tensor([3, 20, 40, 40]), torch.tensor([10, 20, 0, 0])
        index = torch.full((4,), -1)
        out = delta_branches.branches(q, k, v, g, beta, start, length, torch.zeros(0, Hv, K, V), index, 0.25, True,
                                      out=poisoned(tokens, Hv, V, dtype=torch.float32), form=form)
        want = delta_ref.gated_delta_naive(q, k, v, g, beta, start, length, torch.zeros(0, Hv, K, V), index, 0.25,
                                           True)[0]
        assert out[:3].isnan().all() and out[13:20].isnan().all()  # outside the segments: untouched
        torch.testing.assert_close(out[3:13], want[3:13], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(out[20:40], want[20:40], atol=2e-5, rtol=1e-5)

    @pytest.mark.parametrize("tiles", [(16, 4, 32), (32, 2, 64)], ids=["BV16-w4-C32", "BV32-w2-C64"])
    def test_gated_delta_branches_chunk_form_other_chunk_sizes(tiles):
        """The chunk form with 32- and 64-token chunks (the op benchmark's sweep): questions over several chunks,
        the last one partial, equal to the reference fork's question call in fp32."""
        tokens, Hk, Hv, K, V = 260, 1, 2, 16, 32
        r = tiny_round(tokens, seed=31, max_question=70)
        q, k = randn(tokens, Hk, K, seed=15), randn(tokens, Hk, K, seed=16)
        v = randn(tokens, Hv, V, seed=17)
        g = -torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(18)) * 0.7
        beta = torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(19))
        none, empty = torch.full_like(r.state_start, -1), torch.zeros(0, Hv, K, V)
        _, finals = delta_ref.gated_delta(q, k, v, g, beta, r.state_start, r.state_len, empty, none, 0.3, True)
        want, _ = delta_ref.gated_delta(q, k, v, g, beta, r.branch_start, r.branch_len, finals, r.branch_state, 0.3,
                                        True)
        out = delta_branches.branches(q, k, v, g, beta, r.branch_start, r.branch_len, finals, r.branch_state, 0.3,
                                      True, out=poisoned(tokens, Hv, V, dtype=torch.float32), form="chunk",
                                      tiles=tiles)
        rows = segment_rows(tokens, r.branch_start, r.branch_len)
        assert r.branch_len.max() > tiles[2]
        torch.testing.assert_close(out[rows], want[rows], atol=2e-5, rtol=1e-5)

    @pytest.mark.parametrize("l2norm", [True, False])
    def test_gated_delta_branches_final_states(l2norm):
        """`segments_with_final` (checkpoint rounds' state rests): outputs and final states of segments from their
        initial states, equal to the reference's; an empty segment's final state is its initial state, index -1
        starts from zero; `final` is refused with the chunk form or a wrong shape."""
        tokens, Hk, Hv, K, V = 90, 1, 2, 24, 40  # K padded to 32, V over partial tiles
        q, k, v = randn(tokens, Hk, K, seed=11), randn(tokens, Hk, K, seed=12), randn(tokens, Hv, V, seed=13)
        g = -torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(14)) * 0.5
        beta = torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(15))
        init = randn(3, Hv, K, V, seed=16) * 0.1
        start, length = torch.tensor([0, 30, 30, 70]), torch.tensor([30, 0, 40, 20])
        index = torch.tensor([2, 0, -1, 1])
        o, final = delta_branches.segments_with_final(q, k, v, g, beta, start, length, init, index, 0.3, l2norm)
        want_o, want_final = delta_ref.gated_delta(q, k, v, g, beta, start, length, init, index, 0.3, l2norm)
        scale = max(1.0, want_o.abs().max().item())
        torch.testing.assert_close(o, want_o, atol=2e-5 * scale, rtol=1e-5)
        torch.testing.assert_close(final, want_final, atol=2e-5 * max(1.0, want_final.abs().max().item()), rtol=1e-5)
        assert torch.equal(final[1], init[0])  # empty: its initial state, untouched
        args = (q, k, v, g, beta, start, length, init, index, 0.3, l2norm)
        with pytest.raises(ValueError, match="recurrent form"):
            delta_branches.branches(*args, form="chunk", final=torch.empty(4, Hv, K, V))
        with pytest.raises(ValueError, match="recurrent form"):
            delta_branches.branches(*args, final=torch.empty(3, Hv, K, V))

    def test_gated_delta_branches_segments_with_snapshot():
        """`segments_with_snapshot`: outputs and final states as `segments_with_final`'s (same bits), and each
        segment's state after its first snap_at tokens equal to the reference's final state of that prefix: inside
        the segment, at 0 (the initial state), at its end (= final), and an empty segment's (its initial state)."""
        tokens, Hk, Hv, K, V = 90, 1, 2, 24, 40
        q, k, v = randn(tokens, Hk, K, seed=41), randn(tokens, Hk, K, seed=42), randn(tokens, Hv, V, seed=43)
        g = -torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(44)) * 0.5
        beta = torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(45))
        init = randn(2, Hv, K, V, seed=46) * 0.1
        start, length = torch.tensor([0, 30, 30, 70]), torch.tensor([30, 0, 40, 20])
        index, snap_at = torch.tensor([1, 0, -1, 0]), torch.tensor([17, 0, 0, 20])
        args = (q, k, v, g, beta, start, length, init, index)
        o, final, states = delta_branches.segments_with_snapshot(*args, snap_at, 0.3, True)
        o_ref, final_ref = delta_branches.segments_with_final(*args, 0.3, True)
        assert torch.equal(o[:90], o_ref[:90]) and torch.equal(final, final_ref)
        _, want = delta_ref.gated_delta(q, k, v, g, beta, start, snap_at, init, index, 0.3, True)
        torch.testing.assert_close(states, want, atol=2e-5 * max(1.0, want.abs().max().item()), rtol=1e-5)
        assert torch.equal(states[1], init[0]) and torch.equal(states[2], torch.zeros_like(states[2]))
        assert torch.equal(states[3], final[3])

    def test_gated_delta_branches_snapshot_companion_with_recurrent_rests():
        """The fla variant's checkpoint companion re-runs the states' rests with `segments_with_final`: with the
        reference op for the rest of it, its outputs, final states and snapshots equal the reference companion's."""
        from flide.ops.gated_delta import gated_delta_reference, gated_delta_snapshot_reference
        from flide.ops.resume import gated_delta_with_snapshot

        T, Hk, Hv, K, V = 300, 2, 4, 16, 16
        q, k, v = randn(T, Hk, K, seed=21), randn(T, Hk, K, seed=22), randn(T, Hv, V, seed=23)
        g = -torch.rand(T, Hv, generator=torch.Generator().manual_seed(24))
        beta = torch.rand(T, Hv, generator=torch.Generator().manual_seed(26))
        init = randn(1, Hv, K, V, seed=25) * 0.1
        # short_tokens: 0, the op for every state's part before its snapshot; 64, the recurrent kernel for the whole
        # of the states whose part is at most 64 tokens (snapshot in the same pass), the op for the others (mixed);
        # 1000, the recurrent kernel for all (no op)
        for short_tokens in (0, 64, 1000):
            companion = gated_delta_with_snapshot(gated_delta_reference, rest=delta_branches.segments_with_final,
                                                  short=delta_branches.segments_with_snapshot,
                                                  short_tokens=short_tokens)
            for chunks, index in [([2, -1, 0], [-1, 0, -1]), ([4, 1, -1], [0, -1, -1])]:
                args = (q, k, v, g, beta, torch.tensor([0, 200, 260]), torch.tensor([200, 60, 40]), init,
                        torch.tensor(index), torch.tensor(chunks), 0.25, True)
                for got, want in zip(companion(*args), gated_delta_snapshot_reference(*args)):
                    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)

    def test_gated_delta_branches_companion_short_states_keep_their_bits():
        """A short state's outputs, snapshot and final state come from the recurrent kernel whatever else is in the
        call: the same bits alone and beside a long state (which takes the op)."""
        from flide.ops.gated_delta import gated_delta_reference
        from flide.ops.resume import gated_delta_with_snapshot

        T, Hk, Hv, K, V = 300, 1, 2, 16, 16
        q, k, v = randn(T, Hk, K, seed=31), randn(T, Hk, K, seed=32), randn(T, Hv, V, seed=33)
        g = -torch.rand(T, Hv, generator=torch.Generator().manual_seed(34))
        beta = torch.rand(T, Hv, generator=torch.Generator().manual_seed(35))
        init = randn(1, Hv, K, V, seed=36) * 0.1
        companion = gated_delta_with_snapshot(gated_delta_reference, rest=delta_branches.segments_with_final,
                                              short=delta_branches.segments_with_snapshot, short_tokens=100)
        # the short state (rows 200-299, snapshot after 64 tokens) alone, then after a 200-token state from zero
        alone = companion(q[200:], k[200:], v[200:], g[200:], beta[200:], torch.tensor([0]), torch.tensor([100]),
                          init, torch.tensor([0]), torch.tensor([1]), 0.25, True)
        both = companion(q, k, v, g, beta, torch.tensor([0, 200]), torch.tensor([200, 100]), init,
                         torch.tensor([-1, 0]), torch.tensor([-1, 1]), 0.25, True)
        assert torch.equal(both[0][200:], alone[0])
        assert torch.equal(both[1][1], alone[1][0]) and torch.equal(both[2][1], alone[2][0])

    def test_gated_delta_branches_refuse_bad_tiles():
        x = torch.zeros(4, 1, 16)
        args = (x, x, x, torch.zeros(4, 1), torch.zeros(4, 1), torch.tensor([0]), torch.tensor([4]),
                torch.zeros(0, 1, 16, 16), torch.tensor([-1]), 0.25, True)
        with pytest.raises(ValueError, match="power of two"):
            delta_branches.branches(*args, form="chunk", tiles=(16, 4, 24))
        with pytest.raises(ValueError, match="row programs"):
            delta_branches.branches(*args, form="recurrent", tiles=(16, 1, -1))
        with pytest.raises(ValueError, match="tiles"):
            delta_branches.branches(*args, form="recurrent", tiles=(16, 1, 4, 2))

    @pytest.mark.parametrize("row_programs", [1, 3, 64])
    def test_gated_delta_branches_row_programs_keep_the_bits(row_programs):
        """The recurrent form with P programs per (value head, V tile), each looping over rows i, i + P, ...: the
        same outputs, final states and snapshots as a program per row, bit for bit (spare rows of length 0 among
        the used ones and after them, grouped heads, K and V over partial tiles, P over the row count)."""
        tokens, Hk, Hv, K, V = 90, 1, 2, 24, 40
        q, k, v = randn(tokens, Hk, K, seed=61), randn(tokens, Hk, K, seed=62), randn(tokens, Hv, V, seed=63)
        g = -torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(64)) * 0.5
        beta = torch.rand(tokens, Hv, generator=torch.Generator().manual_seed(65))
        init = randn(2, Hv, K, V, seed=66) * 0.1
        start, length = torch.tensor([0, 30, 30, 70, 90, 90]), torch.tensor([30, 0, 40, 20, 0, 0])
        index, snap_at = torch.tensor([1, 0, -1, 0, 1, -1]), torch.tensor([13, 0, 0, 20, 0, 0])
        args = (q, k, v, g, beta, start, length, init, index, 0.3, True)

        def run(tiles, states: bool):
            final, snap = torch.empty(6, Hv, K, V), torch.empty(6, Hv, K, V)
            extra = {"final": final, "snapshot": (snap_at, snap)} if states else {}
            o = delta_branches.branches(*args, out=poisoned(tokens, Hv, V, dtype=torch.float32), tiles=tiles,
                                        **extra)
            return (o, final, snap) if states else (o,)

        for states in (False, True):
            one, looped = run((16, 1, 0), states), run((16, 1, row_programs), states)
            assert all(torch.equal(a, b) for a, b in zip(one, looped))  # NaN-poisoned rows nowhere written
            assert not looped[0].isnan().any()

    def test_gated_delta_branches_chunk_form_with_alike_keys():
        """The chunked form's inverse is a series whose terms grow before they cancel when a chunk's keys are alike
        and beta is near 1 (repeated tokens): a 40-token question of one repeated key, beta 0.95, no decay, must
        still match the reference in fp32."""
        tokens, Hk, Hv, K, V = 48, 1, 1, 16, 16
        k = randn(1, Hk, K, seed=11).expand(tokens, Hk, K).contiguous()
        q, v = randn(tokens, Hk, K, seed=12), randn(tokens, Hv, V, seed=13)
        g = torch.zeros(tokens, Hv)
        beta = torch.full((tokens, Hv), 0.95)
        start, length, index = torch.tensor([8]), torch.tensor([40]), torch.tensor([0])
        h0 = randn(1, Hv, K, V, seed=14) * 0.1
        want = delta_ref.gated_delta_naive(q, k, v, g, beta, start, length, h0, index, 0.25, True)[0]
        out = delta_branches.branches(q, k, v, g, beta, start, length, h0, index, 0.25, True, form="chunk")
        torch.testing.assert_close(out[8:48], want[8:48], atol=1e-5, rtol=1e-5)

    # -----------------------------------------------------------------------------------------------------------------
    # gated_delta: q/k normalisation before fla's state call (fixed launch configuration)
    # -----------------------------------------------------------------------------------------------------------------

    def test_gated_delta_l2norm_kernel_is_interpreted():
        assert isinstance(delta_l2norm._l2norm_kernel, InterpretedFunction)

    @pytest.mark.parametrize("shape", [(1, 1, 16), (37, 2, 24), (65, 3, 128)], ids=["1x1x16", "37x2x24", "65x3x128"])
    def test_gated_delta_l2norm_matches_torch_and_keeps_each_rows_bits_in_any_stream(shape):
        """x / sqrt(sum(x^2) + 1e-6) per row (partial row tiles, D padded to a power of two); a row's output has the
        same bits inside a longer stream (other rows around it, another row count)."""
        x = randn(*shape, seed=shape[0])
        want = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        y = delta_l2norm.l2norm(x)
        torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-5)
        longer = torch.cat([randn(5, *shape[1:], seed=99), x, randn(40, *shape[1:], seed=98)])
        assert torch.equal(delta_l2norm.l2norm(longer)[5:5 + shape[0]], y)

    @pytest.mark.parametrize("normalize", [True, False], ids=["l2norm", "copy"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("shape", [(1, 1, 16, 1), (37, 2, 24, 3), (65, 3, 128, 6)],
                             ids=["1x1x16", "37x2x24", "65x3x128"])
    def test_gated_delta_l2norm_prepare_qkv_reads_slices_in_place_with_the_same_bits(shape, dtype, normalize):
        """q, k and v as column slices of one wider row (the conv's output holds them side by side), laid out in one
        launch whose programs may hold rows of all three: each output a new contiguous tensor, q and k with
        `l2norm`'s bits (or copied), v copied."""
        assert isinstance(delta_l2norm._qkv_kernel, InterpretedFunction)
        T, H, D, HV = shape
        wide = randn(T, 2 * H * D + HV * D + 7, seed=T + 1).to(dtype)
        q, k = wide[:, :H * D].view(T, H, D), wide[:, H * D:2 * H * D].view(T, H, D)
        v = wide[:, 2 * H * D:2 * H * D + HV * D].view(T, HV, D)
        assert T == 1 or not (q.is_contiguous() or v.is_contiguous())  # one token: every view counts as contiguous
        yq, yk, yv = delta_l2norm.prepare_qkv(q, k, v, normalize)
        assert all(y.is_contiguous() and y.dtype == dtype for y in (yq, yk, yv))
        assert all(y.data_ptr() != x.data_ptr() for x, y in zip((q, k, v), (yq, yk, yv)))
        if normalize:
            assert torch.equal(yq, delta_l2norm.l2norm(q)) and torch.equal(yk, delta_l2norm.l2norm(k))
        else:
            assert torch.equal(yq, q) and torch.equal(yk, k)
        assert torch.equal(yv, v)
        with pytest.raises(ValueError, match="one \\[T, H, D\\] shape"):
            delta_l2norm.prepare_qkv(q, k[..., :1], v, normalize)
        with pytest.raises(ValueError, match="v \\[T, HV, DV\\]"):
            delta_l2norm.prepare_qkv(q, k, v[:0], normalize)

    # -----------------------------------------------------------------------------------------------------------------
    # gated_norm: the fork's row select + the gated RMS norm
    # -----------------------------------------------------------------------------------------------------------------

    def gated_norm_inputs(T: int, H: int, V: int, dtype, seed: int, spans: tuple[int, int, int]):
        """x_states / x_branches poisoned with NaN outside their calls' rows (a call may leave them unwritten), the
        gate as a column slice of a wider row (as the GDN layer's fused input projection holds it)."""
        states_end, branches_start, branches_end = spans
        x_states, x_branches = poisoned(T, H, V, dtype=dtype), poisoned(T, H, V, dtype=dtype)
        x_states[:states_end] = randn(states_end, H, V, seed=seed, dtype=dtype)
        x_branches[branches_start:branches_end] = randn(branches_end - branches_start, H, V, seed=seed + 1,
                                                        dtype=dtype)
        wide = randn(T, H * V + 9, seed=seed + 2, dtype=dtype)
        gate = wide[:, 5:5 + H * V].view(T, H, V)
        ends = [torch.tensor([n], dtype=torch.int32) for n in spans]
        return x_states, x_branches, gate, ends

    def test_gated_norm_kernel_is_interpreted():
        assert isinstance(norm_triton._gated_norm_kernel, InterpretedFunction)

    @pytest.mark.parametrize("weight_dtype", ["same", "fp32"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("shape,spans", [((1, 1, 16), (1, 1, 1)), ((37, 2, 24), (15, 15, 31)),
                                             ((50, 3, 128), (20, 24, 44)), ((9, 2, 32), (0, 0, 9))],
                             ids=["1x1x16-states", "37x2x24", "50x3x128-gap", "9x2x32-questions"])
    def test_gated_norm_matches_the_reference_and_never_reads_unwritten_rows(shape, spans, dtype, weight_dtype):
        """Each row from the call that covers it (NaN elsewhere never leaks), zero rows where neither does (the tail
        padding, a gap), V padded to a power of two, the gate read in place as a strided slice; roundings where
        transformers' norm rounds (weight * x in x's dtype when that is the product's dtype, not with fp32
        weights)."""
        T, H, V = shape
        x_states, x_branches, gate, ends = gated_norm_inputs(T, H, V, dtype, T, spans)
        weight = (1 + 0.5 * randn(V, seed=7)).to(dtype if weight_dtype == "same" else torch.float32)
        got = norm_triton.gated_norm(x_states, x_branches, gate, weight, *ends, 1e-6)
        want = norm_ref.gated_norm(x_states, x_branches, gate, weight, *ends, 1e-6)
        assert got.shape == (T, H, V) and got.dtype == dtype and got.is_contiguous()
        assert not got.isnan().any()
        covered = torch.zeros(T, dtype=torch.bool)
        covered[:spans[0]] = True
        covered[spans[1]:spans[2]] = True
        assert torch.equal(got[~covered], torch.zeros_like(got[~covered]))
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        else:  # this triton's interpreter truncates float32 -> bf16 casts (the GPU rounds to nearest): within two
            # bf16 steps here; tests/gpu/test_gated_norm_gpu.py checks the GPU's bits against the reference
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)

    def test_gated_norm_keeps_each_rows_bits_in_any_stream():
        """A row's output has the same bits inside a longer stream with other spans (batch-invariant)."""
        T, H, V = 21, 2, 64
        x_states, x_branches, gate, ends = gated_norm_inputs(T, H, V, torch.bfloat16, 3, (10, 10, 21))
        weight = (1 + 0.5 * randn(V, seed=7)).to(torch.bfloat16)
        alone = norm_triton.gated_norm(x_states, x_branches, gate, weight, *ends, 1e-6)
        pad = 13
        longer = [torch.cat([randn(pad, H, V, seed=50 + i, dtype=torch.bfloat16), x, randn(30, H, V, seed=60 + i,
                                                                                          dtype=torch.bfloat16)])
                  for i, x in enumerate((x_states, x_branches, gate))]
        # the same rows now sit 13 rows later; the states' span starts at 0, so it also covers the leading rows
        ends = [torch.tensor([n], dtype=torch.int64) for n in (pad + 10, pad + 10, pad + 21)]
        inside = norm_triton.gated_norm(*longer, weight, *ends, 1e-6)
        assert torch.equal(inside[pad:pad + T], alone)

    def test_gated_norm_refuses_mismatched_inputs():
        x_states, x_branches, gate, ends = gated_norm_inputs(4, 2, 16, torch.float32, 1, (2, 2, 4))
        weight = torch.ones(16)
        with pytest.raises(ValueError, match="gate is"):
            norm_triton.gated_norm(x_states, x_branches, gate[:, :1], weight, *ends, 1e-6)
        with pytest.raises(ValueError, match="weight is"):
            norm_triton.gated_norm(x_states, x_branches, gate, weight[:8], *ends, 1e-6)
        with pytest.raises(ValueError, match="last dim must be contiguous"):
            norm_triton.gated_norm(x_states, x_branches, gate.transpose(0, 2).contiguous().transpose(0, 2), weight,
                                   *ends, 1e-6)

    def test_gated_norm_in_a_whole_tiny_model_answers_as_the_models_own_norm():
        """Every GDN layer of a tiny Qwen3.5 (fp32, eager rounds on the CPU) ending in the Triton kernel answers as
        the model's own norm after the select, to float32 rounding."""
        import flide
        from flide.models.layers import FlideGatedDeltaNet
        from flide.models.tiny import tiny_model, tiny_tokenizer
        from flide.testing import max_difference, random_request

        engine = flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer())
        rng = random.Random(4)
        requests = [random_request(rng, max_questions=5, max_words=60) for _ in range(4)]
        want = engine.decide(requests)
        layers = [m for m in engine.model.modules() if isinstance(m, FlideGatedDeltaNet)]
        assert layers
        for layer in layers:
            layer.norm_op = norm_triton.gated_norm
        got = engine.decide(requests)
        assert max(max_difference(a, b) for a, b in zip(want, got)) < 1e-5

    def test_fork_conv_qkv_in_a_whole_tiny_model_answers_as_the_plain_path():
        """Every GDN layer of a tiny Qwen3.5 (fp32, eager rounds on the CPU) on the laid-out path: the fused conv
        (interpreted; with the gates g / beta) hands q, k (normalised) and v straight to the state call (here the reference over the round's
        state table) and the question call: answers as the plain path's, to float32 rounding."""
        import flide
        from flide.models.layers import FlideGatedDeltaNet
        from flide.models.tiny import tiny_model, tiny_tokenizer
        from flide.testing import max_difference, random_request

        def laid_out_states(q, k, v, g, beta, cu_seqlens, chunk_indices, chunk_offsets, long_chunks,
                            long_chunk_offsets, scale):
            assert all(x.is_contiguous() for x in (q, k, v))
            n = cu_seqlens.shape[0] - 2
            start, length = cu_seqlens[:n], cu_seqlens[1:n + 1] - cu_seqlens[:n]
            no_initial = q.new_zeros(0, v.shape[1], k.shape[2], v.shape[2], dtype=torch.float32)
            return delta_ref.gated_delta(q, k, v, g, beta, start, length, no_initial, torch.full_like(start, -1),
                                         scale, False)

        engine = flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer())
        rng = random.Random(6)
        requests = [random_request(rng, max_questions=5, max_words=60) for _ in range(4)]
        want = engine.decide(requests)
        layers = [m for m in engine.model.modules() if isinstance(m, FlideGatedDeltaNet)]
        assert layers and all(layer.conv_qkv_op is None for layer in layers)  # the CPU's variants: plain path
        calls = []
        for layer in layers:
            def fused(x, weight, seg_lo, trunk_lo, trunk_hi, a, b, a_log, dt_bias, key_heads, head_dim, normalize):
                calls.append(1)
                return conv_triton.fork_conv_qkv(x, weight, seg_lo, trunk_lo, trunk_hi, key_heads, head_dim,
                                                 normalize, (a, b, a_log, dt_bias))

            layer.conv_qkv_op = fused
            layer.laid_out_state_op = laid_out_states
        got = engine.decide(requests)
        assert len(calls) >= len(layers)
        assert max(max_difference(a, b) for a, b in zip(want, got)) < 1e-5

    # -----------------------------------------------------------------------------------------------------------------
    # qk_prep: a Qwen3.5 attention layer's q / k head norms + partial rotary
    # -----------------------------------------------------------------------------------------------------------------

    def test_qk_prep_kernel_is_interpreted():
        assert isinstance(prep_triton._qk_prep_kernel, InterpretedFunction)

    @pytest.mark.parametrize("T,H,HKV,D,R", [(1, 1, 1, 16, 4), (37, 4, 2, 32, 8), (20, 3, 1, 24, 24)],
                             ids=["1x1x1x16-R4", "37x4x2x32-R8", "20x3x1x24-full"])
    def test_qk_prep_matches_transformers_modules(T, H, HKV, D, R):
        """Against transformers' own Qwen3_5RMSNorm and apply_rotary_pos_emb (fp32), q read where it lies in a
        gated projection (each head's q then its gate), k a column slice; D padded to a power of two."""
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, apply_rotary_pos_emb

        projection = randn(T, H * 2 * D + HKV * D + 3, seed=T + D)
        q = projection[:, :H * 2 * D].view(T, H, 2 * D)[..., :D]
        k = projection[:, H * 2 * D:H * 2 * D + HKV * D].view(T, HKV, D)
        freqs = randn(T, R // 2, seed=7)
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
        q_norm, k_norm = Qwen3_5RMSNorm(D, eps=1e-6), Qwen3_5RMSNorm(D, eps=1e-6)
        with torch.no_grad():
            q_norm.weight.copy_(randn(D, seed=8) * 0.3)
            k_norm.weight.copy_(randn(D, seed=9) * 0.3)
        want_q, want_k = apply_rotary_pos_emb(q_norm(q), k_norm(k), cos, sin, unsqueeze_dim=1)
        got_q, got_k = prep_triton.qk_prep(q, k, cos, sin, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6)
        assert got_q.is_contiguous() and got_k.is_contiguous()
        torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
        ref_q, ref_k = prep_ref.qk_prep(q, k, cos, sin, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6)
        assert torch.equal(ref_q, want_q) and torch.equal(ref_k, want_k)  # the oracle is the modules' math

    def test_qk_prep_rows_keep_their_bits_in_a_longer_stream():
        T, H, HKV, D, R = 11, 2, 1, 32, 8
        q, k = randn(T + 7, H, D, seed=1), randn(T + 7, HKV, D, seed=2)
        cos, sin = randn(T + 7, R, seed=3), randn(T + 7, R, seed=4)
        w = randn(D, seed=5)
        alone = prep_triton.qk_prep(q[7:], k[7:], cos[7:], sin[7:], w, w, 1e-6)
        inside = prep_triton.qk_prep(q, k, cos, sin, w, w, 1e-6)
        assert torch.equal(inside[0][7:], alone[0]) and torch.equal(inside[1][7:], alone[1])

    def test_qk_prep_in_a_whole_tiny_model_answers_as_the_modules():
        """Every attention layer of a tiny Qwen3.5 (fp32, eager rounds on the CPU) preparing q / k with the kernel
        (interpreted) answers as with the model's own norm and rotary modules, to float32 rounding."""
        import flide
        from flide.models.layers import FlideAttention
        from flide.models.tiny import tiny_model, tiny_tokenizer
        from flide.ops.qk_prep import supports
        from flide.testing import max_difference, random_request

        engine = flide.patch(tiny_model("qwen3_5_text"), tiny_tokenizer())
        rng = random.Random(8)
        requests = [random_request(rng, max_questions=5, max_words=60) for _ in range(4)]
        want = engine.decide(requests)
        layers = [m for m in engine.model.modules() if isinstance(m, FlideAttention)]
        assert layers and all(layer.qk_prep is None and supports(layer.original) for layer in layers)
        for layer in layers:
            layer.qk_prep = prep_triton.qk_prep
        got = engine.decide(requests)
        assert max(max_difference(a, b) for a, b in zip(want, got)) < 1e-5

