"""The frozen configuration tree, read from TOML.

Every section is a frozen dataclass; `load_config` walks the TOML table against the dataclass
fields and collects EVERY problem (unknown key with a "did you mean", wrong type, out-of-range
value) into one `ConfigError` that names the key path and the fix. A mode is a `Literal[...]`
field, checked by one function (`base.literal_problem`) whether read from TOML or built in code;
range checks live in each section's `problems()`, so a config built in code is checked the same
way.

Layout: `base` (ConfigError, check helpers, `_Section`), one module per group of sections
(`model`, `rollout`, `algorithm` with `algorithm_tables`, `reward`, `training`), and `loader`
(the root `Config`, TOML loading, overrides). Import from `rollouts.config`; the submodules are
an implementation detail.
"""

from __future__ import annotations

from rollouts.config.algorithm import (
    ADVANTAGES,
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AggMode,
    AlgorithmConfig,
)
from rollouts.config.algorithm_tables import (
    PAIR_SELECTORS,
    CispoConfig,
    GAEConfig,
    KLConfig,
    PairwiseConfig,
    ReferenceConfig,
    RejectionMode,
    RolloutCorrectionConfig,
    TruncatedISConfig,
)
from rollouts.config.base import ConfigError
from rollouts.config.data import DataConfig, SourceConfig
from rollouts.config.engine_options import EngineOptions
from rollouts.config.loader import (
    Config,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
)
from rollouts.config.model import (
    LoraConfig,
    ModelConfig,
    ModelSourceName,
    RunSection,
    TinyModelConfig,
    TinyTokenizer,
)
from rollouts.config.reward import (
    LengthShapingConfig,
    ParetoMode,
    RewardConfig,
    RewardScope,
    RewardTransform,
)
from rollouts.config.rollout import (
    EnginesConfig,
    RolloutConfig,
    RolloutMode,
    SamplingConfig,
)
from rollouts.config.training import (
    CheckpointConfig,
    LoggingConfig,
    OptimConfig,
    RLHalves,
    RunMode,
    Scheduler,
    TrainingConfig,
    WandbMode,
)
from rollouts.config.weight_sync import DistributedSyncConfig, WeightSyncConfig

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "PAIR_SELECTORS",
    "POLICY_LOSSES",
    "AggMode",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CispoConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedSyncConfig",
    "EngineOptions",
    "EnginesConfig",
    "GAEConfig",
    "KLConfig",
    "LengthShapingConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ModelSourceName",
    "OptimConfig",
    "PairwiseConfig",
    "ParetoMode",
    "RLHalves",
    "ReferenceConfig",
    "RejectionMode",
    "RewardConfig",
    "RewardScope",
    "RewardTransform",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RolloutMode",
    "RunMode",
    "RunSection",
    "SamplingConfig",
    "Scheduler",
    "SourceConfig",
    "TinyModelConfig",
    "TinyTokenizer",
    "TrainingConfig",
    "TruncatedISConfig",
    "WandbMode",
    "WeightSyncConfig",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "load_config",
]
