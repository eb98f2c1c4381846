"""The built-in tiny model and its word-level tokenizer (``model.path=builtin:tiny``), built locally at launch."""
