#!/usr/bin/env python3
"""CLI tests of `kvtc` on the real model and real corpus text, plus every
bad input the foundation issue lists. Reads capture files with nothing but
the Python standard library, as a Python user would (safetensors is a JSON
header plus raw little-endian data)."""
import hashlib
import json
import os
import shutil
import struct
import tempfile
import unittest

from kvtc_testlib import GEMMA, SMOL, eval_doc, read_safetensors, run


class CliTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="kvtc-cli-")

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def path(self, name):
        return os.path.join(self.tmp, name)

    def assertFails(self, p, *needles):
        self.assertNotEqual(p.returncode, 0, p.stdout)
        self.assertIn("kvtc: error:", p.stderr)
        for n in needles:
            self.assertIn(n, p.stderr)
        self.assertNotIn("Aborted", p.stderr)
        self.assertGreater(p.returncode, 0, "killed by a signal")

    def assertOnlyFiles(self, *names):
        self.assertEqual(sorted(os.listdir(self.tmp)), sorted(names), "a partial or temporary file was left behind")

    def capture(self, text, n, out, *extra):
        p = run("capture", "--model", SMOL, "--text", text, "--max-tokens", str(n), "-o", out, "--json", *extra, check=0)
        return json.loads(p.stdout)

    def test_capture_file_is_plain_safetensors(self):
        out = self.path("c.safetensors")
        s = self.capture(eval_doc("prose", 1024), 128, out)
        self.assertEqual(s["tokens"], 128)
        self.assertEqual(s["bytes_per_token"], 30 * 3 * 64 * 2 * 2)
        header, meta, data = read_safetensors(out)
        self.assertEqual(header["k"]["dtype"], "F16")
        self.assertEqual(header["k"]["shape"], [30, 3, 128, 64])
        self.assertEqual(header["v"]["shape"], [30, 3, 128, 64])
        self.assertEqual(header["pos"], {"dtype": "I32", "shape": [128], "data_offsets": header["pos"]["data_offsets"]})
        self.assertEqual(header["tokens"]["shape"], [128])
        b, e = header["pos"]["data_offsets"]
        self.assertEqual(list(struct.unpack("<128i", data[b:e])), list(range(128)))
        for key in ("arch", "rope_type", "n_rot", "rope_freq_base", "rope_freq_scale", "rope_freq_factors", "model_sha256",
                    "llama_cpp_commit", "n_ctx", "n_tokens", "flash_attn", "cache_type", "format", "format_version"):
            self.assertIn(key, meta)
        self.assertEqual(meta["arch"], "llama")
        self.assertEqual(meta["rope_type"], "norm")
        self.assertEqual(meta["n_tokens"], "128")
        self.assertEqual(meta["llama_cpp_commit"], "4df29be4f")
        self.assertEqual(meta["flash_attn"], "enabled")
        with open(SMOL, "rb") as f:
            self.assertEqual(meta["model_sha256"], hashlib.sha256(f.read()).hexdigest())
        # K is not all zeros and holds finite halves.
        b, e = header["k"]["data_offsets"]
        halves = struct.unpack(f"<{(e - b) // 2}e", data[b:e])
        self.assertTrue(all(h == h and abs(h) != float("inf") for h in halves))
        self.assertGreater(sum(1 for h in halves if h != 0), len(halves) // 2)
        self.assertOnlyFiles("c.safetensors")

    def test_restore_continues_like_recompute(self):
        for fa in ("on", "off"):
            out = self.path(f"c-{fa}.safetensors")
            self.capture(eval_doc("code", 1024), 160, out, "--flash-attn", fa)
            p = run("restore", "--model", SMOL, out, "--generate", "16", "--verify", "--json", check=0)
            r = json.loads(p.stdout)
            self.assertEqual(r["greedy_agree"], 16)
            self.assertEqual(r["tokens"], 160)
            self.assertTrue(r["generated"])

    def test_gemma_capture_has_two_blocks(self):
        out = self.path("g.safetensors")
        p = run("capture", "--model", GEMMA, "--text", eval_doc("docs", 1024), "--max-tokens", "600", "-o", out, "--json", check=0)
        s = json.loads(p.stdout)
        self.assertEqual([b["n_layer"] for b in s["blocks"]], [3, 15])
        self.assertEqual([b["n_tokens"] for b in s["blocks"]], [600, 512])  # the window keeps 512
        header, meta, _ = read_safetensors(out)
        self.assertEqual(meta["rope_type"], "neox")
        self.assertEqual(json.loads(meta["layers"]), [5, 11, 17])
        self.assertEqual(header["k_swa"]["shape"], [15, 1, 512, 256])
        self.assertEqual(meta["rope_freq_base_swa"], "10000")

    def test_info_json(self):
        j = json.loads(run("info", "--json", check=0).stdout)
        self.assertEqual(j["llama_cpp_commit"], "4df29be4f")
        self.assertTrue(j["default_model"]["exists"])
        self.assertEqual(j["default_model"]["n_layer"], 30)
        self.assertEqual(j["default_model"]["kv_features_per_token"], 5760)
        self.assertTrue(j["corpus"]["built"])
        self.assertEqual(sorted(j["corpus"]["calib"]["kinds"]), ["code", "docs", "math", "prose"])
        self.assertIn("features", j["cpu"])
        # What auto runs: bf16 encode where native, else f32; int8 decode
        # where AVX2 and oneDNN's int8 run it, unless bf16 is native and
        # either AMX bf16 without AMX int8 tiles, or no AVX-512 VNNI, is
        # there (then bf16); int8 always where the int8 kernel is on the
        # AMX tiles (project.cpp's resolve_precision).
        a, native = j["auto_precision"], not j["bf16_projection"].startswith("unavailable")
        feats = j["cpu"]["features"]
        int8 = "avx2" in feats and not j["int8_projection"].startswith("unavailable")
        int8_tiles = int8 and "amx_int8" in feats and "amx" in j["int8_projection"]
        bf16_decode = not int8_tiles and native and ("amx_bf16" in feats or not int8 or "avx512_vnni" not in feats)
        self.assertEqual(a["encode"], "bf16" if native else "f32")
        self.assertEqual(a["decode"], "bf16" if bf16_decode else "int8" if int8 else "f32")

    def test_models_by_name(self):
        j = json.loads(run("info", "--json", check=0).stdout)
        names = {m["name"]: m for m in j["models"]}
        self.assertEqual(sorted(names), ["gemma3", "qwen", "smollm2"])
        self.assertTrue(names["smollm2"]["present"] and names["gemma3"]["present"])
        self.assertEqual(names["qwen"]["fetched_by"], "make models-large")
        j = json.loads(run("info", "--json", "--model", "gemma3", check=0).stdout)
        self.assertEqual(j["default_model"]["path"], names["gemma3"]["path"])
        if not names["qwen"]["present"]:  # not fetched by make test: the name says how to get it
            p = run("info", "--model", "qwen")
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("make models-large", p.stderr + p.stdout)

    def test_tokens(self):
        doc = eval_doc("math", 1024)
        j = json.loads(run("tokens", doc, check=0).stdout)
        self.assertGreaterEqual(j["tokens"], 1024)

    # ---- bad input: clear error, non-zero exit, nothing left behind ----
    def test_missing_and_non_gguf_models(self):
        text = eval_doc("prose", 1024)
        self.assertFails(run("capture", "-m", self.path("none.gguf"), "-t", text, "-o", self.path("o.safetensors")), "model file not found")
        fake = self.path("fake.gguf")
        with open(fake, "w") as f:
            f.write("not a model\n")
        self.assertFails(run("capture", "-m", fake, "-t", text, "-o", self.path("o.safetensors")), "not a GGUF")
        self.assertOnlyFiles("fake.gguf")

    def test_unreadable_empty_and_too_long_text(self):
        out = self.path("o.safetensors")
        self.assertFails(run("capture", "-t", self.path("missing.txt"), "-o", out), "missing.txt", "cannot open")
        self.assertFails(run("capture", "-t", self.tmp, "-o", out), "is a directory")
        empty = self.path("empty.txt")
        open(empty, "w").close()
        self.assertFails(run("capture", "-t", empty, "-o", out), "empty")
        self.assertFails(run("capture", "-t", eval_doc("prose", 1024), "--ctx", "256", "-o", out), "more than the context", "--max-tokens")
        self.assertOnlyFiles("empty.txt")

    def test_unwritable_output_keeps_what_was_there(self):
        text = eval_doc("prose", 1024)
        self.assertFails(run("capture", "-t", text, "--max-tokens", "32", "-o", self.path("no/such/dir/o.safetensors")), "does not exist")
        os.mkdir(self.path("adir"))
        self.assertFails(run("capture", "-t", text, "--max-tokens", "32", "-o", self.path("adir")), "is a directory")
        keep = self.path("keep.safetensors")
        with open(keep, "w") as f:
            f.write("precious")
        self.assertFails(run("capture", "-t", self.path("missing.txt"), "-o", keep))
        with open(keep) as f:
            self.assertEqual(f.read(), "precious")
        self.assertOnlyFiles("adir", "keep.safetensors")

    def test_corrupt_and_mismatched_captures(self):
        good = self.path("good.safetensors")
        self.capture(eval_doc("docs", 1024), 48, good)
        with open(good, "rb") as f:
            raw = f.read()
        trunc = self.path("trunc.safetensors")
        with open(trunc, "wb") as f:
            f.write(raw[: len(raw) - 1000])
        self.assertFails(run("restore", "-m", SMOL, trunc), "trunc.safetensors", "truncated")
        junk = self.path("junk.safetensors")
        with open(junk, "wb") as f:
            f.write(b"\x00" * 7)
        self.assertFails(run("restore", "-m", SMOL, junk), "not a safetensors file")
        # A valid safetensors file that is not a capture.
        hdr = json.dumps({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}).encode()
        other = self.path("other.safetensors")
        with open(other, "wb") as f:
            f.write(struct.pack("<Q", len(hdr)) + hdr + b"\x01")
        self.assertFails(run("restore", "-m", SMOL, other), "not a kvtc capture")
        # Another model: refused by fingerprint, and by layout when forced.
        self.assertFails(run("restore", "-m", GEMMA, good), "sha256")
        self.assertFails(run("restore", "-m", GEMMA, good, "--ignore-model-hash"), "another model")
        self.assertFails(run("restore", "-m", SMOL, self.path("absent.safetensors")), "absent.safetensors")


if __name__ == "__main__":
    unittest.main(verbosity=2)
