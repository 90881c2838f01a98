"""A model's files read without torch: the tokenizer (from tokenizer.json or a GGUF), the default model's lookup,
JSON."""
