"""Generation with heads: ``generate`` on a thin driver (``generate.py``), what each step
records (``recording``), encoder–decoder models (``seq2seq``) and the size caps checked
before anything is allocated (``budget``). ``HeadedModel.generate`` comes from
``generate.HeadedGenerationMixin``; ``headkit.HeadedGenerateOutput`` is the public name."""
