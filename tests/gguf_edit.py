"""Edits a GGUF's metadata, standard library only: for tests that need a
model whose file says something else (a rope scaling, say) with the same
tensors. Shared by tests/ and python/tests/."""
import struct

# GGUF's metadata value types (ggml's gguf.h, gguf_type): fixed-size ones by
# struct format; 8 is a string, 9 an array (element type, count, elements).
_GGUF_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_skip_value(raw, at, t):
    """The offset just past a metadata value of type t at `at`."""
    if t in _GGUF_FIXED:
        return at + struct.calcsize("<" + _GGUF_FIXED[t])
    if t == 8:
        (n,) = struct.unpack_from("<Q", raw, at)
        return at + 8 + n
    assert t == 9, f"GGUF value type {t}"
    et, n = struct.unpack_from("<IQ", raw, at)
    at += 12
    if et in _GGUF_FIXED:
        return at + n * struct.calcsize("<" + _GGUF_FIXED[et])
    for _ in range(n):
        at = _gguf_skip_value(raw, at, et)
    return at


def gguf_string(x):
    """A GGUF string: uint64 length, then the UTF-8 bytes."""
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_with_metadata(src, dst, extra):
    """A copy of the GGUF (version 3) `src` at `dst` with the metadata
    `extra` added or replaced: {key: value}, a str written as a string, an
    int as uint32, a float as float32. The tensors are the same bytes: a
    model whose file says what llama.cpp's flags would otherwise say (e.g.
    rope scaling "yarn"), as such a conversion would ship."""
    with open(src, "rb") as f:
        raw = f.read()
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", raw, 0)
    assert magic == b"GGUF" and version == 3, (src, magic, version)
    at, kept, align = 24, [], 32
    for _ in range(n_kv):
        start = at
        (n,) = struct.unpack_from("<Q", raw, at)
        key = raw[at + 8:at + 8 + n].decode()
        (t,) = struct.unpack_from("<I", raw, at + 8 + n)
        at = _gguf_skip_value(raw, at + 12 + n, t)
        if key == "general.alignment":
            (align,) = struct.unpack_from("<I", raw, at - 4)
        if key not in extra:
            kept.append(raw[start:at])
    for key, v in extra.items():
        if isinstance(v, str):
            kept.append(gguf_string(key) + struct.pack("<I", 8) + gguf_string(v))
        elif isinstance(v, int):
            kept.append(gguf_string(key) + struct.pack("<II", 4, v))
        else:
            kept.append(gguf_string(key) + struct.pack("<If", 6, v))
    infos = at
    for _ in range(n_tensors):  # name, n_dims, dims, type, offset
        (n,) = struct.unpack_from("<Q", raw, at)
        (nd,) = struct.unpack_from("<I", raw, at + 8 + n)
        at += 8 + n + 4 + 8 * nd + 4 + 8
    data = at + (-at % align)
    head = struct.pack("<4sIQQ", magic, version, n_tensors, len(kept)) + b"".join(kept) + raw[infos:at]
    with open(dst, "wb") as f:
        f.write(head + b"\0" * (-len(head) % align) + raw[data:])
