"""Text: the GGUF's tokenizer (tokenizer), its vocabulary rebuilt for `tokenizers` (vocabulary), chat
templates rendered as transformers renders them (chat_template), and the text a generation shows, cut at
its stops (output_text)."""
