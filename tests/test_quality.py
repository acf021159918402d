#!/usr/bin/env python3
"""A regression guard on kvtc's quality on the default model (SmolLM2-135M):
kvtc-16x's next-token KL divergence from recompute and its perplexity, on
two fixed texts of the evaluation corpus, each bounded at about twice what
it measures. A codec change that makes 16x much lossier (a coarser
allocation, a decoder error) fails here, where the other tests, which ask
only that a restored cache continues, would pass.

The calibration is the tests' small one (kvtc_testlib.small_calibration:
3,000 tokens, 512 components), not the shipped one: KL is higher than with
a full calibration (bench/results), which does not matter for a guard."""
import json
import os
import shutil
import tempfile
import unittest

from kvtc_testlib import SMOL, run_lab, small_calibration

# kvtc-lab eval's text windows are chosen by its seed (default 1, plus the
# context) among the evaluation documents: with the pinned corpus, these two
# windows of 1,024 + 128 tokens. The test checks it still gets them.
TEXTS = ("maxima/maxima_singlepage.html#part4", "maxima/maxima_58.html")

# Per text: what was measured here (AVX512-BF16: the bf16 projection) and as
# an AVX2 machine runs it (OPENBLAS_CORETYPE=Haswell for the calibration and
# the f32 projection, oneDNN capped at AVX2), then the bounds.
#   vanilla ppl: 6.72369 and 14.89895 on both (llama.cpp is built for AVX2
#     with fixed flags: the same bits on any x86 CPU). Window +-1%: it
#     checks that the texts and the model are the ones measured.
#   kvtc-16x KL from vanilla (= recompute: vanilla restores the f16 cache
#     exactly, which the run checks): 0.1313 and 0.0933 here, 0.1288 and
#     0.0933 on AVX2. Bound 2x the value measured here: 0.26 and 0.19;
#     a KL that tripled fails.
#   kvtc-16x perplexity over vanilla's: +8.73% and +5.87% here, +9.26% and
#     +6.72% on AVX2. Bound 2x the increase measured here: +17.5% and +11.7%.
#   The whole cache's ratio (1,024 tokens, 132 of them raw): 6.185 and
#     6.198 here, 6.185 and 6.199 on AVX2. Window +-3%: kvtc-16x still
#     compresses as much. With this calibration KL at 16x comes mostly from
#     the 512 components kept of 5,760 (half the bit budget measured KL
#     0.1343 on the first text, ratio 6.97): a change of budget shows in
#     the ratio, a decoder that drops components in KL (components 256 and
#     up dropped: KL 0.370, 2.8x).
VANILLA_PPL = (6.72369, 14.89895)
KL_MAX = (0.26, 0.19)
PPL_INCREASE_MAX = (0.175, 0.117)
RATIO = (6.185, 6.198)


class Quality(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="kvtc-quality-")
        cls.cal = os.path.join(cls.tmp, "cal.safetensors")
        small_calibration(cls.cal)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp)

    def test_kvtc_16x_kl_and_perplexity_on_two_texts(self):
        rec = os.path.join(self.tmp, "records.jsonl")
        p = run_lab("eval", "-m", SMOL, "--calib", self.cal, "--context", "1024", "--continuation", "128", "--samples", "2", "--tasks",
                    "ppl", "kld", "--methods", "vanilla", "kvtc-16x", "--records", rec, "--json", check=0)
        self.assertTrue(json.loads(p.stdout)["vanilla_equals_no_restore"])
        with open(rec) as f:
            recs = {(r["method"], r["index"]): r for r in map(json.loads, f)}
        for i, text in enumerate(TEXTS):
            van, kv = recs["vanilla", i], recs["kvtc-16x", i]
            self.assertEqual((van["id"], kv["id"], van["tokens"]), (text, text, 1024), "the corpus or the eval's window choice changed")
            ppl_v, ppl_k, kl = van["scores"]["ppl"], kv["scores"]["ppl"], kv["scores"]["kld"]
            ratio = kv["f16_bytes"] / kv["stored_bytes"]
            print(f"{text}: vanilla ppl {ppl_v:.5f}, kvtc-16x ppl {ppl_k:.5f} ({100 * (ppl_k / ppl_v - 1):+.2f}%), KL {kl:.4f}, ratio {ratio:.3f}")
            self.assertAlmostEqual(ppl_v, VANILLA_PPL[i], delta=0.01 * VANILLA_PPL[i])
            self.assertLess(kl, KL_MAX[i], text)
            self.assertGreater(kl, 0.0, text)
            self.assertLess(ppl_k / ppl_v - 1, PPL_INCREASE_MAX[i], text)
            self.assertAlmostEqual(ratio, RATIO[i], delta=0.03 * RATIO[i])


if __name__ == "__main__":
    unittest.main(verbosity=2)
