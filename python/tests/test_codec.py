"""The binding against the library and the CLI: the same bytes, the same
errors, arrays in every layout the binding accepts, no leak."""
import os

import numpy as np
import pytest

import kvtc
from conftest import GOLDEN, KVTC, read_capture, run


@pytest.fixture(scope="module")
def cal(smol_calibration):
    return kvtc.Calibration.load(smol_calibration)


@pytest.fixture(scope="module")
def cap(smol_capture):
    return read_capture(smol_capture)


def test_bytes_equal_the_cli_container(cal, cap, smol_capture, smol_calibration, work):
    k, v, pos, tokens, meta = cap
    out = str(work / "cli.kvtc")
    run("compress", smol_capture, "--calib", smol_calibration, "-r", "16", "-o", out)
    with open(out, "rb") as f:
        cli = f.read()
    data = cal.compress(k, v, pos, ratio=16, tokens=tokens, meta=meta)
    assert isinstance(data, bytes)
    assert data == cli
    # f32 input holding the same values, a strided view and a DLPack-only
    # producer (as a torch tensor is) give the same bytes.
    assert cal.compress(k.astype(np.float32), v.astype(np.float32), pos.astype(np.int64), tokens=tokens, meta=meta) == cli
    k_t = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # [L, T, H, D] memory, [L, H, T, D] view
    assert not k_t.flags.c_contiguous
    assert cal.compress(k_t, v, pos, tokens=tokens, meta=meta) == cli

    class DLPackOnly:
        def __init__(self, a):
            self._a = a

        def __dlpack__(self, **kw):
            return self._a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    assert cal.compress(DLPackOnly(k), DLPackOnly(v), list(map(int, pos)), tokens=tokens, meta=meta) == cli
    # Decoding: what `kvtc decompress` writes, as f16 or f32, with the tokens.
    dec = str(work / "cli-decoded.safetensors")
    run("decompress", out, "--calib", smol_calibration, "-o", dec)
    k_cli, v_cli, pos_cli, _, _ = read_capture(dec)
    k2, v2, pos2, tok2 = cal.decompress(data, return_tokens=True)
    assert k2.dtype == np.float16 and k2.shape == k.shape
    np.testing.assert_array_equal(k2, k_cli)
    np.testing.assert_array_equal(v2, v_cli)
    np.testing.assert_array_equal(pos2, pos_cli)
    np.testing.assert_array_equal(tok2, tokens)
    k3, _, _ = cal.decompress(bytearray(data), dtype="float32")
    assert k3.dtype == np.float32
    np.testing.assert_array_equal(k3, k_cli.astype(np.float32))
    # The sink is exact; the coded middle is close.
    np.testing.assert_array_equal(k2[:, :, :4], k[:, :, :4])
    np.testing.assert_array_equal(v2[:, :, :4], v[:, :, :4])  # the window is 8-bit by default: test_eight_bit_window
    kf, k2f = k.astype(np.float64), k2.astype(np.float64)
    assert ((kf - k2f) ** 2).sum() / (kf ** 2).sum() < 0.05
    info = kvtc.inspect(memoryview(data))
    assert info["calibration_id"] == cal.id
    assert info["tokens"] == k.shape[2] and info["file_bytes"] == len(data)
    assert info["ratio_whole_cache"] > 1.5 and info["blocks"][0]["nominal_ratio_k"] == 16


def test_entropy_coded_mode(cal, cap, smol_capture, smol_calibration, work):
    """coding='ecsq' writes what `kvtc compress --coding ecsq` writes
    (container version 4) and decodes to what `kvtc decompress` does."""
    k, v, pos, tokens, meta = cap
    out = str(work / "cli-ecsq.kvtc")
    run("compress", smol_capture, "--calib", smol_calibration, "-r", "18", "--coding", "ecsq", "-o", out)
    with open(out, "rb") as f:
        cli = f.read()
    data = cal.compress(k, v, pos, ratio=18, tokens=tokens, meta=meta, coding="ecsq")
    assert data == cli
    assert kvtc.inspect(data)["version"] == 4  # 32-lane rANS, the window 8-bit or not
    assert kvtc.inspect(cal.compress(k, v, pos, coding="ecsq", window_bits=16))["version"] == 4
    dec = str(work / "cli-ecsq.safetensors")
    run("decompress", out, "--calib", smol_calibration, "-o", dec)
    k_cli, v_cli, _, _, _ = read_capture(dec)
    k2, v2, _ = cal.decompress(data)
    np.testing.assert_array_equal(k2, k_cli)
    np.testing.assert_array_equal(v2, v_cli)
    # A fixed step instead of rate control; options that need ecsq refused.
    assert len(cal.compress(k, v, pos, coding="ecsq", step=0.02)) > len(cal.compress(k, v, pos, coding="ecsq", step=0.2))
    with pytest.raises(kvtc.Error, match="coding='ecsq' only"):
        cal.compress(k, v, pos, coding="dp", step=0.1)
    with pytest.raises(kvtc.Error, match="expected 'dp' or 'ecsq'"):
        cal.compress(k, v, pos, coding="huffman")
    with pytest.raises(kvtc.Error, match="joint=True"):
        cal.compress(k, v, pos, coding="ecsq", joint=True)
    # The prompt store: entropy-coded by default, the DP store another fingerprint.
    assert kvtc.PromptStore(cal, entropy_coded=True).fingerprint == kvtc.PromptStore(cal).fingerprint
    assert kvtc.PromptStore(cal, entropy_coded=False).fingerprint != kvtc.PromptStore(cal).fingerprint


def test_eight_bit_window(cal, cap, smol_capture, smol_calibration, work):
    """window_bits=8 writes what `kvtc compress --window-bits 8` writes
    (container version 4 with the default entropy coding, raw8 window sections): the window within its
    int8 quantization's error, the rest as with f16, fewer bytes; the store
    takes it too (another fingerprint)."""
    k, v, pos, tokens, meta = cap
    out = str(work / "cli-w8.kvtc")
    run("compress", smol_capture, "--calib", smol_calibration, "--window-bits", "8", "-o", out)
    with open(out, "rb") as f:
        cli = f.read()
    data = cal.compress(k, v, pos, tokens=tokens, meta=meta, window_bits=8)
    assert data == cli
    assert kvtc.inspect(data)["version"] == 4  # entropy-coded (the default) with raw8 window sections
    assert data == cal.compress(k, v, pos, tokens=tokens, meta=meta)  # the default
    f16 = cal.compress(k, v, pos, tokens=tokens, meta=meta, window_bits=16)
    assert len(data) < len(f16) - k[:, :, -128:].nbytes * 2 // 3  # the window's K and V: about half their f16 bytes saved
    k8, v8, _ = cal.decompress(data)
    k16, v16, _ = cal.decompress(f16)
    np.testing.assert_array_equal(k8[:, :, :-128], k16[:, :, :-128])
    np.testing.assert_array_equal(v8[:, :, :-128], v16[:, :, :-128])
    for a, b in ((k, k8), (v, v8)):
        w, w8 = a[:, :, -128:].astype(np.float64), b[:, :, -128:].astype(np.float64)
        err = ((w - w8) ** 2).sum() / (w ** 2).sum()
        assert 0 < err < 1e-3
    with pytest.raises(kvtc.Error, match="window_bits must be 16 or 8"):
        cal.compress(k, v, pos, window_bits=4)
    assert kvtc.PromptStore(cal, window_bits=8).fingerprint == kvtc.PromptStore(cal).fingerprint  # the default
    assert kvtc.PromptStore(cal, window_bits=8).fingerprint != kvtc.PromptStore(cal, window_bits=16).fingerprint


def test_clean_errors(cal, cap, smol_calibration):
    k, v, pos, tokens, _ = cap
    data = cal.compress(k, v, pos)

    def error(fn, *args, **kw):
        with pytest.raises(kvtc.Error) as e:
            fn(*args, **kw)
        assert isinstance(e.value, ValueError)
        return str(e.value)

    assert "expected 4 dimensions" in error(cal.compress, k[0], v[0], pos)
    assert "expected float16 or float32" in error(cal.compress, k.astype(np.int32), v, pos)
    assert "expected float16 or float32" in error(cal.compress, k.astype(np.float64), v, pos)
    assert "calibration of another model" in error(cal.compress, k[:, :2], v[:, :2], pos)
    assert "v: shape" in error(cal.compress, k, v[:, :, :-1], pos)
    assert "positions: 599 entries" in error(cal.compress, k, v, pos[:-1])
    assert "expected int32 or int64" in error(cal.compress, k, v, pos.astype(np.float32))
    bad = k.copy()
    bad[3, 1, 200, 7] = np.nan
    assert "K[layer 3, head 1, token 200, dim 7] is NaN" in error(cal.compress, bad, v, pos)
    big = v.astype(np.float32)
    big[0, 0, 10, 0] = 1e6  # beyond f16: infinite once narrowed
    assert "is infinite" in error(cal.compress, k, big, pos)
    assert "'int8'" in error(cal.decompress, data, dtype="int8")
    # Another model's calibration (the golden synthetic one), both ways.
    other = kvtc.Calibration.load(os.path.join(GOLDEN, "calibration.safetensors"))
    assert "another model" in error(other.compress, k, v, pos)
    assert "calibration" in error(other.decompress, data)
    # Truncated and corrupted bytes.
    error(cal.decompress, data[: len(data) // 2])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    error(cal.decompress, bytes(flipped))
    error(kvtc.inspect, data[:100])
    error(cal.decompress_state, data)  # a container of arrays records no llama.cpp state
    with pytest.raises(TypeError):
        cal.decompress("not bytes")
    with pytest.raises(kvtc.Error, match="no such file|cannot open|No such"):
        kvtc.Calibration.load(os.path.join(GOLDEN, "missing.safetensors"))
    dec_only = kvtc.Calibration.load(smol_calibration, decoder_only=True)
    # The DP needs the allocation tables decoder_only skips; the entropy-coded
    # default needs only the spectrum, which it keeps.
    assert "decoder_only" in error(dec_only.compress, k, v, pos, coding="dp")
    assert dec_only.decompress(dec_only.compress(k, v, pos))[0].shape == k.shape
    assert dec_only.decompress(data)[0].shape == k.shape
    assert "state" in error(kvtc.state_layout, b"\x01\x02")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_no_rss_growth_over_500_round_trips(cal, cap):
    k, v, pos, tokens, _ = cap
    k, v, pos = k[:, :, :32].copy(), v[:, :, :32].copy(), pos[:32].copy()  # 0.7 MB of f16 K+V per round trip

    def round_trip():
        # An 8-token raw window at DEFLATE level 1: the loop spends its time
        # in the binding and the codec, not in deflating the raw window.
        # ~23 ms a round trip here (37 ms with 64 tokens: 1,000 of
        # those were 34 s of make test).
        data = cal.compress(k, v, pos, ratio=16, window=8, level=1, threads=1)
        k2, v2, p2 = cal.decompress(data, threads=1)
        assert k2.shape == k.shape
        kvtc.inspect(data)
    for _ in range(100):
        round_trip()
    before = rss_bytes()
    for _ in range(400):
        round_trip()
    grown = rss_bytes() - before
    # A leaked container (~0.2 MB) or decoded cache (0.4 MB) per round trip
    # would add 86-150 MB; allocator noise stays within a few MB.
    assert grown < 32 << 20, f"RSS grew by {grown / 2**20:.1f} MiB over 400 round trips"
