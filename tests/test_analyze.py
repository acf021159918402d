#!/usr/bin/env python3
"""`kvtc-lab analyze` end to end at the smallest settings: a tiny real
calibration, one evaluation document per kind of a few hundred tokens,
every analysis; the JSON must hold the numbers, and bench/plots.py must draw
valid PNGs of them."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest
import zlib

from kvtc_testlib import SMOL, run, run_lab

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PLOTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "plots.py")


def png_chunks(path):
    """(type, data) of each chunk, CRCs checked."""
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:8] == PNG_SIGNATURE, path
    i, out = 8, []
    while i < len(raw):
        assert i + 12 <= len(raw), f"{path}: truncated chunk"
        (n,) = struct.unpack(">I", raw[i:i + 4])
        assert i + 12 + n <= len(raw), f"{path}: truncated chunk"
        typ, data = raw[i + 4:i + 8], raw[i + 8:i + 8 + n]
        (crc,) = struct.unpack(">I", raw[i + 8 + n:i + 12 + n])
        assert zlib.crc32(typ + data) == crc, f"{path}: bad CRC in {typ}"
        out.append((typ, data))
        i += 12 + n
    return out


class Analyze(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="kvtc-analyze-")
        cls.cal = os.path.join(cls.tmp, "cal.safetensors")
        # As test_codec_cli's second calibration (small, real, 64 components),
        # by the randomized PCA route, which is faster at this rank.
        run("calibrate", "-m", SMOL, "--tokens", "1500", "--heldout", "256", "--doc-tokens", "1024", "--rank-max", "64",
            "--ratios", "16", "--pca", "randomized", "-o", cls.cal, check=0)
        cls.out = os.path.join(cls.tmp, "out")
        cls.md = os.path.join(cls.tmp, "body.md")
        cls.proc = run_lab("analyze", "-m", SMOL, "--samples", "1", "--context", "256", "--position-context", "320",
                       "--procrustes-tokens", "512", "--calib", cls.cal, "--calib-sizes", cls.cal, "--domain-calibs",
                       f"all={cls.cal}", "-o", cls.out, "--out-md", cls.md, check=0)
        with open(os.path.join(cls.out, "analyze.json")) as f:
            cls.res = json.load(f)
        # The figures, drawn from analyze.json by matplotlib.
        cls.plots = subprocess.run([sys.executable, PLOTS, "analyze", cls.out], capture_output=True, text=True, timeout=600)
        assert cls.plots.returncode == 0, f"bench/plots.py analyze -> {cls.plots.returncode}\n{cls.plots.stdout}\n{cls.plots.stderr}"

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def test_pngs_are_pngs(self):
        for name in ("procrustes.png", "calib_size.png", "position.png", "domain.png"):
            path = os.path.join(self.out, name)
            self.assertIn(path, self.plots.stdout.split("\n"), name)
            chunks = png_chunks(path)
            types = [c[0] for c in chunks]
            # matplotlib adds chunks (pHYs, tEXt) and splits IDAT: only the frame is fixed.
            self.assertEqual((types[0], types[-1]), (b"IHDR", b"IEND"), name)
            self.assertEqual(types.count(b"IHDR"), 1, name)
            self.assertIn(b"IDAT", types, name)
            w, h, depth, colour = struct.unpack(">IIBB", chunks[0][1][:10])
            self.assertTrue(200 <= w <= 5000 and 200 <= h <= 5000, f"{name}: {w} x {h}")
            self.assertEqual(depth, 8, name)
            self.assertIn(colour, (2, 6), name)  # RGB or RGBA
            # The image data inflates to one filter byte and w pixels per row.
            pixels = zlib.decompress(b"".join(d for t, d in chunks if t == b"IDAT"))
            self.assertEqual(len(pixels), h * (1 + (3 if colour == 2 else 4) * w), name)
        self.assertEqual(sorted(os.listdir(self.out)), ["analyze.json", "calib_size.png", "domain.png", "position.png", "procrustes.png"])

    def test_json_numbers(self):
        r = self.res
        for key in ("model", "ratio", "captures", "position_captures", "procrustes", "calib_size", "position", "bits_per_component", "domain"):
            self.assertIn(key, r)
        self.assertEqual(len(r["captures"]["documents"]), 4)  # one per kind
        p = r["procrustes"]
        self.assertEqual((p["heads"], p["head_dim"]), (90, 64))
        self.assertEqual(p["tokens"], 512)  # an equal share of each capture, sinks left out
        self.assertEqual(p["heldout_fit_tokens"], 256)
        for kind in ("keys", "values"):
            s = p[kind]
            self.assertEqual(len(s["before"]), 90)
            self.assertEqual(len(s["after"][0]), 90)
            self.assertAlmostEqual(s["before"][7][7], 1.0, places=3)
            # Alignment can only help: R = I is one of the orthogonal matrices.
            self.assertGreater(s["mean_offdiag_after"], s["mean_offdiag_before"] + 0.1)
            self.assertGreater(s["mean_offdiag_after_heldout"], s["mean_offdiag_before_heldout"] + 0.1)
            self.assertLess(abs(s["mean_offdiag_before"]), 0.2)
        pos = r["position"]
        self.assertEqual(pos["context"], 320)
        self.assertEqual([b["from"] for b in pos["buckets"]], [0, 128])  # the last bucket is all raw window
        self.assertEqual(sum(b["coded_tokens"] for b in pos["buckets"]), 4 * (320 - 4 - 128))
        for b in pos["buckets"]:
            self.assertTrue(0 < b["k"] < 1 and 0 < b["v"] < 1, b)
        pt = r["calib_size"]["points"]
        self.assertEqual(len(pt), 1)
        self.assertEqual(pt[0]["calib_tokens"], "1500")
        self.assertTrue(0 < pt[0]["k"] < 1 and 0 < pt[0]["v"] < 1)
        d = r["domain"]
        self.assertEqual(d["eval_kinds"], ["prose", "docs", "code", "math"])
        self.assertEqual(d["rows"][0]["calib"], "all")
        self.assertEqual(len(d["rows"][0]["k"]), 4)
        # The same calibration on the same captures: the pooled numbers agree.
        self.assertAlmostEqual(d["rows"][0]["k_all_kinds"], pt[0]["k"], places=5)
        b = r["bits_per_component"]["blocks"]
        self.assertEqual([x["kind"] for x in b], ["keys", "values"])
        for x in b:
            self.assertLessEqual(x["bits_per_token"], x["budget_bits_per_token"])
            self.assertEqual(sum(run_["to"] - run_["from"] for run_ in x["runs"]), x["components_coded"])

    def test_markdown_embeds_images(self):
        with open(self.md) as f:
            md = f.read()
        for name in ("procrustes.png", "calib_size.png", "position.png", "domain.png"):
            self.assertIn(f"]({name})", md)

    def test_unknown_analysis_refused(self):
        p = run_lab("analyze", "--what", "procrustes,nonsense", "-o", os.path.join(self.tmp, "x"))
        self.assertEqual(p.returncode, 1)
        self.assertIn("unknown analysis 'nonsense'", p.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "x")))


if __name__ == "__main__":
    unittest.main()
