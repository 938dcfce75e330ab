"""A test-only module with extra state (``get_extra_state`` / ``set_extra_state``), shaped like Transformer
Engine's FP8 metadata: a per-tensor scale, an amax history and a counter, updated by the forwards it observes.

:func:`attach_probes` hangs one inside the first transformer block (an FSDP2 unit of its own) and one on the
policy's root, each fed by a forward hook of its parent, so a forward of the policy moves their state.
"""

from __future__ import annotations

from typing import Any

import torch


class ExtraStateProbe(torch.nn.Module):
    """Keeps ``scale`` (float32, [2]), ``amax_history`` (float32, [4]) and ``steps`` (int) as extra state."""

    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        self.scale = torch.full((2,), 1.0 + start)
        self.amax_history = torch.full((4,), start)
        self.steps = 0

    def observe(self, output: torch.Tensor) -> None:
        amax = output.detach().abs().amax().float()
        self.amax_history = torch.cat([amax.reshape(1), self.amax_history[:-1]])
        self.scale = torch.stack([448.0 / amax, self.scale[0]])
        self.steps += 1

    def get_extra_state(self) -> Any:
        return {"scale": self.scale.clone(), "amax_history": self.amax_history.clone(), "steps": self.steps}

    def set_extra_state(self, state: Any) -> None:
        self.scale = state["scale"].clone()
        self.amax_history = state["amax_history"].clone()
        self.steps = int(state["steps"])


def _feed(probe: ExtraStateProbe):
    def hook(module, args, output):
        probe.observe(output[0] if isinstance(output, tuple) else output)
    return hook


def attach_probes(model: torch.nn.Module, start: float = 0.0) -> dict[str, ExtraStateProbe]:
    """``{module name: probe}`` of the two probes added to ``model`` (call before FSDP2 wraps it)."""
    block = model.blocks()[0]
    block.probe = ExtraStateProbe(start)
    model.probe = ExtraStateProbe(start + 0.5)
    block.register_forward_hook(_feed(block.probe))
    model.register_forward_hook(_feed(model.probe))
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(block.probe)]: block.probe, names[id(model.probe)]: model.probe}


def same_state(a: ExtraStateProbe, b: ExtraStateProbe) -> bool:
    """Whether two probes hold equal extra state (values, not only keys)."""
    x, y = a.get_extra_state(), b.get_extra_state()
    return (torch.equal(x["scale"], y["scale"]) and torch.equal(x["amax_history"], y["amax_history"])
            and x["steps"] == y["steps"])


def tiny_flux_inputs() -> dict:
    """One seeded sample of inputs for the ``flux-tiny`` preset (12 image tokens on a 3 x 4 grid, 5 text tokens)."""
    gen = torch.Generator().manual_seed(3)
    img, txt = 12, 5
    img_ids = torch.stack([torch.zeros(img), torch.arange(img) // 3, torch.arange(img) % 3], dim=1)
    return dict(hidden_states=torch.randn(1, img, 16, generator=gen),
                encoder_hidden_states=torch.randn(1, txt, 32, generator=gen),
                pooled_projections=torch.randn(1, 24, generator=gen), timestep=torch.tensor([0.6]),
                img_ids=img_ids, txt_ids=torch.zeros(txt, 3), guidance=torch.full((1,), 3.5))
