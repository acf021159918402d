#!/usr/bin/env python3
"""kvtc-server as its users run it: the real binary on a loopback port, the
real SmolLM2 model, real documents from the evaluation corpus, a real HTTP
client (requests). Covered: a second turn restored from the compressed RAM
tier (scored against a recompute), and from raw pieces (exact); the disk
tier across a restart, and encrypted with a secret; shared prefixes stored
once; damaged and unwritable disk tiers; bad calibrations and secret files
refused at start; a client leaving mid-stream; two slots with concurrent
clients; the upstream endpoints (/completion, /slots, /health, /metrics,
streaming)."""
import glob
import json
import os
import resource
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import unittest

import requests

from gguf_edit import gguf_string, gguf_with_metadata
from kvtc_testlib import CORPUS, SMALL_CALIBRATION, SMOL, read_safetensors, run, small_calibration

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from serverlib import Server  # noqa: E402

SERVER = os.environ["KVTC_SERVER_BIN"]
GOLDEN_CAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "v1", "calibration.safetensors")


def docs(kind, n, min_tokens, max_chars):
    """The first n evaluation documents of `kind` with min_tokens tokens, cut to max_chars."""
    with open(os.path.join(CORPUS, "manifest.json")) as f:
        m = json.load(f)
    ds = [d for d in m["documents"] if d["split"] == "eval" and d["kind"] == kind and d["tokens"] >= min_tokens][:n]
    assert len(ds) == n
    out = []
    for d in ds:
        with open(os.path.join(CORPUS, d["file"]), errors="replace") as f:
            out.append(f.read()[:max_chars])
    return out


def conversation(doc, question="Summarise the document in one sentence."):
    return [{"role": "user", "content": "Here is a document.\n\n" + doc + "\n\n" + question}]


# Asked of a chat completion: each reply token's log-probability, and the 10
# most likely tokens' at its position (llama-server computes them from the
# logits before sampling: a greedy reply's tokens carry their real
# probabilities).
LOGPROBS = {"logprobs": True, "top_logprobs": 10}


def reply_tokens(j):
    """[(token id, logprob, {id: logprob of the 10 most likely})] of a chat reply asked with LOGPROBS."""
    return [(c["id"], c["logprob"], {t["id"]: t["logprob"] for t in c["top_logprobs"]}) for c in j["choices"][0]["logprobs"]["content"]]


def drift(got, ref):
    """How far the reply `got` (after a lossy restore) strays from `ref`
    (greedy, same request): (tokens agreeing from the start, mean and list
    of |logprob under got - logprob under ref| of ref's token at each
    position up to and including the first where the tokens differ: until
    then both replies saw the same tokens, so the difference is the
    restored cache's). A token of ref missing from got's 10 most likely
    counts as infinitely far."""
    g, r = reply_tokens(got), reply_tokens(ref)
    agree = 0
    while agree < min(len(g), len(r)) and g[agree][0] == r[agree][0]:
        agree += 1
    d = [abs(g[i][2][r[i][0]] - r[i][1]) if r[i][0] in g[i][2] else float("inf") for i in range(min(agree + 1, len(g), len(r)))]
    return agree, sum(d) / len(d), d


def kvtc_lines(log):
    """The server log's slot-choice and kvtc lines: what a failed cache assertion needs to be read."""
    return "\n".join(x for x in log.splitlines() if "kvtc" in x or "selected slot" in x or "new prompt" in x)


def write_control_vector(path, n_embd, layers, value):
    """A control vector file as llama.cpp reads one (common.cpp,
    common_control_vector_load_one): GGUF version 3, no metadata, one F32
    tensor "direction.<layer>" of n_embd values per layer, data aligned to
    32 bytes (GGUF's default)."""
    layers = list(layers)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(layers), 0)
    for i, layer in enumerate(layers):
        head += gguf_string(f"direction.{layer}") + struct.pack("<IQIQ", 1, n_embd, 0, i * 4 * n_embd)  # 1 dim, F32, offset
    head += b"\0" * (-len(head) % 32)
    with open(path, "wb") as f:
        f.write(head + struct.pack(f"<{n_embd * len(layers)}f", *([value] * (n_embd * len(layers)))))


class KvtcServer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="kvtc-server-test-")
        cls.cal = os.path.join(cls.tmp, "cal.safetensors")
        small_calibration(cls.cal)
        # ~600-token documents: 2 chunks of 256 and a tail each (prefill ~2 s on 2 cores).
        cls.docs = docs("prose", 4, 1000, 2600)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def start(self, name, args, ok=True, model=SMOL, **kw):
        s = Server(SERVER, model, args, os.path.join(self.tmp, name + ".log"), **kw)
        ready = s.wait_ready()
        if ok:
            self.assertTrue(ready, s.log()[-3000:])
            self.addCleanup(s.stop)
        return s

    def kvtc(self, *extra, ram_mib=64):
        return ["--kvtc-calib", self.cal, "--cache-ram", str(ram_mib), "--parallel", "1", *extra]

    # ---- the prompt cache at work ---------------------------------------------
    def test_second_turn_restores_from_the_compressed_ram_tier(self):
        s = self.start("ram", self.kvtc())
        a = conversation(self.docs[0])
        a1, t_a1, _ = s.chat(a)
        s.chat(conversation(self.docs[1]))  # takes the only slot: A is saved
        m = s.wait_saved()
        self.assertEqual(m["kvtc:saves_total"], 1)
        # Held compressed: well under the raw f16 state of the prompt (SmolLM2:
        # 30 layers x 3 KV heads x 64 dims, K and V, 2 bytes).
        raw = (t_a1["prompt_n"] + t_a1["predicted_n"]) * 30 * 3 * 64 * 2 * 2
        self.assertGreater(m["kvtc:ram_bytes"], 0)
        self.assertLess(m["kvtc:ram_bytes"], raw / 2, (m["kvtc:ram_bytes"], raw))
        a2_msgs = a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Name one person or place it mentions."}]
        a2, t_a2, j_a2 = s.chat(a2_msgs, max_tokens=12, **LOGPROBS)
        # The whole first turn came back from the store: only the new turn was computed.
        self.assertGreaterEqual(t_a2["cache_n"], t_a1["prompt_n"], t_a2)
        self.assertLess(t_a2["prompt_n"], 40, t_a2)
        m = s.metrics()
        self.assertEqual(m['kvtc:hits_total{tier="ram"}'], 1)
        self.assertGreaterEqual(m["kvtc:tokens_restored_total"], t_a1["prompt_n"])
        self.assertEqual(m["kvtc:restore_failures_total"], 0)
        # Restored off the loop: the request's HTTP thread looked it up and
        # decoded it before its task was queued; the loop only wrote the
        # state into the slot. Measured (~600 tokens): 60-70 ms waited,
        # the loop held 1-2 ms (a 1.8K-token conversation: 239 ms, 4 ms;
        # 240 ms on the loop before). Bound: the loop's hold under half the
        # wait (an on-loop decode is the wait itself).
        print(f"restore: waited {m['kvtc:restore_wait_seconds_max'] * 1e3:.1f} ms off the loop, the loop held {m['kvtc:loop_restore_seconds_max'] * 1e3:.1f} ms")
        self.assertEqual((m["kvtc:prefetch_hits_total"], m["kvtc:prefetch_used_total"]), (1, 1), m)
        self.assertLess(m["kvtc:loop_restore_seconds_max"], 0.5 * m["kvtc:restore_wait_seconds_max"], m)
        # Restore or recompute: both costs measured, and restoring the cheaper
        # on a CPU (measured here 0.12-0.2 ms per restored token against
        # 3-4 ms of prefill per token: ~20x; bound: restoring cheaper at all).
        self.assertGreater(m["kvtc:prefill_ms_per_token"], 0, m)
        self.assertGreater(m["kvtc:restore_ms_per_token"], 0, m)
        self.assertLess(m["kvtc:restore_ms_per_token"], m["kvtc:prefill_ms_per_token"], m)
        self.assertEqual(m["kvtc:restores_declined_total"], 0, m)
        # It continues as the reply computed from scratch (cache_prompt
        # false: the prefix recomputed) does: drift() of the 12-token reply.
        # Measured here (bf16 projection) 12 of 12 tokens agreeing, mean
        # |logprob difference| 0.158 (0.015 to 0.20 per token, 0.87 at one);
        # as an AVX2 machine runs it (OPENBLAS_CORETYPE=Haswell calibration,
        # f32 projection) 12 of 12, 0.143. A raw (exact) restore measures
        # 0.032 against the same recompute (see test_a_raw_restore_is_exact).
        # Bound 0.32, 2x: the calibration and the codec's rounding vary by
        # CPU (llama.cpp's, built for AVX2 with fixed flags, does not); a
        # restore twice as far from the recompute fails.
        ref, t_ref, j_ref = s.chat(a2_msgs, max_tokens=12, cache_prompt=False, **LOGPROBS)
        self.assertEqual(t_ref.get("cache_n", 0), 0, t_ref)
        agree, mean, d = drift(j_a2, j_ref)
        print(f"second turn after a 16x restore: {agree} of 12 tokens agree, mean |logprob difference| {mean:.3f} {d}")
        self.assertLess(mean, 0.32, (a2, ref, agree, d))
        self.assertIn("kvtc: restored", s.log())

    def test_a_restore_costlier_than_recomputing_is_not_made(self):
        # --kvtc-restore-max-cost X: the store is asked only while a restore
        # costs at most X times the prefill of what it restores, both as
        # measured. Here X = 1e-6, so once both are measured (A's restore,
        # every prefill) B's second turn is recomputed, not restored, as a
        # server whose prefill outruns decoding (a GPU) would choose.
        s = self.start("declined", self.kvtc("--kvtc-restore-max-cost", "1e-6"))
        short = [d[:1200] for d in self.docs[:2]]  # ~280 tokens: more than one 128-token prefill sample each
        a, b = conversation(short[0]), conversation(short[1])
        a1, _, _ = s.chat(a)
        b1, t_b1, _ = s.chat(b)  # A saved
        s.wait_saved()
        a2, t_a2, _ = s.chat(a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Who wrote it?"}])  # restored: no cost known yet
        self.assertGreater(t_a2["cache_n"], 200, t_a2)
        s.wait_saved()
        b2, t_b2, _ = s.chat(b + [{"role": "assistant", "content": b1}, {"role": "user", "content": "Who wrote it?"}])
        m = s.metrics()
        print(f"restore {m['kvtc:restore_ms_per_token']:.3f} ms per token, prefill {m['kvtc:prefill_ms_per_token']:.3f} ms per token")
        self.assertEqual(m["kvtc:restores_declined_total"], 1, m)
        self.assertEqual(m['kvtc:hits_total{tier="ram"}'], 1, m)  # A's only
        # B's history was computed again: only the chat template's first
        # tokens, shared with A's turn in the slot, were not.
        self.assertGreater(t_b2["prompt_n"], t_b1["prompt_n"], t_b2)
        self.assertLess(t_b2["cache_n"], 40, t_b2)

    def test_a_raw_restore_is_exact(self):
        # --kvtc-raw stores f16 pieces, uncoded: a conversation swapped out
        # of its slot and restored continues bit for bit as one that stayed
        # in its slot (the reference: a second server without kvtc, one
        # slot, the same requests). Not as a recompute: that evaluates turn
        # 1's reply in the prompt's batch, where generation evaluated it
        # token by token, and llama.cpp's CPU kernels round the two apart.
        # On this document even the reference (upstream's own slot reuse)
        # replies differently from a recompute: its first token's logprob
        # is 0.054 away and another token wins.
        s = self.start("raw", self.kvtc("--kvtc-raw"))
        ref = self.start("raw-ref", ["--parallel", "1"])
        a = conversation(self.docs[2])
        turn2 = [{"role": "assistant", "content": None}, {"role": "user", "content": "Name one person or place it mentions."}]
        a1, t_a1, _ = s.chat(a)
        s.chat([{"role": "user", "content": "Say hello."}], max_tokens=4)  # takes the only slot: A is saved, raw
        s.wait_saved()
        turn2[0]["content"] = a1
        a2, t_a2, j_a2 = s.chat(a + turn2, max_tokens=12, **LOGPROBS)
        r1, _, _ = ref.chat(a)
        self.assertEqual(r1, a1)
        r2, t_r2, j_r2 = ref.chat(a + turn2, max_tokens=12, **LOGPROBS)  # A stayed in the slot
        m = s.metrics()
        self.assertEqual(m['kvtc:hits_total{tier="ram"}'], 1, m)
        self.assertGreaterEqual(m["kvtc:tokens_restored_total"], t_a1["prompt_n"], m)
        self.assertEqual((t_a2["cache_n"], t_a2["prompt_n"]), (t_r2["cache_n"], t_r2["prompt_n"]))  # the same prefix reused
        self.assertEqual(a2, r2)
        self.assertEqual(j_a2["choices"][0]["logprobs"], j_r2["choices"][0]["logprobs"])  # every logprob, bit for bit

    def test_restart_reads_the_disk_tier_back(self):
        # Turn 2 of A is asked twice: in the first server, restored from its
        # RAM tier, and after a restart, restored from the disk tier by
        # another process. The same entry's bytes decode to the same state,
        # so the two replies and every logprob must be equal bit for bit.
        # (Not a bound against a recompute: on this document the first
        # token is a near-tie that the codec's rounding decides: 8 of 8
        # tokens agreed with the recompute, mean |logprob difference| 0.138,
        # on an AVX512-BF16 CPU, 0 of 8 (0.736) with AMX or f32 on a Xeon
        # with AMX: the same codec error, rel. 0.032 K / 0.186 V either way.
        # test_second_turn_restores_from_the_compressed_ram_tier bounds
        # the drift.)
        store = os.path.join(self.tmp, "store-restart")
        s = self.start("restart-1", self.kvtc("--kvtc-disk", store))
        a = conversation(self.docs[2])
        a1, t_a1, _ = s.chat(a)
        s.chat(conversation(self.docs[3]))  # takes the only slot: A is saved
        m = s.wait_saved()
        self.assertEqual(m["kvtc:disk_enabled"], 1)
        self.assertGreaterEqual(m["kvtc:disk_prompts"], 1)
        a2_msgs = a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And in a few words?"}]
        r2, t_r2, j_r2 = s.chat(a2_msgs, **LOGPROBS)  # restored from RAM; B is saved
        m = s.wait_saved()
        self.assertEqual(m['kvtc:hits_total{tier="ram"}'], 1, kvtc_lines(s.log()))
        self.assertEqual(s.stop(), 0)
        self.assertEqual(len(glob.glob(os.path.join(store, "*", "entries", "*.kvse"))), 2)  # A and B (A's turn 2 was still in the slot)
        s2 = self.start("restart-2", self.kvtc("--kvtc-disk", store))
        self.assertIn("prompts read back", s2.log())
        self.assertEqual(s2.wait_scanned()["kvtc:disk_prompts"], 2)  # read back in the background
        a2, t_a2, j_a2 = s2.chat(a2_msgs, **LOGPROBS)
        self.assertGreaterEqual(t_a2["cache_n"], t_a1["prompt_n"], t_a2)
        self.assertEqual((t_a2["cache_n"], t_a2["prompt_n"]), (t_r2["cache_n"], t_r2["prompt_n"]))  # the same prefix restored
        m = s2.metrics()
        self.assertEqual(m['kvtc:hits_total{tier="disk"}'], 1, kvtc_lines(s2.log()))
        self.assertEqual(a2, r2)
        self.assertEqual(j_a2["choices"][0]["logprobs"], j_r2["choices"][0]["logprobs"])  # every logprob, bit for bit

    def test_a_calibration_learned_from_the_prompts_served(self):
        # --kvtc-calib auto (docs/server.md "A calibration learned from the
        # prompts served"): raw prompts in upstream's cache while learning,
        # then the fit in the background, the file beside the disk tier, the
        # store in place with the raw prompts moved into it; a restart reuses
        # the file. 1,024 tokens here (the default is 32,768); share 1000: no
        # token is skipped for cost.
        store = os.path.join(self.tmp, "store-auto")
        flags = ["--kvtc-calib", "auto", "--kvtc-calib-tokens", "1024", "--kvtc-calib-share", "1000", "--cache-ram", "256", "--parallel", "1",
                 "--kvtc-disk", store]
        s = self.start("auto-1", flags)
        self.assertEqual(s.metrics()['kvtc:calib_state{state="learning"}'], 1)
        more = docs("prose", 10, 1000, 2600)[4:]
        a = conversation(self.docs[0])
        a1, t_a1, _ = s.chat(a)
        s.chat(conversation(self.docs[1]), max_tokens=2)  # takes the slot: A goes to upstream's raw cache and to the learner
        a2_msgs = a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Shorter."}]
        a2, t_a2, _ = s.chat(a2_msgs)
        self.assertGreaterEqual(t_a2["cache_n"], t_a1["prompt_n"], t_a2)  # restored raw while learning
        # A tenant's prompt is not kept raw (upstream's cache knows no tenants).
        t_msgs = conversation(self.docs[2])
        _, t_t1, _ = s.chat(t_msgs, cache_salt="tenant-1", max_tokens=2)
        s.chat(conversation(self.docs[3]), max_tokens=2)
        _, t_t2, _ = s.chat(t_msgs, cache_salt="tenant-1", max_tokens=2)
        self.assertLess(t_t2["cache_n"], t_t1["prompt_n"] // 2, t_t2)
        for d in more:  # distinct documents until the fit's 1,024 + 64 held-out tokens
            if s.metrics()['kvtc:calib_state{state="learning"}'] == 0:
                break
            s.chat(conversation(d), max_tokens=2)
        for _ in range(600):
            m = s.metrics()
            if m['kvtc:calib_state{state="ready"}'] or m['kvtc:calib_state{state="live"}'] or m['kvtc:calib_state{state="failed"}']:
                break
            time.sleep(0.2)
        self.assertEqual(m['kvtc:calib_state{state="failed"}'], 0, kvtc_lines(s.log()))
        print(f"learned: {m['kvtc:calib_fit_tokens']:.0f} + {m['kvtc:calib_heldout_tokens']:.0f} held out of "
              f"{m['kvtc:calib_tokens_new_total']:.0f} new / {m['kvtc:calib_tokens_seen_total']:.0f} seen tokens in "
              f"{m['kvtc:calib_samples_total']:.0f} samples ({m['kvtc:calib_samples_busy_total']:.0f} not taken, busy); learner CPU "
              f"{m['kvtc:calib_learn_cpu_seconds_total']:.2f} s; loop held {m['kvtc:calib_loop_seconds_total'] * 1e3:.1f} ms in all, "
              f"max {m['kvtc:calib_loop_seconds_max'] * 1e3:.2f} ms; fit {m['kvtc:calib_fit_seconds']:.1f} s")
        self.assertGreaterEqual(m["kvtc:calib_fit_tokens"], 1024, m)
        self.assertGreaterEqual(m["kvtc:calib_heldout_tokens"], 64, m)
        # Each prefix learned once: A's second turn added only its new runs.
        self.assertLess(m["kvtc:calib_tokens_new_total"], m["kvtc:calib_tokens_seen_total"], m)
        files = glob.glob(os.path.join(store, "calibration-auto-*.safetensors"))
        self.assertEqual(len(files), 1, os.listdir(store))
        _, meta, _ = read_safetensors(files[0])
        self.assertIn("served prompts", meta["source"])
        # The next slot change puts the store in place; upstream's raw prompts move into it.
        a3_msgs = a2_msgs + [{"role": "assistant", "content": a2}, {"role": "user", "content": "In one word?"}]
        s.chat(conversation(self.docs[1]), max_tokens=2)
        m = s.wait_saved()
        self.assertEqual(m['kvtc:calib_state{state="live"}'], 1, kvtc_lines(s.log()))
        self.assertGreaterEqual(m["kvtc:calib_raw_prompts_moved"], 1, m)
        self.assertGreater(m["kvtc:ram_bytes"], 0, m)
        _, t_a3, j_a3 = s.chat(a3_msgs, **LOGPROBS)
        self.assertGreaterEqual(t_a3["cache_n"], t_a2["prompt_n"] + t_a2["cache_n"], (t_a3, kvtc_lines(s.log())))
        m = s.metrics()
        self.assertGreaterEqual(m['kvtc:hits_total{tier="ram"}'] + m['kvtc:hits_total{tier="pending"}'], 1, m)
        ref, _, j_ref = s.chat(a3_msgs, cache_prompt=False, **LOGPROBS)
        agree, mean, d = drift(j_a3, j_ref)
        print(f"a turn restored with the calibration learned from {m['kvtc:calib_fit_tokens']:.0f} served tokens: {agree} of 8 tokens agree, "
              f"mean |logprob difference| {mean:.3f} {d}")
        # Measured 0.054 (8 of 8 agree) in 3 runs; bound 0.15, ~3x: which
        # samples a busy learner skips changes the calibration.
        self.assertLess(mean, 0.15, (agree, d))
        self.assertEqual(s.stop(), 0)
        # A restart uses the file: no learning, the disk tier serves.
        s2 = self.start("auto-2", flags)
        self.assertIn("the calibration learned before", s2.log())
        m = s2.wait_scanned()
        self.assertNotIn('kvtc:calib_state{state="learning"}', m)
        self.assertGreaterEqual(m["kvtc:disk_prompts"], 1, m)
        _, t, _ = s2.chat(a3_msgs, max_tokens=2)
        self.assertGreaterEqual(t["cache_n"], t_a2["prompt_n"] + t_a2["cache_n"], (t, kvtc_lines(s2.log())))

    def test_a_secret_seals_the_disk_tier(self):
        # Refused before the model loads: a short secret file (named), and
        # --kvtc-encrypt without a secret.
        short = os.path.join(self.tmp, "short-secret")
        with open(short, "wb") as f:
            f.write(b"x" * 31)
        s = self.start("secret-short", self.kvtc("--kvtc-secret-file", short), ok=False)
        self.assertNotEqual(s.wait_exit(), 0)
        self.assertIn(short + ": the secret file holds 31 bytes, expected at least 32", s.log())
        s = self.start("secret-none", self.kvtc("--kvtc-encrypt"), ok=False)
        self.assertNotEqual(s.wait_exit(), 0)
        self.assertIn("--kvtc-encrypt needs --kvtc-secret-file", s.log())
        # Encrypted at rest on disk: a conversation restored after a restart.
        secret = os.path.join(self.tmp, "secret")
        with open(secret, "wb") as f:
            f.write(os.urandom(32))
        os.chmod(secret, 0o600)
        flags = self.kvtc("--kvtc-disk", os.path.join(self.tmp, "store-secret"), "--kvtc-secret-file", secret, "--kvtc-encrypt")
        s = self.start("secret-1", flags)
        self.assertRegex(s.log(), r"kvtc: secret \S+ \(key id [0-9a-f]{16}\): every value on disk and in Redis is encrypted and authenticated")
        self.assertNotIn("readable by", s.log())
        a = conversation(self.docs[2])
        a1, t_a1, _ = s.chat(a)
        s.chat([{"role": "user", "content": "Say hello."}], max_tokens=4)  # takes the only slot: A is saved
        self.assertEqual(s.wait_saved()["kvtc:saves_total"], 1)
        self.assertEqual(s.stop(), 0)
        s2 = self.start("secret-2", flags)
        self.assertEqual(s2.wait_scanned()["kvtc:disk_prompts"], 1)
        _, t_a2, _ = s2.chat(a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And in a few words?"}])
        self.assertGreaterEqual(t_a2["cache_n"], t_a1["prompt_n"], t_a2)
        m = s2.metrics()
        self.assertEqual(m['kvtc:hits_total{tier="disk"}'], 1)
        self.assertEqual(m["kvtc:dropped_foreign_total"], 0)

    def test_shared_prefixes_are_stored_once(self):
        s = self.start("dedup", self.kvtc())
        prefix = self.docs[0] + "\n\n" + self.docs[1][:1200]  # ~900 tokens shared: 3 chunks of 256
        questions = ["Who is speaking?", "What is the tone?", "Give a title.", "What happens first?"]
        others = ["Say hello.", "Count to three.", "Name a colour.", "Name a fruit."]
        for q, o in zip(questions, others):
            s.chat(conversation(prefix, q), max_tokens=4)
            s.chat([{"role": "user", "content": o}], max_tokens=4)  # takes the slot: the chat above is saved
        m = s.wait_saved()
        n = len(questions)
        self.assertGreaterEqual(m["kvtc:saves_total"], n)
        # Every chat after the first found the prefix's chunks stored already.
        self.assertGreaterEqual(m["kvtc:chunks_shared_total"], 3 * (n - 1), m)
        # A chat restored the shared prefix from its neighbour instead of recomputing it
        # (from RAM, or from the queue when the neighbour was still being compressed).
        self.assertGreaterEqual(m['kvtc:hits_total{tier="ram"}'] + m['kvtc:hits_total{tier="pending"}'], n - 1, m)
        self.assertLessEqual(m["kvtc:ram_chunks"], 3 + 2 * n, m)

    # ---- what the store's keys name ---------------------------------------------
    def test_other_rope_settings_never_share_a_store(self):
        # The store's salt names the context's RoPE as llama.cpp resolved it
        # (docs/store.md "Keys"): a disk tier filled with the model's own
        # base is another store for a server run with --rope-freq-base
        # 20000, whose keys are rotated otherwise. No hit, nothing read back,
        # and the reply is the one a server without kvtc gives with the flag.
        store = os.path.join(self.tmp, "store-rope")
        s = self.start("rope-1", self.kvtc("--kvtc-disk", store))
        a = conversation(self.docs[1])
        a1, t_a1, _ = s.chat(a)
        s.chat([{"role": "user", "content": "Say hello."}], max_tokens=4)
        s.wait_saved()
        self.assertIn("rope_freq_base=100000;", s.log())  # SmolLM2's own, from its GGUF
        self.assertEqual(s.stop(), 0)
        turn2 = a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Name one person or place it mentions."}]
        s2 = self.start("rope-2", self.kvtc("--kvtc-disk", store, "--rope-freq-base", "20000"))
        self.assertIn("rope_freq_base=20000;", s2.log())
        self.assertEqual(s2.wait_scanned()["kvtc:disk_prompts"], 0)
        got, t_got, j_got = s2.chat(turn2, max_tokens=12, **LOGPROBS)
        self.assertEqual(t_got.get("cache_n", 0), 0, t_got)
        m = s2.metrics()
        for tier in ("ram", "pending", "disk"):
            self.assertEqual(m[f'kvtc:hits_total{{tier="{tier}"}}'], 0, m)
        ref = self.start("rope-ref", ["--parallel", "1", "--rope-freq-base", "20000"])
        want, _, j_want = ref.chat(turn2, max_tokens=12, **LOGPROBS)
        self.assertEqual(got, want)
        self.assertEqual(j_got["choices"][0]["logprobs"], j_want["choices"][0]["logprobs"])
        s2.stop()
        # The store of the model's own settings is still there, and read back.
        s3 = self.start("rope-3", self.kvtc("--kvtc-disk", store))
        self.assertEqual(s3.wait_scanned()["kvtc:disk_prompts"], 1)
        _, t3, _ = s3.chat(turn2, max_tokens=4)
        self.assertGreaterEqual(t3["cache_n"], t_a1["prompt_n"], t3)

    def test_a_context_with_yarn_restores_as_close_as_plain_rope(self):
        # The codec removes the rotation the context's keys carry: under
        # --rope-scaling yarn that is YaRN's (the context's settings), not the
        # GGUF's plain RoPE. Coded with the GGUF's, SmolLM2 at 16x had KL
        # 0.82 against the uncompressed cache, 0.019 with the context's and
        # 0.012 under plain RoPE (4 documents, bench/results/rope-settings.md). Measured here: the restored turn
        # agrees with the recompute on 12 of 12 greedy tokens, mean |logprob
        # difference| 0.114 (plain RoPE: 12, 0.154); coded with the GGUF's
        # RoPE, 7 of 12 (0.154 until they part). Bounds: 10 tokens, and
        # test_second_turn_restores_from_the_compressed_ram_tier's 0.32.
        yarn = ["--rope-scaling", "yarn", "--rope-scale", "2", "--yarn-orig-ctx", "2048"]
        s = self.start("yarn", self.kvtc(*yarn))
        self.restored_turn_agrees(s, "YaRN x2")
        self.assertIn("yarn_ext_factor=1;", s.log())

    def restored_turn_agrees(self, s, what):
        """A saved conversation's second turn, restored on `s`, against its
        recompute: mean |logprob difference| below 0.2 (measured 0.111-0.114
        with YaRN by flags and 0.121-0.132 with the GGUF's own on an AVX2
        and a Zen 4 EPYC; a decoder broken on purpose to scale K and V by
        1.15 gave 0.227-0.237) and, where the greedy replies part, a close
        call there: the recompute preferred its token to the restored
        reply's by less than 0.64 nats, two of the per-token moves a 16x
        restore makes (up to 0.38 at a token in the YaRN-flags test), one
        down and one up. (The GGUF's own YaRN agreed on 12 of 12 tokens on
        the AVX2 EPYC; on the Zen 4 it parts at token 4 with a margin of
        0.346, with the code before 2026-12-05 too: the CPU's arithmetic,
        not a change of the restore.)"""
        a = conversation(self.docs[0])
        a1, t_a1, _ = s.chat(a)
        s.chat(conversation(self.docs[1]))  # takes the only slot: A is saved
        m = s.wait_saved()
        self.assertEqual(m["kvtc:saves_total"], 1, kvtc_lines(s.log()))
        a2_msgs = a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Name one person or place it mentions."}]
        _, t_a2, j_a2 = s.chat(a2_msgs, max_tokens=12, **LOGPROBS)
        self.assertGreaterEqual(t_a2["cache_n"], t_a1["prompt_n"], t_a2)
        _, t_ref, j_ref = s.chat(a2_msgs, max_tokens=12, cache_prompt=False, **LOGPROBS)
        self.assertEqual(t_ref.get("cache_n", 0), 0, t_ref)
        agree, mean, d = drift(j_a2, j_ref)
        g, r = reply_tokens(j_a2), reply_tokens(j_ref)
        margin = r[agree][1] - r[agree][2].get(g[agree][0], float("-inf")) if agree < min(len(g), len(r)) else 0.0
        print(f"{what}: second turn after a 16x restore: {agree} of 12 tokens agree, mean |logprob difference| {mean:.3f} {d}; "
              f"the recompute's margin where they part {margin:.3f}")
        self.assertLess(margin, 0.64, (agree, d))
        self.assertLess(mean, 0.2, (agree, d))

    def test_a_gguf_that_asks_for_yarn_itself_is_coded_under_it(self):
        # Some conversions ship YaRN in the GGUF (rope scaling "yarn", as
        # 128K Qwen2.5 and gpt-oss GGUFs do) rather than in flags: llama.cpp
        # resolves its parameters when it creates the context, and kvtc
        # takes them from there, as for the flags. Here SmolLM2 whose file
        # says what the test above's flags say. Before, no rotation could be
        # built from such a GGUF: every save failed and every turn was
        # recomputed. Measured: the calibration (fitted through a context of
        # this file, so under its YaRN) and a 16x restore agree with the
        # recompute on 12 of 12 greedy tokens, mean |logprob difference|
        # 0.121; with the GGUF's YaRN left unresolved, `kvtc calibrate`
        # refuses the model. Bounds as the test above's.
        gguf = os.path.join(self.tmp, "smol-yarn.gguf")
        gguf_with_metadata(SMOL, gguf, {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.0,
                                        "llama.rope.scaling.original_context_length": 2048})
        cal = os.path.join(self.tmp, "cal-yarn.safetensors")
        run("calibrate", "-m", gguf, *SMALL_CALIBRATION, "-o", cal, check=0)
        _, meta, _ = read_safetensors(cal)
        self.assertEqual((meta["rope_scaling_type"], meta["yarn_ext_factor"], meta["n_ctx_orig_yarn"]), ("yarn", "1", "2048"), meta)
        s = self.start("gguf-yarn", ["--kvtc-calib", cal, "--cache-ram", "64", "--parallel", "1"], model=gguf)
        self.assertIn("rope_freq_scale=0.5;n_ctx_orig_yarn=2048;yarn_ext_factor=1;", s.log())
        self.restored_turn_agrees(s, "the GGUF's own YaRN x2")

    def test_a_rotation_kvtc_cannot_undo_is_refused_at_start(self):
        # Phi-3's "longrope" (here on SmolLM2's file: llama.cpp runs it, the
        # Llama graph reads no long-context factors) is a rotation kvtc does
        # not undo. Said once at start, not by a failed save at every turn.
        gguf = os.path.join(self.tmp, "smol-longrope.gguf")
        gguf_with_metadata(SMOL, gguf, {"llama.rope.scaling.type": "longrope"})
        s = self.start("longrope", self.kvtc(), ok=False, model=gguf)
        self.assertNotEqual(s.wait_exit(), 0)
        self.assertRegex(s.log(), r"kvtc: this model's keys carry a rotation kvtc cannot undo.*rope scaling 'longrope'")

    def test_settings_the_keys_cannot_name_are_refused(self):
        # --override-kv changes the model without changing its file (what
        # the keys and the calibration name); refused as LoRA adapters are.
        s = self.start("override", self.kvtc("--override-kv", "llama.rope.freq_base=float:20000"), ok=False)
        self.assertNotEqual(s.wait_exit(), 0)
        self.assertRegex(s.log(), r"kvtc: .*--override-kv is not supported")

    def test_control_vectors_are_refused(self):
        # A control vector adds a direction to every layer's hidden state:
        # every key and value changes while the model file (what the keys
        # name) does not. A valid one (SmolLM2: 576 wide, layers 1-29), as
        # llama.cpp's loader reads it: llama-server starts with it alone;
        # with --kvtc-calib kvtc refuses it at start.
        cv = os.path.join(self.tmp, "direction.gguf")
        write_control_vector(cv, n_embd=576, layers=range(1, 30), value=0.01)
        plain = self.start("cv-plain", ["--control-vector", cv, "--parallel", "1"])
        self.assertTrue(plain.chat([{"role": "user", "content": "Say hello."}], max_tokens=4)[0].strip())
        self.assertNotRegex(plain.log(), r"(?i)control vector")  # llama.cpp logs only a file it cannot use (and serves on)
        self.assertEqual(plain.stop(), 0)
        s = self.start("cv", self.kvtc("--control-vector", cv), ok=False)
        self.assertNotEqual(s.wait_exit(), 0)
        self.assertRegex(s.log(), r"kvtc: .*control vectors are not supported")

    def test_a_shifted_cache_is_not_saved(self):
        # A context shift moves the slot's cells past n_keep to other
        # positions: their K/V is no longer what a prefill of the slot's
        # tokens computes, so the slot is not saved while it holds them.
        s = self.start("shift", ["--kvtc-calib", self.cal, "--cache-ram", "64", "--parallel", "1", "-c", "256", "--context-shift"])
        r = requests.post(s.url + "/completion", json={"prompt": self.docs[0][:400], "n_predict": 200, "temperature": 0, "ignore_eos": True,
                                                      "cache_prompt": True}, timeout=300)
        self.assertEqual(r.status_code, 200, r.text[:500])
        self.assertIn("slot context shift", s.log())
        s.chat([{"role": "user", "content": "Say hello."}], max_tokens=4)  # takes the slot: a save is asked
        m = s.wait_saved()
        self.assertGreaterEqual(m["kvtc:shifted_not_saved_total"], 1, m)
        self.assertEqual(m["kvtc:saves_total"], 0, m)
        self.assertIn("was shifted", s.log())
        # Once the slot has been recomputed past n_keep, it is saved again
        # (a prompt unlike the slot's, so that llama-server takes the slot
        # by LRU and saves what it held: a similar one would just continue it).
        r = requests.post(s.url + "/completion", json={"prompt": self.docs[1][:300], "n_predict": 4, "temperature": 0}, timeout=300)
        self.assertEqual(r.status_code, 200, r.text[:500])
        m = s.wait_saved()
        self.assertGreaterEqual(m["kvtc:saves_total"], 1, m)

    def test_waking_from_sleep_keeps_the_store(self):
        # --sleep-idle-seconds frees the model and context when idle; waking
        # reloads them. The store is kept across (nothing reloaded, hashed or
        # rescanned: the calibration file may even be gone by then), so a
        # conversation saved before the sleep is restored after it.
        cal = os.path.join(self.tmp, "cal-sleep.safetensors")
        shutil.copy(self.cal, cal)
        s = self.start("sleep", ["--kvtc-calib", cal, "--cache-ram", "64", "--parallel", "1", "--sleep-idle-seconds", "2"])
        a = conversation(self.docs[3])
        a1, t_a1, _ = s.chat(a)
        s.chat([{"role": "user", "content": "Say hello."}], max_tokens=4)  # A is saved
        s.wait_saved()
        t0 = time.time()
        while "entering sleeping state" not in s.log():
            self.assertLess(time.time() - t0, 60, s.log()[-2000:])
            time.sleep(0.5)
        os.remove(cal)  # a wake that reloaded the calibration would fail now
        _, t_a2, _ = s.chat(a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Shorter."}], max_tokens=4)
        self.assertIn("exiting sleeping state", s.log())
        self.assertIn("kvtc: awake with the store kept", s.log())
        self.assertGreaterEqual(t_a2["cache_n"], t_a1["prompt_n"], t_a2)
        m = s.metrics()
        self.assertEqual(m['kvtc:hits_total{tier="ram"}'], 1, m)
        self.assertNotIn("kvtc:disabled", str(m))

    # ---- tenants ----------------------------------------------------------------
    def test_tenants_never_reuse_each_others_prompts(self):
        # One slot, two API keys, --kvtc-tenant-from-api-key (docs/server.md
        # "Tenants"). Key 2 sends key 1's exact conversation: llama-server
        # would pick the slot by similarity and reuse all of key 1's cells;
        # here the slot is saved for key 1 and emptied, so key 2's prompt is
        # computed from nothing (cache_n 0) and its reply is the recompute's
        # (key 1's first turn was one too: equal, every logprob). Key 1's
        # next turn is then restored from the store; the same turn with a
        # cache_salt is another tenant again (recomputed).
        s = self.start("tenants", self.kvtc("--api-key", "k-one,k-two", "--kvtc-tenant-from-api-key"))

        def chat(key, messages, **extra):
            body = {"messages": messages, "max_tokens": 8, "temperature": 0, "seed": 1, **LOGPROBS, **extra}
            r = requests.post(s.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer " + key}, timeout=600)
            self.assertEqual(r.status_code, 200, r.text[:500])
            j = r.json()
            return j["choices"][0]["message"]["content"], j.get("timings", {}), j

        a = conversation(self.docs[0][:1200])
        a1, t_a1, j_a1 = chat("k-one", a)
        b1, t_b1, j_b1 = chat("k-two", a)
        self.assertEqual(t_b1.get("cache_n", 0), 0, t_b1)
        self.assertEqual(t_b1["prompt_n"], t_a1["prompt_n"])
        self.assertEqual(b1, a1)
        self.assertEqual(j_b1["choices"][0]["logprobs"], j_a1["choices"][0]["logprobs"])
        a2_msgs = a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Shorter."}]
        _, t_a2, _ = chat("k-one", a2_msgs)
        self.assertGreaterEqual(t_a2.get("cache_n", 0), t_a1["prompt_n"], t_a2)
        _, t_s2, _ = chat("k-one", a2_msgs, cache_salt="another tenant of key one")
        self.assertEqual(t_s2.get("cache_n", 0), 0, t_s2)
        log = s.log()
        self.assertIn("held another tenant's prompt", log)
        self.assertNotIn("k-one", log)  # only the key's hash is used, and never logged
        # A bad cache_salt is the client's error, named.
        for bad, why in ((7, "a string is expected, got number"), ("", "a non-empty string"), ("x" * 257, "at most 256 bytes")):
            r = requests.post(s.url + "/completion", json={"prompt": "Hi", "n_predict": 1, "cache_salt": bad},
                              headers={"Authorization": "Bearer k-one"}, timeout=60)
            self.assertEqual(r.status_code, 400, r.text[:300])
            self.assertIn("cache_salt: " + why, r.text)

    # ---- faults and bad input --------------------------------------------------
    def test_a_calibration_for_another_model_is_refused(self):
        s = self.start("othermodel", ["--kvtc-calib", GOLDEN_CAL, "--cache-ram", "64"], ok=False)
        self.assertNotEqual(s.wait_exit(), 0)
        self.assertRegex(s.log(), r"kvtc: refusing to start: .*calibration\.safetensors: .*wrong calibration for this model")

    def test_a_damaged_calibration_is_refused(self):
        bad = os.path.join(self.tmp, "damaged.safetensors")
        with open(self.cal, "rb") as f:
            data = bytearray(f.read())
        data[len(data) // 2] ^= 0x40
        with open(bad, "wb") as f:
            f.write(data)
        s = self.start("damagedcal", ["--kvtc-calib", bad, "--cache-ram", "64"], ok=False)
        self.assertNotEqual(s.wait_exit(), 0)
        self.assertRegex(s.log(), r"kvtc: refusing to start: .*damaged\.safetensors.*checksum")
        # A quantized cache: kvtc codes f16 caches.
        s = self.start("q8cache", ["--kvtc-calib", self.cal, "--cache-ram", "64", "--cache-type-k", "q8_0", "--cache-type-v", "q8_0",
                                   "-fa", "on"], ok=False)
        self.assertNotEqual(s.wait_exit(), 0)
        self.assertRegex(s.log(), r"kvtc: refusing to start: .*f16")
        # And without the prompt cache there is nothing to compress into.
        s = self.start("nocache", ["--kvtc-calib", self.cal, "--cache-ram", "0"], ok=False)
        self.assertNotEqual(s.wait_exit(), 0)
        self.assertIn("--kvtc-calib needs the prompt cache", s.log())

    def test_damaged_disk_entries_are_dropped_and_recomputed(self):
        store = os.path.join(self.tmp, "store-damaged")
        s = self.start("damaged-1", self.kvtc("--kvtc-disk", store))
        a, b = conversation(self.docs[0]), conversation(self.docs[1])
        a1, _, _ = s.chat(a)
        b1, _, _ = s.chat(b)
        s.chat([{"role": "user", "content": "Say hello."}], max_tokens=4)
        s.wait_saved()
        self.assertEqual(s.stop(), 0)
        # Entry files: one with a flipped byte, one truncated; chunk files: all damaged.
        entries = sorted(glob.glob(os.path.join(store, "*", "entries", "*.kvse")), key=os.path.getsize, reverse=True)
        self.assertGreaterEqual(len(entries), 2)
        with open(entries[0], "r+b") as f:
            f.seek(os.path.getsize(entries[0]) - 100)
            c = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([c[0] ^ 0xFF]))
        os.truncate(entries[1], os.path.getsize(entries[1]) // 2)
        s2 = self.start("damaged-2", self.kvtc("--kvtc-disk", store))
        m = s2.wait_scanned()
        self.assertGreaterEqual(m["kvtc:dropped_damaged_total"], 2)
        self.assertIn("checksum mismatch", s2.log())
        for msgs, first in ((a, a1), (b, b1)):
            reply, t, _ = s2.chat(msgs + [{"role": "assistant", "content": first}, {"role": "user", "content": "Again, shorter."}])
            self.assertTrue(reply.strip())
            self.assertLess(t.get("cache_n", 0), 100, t)  # recomputed, not restored from a damaged file
        self.assertEqual(s2.metrics()['kvtc:hits_total{tier="disk"}'], 0)
        # A damaged chunk file is found when a restore decodes it: a miss, the reply still served.
        s2.wait_saved()
        self.assertEqual(s2.stop(), 0)
        for c in glob.glob(os.path.join(store, "*", "chunks", "*.kvtc")):
            with open(c, "r+b") as f:
                f.seek(os.path.getsize(c) // 2)
                x = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([x[0] ^ 0xFF]))
        s3 = self.start("damaged-3", self.kvtc("--kvtc-disk", store))
        s3.wait_scanned()
        reply, t, _ = s3.chat(a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Again, shorter."},
                                   {"role": "assistant", "content": "Fine."}, {"role": "user", "content": "Thanks."}])
        self.assertTrue(reply.strip())
        m = s3.metrics()
        self.assertGreaterEqual(m["kvtc:dropped_damaged_total"], 1, s3.log()[-2000:])
        self.assertEqual(m["kvtc:restore_failures_total"], 0)

    def test_an_unwritable_disk_leaves_ram_serving(self):
        blocker = os.path.join(self.tmp, "a-file")
        with open(blocker, "w") as f:
            f.write("not a directory")
        s = self.start("unwritable", self.kvtc("--kvtc-disk", os.path.join(blocker, "store")))
        self.assertIn("DISABLED", s.log())
        m = s.metrics()
        self.assertEqual(m["kvtc:disk_enabled"], 0)
        self.assertTrue(any("error=" in lab for lab in s.metric_labels("kvtc:disk_error")))
        a = conversation(self.docs[2])
        a1, t_a1, _ = s.chat(a)
        s.chat([{"role": "user", "content": "Say hello."}], max_tokens=4)
        s.wait_saved()
        _, t, _ = s.chat(a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Shorter."}])
        self.assertGreaterEqual(t["cache_n"], t_a1["prompt_n"])  # from RAM

    def test_a_full_disk_disables_the_tier_mid_run(self):
        # RLIMIT_FSIZE makes the kernel refuse file bytes past 1 MiB (EFBIG),
        # as a full disk refuses them (ENOSPC): a compressed prompt's tail
        # (its raw window) is larger. The server's own log stays below it.
        def limit():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

        store = os.path.join(self.tmp, "store-full")
        s = self.start("full", self.kvtc("--kvtc-disk", store), preexec_fn=limit)
        self.assertEqual(s.metrics()["kvtc:disk_enabled"], 1)
        a = conversation(self.docs[3])
        a1, t_a1, _ = s.chat(a)
        s.chat([{"role": "user", "content": "Say hello."}], max_tokens=4)
        m = s.wait_saved()
        self.assertEqual(m["kvtc:disk_enabled"], 0, s.log()[-2000:])
        self.assertTrue(any("write failed" in lab for lab in s.metric_labels("kvtc:disk_error")))
        self.assertIn("disk tier disabled", s.log())
        self.assertEqual(glob.glob(os.path.join(store, "*", "entries", "*.kvse")), [])  # no partial entry
        _, t, _ = s.chat(a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Shorter."}])
        self.assertGreaterEqual(t["cache_n"], t_a1["prompt_n"])  # RAM still serves

    def test_a_client_leaving_mid_stream(self):
        s = self.start("disconnect", self.kvtc())
        body = {"messages": conversation(self.docs[0][:800]), "max_tokens": 400, "temperature": 0, "stream": True}
        rss = []
        for i in range(4):
            with requests.post(s.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
                self.assertEqual(r.status_code, 200)
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
                self.assertTrue(any(g.startswith(b"data: ") for g in got))
            # closed here, mid-stream
            rss.append(s.rss_kib())
        # The slot is released and the next client is served.
        for _ in range(100):
            if not any(x.get("is_processing") for x in requests.get(s.url + "/slots", timeout=10).json()):
                break
            time.sleep(0.2)
        self.assertFalse(any(x.get("is_processing") for x in requests.get(s.url + "/slots", timeout=10).json()))
        reply, _, _ = s.chat([{"role": "user", "content": "Say hello."}], max_tokens=4)
        self.assertTrue(reply.strip())
        self.assertIsNone(s.proc.poll())
        self.assertLess(rss[-1] - rss[0], 64 * 1024, rss)  # no growth per disconnect beyond noise

    def test_two_slots_with_concurrent_clients(self):
        s = self.start("parallel", ["--kvtc-calib", self.cal, "--cache-ram", "64", "--parallel", "2"])
        errors, results = [], {}

        def client(i):
            try:
                msgs = conversation(self.docs[i][:1500])
                r1, t1, _ = s.chat(msgs, max_tokens=6)
                r2, t2, _ = s.chat(msgs + [{"role": "assistant", "content": r1}, {"role": "user", "content": "Shorter."}], max_tokens=6)
                results[i] = (r1, r2, t1, t2)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        self.assertEqual(errors, [])
        self.assertEqual(len(results), 4)
        # Every second turn found its first turn, in its slot or restored.
        for r1, r2, t1, t2 in results.values():
            self.assertTrue(r1.strip() and r2.strip())
            self.assertGreaterEqual(t2["cache_n"], t1["prompt_n"], (t1, t2, kvtc_lines(s.log())))
        # Four conversations, two slots: the first two first turns to finish
        # lose their slot to the other two (queued since the start, ahead of
        # any second turn), so at least two second turns are restores from
        # the store (measured: all four, 1,847 tokens).
        m = s.wait_saved()
        print("two slots:", {k: v for k, v in m.items() if "hits" in k or "restored" in k})
        hits = m['kvtc:hits_total{tier="ram"}'] + m['kvtc:hits_total{tier="pending"}']
        self.assertGreaterEqual(hits, 2, m)
        self.assertGreaterEqual(m["kvtc:tokens_restored_total"], 2 * min(t1["prompt_n"] for _, _, t1, _ in results.values()), m)
        self.assertEqual(m["kvtc:restore_failures_total"], 0)
        self.assertEqual(m["kvtc:saves_skipped_total"], 0)

    def test_a_turn_saved_after_its_next_requests_prefetch_is_restored(self):
        # A client may send its next turn before the server has released the
        # slot of the one before (the reply is sent first): the prefetch then
        # finds that turn neither in an idle slot nor in the store. Here, on
        # one slot: X's first turn runs; Y's first turn and then X's second
        # are queued behind it (X2 prefetched while X1 still runs). Y takes
        # the slot, saving X1; X2 comes next and must restore X1 from the
        # store, not trust its prefetch's miss (the two-slot test recomputed
        # such a turn in 1 run of 8 under load before the fix).
        s = self.start("late-save", ["--kvtc-calib", self.cal, "--cache-ram", "64", "--parallel", "1"])
        x = conversation(self.docs[1][:1500])
        y = conversation(self.docs[2][:1500])
        x2 = x + [{"role": "assistant", "content": "It is about the text above."}, {"role": "user", "content": "Shorter."}]
        out, errors = {}, []

        def send(key, msgs, n):
            try:
                out[key] = s.chat(msgs, max_tokens=n)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        tx = threading.Thread(target=send, args=("x1", x, 48))
        tx.start()
        for _ in range(600):  # until X1 holds the slot
            if any(q.get("is_processing") for q in requests.get(s.url + "/slots", timeout=10).json()):
                break
            time.sleep(0.05)
        ty = threading.Thread(target=send, args=("y1", y, 4))
        ty.start()
        time.sleep(0.5)  # Y1 queued first
        t2 = threading.Thread(target=send, args=("x2", x2, 4))
        t2.start()
        for t in (tx, ty, t2):
            t.join(600)
        self.assertEqual(errors, [])
        self.assertFalse(out["x1"][2]["choices"][0]["finish_reason"] is None)
        t_x1, t_x2 = out["x1"][1], out["x2"][1]
        m = s.wait_saved()
        lines = kvtc_lines(s.log())
        self.assertGreaterEqual(m["kvtc:prefetches_total"], 3, lines)
        # X2 restored X1's prompt (its whole prompt is X1's plus 4 short messages).
        self.assertGreaterEqual(t_x2["cache_n"], t_x1["prompt_n"], (t_x1, t_x2, lines))
        self.assertIn("restored", lines)

    def test_another_slot_streams_on_while_a_restore_runs(self):
        # Issue 29: a restore decoded on the loop paused every slot (a
        # stream's largest gap 0.38-0.52 s against 0.02-0.03 s alone,
        # bench/results/restore-stall.md). Two slots: one streams while the
        # other resumes a stored ~1.8K-token conversation; the restore is
        # prefetched on the request's thread and the loop only writes the
        # state. Measured here: the loop held 2.5-2.9 ms of a 0.15 s restore
        # (1,723 tokens, the tests' small calibration); the stream's largest
        # gap during it 0.16-0.17 s (the resumed turn's prefill and the
        # decoding's share of 2 cores). Bounds: the loop's
        # hold 50 ms, the gap 2 s (a busy machine stalls llama.cpp's threads
        # whatever kvtc does: the loop bound is the one that names kvtc).
        s = self.start("stream", ["--kvtc-calib", self.cal, "--cache-ram", "256", "--parallel", "2"])
        doc = docs("prose", 5, 1500, 6000)[4]
        a1, t1, _ = s.chat(conversation(doc))
        for k in range(2):  # both slots take something else: the conversation is stored and leaves them
            s.chat([{"role": "user", "content": f"Say hello to number {k}."}], max_tokens=4)
        s.wait_saved()
        arrivals, errors = [], []

        def stream():
            body = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}], "max_tokens": 120,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            try:
                with requests.post(s.url + "/v1/chat/completions", json=body, stream=True, timeout=300) as q:
                    for line in q.iter_lines():
                        if line.startswith(b"data: ") and b'"content"' in line:
                            arrivals.append(time.monotonic())
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        th = threading.Thread(target=stream)
        th.start()
        while len(arrivals) < 20 and th.is_alive():
            time.sleep(0.01)
        t0 = time.monotonic()
        _, t2, _ = s.chat(conversation(doc) + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Shorter."}], max_tokens=1)
        t_end = time.monotonic()
        th.join(300)
        self.assertEqual(errors, [])
        self.assertGreaterEqual(len(arrivals), 110)  # every token came (120 asked; a chunk may carry two)
        self.assertGreaterEqual(t2["cache_n"], t1["prompt_n"], t2)  # restored
        m = s.metrics()
        gap = max(b - a for a, b in zip(arrivals, arrivals[1:]) if b >= t0 and a <= t_end)
        print(f"restore of {t1['prompt_n']} tokens: waited {m['kvtc:restore_wait_seconds_max']:.3f} s off the loop, the loop held "
              f"{m['kvtc:loop_restore_seconds_max'] * 1e3:.1f} ms; the other slot's largest gap meanwhile {gap:.3f} s")
        self.assertEqual(m["kvtc:prefetch_used_total"], 1, m)
        self.assertLess(m["kvtc:loop_restore_seconds_max"], 0.05, m)
        self.assertLess(gap, 2.0)

    def test_upstream_endpoints_still_work(self):
        s = self.start("endpoints", self.kvtc())
        r = requests.post(s.url + "/completion", json={"prompt": "The capital of France is", "n_predict": 4, "temperature": 0}, timeout=120)
        self.assertEqual(r.status_code, 200)
        self.assertIn("content", r.json())
        # cache_salt alone (no API keys) is a tenant: the slot's prompt of
        # tenant "" above is not reused for it (upstream reuses all but one
        # token); the request without one after it gets tenant ""'s own
        # prompt back, from the store (saved when the slot changed tenants).
        for salt, reused in (("tenant x", False), (None, True)):
            body = {"prompt": "The capital of France is", "n_predict": 4, "temperature": 0, **({"cache_salt": salt} if salt else {})}
            r = requests.post(s.url + "/completion", json=body, timeout=120)
            self.assertEqual(r.status_code, 200, r.text[:300])
            self.assertEqual(r.json()["timings"].get("cache_n", 0) > 0, reused, (salt, r.json()["timings"]))
        r = requests.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "cache_salt": ["x"]}, timeout=60)
        self.assertEqual(r.status_code, 400, r.text[:300])
        self.assertIn("cache_salt: a string is expected, got array", r.text)
        self.assertEqual(requests.get(s.url + "/health", timeout=10).json().get("status"), "ok")
        self.assertIsInstance(requests.get(s.url + "/slots", timeout=10).json(), list)
        text = requests.get(s.url + "/metrics", timeout=10).text
        self.assertIn("llamacpp:prompt_tokens_total", text)
        self.assertIn("kvtc:ram_bytes", text)
        body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "temperature": 0, "stream": True}
        with requests.post(s.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as r:
            events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
        self.assertEqual(events[-1], b"data: [DONE]")
        self.assertGreater(len(events), 2)


if __name__ == "__main__":
    unittest.main(verbosity=2)
