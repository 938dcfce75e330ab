"""Peak memory of one pipelined rollout call on each pipeline stage (``parallel.pp=2``, two gloo ranks).

  OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/bench_pipeline_memory.py --micro-batches 4

builds the FLUX shape of ``yaml_configs/bench/flux_flowgrpo.yaml`` (2 double + 2 single blocks, 4 heads x 64,
256 image + 16 text tokens, fp32) split into two stages, and measures with the allocator meter
(``leangrpo_mcore.parallel.memory.MemoryMeter``) one ``StagedVelocity.velocities`` call over M micro-batches of
one sample each: megatron's forward-only schedule over the stages, as a rollout step runs it. ``--grad`` measures
the call under grad (Retain's trained steps, whose graphs stay alive until their backward). Each rank prints one
JSON line: its stage, the peak and end bytes above the call's start (the velocities returned included), and the
bytes of one boundary tensor.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

ARCH = {"family": "flux", "preset": "flux-tiny", "num_layers": 2, "num_single_layers": 2, "num_attention_heads": 4,
        "attention_head_dim": 64, "axes_dims_rope": [16, 24, 24], "in_channels": 64, "joint_attention_dim": 128,
        "pooled_projection_dim": 64, "guidance_embeds": True}
GRID, TEXT = 32, 16
"""The VAE latent grid of 256x256 pixels (2x2 packing: 256 image tokens) and the text length."""


def _requests(count: int) -> list:
    from leangrpo_mcore.diffusion.trajectory import Conditioning

    gen = torch.Generator().manual_seed(0)
    cond = Conditioning(encoder_hidden_states=torch.randn(1, TEXT, ARCH["joint_attention_dim"], generator=gen),
                        pooled_projections=torch.randn(1, ARCH["pooled_projection_dim"], generator=gen),
                        guidance=torch.full((1,), 3.5))
    tokens = (GRID // 2) ** 2
    return [(torch.randn(1, tokens, ARCH["in_channels"], generator=gen), torch.full((1,), 0.5), cond)
            for _ in range(count)]


def measure(micro_batches: int, grad: bool) -> dict:
    """This rank's stage, the call's peak and end bytes, and one boundary's bytes."""
    from leangrpo_mcore.diffusion.velocity import FluxVelocity
    from leangrpo_mcore.models import build_policy
    from leangrpo_mcore.models.common.pipeline import split_blocks
    from leangrpo_mcore.parallel.memory import MemoryMeter
    from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context
    from leangrpo_mcore.parallel.stages import StagedVelocity, StageLink

    ctx = build_parallel_context(Layout(pp=2))
    stage = split_blocks(ARCH["num_layers"] + ARCH["num_single_layers"], 2)[ctx.pp_rank]
    policy = build_policy(ARCH, seed=0, backend="local", stage=stage)
    staged = StagedVelocity(FluxVelocity(policy, latent_height=GRID, latent_width=GRID), StageLink(ctx, torch.float32))
    requests = _requests(micro_batches)
    with torch.set_grad_enabled(grad):
        staged.velocities(requests)  # warm-up: first-call allocations (kernels, communicator) stay out
        with MemoryMeter("cpu") as meter:
            out = staged.velocities(requests)
    boundary = (1, 1 + TEXT + (GRID // 2) ** 2, ARCH["num_attention_heads"] * ARCH["attention_head_dim"])
    del out
    return {"stage": ctx.pp_rank, "micro_batches": micro_batches, "grad": grad, "peak_bytes": meter.peak_bytes,
            "end_bytes": meter.end_bytes, "boundary_bytes": 4 * boundary[0] * boundary[1] * boundary[2]}


def main() -> None:
    """Parse the flags, measure on this rank, print its JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches of the call (default 4)")
    parser.add_argument("--grad", action="store_true", help="measure the call under grad (graphs kept)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    try:
        print(json.dumps(measure(args.micro_batches, args.grad)), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
