"""leangrpo_mcore: recompute-free GRPO for diffusion policies (FLUX, Wan) on megatron-core and FSDP2."""

from leangrpo_mcore.compat import quiet_dependency_noise

# megatron-core and torch print a few warnings about their own internals and defaults at import and at first use
# (each listed, with the reason it is harmless, in compat.NOISE); the filters are narrowed to those messages.
quiet_dependency_noise()

__version__ = "0.1.0"
