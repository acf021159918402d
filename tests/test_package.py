#!/usr/bin/env python3
"""The installed library as a user gets it: `cmake --install` the build,
build examples/ against the package with find_package(kvtc), and round-trip
a real cache (SmolLM2 on an evaluation document, a small real calibration)
through the example program, which includes only <kvtc/kvtc.h>."""
import os
import re
import shutil
import subprocess
import tempfile
import unittest

from kvtc_testlib import SMOL, eval_doc, run, small_calibration

CMAKE = os.environ["CMAKE_COMMAND"]
BUILD = os.environ["KVTC_BUILD_DIR"]
SOURCE = os.environ["KVTC_SOURCE_DIR"]
PUBLIC = ["cache.h", "calibration.h", "codec.h", "corpus.h", "error.h", "files.h", "kvtc.h", "llama.h", "store.h"]


def sh(*args):
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{' '.join(args)} -> {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p


class Package(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="kvtc-package-")
        cls.prefix = os.path.join(cls.tmp, "prefix")
        sh(CMAKE, "--install", BUILD, "--prefix", cls.prefix)
        cls.ex = os.path.join(cls.tmp, "examples")
        sh(CMAKE, "-S", os.path.join(SOURCE, "examples"), "-B", cls.ex, f"-DCMAKE_PREFIX_PATH={cls.prefix}", "-DCMAKE_BUILD_TYPE=Release")
        sh(CMAKE, "--build", cls.ex)
        cls.roundtrip = os.path.join(cls.ex, "roundtrip")
        # A real cache and a small real calibration of the same model.
        cls.cap = os.path.join(cls.tmp, "cap.safetensors")
        run("capture", "-m", SMOL, "-t", eval_doc("prose", 1024), "--max-tokens", "700", "-o", cls.cap, check=0)
        cls.cal = os.path.join(cls.tmp, "cal.safetensors")
        small_calibration(cls.cal)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def test_installs_exactly_the_public_headers(self):
        inc = os.path.join(self.prefix, "include", "kvtc")
        self.assertEqual(sorted(os.listdir(inc)), PUBLIC)
        for h in PUBLIC:
            with open(os.path.join(inc, h)) as f:
                quoted = re.findall(r'#include "([^"]+)"', f.read())
            self.assertTrue(all(q.startswith("kvtc/") and q[5:] in PUBLIC for q in quoted), f"{h} includes {quoted}")
        self.assertTrue(os.path.isfile(os.path.join(self.prefix, "lib", "libkvtc.a")))
        self.assertTrue(os.path.isfile(os.path.join(self.prefix, "lib", "libkvtc_llama.a")))
        self.assertTrue(os.path.isfile(os.path.join(self.prefix, "lib", "cmake", "kvtc", "kvtcConfig.cmake")))

    def test_example_uses_only_the_umbrella_header(self):
        with open(os.path.join(SOURCE, "examples", "roundtrip.cpp")) as f:
            includes = re.findall(r"^#include [<\"]([^>\"]+)[>\"]", f.read(), re.MULTILINE)
        self.assertEqual([i for i in includes if "kvtc" in i], ["kvtc/kvtc.h"])

    def test_round_trips_a_real_cache(self):
        p = subprocess.run([self.roundtrip, self.cal, self.cap, "16", "0.2"], capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        m = re.search(r"(\d+) tokens, \d+ bytes: ([\d.]+)x on the coded tokens, ([\d.]+)x on the whole cache; relative error K ([\d.]+), V ([\d.]+)",
                      p.stdout)
        self.assertIsNotNone(m, p.stdout)
        tokens, coded, whole, ek, ev = int(m[1]), float(m[2]), float(m[3]), float(m[4]), float(m[5])
        self.assertEqual(tokens, 700)
        self.assertGreater(coded, 10)  # 16x nominal lands at ~18x on real caches (bench/results/ratio.md)
        self.assertGreater(coded, whole)  # sink and window are stored raw
        self.assertGreater(ek, 0)
        self.assertLess(ek, 0.2)
        self.assertLess(ev, 0.2)

    def test_refuses_with_a_message(self):
        p = subprocess.run([self.roundtrip, self.cap, self.cap], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 1)
        self.assertIn(self.cap, p.stderr)  # the error names the file
        # An error bound the codec cannot meet fails the run.
        p = subprocess.run([self.roundtrip, self.cal, self.cap, "64", "0.0001"], capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn("error above", p.stderr)


if __name__ == "__main__":
    unittest.main()
