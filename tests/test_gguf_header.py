"""Our fast header reader against gguf's own GGUFReader on the same file."""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader, GGUFValueType

from clover_gguf.convert import convert
from clover_gguf.gguf_header import MAX_ARRAY, ArrayInfo, read_header, tensor_bytes


def test_header_matches_gguf_reader(tiny, tmp_path):
    out = tmp_path / "m.gguf"
    convert(tiny, out, outtype="q8_0", quiet=True)
    ours = read_header(out)
    theirs = GGUFReader(out)
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        shape, qtype = ours.tensors[t.name]
        assert shape == tuple(int(x) for x in reversed(t.shape.tolist())) and qtype == t.tensor_type
        assert tensor_bytes(qtype, shape) == int(t.n_bytes)
        assert ours.data_offset + ours.offsets[t.name] == t.data_offset
    assert ours.data_offset == theirs.data_offset
    full = read_header(out, full=True)  # every array whole, for writing the values back (export-ar)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.kv) == set(fields)
    for key, f in fields.items():
        v = ours.kv[key]
        assert ours.types[key] == (f.types[0], f.types[1] if len(f.types) > 1 else None), key
        if f.types[0] == GGUFValueType.ARRAY:
            assert full.kv[key] == f.contents(), key
            if len(f.data) > MAX_ARRAY:
                assert isinstance(v, ArrayInfo) and v.length == len(f.data), key
            else:
                assert v == f.contents(), key
        elif f.types[0] == GGUFValueType.FLOAT32:
            assert np.float32(v) == np.float32(f.contents()), key
        else:
            assert v == f.contents(), key
