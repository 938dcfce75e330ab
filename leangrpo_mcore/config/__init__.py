"""Experiment configuration: dataclass sections (``schema``) and the strict YAML loader (``loader``)."""

from leangrpo_mcore.config.loader import (
    COMMAND_LINE,
    ConfigError,
    build_config,
    config_to_yaml,
    dump_config,
    load_config,
    valid_keys,
)
from leangrpo_mcore.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    ExpertsConfig,
    GRPOConfig,
    LoggingConfig,
    LoRAConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RewardConfig,
    SamplerConfig,
    ScheduleConfig,
    TrainConfig,
)

__all__ = [
    "COMMAND_LINE", "ConfigError", "build_config", "config_to_yaml", "dump_config", "load_config", "valid_keys",
    "CheckpointConfig", "Config", "DataConfig", "EvalConfig", "ExpertsConfig", "GRPOConfig", "LoggingConfig",
    "LoRAConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "RewardConfig", "SamplerConfig", "ScheduleConfig", "TrainConfig",
]
