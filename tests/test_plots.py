"""--plot: every figure of inferno.analysis.plots is written as a valid PNG or SVG from small synthetic
reports (the dicts the commands' --json prints), bad file names are refused in one line, and one real kv-bench
run draws its per-forward figure."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import pytest

from inferno.analysis import plots
from inferno.errors import InfernoError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def forwards_report() -> dict:
    def run(forwards):
        metrics = {"per_forward_ms": forwards, "ttft_ms": forwards[0]}
        return {"token_ids": [1] * len(forwards), "metrics": metrics}

    return {"prompt_tokens": 4, "new_tokens": 6, "identical_tokens": True,
            "runs": {"off": run([9.0, 5.0, 6.0, 7.0, 8.0, 9.0]),
                     "prealloc": run([9.0, 2.0, 2.1, 2.0, 2.0, 2.1]),
                     "paged/q8_0": run([9.0, 2.2, 2.2, 2.3, 2.2, 2.2])},
            "summary": {}}


def sweep_report() -> dict:
    rows = [{"batch": b, "decode_tok_s": 90.0 * b ** 0.8, "per_sequence_tok_s": 90.0 / b ** 0.2,
             "peak_cache_bytes": (2 + b) << 20, "unshared_peak_bytes": 3 * b << 20} for b in (1, 2, 4)]
    return {"prompt_tokens": 128, "new_tokens": 16, "block_size": 16, "activations": "f32", "sweep": rows}


def fidelity_report() -> dict:
    types = (("f32", 32, 1.0, 0.0), ("q8_0", 8.5, 0.98, 5e-4), ("q4_0", 4.5, 0.9, 2e-2))
    rows = [{"dtype": d, "activations": "f32", "bits_per_value": bits, "cache_bytes": 1000,
             "top1_agreement": a, "kl_mean": kl, "kl_max": 10 * kl, "perplexity": 18.0, "decode_ms": 8.0,
             "kernels_ms": 0.0} for d, bits, a, kl in types]
    return {"text": "synthetic", "tokens": 64, "rows": rows}


def mixed_report(timeline: bool = False) -> dict:
    rows = [{"step_tokens": budget, "itl_median_ms": 10.0, "itl_p99_ms": p99, "itl_max_ms": p99 * 1.2,
             "p99_over_median": p99 / 10, "long_prompt_ttft_ms": 900.0, "decode_tok_s": 300.0, "steps": 40}
            for budget, p99 in ((64, 14.0), (None, 95.0))]
    if timeline:
        for r in rows:
            r["itl_ms"] = [10.0, 11.0, r["itl_p99_ms"], 10.5]
    return {"decoders": 3, "prompt_tokens": 2000, "new_tokens": 16, "rounds": 1, "runs": rows}


def inspect_report() -> dict:
    tokens = [{"pos": i, "id": 10 + i, "text": t} for i, t in enumerate(["Once", " upon", " a", "\n"])]
    return {"layers": 3, "kv_heads": 2, "heads": 4, "tokens": tokens,
            "key_norms": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
            "value_norms": [[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]],
            "attention": {"layer": 1, "query_pos": 3,
                          "weights": [[0.25] * 4, [0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1], [0, 0, 0, 1]]},
            "block_size": 2, "pool_blocks": 4, "blocks": [{"sequence": 0, "length": 4, "table": [0, 1]},
                                                          {"sequence": 1, "length": 4, "table": [0, 2]}],
            "refcounts": [2, 1, 1, 0], "shared_blocks": [0], "free_blocks": [3]}


def assert_image(path) -> None:
    data = path.read_bytes()
    if path.suffix == ".png":
        assert data.startswith(PNG_MAGIC)
        import matplotlib.image

        height, width, *_ = matplotlib.image.imread(path).shape
        assert height > 100 and width > 100
    else:
        root = ET.fromstring(data)
        assert root.tag == "{http://www.w3.org/2000/svg}svg"


FIGURES = [
    (plots.plot_forwards, forwards_report()),
    (plots.plot_sweep, sweep_report()),
    (plots.plot_fidelity, fidelity_report()),
    (plots.plot_mixed, mixed_report()),
    (plots.plot_mixed, mixed_report(timeline=True)),
    (plots.plot_inspect, inspect_report()),
    (plots.plot_inspect, {k: v for k, v in inspect_report().items() if k not in ("attention", "blocks")}),
]


@pytest.mark.parametrize("ext", ["png", "svg"])
@pytest.mark.parametrize(("draw", "report"), FIGURES, ids=lambda x: getattr(x, "__name__", ""))
def test_every_figure_is_a_valid_image(tmp_path, draw, report, ext):
    path = tmp_path / f"figure.{ext}"
    draw(report, path)
    assert_image(path)


def test_svg_has_no_date_so_the_same_results_make_the_same_file(tmp_path):
    first, second = tmp_path / "a.svg", tmp_path / "b.svg"
    plots.plot_sweep(sweep_report(), first)
    plots.plot_sweep(sweep_report(), second)
    assert first.read_bytes() == second.read_bytes()


@pytest.mark.parametrize("name", ["x.pdf", "x", "x.svg.txt"])
def test_other_extensions_are_refused(tmp_path, name):
    with pytest.raises(InfernoError, match=r"must end in \.svg or \.png"):
        plots.plot_sweep(sweep_report(), tmp_path / name)
    assert not (tmp_path / name).exists()


def test_an_unwritable_file_is_one_error(tmp_path):
    with pytest.raises(InfernoError, match="cannot write --plot"):
        plots.plot_sweep(sweep_report(), tmp_path / "missing" / "x.png")


def test_matplotlib_is_imported_only_when_a_plot_is_asked_for():
    import subprocess

    code = ("import sys, inferno.analysis.plots, inferno.cli.kv_bench, inferno.cli.inspect; "
            "print('matplotlib' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_kv_bench_plot_draws_the_modes(run_main, loaded_once, tmp_path, monkeypatch):
    from inferno.cli.kv_bench import main

    monkeypatch.setenv("NO_COLOR", "1")
    path = tmp_path / "x.png"
    code, out, err = run_main(main, "kv-bench", "-n", "4", "--modes", "off,prealloc", "--plot", path)
    assert code == 0, err
    assert "KV cache modes" in out
    assert_image(path)


def test_kv_bench_refuses_a_bad_plot_name_before_loading(run_main, tmp_path):
    from inferno.cli.kv_bench import main

    code, out, err = run_main(main, "kv-bench", "--plot", tmp_path / "x.jpg")
    assert code == 2 and out == "" and err.count("\n") == 1 and "must end in .svg or .png" in err
