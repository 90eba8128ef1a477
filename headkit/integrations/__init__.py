"""headkit with other libraries: HF Trainer (``trainer``), peft (``peft``),
sentence-transformers (``sentence_transformers``), transformer-heads (``transformer_heads``).

Importing this package imports none of them: each module is imported when used.
"""
