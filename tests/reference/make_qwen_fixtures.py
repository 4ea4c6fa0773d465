"""Record HF transformers' float32 reference for Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF) as small fixtures.

Dev-only: needs torch and transformers (see README.md beside this file); the project's tests read only
the .npz/.json this writes. transformers dequantizes every GGUF tensor to float32 (Q5_0, Q8_0, Q4_K and Q6_K
matrices in this file), so this is the same model as the file, run by an independent float implementation
(eager attention, HF's own cache). The vocabulary is 151,936 tokens, so no full logit row is kept: the
first step's logits at 512 fixed random ids, and the top 16 of every step.

    python tests/reference/make_qwen_fixtures.py [MODEL.gguf] [--out tests/fixtures]
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_hf_fixtures import LONG_A, VERSIONED, greedy, top_k, unpermute_llama

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_OUT = REPO / "tests" / "fixtures"

N_NEW = 32  # greedy continuation length recorded for every prompt
TOP_K = 16  # per-step top-k kept for every prompt and step
N_SAMPLED = 512  # first-step logits also kept at this many fixed random ids: the whole distribution
LONG_MIN_TOKENS = 300

# One user message, rendered with the file's own chat template (its default system message included).
CHAT = [{"role": "user", "content": "Write a Python function that returns the largest of three numbers."}]

PROMPTS: list[tuple[str, str | None]] = [
    ("once_upon", "Once upon a time"),
    ("question", "What is the capital of France?"),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("chat", None),  # CHAT through tokenizer.apply_chat_template
    ("long", LONG_A),  # SmolLM2's long_400 text
]


def check_weights(model: torch.nn.Module, gguf_path: Path) -> dict[str, str]:
    """Confirm HF loaded exactly the file's dequantized tensors: its own output matrix, q/k as stored."""
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config

    def deq(name: str) -> np.ndarray:
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)

    def qtype(name: str) -> str:
        return tensors[name].tensor_type.name

    def hf(param: torch.Tensor) -> np.ndarray:
        return param.detach().numpy()

    def same(param: torch.Tensor, name: str) -> str:
        assert np.array_equal(hf(param), deq(name)), f"{name} differs"
        return f"{name} ({qtype(name)})"

    checked = []
    # Not tied: the file has an output matrix of its own (Q8_0), and HF reads it into lm_head.
    assert "output.weight" in tensors and not cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr(), "lm_head is tied"
    checked.append(same(model.lm_head.weight, "output.weight"))
    checked.append(same(model.model.embed_tokens.weight, "token_embd.weight"))
    checked.append(same(model.model.norm.weight, "output_norm.weight"))
    layer = model.model.layers[0]
    attn = layer.self_attn
    checked.append(same(attn.q_proj.weight, "blk.0.attn_q.weight"))
    checked.append(same(attn.k_proj.weight, "blk.0.attn_k.weight"))
    checked.append(same(attn.v_proj.weight, "blk.0.attn_v.weight"))
    for proj in ("q", "k", "v"):
        checked.append(same(getattr(attn, f"{proj}_proj").bias, f"blk.0.attn_{proj}.bias"))
    checked.append(same(attn.o_proj.weight, "blk.0.attn_output.weight"))
    checked.append(same(layer.mlp.down_proj.weight, "blk.0.ffn_down.weight"))
    checked.append(same(layer.input_layernorm.weight, "blk.0.attn_norm.weight"))
    checked.append(same(layer.post_attention_layernorm.weight, "blk.0.ffn_norm.weight"))
    # The mixed-type matrices in another type than blk.0's: the first layer with ffn_down Q4_K (blk.0: Q6_K)
    # and with attn_v Q5_0 (blk.0: Q8_0).
    for kind, hf_name, want in (
        ("ffn_down", "mlp.down_proj", "Q4_K"),
        ("attn_v", "self_attn.v_proj", "Q5_0"),
    ):
        n = next(i for i in range(cfg.num_hidden_layers) if qtype(f"blk.{i}.{kind}.weight") == want)
        checked.append(
            same(model.get_submodule(f"model.layers.{n}.{hf_name}").weight, f"blk.{n}.{kind}.weight")
        )
    # q/k as stored, which is not llama.cpp's permutation undone: qwen2 files keep HF's layout (NEOX RoPE).
    for proj, heads in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads)):
        unpermuted = unpermute_llama(deq(f"blk.0.attn_{proj}.weight"), heads)
        assert not np.array_equal(hf(getattr(attn, f"{proj}_proj").weight), unpermuted), proj
    types = sorted({t.tensor_type.name for t in reader.tensors})
    return {
        "tied_embeddings": "no: lm_head is output.weight (Q8_0), token_embd is Q5_0; not the same tensor",
        "equal_to_gguf_dequantize": ", ".join(checked),
        "tensor_types_in_file": ", ".join(types),
        "q_k_layout": "HF q_proj/k_proj == attn_q/attn_k as stored (no llama.cpp permutation to undo for "
        "qwen2: NEOX RoPE on HF's layout); the inverse llama permutation of attn_q/attn_k does NOT match",
        "norms": "HF norm weights == the file's norm tensors as stored (no 1 + w convention for qwen2)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", nargs="?", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    path: Path = args.model.resolve()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (24, 14, 2)
    assert not getattr(cfg, "use_sliding_window", False), "every layer attends to the whole sequence"
    eos_id = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # every prompt gets exactly N_NEW greedy tokens
    stop_ids = sorted({tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")})
    checks = check_weights(model, path)
    vocab = cfg.vocab_size
    sampled = np.sort(np.random.default_rng(0).choice(vocab, N_SAMPLED, replace=False)).astype(np.int32)

    arrays: dict[str, np.ndarray] = {"sampled_ids": sampled}
    records = []
    for i, (name, text) in enumerate(PROMPTS):
        record: dict = {"index": i, "name": name}
        if text is None:
            text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            record["messages"] = CHAT
        ids = tok(text)["input_ids"]
        assert ids[0] != tok.bos_token_id, "this file has add_bos_token = false"
        with torch.no_grad():
            full = model(torch.tensor([ids])).logits[0, -1].float().numpy()
        new, step_logits = greedy(model, ids, N_NEW)
        assert np.allclose(full, step_logits[0], atol=1e-4), "prefill and generate disagree"
        tids, tvals = top_k(step_logits, TOP_K)
        arrays[f"prompt_ids_{i}"] = np.asarray(ids, np.int32)
        arrays[f"continuation_ids_{i}"] = np.asarray(new, np.int32)
        arrays[f"step_topk_ids_{i}"] = tids
        arrays[f"step_topk_logits_{i}"] = tvals
        arrays[f"prefill_sampled_logits_{i}"] = full[sampled]
        margins = tvals[:, 0] - tvals[:, 1]
        stops = [j for j, t in enumerate(new) if t in stop_ids]
        record.update(
            text=text,
            n_tokens=len(ids),
            continuation_text=tok.decode(new),
            # what a run that stops at the first stop token prints: the text before it
            text_to_stop=tok.decode(new[: stops[0]] if stops else new),
            stop_positions=stops,
            min_margin=float(margins.min()),
            min_margin_step=int(margins.argmin()),
            margins=[round(float(m), 4) for m in margins],
        )
        records.append(record)
        print(f"[{i}] {name}: {len(ids)} tokens -> {tok.decode(new)!r}")
        print(f"     min margin {margins.min():.4f} at step {margins.argmin()}, stops at {stops}")
    assert records[-1]["n_tokens"] >= LONG_MIN_TOKENS, records[-1]["n_tokens"]

    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "hf_qwen.npz", **arrays)
    fields = gguf.GGUFReader(path).fields
    meta = {
        "model_file": path.name,
        # the file says it was converted from the AWQ release (weights de-quantized from AWQ int4 first)
        "general_name": fields["general.name"].contents(),
        "general_finetune": fields["general.finetune"].contents(),
        "versions": {name: version(name) for name in VERSIONED},
        "attn_implementation": "eager",
        "dtype": "float32",
        "vocab_size": vocab,
        "add_bos": False,
        "rope_parameters": cfg.rope_parameters,
        "rms_norm_eps": cfg.rms_norm_eps,
        "eos_token_id": eos_id,
        "stop_ids": stop_ids,
        "eos_stop": False,
        "n_new": N_NEW,
        "top_k": TOP_K,
        "n_sampled": N_SAMPLED,
        "checks": checks,
        "prompts": records,
    }
    (args.out / "hf_qwen.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}/hf_qwen.npz and .json")


if __name__ == "__main__":
    main()
