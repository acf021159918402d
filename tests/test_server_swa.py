#!/usr/bin/env python3
"""kvtc-server with a sliding-window (iSWA) model: Gemma 3 270M, whose
cache keeps 3 global layers for every token and 15 sliding-window layers for
the last 512 positions (docs/store.md "Sliding-window models": the window's
state is stored in the tail, a stored prompt is restored whole). The real
binary, model, documents and HTTP client, as tests/test_server.py: a second
turn restored from the compressed RAM tier and scored against a recompute,
raw (exact) against a server that kept the conversation in its slot, from
the disk tier after a restart (bit for bit), from Redis on another replica;
prompts longer and shorter than the window; an edited turn, whose prefix
the store cannot restore, recomputed."""
import os
import shutil
import sys
import tempfile
import time
import unittest

from kvtc_testlib import GEMMA, small_calibration

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from serverlib import Redis, Server  # noqa: E402
from test_server import LOGPROBS, conversation, docs, drift, kvtc_lines  # noqa: E402

SERVER = os.environ["KVTC_SERVER_BIN"]
N_SWA = 512  # Gemma 3 270M's window (its GGUF's gemma3.attention.sliding_window)
# The GGUF carries no chat template: llama-server would fall back to ChatML,
# which Gemma does not know. Gemma's turn markers, as a Jinja template:
TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "gemma-chat.jinja")
TURN2 = "Name one person or place it mentions."


def turn2(msgs, reply, question=TURN2):
    return msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]


class KvtcServerSwa(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="kvtc-server-swa-test-")
        # A small real calibration of both blocks (kvtc_testlib.SMALL_CALIBRATION:
        # 3,000 tokens in 1,024-token documents; the window block sees the
        # last 512 of each), made once per ctest run (gemma_calibration).
        cls.cal = os.path.join(cls.tmp, "gemma.safetensors")
        small_calibration(cls.cal, GEMMA)
        # ~1,100-token conversations (longer than the window: 3 chunks of 256
        # and a tail) and a ~300-token one (within it).
        cls.long = docs("prose", 3, 1000, 4000)
        cls.short = docs("prose", 4, 1000, 1000)[3]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def start(self, name, args):
        s = Server(SERVER, GEMMA, ["--chat-template-file", TEMPLATE, *args], os.path.join(self.tmp, name + ".log"))
        self.assertTrue(s.wait_ready(), s.log()[-3000:])
        self.addCleanup(s.stop)
        return s

    def kvtc(self, *extra):
        return ["--kvtc-calib", self.cal, "--cache-ram", "64", "--parallel", "1", *extra]

    def evicted_turn2(self, s, msgs, other, max_tokens=12, question=TURN2):
        """Turn 1 of msgs, another conversation in the only slot (msgs is
        saved), then turn 2: (turn 1's timings, turn 2's messages, reply,
        timings, response)."""
        r1, t1, _ = s.chat(msgs)
        _, t_o, _ = s.chat(other, max_tokens=4)
        self.other_n = t_o["prompt_n"] + t_o["predicted_n"]
        s.wait_saved()
        m2 = turn2(msgs, r1, question)
        r2, t2, j2 = s.chat(m2, max_tokens=max_tokens, **LOGPROBS)
        return t1, m2, r2, t2, j2

    def assert_restored(self, s, t1, t2, tier="ram", hits=1):
        # The whole of turn 1 came back from the store: only the new turn was computed.
        self.assertGreaterEqual(t2["cache_n"], t1["prompt_n"], (t2, kvtc_lines(s.log())))
        self.assertLess(t2["prompt_n"], 40, t2)
        m = s.metrics()
        self.assertEqual(m[f'kvtc:hits_total{{tier="{tier}"}}'], hits, m)
        self.assertEqual(m["kvtc:restore_failures_total"], 0, m)
        # Not recomputed behind the restore's back: llama-server's own test
        # of the window (too few cells: "forcing full prompt re-processing")
        # would have thrown the restored cells away.
        self.assertNotIn("forcing full prompt re-processing", s.log())

    def test_turn_two_restored_compressed_raw_and_after_a_restart(self):
        # One conversation, turn 2 after another took the only slot, on
        # three servers: kvtc 16x (with a disk tier), kvtc --kvtc-raw (f16
        # pieces: the window's state as llama.cpp wrote it) and upstream's
        # own cache, where the conversation stays in its slot.
        store = os.path.join(self.tmp, "store")
        s = self.start("x16", self.kvtc("--kvtc-disk", store))
        raw = self.start("raw", self.kvtc("--kvtc-raw"))
        slot = self.start("slot", ["--parallel", "1"])
        a = conversation(self.long[0])
        other = conversation(self.short)
        t1, a2_msgs, a2, t2, j2 = self.evicted_turn2(s, a, other)
        self.assertGreater(t1["prompt_n"], 2 * N_SWA, t1)  # the window holds less than half the prompt
        self.assert_restored(s, t1, t2)
        _, _, w2, t_w2, j_w2 = self.evicted_turn2(raw, a, other)
        self.assert_restored(raw, t1, t_w2)
        slot.chat(a)
        o2, t_o2, j_o2 = slot.chat(a2_msgs, max_tokens=12, **LOGPROBS)
        self.assertEqual((t2["cache_n"], t2["prompt_n"]), (t_o2["cache_n"], t_o2["prompt_n"]))  # the same prefix reused
        self.assertEqual((t_w2["cache_n"], t_w2["prompt_n"]), (t_o2["cache_n"], t_o2["prompt_n"]))

        # The raw restore is the slot's state up to rounding: its window
        # cells are in position order where the slot's are a ring holding
        # older, masked cells too, so attention adds the same terms in
        # another order; a recompute of turn 2's whole prompt is the other
        # exact reference. The two references disagree themselves where a
        # token is a near tie: this document's first token flips between the
        # slot and the recompute on ggml's AVX-512 variants (0.16 apart; 12
        # of 12 agree on haswell). So the restore must be within rounding of
        # one of them. Measured (3 documents): vs the slot 0.014-0.026 mean
        # |logprob difference| (haswell), 0.014-0.016 and the flip at 0.25
        # (zen4); vs the recompute 0.009-0.054 (haswell), 0.006-0.042 (zen4).
        # Bound 0.1: a window whose cells held the content of 64 positions
        # earlier (a store cutting it wrong) measured 0.25. (SmolLM2, one
        # block, restores bit for bit: test_server.py.)
        fresh = self.start("fresh", ["--parallel", "1", "--cache-ram", "0", "--no-cache-prompt"])
        f2, t_f2, j_f2 = fresh.chat(a2_msgs, max_tokens=12, **LOGPROBS)
        self.assertEqual(t_f2["cache_n"], 0, t_f2)
        vs = {"the slot kept": drift(j_w2, j_o2), "a recompute": drift(j_w2, j_f2)}
        for ref, (agree, mean, d) in vs.items():
            print(f"Gemma 3 turn 2, raw restore vs {ref}: {agree} of 12 tokens agree, mean |logprob difference| {mean:.3f}")
        self.assertLess(min(mean for _, mean, _ in vs.values()), 0.1, (w2, o2, f2, vs))
        # 16x (the window; the global layers at 4x, the default: Gemma 3
        # 270M's global values are hard to code, held-out error 0.27 at 16x
        # with this calibration, bench/results/swa.md), scored against the
        # raw restore: the codec is the only difference. Measured on this
        # document 0 of 12 tokens agree, the first (a near tie) 0.43 away on
        # haswell, 10 of 12 and 0.040 on zen4 (0.73 and 0.06 on two other
        # documents on haswell; with the global layers at
        # 16x too 1.0, 1.8, 0.8). Bound 1.0: a loose guard, the raw restore
        # above tests what the store restores.
        agree, mean, d = drift(j2, j_w2)
        print(f"Gemma 3 turn 2 after a 16x restore vs the raw restore: {agree} of 12 tokens agree, mean |logprob difference| {mean:.3f} {d}")
        self.assertLess(mean, 1.0, (a2, w2, agree, d))
        # Held compressed: the entries of both conversations against their
        # raw states (3 global layers of every token, 15 window layers of at
        # most 512 positions; x 256 dims x K and V x 2 bytes).
        m = s.wait_saved()
        self.assertEqual(m["kvtc:saves_total"], 2, m)
        held = [t1["prompt_n"] + t1["predicted_n"], self.other_n]
        raw_bytes = sum(n * 3 * 256 * 4 + min(n, N_SWA) * 15 * 256 * 4 for n in held)
        print(f"stored {m['kvtc:ram_bytes'] / 2**20:.2f} MiB for {raw_bytes / 2**20:.2f} MiB of raw state")
        self.assertLess(m["kvtc:ram_bytes"], raw_bytes / 2, (m["kvtc:ram_bytes"], raw_bytes))
        self.assertEqual(s.stop(), 0)

        # Another process reads the disk tier back and restores the same
        # entry: the same bytes decode to the same state, bit for bit.
        s2 = self.start("restart", self.kvtc("--kvtc-disk", store))
        s2.wait_scanned()
        r2, t_r2, j_r2 = s2.chat(a2_msgs, max_tokens=12, **LOGPROBS)
        self.assert_restored(s2, t1, t_r2, tier="disk")
        self.assertEqual((t_r2["cache_n"], t_r2["prompt_n"]), (t2["cache_n"], t2["prompt_n"]))
        self.assertEqual(r2, a2)
        self.assertEqual(j_r2["choices"][0]["logprobs"], j2["choices"][0]["logprobs"])

    def test_short_prompts_and_an_edited_turn(self):
        s = self.start("short", self.kvtc())
        # Within the window: every position of both blocks is stored.
        b = conversation(self.short)
        t1, b2_msgs, _, t2, _ = self.evicted_turn2(s, b, conversation(self.long[2]), max_tokens=4)
        self.assertLess(t1["prompt_n"] + t1["predicted_n"], N_SWA, t1)
        self.assert_restored(s, t1, t2)
        # An edited turn 1 (another question after the same document): the
        # stored prompt holds the window's state at its own end only, so its
        # common prefix with the new prompt (the document) is not restored
        # from it; the long conversation in the slot is no better. Computed
        # from scratch, and as a recompute replies.
        edited = conversation(self.long[2], "Who is it for?")
        s.chat(b2_msgs, max_tokens=4)  # the slot now holds b's turn 2; a (whole) is stored
        s.wait_saved()
        r, t, j = s.chat(edited, max_tokens=8, **LOGPROBS)
        self.assertLess(t.get("cache_n", 0), 40, t)
        m = s.metrics()
        self.assertEqual(m['kvtc:hits_total{tier="ram"}'], 1, m)  # b's only
        ref, _, j_ref = s.chat(edited, max_tokens=8, cache_prompt=False, **LOGPROBS)
        self.assertEqual(r, ref)
        # (Asking a's turn 1 again, to regenerate its reply, is the same
        # case: the stored prompt ends after the reply it had.)

    def test_what_is_not_supported_yet_is_refused_at_start(self):
        for args, why in ((["--kvtc-calib", "auto"], "does not learn sliding-window"),
                          (["--kvtc-calib", self.cal, "--kvtc-ecsq"], "a sliding-window (iSWA) model's pieces are DP-coded")):
            s = Server(SERVER, GEMMA, ["--cache-ram", "64", *args], os.path.join(self.tmp, "refused.log"))
            self.assertNotEqual(s.wait_exit(120), 0)
            self.assertIn(why, s.log())

    def test_two_replicas_through_redis(self):
        r = Redis(os.path.join(self.tmp, "redis"))
        self.addCleanup(r.stop)
        a = self.start("redis-a", self.kvtc("--kvtc-redis", r.url))
        b = self.start("redis-b", self.kvtc("--kvtc-redis", r.url))
        msgs = conversation(self.long[0])
        r1, t1, _ = a.chat(msgs)  # saved to Redis when the slot is released
        t0 = time.time()
        while a.metrics().get("kvtc:redis_prompts_written_total", 0) < 1 or a.metrics().get("kvtc:pending", 0):
            self.assertLess(time.time() - t0, 120, kvtc_lines(a.log()))
            time.sleep(0.1)
        m2 = turn2(msgs, r1)
        _, t2, j2 = b.chat(m2, max_tokens=12, **LOGPROBS)
        self.assert_restored(b, t1, t2, tier="redis")
        _, _, j_ref = b.chat(m2, max_tokens=12, cache_prompt=False, **LOGPROBS)
        agree, mean, d = drift(j2, j_ref)
        # As a recompute (cache_prompt false) replies: measured 0 of 12
        # tokens agree, the first 0.33 away (the codec's error, as in the
        # test above). Bound 1.0.
        print(f"Gemma 3 turn 2 on another replica from Redis: {agree} of 12 tokens agree, mean |logprob difference| {mean:.3f}")
        self.assertLess(mean, 1.0, (agree, d))


if __name__ == "__main__":
    unittest.main(verbosity=2)
