"""The llama.cpp and HF transformers side of a benchmark measurement: one process, one JSON line.

Run by path (`PYTHON competitors.py ENGINE MODEL PROMPT_FILE N_PROMPT N_NEW THREADS CTX`) by the
interpreter that has those engines (`--others-python`), which need not have inferno: so this file
imports nothing from it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def child_llama(model: str, threads: int, ctx: int, text: str, n_prompt: int, n_new: int,
                flash_attn: bool = False) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=model, n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, logits_all=False, flash_attn=flash_attn, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)
    if n_prompt:
        ids = ids[:n_prompt]

    n_vocab = llm.n_vocab()

    def last_logits() -> np.ndarray:
        # With logits_all=False only the last position's logits exist, and eval() no longer copies
        # them anywhere: read them from the context, as llama.cpp's own sampler does.
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))

    start = time.perf_counter()
    llm.eval(ids)
    out = [int(np.argmax(last_logits()))]
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n_new - 1):
        llm.eval([out[-1]])
        out.append(int(np.argmax(last_logits())))
    decode_s = time.perf_counter() - start
    return {"version": f"llama-cpp-python {llama_cpp.__version__}", "n_prompt": len(ids), "token_ids": out,
            "text": llm.detokenize(out).decode(errors="replace"), "prefill_s": prefill_s,
            "decode_s": decode_s, "n_decode": n_new - 1}


def child_hf(model: str, threads: int, ctx: int, text: str, n_prompt: int, n_new: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    lm = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    lm.eval()
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if n_prompt:
        ids = ids[:n_prompt]

    with torch.inference_mode():
        start = time.perf_counter()
        # logits_to_keep=1: only the last position goes through the LM head, as generate() does.
        step = lm(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        out = [int(step.logits[0, -1].argmax())]
        prefill_s = time.perf_counter() - start
        past = step.past_key_values
        start = time.perf_counter()
        for _ in range(n_new - 1):
            step = lm(input_ids=torch.tensor([[out[-1]]]), past_key_values=past, use_cache=True,
                      logits_to_keep=1)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
        decode_s = time.perf_counter() - start
    return {"version": f"transformers {transformers.__version__}, torch {torch.__version__}",
            "n_prompt": len(ids), "token_ids": out, "text": tokenizer.decode(out), "prefill_s": prefill_s,
            "decode_s": decode_s, "n_decode": n_new - 1}


def main() -> None:
    parser = argparse.ArgumentParser(prog="competitors.py")
    parser.add_argument("engine", choices=["llama.cpp", "llama.cpp-fa", "hf"])
    parser.add_argument("model")
    parser.add_argument("prompt_file")
    parser.add_argument("n_prompt", type=int, help="tokens of the prompt to keep (0: all)")
    parser.add_argument("n_new", type=int)
    parser.add_argument("threads", type=int)
    parser.add_argument("ctx", type=int)
    a = parser.parse_args()
    text = Path(a.prompt_file).read_text()
    args = (a.model, a.threads, a.ctx, text, a.n_prompt, a.n_new)
    if a.engine == "hf":
        result = child_hf(*args)
    else:
        result = child_llama(*args, flash_attn=a.engine == "llama.cpp-fa")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
