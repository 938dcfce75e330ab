"""Native: the baselines' update (docs/algorithms.md §5).

The rollout runs without gradients and stores every transition. When a group's advantages are known,
each selected step of each micro-batch is *recomputed*: the policy runs again, with gradients, on the
stored x_t, log p is evaluated at the stored x_{t+1}, and that unit's loss is backpropagated at once.
Gradient synchronisation is the injected :class:`~leangrpo_mcore.parallel.grad_sync.GradSync`: a
reduce-scatter per backward like the baselines (``per_backward``), or deferred to one reduce-scatter
per update (``coalesced``, the ``schedule.coalesce_sync`` ablation). It is also the schedule of every
update after the first one of a rollout (the policy has moved, so the rollout's graphs are stale).

Units are processed in the canonical order shared with Retain — micro-batches in rollout order, steps
ascending — so both accumulate the same per-unit gradients in the same order.
"""

from __future__ import annotations

from leangrpo_mcore.schedules.base import GroupUpdate, Schedule, register_schedule, unit_loss


@register_schedule("native")
class NativeSchedule(Schedule):
    """No-grad rollout, recompute + backward per selected step."""

    recompute_free = False

    def on_advantages(self, group: GroupUpdate) -> None:
        """Recompute and backpropagate every selected unit of the group."""
        objective = self.ctx.objective
        for traj, advantages in zip(group.trajectories, group.advantages):
            advantages = advantages.to(traj.latents.device)
            for t in range(traj.num_steps):
                train = traj.selected[:, t]
                if not bool(train.any()):
                    continue
                with self.ctx.phase("recompute"):
                    out = self.recompute(traj, t)
                    kl = self.step_kl(out.mean, out.std, traj.latents[:, t], traj.next_latents[:, t],
                                      traj.sigmas[:, t], traj.sigmas[:, t + 1], traj.conditioning)
                    loss, ratio = unit_loss(out.log_prob, traj.log_probs[:, t], advantages, train, self.weight,
                                            objective, kl)
                with self.ctx.phase("backward"):
                    self.ctx.grad_sync.backward(loss)
                self.stats.add(ratio, loss)
