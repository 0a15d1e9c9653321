#!/usr/bin/env python3
"""Graft a head-only NextN GGUF (pipeline.py's output) into a copy of the target GGUF, for checking
it in the engine before `tine` grows its own graft command.

    python3 tools/drafters/graft.py --target gemma-3-270m-q4_k_m.gguf --head drafters/gemma3-270m-nextn.gguf \
        --out /tmp/grafted.gguf [--no-draft-vocab]

Copies every metadata key and tensor of the target, sets `gemma3.block_count` to the trunk's count
plus one and `gemma3.nextn_predict_layers = 1`, and appends the head's `blk.L.*` tensors as stored
(Q8_0 / F32). `--no-draft-vocab` leaves out `blk.L.nextn.draft_vocab` (an I32 tensor that engines
without reduced-vocabulary support cannot parse): the head then scores the full vocabulary.
"""
import argparse

import gguf

from vocab_metadata import copy_fields, write_raw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-draft-vocab", action="store_true")
    a = ap.parse_args()
    tr = gguf.GGUFReader(a.target)
    hr = gguf.GGUFReader(a.head)
    arch = tr.fields["general.architecture"].contents()
    n = int(tr.fields[f"{arch}.block_count"].contents())
    head_tensors = [t for t in hr.tensors if t.name.startswith(f"blk.{n}.")]
    if not head_tensors:
        raise SystemExit(f"the head has no blk.{n}.* tensors (target block_count {n})")
    if a.no_draft_vocab:
        head_tensors = [t for t in head_tensors if not t.name.endswith(".draft_vocab")]
    new = {f"{arch}.block_count": (n + 1, gguf.GGUFValueType.UINT32), f"{arch}.nextn_predict_layers": (1, gguf.GGUFValueType.UINT32)}
    w = gguf.GGUFWriter(a.out, arch)
    copy_fields(tr, w, skip=lambda name: name in new)
    for k, (v, t) in new.items():
        w.add_key_value(k, v, t)
    # a draft vocabulary stored as metadata (vocab_metadata.py's layout) travels with the head
    dv = hr.fields.get(f"{arch}.nextn.draft_vocab")
    if dv is not None and not a.no_draft_vocab:
        w.add_key_value(dv.name, dv.contents(), gguf.GGUFValueType.ARRAY, sub_type=dv.types[-1])
    write_raw(w, list(tr.tensors) + head_tensors, tr.endianess)
    print(f"grafted {len(head_tensors)} tensors of blk.{n} into {a.out}")


if __name__ == "__main__":
    main()
