"""When FSDP2 keeps a step's parameters gathered, and what the planner charges for it."""

from leangrpo_mcore.planner.arch_specs import load_arch, params_per_rank
from leangrpo_mcore.planner.cost_model import memory_phases, step_time
from leangrpo_mcore.parallel.gathering import keep_parameters_gathered, selection_varies_across_ranks
from leangrpo_mcore.planner.workload import GiB, Hardware, Layout, Workload

HW = Hardware(nodes=1, gpus_per_node=8, gpu_mem_bytes=80 * GiB, gpu_tflops=989, intra_node_gbps=150,
              inter_node_gbps=25, hbm_gbps=3350)


def test_which_selections_differ_between_ranks():
    def varies(method, layout="shared", group=8, dp=8):
        return selection_varies_across_ranks(method, layout=layout, group_size=group, dp_size=dp)

    assert not varies("flow_grpo") and not varies("flow_grpo", layout="conventional")
    assert varies("dance_grpo") and not varies("dance_grpo", dp=1)
    assert not varies("sde_window")  # every rank holds a share of every prompt: same windows in the same order
    assert varies("sde_window", group=4)  # worker groups hold different prompts
    assert varies("sde_window", layout="conventional")


def test_auto_gathers_only_reweight_with_differing_steps():
    assert keep_parameters_gathered(None, schedule="reweight", varies=True)
    assert not keep_parameters_gathered(None, schedule="reweight", varies=False)
    assert not keep_parameters_gathered(None, schedule="retain", varies=True)
    assert keep_parameters_gathered(False, schedule="native", varies=False)
    assert not keep_parameters_gathered(True, schedule="reweight", varies=True)


def test_planner_charges_the_gathered_parameters_and_saves_the_gathers():
    arch = load_arch("flux-dev")
    layout = Layout(tp=1, dp_shard=8, dp_replicate=1)

    def work(selection):
        return Workload(arch=arch, tokens=arch.tokens(512, 512), num_steps=16, selected_steps=9, group_size=8,
                        prompts_per_step=1, selection=selection)

    dance, flow = work("dance_grpo"), work("flow_grpo")
    full = params_per_rank(arch, 1) * dance.precision.compute_bytes
    gathered = memory_phases(dance, HW, layout, "reweight", False)["rollout"]["gathered_params"]
    resharded = memory_phases(flow, HW, layout, "reweight", False)["rollout"]["gathered_params"]
    assert gathered == full and resharded < full / 4
    assert memory_phases(dance, HW, layout, "retain", False)["rollout"]["gathered_params"] == resharded
    assert step_time(dance, HW, layout, "reweight", False)["fsdp_all_gather"] < \
        step_time(flow, HW, layout, "reweight", False)["fsdp_all_gather"] / 10
