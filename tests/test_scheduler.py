"""The scheduler: every cache layout and element type through one engine, requests run together,
chunked prefill, preemption, aborts, prefix sharing (both real models; a tiny one for a tiny pool)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import FIXTURES

from inferno.kv import LAYOUTS
from inferno.kv.paged import PagedKVCache
from inferno.runtime.engine import WARM_TOKENS, Engine
from inferno.runtime.scheduler import Request, SchedulerFullError

NEW = 6
PROMPT = "The capital of France is Paris. The capital of Italy is"
PROMPTS = ["Once upon a time", "The best way to learn a language is", "def fibonacci(n):",
           "In 1969, the first humans"]
ROW_TYPES = ("f32", "f16", "q8_0", "q8_0h", "q4_0", "q4_0h")
GROUPED = ("q4_recent", "q4_kivi")  # state across positions: a ring and key means, key groups
# every (layout, element type) pair a layout holds: basic f32 only; window and paged all
PAIRS = [("basic", "f32")] + [(layout, d) for layout in ("window", "paged") for d in ROW_TYPES + GROUPED]


def greedy(engine, ids: list[int], kv: str, dtype: str = "f32", **options) -> list[int]:
    return engine.run(ids, NEW, kv=kv, kv_dtype=dtype, ignore_eos=True, **options).token_ids


@pytest.mark.parametrize(("layout", "dtype"), PAIRS, ids=[f"{k}-{d}" for k, d in PAIRS])
def test_every_layout_generates_what_prealloc_of_its_element_type_generates(engine, gemma_engine, layout,
                                                                            dtype):
    assert dtype in LAYOUTS[layout].dtypes
    for model in (engine, gemma_engine):
        ids = model.tokenizer.encode(PROMPT)
        options = {"window": 64} if layout == "window" and not model.config.kv_geometry.sliding else {}
        want = greedy(model, ids, "prealloc", dtype)
        assert greedy(model, ids, layout, dtype, **options) == want, model.path


def run_all(scheduler, requests: list[Request]) -> list[list[int]]:
    ids = [scheduler.add(r) for r in requests]
    while scheduler.has_work:
        for event in scheduler.step():
            assert event.error is None
    return [scheduler.pop(i).token_ids for i in ids]


def requests_of(engine, prompts=PROMPTS, new=NEW) -> list[Request]:
    return [Request(engine.tokenizer.encode(p), new, ignore_eos=True) for p in prompts]


def test_requests_run_together_generate_what_each_generates_alone(engine):
    alone = [greedy(engine, r.prompt_ids, "paged") for r in requests_of(engine)]
    scheduler = engine.scheduler("paged", max_batch=4)
    assert run_all(scheduler, requests_of(engine)) == alone
    assert scheduler.pool.used_blocks == 0  # every finished request gave its blocks back


def test_a_step_budget_chunks_prompts_beside_decode_tokens_and_changes_no_token(engine, monkeypatch):
    long_prompts = [" ".join(PROMPTS) * 2, PROMPT * 3]
    want = run_all(engine.scheduler("paged", max_batch=3), requests_of(engine, [PROMPTS[0], *long_prompts]))
    counts = []
    forward = engine.model.forward

    def spy(tokens, caches=None, counts_=None, **kw):
        counts.append(list(counts_))
        return forward(tokens, caches, counts_, **kw)

    monkeypatch.setattr(engine.model, "forward", spy)
    got = run_all(engine.scheduler("paged", max_batch=3, step_tokens=16),
                  requests_of(engine, [PROMPTS[0], *long_prompts]))
    assert got == want
    assert max(sum(c) for c in counts) <= 16
    mixed = [c for c in counts if 1 in c and max(c) > 1]
    assert mixed, "a prompt chunk ran beside a decode token"


def test_a_short_pool_preempts_and_recomputes_without_changing_tokens(engine):
    want = run_all(engine.scheduler("paged", max_batch=4), requests_of(engine, new=24))
    scheduler = engine.scheduler("paged", max_batch=4, pool_blocks=7, block_size=8)
    assert run_all(scheduler, requests_of(engine, new=24)) == want
    assert scheduler.preemptions > 0 and scheduler.pool.used_blocks == 0


def test_a_pool_too_small_for_the_warm_up_still_runs_what_fits():
    """A pool of one 2-token block cannot hold the warm-up's tokens: the scheduler starts without it
    (the kernels then load in the first request's forwards) and runs a request that fits."""
    engine = Engine.load(FIXTURES / "tiny_qwen3.gguf")
    scheduler = engine.scheduler("paged", max_batch=1, pool_blocks=1, block_size=WARM_TOKENS - 1)
    want = engine.run([1], 1, kv="prealloc", ignore_eos=True).token_ids
    assert run_all(scheduler, [Request([1], 1, ignore_eos=True)]) == [want]


def test_abort_ends_a_request_within_a_step_and_frees_its_blocks(engine):
    scheduler = engine.scheduler("paged", max_batch=2)
    kept, dropped = (scheduler.add(r) for r in requests_of(engine, PROMPTS[:2], new=20))
    scheduler.step()
    scheduler.step()
    held = scheduler.pool.used_blocks
    assert scheduler.abort(dropped) and not scheduler.abort(dropped)
    assert scheduler.pool.used_blocks < held
    events = scheduler.step()
    assert [(e.request_id, e.finish_reason) for e in events if e.token is None] == [(dropped, "abort")]
    while scheduler.has_work:
        scheduler.step()
    assert scheduler.get(kept).finish_reason == "length" and scheduler.pool.used_blocks == 0


def test_a_full_queue_refuses_at_once(engine):
    scheduler = engine.scheduler("paged", max_batch=1, max_waiting=1)
    first, second = requests_of(engine, PROMPTS[:2])
    scheduler.add(first)
    with pytest.raises(SchedulerFullError):
        scheduler.add(second)


def test_stop_strings_and_end_tokens_end_every_request_of_a_batch(engine):
    ids = engine.tokenizer.encode(engine.prompt_text("Say hello.", chat=True))
    scheduler = engine.scheduler("paged", max_batch=2)
    free = Request(ids, 40)
    cut = Request(engine.tokenizer.encode(PROMPT), 40, stop=(".",))
    a, b = scheduler.add(free), scheduler.add(cut)
    while scheduler.has_work:
        scheduler.step()
    chat, stopped = scheduler.pop(a), scheduler.pop(b)
    assert chat.finish_reason == "stop" and "<|im_end|>" not in chat.output.text
    assert stopped.finish_reason == "stop" and stopped.output.stopped_by == "."
    assert "." not in stopped.output.text


def test_gemma_samples_hold_the_prompt_once_and_sliding_layers_only_their_window(gemma_engine):
    """8 samples of a prompt longer than Gemma 3's sliding window (512): the prompt's blocks are held
    once, and each sequence's sliding-layer groups never hold more than the window and a block."""
    engine = gemma_engine
    ids = (engine.tokenizer.encode(" ".join(PROMPTS) + " ") * 60)[:600]
    scheduler = engine.scheduler("paged", max_batch=8, pool_tokens=8 * 640)
    rids = [scheduler.add(Request(ids, 4, ignore_eos=True)) for _ in range(8)]
    pool = scheduler.pool
    window, size = 512, pool.block_size
    sliding = [g for g, group in enumerate(pool.groups) if group.window is not None]
    assert sliding and all(pool.groups[g].window == window for g in sliding)
    peak = 0
    while scheduler.has_work:
        scheduler.step()
        peak = max(peak, pool.used_blocks)
        for rid in rids:
            cache = scheduler.get(rid).cache
            if isinstance(cache, PagedKVCache):
                for g in sliding:
                    held = sum(b >= 0 for b in cache.tables[g])
                    assert held <= window // size + 2, (g, held)
    prompt_blocks = len(pool.groups) * -(-len(ids) // size)
    assert peak < 2 * prompt_blocks  # 8 unshared copies would take 8x
    assert sum(scheduler.get(r).metrics.reused_tokens for r in rids) >= 7 * (len(ids) // size - 1) * size
    assert len({tuple(scheduler.get(r).token_ids) for r in rids}) == 1
    assert np.all(pool.refs == 0)


@pytest.mark.parametrize("dtype", GROUPED)
def test_grouped_types_in_a_pool_generate_what_prealloc_generates_past_their_groups(engine, gemma_engine,
                                                                                   dtype):
    """Prompts of 170 and 200 tokens (q4_kivi closes key groups of 64, q4_recent takes key means out
    past its first segment of 128 and its ring), three requests in one pool, two of them one prompt:
    each generates what prealloc of its element type generates alone. q4_kivi's second sample adopts
    the first's whole key groups; q4_recent adopts nothing (no block holds its ring's q8_0 rows)."""
    for model in (engine, gemma_engine):
        first = (model.tokenizer.encode(" ".join(PROMPTS) + " ") * 20)[:200]
        second = (model.tokenizer.encode(PROMPT + " ") * 20)[:170]
        want = [greedy(model, ids, "prealloc", dtype) for ids in (first, second)]
        scheduler = model.scheduler("paged", kv_dtype=dtype, max_batch=3)
        rids = [scheduler.add(Request(ids, NEW, ignore_eos=True)) for ids in (first, second, first)]
        scheduler.step()
        # q4_kivi's third request waits for the first's groups; q4_recent's, which can adopt none, does not
        assert (scheduler.get(rids[2]).computed == 0) == (dtype == "q4_kivi")
        while scheduler.has_work:
            for event in scheduler.step():
                assert event.error is None
        done = [scheduler.pop(rid) for rid in rids]
        assert [g.token_ids for g in done] == [want[0], want[1], want[0]], model.path
        reused = done[2].metrics.reused_tokens
        assert reused == (192 if dtype == "q4_kivi" else 0), model.path  # 3 groups of 64: 192 of 200
        assert np.all(scheduler.pool.refs == 0)
