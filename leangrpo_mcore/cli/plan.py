"""`leangrpo-plan`: plan the schedule, PP/TP/CP/FSDP/HSDP degrees and prompt-group placement for a cluster.

    leangrpo-plan --model flux-dev --nodes 4 --gpus-per-node 8 --gpu-mem-gb 80 --resolution 720 --json
    leangrpo-plan --config yaml_configs/flux_dev/dancegrpo.yaml grpo.group_size=16 --gpus-per-node 8 --gpu-mem-gb 48
    leangrpo-plan --config yaml_configs/bench/flux_flowgrpo.yaml --schedule config --hardware cpu \
        --gpus-per-node 2 --gpu-mem-gb 11

The plan ends with one line of overrides (``schedule.name=… parallel.tp=… … model.activation_checkpointing=…``)
that runs the chosen layout; ``--json`` carries it as ``overrides``.

Exit codes: 0 a plan, 1 nothing fits (the candidates and the reason are still printed), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from typing import TYPE_CHECKING, Optional, Sequence

from leangrpo_mcore.cli.common import add_version_flag, run_main
from leangrpo_mcore.errors import UserError
from leangrpo_mcore.planner.arch_specs import BUILTIN_PRESETS, DEFAULT_LORA_TARGETS, IMAGE_CONDITIONED, load_arch
from leangrpo_mcore.planner.workload import (HARDWARE_KINDS, PRECISIONS, SCHEDULES, GiB, Hardware, Workload,
                                             hardware_preset)
from leangrpo_mcore.planner.config_workload import expert_trained_steps
from leangrpo_mcore.planner.layout import (DEFAULT_TEXT_TOKENS, Plan, config_schedules, describe_layout, plan,
                                           workload_from_config)
from leangrpo_mcore.planner.simulate_plan import DEFAULT_SHIFT, SIGMA_SCHEDULE

if TYPE_CHECKING:
    from leangrpo_mcore.config import Config

# Flags that a YAML config sets itself: with --config they come from it (use dotted overrides instead).
WORKLOAD_FLAGS = ("resolution", "frames", "num_steps", "selected_steps", "group_size", "prompts_per_step",
                  "micro_batch", "lora_rank", "precision", "activation_checkpointing", "kl_beta", "cfg_scale", "cp", "pp",
                  "reshard_after_forward", "image_conditioning", "experts_train")
RESHARD_FLAG = {"auto": "auto", "true": True, "false": False, "rollout": "rollout"}
# FLUX.1-dev is guidance-distilled; Wan samples with CFG 5, SD3.5-M with FlowGRPO's 4.5, Qwen-Image with true CFG 4
DEFAULT_CFG_SCALE = {"flux": 1.0, "sd3": 4.5, "wan": 5.0, "qwen_image": 4.0}
MAX_TABLE_RANKS = 64


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``leangrpo-plan`` (experiment and hardware flags)."""
    p = argparse.ArgumentParser(prog="leangrpo-plan", description="Plan the schedule, PP/TP/CP/FSDP/HSDP degrees and "
                                "prompt-group placement of a run; exit 1 when nothing fits, 2 on bad input.")
    p.add_argument("--model", help=f"{', '.join(BUILTIN_PRESETS)}, a diffusers transformer config.json / directory, "
                                   "a leangrpo checkpoint, or a YAML experiment config")
    p.add_argument("--config", help="YAML experiment config, planned as written")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of --config")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per node")
    p.add_argument("--gpu-mem-gb", type=float, required=True, help="memory per GPU, GiB")
    p.add_argument("--resolution", help="pixels: 512 or HEIGHTxWIDTH (default 512)")
    p.add_argument("--frames", type=int, help="video frames in pixel space (default 1)")
    p.add_argument("--image-conditioning", choices=("on", "off"),
                   help="a conditioning image per sample (FLUX.1-Kontext: its tokens join the generated ones; Wan2.2-TI2V: "
                        "it takes the first latent frame; a channel-concatenated Wan I2V checkpoint always reads one "
                        f"through its channels); default on for {', '.join(sorted(IMAGE_CONDITIONED))}, off otherwise")
    p.add_argument("--num-steps", type=int, help="denoising steps T (default 16)")
    p.add_argument("--selected-steps", type=int, help="trained steps |S| per sample (default T-1)")
    p.add_argument("--group-size", type=int, help="generations per prompt M (default 8)")
    p.add_argument("--prompts-per-step", type=int, help="prompt groups per optimizer step (default GPUs / M, >= 1)")
    p.add_argument("--micro-batch", type=int, help="samples per forward (default 1)")
    p.add_argument("--lora-rank", type=int, help="LoRA rank, 0 = full fine-tune (default 0)")
    p.add_argument("--precision", choices=("bf16", "fp8"), help="compute precision (default bf16)")
    p.add_argument("--activation-checkpointing", nargs="?", const="on", choices=("on", "off", "auto"),
                   help="per-block activation checkpointing; alone means on (default auto: the planner decides)")
    p.add_argument("--reshard-after-forward", choices=tuple(RESHARD_FLAG),
                   help="FSDP2 gathering as parallel.reshard_after_forward: true (every forward), rollout (once per "
                        "rollout), false (once per step); default auto: the planner decides")
    p.add_argument("--experts-train", choices=("both", "high", "low"),
                   help="two-expert models (wan2.2-t2v-a14b): which experts learn, as model.experts.train (default "
                        "both); of the --selected-steps (the first ones) those the trained expert runs train, on the "
                        "Wan schedule at shift 3")
    p.add_argument("--kl-beta", type=float, help="KL coefficient (default 0)")
    p.add_argument("--cfg-scale", type=float, help="classifier-free guidance (> 1 doubles every forward; "
                                                   "default 1 for FLUX, 4.5 for SD3, 5 for Wan, 4 for Qwen-Image)")
    p.add_argument("--cp", type=int, help="context-parallel degree: each sample's tokens split over N GPUs of a node "
                                         "(must divide the GPUs per node and the attention heads; default: the "
                                         "planner tries every degree)")
    p.add_argument("--pp", type=int, help="pipeline-parallel degree: the blocks split over N stages, pp outermost "
                                         "(stages of whole nodes or of a divisor of a node; default: the planner "
                                         "tries every degree)")
    p.add_argument("--text-tokens", type=int, help=f"text-encoder tokens per prompt (default {DEFAULT_TEXT_TOKENS}; "
                                                   "a YAML config's hashed text embedder: 16)")
    p.add_argument("--schedule", default="all", choices=("all", "config", *SCHEDULES),
                   help="schedules to plan: all (default), one of them, or config: what the trainer resolves for a "
                        "YAML config (its schedule.name; every schedule for auto)")
    p.add_argument("--hardware", default="gpu", choices=HARDWARE_KINDS,
                   help="rate defaults: gpu (an A100-class GPU) or cpu (single-threaded gloo ranks on a host, as the "
                        "trainer plans a CPU run); the flags below override them")
    hardware = (("--intra-node-gbps", None, "collective bandwidth per GPU in a node, GB/s (gpu: 150)"),
                ("--inter-node-gbps", None, "collective bandwidth per GPU across nodes, GB/s (gpu: 25)"),
                ("--gpu-tflops", None, "dense bf16 TFLOP/s per GPU (gpu: 312)"),
                ("--efficiency", None, "fraction of the peak TFLOP/s reached (gpu: 0.4)"),
                ("--hbm-gbps", None, "GPU memory bandwidth, GB/s (gpu: 1500)"),
                ("--overhead-gb", None, "per-GPU memory outside tensors (CUDA context, NCCL, allocator), GiB "
                                        "(gpu: 1.5)"),
                ("--reward-seconds", 0.0, "reward time per generation, s"),
                ("--reward-mem-gb", 0.0, "memory reserved per GPU for a reward model the planner does not derive "
                                         "(a plugin's; a YAML config's built-in learned reward is derived), GiB"),
                ("--decode-mem-gb", 0.0, "transient memory of VAE decode + reward scoring of a micro-batch, GiB"))
    for flag, default, text in hardware:
        p.add_argument(flag, type=float, default=default,
                       help=text if default is None else f"{text} (default: {default})")
    p.add_argument("--top", type=int, default=0, help="table: show only the N best candidates (0 = all)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (every candidate)")
    p.add_argument("--simulate", nargs="?", const="chosen", choices=("chosen", "all"),
                   help="also run the step of the chosen candidate (all: of the best candidate of each schedule) "
                        "under fake tensors on this CPU, one rank at the planned world size, and report its "
                        "simulated peak memory next to the predicted one (minutes per candidate)")
    return add_version_flag(p)


def _resolution(text: Optional[str]) -> tuple[int, int]:
    text = text or "512"
    try:
        parts = [int(v) for v in text.lower().split("x")]
    except ValueError:
        raise UserError(f"--resolution must be N or HEIGHTxWIDTH, got {text!r}") from None
    if len(parts) not in (1, 2):
        raise UserError(f"--resolution must be N or HEIGHTxWIDTH, got {text!r}")
    return parts[0], parts[-1]


def _pick(value, default):
    return default if value is None else value


def workload_from_args(args: argparse.Namespace, world_size: int) -> Workload:
    """The experiment described by the command-line flags (defaults as in ``--help``)."""
    arch = load_arch(args.model)
    height, width = _resolution(args.resolution)
    conditioned = _pick(args.image_conditioning, "on" if args.model in IMAGE_CONDITIONED else "off") == "on"
    tokens = arch.tokens(height, width, _pick(args.frames, 1), _pick(args.text_tokens, DEFAULT_TEXT_TOKENS),
                         reference=conditioned)
    steps = _pick(args.num_steps, 16)
    group = _pick(args.group_size, 8)
    selected, train = _pick(args.selected_steps, max(steps - 1, 1)), _pick(args.experts_train, "both")
    if train != "both" and arch.experts > 1:  # the trained expert's share of the selected steps
        selected = expert_trained_steps(arch, train, SIGMA_SCHEDULE[arch.family], steps, DEFAULT_SHIFT, "flow_grpo",
                                        selected)
    ac = {"on": True, "off": False, "auto": None}[_pick(args.activation_checkpointing, "auto")]
    return Workload(
        arch=arch, tokens=tokens, num_steps=steps, selected_steps=selected,
        group_size=group, prompts_per_step=_pick(args.prompts_per_step, max(1, world_size // group)),
        micro_batch=_pick(args.micro_batch, 1), lora_rank=_pick(args.lora_rank, 0),
        lora_targets=DEFAULT_LORA_TARGETS[arch.family], precision=PRECISIONS[_pick(args.precision, "bf16")],
        activation_checkpointing=ac, kl_beta=_pick(args.kl_beta, 0.0),
        reshard_after_forward=RESHARD_FLAG[_pick(args.reshard_after_forward, "auto")],
        cfg=_pick(args.cfg_scale, DEFAULT_CFG_SCALE[arch.family]) > 1.0, reward_seconds=args.reward_seconds,
        reward_mem_bytes=int(args.reward_mem_gb * GiB), decode_bytes=int(args.decode_mem_gb * GiB),
        experts_train=train)


def _config_workload(args: argparse.Namespace, path: str) -> tuple[Workload, dict]:
    """The workload of a YAML config and the degrees it fixes (and with ``--schedule config`` its schedules)."""
    given = [f"--{name.replace('_', '-')}" for name in WORKLOAD_FLAGS if getattr(args, name) is not None]
    if given:
        raise UserError(f"{given[0]} cannot be combined with a YAML config: use a dotted override instead")
    from leangrpo_mcore.config import load_config

    config = load_config(path, args.overrides)
    fixed = {"tp": config.parallel.tp, "cp": config.parallel.cp, "pp": config.parallel.pp}
    for key in ("dp_shard", "dp_replicate"):
        if getattr(config.parallel, key) != "auto":
            fixed[key] = int(getattr(config.parallel, key))
    if args.schedule == "config":
        fixed["schedules"] = config_schedules(config)
    work = workload_from_config(config, text_tokens=args.text_tokens, reward_seconds=args.reward_seconds,
                                reward_mem_gb=args.reward_mem_gb, decode_bytes=int(args.decode_mem_gb * GiB))
    return work, fixed


def check_numbers(args: argparse.Namespace) -> None:
    """UserError for a numeric flag that is negative, inf or nan (argparse's ``float`` accepts all three)."""
    for dest, value in vars(args).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        flag = "--" + dest.replace("_", "-")
        if not math.isfinite(value):
            raise UserError(f"{flag} must be a finite number, got {value}")
        if value < 0:
            raise UserError(f"{flag} must be >= 0, got {value}")


def plan_config(args: argparse.Namespace, work: Workload) -> "Config":
    """The experiment config the plan is for: the YAML config as written, or the one the flags describe."""
    from leangrpo_mcore.config import load_config
    from leangrpo_mcore.planner.simulate_plan import flags_config

    path = args.config or (args.model if args.model and args.model.endswith((".yaml", ".yml")) else None)
    if path:
        return load_config(path, args.overrides)
    height, width = _resolution(args.resolution)
    cfg_scale = _pick(args.cfg_scale, DEFAULT_CFG_SCALE[work.arch.family])
    return flags_config(work, height=height, width=width, frames=_pick(args.frames, 1), cfg_scale=cfg_scale)


def make_plan(args: argparse.Namespace) -> Plan:
    """Hardware and workload from ``args``, then :func:`leangrpo_mcore.planner.layout.plan`."""
    check_numbers(args)
    rates = hardware_preset(args.hardware)
    flags = {"gpu_tflops": args.gpu_tflops, "efficiency": args.efficiency, "intra_node_gbps": args.intra_node_gbps,
             "inter_node_gbps": args.inter_node_gbps, "hbm_gbps": args.hbm_gbps,
             "overhead_bytes": None if args.overhead_gb is None else int(args.overhead_gb * GiB)}
    rates.update({key: value for key, value in flags.items() if value is not None})
    hw = Hardware(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_mem_bytes=int(args.gpu_mem_gb * GiB),
                  **rates)
    path = args.config or (args.model if args.model and args.model.endswith((".yaml", ".yml")) else None)
    if (args.config is None) == (args.model is None):
        raise UserError("give exactly one of --model and --config")
    if path is None and args.overrides:
        raise UserError(f"override {args.overrides[0]!r} needs --config")
    if args.schedule == "config" and not path:
        raise UserError("--schedule config needs --config")
    work, fixed = _config_workload(args, path) if path else (workload_from_args(args, hw.world_size),
                                                             {"cp": args.cp, "pp": args.pp})
    if args.schedule in SCHEDULES:
        fixed["schedules"] = (args.schedule,)
    return plan(work, hw, **fixed)


def render(result: Plan, top: int = 0) -> str:
    """The human-readable plan: decision, reason, candidate table (``top`` best, 0 = all), placement."""
    w = result.workload
    reference = w.tokens.get("reference", 0)
    conditioned = f" (of which {reference} of the conditioning image)" if reference else ""
    lines = [f"model {w.arch.name}: {w.tokens['image']} image/video{conditioned} + {w.tokens['text']} text tokens, "
             f"T={w.num_steps}, "
             f"|S|={w.selected_steps}, M={w.group_size}, {w.prompts_per_step} prompt(s)/step, "
             f"{'LoRA r=%d' % w.lora_rank if w.lora_rank else 'full fine-tune'}, {w.precision.name}"
             f"{', CFG' if w.cfg else ''}; {result.hardware.nodes} node(s) x {result.hardware.gpus_per_node} GPUs"]
    if w.reward_model:
        lines.append(f"reward model {w.reward_model} on the scoring ranks (CP rank 0 of the last stage): "
                     f"{w.reward_model_bytes / GiB:.1f} GiB resident + {w.reward_activation_bytes / GiB:.2f} GiB "
                     f"activations while scoring")
    lines.append("")
    head = f"schedule: {result.schedule}" if result.ok else "schedule: none (nothing fits)"
    lines += [head] + textwrap.wrap(result.reason, 110, initial_indent="  ", subsequent_indent="  ") + [""]
    lines.append(f"{'schedule':9}{'pp':>3}{'tp':>3}{'cp':>3}{'shard':>6}{'repl':>5}{'gather':>8}{'Q':>4}{'P':>4}"
                 f"{'ckpt':>5}"
                 f"{'peak GiB':>10}{'fits':>6}{'step s':>9}  {'rollout':>8}{'recomp':>8}{'backward':>9}{'comm':>8}"
                 f"{'bubble':>7}{'other':>7}")
    shown = result.candidates[:top] if top > 0 else result.candidates
    for c in shown:
        degrees = (f"{c.schedule:9}{c.layout.pp:>3}{c.layout.tp:>3}{c.layout.cp:>3}{c.layout.dp_shard:>6}"
                   f"{c.layout.dp_replicate:>5}{c.gather_mode if c.layout.fsdp else '-':>8}")
        if not c.feasible:
            lines.append(f"{degrees}  -- {c.note}")
            continue
        t = c.time
        comm = t["fsdp_all_gather"] + t["tp_all_reduce"] + t["cp_all_to_all"] + t["grad_sync"] + t["p2p"]
        other = t["grad_buffers"] + t["optimizer"] + t["reward"] + t["reference_forward"]
        lines.append(f"{degrees}"
                     f"{c.shape.generations_per_rank:>4}{c.shape.worker_groups:>4}"
                     f"{'on' if c.activation_checkpointing else 'off':>5}{c.peak_mem_bytes / GiB:>10.1f}"
                     f"{'yes' if c.fits else 'no':>6}{c.step_time_s:>9.1f}  {t['rollout']:>8.1f}{t['recompute']:>8.1f}"
                     f"{t['backward']:>9.1f}{comm:>8.1f}{t['pipeline_bubble']:>7.1f}{other:>7.1f}")
    if len(shown) < len(result.candidates):
        lines.append(f"... {len(result.candidates) - len(shown)} more (--top 0 shows all)")
    if result.ok:
        lines += ["", f"run it with: {result.overrides}"]
    if result.placement is not None:
        pl = result.placement
        lines += ["", f"placement ({describe_layout(result.chosen, w)}; TP groups in a node: "
                      f"{'yes' if pl.tp_groups_intra_node else 'no'}; reward all-gather in a node: "
                      f"{'yes' if pl.group_gather_intra_node else 'no, spans %d nodes' % pl.group_gather_nodes})",
                  f"{'rank':>5}{'node':>5}{'local':>6}{'pp':>4}{'tp':>4}{'cp':>4}{'dp':>4}{'shard':>6}{'repl':>5}"
                  f"{'group':>6}  generations / prompt slots"]
        for r in pl.ranks[:MAX_TABLE_RANKS]:
            lines.append(f"{r.rank:>5}{r.node:>5}{r.local_rank:>6}{r.pp_rank:>4}{r.tp_rank:>4}{r.cp_rank:>4}{r.dp_rank:>4}"
                         f"{r.dp_shard:>6}{r.dp_replicate:>5}{r.worker_group:>6}  "
                         f"{list(r.generations)} / {list(r.prompt_slots)}")
        if len(pl.ranks) > MAX_TABLE_RANKS:
            lines.append(f"... {len(pl.ranks) - MAX_TABLE_RANKS} more ranks (--json lists all)")
    return "\n".join(lines)


def render_simulations(result: Plan, sims: dict[int, dict]) -> str:
    """The simulated peaks against the predicted ones, one line per simulated candidate."""
    lines = ["", "", "simulated (one rank's real step under fake tensors; reserved memory added as predicted):",
             f"{'schedule':9}{'pp':>3}{'tp':>3}{'cp':>3}{'shard':>6}{'repl':>5}{'ckpt':>5}{'predicted GiB':>15}"
             f"{'simulated GiB':>15}"
             f"{'ratio':>7}{'sim s':>7}  biggest simulated terms"]
    for index, sim in sims.items():
        c = result.candidates[index]
        terms = sorted(sim["simulated_breakdown"].items(), key=lambda kv: -kv[1])[:3]
        shown = ", ".join(f"{k} {v / GiB:.1f}" for k, v in terms if v)
        lines.append(f"{c.schedule:9}{c.layout.pp:>3}{c.layout.tp:>3}{c.layout.cp:>3}{c.layout.dp_shard:>6}"
                     f"{c.layout.dp_replicate:>5}{'on' if c.activation_checkpointing else 'off':>5}{c.peak_mem_bytes / GiB:>15.1f}"
                     f"{sim['simulated_peak_bytes'] / GiB:>15.1f}{sim['simulated_over_predicted']:>7.2f}"
                     f"{sim['simulated_seconds']:>7.0f}  {shown}")
    return "\n".join(lines)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    result = make_plan(args)
    sims: dict[int, dict] = {}
    if args.simulate:
        from leangrpo_mcore.planner.simulate_plan import simulate_plan

        sims = simulate_plan(result, plan_config(args, result.workload), args.simulate,
                             progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        data = result.to_dict()
        for index, sim in sims.items():
            data["candidates"][index].update(sim)
            if result.chosen is result.candidates[index]:
                data["chosen"].update(sim)
        print(json.dumps(data, indent=1))
    else:
        print(render(result, args.top) + (render_simulations(result, sims) if sims else ""))
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``leangrpo-plan``."""
    return run_main(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
