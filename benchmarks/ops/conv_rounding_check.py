"""The Triton conv against the reference conv and float32 on the GPU: bitwise agreement and rounding (one-off check)."""
import torch
from flide.ops.fork_conv import triton as tc
from flide.ops.fork_conv import reference as rc
torch.manual_seed(0)
T, W = 2048, 4
for D in (6144, 8192):
    x = (torch.randn(T, D, device="cuda")*3).bfloat16(); w = (torch.randn(D, W, device="cuda")*0.5).bfloat16()
    z = torch.zeros(T, dtype=torch.int64, device="cuda")
    for silu in (False, True):
        a = tc.fork_conv(x, w, z, z, z, silu).float()
        b = rc.fork_conv(x, w, z, z, z, silu).float()
        c = rc.fork_conv(x.float(), w.float(), z, z, z, silu)
        print(D, "silu", silu, "triton==reference", (a == b).float().mean().item(), "triton==RNE(fp32)", (a == c.bfloat16().float()).float().mean().item(),
              "max|triton-fp32|", (a - c).abs().max().item(), "max|ref-fp32|", (b - c).abs().max().item(), flush=True)
