"""Tiny random reward models of the real classes, for tests (:mod:`leangrpo_mcore.rl.rewards.tiny_clip`)."""

from leangrpo_mcore.rl.rewards.tiny_clip import (  # noqa: F401 -- the tests' names
    CONTEXT,
    IMAGE,
    LAYERS,
    OPENAI_MEAN,
    OPENAI_STD,
    PATCH,
    PROJ,
    WIDTH,
    write_tiny_clip_dir,
)
