"""zerodp's configuration: typed sections, strict YAML loading, `section.key=value` overrides.

This package imports neither torch nor deepspeed, so the planner (`zerodp plan`) can read a training
config instantly. Its parts: schema (the typed sections, each field documented where it is declared,
and their validation), checks (the batch split and the other checks that other layers share), loading
(YAML, overrides, the Hugging Face config.json merge, what the user set), docs (`zerodp config`'s
text) and sources (what a data.source folder holds). Every name is imported from here.

Layer: above errors, the model specs (zerodp.models, whose Hugging Face config.json reader it uses)
and the strategy catalog (zerodp.strategies.catalog), and nothing else; torch-free. Every other layer
may import it.
"""

from zerodp.config.checks import batch_split, zeropp_refusal, zeropp_settings
from zerodp.config.docs import FieldDoc, field_docs, format_field_docs
from zerodp.config.loading import (
    apply_hf_config,
    dump_yaml,
    from_dict,
    load_config,
    parse_override,
    resolve_model,
    set_and_resolved,
    take_prepared_vocab,
    user_settings,
)
from zerodp.config.schema import (
    _SECTIONS,
    ARCHS,
    DECAY_SHAPES,
    PRECISIONS,
    SCHEDULES,
    STRATEGIES,
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    StrategyConfig,
    TrainConfig,
)
from zerodp.errors import ConfigError, UserError

__all__ = ["_SECTIONS", "ARCHS", "DECAY_SHAPES", "PRECISIONS", "SCHEDULES", "STRATEGIES", "CheckpointConfig", "Config",
           "ConfigError", "DataConfig", "FieldDoc", "ModelConfig", "OptimConfig", "StrategyConfig", "TrainConfig",
           "UserError", "apply_hf_config", "batch_split", "dump_yaml", "field_docs", "format_field_docs", "from_dict",
           "load_config", "parse_override", "resolve_model", "set_and_resolved", "take_prepared_vocab",
           "user_settings", "zeropp_refusal", "zeropp_settings"]
