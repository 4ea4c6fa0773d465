"""Qwen2.5-Coder-0.5B-Instruct (Q4_K_M) against HF transformers' float32 forward of the same GGUF.

The third real model: qwen2 with q/k/v biases, an output matrix of its own (not tied), mixed Q5_0, Q8_0,
Q4_K and Q6_K matrices, and a 151,936-token byte-level BPE vocabulary with a chat template. The fixtures
come from tests/reference/make_qwen_fixtures.py (logits, greedy continuations) and
make_qwen_tokenizer_fixtures.py (ids of the SmolLM2 tokenizer corpus and Qwen's special tokens); these tests
need neither torch nor transformers. The model is fetched by `bin/fetch-model qwen` (`make model MODEL=qwen`).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import FIXTURES, ROOT, greedy

QWEN_MODEL = ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
if not QWEN_MODEL.is_file():
    pytest.skip(f"{QWEN_MODEL.name} is absent (fetch it with `bin/fetch-model qwen`)",
                allow_module_level=True)

REFERENCE = json.loads((FIXTURES / "hf_qwen.json").read_text(encoding="utf-8"))
ARRAYS = np.load(FIXTURES / "hf_qwen.npz")
TOKENIZER = json.loads((FIXTURES / "tokenizer_qwen.json").read_text(encoding="utf-8"))
PROMPTS = REFERENCE["prompts"]
NAMES = [p["name"] for p in PROMPTS]
CHAT = NAMES.index("chat")
N_NEW = REFERENCE["n_new"]
LOGIT_TOLERANCE = 1e-3  # as for SmolLM2 and Gemma 3
# Greedy ids are compared over all N_NEW steps only because HF's top-1 leads its top-2 by far more than the
# logits may differ at every step (smallest recorded margin: 0.091, once_upon step 3).
MIN_MARGIN = 20 * LOGIT_TOLERANCE
CASES = TOKENIZER["cases"]


@pytest.fixture(scope="module")
def qwen_engine():
    from inferno.runtime.engine import Engine

    return Engine.load(QWEN_MODEL)


@pytest.fixture(scope="module")
def tok(qwen_engine):
    return qwen_engine.tokenizer


def prompt_ids(i: int) -> list[int]:
    return ARRAYS[f"prompt_ids_{i}"].tolist()


def mismatches(expected: list, actual: list) -> str:
    bad = [(case["text"], e, a) for case, e, a in zip(CASES, expected, actual, strict=True) if e != a]
    shown = "\n".join(f"{text!r}: expected {e!r}, got {a!r}" for text, e, a in bad[:5])
    return f"{len(bad)} of {len(expected)} differ:\n{shown}"


def test_config_is_the_files(qwen_engine):
    c = qwen_engine.config
    assert (c.architecture, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_size, c.ffn_size) == (
        "qwen2", 24, 14, 2, 64, 896, 4864)
    assert c.vocab_size == REFERENCE["vocab_size"] == 151936
    assert c.qkv_bias and not c.qk_norm and not c.tied_embeddings and c.rope_neox
    assert c.rope_base == REFERENCE["rope_parameters"]["rope_theta"] == 1e6
    assert c.rms_eps == REFERENCE["rms_norm_eps"]
    assert c.layer_windows == (None,) * 24


def test_fixture_has_a_long_prompt_and_wide_margins():
    assert NAMES == ["once_upon", "question", "code", "chat", "long"]
    assert PROMPTS[-1]["n_tokens"] >= 300
    for i, name in enumerate(NAMES):
        top = ARRAYS[f"step_topk_logits_{i}"]
        margins = top[:, 0] - top[:, 1]
        assert margins.min() > MIN_MARGIN, (name, int(margins.argmin()), float(margins.min()))
        assert np.allclose(margins, PROMPTS[i]["margins"], atol=1e-4)


@pytest.mark.parametrize("i", range(len(PROMPTS)), ids=NAMES)
def test_prompt_tokenizes_like_hf(tok, i):
    assert tok.encode(PROMPTS[i]["text"]) == prompt_ids(i)


def test_chat_prompt_renders_like_hf(tok):
    chat = PROMPTS[CHAT]
    assert tok.apply_chat_template(chat["messages"], add_generation_prompt=True) == chat["text"]


@pytest.mark.parametrize("i", range(len(PROMPTS)), ids=NAMES)
def test_greedy_continuation_and_logits_match_hf(qwen_engine, i):
    tokens, logits = greedy(qwen_engine, prompt_ids(i), N_NEW)
    top_ids, top_logits = ARRAYS[f"step_topk_ids_{i}"], ARRAYS[f"step_topk_logits_{i}"]
    want = ARRAYS[f"continuation_ids_{i}"].tolist()
    for step, (row, got, expected) in enumerate(zip(logits, tokens, want, strict=True)):
        np.testing.assert_allclose(row[top_ids[step]], top_logits[step], rtol=0, atol=LOGIT_TOLERANCE,
                                   err_msg=f"{NAMES[i]} step {step}: the top-{len(top_ids[step])} logits")
        assert got == expected, (f"{NAMES[i]} step {step}: {got} instead of HF's {expected} "
                                 f"(HF top-2 {top_ids[step][:2].tolist()} {top_logits[step][:2].tolist()})")
    sampled = ARRAYS["sampled_ids"]
    np.testing.assert_allclose(logits[0][sampled], ARRAYS[f"prefill_sampled_logits_{i}"], rtol=0,
                               atol=LOGIT_TOLERANCE)


# -- the tokenizer on the SmolLM2 tokenizer corpus and Qwen's special tokens ---------------------------


def test_tokenizer_fixture_holds_the_smollm2_corpus():
    smollm2 = json.loads((FIXTURES / TOKENIZER["texts_from"]).read_text(encoding="utf-8"))
    texts = {case["text"] for case in CASES}
    assert {case["text"] for case in smollm2["cases"]} <= texts and len(CASES) >= 300


def test_encode_matches_transformers(tok):
    expected = [case["ids"] for case in CASES]
    actual = [tok.encode(case["text"]) for case in CASES]
    assert actual == expected, mismatches(expected, actual)


def test_the_prepared_models_tokenizer_encodes_as_transformers(tok):
    """Rebuilt from the state the prepared-model cache stores: transformers' ids."""
    from inferno.text.tokenizer import GGUFTokenizer

    again = GGUFTokenizer.from_state(*tok.to_state())
    expected = [case["ids"] for case in CASES]
    actual = [again.encode(case["text"]) for case in CASES]
    assert actual == expected, mismatches(expected, actual)


def test_decode_matches_transformers(tok):
    expected = [case["decoded"] for case in CASES]
    actual = [tok.decode(case["ids"]) for case in CASES]
    assert actual == expected, mismatches(expected, actual)


@pytest.mark.parametrize("chat", TOKENIZER["chats"],
                         ids=lambda chat: f"{len(chat['messages'])}msg-{chat['add_generation_prompt']}")
def test_chat_template_matches_transformers(tok, chat):
    rendered = tok.apply_chat_template(chat["messages"], add_generation_prompt=chat["add_generation_prompt"])
    assert rendered == chat["rendered"]


def test_qwen_tokenizer_properties(tok):
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.vocab_size) == (151643, 151645, False, 151936)
    assert tok.is_stop(151645) and tok.is_stop(151643)  # <|im_end|>, <|endoftext|>
    assert tok.encode("<|im_start|>") == [151644]
    assert tok.token_text(tok.encode(" capital")[0]) == " capital"


# -- model-generate --chat with this model -----------------------------------------------------------------


@pytest.fixture
def generate(run_main, monkeypatch, qwen_engine):
    """model-generate's main() in this process, given the module's engine instead of loading the model."""
    from inferno.cli.generate import main
    from inferno.runtime.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, path, progress=None: qwen_engine))
    return lambda *args: run_main(main, "model-generate", *args)


def test_generate_chat_renders_the_files_template(generate):
    chat = PROMPTS[CHAT]
    code, out, err = generate("--chat", "--json", QWEN_MODEL, chat["messages"][0]["content"], 1)
    assert code == 0, err
    report = json.loads(out)
    assert report["prompt"] == chat["text"]  # transformers' rendering, the default system message and all
    assert report["prompt_ids"] == prompt_ids(CHAT)
    assert report["token_ids"] == ARRAYS[f"continuation_ids_{CHAT}"][:1].tolist()


def test_generate_chat_prints_hfs_answer_as_text(generate):
    chat = PROMPTS[CHAT]
    assert not chat["stop_positions"], "HF's 32 tokens end before a stop token: the run prints them all"
    # with a cache: without --kv every token reruns the whole sequence (the baseline), 30 times slower here
    code, out, err = generate("--chat", "--kv", "prealloc", QWEN_MODEL, chat["messages"][0]["content"], N_NEW)
    assert code == 0, err
    assert out == chat["continuation_text"] + "\n", out
    assert "time to first token" in err and "Traceback" not in err


def test_the_warm_up_runs_one_layer_of_each_kind(qwen_engine, gemma_engine):
    """The warm-up's model keeps the first layer of each kind, the same objects: Qwen's Q4_K_M layers
    differ in attn_v's and ffn_down's block types, Gemma's in their window; every kind is kept, once."""
    for engine in (qwen_engine, gemma_engine):
        model = engine.model
        warm = model.one_layer_of_each_kind()
        kinds = [model._layer_kind(i) for i in range(len(model.layers))]
        kept = [kinds.index(kind) for kind in dict.fromkeys(kinds)]
        assert 1 < len(kept) < len(model.layers)
        assert all(a is model.layers[i] for a, i in zip(warm.layers, kept, strict=True))
        assert warm.config.n_layers == len(kept)
        assert warm.config.layer_windows == tuple(model.config.layer_windows[i] for i in kept)
        assert warm.config.layer_rope_bases == tuple(model.config.layer_rope_bases[i] for i in kept)
        assert warm.embedding is model.embedding and warm.output is model.output
        assert {m.qtype for m in warm.layer_matrices()} == {m.qtype for m in model.layer_matrices()}
