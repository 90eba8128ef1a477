"""transformer-heads' public names under one import path (``headkit.compat``).

``from transformer_heads... import X`` becomes ``from headkit.compat import X`` for every name
its notebooks and tests import; each keeps its signature and, where headkit's own differs in
what it returns (``evaluate_head_wise``), transformer-heads' result. See docs/migrating.md.
"""

from .config import HeadConfig
from .integrations.peft import create_headed_qlora, load_lora_with_heads
from .integrations.transformer_heads import (
    DataCollatorWithPadding,
    HeadedModelGenerateOutput,
    compare_all_params,
    evaluate_head_wise,
    get_model_params,
    get_multi_head_transformer,
    get_some_preds,
    get_top_n_preds,
    load_tokenizer,
    print_trainable_parameters,
    th_parameter_names,
)
from .loading import load_headed
from .model.headed import HeadedModel, HeadedModelOutput

__all__ = [
    "DataCollatorWithPadding",
    "HeadConfig",
    "HeadedModel",
    "HeadedModelGenerateOutput",
    "HeadedModelOutput",
    "compare_all_params",
    "create_headed_qlora",
    "evaluate_head_wise",
    "get_model_params",
    "get_multi_head_transformer",
    "get_some_preds",
    "get_top_n_preds",
    "load_headed",
    "load_lora_with_heads",
    "load_tokenizer",
    "print_trainable_parameters",
    "th_parameter_names",
]
