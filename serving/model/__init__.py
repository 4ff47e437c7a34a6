"""The Llama-style torch decoder: config, layers, linears, checkpoints, tokenizer, sampling."""
