"""Several processes or devices: the process group as headkit sees it (``ranks``), what DDP
needs (``parallel``), heads placed by ``hf_device_map`` (``placement``) and FSDP2 sharding
(``sharding``). The modules are imported by path; ``headkit.shard`` is the public name."""
