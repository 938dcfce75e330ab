"""Context parallelism without processes: token splits, the layout's degrees, and the refused combinations."""

import logging

import pytest

from leangrpo_mcore.config import load_config
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.models.common.context_parallel import split_sizes
from leangrpo_mcore.parallel.mesh import Layout, ParallelContext


def test_split_sizes_are_contiguous_and_uneven_without_padding():
    assert split_sizes(9, 2) == (5, 4)
    assert split_sizes(16, 4) == (4, 4, 4, 4)
    assert split_sizes(7, 3) == (3, 2, 2)
    with pytest.raises(ValueError, match="cannot be split over 4"):
        split_sizes(3, 4)


def test_layout_counts_cp_outside_the_data_parallel_degrees():
    resolved = Layout(tp=2, cp=2).resolve(8)
    assert (resolved.dp_replicate, resolved.dp_shard) == (1, 2)
    ctx = ParallelContext(layout=resolved, world_size=8)
    assert ctx.dp_size == 2 and ctx.fsdp_shard_size == 4
    with pytest.raises(ValueError, match="tp=2 x cp=2 does not divide the world size 6"):
        Layout(tp=2, cp=2).resolve(6)
    assert Layout.from_config(load_config(None, ["parallel.cp=4"]).parallel).cp == 4


def test_unsupported_combinations_are_refused():
    import torch

    from leangrpo_mcore.diffusion.sampler import SDEParams
    from leangrpo_mcore.engine.build import resolve_plan
    from leangrpo_mcore.engine.launch import DistContext
    from leangrpo_mcore.engine.step import StepPlan
    from leangrpo_mcore.schedules import Objective

    with pytest.raises(UserError, match="schedule.name=auto with parallel.cp > 1"):
        resolve_plan(load_config(None, ["schedule.name=auto", "parallel.cp=2"]),
                     DistContext(0, 2, 0, torch.device("cpu"), "gloo", False), logging.getLogger("test"))
    sigmas = torch.linspace(1.0, 0.0, 5)
    plan = StepPlan(schedule="native", group_size=2, prompts_per_step=1, latent_shape=(4, 4), sigmas=sigmas,
                    sde=SDEParams.from_sigmas("dance_grpo", 0.3, sigmas), objective=Objective(),
                    selection={"method": "flow_grpo", "fraction": 0.5}, async_scoring=True)
    ctx = ParallelContext(layout=Layout(cp=2).resolve(2), world_size=2)
    with pytest.raises(ValueError, match="reward.async_scoring with parallel.cp > 1"):
        plan.validate(ctx, torch.nn.Linear(2, 2))
