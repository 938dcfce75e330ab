"""megatron-core imported without torch's compiler stack and wandb (``leangrpo_mcore/mcore_import.py``).

That a fresh process importing the trainer loads neither is checked in ``test_import_graph.py`` (its one
subprocess imports the runtime); here: the stand-in for ``torch.compile`` compiles what it was given, once, at the
first call, and the import leaves ``torch.compile`` and wandb as they were.
"""

from __future__ import annotations

import sys

import torch

from leangrpo_mcore import mcore_import


def test_deferred_compile_compiles_once_at_the_first_call(monkeypatch):
    calls = []

    def fake_compile(fn, **options):
        calls.append((fn, options))
        return lambda *args, **kwargs: 10 * fn(*args, **kwargs)

    monkeypatch.setattr(mcore_import, "_TORCH_COMPILE", fake_compile)

    def plus_one(x):
        return x + 1

    bare, with_options = mcore_import.deferred_compile(plus_one), mcore_import.deferred_compile(dynamic=False)(plus_one)
    assert calls == [] and bare.__name__ == "plus_one" and bare.__wrapped__ is plus_one
    assert bare(1) == 20 and bare(x=2) == 30 and with_options(3) == 40
    assert calls == [(plus_one, {}), (plus_one, {"dynamic": False})]


def test_the_import_restores_torch_compile_and_wandb():
    mcore_import.import_megatron_core()
    import megatron.core.jit as jit

    assert torch.compile is mcore_import._TORCH_COMPILE
    assert sys.modules.get(mcore_import.BLOCKED, "absent") is not None  # wandb importable again
    # the fusions' compiler: deferred, unless this process imported megatron-core before the package did
    assert jit.jit_fuser in (mcore_import.deferred_compile, torch.compile)
