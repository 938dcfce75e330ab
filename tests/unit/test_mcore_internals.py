"""Every megatron-core (and torch) internal listed in ``parallel/mcore_internals.py`` is still as the project uses
it; and the list covers the megatron-core modules the package imports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leangrpo_mcore.parallel.mcore_internals import INTERNALS

PACKAGE = Path(__file__).resolve().parents[2] / "leangrpo_mcore"


@pytest.mark.parametrize("internal", INTERNALS, ids=[i.name for i in INTERNALS])
def test_internal_still_as_used(internal):
    internal.check()


def test_every_megatron_import_is_public_or_listed():
    """A new ``from megatron.core.X import Y`` must either be megatron's documented surface or get an entry."""
    public = {"megatron.core.parallel_state", "megatron.core.transformer",
              "megatron.core.transformer.transformer_config", "megatron.core.tensor_parallel",
              "megatron.core.model_parallel_config", "megatron.core.enums", "megatron.core.process_groups_config",
              "megatron.core.pipeline_parallel"}
    listed = {"megatron.core.pipeline_parallel.p2p_communication", "megatron.core.fp8_utils",
              "megatron.core.fusions.fused_bias_gelu", "megatron.core.utils", "megatron.core.tensor_parallel.layers",
              "megatron.core.jit", "megatron.core.fusions", "megatron.core.inference.contexts"}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        found |= {f"{m}.{n}" if m == "megatron.core" else m
                  for m, n in re.findall(r"from (megatron\.core[\w.]*) import (\w+)", text)}
    assert found <= public | listed, sorted(found - public - listed)


def test_a_changed_internal_fails_its_check(monkeypatch):
    """The checks can fail: a schedule module that calls a CUDA function the CPU bridge does not answer."""
    from megatron.core.pipeline_parallel import schedules

    check = next(i.check for i in INTERNALS if "cpu_bridge" in i.name)
    real = __import__("inspect").getsource
    monkeypatch.setattr("inspect.getsource",
                        lambda obj: real(obj) + ("\ntorch.cuda.empty_cache()\n" if obj is schedules else ""))
    with pytest.raises(AssertionError, match="empty_cache"):
        check()
