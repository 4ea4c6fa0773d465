"""The file: a GGUF opened and checked (reader), and the model's hyperparameters read from its
metadata (config). Nothing here computes."""
