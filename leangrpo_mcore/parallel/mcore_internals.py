"""The megatron-core internals this project leans on, in one place, each with a check that it is still as used.

megatron-core's documented surface (``get_forward_backward_func``, the ``ModelParallelConfig`` fields, the
``config.no_sync_func`` / ``grad_sync_func`` / ``finalize_model_grads_func`` hooks, ``parallel_state``) is
used as documented; what follows is what the project assumes beyond it: how the schedules read their config,
process groups and model, the module-global ``torch`` the CPU bridge replaces, the point-to-point module's
call shapes, and the parameter attributes of its tensor-parallel layers. Beside them the torch internals: the
autograd engine's final callbacks (gradient routing), FSDP2's per-parameter state (the local gradient slot), a
process group's timeout and DTensor's shard offsets (checkpoint boxes). Every check holds on each megatron-core
release ``setup.py`` admits (0.16.1 to 0.19); what differs between those releases is answered by
:mod:`leangrpo_mcore.compat`. An upgrade that changes any of these fails ``tests/unit/test_mcore_internals.py``,
which runs every :data:`INTERNALS` check, instead of a training run.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

from leangrpo_mcore.compat import multimodule_group_members


@dataclass(frozen=True)
class Internal:
    """One internal: what it is, who uses it, and a check that raises AssertionError when it changed."""

    name: str
    """The megatron-core (or torch) object or convention."""
    used_by: str
    """The project module(s) leaning on it."""
    check: Callable[[], None]
    """Raises AssertionError, naming the difference, when the installed version no longer matches the use."""


def _schedules():
    from megatron.core.pipeline_parallel import schedules

    return schedules


def _p2p():
    from megatron.core.pipeline_parallel import p2p_communication

    return p2p_communication


def _source(module) -> str:
    return inspect.getsource(module)


def _has_parameters(fn, names) -> None:
    missing = set(names) - set(inspect.signature(fn).parameters)
    assert not missing, f"{fn.__qualname__} lost the parameters {sorted(missing)}"


_SCHEDULE_KWARGS = ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length",
                    "micro_batch_size", "forward_only", "pg_collection", "p2p_communicator")
"""The keyword arguments :func:`~leangrpo_mcore.parallel.pipeline.run_micro_batches` passes a schedule."""


def _check_scheduler_calls() -> None:
    # run_micro_batches calls get_forward_backward_func(pp_size=, vp_size=) and the returned schedule by keyword
    schedules = _schedules()
    _has_parameters(schedules.get_forward_backward_func, ("pp_size", "vp_size"))
    for fn in (schedules.forward_backward_no_pipelining, schedules.forward_backward_pipelining_without_interleaving):
        _has_parameters(fn, _SCHEDULE_KWARGS)
    # a pipelined call's one boundary shape replaces the (seq, micro-batch, hidden) shapes it would derive
    _has_parameters(schedules.forward_backward_pipelining_without_interleaving, ("adjust_tensor_shapes_fn",))


def _check_config_reads() -> None:
    # ScheduleConfig is a ModelParallelConfig with the few TransformerConfig fields the schedules read; any other
    # ``config.X`` a schedule reads must be guarded by hasattr there (or ScheduleConfig needs the field too)
    from leangrpo_mcore.parallel.pipeline import ScheduleConfig

    config = ScheduleConfig()
    for module in (_schedules(), _p2p()):
        lines = _source(module).splitlines()
        for i, line in enumerate(lines):
            for name in re.findall(r"\bconfig\.(\w+)", line):
                guarded = any("hasattr(config," in above for above in lines[max(0, i - 3):i + 1])
                assert hasattr(config, name) or guarded, \
                    f"{module.__name__} reads config.{name} unguarded, which ScheduleConfig lacks"


def _check_faked_fields() -> None:
    # the fields ScheduleConfig adds are TransformerConfig's, with the meaning megatron gives them there
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.transformer import TransformerConfig

    from leangrpo_mcore.parallel.pipeline import ScheduleConfig

    added = set(ScheduleConfig.__dataclass_fields__) - set(ModelParallelConfig.__dataclass_fields__)
    stale = added - set(TransformerConfig.__dataclass_fields__)
    assert not stale, f"ScheduleConfig fakes {sorted(stale)}, no longer TransformerConfig fields"


def _check_timer_names() -> None:
    # _PhaseTimers answers config.timers(name, log_level=...).start()/.stop() for the compute and transfer names
    from leangrpo_mcore.parallel.pipeline import P2P_TIMERS

    names = set()
    for module in (_schedules(), _p2p()):
        names |= set(re.findall(r"timers\(\s*['\"]([\w-]+)['\"]", _source(module)))
    missing = {"forward-compute", "backward-compute", *P2P_TIMERS} - names
    assert not missing, f"megatron no longer times {sorted(missing)}"


def _check_process_groups() -> None:
    # _process_groups fills only these ProcessGroupCollection attributes, and its cp is a _GroupSize: the
    # schedules may ask the CP group for its size() and nothing else. Assignments (the schedules' own default
    # collection) are not reads; since 0.17 the schedules also read the multi-module collection's own members,
    # on the branch that a MultiModuleProcessGroupCollection takes and ours never does.
    from megatron.core.process_groups_config import ProcessGroupCollection

    source = _source(_schedules())
    read = set(re.findall(r"pg_collection\.(\w+)\b(?!\s*=[^=])", source))
    multimodule = multimodule_group_members()
    assert not multimodule & set(dir(ProcessGroupCollection)), "the multi-module members are ProcessGroupCollection's"
    read -= multimodule
    assert read <= {"tp", "cp", "embd", "pos_embd", "pp", "dp_cp"}, f"schedules read pg_collection.{sorted(read)}"
    used = set(re.findall(r"pg_collection\.cp\.(\w+)", source)) | set(re.findall(r"\bcp_group\.(\w+)", source))
    assert used <= {"size"}, f"the schedules call {sorted(used)} on the CP group (_GroupSize answers size())"


def _check_cpu_bridge() -> None:
    # cpu_bridge swaps the module-global ``torch`` of both modules; _CpuTorch answers exactly these CUDA uses
    schedules, p2p = _schedules(), _p2p()
    import torch

    assert schedules.torch is torch and p2p.torch is torch, "the pipeline modules no longer import torch globally"
    cuda = set()
    for module in (schedules, p2p):
        cuda |= set(re.findall(r"torch\.cuda\.(\w+)", _source(module)))
    assert cuda <= {"current_device", "synchronize"}, f"new CUDA calls in the pipeline modules: {sorted(cuda)}"
    allocations = re.findall(r"torch\.(\w+)\([^()]*device=['\"]cuda['\"]", _source(schedules))
    assert set(allocations) <= {"zeros"}, f"schedules allocate on 'cuda' with torch.{sorted(set(allocations))}"


def _check_p2p() -> None:
    # StageLink calls P2PCommunicator(pp_group=, config=) and its four transfers with these arguments
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    _has_parameters(P2PCommunicator.__init__, ("pp_group", "config"))
    for method, flag in (("recv_forward", "is_first_stage"), ("send_forward", "is_last_stage"),
                         ("recv_backward", "is_last_stage"), ("send_backward", "is_first_stage")):
        params = list(inspect.signature(getattr(P2PCommunicator, method)).parameters)
        assert params[2:] == [flag], f"P2PCommunicator.{method}{tuple(params[1:])}"


def _check_model_reads() -> None:
    # _Stage is what the schedules see as a model: config, model_type and set_input_tensor
    from megatron.core.enums import ModelType

    assert hasattr(ModelType, "encoder_or_decoder")
    source = _source(_schedules())
    assert "set_input_tensor" in source and "get_model_config" in source and "get_model_type" in source
    from megatron.core.utils import get_model_config, get_model_type

    class Probe:
        config, model_type = object(), ModelType.encoder_or_decoder

    assert get_model_config(Probe()) is Probe.config and get_model_type(Probe()) is Probe.model_type


def _check_tp_attributes() -> None:
    # parameters of the tensor-parallel layers carry these attributes (optimizer, FSDP2 wrapping, checkpoints)
    from megatron.core.tensor_parallel.layers import _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS

    missing = {"tensor_model_parallel", "partition_dim", "partition_stride"} - set(_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS)
    assert not missing, f"megatron's parameters no longer carry {sorted(missing)}"


def _check_fusions() -> None:
    # activate() calls the fused bias-GeLU as bias_gelu_impl(input, bias); the FP8 context as get_fp8_context(config)
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.fusions.fused_bias_gelu import GeLUFunction, bias_gelu_impl

    assert bias_gelu_impl == GeLUFunction.apply
    assert list(inspect.signature(GeLUFunction.forward).parameters)[1:] == ["input", "bias"]
    assert list(inspect.signature(get_fp8_context).parameters)[0] == "config"


def _check_lean_import() -> None:
    # mcore_import: megatron.core.jit binds jit_fuser = torch.compile when it is imported, the fusions decorate
    # with the jit_fuser they import, and every module that imports wandb does so only if it can (0.16: the dynamic
    # inference context and the timers; 0.19: the dynamic engine and the timers), so a blocked wandb is an absent one
    from pathlib import Path

    import megatron.core
    from megatron.core import jit
    from megatron.core.fusions import fused_bias_geglu, fused_bias_gelu

    assert re.search(r"^\s*jit_fuser = torch\.compile$", _source(jit), re.M), "jit_fuser is no longer torch.compile"
    for module in (fused_bias_gelu, fused_bias_geglu):
        assert "from megatron.core.jit import jit_fuser" in _source(module), f"{module.__name__} binds another fuser"
    importing = []
    for path in Path(megatron.core.__file__).parent.rglob("*.py"):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "import wandb" not in text:
            continue
        importing.append(path.name)
        assert not re.search(r"^(import wandb|from wandb)\b", text, re.M), f"{path} imports wandb unconditionally"
        for found in re.finditer(r"^(\s*)import wandb\b", text, re.M):
            before = text[:found.start()].rstrip().splitlines()[-1:] or [""]
            # an import at the top of a try block (one guarded by except ImportError), or inside a function
            assert before[0].strip() == "try:" or found.group(1), f"{path}: an unguarded wandb import"
    assert importing, "no megatron-core module imports wandb any more: drop the blocking in mcore_import"


def _check_queue_callback() -> None:
    # GradientRouter moves a routed slot out in a final callback of the backward pass that ran it
    import torch

    assert callable(getattr(torch.autograd.Variable._execution_engine, "queue_callback", None))


def _check_fsdp_param_state() -> None:
    # GradSync's local slot is FSDP2's unsharded gradient per parameter, reached through these private names
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group, _fsdp_state

    assert callable(getattr(FSDPModule, "_get_fsdp_state", None))
    for cls, names in ((_fsdp_state.FSDPState, ("_fsdp_param_groups",)),
                       (_fsdp_param_group.FSDPParamGroup, ("fsdp_params",)),
                       (_fsdp_param.FSDPParam, ("unsharded_accumulated_grad", "_unsharded_param", "reduce_dtype",
                                                "sharded_param", "sharded_size"))):
        source = inspect.getsource(cls)
        missing = [n for n in names
                   if not hasattr(cls, n) and f"self.{n} " not in source and f"self.{n}:" not in source]
        assert not missing, f"{cls.__name__} lost {missing}"
    assert callable(getattr(_fsdp_param.FSDPParam, "to_sharded_dtensor", None))


def _check_group_timeout() -> None:
    # mesh.default_group_timeout reads group._get_backend(device).options._timeout; mesh_backend_options sets
    # _timeout on the options init_device_mesh passes on as each group's timeout.
    import torch.distributed as dist
    from torch.distributed import device_mesh

    assert callable(getattr(dist.ProcessGroup, "_get_backend", None)), "ProcessGroup lost _get_backend"
    assert hasattr(dist.ProcessGroupGloo._Options(), "_timeout"), "ProcessGroupGloo._Options lost _timeout"
    assert "pg_options._timeout" in _source(device_mesh), "init_device_mesh no longer takes the options' timeout"


def _check_dtensor_offsets() -> None:
    # block_tensor reads an FSDP2 DTensor's global offsets as compute_local_shape_and_global_offset(shape, mesh,
    # placements) -> (local shape, global offsets)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    params = list(inspect.signature(compute_local_shape_and_global_offset).parameters)
    assert params[:3] == ["global_shape", "mesh", "placements"], f"compute_local_shape_and_global_offset{params}"


def _check_fake_world() -> None:
    # the step simulator runs one rank of a world under a fake process group (FakeStore, backend "fake") and
    # FakeTensorMode(allow_non_fake_inputs=...); megatron builds its groups there without gloo side groups
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert callable(FakeStore) and "fake" in dist.Backend.backend_list, "torch lost its fake process group"
    _has_parameters(FakeTensorMode.__init__, ("allow_non_fake_inputs",))
    _has_parameters(parallel_state.initialize_model_parallel, ("create_gloo_process_groups",))


INTERNALS: tuple[Internal, ...] = (
    Internal("schedules.get_forward_backward_func and its schedules' keyword arguments", "parallel/pipeline.py",
             _check_scheduler_calls),
    Internal("config.X read by the schedules and p2p_communication (ScheduleConfig's faked TransformerConfig "
             "fields)", "parallel/pipeline.py", _check_config_reads),
    Internal("ScheduleConfig's extra fields are TransformerConfig's", "parallel/pipeline.py", _check_faked_fields),
    Internal("config.timers names (forward-compute, backward-compute, the p2p transfers)", "parallel/pipeline.py",
             _check_timer_names),
    Internal("ProcessGroupCollection attributes read, and _GroupSize as the CP group", "parallel/pipeline.py",
             _check_process_groups),
    Internal("module-global torch of schedules and p2p_communication (cpu_bridge)", "parallel/pipeline.py",
             _check_cpu_bridge),
    Internal("P2PCommunicator's constructor and transfers", "parallel/stages.py, parallel/pipeline.py", _check_p2p),
    Internal("what the schedules read from a model (_Stage)", "parallel/pipeline.py", _check_model_reads),
    Internal("tensor-parallel parameter attributes", "models/common/tp.py, parallel/fsdp.py, engine/optim.py, "
             "engine/checkpoint/", _check_tp_attributes),
    Internal("fused_bias_gelu.bias_gelu_impl and fp8_utils.get_fp8_context",
             "models/backends.py, models/common/fp8.py", _check_fusions),
    Internal("jit_fuser bound to torch.compile at import, the optional wandb import of the dynamic inference "
             "context", "mcore_import.py", _check_lean_import),
    Internal("torch: the autograd engine's queue_callback", "parallel/routing.py", _check_queue_callback),
    Internal("torch: FSDP2's per-parameter gradient state", "parallel/grad_sync.py", _check_fsdp_param_state),
    Internal("torch: a process group's timeout in its backend's options", "parallel/mesh.py",
             _check_group_timeout),
    Internal("torch: DTensor's compute_local_shape_and_global_offset", "models/common/dcp_blocks.py",
             _check_dtensor_offsets),
    Internal("torch: the fake process group and FakeTensorMode; megatron's groups without gloo",
             "planner/simulate.py, planner/sim_mode.py", _check_fake_world),
)
"""Every internal the project leans on (module doc)."""
