#!/usr/bin/env python3
"""Writes the gguf_read seed corpus (fuzz/corpus/gguf_read/): tiny GGUFs in the real layout.

GGUF v3 and v1 files with metadata of every value type (nested arrays included), an SPM
vocabulary (`tokenizer.ggml.model = "llama"`, as Gemma 3's), a BPE one (`gpt2`, with merges),
and small tensors of the common dtypes (F32, F16, Q4_0, Q8_0). Deterministic: run it again and
the bytes are the same. Usage: python3 fuzz/gen_gguf_seeds.py
"""
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "gguf_read")
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
DT_F32, DT_F16, DT_Q4_0, DT_Q8_0 = 0, 1, 2, 8


class W:
    def __init__(self, version):
        self.v = version
        self.b = bytearray()

    def len(self, n):
        self.b += struct.pack("<I" if self.v == 1 else "<Q", n)

    def s(self, text):
        data = text.encode()
        self.len(len(data))
        self.b += data

    def value(self, ty, v):
        fmt = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
        if ty == STR:
            self.s(v)
        elif ty == ARR:
            elem_ty, items = v
            self.b += struct.pack("<I", elem_ty)
            self.len(len(items))
            for it in items:
                self.value(elem_ty, it)
        else:
            self.b += struct.pack(fmt[ty], v)


def gguf(version, kvs, tensors, alignment=32):
    w = W(version)
    w.b += b"GGUF" + struct.pack("<I", version)
    w.len(len(tensors))
    w.len(len(kvs))
    for k, ty, v in kvs:
        w.s(k)
        w.b += struct.pack("<I", ty)
        w.value(ty, v)
    offset = 0
    datas = []
    for name, dims, dtype, data in tensors:
        w.s(name)
        w.b += struct.pack("<I", len(dims))
        for d in dims:
            w.b += struct.pack("<I" if version == 1 else "<Q", d)
        w.b += struct.pack("<I", dtype) + struct.pack("<Q", offset)
        datas.append((offset, data))
        offset += len(data) + (-len(data)) % alignment
    w.b += b"\0" * ((-len(w.b)) % alignment)
    start = len(w.b)
    for off, data in datas:
        w.b += b"\0" * (start + off - len(w.b)) + data
    return bytes(w.b)


def f16(x):
    return struct.pack("<e", x)


TENSORS = [
    ("token_embd.weight", [4, 2], DT_F32, struct.pack("<8f", *[i * 0.5 for i in range(8)])),
    ("blk.0.attn_norm.weight", [3], DT_F16, b"".join(f16(x) for x in (1.0, -2.0, 0.25))),
    ("blk.0.attn_q.weight", [32, 1], DT_Q4_0, f16(0.125) + bytes(range(16))),
    ("blk.0.ffn_up.weight", [32], DT_Q8_0, f16(0.5) + bytes((i * 7) % 256 for i in range(32))),
]

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["\u2581", "h", "e", "l", "o", "he", "ll", "hell", "hello", "\u2581w", "or", "\u2581world", "\u00e9"]


def spm_kvs(add_space_prefix):
    tokens = CONTROL + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [2 if i == 3 else 3 for i in range(len(CONTROL))] + [6] * 256 + [1] * len(PIECES)
    scores = [0.0] * (len(CONTROL) + 256) + [len(p) * 10.0 - i * 0.01 for i, p in enumerate(PIECES)]
    return [
        ("general.architecture", STR, "gemma3"),
        ("general.alignment", U32, 32),
        ("gemma3.context_length", U32, 32),
        ("tokenizer.ggml.model", STR, "llama"),
        ("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        ("tokenizer.ggml.scores", ARR, (F32, scores)),
        ("tokenizer.ggml.token_type", ARR, (I32, types)),
        ("tokenizer.ggml.bos_token_id", U32, 2),
        ("tokenizer.ggml.eos_token_id", U32, 1),
        ("tokenizer.ggml.add_bos_token", BOOL, True),
        ("tokenizer.ggml.add_space_prefix", BOOL, add_space_prefix),
    ]


EVERY_TYPE = [
    ("t.u8", U8, 7), ("t.i8", I8, -7), ("t.u16", U16, 700), ("t.i16", I16, -700), ("t.u32", U32, 70000), ("t.i32", I32, -70000),
    ("t.f32", F32, 1.5), ("t.bool", BOOL, False), ("t.str", STR, "caf\u00e9"), ("t.u64", U64, 1 << 40), ("t.i64", I64, -(1 << 40)), ("t.f64", F64, 2.5),
    ("t.nested", ARR, (ARR, [(U8, [1, 2]), (STR, ["a", "bc"])])),
]

GPT2 = [
    ("general.architecture", STR, "gpt2"),
    ("tokenizer.ggml.model", STR, "gpt2"),
    ("tokenizer.ggml.pre", STR, "gpt2"),
    ("tokenizer.ggml.tokens", ARR, (STR, ["h", "e", "l", "o", "he", "ll", "hell", "hello", "\u0120", "\u0120w", "<|endoftext|>"])),
    ("tokenizer.ggml.merges", ARR, (STR, ["h e", "l l", "he ll", "hell o", "\u0120 w"])),
    ("tokenizer.ggml.token_type", ARR, (I32, [1] * 10 + [3])),
    ("tokenizer.ggml.bos_token_id", U32, 10),
    ("tokenizer.ggml.eos_token_id", U32, 10),
]

SEEDS = {
    "spm-gemma3-v3.gguf": gguf(3, spm_kvs(False), TENSORS),
    "spm-llama-v2.gguf": gguf(2, spm_kvs(True), TENSORS[:1]),
    "every-type-v1.gguf": gguf(1, EVERY_TYPE, TENSORS[1:3]),
    "gpt2-bpe-v3.gguf": gguf(3, GPT2, []),
    "alignment-64-v3.gguf": gguf(3, [("general.alignment", U32, 64)], TENSORS[2:], alignment=64),
    "header-only-v3.gguf": gguf(3, [], []),
}

if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
        print(f"{name}: {len(data)} bytes")
