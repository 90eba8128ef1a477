"""Layer sweeps: one linear probe per layer on cached features (``probe_layers``)."""

from .results import ProbeResults, ProbeRow
from .sweep import parse_layers, probe_layers

__all__ = ["ProbeResults", "ProbeRow", "parse_layers", "probe_layers"]
