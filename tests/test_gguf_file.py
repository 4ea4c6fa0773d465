"""open_gguf's faster parse must give exactly the fields and tensors of gguf's own GGUFReader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from conftest import FIXTURES

from inferno.errors import InfernoError
from inferno.file.reader import metadata, open_gguf


def assert_same_as_stock_reader(path) -> None:
    stock, ours = gguf.GGUFReader(path), open_gguf(path)
    assert list(ours.fields) == list(stock.fields)
    for name, want in stock.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.data, got.types) == (want.offset, want.data, want.types), name
        assert [(p.dtype, p.tobytes()) for p in got.parts] == [
            (p.dtype, p.tobytes()) for p in want.parts
        ], name
        assert got.contents() == want.contents(), name
    assert [(t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in stock.tensors
    ]
    assert ours.data_offset == stock.data_offset


def test_default_model_parses_like_the_stock_reader(model_path):
    assert_same_as_stock_reader(model_path)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_fixtures_parse_like_the_stock_reader(name):
    assert_same_as_stock_reader(FIXTURES / f"{name}.gguf")


def test_every_kind_of_array(tmp_path):
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", ["", "a", "héllo", "<|im_start|>", "x" * 300])
    writer.add_array("test.empty", [])
    writer.add_array("test.ints", [3, -1, 7])
    writer.add_array("test.floats", [0.5, -2.25])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_array("test.nul", ["a\0b", "", "\0", "c"])  # decoded one by one: a NUL splits no string
    writer.add_string("test.after", "still in step")
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    assert_same_as_stock_reader(path)
    reader = open_gguf(path)
    assert metadata(reader, "test.strings") == ["", "a", "héllo", "<|im_start|>", "x" * 300]
    assert metadata(reader, "test.ints") == [3, -1, 7]
    assert metadata(reader, "test.bools") == [True, False, True]
    assert metadata(reader, "test.after") == "still in step"
    assert metadata(reader, "test.nul") == ["a\0b", "", "\0", "c"]
    assert reader.fields["test.strings"].contents(2) == "héllo"
    assert reader.fields["test.strings"].contents(slice(1, 3)) == ["a", "héllo"]
    np.testing.assert_array_equal(reader.tensors[0].data, np.arange(64, dtype=np.float32).reshape(2, 32))


def test_text_that_is_not_utf8_is_refused_as_the_stock_reader_refuses_it(tmp_path):
    path = tmp_path / "latin1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", [b"ok", b"caf\xe9"])
    writer.add_tensor("w", np.zeros((1, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for reader in (gguf.GGUFReader(path), open_gguf(path)):
        with pytest.raises(UnicodeDecodeError):
            reader.fields["test.strings"].contents()
        assert reader.fields["test.strings"].contents(0) == "ok"
    with pytest.raises(InfernoError, match="not valid UTF-8"):
        metadata(open_gguf(path), "test.strings")
