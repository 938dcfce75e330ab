"""A step's conditioning images on one rank: read for the prompt groups it takes part in, encoded once per group.

Each data-parallel rank reads only the images of the prompt slots it holds generations of (the prompt sampler
draws the same prompts on every rank, so the ranks agree on them without communication; the CP and pipeline
ranks of a sample read the same ones). Every image is VAE-encoded once, and all the group's generations on the
rank share the encoding through the step's :class:`~leangrpo_mcore.diffusion.trajectory.Conditioning`, whose
reference rows of the slots the rank does not hold are NaN: never read, and poison if they were.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from leangrpo_mcore.data.images import ConditioningImages
from leangrpo_mcore.data.reference import encode_references
from leangrpo_mcore.data.vae import LatentDecoder
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.engine.launch import raise_if_any
from leangrpo_mcore.errors import UserError


class StepReferences:
    """Attaches each step's conditioning images to its conditioning (module doc)."""

    def __init__(self, images: ConditioningImages, decoder: LatentDecoder, family: str, slots: Sequence[int]) -> None:
        """``slots``: the prompt slots this rank holds generations of (the step engine's shares)."""
        self.images, self.decoder, self.family = images, decoder, family
        self.slots = sorted(set(int(s) for s in slots))

    def attach(self, conditioning: Conditioning, prompt_ids: Sequence[int]
               ) -> tuple[Conditioning, dict[int, torch.Tensor]]:
        """(``conditioning`` (one row per prompt slot) with its reference fields, {prompt id: this rank's image
        (3, H, W) float32 in [0, 1]}). Collective: an image that cannot be read stops every rank with its line."""
        ids = [int(prompt_ids[slot]) for slot in self.slots]
        pixels: Optional[torch.Tensor] = None
        error = None
        try:
            pixels = self.images.load(ids)
        except UserError as err:
            error = str(err)
        raise_if_any(error)
        fields = encode_references(self.family, self.decoder, pixels) if self.slots else {}
        rows = torch.tensor(self.slots, dtype=torch.long)
        attached = {}
        for name, value in fields.items():
            full = value.new_full((conditioning.num_samples, *value.shape[1:]), float("nan"))
            full[rows.to(value.device)] = value
            attached[name] = full.to(conditioning.encoder_hidden_states.device)
        sources = {} if pixels is None else {pid: image for pid, image in zip(ids, pixels)}
        return dataclasses.replace(conditioning, **attached), sources
