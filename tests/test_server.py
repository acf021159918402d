#!/usr/bin/env python3
"""kvtc-server as its users run it: the real binary on a loopback port, the
real SmolLM2 model, real documents from the evaluation corpus, a real HTTP
client (requests). Covered: a second turn restored from the compressed RAM
tier; the disk tier across a restart; shared prefixes stored once; damaged
and unwritable disk tiers; bad calibrations refused at start; a client
leaving mid-stream; two slots with concurrent clients; the upstream
endpoints (/completion, /slots, /health, /metrics, streaming)."""
import glob
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
import unittest

import requests

from kvtc_testlib import CORPUS, SMOL, small_calibration

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

    def start(self, name, args, ok=True, **kw):
        s = Server(SERVER, SMOL, args, os.path.join(self.tmp, name + ".log"), **kw)
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
        a2, t_a2, _ = s.chat(a2_msgs, max_tokens=12)
        # The whole first turn came back from the store: only the new turn was computed.
        self.assertGreaterEqual(t_a2["cache_n"], t_a1["prompt_n"], t_a2)
        self.assertLess(t_a2["prompt_n"], 40, t_a2)
        m = s.metrics()
        self.assertEqual(m['kvtc:hits_total{tier="ram"}'], 1)
        self.assertGreaterEqual(m["kvtc:tokens_restored_total"], t_a1["prompt_n"])
        self.assertEqual(m["kvtc:restore_failures_total"], 0)
        # It continues sensibly: the first tokens of the reply match the reply
        # computed from scratch (cache_prompt false: the prefix recomputed).
        ref, t_ref, _ = s.chat(a2_msgs, max_tokens=12, cache_prompt=False)
        self.assertEqual(t_ref.get("cache_n", 0), 0, t_ref)
        self.assertTrue(a2.strip())
        self.assertEqual(a2.split()[:2], ref.split()[:2], (a2, ref))
        self.assertIn("kvtc: restored", s.log())

    def test_restart_reads_the_disk_tier_back(self):
        store = os.path.join(self.tmp, "store-restart")
        s = self.start("restart-1", self.kvtc("--kvtc-disk", store))
        a = conversation(self.docs[2])
        a1, t_a1, _ = s.chat(a)
        s.chat(conversation(self.docs[3]))
        m = s.wait_saved()
        self.assertEqual(m["kvtc:disk_enabled"], 1)
        self.assertGreaterEqual(m["kvtc:disk_prompts"], 1)
        self.assertEqual(s.stop(), 0)
        self.assertEqual(len(glob.glob(os.path.join(store, "*", "entries", "*.kvse"))), 1)  # A (B was still in the slot)
        s2 = self.start("restart-2", self.kvtc("--kvtc-disk", store))
        self.assertIn("prompts read back", s2.log())
        self.assertEqual(s2.wait_scanned()["kvtc:disk_prompts"], 1)  # read back in the background
        a2, t_a2, _ = s2.chat(a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And in a few words?"}])
        self.assertGreaterEqual(t_a2["cache_n"], t_a1["prompt_n"], t_a2)
        m = s2.metrics()
        self.assertEqual(m['kvtc:hits_total{tier="disk"}'], 1)
        self.assertTrue(a2.strip())

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
                r1, _, _ = s.chat(msgs, max_tokens=6)
                r2, t2, _ = s.chat(msgs + [{"role": "assistant", "content": r1}, {"role": "user", "content": "Shorter."}], max_tokens=6)
                results[i] = (r1, r2, t2)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        self.assertEqual(errors, [])
        self.assertEqual(len(results), 4)
        for r1, r2, t2 in results.values():
            self.assertTrue(r1.strip() and r2.strip())
        m = s.wait_saved()
        self.assertEqual(m["kvtc:restore_failures_total"], 0)
        self.assertEqual(m["kvtc:saves_skipped_total"], 0)

    def test_upstream_endpoints_still_work(self):
        s = self.start("endpoints", self.kvtc())
        r = requests.post(s.url + "/completion", json={"prompt": "The capital of France is", "n_predict": 4, "temperature": 0}, timeout=120)
        self.assertEqual(r.status_code, 200)
        self.assertIn("content", r.json())
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
