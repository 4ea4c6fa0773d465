"""Planning (kv-memcalc): KV-cache memory arithmetic (memcalc), a Hugging Face config.json read
(hf_config), a deployment across GPUs in vLLM's, SGLang's and llama.cpp's terms (deploy), and the
report the command prints, as plain data (report)."""
