"""The stability recipe: a versioned, self-documenting schema for one training run.

Every section is a pydantic model with ``extra="forbid"``; the docstring under each field is its description
(and shows up in the JSON Schema that editors use). One module per group of sections; ``loading`` turns text
into a ``Recipe``; ``imports`` is the one allow-list rule for ``module:function`` strings.
"""

from contracts.recipe.base import API_VERSION, DEFAULT_MAX_RECIPE_BYTES, KIND, Section
from contracts.recipe.code import Code
from contracts.recipe.data import (
    CustomData,
    DatasetData,
    DataSpec,
    MarkovData,
    RegressionData,
    SequenceData,
    SequenceTask,
    TokenDType,
    TokensFileData,
)
from contracts.recipe.detectors import (
    Action,
    Detectors,
    GradNormSpikeDetector,
    LossSpikeDetector,
    NonFiniteDetector,
    OscillationDetector,
    StagnationDetector,
    VanishingDetector,
)
from contracts.recipe.document import CrossFieldErrors, Recipe
from contracts.recipe.faults import (
    BatchScaleFault,
    CorruptCheckpointFault,
    Fault,
    GradScaleFault,
    HangFault,
    KillWorkerFault,
    NanLossFault,
)
from contracts.recipe.imports import admitted_modules, check_import_string, module_allowed, named_modules
from contracts.recipe.loading import (
    FieldError,
    RecipeError,
    dump_recipe,
    load_recipe,
    parse_yaml,
    recipe_json_schema,
    recipe_to_dict,
    validate_recipe_data,
)
from contracts.recipe.loss import CrossEntropyLoss, CustomLoss, LossSpec, ModelLoss, MSELoss
from contracts.recipe.model import (
    BUILTIN_MODELS,
    Activation,
    CustomModel,
    DeepMLPModel,
    HFCausalLMModel,
    LinearModel,
    ModelSpec,
    NormPosition,
    RecurrentCell,
    RecurrentModel,
    TinyGPTModel,
)
from contracts.recipe.operations import (
    Checkpoint,
    Compression,
    Distributed,
    Exporter,
    LoRA,
    LrProbe,
    ProbeMode,
    Recovery,
    RecoveryStrategy,
    Resources,
    Strategy,
    Telemetry,
    TightenOrder,
)
from contracts.recipe.success import Success
from contracts.recipe.training import (
    MAX_LR,
    SCHEDULE_PRESETS,
    ClipMethod,
    Clipping,
    Decay,
    DType,
    LossScaling,
    NoDecay,
    Optimizer,
    OptimizerName,
    Precision,
    Schedule,
    SchedulePreset,
    Training,
)

__all__ = [
    "BUILTIN_MODELS", "CrossEntropyLoss", "CustomLoss", "DatasetData", "HFCausalLMModel", "LoRA", "LossSpec", "MSELoss",
    "ModelLoss", "NoDecay", "TokenDType", "TokensFileData",
    "API_VERSION", "DEFAULT_MAX_RECIPE_BYTES", "KIND", "SCHEDULE_PRESETS", "Action", "Activation", "BatchScaleFault",
    "Checkpoint", "ClipMethod", "Clipping", "Code", "Compression", "CorruptCheckpointFault", "CrossFieldErrors",
    "CustomData", "CustomModel", "DType", "DataSpec", "Decay", "DeepMLPModel", "Detectors", "Distributed",
    "Exporter", "Fault", "FieldError", "GradNormSpikeDetector", "GradScaleFault", "HangFault", "KillWorkerFault",
    "LinearModel",
    "LossScaling",
    "LossSpikeDetector", "LrProbe", "MarkovData", "ModelSpec", "NanLossFault", "NonFiniteDetector", "NormPosition",
    "MAX_LR", "Optimizer", "OptimizerName", "OscillationDetector", "Precision", "ProbeMode", "Recipe", "RecipeError",
    "Recovery",
    "RecoveryStrategy",
    "RecurrentCell",
    "RecurrentModel", "RegressionData", "Resources", "Schedule", "SchedulePreset", "Section", "SequenceData",
    "SequenceTask", "StagnationDetector", "Strategy", "Success", "Telemetry", "TightenOrder", "TinyGPTModel",
    "Training",
    "VanishingDetector", "admitted_modules", "check_import_string", "dump_recipe", "load_recipe", "module_allowed",
    "named_modules", "parse_yaml", "recipe_json_schema", "recipe_to_dict", "validate_recipe_data",
]
