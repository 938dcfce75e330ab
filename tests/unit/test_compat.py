"""What differs between the supported stacks (leangrpo_mcore/compat.py): one test per version-dependent name, the
dependencies' noise filtered message by message (and nothing else), and FSDP2 units that hand out no views."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from leangrpo_mcore import compat

ROOT = Path(__file__).resolve().parents[2]


def test_version_tuple_reads_the_release():
    assert compat.version_tuple("2.14.1+cu130") == (2, 14, 1)
    assert compat.version_tuple("0.19.0rc1") == (0, 19, 0)
    assert compat.version_tuple("0.16.1") == (0, 16, 1)
    assert compat.installed("megatron-core") >= (0, 16, 1)
    assert compat.installed("no-such-distribution-here") is None


def test_multimodule_members_follow_the_release():
    """0.17 added MultiModuleProcessGroupCollection; its members are what the schedules read on its branch only."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.process_groups_config import ProcessGroupCollection

    members = compat.multimodule_group_members()
    if compat.installed("megatron-core") < compat.MULTIMODULE_PIPELINES:
        assert members == frozenset()
        return
    assert {"has_language_model", "get_language_model_cp_size", "language_model_module_name"} <= members
    assert not members & set(dir(ProcessGroupCollection))
    source = Path(schedules.__file__).read_text(encoding="utf-8")
    read = set(re.findall(r"pg_collection\.(\w+)\b(?!\s*=[^=])", source))
    assert read & members, "the schedules no longer read the multi-module members: the exemption is stale"


def _source_text(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{module} is not installed"
    return Path(spec.origin).read_text(encoding="utf-8")


@pytest.mark.parametrize("noise", compat.NOISE, ids=[n.message[:40] for n in compat.NOISE])
def test_each_filtered_message_is_still_said_by_its_module(noise):
    """A filter whose message its module no longer says would hide nothing (or, reworded, something else)."""
    text = _source_text(noise.source)
    assert re.search(noise.message, text), f"{noise.source} no longer says {noise.message!r}"
    assert noise.printed_by and noise.why


def test_filters_are_narrowed_to_their_module():
    compat.quiet_dependency_noise()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.quiet_dependency_noise()
        # the same message, attributed to a module outside the filter's, is shown
        warnings.warn_explicit("full scope is deprecated. elsewhere", UserWarning, "mine.py", 1, module="mine")
        warnings.warn_explicit("full scope is deprecated. there", UserWarning, "transformer_config.py", 1,
                               module="megatron.core.transformer.transformer_config")
        warnings.warn_explicit("full scope is deprecated. there", UserWarning, "x.py", 1,
                               module="megatron.core.transformer.transformer_config_extra")
    assert [str(w.message) for w in caught] == ["full scope is deprecated. elsewhere",
                                                "full scope is deprecated. there"]


_TRIGGER = """
import torch, megatron.core
from megatron.core.transformer import TransformerConfig
from megatron.core.pipeline_parallel import schedules
import megatron.core.models.backends, megatron.core.optimizer
import torch.utils.cpp_extension
TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
"""


def _stderr(code: str) -> str:
    done = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.mark.slow
def test_the_stack_prints_its_noise_and_the_package_hides_exactly_that():
    """With every warning shown (-W default), megatron's import and first use print the listed messages; after
    ``import leangrpo_mcore`` the same code prints nothing."""
    bare = _stderr(_TRIGGER)
    for message in ("The following imports from `dynamic_context.py`", "full scope is deprecated",
                    "Apex is not installed. Falling back to Torch Norm"):
        assert message in bare, message
    assert _stderr("import leangrpo_mcore\n" + _TRIGGER) == ""


def test_fsdp_units_hand_out_no_views():
    """A policy's last linear returns a view; under FSDP2 its output is a copy (torch warns about every view an
    FSDP2 unit returns, whose in-place change would skip the backward gather), with the same numbers."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from leangrpo_mcore.models import build_policy
    from leangrpo_mcore.parallel.fsdp import apply_fsdp
    from leangrpo_mcore.parallel.mesh import Layout, build_parallel_context, destroy_parallel_context
    from tests.unit.test_flux_model import TINY, flux_inputs

    inputs = flux_inputs(4, 4, 5, batch=1)
    plain = build_policy({"family": "flux", **TINY}, seed=3)
    expected = plain(**inputs)
    assert expected._base is not None  # the cause: a 3-D linear's output is a view of its 2-D GEMM
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharded = apply_fsdp(build_policy({"family": "flux", **TINY}, seed=3), build_parallel_context(Layout()),
                             cast_only=True)  # FSDP2 over a one-rank mesh, as a one-process run casting
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = sharded(**inputs)
        assert not [w for w in caught if "view" in str(w.message)], [str(w.message) for w in caught]
        assert out._base is None and torch.equal(out, expected)
        # the unhooked control: the same root without the copy warns
        bare = torch.nn.Sequential(torch.nn.Linear(4, 4))
        fully_shard(bare, mesh=init_device_mesh("cpu", (1,)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bare(torch.randn(2, 3, 4, requires_grad=True))
        assert [w for w in caught if "returned a view tensor" in str(w.message)]
    finally:
        destroy_parallel_context()
        dist.destroy_process_group()


def _te_extra() -> list[str]:
    import ast

    setup = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    extras = next(ast.literal_eval(kw.value) for node in ast.walk(setup) if isinstance(node, ast.Call)
                  for kw in node.keywords if kw.arg == "extras_require")
    return extras["te"]


def test_every_fp8_recipe_the_config_accepts_exists_in_the_declared_te_range():
    """Each recipe name is megatron's, megatron builds it from the TE class our table names once TE reaches the
    release our table gives (read from the installed megatron-core's fp8_utils), and that release is inside every
    range of the ``te`` extra."""
    from megatron.core import fp8_utils
    from megatron.core.enums import Fp8Recipe

    from leangrpo_mcore.config.schema import ModelConfig
    from leangrpo_mcore.models.common.fp8 import FP8_RECIPES, TE_RECIPES

    choices = next(f for f in dataclasses.fields(ModelConfig) if f.name == "fp8").metadata["choices"]
    assert set(choices) == set(FP8_RECIPES)
    source = Path(fp8_utils.__file__).read_text(encoding="utf-8")
    outer = re.search(r'if is_te_min_version\("([\d.]+)"\):\s*\n\s*if config\.fp8_recipe == Fp8Recipe\.delayed',
                      source)
    assert outer, "megatron's FP8 recipe selection changed shape"
    for name, (te_class, first) in TE_RECIPES.items():
        assert Fp8Recipe(name).value == name
        branch = re.search(rf'Fp8Recipe\.{name}(?: and is_te_min_version\("([\d.]+)[\w.]*"\))?:\s*\n\s*'
                           rf'fp8_recipe = transformer_engine\.common\.recipe\.(\w+)\(', source)
        assert branch, f"megatron no longer builds the {name} recipe"
        gate = compat.version_tuple((branch.group(1) or outer.group(1)).strip("."))
        while gate[-1:] == (0,):
            gate = gate[:-1]
        assert branch.group(2) == te_class and gate == first, (name, branch.groups(), outer.group(1))
    lowest = max(first for _, first in TE_RECIPES.values())
    for requirement in _te_extra():
        minimum = re.search(r">=([\d.]+)", requirement)
        assert minimum and compat.version_tuple(minimum.group(1)) >= lowest, requirement


def _install_requires() -> dict[str, str]:
    import ast

    setup = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    requires = next(ast.literal_eval(kw.value) for node in ast.walk(setup) if isinstance(node, ast.Call)
                    for kw in node.keywords if kw.arg == "install_requires")
    names = [re.match(r"[\w-]+", r).group() for r in requires]
    return {name: r[len(name):] for name, r in zip(names, requires)}


def _release_text(release: tuple[int, ...]) -> str:
    return ".".join(str(n) for n in release)


def test_setup_ranges_are_the_tested_stacks():
    """setup.py admits torch and megatron-core from the lowest release CI tests (the Quickstart's pins) up to, not
    including, the minor release after the highest (.ci/current-stack.txt's pins); the README's table says the
    same, and the running stack is inside."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    table = readme.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    current = dict(line.strip().split("==") for line in (ROOT / ".ci" / "current-stack.txt").read_text().splitlines()
                   if "==" in line and not line.startswith("#"))
    lowest = {"torch": re.search(r"torch==([\d.]+)", quickstart).group(1), "megatron-core": "0.16.1"}
    requires = _install_requires()
    for name in ("torch", "megatron-core"):
        spec = SpecifierSet(requires[name])
        bounds = {s.operator: compat.version_tuple(s.version) for s in spec}
        assert set(bounds) == {">=", "<"}, requires[name]
        low, high = compat.version_tuple(lowest[name]), compat.version_tuple(current[name])
        assert bounds[">="] + (0,) * (3 - len(bounds[">="])) == low, (name, requires[name], lowest[name])
        assert bounds["<"][:2] == (high[0], high[1] + 1), (name, requires[name], current[name])
        row = f"| {name} | >= {_release_text(bounds['>='])}, < {_release_text(bounds['<'])} "
        assert row in table, row
        assert spec.contains(metadata.version(name).split("+")[0]), (name, metadata.version(name))


def test_every_stack_entry_names_a_test():
    """The current stack's subset (tests/conftest.py STACK) names files and tests that exist: a renamed one would
    silently drop out of the current stack's CI run."""
    from tests.conftest import STACK

    for entry in STACK:
        path, _, name = entry.partition("::")
        assert (ROOT / path).is_file(), entry
        assert not name or re.search(rf"^def {name}\(", (ROOT / path).read_text(encoding="utf-8"), re.M), entry
    assert {"tests/distributed/test_schedules_parallel.py", "tests/distributed/test_pipeline_parallel.py"} <= set(STACK)
