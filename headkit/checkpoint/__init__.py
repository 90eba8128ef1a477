"""Checkpoints: ``head_configs.json`` + safetensors, written atomically, read without pickle.

Layout of a checkpoint directory::

    head_configs.json              the manifest (format version, head configs, file names)
    heads-<token>.safetensors      head and loss-weighting tensors
    backbone-<token>/              the backbone (config.json + *.safetensors), only when it
                                   was trained, modified, or has no loadable source

``save_checkpoint`` writes one (``save.py``) holding the folder's lock (``lock.py``) and
deleting only what it wrote (``journal.py``); ``restore`` is the one way to read one back
(``restore.py``); ``read_manifest`` validates the manifest (``manifest.py``); ``paths.py``
keeps names plain and files inside the folder; ``sizes.py`` is the size guard. See
docs/checkpoints.md.
"""

import os  # noqa: F401  (tests patch headkit.checkpoint.os.replace to simulate crashes)

from .manifest import MANIFEST
from .restore import load_head_weights, read_checkpoint, restore
from .save import save_checkpoint

__all__ = ["MANIFEST", "load_head_weights", "read_checkpoint", "restore", "save_checkpoint"]
