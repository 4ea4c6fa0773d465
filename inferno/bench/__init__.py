"""Benchmarks, run as modules of the package:

    python -m inferno.bench          inferno against llama.cpp and HF transformers (`make bench`)
    python -m inferno.bench.matvec   the quantized matrix-vector kernels against np.dot

`python -m inferno.bench` is split by what each part does: `prompts` makes the inputs, `processes` runs
one measurement in its own process, `competitors` is the llama.cpp / HF side of such a process,
`measure` runs the rounds, `figures` turns the runs into medians and ratios, `report` prints them.
"""
