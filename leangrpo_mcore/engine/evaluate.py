"""Evaluation on fixed held-out prompts: a deterministic rollout of the policy, scored by one or more rewards.

Sample j of eval prompt i starts from noise drawn from ``(eval.seed, i, j)`` alone, and with ``eval.noise_level``
0 (the default) every step is the deterministic Euler step of the probability-flow ODE, so an evaluation of the
same weights gives the same images at every world size and layout, and evaluations of one run at different steps
differ only by what the policy learned. The samples are split over the data-parallel ranks (each padded to the
same count, since FSDP2 gathers in step); the policy runs as in training (TP, CP, PP, FSDP2), without gradients;
each sample is decoded and scored once, on the ranks that score training samples (CP rank 0 of the last
pipeline stage). In an image-conditioned run (``data.images``) each eval prompt's own image conditions its samples
(the test split's images), the rewards receive it as ``reference_images`` and the grid shows [source | result].
Results: :class:`EvalResult`, one object per evaluation (``RUN/eval.jsonl``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from leangrpo_mcore.config.loader import build_section
from leangrpo_mcore.config.schema import Config, RewardConfig
from leangrpo_mcore.data.conditioning import TextEncoder
from leangrpo_mcore.data.prompts import PromptDataset, eval_source
from leangrpo_mcore.data.reference import encode_references
from leangrpo_mcore.data.vae import PACKED_FAMILIES, DecodedImages, LatentDecoder
from leangrpo_mcore.diffusion.lockstep import rollout_together
from leangrpo_mcore.diffusion.sampler import RolloutLoop, SDEParams
from leangrpo_mcore.diffusion.seeding import eval_inputs
from leangrpo_mcore.diffusion.trajectory import Conditioning
from leangrpo_mcore.diffusion.velocity import finish_latents
from leangrpo_mcore.engine import build
from leangrpo_mcore.engine.launch import raise_if_any
from leangrpo_mcore.engine.output.samples import beside_sources, save_grid, to_uint8, video_to_uint8
from leangrpo_mcore.engine.output.video import write_video_grid
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.parallel.fsdp import reshard_policy, set_gathered
from leangrpo_mcore.parallel.mesh import ParallelContext
from leangrpo_mcore.parallel.sequence import LatentSplit
from leangrpo_mcore.parallel.stages import split_velocity
from leangrpo_mcore.rl.rewards import ValidatedReward

GRID_MAX = 16
"""At most this many eval samples (the first ones, in prompt order) appear in the eval grid."""


@dataclass
class EvalResult:
    """One evaluation: per reward the statistics over every sample and the mean of each prompt's samples."""

    step: int
    """Optimizer step of the evaluated weights (0: before training)."""
    rewards: dict[str, dict[str, Any]]
    """{reward name: {"mean", "std", "min", "max", "per_prompt": [...]}} (std over samples, ddof 0)."""
    num_prompts: int
    samples_per_prompt: int
    time_s: float = 0.0
    """Wall-clock seconds of the evaluation."""
    samples: list[tuple] = field(default_factory=list)
    """(uint8 (H, W, 3) image, prompt, first reward's value, uint8 (F, H, W, 3) video or None, uint8 (H, W, 3)
    conditioning image or None) of the first :data:`GRID_MAX` samples in (prompt, sample) order, for the grid (not
    written to the JSON)."""

    def to_json(self) -> dict:
        """The ``eval.jsonl`` object."""
        return {"step": self.step, "rewards": self.rewards, "num_prompts": self.num_prompts,
                "samples_per_prompt": self.samples_per_prompt, "time_s": round(self.time_s, 3)}

    def scalars(self) -> dict[str, float]:
        """``eval/<reward>/<stat>`` scalars for TensorBoard and wandb."""
        return {f"eval/{name}/{stat}": stats[stat] for name, stats in self.rewards.items()
                for stat in ("mean", "std", "min", "max")}


def reward_summary(values: np.ndarray) -> dict[str, Any]:
    """Statistics of a (prompts, samples) float64 array of one reward."""
    return {"mean": float(values.mean()), "std": float(values.std()), "min": float(values.min()),
            "max": float(values.max()), "per_prompt": [float(v) for v in values.mean(axis=1)]}


def eval_dataset(config: Config) -> PromptDataset:
    """The eval prompts: ``eval.prompts``, else ``data.prompts`` (of a dataset directory its test split where it
    has one); the first ``eval.num_prompts`` of them."""
    e = config.eval
    key = "eval.prompts" if e.prompts is not None else "data.prompts"
    source, split = eval_source(e.prompts if e.prompts is not None else config.data.prompts)
    dataset = build.prompts_from(key, source, split)
    if e.num_prompts is not None and e.num_prompts < len(dataset):
        dataset = PromptDataset(dataset.records[:e.num_prompts], source=dataset.source)
    return dataset


def eval_rewards(config: Config, training: Optional[ValidatedReward]) -> dict[str, ValidatedReward]:
    """{name: reward} of ``eval.rewards`` (each entry a reward section), or the training reward."""
    entries = config.eval.rewards
    if entries is None:
        reward = training if training is not None else build.reward_of(config.reward)
        return {config.reward.name: build.check_reward_images(reward, config, "reward")}
    if not entries:
        raise UserError("eval.rewards is empty: list at least one reward, or null for the training reward")
    rewards: dict[str, ValidatedReward] = {}
    for k, entry in enumerate(entries):
        section = build_section(RewardConfig, entry, f"eval.rewards.{k}.")
        if section.name in rewards:
            raise UserError(f"eval.rewards lists reward '{section.name}' twice")
        rewards[section.name] = build.check_reward_images(build.reward_of(section), config, f"eval.rewards.{k}")
    return rewards


def reward_input(decoded: DecodedImages) -> torch.Tensor:
    """What a reward scores: the images, or a video policy's whole videos (B, 3, F, H, W), of which the reward
    scores the frames that ``reward.options.frames`` names (the first by default)."""
    return decoded.video if decoded.video is not None else decoded.images


@contextlib.contextmanager
def ema_weights(policy: torch.nn.Module, ema: Optional[dict[str, torch.Tensor]]) -> Iterator[None]:
    """The policy's trainable parameters replaced by their EMA shadows inside the block (restored after)."""
    if not ema:
        yield
        return
    params = dict(policy.named_parameters())
    saved = {}
    with torch.no_grad():
        for name, shadow in ema.items():
            saved[name] = params[name].detach().clone()
            params[name].detach().copy_(shadow.to(params[name].dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for name, value in saved.items():
                params[name].detach().copy_(value)


class Evaluator:
    """Evaluates the policy of a run on the eval prompts (module doc); every rank calls :meth:`evaluate`."""

    def __init__(self, config: Config, *, parts: build.PolicyParts, pctx: ParallelContext, text_encoder: TextEncoder,
                 decoder: LatentDecoder, rewards: Optional[dict[str, ValidatedReward]], velocity=None,
                 forward_context=None) -> None:
        """``rewards`` is None on ranks that do not score; ``velocity`` the training velocity function (reused
        when the eval's guidance equals the sampler's)."""
        e, s = config.eval, config.sampler
        self.config, self.parts, self.pctx = config, parts, pctx
        self.text_encoder, self.decoder, self.rewards = text_encoder, decoder, rewards
        self.dataset = eval_dataset(config)
        key = "eval.prompts" if e.prompts is not None else "data.prompts"
        self.images = build.conditioning_images(config, parts.family, self.dataset, key, pctx.device,
                                                parts.policy.config.to_diffusers_config())
        self._sources: dict[int, torch.Tensor] = {}
        self.samples_per_prompt = e.samples_per_prompt
        self.shape = build.policy_latent_shape(config, parts.policy, parts.family)
        self.sigmas = build.sigma_schedule(config, e.num_steps or s.num_steps, self.shape)
        self.cfg_scale = s.cfg_scale if e.cfg_scale is None else e.cfg_scale
        self.guidance = s.guidance_scale if e.guidance_scale is None else e.guidance_scale
        if parts.family.name == "flux" and self.cfg_scale != 1.0:
            raise UserError("eval.cfg_scale: FLUX uses the guidance embedding; set it to 1 (or null)")
        use_ema = config.train.ema_decay > 0 if e.use_ema is None else e.use_ema
        if use_ema and parts.ema is None:
            raise UserError("eval.use_ema=true needs EMA weights: set train.ema_decay > 0")
        self.use_ema = use_ema
        if velocity is None or self.cfg_scale != s.cfg_scale:
            velocity = build.build_velocity(config, parts, pctx, cfg_scale=self.cfg_scale)
        self.split = LatentSplit(self.shape, pctx.cp_group) if pctx.layout.cp > 1 else None
        self.velocity = split_velocity(velocity, self.split) if self.split is not None else velocity
        self.sde = SDEParams.from_sigmas(s.sde_kind, e.noise_level, self.sigmas)
        if self.split is not None:
            self.sde = dataclasses.replace(self.sde, sample_mean=self.split.sample_mean)
        self.forward_context = forward_context
        self.micro_batch = config.schedule.micro_batch
        self.scores = rewards is not None

    @property
    def num_samples(self) -> int:
        """Samples of one evaluation over all ranks."""
        return len(self.dataset) * self.samples_per_prompt

    def _my_items(self) -> list[Optional[tuple[int, int]]]:
        """This data-parallel rank's (prompt, sample) pairs, padded with None to the count of the busiest rank."""
        items = [(i, j) for i in range(len(self.dataset)) for j in range(self.samples_per_prompt)]
        dp, rank = self.pctx.dp_size, self.pctx.dp_rank
        mine: list[Optional[tuple[int, int]]] = list(items[rank::dp])
        return mine + [None] * (math.ceil(len(items) / dp) - len(mine))

    def _conditioning(self, prompts: list[str]) -> Conditioning:
        cond = self.text_encoder.encode(prompts)
        if cond.guidance is not None:
            cond = dataclasses.replace(cond, guidance=torch.full_like(cond.guidance, float(self.guidance)))
        if self.cfg_scale > 1.0 and cond.negative_encoder_hidden_states is None:
            cond = self.text_encoder.add_negative(cond, self.config.sampler.negative_prompt)
        return cond

    def _read_sources(self, items: list[Optional[tuple[int, int]]]) -> None:
        """Collective: this rank's eval prompts' conditioning images (``data.images``), read before any forward so
        that an unreadable one stops every rank with its line."""
        self._sources, error = {}, None
        if self.images is None:
            return
        prompts = sorted({pair[0] for pair in items if pair is not None} or {0})  # a padded rank repeats prompt 0
        try:
            self._sources = dict(zip(prompts, self.images.load(prompts)))
        except UserError as err:
            error = str(err)
        raise_if_any(error)

    def _references(self, pairs: list[tuple[int, int]]) -> Optional[torch.Tensor]:
        """(B, 3, H, W) conditioning images of the samples ``pairs`` (None without ``data.images``)."""
        return torch.stack([self._sources[i] for i, _ in pairs]) if self.images is not None else None

    def _rollout(self, pairs: list[tuple[int, int]]) -> torch.Tensor:
        """Final latents (B, *shape) of the samples ``pairs`` (whole latents on every CP rank)."""
        device, steps = self.pctx.device, self.sigmas.numel() - 1
        init, seeds = eval_inputs(self.config.eval.seed, [i for i, _ in pairs], [j for _, j in pairs], self.shape,
                                  steps)
        batch = len(pairs)
        sde_rows = self.config.eval.noise_level > 0
        cond = self._conditioning(self.dataset.get([i for i, _ in pairs]))
        references = self._references(pairs)
        if references is not None:
            run = build.reference_run(self.config, self.parts.policy.config.to_diffusers_config())
            cond = dataclasses.replace(cond, **encode_references(self.parts.family.name, self.decoder, references,
                                                                 run))
        cond = cond.to(device)
        loop = RolloutLoop(init.to(device), self.sigmas, cond, sde=self.sde,
                           selected=torch.zeros(batch, steps, dtype=torch.bool),
                           sde_steps=torch.full((batch, steps), sde_rows, dtype=torch.bool), noise_seeds=seeds,
                           prompt_ids=torch.tensor([i for i, _ in pairs]),
                           generation_ids=torch.tensor([j for _, j in pairs]), forward_context=self.forward_context,
                           split=self.split)
        many = getattr(self.velocity, "velocities", None)
        if many is not None:
            rollout_together([loop], self.velocity, many, with_grad=False)
        while not loop.done:
            loop.step(self.velocity)
        final = loop.trajectory().final_latents
        final = self.split.gather(final) if self.split is not None else final
        return finish_latents(self.velocity, final, cond)

    def _score(self, latents: torch.Tensor, pairs: list[tuple[int, int]], keep: int) -> list[tuple]:
        """(i, j, {reward: value}, grid item or None) of each sample (the first ``keep`` keep their images)."""
        s = self.config.sampler
        size = {"height": s.height, "width": s.width} if self.parts.family.name in PACKED_FAMILIES else {}
        decoded = self.decoder.decode(latents, **size)
        prompts, metadata = self.dataset.get([i for i, _ in pairs]), self.dataset.metadata([i for i, _ in pairs])
        references = self._references(pairs)
        values = {name: reward(reward_input(decoded), prompts, metadata, references).double().tolist()
                  for name, reward in self.rewards.items()}
        first = next(iter(values))
        images = to_uint8(decoded.images)
        videos = None if decoded.video is None else video_to_uint8(decoded.video)
        sources = None if references is None else to_uint8(references)
        out = []
        for row, (i, j) in enumerate(pairs):
            index = i * self.samples_per_prompt + j
            item = None
            if index < keep:
                item = (images[row], prompts[row], values[first][row], None if videos is None else videos[row],
                        None if sources is None else sources[row])
            out.append((i, j, {name: v[row] for name, v in values.items()}, item))
        return out

    def evaluate(self, step: int) -> Optional[EvalResult]:
        """Collective: evaluate the current weights (their EMA with ``eval.use_ema``); the result on the first
        rank, None elsewhere."""
        start = time.perf_counter()
        items = self._my_items()
        local: list[tuple] = []
        policy = self.parts.policy
        self._read_sources(items)
        reshard_policy(policy)
        set_gathered(policy, False)
        with torch.no_grad(), ema_weights(policy, self.parts.ema if self.use_ema else None):
            for first in range(0, len(items), self.micro_batch):
                chunk = items[first:first + self.micro_batch]
                real = [pair for pair in chunk if pair is not None]
                # a padded rank repeats a sample so that every rank runs the same forwards (FSDP2 gathers in step)
                pairs = [pair if pair is not None else (real or [(0, 0)])[0] for pair in chunk]
                latents = self._rollout(pairs)
                if self.scores and real:
                    local.extend(self._score(latents[:len(real)], real, GRID_MAX))
        reshard_policy(policy)
        return self._collect(step, local, time.perf_counter() - start)

    def _collect(self, step: int, local: list[tuple], seconds: float) -> Optional[EvalResult]:
        gathered = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        rows = {(i, j): (values, item) for part in gathered for i, j, values, item in part}
        shape = (len(self.dataset), self.samples_per_prompt)
        if len(rows) != shape[0] * shape[1]:
            raise RuntimeError(f"evaluation scored {len(rows)} of {shape[0] * shape[1]} samples")
        names = list(next(iter(rows.values()))[0])
        table = {name: np.array([[rows[(i, j)][0][name] for j in range(shape[1])] for i in range(shape[0])],
                                dtype=np.float64) for name in names}
        samples = [rows[key][1] for key in sorted(rows) if rows[key][1] is not None][:GRID_MAX]
        return EvalResult(step=step, rewards={name: reward_summary(v) for name, v in table.items()},
                          num_prompts=shape[0], samples_per_prompt=shape[1], time_s=seconds, samples=samples)


def write_eval_grid(run_dir, step: int, samples: list[tuple], metrics, *, fps: int) -> None:
    """``samples/eval_step_<N>.png`` (first frames; also to TensorBoard and wandb as ``eval/samples``) and, for
    video policies, ``samples/eval_step_<N>.mp4`` (wandb: ``eval/samples_video``); each sample is captioned with
    its prompt and its value of the first eval reward, and shown beside its conditioning image where it has one."""
    sources = np.stack([s[4] for s in samples]) if all(s[4] is not None for s in samples) else None
    paired = (lambda tiles: tiles) if sources is None else (lambda tiles: beside_sources(tiles, sources))
    images = torch.from_numpy(paired(np.stack([s[0] for s in samples]))).permute(0, 3, 1, 2).float() / 255.0
    prompts, values = [s[1] for s in samples], [s[2] for s in samples]
    grid = save_grid(run_dir.sample_path(step, prefix="eval_step"), images, prompts, values)
    metrics.add_image("eval/samples", np.asarray(grid), step)
    if all(s[3] is not None for s in samples):
        path = run_dir.video_path(step, prefix="eval_step")
        write_video_grid(path, paired(np.stack([s[3] for s in samples])), prompts, values, fps=fps)
        metrics.add_video("eval/samples_video", path, step, fps)
