"""The model FLOPs of one training step: what ``tflops_per_device`` and ``mfu`` divide by the step time.

Pure Python. A step's FLOPs are counted per *sample-pass* (one forward or one backward of one sample, both CFG
branches included) from the :class:`~leangrpo_mcore.planner.arch_specs.ArchSpec`, times how many passes the
step actually runs (:func:`step_passes`), over every sample of the step on every rank.

Counting rules (a multiply-add is 2 FLOPs; elementwise work, norms, softmax and the SDE math are not counted):

- a linear layer of ``in`` x ``out`` over ``t`` tokens: ``2·t·in·out`` forward; its backward
  ``2·t·in·out`` for the input gradient, except for the embedders that read the model's inputs (nothing upstream
  needs a gradient), plus ``2·t·in·out`` for the weight gradient when the weight trains;
- attention of ``s_q`` queries over ``s_kv`` keys, ``h`` heads of width ``d``: ``4·s_q·s_kv·d·h`` forward
  (QKᵀ and PV), 2.5 times that backward (the four gradient products and the scores QKᵀ again, as flash
  attention's backward computes them);
- a LoRA adapter of rank ``r`` on such a layer: ``2·t·r·(in + out)`` forward, twice that backward (its weights
  train); under LoRA a frozen layer computes its input gradient only where something upstream trains: not in
  the embedders, the adaLN modulation of the timestep embedding, Wan's cross-attention keys and values of the
  text, nor the first block's projections of its input;
- activation checkpointing recomputes the transformer blocks' forward once per backward;
- two-branch classifier-free guidance runs every pass on a batch of two.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.arch_specs import (_OUTPUT_LAYERS, DEFAULT_LORA_TARGETS, ArchSpec, LinearSpec,
                                                _target_matches)
from leangrpo_mcore.planner.config_workload import arch_of, rollout_steps_of, selected_steps_of, tokens_of

FORWARD_KINDS = ("nograd", "rollout_grad", "recompute", "reference")
"""Sample-forwards by kind, as the benchmark's forward probe sorts them: rollout forwards without gradients,
grad-enabled rollout forwards (recompute-free schedules), Native's recompute forwards, KL reference forwards."""

# Root linears whose input is a model input (latents, text embeddings, sinusoidal timestep features). Qwen-Image's
# txt_in is not one: it reads txt_norm, whose weight trains in a full fine-tune.
_ENTRY_LAYERS = ("x_embedder", "context_embedder", "patch_embedding", "linear_1", "img_in")


ATTENTION_BACKWARD = 2.5
"""Backward over forward FLOPs of attention: dV = PᵀdO, dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀQ and the recomputed
scores QKᵀ, five products of the forward's two."""

# The block linears that read the block's input residual streams (FLUX double / single, Wan, Qwen-Image), and
# Wan's cross-attention keys and values, which read the text context no block updates.
_JOINT_QKV = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
_BLOCK_INPUT = {"double": _JOINT_QKV, "qwen": _JOINT_QKV, "qwen_last": _JOINT_QKV,
                "single": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
                "wan": ("attn1.to_q", "attn1.to_k", "attn1.to_v")}
_TEXT_CONTEXT = {"wan": ("attn2.to_k", "attn2.to_v")}


def _is_entry(lin: LinearSpec) -> bool:
    return lin.name.split(".")[-1] in _ENTRY_LAYERS


@dataclass(frozen=True)
class PassFlops:
    """FLOPs of one pass of one sample (both CFG branches), the whole model on one device."""

    forward: float
    """One forward."""
    backward: float
    """One backward (input and weight gradients), without any recompute."""
    recompute: float
    """What activation checkpointing adds to one backward (the blocks' forward; 0 without it)."""
    reference: float = 0.0
    """One KL reference forward: :attr:`forward` without the LoRA adapters (the reference disables them)."""
    forward_attention: float = 0.0
    """The attention part of :attr:`forward` (QKᵀ and PV)."""


def _lora_rank_of(lin: LinearSpec, rank: int, targets: tuple[str, ...]) -> int:
    return rank if rank and any(_target_matches(lin.name, t) for t in targets) else 0


def _linear_pass(lin: LinearSpec, tokens: dict[str, int], *, rank: int, input_grad: bool,
                 trains: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs of one linear with its adapter of rank ``rank`` (0: none) for one sample: the
    backward computes the input gradient when ``input_grad`` and the weight gradient when the weight ``trains``;
    an adapter's own weights always train."""
    t = tokens[lin.stream]
    base = 2.0 * t * lin.in_features * lin.out_features
    adapter = 2.0 * t * rank * (lin.in_features + lin.out_features)
    backward = base * (int(input_grad) + int(trains))
    if rank:  # B's weight and input gradients, A's weight gradient, and A's input gradient when needed
        backward += 2.0 * adapter - (0.0 if input_grad else 2.0 * t * rank * lin.in_features)
    return base + adapter, backward


def _root_input_grad(lin: LinearSpec, full: bool) -> bool:
    if full:
        return not _is_entry(lin)
    # Under LoRA only what lies downstream of an adapter needs gradients: of the root layers the output projection.
    return lin.name.split(".")[0] in _OUTPUT_LAYERS and lin.stream != "sample"


def _block_input_grad(lin: LinearSpec, kind: str, first: bool, full: bool) -> bool:
    if full:
        return True
    # Under LoRA the timestep modulation and the text context of cross-attention never need a gradient, nor the
    # first block's input, which only frozen embedders made.
    return not (lin.stream == "sample" or lin.name in _TEXT_CONTEXT.get(kind, ())
                or (first and lin.name in _BLOCK_INPUT.get(kind, ())))


def pass_flops(arch: ArchSpec, tokens: dict[str, int], *, lora_rank: int = 0, lora_targets: tuple[str, ...] = (),
               checkpointing: bool = False, cfg: bool = False) -> PassFlops:
    """FLOPs of one forward / backward of one sample (module rules); ``cfg``: two branches per pass."""
    full = lora_rank == 0
    forward = backward = blocks = attention = adapters = 0.0
    for lin in arch.root:
        f, b = _linear_pass(lin, tokens, rank=0, input_grad=_root_input_grad(lin, full), trains=full)
        forward, backward = forward + f, backward + b
    first = True
    for block in (b for b in arch.blocks if b.count):
        for lin in block.linears:
            rank = _lora_rank_of(lin, lora_rank, lora_targets)
            f, b_first = _linear_pass(lin, tokens, rank=rank, trains=full,
                                      input_grad=_block_input_grad(lin, block.kind, first, full))
            b_rest = _linear_pass(lin, tokens, rank=rank, trains=full,
                                  input_grad=_block_input_grad(lin, block.kind, False, full))[1]
            forward, blocks = forward + block.count * f, blocks + block.count * f
            adapters += block.count * 2.0 * tokens[lin.stream] * rank * (lin.in_features + lin.out_features)
            backward += b_first + (block.count - 1) * b_rest
        first = False
        for q_stream, kv_stream in block.attention:
            scores = block.count * 4.0 * tokens[q_stream] * tokens[kv_stream] * arch.hidden_size
            forward, blocks, attention = forward + scores, blocks + scores, attention + scores
            backward += ATTENTION_BACKWARD * scores
    branches = 2.0 if cfg else 1.0
    return PassFlops(forward=branches * forward, backward=branches * backward,
                     recompute=branches * blocks if checkpointing else 0.0, reference=branches * (forward - adapters),
                     forward_attention=branches * attention)


def step_passes(schedule: str, *, num_steps: int, selected_steps: int, kl: bool, pp: int = 1) -> dict[str, int]:
    """Sample-passes of one sample trained by ``schedule`` in one step: forwards by :data:`FORWARD_KINDS` and
    ``backward``.

    ``num_steps`` is the rollout's forwards (T, or T' when the steps after the SDE window are compressed).
    Native rolls out all T steps without gradients and recomputes each of the |S| trained ones; Retain and
    Reweight run the trained steps' rollout forwards with gradients. The KL term adds a reference forward per
    trained step; under Reweight it is backpropagated apart from the policy-gradient part (a second backward of
    the step's graph; at ``pp`` > 1 a second forward of its own too, ``schedules/reweight.py``).
    """
    if schedule not in ("native", "retain", "reweight"):
        raise UserError(f"unknown schedule {schedule!r} (expected native, retain or reweight)")
    t, s = num_steps, selected_steps
    reference = s if kl else 0
    if schedule == "native":
        return {"nograd": t, "rollout_grad": 0, "recompute": s, "reference": reference, "backward": s}
    parts = 2 if schedule == "reweight" and kl else 1
    grad_forwards = s * (parts if pp > 1 else 1)
    return {"nograd": t - s, "rollout_grad": grad_forwards, "recompute": 0, "reference": reference,
            "backward": s * parts}


@dataclass(frozen=True)
class StepFlops:
    """The FLOPs of one training step over all ranks, and the passes behind them."""

    samples: int
    """Generations per step over all ranks (P·M)."""
    passes: PassFlops
    counts: dict[str, int] = field(default_factory=dict)
    """Sample-passes of the whole step: :data:`FORWARD_KINDS` forwards and ``backward``."""

    @property
    def total(self) -> float:
        """Model FLOPs of the step (every forward, backward and recompute of every sample)."""
        p, c = self.passes, self.counts
        policy = c["nograd"] + c["rollout_grad"] + c["recompute"]
        return policy * p.forward + c["reference"] * p.reference + c["backward"] * (p.backward + p.recompute)

    def per_rank_counts(self, dp_size: int) -> dict[str, int]:
        """Sample-passes one data-parallel rank runs (every rank of a sample's TP/CP/PP group runs them all)."""
        return {k: v // dp_size if isinstance(v, int) else v / dp_size for k, v in self.counts.items()}


def step_flops(arch: ArchSpec, tokens: dict[str, int], *, schedule: str, num_steps: int, selected_steps: int,
               group_size: int, prompts_per_step: int, updates_per_rollout: int = 1, kl: bool = False,
               lora_rank: int = 0, lora_targets: tuple[str, ...] = (), checkpointing: bool = False,
               cfg: bool = False, pp: int = 1) -> StepFlops:
    """The FLOPs of one step: the first of ``updates_per_rollout`` blocks of prompt groups is trained by
    ``schedule``, the later ones by Native (``engine/step/engine.py``)."""
    if prompts_per_step % updates_per_rollout:
        raise UserError(f"updates per rollout ({updates_per_rollout}) must divide prompts per step "
                        f"({prompts_per_step})")
    first = prompts_per_step // updates_per_rollout * group_size
    samples = prompts_per_step * group_size
    own = step_passes(schedule, num_steps=num_steps, selected_steps=selected_steps, kl=kl, pp=pp)
    later = step_passes("native", num_steps=num_steps, selected_steps=selected_steps, kl=kl, pp=pp)
    counts = {k: first * own[k] + (samples - first) * later[k] for k in own}
    passes = pass_flops(arch, tokens, lora_rank=lora_rank, lora_targets=lora_targets, checkpointing=checkpointing,
                        cfg=cfg)
    return StepFlops(samples=samples, passes=passes, counts=counts)


def step_flops_for_config(config: Any, schedule: str | None = None, window_start: int | None = None, *,
                          text_tokens: int | None = None) -> StepFlops:
    """The FLOPs of one step of an experiment config under ``schedule`` (default ``config.schedule.name``), its
    prompts ``text_tokens`` long (default: the text encoder's length, see ``tokens_of``), with the rollout's T'
    forwards when the steps after a shared SDE window are compressed: at ``window_start``, or the mean over the
    window's starts (:func:`~leangrpo_mcore.planner.config_workload.rollout_steps_of`)."""
    name = schedule or config.schedule.name
    if name == "auto":
        raise UserError("schedule 'auto' must be resolved before counting a step's FLOPs")
    arch = arch_of(config)
    lora = config.model.lora
    targets = DEFAULT_LORA_TARGETS[arch.family] if lora.targets is None else tuple(lora.targets)
    g = config.grpo
    rollout = rollout_steps_of(config, window_start)
    return step_flops(arch, tokens_of(config, arch, text_tokens), schedule=name,
                      num_steps=int(rollout) if rollout.is_integer() else rollout,
                      selected_steps=selected_steps_of(config), group_size=g.group_size,
                      prompts_per_step=g.prompts_per_step, updates_per_rollout=g.updates_per_rollout,
                      kl=g.kl_beta > 0, lora_rank=lora.rank, lora_targets=targets,
                      checkpointing=config.model.activation_checkpointing is True,
                      cfg=(config.sampler.cfg_scale or 1.0) > 1.0, pp=int(config.parallel.pp))
