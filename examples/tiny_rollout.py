"""A tiny end-to-end GRPO loop on the project's diffusion and RL math, on the CPU in seconds.

A small convolutional velocity network denoises 3x32x32 pixel-space "latents" along FlowGRPO's SDE
(FLUX sigma schedule, noise level 0.9). Every (prompt group, generation) draws its noise from its own
seeded generator; the first int(T * 0.99) steps are trained. The final images are scored with DDPO's
JPEG-compressibility reward, advantages are FlowGRPO's per-group normalisation, and the clipped GRPO
loss is backpropagated through the graphs kept from the rollout (LeanGRPO-Retain on one process).

This exercises the math only; the full trainer with FLUX / Wan policies is ``leangrpo-train``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from leangrpo_mcore.diffusion import get_sigmas, sde_step
from leangrpo_mcore.rl import build_reward, compute_advantages, grpo_step_loss


class TinyVelocity(nn.Module):
    """v(x, sigma): three conv layers with the noise level fed in as an extra channel."""

    def __init__(self, channels: int = 3, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(channels + 1, width, 3, padding=1), nn.SiLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.SiLU(),
            nn.Conv2d(width, channels, 3, padding=1),
        )

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        level = sigma.view(-1, 1, 1, 1).expand(-1, 1, *x.shape[2:])
        return self.net(torch.cat([x, level], dim=1))


def rollout(model, groups: int, group_size: int, steps: int, seed: int, iteration: int):
    """One batch of trajectories; returns final images, log-probs (B, S) with grad and their detached copies."""
    batch = groups * group_size
    sigmas = get_sigmas("flux", steps, image_seq_len=256)
    selected = int(steps * 0.99)
    gens = [torch.Generator().manual_seed(((seed * 1_000_003 + iteration) * 10_007 + g) * 101 + m)
            for g in range(groups) for m in range(group_size)]
    x = torch.stack([torch.randn(3, 32, 32, generator=g) for g in gens])
    log_probs = []
    for t in range(steps):
        sigma = sigmas[t].expand(batch)
        sigma_next = sigmas[t + 1].expand(batch)
        with torch.set_grad_enabled(t < selected):
            v = model(x, sigma)
            out = sde_step("flow_grpo", v, x, sigma, sigma_next, noise_level=0.9, generator=gens, sigma_max=sigmas[1])
        if t < selected:
            log_probs.append(out.log_prob)
        x = out.prev_sample.detach()  # no gradient flows along the trajectory
    images = (x.clamp(-1, 1) + 1) / 2
    return images, torch.stack(log_probs, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = TinyVelocity()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    reward_fn = build_reward("jpeg_compressibility")
    group_ids = torch.arange(args.groups).repeat_interleave(args.group_size)
    prompts = [f"prompt {g}" for g in group_ids.tolist()]
    for it in range(args.iterations):
        images, log_probs = rollout(model, args.groups, args.group_size, args.steps, args.seed, it)
        rewards = reward_fn(images.detach(), prompts)
        advantages = compute_advantages("flow_grpo", rewards, group_ids, adv_clip_max=5.0)
        old = log_probs.detach()  # on-policy: the rollout's own log-probs, ratio exactly 1
        losses = [grpo_step_loss(log_probs[:, s], old[:, s], advantages, clip_range=1e-4)[0]
                  for s in range(log_probs.shape[1])]
        loss = torch.stack(losses).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"iteration {it}: reward mean {rewards.mean():+.3f} kB  std {rewards.std():.3f}  "
              f"loss {loss.item():+.5f}  rewards {[round(r, 2) for r in rewards.tolist()]}")


if __name__ == "__main__":
    main()
