"""Record HF transformers' float32 reference for SmolLM2-135M-Instruct (Q4_1 GGUF) as small fixtures.

Dev-only: needs torch and transformers (see README.md beside this file); the project's tests read only
the .npz/.json this writes. transformers dequantizes every GGUF tensor to float32 and undoes
llama.cpp's q/k permutation, so this is the same model as the file, run by an independent float
implementation (eager attention, no fused kernels).

    python tests/reference/make_hf_fixtures.py [MODEL.gguf] [--out tests/fixtures]
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # this checkout's inferno, for its default model's name
from inferno.cli.common import DEFAULT_MODEL  # noqa: E402

DEFAULT_OUT = REPO / "tests" / "fixtures"

N_NEW = 32  # greedy continuation length recorded for every prompt
N_DECODE_LOGITS = 4  # full-vocab logits kept for this many decode steps (prompt 0 only: 192 KiB a row)
N_LONG_NEW = 128  # longer greedy continuation of the last (longest) prompt
TOP_K = 16  # per-step top-k kept for every prompt and step
VERSIONED = ("torch", "transformers", "tokenizers", "gguf", "numpy")

# The second long prompt extends the first one, so their token ids share a long prefix: handy for
# prompt-cache tests (the script checks and records whether the prefix survives tokenization).
LONG_A = (
    "The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only "
    "person who lived there was an old keeper named Tomas. Every evening, an hour before sunset, he "
    "climbed the one hundred and twelve steps of the spiral staircase, wiped the salt from the great "
    "glass lens, trimmed the wick and lit the lamp. He had done this for thirty-one years, and in all "
    "that time he had missed only two nights: once when a winter storm tore the door from its hinges, "
    "and once when his daughter was born in the village across the bay.\n\n"
    "The village was small. It had a harbour with a stone wall, a church with a crooked tower, a "
    "bakery that opened before dawn and a school with a single classroom. The fishermen left in the "
    "dark and came back in the afternoon, their boats heavy with cod and mackerel, and the children "
    "ran down to the quay to watch the catch being sorted into wooden crates. In the summer, a few "
    "visitors arrived on the ferry from the mainland. They walked along the cliffs, took photographs "
    "of the lighthouse and asked the baker for directions to the beach, which was hidden behind a "
    "ridge of dunes and could only be reached by a sandy path through the heather.\n\n"
    "Tomas liked the visitors, although he rarely spoke to them. He liked to see them standing at "
    "the foot of the tower, shading their eyes and counting the windows. Sometimes a child would wave "
    "at him, and he would wave back from the gallery at the top, and the child would shout with "
    "delight. On those days he felt that the light was not only a warning to ships but also a kind "
    "of greeting, a way of telling everyone on the island and on the sea that someone was awake and "
    "watching, and that they were not alone in the dark.\n\n"
    "His daughter, Elena, had grown up and moved to the city to study engineering. She wrote to him "
    "every month, long letters about bridges and tunnels and the machines that measured the strength "
    "of steel. He kept the letters in a tin box on the shelf above his bed, and on quiet nights he "
    "read them again by the light of a small oil lamp."
)
LONG_B = LONG_A + (
    " One autumn, a letter arrived that was different from the others. Elena wrote that the "
    "government had decided to automate all the lighthouses on the coast. A machine would switch the "
    "lamp on and off, a sensor would watch the fog, and a radio would report any fault to an office "
    "on the mainland. The keepers would no longer be needed. She wrote that she was sorry, and that "
    "she had asked to work on the project herself, so that she could be the one to install the "
    "machine in her father's tower.\n\n"
    "Tomas read the letter twice. Then he folded it carefully, put it in the tin box with the others "
    "and climbed the stairs to light the lamp, as he had done every evening for thirty-one years."
)

PROMPTS: list[tuple[str, str]] = [
    ("once_upon", "Once upon a time"),
    ("question", "What is the capital of France?"),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    # picked among a few short prompts for a wide top-1/top-2 logit margin at every greedy step
    ("short", "Water boils at"),
    ("long_400", LONG_A),
    ("long_550", LONG_B),
]


def unpermute_llama(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's converter permutation (adjacent-pair RoPE rows back to HF's halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check_weights(model: torch.nn.Module, gguf_path: Path) -> dict[str, str]:
    """Confirm HF loaded exactly the file's dequantized tensors, tied output and un-permuted q/k."""
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config

    def deq(name: str) -> np.ndarray:
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)

    assert "output.weight" not in tensors, "expected a tied-embedding file"
    embed = model.model.embed_tokens.weight.detach().numpy()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "lm_head not tied"
    assert np.array_equal(embed, deq("token_embd.weight")), "token_embd differs"
    attn = model.model.layers[0].self_attn
    q = unpermute_llama(deq("blk.0.attn_q.weight"), cfg.num_attention_heads)
    k = unpermute_llama(deq("blk.0.attn_k.weight"), cfg.num_key_value_heads)
    assert np.array_equal(attn.q_proj.weight.detach().numpy(), q), "attn_q differs"
    assert np.array_equal(attn.k_proj.weight.detach().numpy(), k), "attn_k differs"
    down = model.model.layers[0].mlp.down_proj.weight.detach().numpy()
    assert np.array_equal(down, deq("blk.0.ffn_down.weight")), "ffn_down differs"
    return {
        "tied_embeddings": "lm_head shares token_embd (Q8_0, dequantized); the file has no output.weight",
        "q_k_layout": "HF q_proj/k_proj == inverse llama.cpp permutation of attn_q/attn_k (checked on blk.0)",
    }


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    # stable sort so ties keep the lower id first, like argmax
    order = np.argsort(-logits, axis=-1, kind="stable")[..., :k]
    return order.astype(np.int32), np.take_along_axis(logits, order, axis=-1).astype(np.float32)


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: list[int], n_new: int) -> tuple[list[int], np.ndarray]:
    """generate() greedily with the KV cache; never stops at EOS. Returns new ids and [n_new, V] logits."""
    input_ids = torch.tensor([ids], dtype=torch.long)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=n_new,
        output_logits=True,  # raw logits, before any logits processor
        return_dict_in_generate=True,
    )
    new = out.sequences[0, len(ids) :].tolist()
    logits = torch.stack(out.logits, dim=1)[0].float().numpy()
    assert len(new) == n_new, f"generate stopped after {len(new)} tokens"
    assert new == logits.argmax(-1).tolist(), "greedy ids disagree with the recorded logits"
    return new, logits


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", nargs="?", type=Path, default=REPO / DEFAULT_MODEL)
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
    eos_id = model.generation_config.eos_token_id
    # No EOS stop: every prompt gets exactly N_NEW greedy tokens (EOS, if emitted, is just another token).
    model.generation_config.eos_token_id = None
    checks = check_weights(model, path)
    vocab = model.config.vocab_size

    arrays: dict[str, np.ndarray] = {}
    prefill = np.zeros((len(PROMPTS), vocab), np.float32)
    conts = np.zeros((len(PROMPTS), N_NEW), np.int32)
    margins = np.zeros((len(PROMPTS), N_NEW), np.float32)
    topk_ids = np.zeros((len(PROMPTS), N_NEW, TOP_K), np.int32)
    topk_logits = np.zeros((len(PROMPTS), N_NEW, TOP_K), np.float32)
    records = []
    for i, (name, text) in enumerate(PROMPTS):
        ids = tok(text)["input_ids"]
        assert ids[0] != tok.bos_token_id, "this file has add_bos_token = false"
        with torch.no_grad():
            full = model(torch.tensor([ids])).logits[0, -1].float().numpy()
        new, step_logits = greedy(model, ids, N_NEW)
        # The first step of generate() is the same prefill; record the plain forward's row.
        assert np.allclose(full, step_logits[0], atol=1e-4), "prefill and generate disagree"
        prefill[i] = full
        conts[i] = new
        tids, tvals = top_k(step_logits, TOP_K)
        topk_ids[i], topk_logits[i] = tids, tvals
        margins[i] = tvals[:, 0] - tvals[:, 1]
        arrays[f"prompt_ids_{i}"] = np.asarray(ids, np.int32)
        if i == 0:
            arrays["decode_logits_0"] = step_logits[1 : 1 + N_DECODE_LOGITS].astype(np.float32)
        t5_ids, t5_vals = top_k(full, 5)
        records.append(
            {
                "index": i,
                "name": name,
                "text": text,
                "n_tokens": len(ids),
                "prompt_ids": ids,
                "continuation_ids": new,
                "continuation_text": tok.decode(new),
                "eos_positions": [j for j, t in enumerate(new) if t == eos_id],
                "min_margin": float(margins[i].min()),
                "top5_first_step": {"ids": t5_ids.tolist(), "logits": [float(v) for v in t5_vals]},
            }
        )
        print(f"[{i}] {name}: {len(ids)} tokens -> {tok.decode(new)!r}")

    long_ids = records[-1]["prompt_ids"]
    long_new, long_logits = greedy(model, long_ids, N_LONG_NEW)
    assert long_new[:N_NEW] == records[-1]["continuation_ids"]
    long_margins = np.sort(long_logits, axis=-1)[:, -1] - np.sort(long_logits, axis=-1)[:, -2]

    ids_a, ids_b = records[4]["prompt_ids"], records[5]["prompt_ids"]
    prefix_ok = ids_b[: len(ids_a)] == ids_a

    arrays.update(
        prefill_logits=prefill,
        continuation_ids=conts,
        continuation_margins=margins,
        step_topk_ids=topk_ids,
        step_topk_logits=topk_logits,
        long_continuation_ids=np.asarray(long_new, np.int32),
        long_continuation_margins=long_margins.astype(np.float32),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out / "hf_smollm2.npz", **arrays)
    meta = {
        "model_file": path.name,
        "versions": {name: version(name) for name in VERSIONED},
        "attn_implementation": "eager",
        "dtype": "float32",
        "vocab_size": vocab,
        "add_bos": False,
        "eos_token_id": eos_id,
        "eos_stop": False,
        "n_new": N_NEW,
        "n_decode_logits": N_DECODE_LOGITS,
        "top_k": TOP_K,
        "checks": checks,
        "long_400_ids_prefix_of_long_550": prefix_ok,
        "long_continuation": {
            "prompt_index": len(PROMPTS) - 1,
            "n_new": N_LONG_NEW,
            "ids": long_new,
            "text": tok.decode(long_new),
            "eos_positions": [j for j, t in enumerate(long_new) if t == eos_id],
            "min_margin": float(long_margins.min()),
        },
        "prompts": records,
    }
    (args.out / "hf_smollm2.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")
    print(f"long_400 ids prefix of long_550: {prefix_ok}; wrote {args.out}/hf_smollm2.npz and .json")


if __name__ == "__main__":
    main()
