"""GGUF checkpoints (llama.cpp's format): read with the `gguf` package, dequantized, and converted once into a
transformers checkpoint directory in tokend's cache, which the engine then loads like any other (docs/models.md).

reader: the file's metadata and tensors; dequantize: GGML types to torch; weights: llama.cpp's names and Q/K
order back to the Llama layout; model_config: config.json and generation_config.json; tokenizer: tokenizer.json
and tokenizer_config.json from `tokenizer.ggml.*`; convert: all of it into the cache, once.
"""
