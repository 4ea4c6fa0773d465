"""Record HF transformers' float32 reference for Gemma 3 270M (Q4_K_M GGUF) as small fixtures.

Dev-only: needs torch and transformers (see README.md beside this file); the project's tests read only
the .npz/.json this writes. transformers dequantizes every GGUF tensor to float32 (and takes 1 off the
norm weights, which llama.cpp's converter stores as 1 + w), so this is the same model as the file, run
by an independent float implementation (eager attention, HF's own sliding-window mask and cache).

    python tests/reference/make_gemma_fixtures.py [MODEL.gguf] [--out tests/fixtures]
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
from make_hf_fixtures import LONG_B, VERSIONED, greedy, top_k

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "gemma-3-270m-q4_k_m.gguf"
DEFAULT_OUT = REPO / "tests" / "fixtures"

N_NEW = 32  # greedy continuation length recorded for every prompt
TOP_K = 16  # per-step top-k kept for every prompt and step
N_SAMPLED = 512  # first-step logits also kept at this many fixed random ids: the whole distribution
WINDOW = 512

# Past the sliding window of 512 tokens, so the local layers' masks and caches matter.
LONG = LONG_B + (
    "\n\nThe next spring, Elena came home on the first ferry of the season. She carried a heavy case of "
    "tools and a small grey box with a blinking green light. Together they climbed the stairs, and she "
    "showed him how the machine worked: a clock that knew the time of every sunset, a relay that opened "
    "the valve, a sensor that counted the seconds between the flashes. Tomas watched her hands and said "
    "nothing for a long time. Then he asked whether the machine would also clean the lens, and she laughed "
    "and said no, somebody would still have to do that, and perhaps it could be him."
)

PROMPTS: list[tuple[str, str]] = [
    ("once_upon", "Once upon a time"),
    ("question", "The capital of France is"),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("long", LONG),
]


def check_weights(model: torch.nn.Module, gguf_path: Path) -> dict[str, str]:
    """Confirm HF loaded exactly the file's dequantized tensors: tied output, norms as w - 1, q/k as is."""
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}

    def deq(name: str) -> np.ndarray:
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)

    def hf(param: torch.Tensor) -> np.ndarray:
        return param.detach().numpy()

    assert "output.weight" not in tensors, "expected a tied-embedding file"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    assert np.array_equal(hf(model.model.embed_tokens.weight), deq("token_embd.weight")), "token_embd differs"
    layer = model.model.layers[0]
    assert np.array_equal(hf(layer.self_attn.q_proj.weight), deq("blk.0.attn_q.weight")), "attn_q differs"
    assert np.array_equal(hf(layer.self_attn.k_proj.weight), deq("blk.0.attn_k.weight")), "attn_k differs"
    assert np.array_equal(hf(layer.mlp.down_proj.weight), deq("blk.0.ffn_down.weight")), "ffn_down differs"
    norms = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    }
    for hf_name, gguf_name in norms.items():
        stored = deq(f"blk.0.{gguf_name}.weight")
        assert np.allclose(hf(getattr(layer, hf_name).weight) + 1, stored, rtol=0, atol=1e-6), hf_name
    assert np.allclose(hf(layer.self_attn.q_norm.weight) + 1, deq("blk.0.attn_q_norm.weight"), atol=1e-6)
    return {
        "tied_embeddings": "lm_head shares token_embd (Q8_0, dequantized); the file has no output.weight",
        "norms": "HF norm weight + 1 == the file's norm tensors (llama.cpp stores 1 + w; checked on blk.0)",
        "q_k_layout": "HF q_proj/k_proj == attn_q/attn_k as stored (no permutation for gemma3)",
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
    assert cfg.sliding_window == WINDOW and cfg.query_pre_attn_scalar == cfg.head_dim == 256
    global_layers = [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"]
    assert global_layers == [5, 11, 17], global_layers
    eos_id = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # every prompt gets exactly N_NEW greedy tokens
    checks = check_weights(model, path)
    vocab = cfg.vocab_size
    sampled = np.sort(np.random.default_rng(0).choice(vocab, N_SAMPLED, replace=False)).astype(np.int32)

    arrays: dict[str, np.ndarray] = {"sampled_ids": sampled}
    records = []
    for i, (name, text) in enumerate(PROMPTS):
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id, "this file has add_bos_token = true"
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
        records.append(
            {
                "index": i,
                "name": name,
                "text": text,
                "n_tokens": len(ids),
                "continuation_text": tok.decode(new),
                "eos_positions": [j for j, t in enumerate(new) if t == eos_id],
                "min_margin": float(margins.min()),
            }
        )
        print(f"[{i}] {name}: {len(ids)} tokens -> {tok.decode(new)!r} (min margin {margins.min():.3f})")
    assert records[-1]["n_tokens"] > WINDOW + 64, "the long prompt must run well past the window"

    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "hf_gemma3.npz", **arrays)
    meta = {
        "model_file": path.name,
        "versions": {name: version(name) for name in VERSIONED},
        "attn_implementation": "eager",
        "dtype": "float32",
        "vocab_size": vocab,
        "sliding_window": WINDOW,
        "global_layers": global_layers,
        "rope_parameters": cfg.rope_parameters,
        "eos_token_id": eos_id,
        "eos_stop": False,
        "n_new": N_NEW,
        "top_k": TOP_K,
        "n_sampled": N_SAMPLED,
        "checks": checks,
        "prompts": records,
    }
    (args.out / "hf_gemma3.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}/hf_gemma3.npz and .json")


if __name__ == "__main__":
    main()
