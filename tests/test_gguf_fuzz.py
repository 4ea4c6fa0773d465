"""Mutated GGUF files: every one is refused with one line and exit code 2, or runs (see gguf_fuzz.py)."""

from __future__ import annotations

import os
from collections import Counter

from gguf_fuzz import cases_for, run_cases

CASES = 1360  # 340 per tiny model; about 13 s on 2 idle cores


def test_every_mutated_gguf_is_refused_in_one_line_or_runs():
    rows = run_cases(cases_for(CASES))
    counts = Counter(row["outcome"] for row in rows)
    print(f"GGUF fuzz: {len(rows)} cases: {counts['refused']} refused, {counts['ran']} ran, "
          f"{counts['other']} other, {counts['crash']} crashed")
    assert len(rows) == CASES
    bad = [row for row in rows if row["outcome"] not in ("refused", "ran")]
    assert not bad, "\n\n".join(
        f"{r['model']} seed {r['seed']} ({r['what']}): exit {r['code']}\n{r['stderr']}" for r in bad[:5]
    )
    assert counts["refused"] > CASES // 2 and counts["ran"] > CASES // 20  # the mutations do both


def test_a_case_that_kills_its_worker_is_isolated_and_reported():
    cases = cases_for(6)
    env = dict(os.environ, GGUF_FUZZ_ABORT_ON=f"{cases[2][0]}:{cases[2][1]}")
    rows = run_cases(cases, workers=1, env=env)
    assert sorted(row["seed"] for row in rows) == [seed for _, seed in cases]
    crashed = [row for row in rows if row["outcome"] == "crash"]
    assert [(row["seed"], row["code"]) for row in crashed] == [(cases[2][1], -6)]  # SIGABRT
