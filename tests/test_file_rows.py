"""FileRows: an untied embedding looked up in the GGUF's own blocks, bit for bit what gguf-py and the
matrices' tiles give, from the reader's tensor and from a mapping at the tensor's offset alike."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_quant import make_blocks, reference, write_gguf

from inferno.kernels.file_rows import FileRows
from inferno.kernels.quant import SUPPORTED, QuantizedMatrix


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_rows_are_gguf_dequantized_rows(tmp_path, qtype):
    rows, cols = 70, 512
    rng = np.random.default_rng(int(qtype))
    path = tmp_path / "w.gguf"
    raw = make_blocks(qtype, rows, cols, rng)
    tensor = write_gguf(path, {"token_embd.weight": (qtype, raw)})["token_embd.weight"]
    want = reference(tensor)
    in_reader = FileRows.from_tensor(tensor)
    assert in_reader.offset == int(tensor.data_offset) and (in_reader.rows, in_reader.cols) == (rows, cols)
    mapped = FileRows.mapped(str(path), tensor.name, qtype, rows, cols, in_reader.offset)
    tiles = QuantizedMatrix.from_tensor(tensor)
    for ids in ([5], [0, 69, 5, 5], list(range(rows)), []):
        ids = np.array(ids, np.int64)
        expected = want[ids].reshape(len(ids), cols).astype(np.float32)
        for rows_of in (in_reader, mapped, tiles):
            np.testing.assert_array_equal(rows_of.rows_at(ids).view(np.uint32), expected.view(np.uint32))


def test_ids_out_of_range_and_a_mapping_past_the_file_are_refused(tmp_path):
    path = tmp_path / "w.gguf"
    qtype = Q.Q8_0
    tensor = write_gguf(path, {"w": (qtype, make_blocks(qtype, 8, 64, np.random.default_rng(0)))})["w"]
    rows = FileRows.from_tensor(tensor)
    for bad in ([8], [-1]):
        with pytest.raises(IndexError, match=r"\[0, 8\)"):
            rows.rows_at(np.array(bad))
    with pytest.raises(ValueError):
        FileRows.mapped(str(path), "w", qtype, 8, 64, path.stat().st_size - 10)
