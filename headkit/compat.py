"""transformer-heads' helpers under the import path its users know (``headkit.compat``)."""

from .integrations.transformer_heads import (
    get_model_params,
    get_top_n_preds,
    print_trainable_parameters,
)

__all__ = ["get_model_params", "get_top_n_preds", "print_trainable_parameters"]
