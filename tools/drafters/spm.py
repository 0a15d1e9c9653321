"""SentencePiece (GGUF `tokenizer.ggml.model = "llama"`) tokenizer, a port of Tine's
`candle_core::quantized::spm_tokenizer` (itself llama.cpp's `llm_tokenizer_spm`), so prompt token
ids here are exactly the ids `tine tokenize` prints.

transformers' GGUF tokenizer conversion splits Gemma 3 text badly ("Hello world" ->
`Hello ▁w or ld`), so the pipeline tokenizes with this instead.
"""
import heapq

import numpy as np

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = range(6)


def _type(v):
    return {2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}.get(int(v), NORMAL)


class SpmTokenizer:
    def __init__(self, tokens, scores, types, bos=2, eos=1, add_bos=True, add_space_prefix=False):
        self.tokens = tokens
        self.scores = scores
        self.types = [_type(t) for t in types]
        self.tok2id = {}
        for i, t in enumerate(tokens):
            self.tok2id[t] = i  # llama.cpp keeps the last id of a duplicated text
        self.byte_tokens = [self.tok2id.get("<0x%02X>" % b) for b in range(256)]
        specials = [i for i, t in enumerate(tokens) if self.types[i] in (CONTROL, USER_DEFINED, UNKNOWN) and t]
        specials.sort(key=lambda i: (-len(tokens[i].encode()), i))
        self.specials = specials
        self.bos, self.eos, self.add_bos, self.add_space_prefix = bos, eos, add_bos, add_space_prefix
        self.unk = next((i for i, t in enumerate(self.types) if t == UNKNOWN), None)

    @classmethod
    def from_gguf(cls, path):
        import gguf

        r = gguf.GGUFReader(path)
        f = r.fields

        def val(k, default=None):
            return f[k].contents() if k in f else default

        tokens = val("tokenizer.ggml.tokens")
        scores = np.asarray(val("tokenizer.ggml.scores"), dtype=np.float32).tolist()
        types = val("tokenizer.ggml.token_type")
        return cls(tokens, scores, types, bos=val("tokenizer.ggml.bos_token_id", 2), eos=val("tokenizer.ggml.eos_token_id", 1),
                   add_bos=bool(val("tokenizer.ggml.add_bos_token", True)),
                   add_space_prefix=bool(val("tokenizer.ggml.add_space_prefix", True)))

    def id(self, text):
        return self.tok2id[text]

    def encode(self, text, add_special=True, parse_special=True):
        out = []
        if add_special and self.add_bos and self.bos is not None:
            out.append(self.bos)
        prev_special = True
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            else:
                s = (" " if self.add_space_prefix and prev_special else "") + frag
                self._tokenize_text(s.replace(" ", "\u2581"), out)
                prev_special = False
        return out

    def _partition(self, text, parse_special):
        frags = [text]
        for i in self.specials:
            ty = self.types[i]
            if not parse_special and ty in (CONTROL, UNKNOWN):
                continue
            needle = self.tokens[i]
            if not any(isinstance(f, str) and needle in f for f in frags):
                continue
            nxt = []
            for f in frags:
                if not isinstance(f, str):
                    nxt.append(f)
                    continue
                while True:
                    pos = f.find(needle)
                    if pos < 0:
                        break
                    if pos > 0:
                        nxt.append(f[:pos])
                    nxt.append(i)
                    f = f[pos + len(needle):]
                if f:
                    nxt.append(f)
            frags = nxt
        return frags

    def _tokenize_text(self, text, out):
        # symbols: [start, len, prev, next] over characters (Python str indices)
        n = len(text)
        if n == 0:
            return
        start = list(range(n))
        length = [1] * n
        prev = [i - 1 for i in range(n)]
        nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
        heap = []
        rev = {}

        def try_add(l, r):
            if l < 0 or r < 0:
                return
            piece = text[start[l]:start[l] + length[l] + length[r]]
            tid = self.tok2id.get(piece)
            if tid is None:
                return
            # max-heap: higher score first, then leftmost
            heapq.heappush(heap, (-self.scores[tid], l, r, len(piece)))
            rev[piece] = (l, r)

        for i in range(1, n):
            try_add(i - 1, i)
        while heap:
            _, l, r, size = heapq.heappop(heap)
            if length[l] == 0 or length[r] == 0 or length[l] + length[r] != size:
                continue
            length[l] += length[r]
            length[r] = 0
            nxt[l] = nxt[r]
            if nxt[r] >= 0:
                prev[nxt[r]] = l
            try_add(prev[l], l)
            try_add(l, nxt[l])

        def reseg(idx):
            piece = text[start[idx]:start[idx] + length[idx]]
            tid = self.tok2id.get(piece)
            if tid is not None:
                out.append(tid)
                return
            if piece in rev:
                l, r = rev[piece]
                reseg(l)
                reseg(r)
                return
            for b in piece.encode("utf-8"):
                t = self.byte_tokens[b]
                if t is None:
                    t = self.unk
                if t is not None:
                    out.append(t)

        i = 0
        while i >= 0:
            reseg(i)
            i = nxt[i]

    def token_bytes(self, tid, special=False):
        ty = self.types[tid]
        t = self.tokens[tid]
        if ty in (CONTROL, UNKNOWN):
            return t.encode() if special else b""
        if ty == USER_DEFINED:
            return t.encode()
        if ty == NORMAL:
            return t.replace("\u2581", " ").encode()
        if ty == BYTE:
            return bytes([int(t[3:-1], 16)])
        return b""

    def decode(self, ids, special=False):
        return b"".join(self.token_bytes(int(i), special) for i in ids).decode("utf-8", errors="replace")
