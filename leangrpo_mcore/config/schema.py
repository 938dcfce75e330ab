"""The experiment configuration: one dataclass per section, a docstring per field.

YAML files are plain data mapped onto these classes by :mod:`leangrpo_mcore.config.loader`, which checks every
key, type, range and choice. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from leangrpo_mcore.config.fields import option

SDE_KINDS = ("flow_grpo", "flow_grpo_cps", "wan", "dance_grpo")
SIGMA_SCHEDULES = ("flux", "sd3", "dance", "wan", "qwen_image")


@dataclass
class SamplerConfig:
    """How a trajectory is rolled out (docs/algorithms.md §2-3)."""

    sde_kind: str = option("flow_grpo", choices=SDE_KINDS)
    """SDE step variant: flow_grpo (FlowGRPO sde), flow_grpo_cps, wan (FlowGRPO's Wan step), dance_grpo."""
    num_steps: int = option(6, ge=1)
    """T, the number of denoising steps of a rollout."""
    noise_level: float = option(0.9, ge=0.0)
    """SDE noise: FlowGRPO's noise level a (0.7 SD3, 0.9 FLUX), or DanceGRPO's eta (0.3). Must be > 0 for every
    kind but wan (whose step sets its own noise): GRPO's log-probabilities need a stochastic rollout. The
    deterministic ODE rollout is evaluation's (eval.noise_level: 0)."""
    sigma_schedule: str = option("flux", choices=SIGMA_SCHEDULES)
    """Sigma schedule: flux (dynamic shift from the token count), qwen_image (Qwen-Image's: dynamic shift, stretched
    to end at 0.02), sd3 / wan (static shift), dance (time shift)."""
    shift: Optional[float] = option(None, gt=0.0)
    """Static shift of the sd3, wan and dance schedules (unused by flux and qwen_image, whose shift depends on
    tokens); null = the
    shift of the pipeline's scheduler/scheduler_config.json when model.path is a diffusers pipeline root, else 3.0."""
    guidance_scale: float = option(3.5, ge=0.0)
    """Guidance-embedding value given to a guidance-distilled policy (FLUX.1-dev: 3.5)."""
    cfg_scale: float = option(1.0, ge=1.0)
    """Two-branch classifier-free guidance scale (Wan: 5.0; Qwen-Image's true CFG, rescaled to the conditional
    velocity's norm: 4.0); 1.0 disables the unconditional branch."""
    height: int = option(512, ge=16)
    """Image height in pixels."""
    width: int = option(512, ge=16)
    """Image width in pixels."""
    frames: int = option(1, ge=1)
    """Video frames in pixel space (1 for images)."""
    negative_prompt: str = ""
    """Prompt of the unconditional branch of classifier-free guidance (Wan, SD3, Qwen-Image), used when cfg_scale >
    1 (a precomputed text-embedding cache must hold it)."""
    same_latent: bool = False
    """Share the initial noise within a prompt group (SDE noise always differs per generation)."""
    sde_window_size: int = option(0, ge=0)
    """FlowGRPO-Fast: number of SDE steps in the noise window (0 = SDE on every step)."""
    sde_window_range: list[int] = option(factory=lambda: [0, 3])
    """[lowest, highest) start step of the SDE window: the range a random start is drawn from, a fixed window's
    start (the lowest), the starts a progressive window sweeps."""
    sde_window_schedule: str = option("random", choices=("fixed", "random", "progressive"))
    """Where the SDE window sits (docs/algorithms.md §8): random (FlowGRPO-Fast: a start drawn per prompt group),
    fixed (always at sde_window_range[0]) or progressive (MixGRPO: from sde_window_range[0], moving by
    window_stride every window_shift_every optimizer steps, back to the first start after the last one below
    sde_window_range[1]). Needs sde_window_size >= 1 unless random."""
    window_stride: int = option(1, ge=1)
    """Progressive window: steps the start moves at each shift (MixGRPO: 1)."""
    window_shift_every: int = option(1, ge=1)
    """Progressive window: optimizer steps between two shifts (MixGRPO: 25, MixGRPO-Flash: 20)."""
    ode_solver: str = option("euler", choices=("euler", "dpmpp_2m"))
    """ODE steps outside the SDE window: euler, or dpmpp_2m (second-order multistep DPM-Solver++ on the data
    prediction x0 = x - sigma*v, MixGRPO-Flash). Needs sde_window_size >= 1 unless euler."""
    ode_solver_before_window: str = option("same", choices=("same", "euler"))
    """ODE steps before the SDE window: same (sampler.ode_solver, as after it) or euler (MixGRPO-Flash's "post"
    strategy: Euler before the window, sampler.ode_solver only after it; the solver's history still runs through
    every step). Needs sde_window_size >= 1 unless same."""
    ode_steps_after_window: Optional[int | float] = option(None, ge=0)
    """MixGRPO-Flash: compress the remainder of the schedule after the SDE window into fewer ODE steps (fewer
    forwards per rollout). A count K: K steps on points of the sigma schedule. A ratio r in (0, 1):
    MixGRPO-Flash's rule, int(max((T - e + 1) * r, 1)) points from the window's end e to sigma 0 (e.g. 0.4), spaced
    evenly in the schedule's unshifted time, so the tail shrinks as the window moves (docs/algorithms.md §8).
    0 or null keeps every step. Needs a fixed or progressive window."""


@dataclass
class GRPOConfig:
    """Advantages, the clipped surrogate, KL and the selected steps (docs/algorithms.md §4)."""

    group_size: int = option(4, ge=1)
    """M, the generations per prompt."""
    prompts_per_step: int = option(1, ge=1)
    """Prompt groups per optimizer step, over the whole data-parallel world."""
    clip_range: float = option(1e-4, gt=0.0)
    """epsilon of the clipped ratio (1e-4; 1e-5 for FlowGRPO-Fast)."""
    adv_clip_max: float = option(5.0, gt=0.0)
    """Advantages are clamped to +-adv_clip_max."""
    kl_beta: float = option(0.0, ge=0.0)
    """beta of the KL term to the reference policy (0 disables it and the reference forward)."""
    kl_form: str = option("flow_grpo", choices=("flow_grpo", "exact"))
    """KL on SDE means: flow_grpo divides by 2 std_t^2 (FlowGRPO SD3/FLUX code); exact is the true Gaussian KL."""
    advantage: str = option("flow_grpo", choices=("flow_grpo", "dance_grpo"))
    """Advantage estimator: flow_grpo ((r-mean)/(std+1e-4), ddof 0) or dance_grpo ((r-mean)/(std+1e-8), ddof 1)."""
    global_std: bool = False
    """Normalise by the std of all rewards of the step instead of the group's."""
    timestep_fraction: float = option(0.99, gt=0.0, le=1.0)
    """Fraction of the steps that are trained (FlowGRPO: first int(T*f); DanceGRPO: int((T-1)*f) random ones)."""
    timestep_selection: str = option("flow_grpo", choices=("flow_grpo", "dance_grpo", "sde_window"))
    """Which steps are selected, drawn before rollout: first ones, a random subset per sample, or the SDE window."""
    updates_per_rollout: int = option(1, ge=1)
    """K, optimizer steps per training step: the step's prompt groups are rolled out once and split into K
    blocks, one optimizer step each; the first block is recompute-free (Retain, Reweight), later ones recompute
    (Native) at the then current parameters. train.max_steps, metrics' step and checkpoint/eval intervals count
    training steps; optim.warmup_steps, the learning-rate schedule and sampler.window_shift_every count the K
    optimizer steps of each."""
    ratio_norm: bool = False
    """GRPO-Guard's RatioNorm: the log-ratio of each trained step, centred by the mean shift its mean's drift
    causes and scaled by the step's transition std s, s*(log p - log p_old) + mean((mu - mu_old)^2)/(2 s), so
    that PPO's clip band sits around the ratio's mean again at every denoising step (docs/algorithms.md §9).
    Not with sampler.sde_kind=flow_grpo_cps (its log-density drops the normalisation)."""
    grad_reweight: str = option("none", choices=("none", "flow_grpo", "dancegrpo"))
    """GRPO-Guard's gradient reweighting of each trained step's clipped surrogate (the KL term is not weighted):
    none; flow_grpo, 1/|dt| (FlowGRPO's sigma form, std_t = a*sqrt(sigma/(1-sigma))); dancegrpo,
    1/(|dt|*(1 + eta^2*(1-sigma)/(2*sigma))) (DanceGRPO's constant std_t = eta). Each equalises the steps'
    gradients for its SDE (docs/algorithms.md §9). Not with sampler.sde_kind=flow_grpo_cps."""


@dataclass
class RewardConfig:
    """The reward function (a registry name, a plugin, or a weighted sum of several)."""

    name: str = "jpeg_compressibility"
    """Registered reward name, 'weighted' to combine the rewards in `weights`, a plugin
    package.module:callable (a function, or a class instantiated with `options`), or the name of an installed
    entry point of the group leangrpo_mcore.rewards."""
    options: dict[str, Any] = option(factory=dict)
    """Keyword options of the reward: constructor arguments of a class, keyword arguments of a function."""
    weights: Optional[dict[str, float]] = None
    """For name 'weighted': {reward name: weight}."""
    normalize: bool = False
    """For name 'weighted': z-score each reward over the batch before weighting."""
    aggregate: str = option("rewards", choices=("rewards", "advantages"))
    """For name 'weighted': 'rewards' sums the weighted rewards Σ_k w_k r_k into one reward, then one group
    advantage; 'advantages' normalises each reward k into its own group advantage A_k (grpo.advantage,
    grpo.global_std per reward) and trains on A = clamp(Σ_k w_k A_k, ±grpo.adv_clip_max) (MixGRPO's multi-reward
    option). The logged reward stays Σ_k w_k r_k; each reward's mean is logged as reward_<name>_mean."""
    url: Optional[str] = None
    """For name 'remote': the HTTP endpoint of a reward server."""
    timeout_s: float = option(60.0, gt=0.0)
    """For name 'remote': seconds one request may take in all (connect, send, wait, read the whole reply)."""
    retries: int = option(3, ge=0)
    """For name 'remote': retries after a failed request (connection errors, timeouts, HTTP 429 and 5xx only)."""
    max_response_bytes: int = option(16 << 20, gt=0)
    """For name 'remote': largest accepted reply in bytes; a larger one fails without being read whole."""
    auth_env: Optional[str] = None
    """For name 'remote': NAME of an environment variable holding a bearer token (never the token itself)."""
    ca_bundle: Optional[str] = None
    """For name 'remote': CA certificate file (PEM) that verifies an https reward server."""
    async_scoring: bool = False
    """Decode and score each micro-batch in a background thread while the next ones roll out; rewards are
    joined before the advantages need them, with the same numbers as synchronous scoring (more memory held)."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy's linears."""

    rank: int = option(0, ge=0)
    """Adapter rank; 0 means a full fine-tune."""
    alpha: float = option(1.0, gt=0.0)
    """Adapter scale numerator: the update is (alpha / rank) * B A."""
    targets: Optional[list[str]] = None
    """Module-name suffixes that receive adapters; null = the family's default set (FlowGRPO's for FLUX)."""


@dataclass
class ExpertsConfig:
    """A two-expert policy (Wan2.2-A14B: a high-noise and a low-noise transformer split at the pipeline's
    boundary_ratio; docs/models.md, "Two experts")."""

    train: str = option("both", choices=("both", "high", "low"))
    """Which experts learn: both, or only the high-noise (high) or the low-noise (low) one. The other is frozen (no
    gradients, no optimizer state, its weights kept in the compute dtype; with LoRA its adapters frozen too), and
    of the selected steps only those its partner runs are trained. A one-transformer policy accepts only both."""


@dataclass
class ModelConfig:
    """The policy (FLUX, SD3, Wan or Qwen-Image) and its conditioning models."""

    family: str = option("flux", choices=("flux", "sd3", "wan", "qwen_image"))
    """Policy architecture family."""
    path: Optional[str] = None
    """A diffusers transformer directory or a leangrpo_mcore checkpoint; null builds from `preset` + `arch`."""
    preset: Optional[str] = "tiny"
    """Named architecture preset of the family (e.g. tiny, flux-dev, wan2.1-1.3b) for random init."""
    random_init: bool = False
    """Train a full-size preset (any preset but the tiny ones) from random weights without `path`. Off, a run
    (and leangrpo-eval) without `path` is refused for such a preset: RL fine-tuning starts from pretrained
    weights, and a forgotten `path` would otherwise train noise. The planner reads no weights and never needs it; a benchmark of a full-size
    preset sets it."""
    arch: dict[str, Any] = option(factory=dict)
    """Overrides of the preset's diffusers-style hyper-parameters (e.g. num_layers)."""
    backend: str = option("auto", choices=("auto", "local", "te"))
    """Layer backend: te (Transformer Engine) when it imports and CUDA is available, else local megatron-core."""
    dtype: str = option("float32", choices=("float32", "bfloat16", "float16"))
    """Compute dtype of the policy's forwards and backwards: FSDP2 casts the master weights to it."""
    master_dtype: Optional[str] = option(None, choices=("float32", "bfloat16"))
    """dtype of the master weights (the FSDP2 shards) and of the optimizer state; null = float32."""
    fp8: Optional[str] = option(None, choices=("tensorwise", "mxfp8", "blockwise"))
    """FP8 recipe for TE layers (null = off); needs the te backend: current scaling per tensor (tensorwise), per
    1x128 / 128x128 block (blockwise) or MXFP8 blocks of 32 (mxfp8), all in Transformer Engine 2.9 and later."""
    activation_checkpointing: bool | Literal["auto"] = False
    """Recompute each block's activations in backward. auto: the layout planner decides at launch, with the
    data-parallel degrees (docs/planning.md, "Auto layout"): on only when nothing fits without it."""
    seed: int = option(0, ge=0)
    """Seed of the random initialisation (when no `path` is given)."""
    lora: LoRAConfig = option(factory=LoRAConfig)
    """Adapters (rank 0 = full fine-tune)."""
    experts: ExpertsConfig = option(factory=ExpertsConfig)
    """Which experts of a two-expert policy train."""
    text_encoder: str = option("hashed", choices=("hashed", "diffusers", "precomputed"))
    """Text conditioning provider: hashed (tiny deterministic embedder, not a language model), diffusers, precomputed."""
    text_encoder_path: Optional[str] = None
    """diffusers pipeline directory holding the text encoders, or the precomputed embedding cache."""
    text_max_length: int = option(512, ge=1)
    """Text tokens per prompt of the diffusers and precomputed text encoders (T5 / UMT5: 512; SD3: CLIP's 77 plus
    T5's, FlowGRPO's 77 + 128; Qwen-Image: the most Qwen2.5-VL states kept after the template's prefix, the
    pipeline's max_sequence_length, padding trimmed per step; a precomputed cache must have been written with the
    same length); the hashed CPU encoder always uses 16."""
    vae: str = option("tiny", choices=("tiny", "diffusers"))
    """Latent decoder: tiny random VAE for CPU runs, or diffusers weights from `vae_path`."""
    vae_path: Optional[str] = None
    """diffusers VAE directory (AutoencoderKL for FLUX and SD3, AutoencoderKLWan for Wan, AutoencoderKLQwenImage for
    Qwen-Image)."""
    image_encoder_path: Optional[str] = None
    """The CLIP image encoder of a checkpoint that reads CLIP image tokens beside its conditioning image (Wan2.1-I2V:
    ``image_dim`` in its config), for a run with ``data.images``: a diffusers pipeline directory with
    ``image_encoder/`` and ``image_processor/``, or one directory with a ``CLIPVisionModel`` and its
    ``preprocessor_config.json``. Any other run refuses it."""


@dataclass
class ParallelConfig:
    """Tensor, context and data parallel degrees and the layout of prompt groups."""

    tp: int = option(1, ge=1)
    """Tensor-parallel degree (within a node)."""
    pp: int = option(1, ge=1)
    """Pipeline-parallel degree: the policy's blocks split into pp stages (docs/models.md, "Pipeline
    parallelism"); the pp ranks of a sample count as one data-parallel rank, each holding one stage."""
    cp: int = option(1, ge=1)
    """Context (sequence) parallel degree: the tokens of each sample split over cp ranks, Ulysses attention
    (docs/models.md, "Sequence parallelism"); the cp ranks of a sample count as one data-parallel rank."""
    dp_shard: int | Literal["auto"] = "auto"
    """FSDP2 sharding degree over data-parallel ranks. FSDP2 shards each parameter over dp_shard * cp ranks (the
    cp ranks of a sample hold the same parameters). auto: the layout planner's choice at launch, the fastest
    layout that fits the memory (docs/planning.md, "Auto layout"); with dp_replicate fixed, world size /
    (pp * tp * cp * dp_replicate)."""
    dp_replicate: int | Literal["auto"] = "auto"
    """HSDP replica degree: full copies of the (sharded) parameters, each gradient all-reduced across them. auto:
    the layout planner's choice at launch (with dp_shard fixed, the rest of the world)."""
    memory_budget_gb: Optional[float] = option(None, gt=0.0)
    """Memory per rank, GiB, the layout planner may fill when it resolves the auto keys (dp_shard, dp_replicate,
    reshard_after_forward, model.activation_checkpointing, schedule.name: auto). null: on a GPU the free device
    memory at launch (the least over the ranks), on CPU the host memory over the ranks of a node."""
    timeout_minutes: float = option(30.0, gt=0.0)
    """Timeout of the default process group's collectives: a rank that waits this long for its peers fails
    instead of hanging (torchtitan's and Megatron's default, 30)."""
    layout: str = option("shared", choices=("shared", "conventional"))
    """shared: a prompt's generations spread over ranks (LeanGRPO); conventional: each rank holds whole groups."""
    param_dtype: Optional[str] = option(None, choices=("float32", "bfloat16", "float16"))
    """FSDP2 MixedPrecisionPolicy parameter dtype: the compute dtype, so null (= model.dtype) or equal to it."""
    reduce_dtype: str = option("float32", choices=("float32", "bfloat16"))
    """FSDP2 MixedPrecisionPolicy gradient-reduction dtype."""
    reshard_after_forward: bool | Literal["auto", "rollout"] | None = "auto"
    """FSDP2 gathering of the parameters. true: each block's parameters are gathered for every forward and
    backward and freed after it (least memory). false: every block stays gathered from its first forward of a
    step to the optimizer step, so a step gathers each block once (all denoising steps, micro-batches and
    groups; the most memory). rollout: gathered once per prompt group for its rollout (its no-grad forwards,
    and Retain's and Reweight's trained steps, which run inside it), freed before the group's update, whose
    forwards and backwards regather (Native's recompute, Retain's deferred backward). auto (null too): the
    layout planner's choice at launch, the fastest that fits; Reweight with ranks that train different steps
    (DanceGRPO selection; SDE windows of different prompts) needs false or rollout, true is refused there."""


@dataclass
class ScheduleConfig:
    """Which step schedule computes the update."""

    name: str = option("reweight", choices=("native", "retain", "reweight", "auto"))
    """native (recompute), retain (keep graphs), reweight (immediate backward, rescale), auto (planner decides)."""
    coalesce_sync: bool = False
    """native: one reduce-scatter per update instead of one per backward (the Table-1 ablation)."""
    reweight_accumulate: str = option("per_sample", choices=("per_sample", "affine"))
    """reweight: one provisional gradient per in-flight sample, or the two affine accumulators (exact unless clamped)."""
    micro_batch: int = option(1, ge=1)
    """Samples per policy forward on a rank."""
    provisional_dtype: Optional[str] = option(None, choices=("float32", "bfloat16"))
    """reweight: dtype in which the provisional gradients wait for their advantage; null = parallel.reduce_dtype."""


@dataclass
class OptimConfig:
    """The optimizer and learning-rate schedule."""

    name: str = option("adamw", choices=("adamw", "sgd"))
    """Optimizer; NVIDIA apex's fused AdamW is used when installed."""
    lr: float = option(1e-4, gt=0.0, le=1e3)
    """Peak learning rate (at most 1e3: a larger one overflows AdamW's float32 update within a step)."""
    betas: list[float] = option(factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    eps: float = option(1e-8, gt=0.0)
    """AdamW epsilon."""
    weight_decay: float = option(1e-4, ge=0.0)
    """Decoupled weight decay."""
    momentum: float = option(0.0, ge=0.0, lt=1.0)
    """SGD momentum."""
    max_grad_norm: float = option(1.0, ge=0.0)
    """Global gradient-norm clip (0 disables clipping)."""
    lr_scheduler: str = option("constant", choices=("constant", "linear", "cosine"))
    """Learning-rate decay after warm-up."""
    warmup_steps: int = option(0, ge=0)
    """Linear warm-up steps, in optimizer steps (grpo.updates_per_rollout per training step); the decay ends at
    train.max_steps * grpo.updates_per_rollout of them."""


@dataclass
class TrainConfig:
    """The run."""

    output_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, samples/, tensorboard/."""
    max_steps: int = option(10, ge=0)
    """Training steps to run: each one rollout of grpo.prompts_per_step groups and grpo.updates_per_rollout
    optimizer steps (so max_steps * updates_per_rollout optimizer steps in all)."""
    seed: int = option(0, ge=0)
    """Seed of prompts, initial noise, SDE noise and selected steps (independent of rank and layout)."""
    ema_decay: float = option(0.0, ge=0.0, lt=1.0)
    """EMA of the trainable parameters (0 disables it)."""
    max_nonfinite_skips: int = option(3, ge=0)
    """Consecutive updates skipped for a non-finite loss or gradient before the run stops."""
    allow_config_change: bool = False
    """Resume although the config changes what a training step computes (group size, steps, sampler, schedule,
    prompts per step, reward, prompt data, ...); the changes are logged one per line. Off, such a resume is
    refused (docs/checkpoints.md, "Changing the config on resume")."""
    overwrite: bool = False
    """A fresh run into an output_dir that holds an earlier run's checkpoints or metrics deletes them first
    (otherwise such a directory is refused)."""
    save_on_signal: list[str] = option(factory=lambda: ["TERM", "INT", "USR1"], choices=("TERM", "INT", "USR1"))
    """Signals that make every rank finish the current optimizer step, write a checkpoint of it (synchronously)
    and exit with 128 + the signal number (143 for TERM, 130 for INT, 138 for USR1); [] keeps the default
    actions (docs/checkpoints.md, "Preemption")."""
    step_timeout_minutes: float = option(0.0, ge=0.0)
    """Step watchdog: a rank that spends longer than this in one phase of the training loop (a step's rollout
    and update, a reward call, a checkpoint save, an evaluation) stops the job with one line naming the phase
    and the rank that stalled (exit code 124); fractions allowed, 0 disables it."""


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    save_every: int = option(0, ge=0)
    """Save every N steps (0: only at the end)."""
    resume: Optional[str] = None
    """null (fresh run), auto (the newest checkpoint in output_dir that verifies; damaged newer ones are set aside,
    and when every checkpoint is damaged the run stops instead of training from step 0), fresh_if_damaged (auto,
    except that a run directory whose every checkpoint is damaged starts afresh on purpose, the damaged ones set
    aside), or a checkpoint path."""
    verify: bool = True
    """Check a training checkpoint's COMPLETE marker (every file's size and CRC-32, each rank reading its share)
    before anything reads it: checkpoint.resume, model.path and leangrpo-eval --checkpoint. false skips the check
    on purpose, with one log line (a read error is still one line; altered weights then go unnoticed)."""
    keep_last: int = option(0, ge=0)
    """Keep only the newest N checkpoints (0 keeps all); the one just written is always kept."""
    async_save: bool = False
    """Write checkpoints in a background thread from a host copy of this rank's shards, overlapping the write
    with the next steps (costs one host copy of the rank's shards until the write ends)."""


@dataclass
class WandbConfig:
    """Weights & Biases logging (the ``wandb`` extra): the TensorBoard scalars and the sample grids."""

    project: Optional[str] = None
    """wandb project (null: WANDB_PROJECT, else wandb's default)."""
    entity: Optional[str] = None
    """wandb team or user (null: WANDB_ENTITY, else your default entity)."""
    mode: str = option("online", choices=("online", "offline", "disabled"))
    """online (sync as it runs), offline (files only, no network; `wandb sync` later) or disabled (no wandb)."""


@dataclass
class LoggingConfig:
    """Metrics, samples and progress output."""

    sample_every: int = option(0, ge=0)
    """Write samples/step_<N>.png every N steps (0: only the last step); a video policy (sampler.frames > 1)
    also writes samples/step_<N>.mp4."""
    video_fps: int = option(8, ge=1)
    """Frames per second of the video sample grids (samples/step_<N>.mp4, also logged to wandb)."""
    tensorboard: bool = True
    """Write TensorBoard event files under output_dir/tensorboard."""
    progress_bar: bool = True
    """Show progress on rank 0: on a terminal a step bar and under it a rollout bar (denoising steps × groups);
    otherwise (a log file) one plain line per step (step, reward mean/std, loss, step and phase times)."""
    measure_memory: Optional[bool] = None
    """Measure each step's peak tensor memory (null: on CUDA only; on CPU the meter slows the step down)."""
    peak_tflops: Optional[float] = option(None, gt=0.0)
    """Peak TFLOP/s of one device that the per-step ``mfu`` divides by (null: the dense bf16 peak of a known GPU,
    e.g. 989 on an H100 SXM or H200, 312 on an A100; on a CPU or an unknown GPU no ``mfu`` is logged)."""
    wandb: Optional[WandbConfig] = None
    """Weights & Biases logging, e.g. {project: my-project, mode: offline}; null (the default) = off. The run id is
    kept in output_dir/wandb_run_id, so that a resumed run continues the same wandb run."""


@dataclass
class DataConfig:
    """Prompts, and the conditioning images of image-conditioned runs."""

    prompts: str = "builtin"
    """Prompt source: 'builtin' (a small demo set), a .txt (one per line) / .jsonl ({"prompt": ...}) file, or a
    directory in FlowGRPO's dataset layout: train.txt / test.txt (pickscore, drawbench) or train_metadata.jsonl /
    test_metadata.jsonl (geneval, ocr; a line's other fields are kept as the prompt's metadata). Training reads
    the train split; evaluation defaults to the test split where the directory has one, else these prompts."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (deterministically from train.seed)."""
    images: bool = False
    """Condition every sample on its prompt's image (instruction editing with FLUX.1-Kontext): each row of the
    *_metadata.jsonl split files names one in its 'image' field, a path relative to the file's directory. The
    images are decoded, resized with Lanczos to cover sampler.height x sampler.width and centre-cropped by an NVIDIA
    DALI pipeline (the 'dali' extra), encoded once per prompt group, and reach the rewards that declare
    reference_images (docs/rewards.md). Evaluation reads the test split's images."""


@dataclass
class EvalConfig:
    """Periodic evaluation on fixed held-out prompts with a deterministic sampler (docs/evaluation.md)."""

    every: int = option(0, ge=0)
    """Evaluate every N training steps (0: never during training; leangrpo-eval still works)."""
    before_train: bool = False
    """Also evaluate before the first step (logged as step 0; not repeated when a run resumes)."""
    prompts: Optional[str] = None
    """Prompt file or dataset directory; null = the test split of data.prompts where it has one, else its prompts."""
    num_prompts: Optional[int] = option(None, ge=1)
    """The first N prompts of the eval set (null = all)."""
    samples_per_prompt: int = option(1, ge=1)
    """Generations per eval prompt, each from its own fixed initial noise."""
    num_steps: Optional[int] = option(None, ge=1)
    """Denoising steps of an eval rollout (null = sampler.num_steps)."""
    noise_level: float = option(0.0, ge=0.0)
    """SDE noise of the eval rollout; 0 = the deterministic ODE (Euler on the policy's velocity)."""
    cfg_scale: Optional[float] = option(None, ge=1.0)
    """Classifier-free guidance scale of the eval rollout (null = sampler.cfg_scale)."""
    guidance_scale: Optional[float] = option(None, ge=0.0)
    """Guidance-embedding value of a guidance-distilled policy (null = sampler.guidance_scale)."""
    seed: int = option(0, ge=0)
    """Seed of the eval noise: sample j of eval prompt i starts from noise drawn from (seed, i, j) alone."""
    rewards: Optional[list[dict[str, Any]]] = None
    """Rewards to report, each {name: ..., options: {...}, weights: ..., url: ...} as the reward section;
    null = the training reward."""
    use_ema: Optional[bool] = None
    """Evaluate the EMA weights (null: true when train.ema_decay > 0)."""


@dataclass
class Config:
    """A whole experiment."""

    sampler: SamplerConfig = option(factory=SamplerConfig)
    """Rollout: SDE kind, steps, noise, schedule, guidance, resolution."""
    grpo: GRPOConfig = option(factory=GRPOConfig)
    """GRPO objective and step selection."""
    reward: RewardConfig = option(factory=RewardConfig)
    """Reward function."""
    model: ModelConfig = option(factory=ModelConfig)
    """Policy and conditioning models."""
    parallel: ParallelConfig = option(factory=ParallelConfig)
    """Parallel degrees and layout."""
    schedule: ScheduleConfig = option(factory=ScheduleConfig)
    """Update schedule."""
    optim: OptimConfig = option(factory=OptimConfig)
    """Optimizer."""
    train: TrainConfig = option(factory=TrainConfig)
    """Run length, output and seeds."""
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = option(factory=LoggingConfig)
    """Logging."""
    data: DataConfig = option(factory=DataConfig)
    """Data."""
    eval: EvalConfig = option(factory=EvalConfig)
    """Periodic evaluation."""
