"""Write tiny random-weight llama / qwen2 / qwen3 GGUF files and HF transformers' float32 reference for them.

Dev-only: needs torch and transformers (see README.md beside this file). Each model is built with
transformers' own config/model classes and seeded random weights, then written the way llama.cpp's
`convert_hf_to_gguf.py` writes that architecture:

- tensor names `token_embd`, `blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,ffn_norm,ffn_gate,
  ffn_up,ffn_down}`, `output_norm`, `output` (absent when tied), plus `attn_{q,k,v}.bias` (qwen2) and
  `attn_q_norm`/`attn_k_norm` (qwen3); 1-D tensors always F32;
- llama's q/k weights permuted (`LlamaModel.permute`) so RoPE rotates adjacent pairs; qwen2/qwen3
  keep HF's layout (NEOX RoPE, rotating the two halves);
- the converter's metadata keys, and a minimal byte-level BPE tokenizer (the converter always writes
  one, and transformers needs its token count as the vocab size for qwen2/qwen3).

2-D tensors are F32 (llama), F16 (qwen2) or Q8_0 (qwen3), and the HF model is given exactly the
dequantized values before the reference is computed, so reference and file are the same model.
Finally transformers reads each file back (`from_pretrained(gguf_file=...)`) and must reproduce
the logits: that checks the layout against transformers' own llama.cpp-compatible loader.

    python tests/reference/make_tiny_models.py [--out tests/fixtures]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests" / "fixtures"

VOCAB = 320
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
SEQ_LENGTHS = (7, 40)
N_NEW = 16
# std of each random matrix is gain / sqrt(fan_in); embeddings are N(0, 1)
GAINS = {
    "q_proj": 2.0,
    "k_proj": 2.0,
    "v_proj": 2.0,
    "o_proj": 4.0,
    "gate_proj": 2.0,
    "up_proj": 2.0,
    "down_proj": 4.0,
    "lm_head": 4.0,
}
VERSIONED = ("torch", "transformers", "tokenizers", "gguf", "numpy")

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)

# Text the tiny tokenizer's merges are learned from; its quality does not matter.
TOKENIZER_CORPUS = [
    "Once upon a time there was a tiny model that lived in a test folder.",
    "The quick brown fox jumps over the lazy dog. The dog did not mind.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "What is the capital of France? The capital of France is Paris.",
    "Water boils at one hundred degrees and freezes at zero degrees.",
]


@dataclass(frozen=True)
class TinySpec:
    arch: str
    model_cls: type[PreTrainedModel]
    config: PretrainedConfig
    matrix_type: QT  # storage type of every 2-D tensor
    file_type: gguf.LlamaFileType
    seed: int  # weights and token sequences; picked among a few for wide greedy logit margins


SPECS = [
    TinySpec(
        "llama",
        LlamaForCausalLM,
        LlamaConfig(
            **COMMON,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        QT.F32,
        gguf.LlamaFileType.ALL_F32,
        seed=3,
    ),
    TinySpec(
        "qwen2",
        Qwen2ForCausalLM,
        Qwen2Config(
            **COMMON,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
        QT.F16,
        gguf.LlamaFileType.MOSTLY_F16,
        seed=3,
    ),
    TinySpec(
        "qwen3",
        Qwen3ForCausalLM,
        Qwen3Config(
            **COMMON,
            head_dim=32,  # deliberately not hidden_size / num_attention_heads (= 16)
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        QT.Q8_0,
        gguf.LlamaFileType.MOSTLY_Q8_0,
        seed=5,
    ),
]


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE (GPT-2 style) with exactly VOCAB tokens: specials, 256 bytes, learned merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def add_tokenizer(writer: gguf.GGUFWriter, tok: Tokenizer) -> None:
    """What the converter's `_set_vocab_gpt2` writes for a byte-level BPE tokenizer."""
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(VOCAB))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(False)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's `LlamaModel.permute`: HF rotate-half rows -> adjacent-pair rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@torch.no_grad()
def randomize(model: PreTrainedModel, seed: int) -> None:
    """Seeded weights large enough that attention is sharp and logits well separated.

    HF's default init (std 0.02) would give near-uniform attention and near-tied logits, which
    would test little and make greedy continuations fragile. Large o_proj/down_proj outputs keep the
    tied qwen2 model from just repeating its input token (its own embedding dominating the residual).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # shares embed_tokens
        if "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            p.copy_(torch.rand(p.shape, generator=gen) * 1.5 + 0.5)  # far from 1
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        else:
            gain = next((g for key, g in GAINS.items() if key in name), 1.0)
            p.copy_(torch.randn(p.shape, generator=gen) * gain / p.shape[1] ** 0.5)


def gguf_tensors(model: PreTrainedModel, spec: TinySpec) -> dict[str, tuple[np.ndarray, QT]]:
    """GGUF name -> (HF-layout float32 array, storage type), in the converter's naming."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out: dict[str, tuple[np.ndarray, QT]] = {}

    def put(gguf_name: str, hf_name: str) -> None:
        arr = sd[hf_name]
        out[gguf_name] = (arr, spec.matrix_type if arr.ndim == 2 else QT.F32)

    put("token_embd.weight", "model.embed_tokens.weight")
    for i in range(cfg.num_hidden_layers):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        put(blk + "attn_norm.weight", hf + "input_layernorm.weight")
        for g, h in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
            put(f"{blk}attn_{g}.weight", f"{hf}self_attn.{h}.weight")
            if f"{hf}self_attn.{h}.bias" in sd:
                put(f"{blk}attn_{g}.bias", f"{hf}self_attn.{h}.bias")
        if spec.arch == "qwen3":
            put(blk + "attn_q_norm.weight", hf + "self_attn.q_norm.weight")
            put(blk + "attn_k_norm.weight", hf + "self_attn.k_norm.weight")
        put(blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight")
        for g in ("gate", "up", "down"):
            put(f"{blk}ffn_{g}.weight", f"{hf}mlp.{g}_proj.weight")
    put("output_norm.weight", "model.norm.weight")
    if not cfg.tie_word_embeddings:
        put("output.weight", "lm_head.weight")
    assert len(sd) == len(out) + (1 if cfg.tie_word_embeddings else 0), "unmapped HF tensors"
    return out


def hf_name(gguf_name: str, arch: str) -> str:
    """Inverse of the mapping in gguf_tensors (for loading dequantized values into the HF model)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, i, part, kind = gguf_name.split(".")
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    return f"model.layers.{i}.{names[part]}.{kind}"


def write_gguf(path: Path, model: PreTrainedModel, spec: TinySpec, tok: Tokenizer) -> dict[str, str]:
    """Quantize, load the dequantized values back into `model`, write the file. Returns name -> type."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, spec.arch)
    # TextModel.set_gguf_parameters, in the converter's order
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"tiny-random-{spec.arch}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None) is not None:  # written when config.json has head_dim
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_file_type(spec.file_type)
    if spec.arch == "llama":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(writer, tok)

    params = dict(model.named_parameters())
    types: dict[str, str] = {}
    for name, (arr, qtype) in gguf_tensors(model, spec).items():
        heads = cfg.num_attention_heads if "attn_q." in name else cfg.num_key_value_heads
        permuted = spec.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight"))
        if permuted:
            arr = llama_permute(arr, heads)
        data = arr if qtype == QT.F32 else gguf.quants.quantize(arr, qtype)
        deq = gguf.quants.dequantize(data, qtype).reshape(arr.shape).astype(np.float32)
        if permuted:  # the HF model keeps its own layout
            deq = llama_unpermute(deq, heads)
        with torch.no_grad():
            params[hf_name(name, spec.arch)].copy_(torch.from_numpy(deq))
        writer.add_tensor(name, data, raw_dtype=None if qtype in (QT.F32, QT.F16) else qtype)
        types[name] = qtype.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


@torch.no_grad()
def reference(model: PreTrainedModel, ids: list[int]) -> tuple[np.ndarray, list[int], np.ndarray]:
    """[T, V] logits of a full forward, greedy N_NEW ids (KV-cached generate) and their [N_NEW, V] logits."""
    x = torch.tensor([ids])
    logits = model(x).logits[0].float().numpy()
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=N_NEW,
        output_logits=True,
        return_dict_in_generate=True,
    )
    new = out.sequences[0, len(ids) :].tolist()
    steps = torch.stack(out.logits, dim=1)[0].float().numpy()
    assert len(new) == N_NEW and new == steps.argmax(-1).tolist()
    assert np.allclose(steps[0], logits[-1], atol=1e-4)
    return logits, new, steps


def readback(
    path: Path, spec: TinySpec, seqs: list[list[int]], expected: list[np.ndarray], tok: Tokenizer
) -> dict:
    """Load the written file with transformers' GGUF loader and compare logits with the reference."""
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    result: dict = {}
    try:
        m = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs).eval()
        result["config_from_file"] = True
    except Exception as exc:  # e.g. transformers ignores qwen3's attention.key_length
        result["plain_load_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        # config from the HF object, every tensor still from the file
        m = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, config=spec.config, **kwargs
        ).eval()
        result["config_from_file"] = False
    with torch.no_grad():
        diffs = [
            float(np.abs(m(torch.tensor([s])).logits[0].float().numpy() - e).max())
            for s, e in zip(seqs, expected, strict=True)
        ]
    result["max_abs_logit_diff"] = max(diffs)
    result["matches"] = max(diffs) <= 1e-5
    try:
        hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        result["tokenizer_loads"] = True
        result["tokenizer_vocab"] = len(hf_tok)
        text = TOKENIZER_CORPUS[0]
        same = hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text).ids
        result["tokenizer_encodes_like_source"] = same
    except Exception as exc:
        result["tokenizer_loads"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)

    tok = build_tokenizer()
    summary: dict = {"versions": {name: version(name) for name in VERSIONED}, "models": {}}
    for spec in SPECS:
        spec.config._attn_implementation = "eager"
        model = spec.model_cls(spec.config).eval()
        randomize(model, spec.seed)
        path = args.out / f"tiny_{spec.arch}.gguf"
        types = write_gguf(path, model, spec, tok)
        model.generation_config.eos_token_id = None  # always generate N_NEW tokens
        model.generation_config.pad_token_id = EOS_ID

        rng = np.random.default_rng(spec.seed)
        seqs = [rng.integers(0, VOCAB, n).tolist() for n in SEQ_LENGTHS]
        arrays: dict[str, np.ndarray] = {}
        full_logits = []
        conts = []
        for j, ids in enumerate(seqs):
            logits, new, steps = reference(model, ids)
            srt = np.sort(steps, axis=-1)
            arrays[f"ids_{j}"] = np.asarray(ids, np.int32)
            arrays[f"logits_{j}"] = logits.astype(np.float32)
            arrays[f"continuation_{j}"] = np.asarray(new, np.int32)
            arrays[f"step_logits_{j}"] = steps.astype(np.float32)
            arrays[f"margins_{j}"] = (srt[:, -1] - srt[:, -2]).astype(np.float32)
            full_logits.append(logits)
            conts.append(new)
        np.savez_compressed(args.out / f"tiny_{spec.arch}.npz", **arrays)

        check = readback(path, spec, seqs, full_logits, tok)
        cfg = spec.config
        summary["models"][spec.arch] = {
            "gguf": path.name,
            "hf_class": spec.model_cls.__name__,
            "seed": spec.seed,
            "matrix_type": spec.matrix_type.name,
            "tensor_types": types,
            "config": {
                "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.intermediate_size,
                "num_hidden_layers": cfg.num_hidden_layers,
                "num_attention_heads": cfg.num_attention_heads,
                "num_key_value_heads": cfg.num_key_value_heads,
                "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                "rope_theta": cfg.rope_parameters["rope_theta"],
                "rms_norm_eps": cfg.rms_norm_eps,
                "max_position_embeddings": cfg.max_position_embeddings,
                "tie_word_embeddings": cfg.tie_word_embeddings,
                "rope_style": "normal (adjacent pairs, q/k permuted)" if spec.arch == "llama" else "neox",
            },
            "sequences": seqs,
            "continuations": conts,
            "min_margin": [float(arrays[f"margins_{j}"].min()) for j in range(len(seqs))],
            "hf_readback": check,
            "file_bytes": path.stat().st_size,
        }
        print(f"{spec.arch}: {path.stat().st_size} bytes, readback {check}")
    (args.out / "tiny_models.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
