"""Any Hugging Face backbone, by inspection: its block stack, inputs, positions, where it came
from, peft adapter layers inside it and head weights tied to it."""
