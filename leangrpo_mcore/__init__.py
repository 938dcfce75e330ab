"""leangrpo_mcore: recompute-free GRPO for diffusion policies (FLUX, Wan) on megatron-core and FSDP2."""

import warnings

# megatron-core announces at import that it falls back to torch when TE / apex are absent (the normal case on
# CPU machines; its norms say it again when the first pipeline schedule imports them) and warns about one of its
# own defaults; neither concerns users of this package.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed",
                        category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)

__version__ = "0.1.0"
