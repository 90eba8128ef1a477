"""transformer-heads compatibility: the one edge package that knows that library.

``from transformer_heads... import X`` becomes ``from headkit.compat import X`` for every name
its notebooks and tests import; each keeps its signature and, where headkit's own differs in
what it returns (``evaluate_head_wise``), transformer-heads' result. See docs/migrating.md.

The package adapts to headkit's core and the core never imports it: ``calls.py`` binds its
loaders' call forms (``TH_ORDER``, ``TH_QLORA_ORDER``, ``bind_positional``) onto headkit's
loaders; ``checkpoint.py`` reads its saves as a registered checkpoint format
(``READERS["transformer-heads"]``); ``helpers.py`` holds its helper functions and outputs.
"""

from ..config import HeadConfig
from ..model.headed import HeadedModel, HeadedModelOutput
from .calls import create_headed_qlora, load_headed, load_lora_with_heads
from .helpers import (
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
