"""kv-inspect: its JSON checked against the cache's own arrays, the terminal view, snapshots, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from inferno.analysis.cache_view import fill_cache
from inferno.cli.inspect import main
from inferno.kernels.attention import attention_decode
from inferno.kv.snapshot import Snapshot

PROG = "kv-inspect"
PROMPT = "Once upon a time"
PROMPT_IDS = [6403, 1980, 253, 655]
LAYER = 5


@pytest.fixture
def kv_inspect(run_main, monkeypatch, loaded_once):
    """kv-inspect in this process, with the session's engine."""
    monkeypatch.setenv("NO_COLOR", "1")
    return lambda *args: run_main(main, PROG, *args)


@pytest.fixture(scope="module")
def filled(engine):
    """What kv-inspect --decode 2 runs: the prompt, two greedy tokens, queries of the last one."""
    return fill_cache(engine, PROMPT_IDS, 2, None)


def refused(result, *fragments: str) -> bool:
    code, out, err = result
    line = err.strip()
    return code == 2 and out == "" and "\n" not in line and line.startswith(f"{PROG}: error: ") and all(
        fragment in line for fragment in fragments
    )


def test_json_matches_the_caches_own_arrays(kv_inspect, model_path, filled):
    code, out, err = kv_inspect("--json", "--decode", "2", "--layer", LAYER, model_path, PROMPT)
    assert code == 0, err
    r = json.loads(out)
    cache, ids, queries = filled
    n = cache.length
    assert n == 6 and len(ids) == 6 and ids[:4] == PROMPT_IDS
    assert (r["layers"], r["kv_heads"], r["heads"], r["head_dim"], r["kv_width"]) == (30, 3, 9, 64, 192)
    assert (r["length"], r["capacity"], r["cache"]) == (n, cache.capacity, "prealloc")
    assert r["bytes_allocated"] == cache.nbytes == cache.keys.nbytes + cache.values.nbytes
    assert r["bytes_used"] == 2 * 30 * n * 192 * 4
    assert [t["id"] for t in r["tokens"]] == ids and [t["pos"] for t in r["tokens"]] == list(range(n))
    assert r["tokens"][1]["text"] == " upon"

    for name, array in (("key_norms", cache.keys), ("value_norms", cache.values)):
        expected = [
            [np.mean([np.linalg.norm(array[layer, pos, h * 64 : (h + 1) * 64]) for pos in range(n)])
             for h in range(3)]
            for layer in range(30)
        ]
        assert np.allclose(r[name], expected, rtol=1e-6)

    attention = r["attention"]
    assert (attention["layer"], attention["query_pos"]) == (LAYER, n - 1)
    weights = np.array(attention["weights"])
    assert weights.shape == (9, n) and np.allclose(weights.sum(axis=1), 1.0)
    q, keys, values = queries[LAYER], cache.keys[LAYER, :n], cache.values[LAYER, :n]
    for head in range(9):
        kv = slice(head // 3 * 64, (head // 3 + 1) * 64)
        scores = keys[:, kv] @ q[head * 64 : (head + 1) * 64] / 8.0
        expected = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
        assert np.allclose(weights[head], expected, atol=1e-6)
    # The weights are the ones the model used: mixing V with them gives its attention output.
    mixed = np.concatenate([weights[h] @ values[:, h // 3 * 64 : (h // 3 + 1) * 64] for h in range(9)])
    assert np.allclose(mixed, attention_decode(q, keys, values, 9), atol=1e-5)


def test_terminal_view(kv_inspect, model_path):
    code, out, err = kv_inspect("--layer", "0", model_path, "Hi there")
    assert code == 0, err
    for text in ("llama, prealloc cache", "30 layers x 3 KV heads x head_dim 64", "stored after RoPE",
                 "2 of 2 tokens committed", "0:Hi 1:␣there", "mean |K| per head", "mean |V| per head",
                 "L29", "layer 0: attention of the last query (position 1)", "q8 (kv2)", "␣there"):
        assert text in out, text


def test_long_attention_map_turns_on_its_side(kv_inspect, model_path):
    prompt = "The quick brown fox jumps over the lazy dog " * 2
    code, out, err = kv_inspect("--layer", "3", model_path, prompt)
    assert code == 0, err
    assert "q0 (kv0)" not in out  # 19 positions do not fit 80 columns: one row per position
    assert "   0 The" in out and "q8" in out


def test_max_context_leaves_room(kv_inspect, model_path):
    code, out, err = kv_inspect("--json", "--max-context", "64", model_path, PROMPT)
    assert code == 0, err
    r = json.loads(out)
    assert (r["length"], r["capacity"]) == (4, 64)
    assert r["bytes_allocated"] == 2 * 30 * 64 * 192 * 4 and r["bytes_used"] == 2 * 30 * 4 * 192 * 4
    assert "attention" not in r


def test_paged_pool_layout_of_forked_samples(kv_inspect, model_path, filled):
    """3 sequences forked from a 4-token prompt, blocks of 2, 2 greedy tokens each: the first 3 prompt
    tokens are prefilled once (block 0 full and shared; the partial block 1 copied on write by the
    forks that write the last prompt token while it is still shared), then each sequence grows alone."""
    code, out, err = kv_inspect("--json", "--kv", "paged", "--block-size", "2", "--num-samples", "3",
                                "--decode", "2", "--layer", LAYER, model_path, PROMPT)
    assert code == 0, err
    r = json.loads(out)
    cache, ids, queries = filled  # the same tokens in a prealloc cache, alone
    assert r["cache"] == "paged" and [t["id"] for t in r["tokens"]] == ids
    tables = [seq["table"] for seq in r["blocks"]]
    assert [seq["length"] for seq in r["blocks"]] == [6, 6, 6] and [len(t) for t in tables] == [3, 3, 3]
    assert {t[0] for t in tables} == {0} and r["shared_blocks"] == [0]
    private = [block for t in tables for block in t[1:]]
    assert len(set(private)) == 6  # after the shared block, every sequence holds its own
    held = {0, *private}
    assert r["refcounts"] == [sum(block in t for t in tables) for block in range(r["pool_blocks"])]
    assert r["pool_blocks"] == 7 and r["free_blocks"] == sorted(set(range(7)) - held) == []
    assert (r["slots_allocated"], r["slots_used"], r["tokens_held"]) == (14, 14, 18)
    assert r["bytes_held"] == r["pool_bytes"] == 7 * 2 * 2 * 30 * 192 * 4
    # Sequence 0's report reads its blocks: the same K norms and attention as the prealloc cache's.
    expected = np.linalg.norm(cache.keys[7, :6].reshape(6, 3, 64), axis=-1).mean(axis=0)
    assert np.allclose(r["key_norms"][7], expected, rtol=1e-4)
    weights = np.array(r["attention"]["weights"])
    q, keys = queries[LAYER], cache.keys[LAYER, :6]
    scores = keys[:, :64] @ q[:64] / 8.0
    assert np.allclose(weights[0], np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum(),
                       atol=1e-4)

    code, out, err = kv_inspect("--kv", "paged", "--max-context", "9", "--block-size", "4", model_path,
                                PROMPT)
    assert code == 0, err
    for text in ("llama, paged cache", "block pool: 3 blocks of 4 tokens", "seq 0", "4 tokens in blocks 0",
                 "free             2 blocks: 1-2", "4 of 4 allocated slots used, 0 empty (0%)"):
        assert text in out, text


def test_a_snapshot_is_inspected_without_the_model(run_main, engine, filled, tmp_path):
    cache, ids, _ = filled
    path = tmp_path / "cache.safetensors"
    Snapshot.from_cache(cache, ids, engine.config, engine.fingerprint).save(path)
    code, out, err = run_main(main, PROG, "--json", path)
    assert code == 0, err
    r = json.loads(out)
    assert r["snapshot"] == str(path) and r["fingerprint"] == engine.fingerprint
    assert (r["length"], r["capacity"], r["bytes_used"], r["bytes_allocated"]) == (6, 6, 276480, 276480)
    assert [t["id"] for t in r["tokens"]] == ids and "text" not in r["tokens"][0]
    layer7 = np.linalg.norm(cache.keys[7, :6].reshape(6, 3, 64), axis=-1).mean(axis=0)
    assert np.allclose(r["key_norms"][7], layer7)
    code, out, _ = run_main(main, PROG, path)
    assert code == 0 and "0:6403 1:1980" in out and "mean |V| per head" in out


@pytest.mark.parametrize(
    "args, fragments",
    [
        (("--layer", "30", "Hi"), ("--layer 30 does not exist", "0..29")),
        (("--layer", "-1", "Hi"), ("--layer -1 does not exist",)),
        (("--decode", "-1", "Hi"), ("--decode must be 0 or more",)),
        (("--max-context", "2", PROMPT), ("more than the cache's 2 tokens", "--max-context 2")),
        (("",), ("prompt is empty",)),
        ((), ("missing PROMPT",)),
        (("missing.safetensors",), ("missing.safetensors: no such file",)),
        (("--num-samples", "2", "Hi"), ("--block-size and --num-samples need --kv paged",)),
        (("--kv", "paged", "--block-size", "0", "Hi"), ("--block-size must be at least 1, got 0",)),
        (("--kv", "paged", "--num-samples", "0", "Hi"), ("--num-samples must be at least 1, got 0",)),
        (("--kv", "pages", "Hi"), ("'pages' is not one of",)),
    ],
)
def test_bad_input_is_one_line_and_exit_2(kv_inspect, args, fragments):
    assert refused(kv_inspect(*args), *fragments)


def test_a_snapshot_has_no_queries_to_show(kv_inspect, engine, filled, tmp_path):
    cache, ids, _ = filled
    path = tmp_path / "cache.safetensors"
    Snapshot.from_cache(cache, ids, engine.config, engine.fingerprint).save(path)
    assert refused(kv_inspect("--layer", "0", path), "need a model")
