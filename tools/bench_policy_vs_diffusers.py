"""Our FLUX / Wan policies against diffusers' models on the same weights: forward, forward+backward, rollout.

  python tools/bench_policy_vs_diffusers.py --family flux --repeats 7
  python tools/bench_policy_vs_diffusers.py --family wan --repeats 7
  python tools/bench_policy_vs_diffusers.py --family flux --megatron-linears   # megatron's autograd linears
  python tools/bench_policy_vs_diffusers.py --family flux --clock process       # CPU time: for a busy machine

Both models are built from one diffusers checkpoint (random weights, written to a temporary folder), in fp32 on
the CPU, one intra-op thread, under the training setup (a one-rank process group and megatron's parallel state
at TP=1, as ``leangrpo-train`` has them). Runs are interleaved (ours, theirs, ours, ...) so that drift of the
machine hits both alike; the report gives the median time of each and their ratio (ours / diffusers; below 1 is
faster). ``--megatron-linears`` routes our linears through megatron-core's linear autograd function even at TP=1
(matmul, separate bias add and bias-gradient sum), the path the TP=1 fast path replaces.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ARCH = {
    "flux": {"preset": "flux-tiny", "num_layers": 2, "num_single_layers": 4, "num_attention_heads": 4,
             "attention_head_dim": 64, "joint_attention_dim": 512, "pooled_projection_dim": 256,
             "in_channels": 64, "axes_dims_rope": [16, 24, 24]},
    "wan": {"preset": "tiny", "num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 64,
            "ffn_dim": 1024, "text_dim": 512, "freq_dim": 256},
}


def _setup() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)


def _models(family: str, megatron_linears: bool):
    from leangrpo_mcore.models import build_policy, get_family, load_policy
    from leangrpo_mcore.models.common import checkpoint as ckpt

    fam = get_family(family)
    source = build_policy({"family": family, **ARCH[family]}, seed=0, backend="local")
    with tempfile.TemporaryDirectory() as folder:
        tensors = fam.mcore_to_diffusers({n: p.detach() for n, p in source.named_parameters()}, source.config)
        ckpt.write_diffusers_dir(folder, class_name=fam.diffusers_class_name,
                                 config=source.config.to_diffusers_config(), tensors=tensors)
        import diffusers

        theirs = getattr(diffusers, fam.diffusers_class_name).from_pretrained(folder)
        ours = load_policy(folder, backend="local")
    if megatron_linears:
        for module in ours.modules():
            if hasattr(module, "tp_alone"):
                module.tp_alone = False
    return ours, theirs


def _inputs(family: str, config) -> tuple[dict, dict]:
    """(our kwargs, diffusers' kwargs) of one batch of two samples."""
    gen = torch.Generator().manual_seed(0)
    hyper = config.to_diffusers_config()
    if family == "flux":
        img, txt = 256, 64
        ids = torch.stack([torch.zeros(img), torch.arange(img) // 16, torch.arange(img) % 16], dim=1)
        kw = dict(hidden_states=torch.randn(2, img, hyper["in_channels"], generator=gen),
                  encoder_hidden_states=torch.randn(2, txt, hyper["joint_attention_dim"], generator=gen),
                  pooled_projections=torch.randn(2, hyper["pooled_projection_dim"], generator=gen),
                  timestep=torch.tensor([0.6, 0.3]), img_ids=ids, txt_ids=torch.zeros(txt, 3))
        if hyper.get("guidance_embeds"):
            kw["guidance"] = torch.tensor([3.5, 3.5])
        return kw, dict(kw)
    kw = dict(hidden_states=torch.randn(2, hyper["in_channels"], 3, 16, 16, generator=gen),
              encoder_hidden_states=torch.randn(2, 64, hyper["text_dim"], generator=gen),
              timestep=torch.tensor([600.0, 300.0]))
    return kw, dict(kw)


def _output(model, kwargs: dict, diffusers_model: bool) -> torch.Tensor:
    out = model(**kwargs, return_dict=False)[0] if diffusers_model else model(**kwargs)
    return out[0] if isinstance(out, tuple) else out


CLOCKS = {"wall": time.perf_counter, "process": time.process_time}
"""``process`` counts this process's CPU time only: on a shared machine it is far less disturbed by other jobs
than wall time (one intra-op thread, so CPU time is the work done)."""


def _time(fn, clock) -> float:
    began = clock()
    fn()
    return clock() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(ARCH), default="flux")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rollout-steps", type=int, default=6)
    parser.add_argument("--megatron-linears", action="store_true")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = parser.parse_args()
    if args.repeats < 1:
        print("error: --repeats must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    _setup()
    ours, theirs = _models(args.family, args.megatron_linears)
    mine_kw, their_kw = _inputs(args.family, ours.config)

    def forward(model, kw, is_diffusers):
        with torch.no_grad():
            _output(model, kw, is_diffusers)

    def forward_backward(model, kw, is_diffusers):
        model.zero_grad(set_to_none=True)
        _output(model, kw, is_diffusers).float().square().mean().backward()

    def rollout(model, kw, is_diffusers):
        with torch.no_grad():
            for _ in range(args.rollout_steps):
                _output(model, kw, is_diffusers)

    rows = []
    for name, work in (("forward", forward), ("forward+backward", forward_backward),
                       (f"rollout ({args.rollout_steps} forwards)", rollout)):
        work(ours, mine_kw, False), work(theirs, their_kw, True)  # warm-up
        mine, theirs_t = [], []
        for _ in range(args.repeats):
            mine.append(_time(lambda: work(ours, mine_kw, False), CLOCKS[args.clock]))
            theirs_t.append(_time(lambda: work(theirs, their_kw, True), CLOCKS[args.clock]))
        a, b = statistics.median(mine), statistics.median(theirs_t)
        rows.append((name, a, b))
    params = sum(p.numel() for p in ours.parameters())
    path = "megatron-core linear autograd at TP=1" if args.megatron_linears else "TP=1 fast path (F.linear)"
    print(f"{args.family}: {params / 1e6:.1f} M parameters, fp32, 1 thread, {args.repeats} interleaved repeats, "
          f"{args.clock} clock, "
          f"our linears: {path}")
    print("| work | ours (median s) | diffusers (median s) | ours / diffusers |")
    print("|---|---|---|---|")
    for name, a, b in rows:
        print(f"| {name} | {a:.4f} | {b:.4f} | {a / b:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
