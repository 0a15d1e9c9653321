#!/usr/bin/env python3
"""Moves a drafter's draft vocabulary from an I32 tensor into GGUF metadata, where Tine reads it.

candle's GGUF reader knows no I32 tensors (a file holding one does not open), so Tine stores the
draft vocabulary as a metadata array of token ids: `gemma3.nextn.draft_vocab` for a NextN head
(from tensor `blk.L.nextn.draft_vocab`), `<arch>.draft_vocab` for an assistant head (from tensor
`draft_vocab`). Every other key and tensor is copied unchanged; the output is written atomically.

Usage: vocab_metadata.py IN.gguf OUT.gguf
"""
import os
import sys

import numpy as np
import gguf


def copy_fields(reader, writer, skip=lambda name: False):
    """Copies every metadata key of `reader` to `writer`, except the ones GGUFWriter writes itself
    and those `skip` names."""
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or skip(field.name):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)


def write_raw(writer, tensors, endianess):
    """Writes the header, the keys and `tensors` (reader tensors, copied byte for byte)."""
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=endianess)
    writer.close()


def convert(src, dst):
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    vocab_tensors = [t for t in reader.tensors if t.name.endswith("draft_vocab")]
    if len(vocab_tensors) != 1:
        sys.exit(f"{src}: expected one draft_vocab tensor, found {len(vocab_tensors)}")
    vt = vocab_tensors[0]
    ids = np.asarray(vt.data).astype(np.int64).reshape(-1)
    if len(set(ids.tolist())) != len(ids) or ids.min() < 0:
        sys.exit(f"{src}: the draft vocabulary must be distinct non-negative ids")
    key = "gemma3.nextn.draft_vocab" if ".nextn." in vt.name else f"{arch}.draft_vocab"
    tmp = dst + ".partial"
    writer = gguf.GGUFWriter(tmp, arch)
    copy_fields(reader, writer, skip=lambda name: name.endswith("draft_vocab_size"))
    writer.add_key_value(key, [int(i) for i in ids], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT32)
    write_raw(writer, [t for t in reader.tensors if t is not vt], reader.endianess)
    os.replace(tmp, dst)
    return key, len(ids)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    key, k = convert(sys.argv[1], sys.argv[2])
    print(f"{sys.argv[2]}: {key} = {k} token ids")
