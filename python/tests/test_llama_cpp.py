"""KvtcCache in a real llama-cpp-python 0.3.35 session (SmolLM2-135M, the
pinned llama.cpp): a follow-up prompt is answered from the compressed cache,
the budget holds, states survive a restart on disk, two Llamas share a real
Redis tier (and answer with it down), and what the cache cannot keep is
refused."""
import os
import sys

import numpy as np
import pytest

import kvtc
from conftest import SMOL, TOP, eval_text

import llama_cpp  # noqa: E402  (a missing llama_cpp is a failure, not a skip)
from kvtc.llama_cpp import KvtcCache

sys.path.insert(0, os.path.join(TOP, "scripts"))
sys.path.insert(0, os.path.join(TOP, "tests"))
from gguf_edit import gguf_with_metadata  # noqa: E402  (a model file with other metadata, same tensors)
from serverlib import Redis  # noqa: E402  (redis-server on a loopback port, as the server tests use)

N_CTX = 2048


def make_llm(model=SMOL, **kw):
    return llama_cpp.Llama(model, n_ctx=N_CTX, n_threads=2, seed=7, verbose=False, **kw)


def document(n_chars=3000):
    with open(eval_text()) as f:
        return f.read()[:n_chars]


def first_turn():
    return document() + "\n\nQuestion: Who wrote this letter?\nAnswer:"


def ask(llm, prompt, n=12, logits=None):
    """The greedy reply; with `logits` (a list), the logits llama.cpp gave
    at each reply position are appended to it (a logits processor sees
    them before sampling and passes them on unchanged)."""
    kw = {}
    if logits is not None:

        def record(_ids, x):
            logits.append(np.array(x, dtype=np.float64))
            return x

        kw["logits_processor"] = llama_cpp.LogitsProcessorList([record])
    return llm(prompt, max_tokens=n, temperature=0, **kw)["choices"][0]["text"]


def conversation(llm, cache, switch=True):
    """Turn 1, a context switch (another conversation runs in the same
    Llama, as on a shared server), then turn 2, which extends turn 1:
    (answer 1, answer 2, the logits at each position of answer 2). Without
    the switch turn 2 continues on turn 1's cache as llama.cpp left it."""
    p1 = first_turn()
    a1 = ask(llm, p1)
    if cache is not None:
        cache.flush()
    if switch:
        llm.reset()
        llm.eval(llm.tokenize(b"An unrelated conversation."))
    p2 = p1 + a1 + "\nQuestion: What is it about?\nAnswer:"
    logits = []
    return a1, ask(llm, p2, logits=logits), logits


def through_kvtc_cache(llm, calibration, **kw):
    """conversation() on `llm` with a KvtcCache of `calibration` (and `kw`):
    (answer 1, the logits of turn 2's answer, the store's stats)."""
    with KvtcCache(calibration, llm, **kw) as cache:
        llm.set_cache(cache)
        a1, _, logits = conversation(llm, cache)
        return a1, logits, cache.stats()


def kl_while_agreeing(ref, got):
    """KL(ref || got) of the next-token distributions at each reply position
    up to and including the first where the greedy tokens differ (until
    then both replies saw the same tokens, so the difference is the
    restored cache's alone), and the number of positions that agree."""
    agree, kls = 0, []
    for r, g in zip(ref, got):
        lr, lg = r - np.logaddexp.reduce(r), g - np.logaddexp.reduce(g)
        kls.append(float(np.sum(np.exp(lr) * (lr - lg))))
        if np.argmax(r) != np.argmax(g):
            break
        agree += 1
    return kls, agree


@pytest.fixture(scope="module")
def kept():
    """The reference: turn 2 on turn 1's cache as it never left llama.cpp.
    Not a recompute of turn 2's whole prefix: that evaluates turn 1's
    answer in one batch where generation evaluated it token by token, and
    llama.cpp's CPU kernels round the two differently (here a recompute's
    logits differ from these by up to 0.97, KL up to 0.007 per position,
    with the same greedy answers), so a restore can only be exact against
    this."""
    return conversation(make_llm(), None, switch=False)


def test_raw_store_restores_exactly(smol_calibration, kept):
    llm = make_llm()
    with KvtcCache(smol_calibration, llm, raw=True) as cache:
        llm.set_cache(cache)
        a1, a2, logits = conversation(llm, cache)
        s = cache.stats()
    # Turn 1 (873 tokens with its answer) came back from the store.
    assert s["hits_ram"] + s["hits_pending"] == 1 and s["tokens_restored"] >= 850, s
    # f16 pieces, no coding: the restored cache is the original, and so are
    # the answers and every logit of turn 2, bit for bit.
    assert (a1, a2) == kept[:2]
    assert len(logits) == len(kept[2]) == 12 and all(np.array_equal(x, y) for x, y in zip(logits, kept[2]))


def test_compressed_cache_answers_the_follow_up_within_budget(smol_calibration, kept):
    llm = make_llm()
    budget = 4 << 20  # ~1.5 prompts of ~800 tokens at 16x
    with KvtcCache(smol_calibration, llm, capacity_bytes=budget, ratio=16) as cache:
        llm.set_cache(cache)
        a1, a2, logits = conversation(llm, cache)
        s = cache.stats()
        assert s["hits_ram"] + s["hits_pending"] == 1 and s["tokens_restored"] >= 850, s
        assert a1 == kept[0]  # turn 1 ran before any restore
        # Turn 2 continues from the 16x cache as from the exact one: the
        # mean KL from the exact cache's next-token distribution over the
        # answer's positions (while the greedy tokens agree, and the first
        # that differs). Measured 0.0149 here (AVX512-BF16: bf16 projection;
        # 12 of 12 tokens agree; 0.035 at the first token, 0.001 to 0.030
        # after), 0.0147 as an AVX2 machine runs it (OPENBLAS_CORETYPE=Haswell
        # for the calibration and the f32 projection, oneDNN capped at AVX2).
        # Bound 0.03, 2x: the calibration and the projection's rounding vary
        # by CPU; a codec twice as lossy does not pass.
        kls, agree = kl_while_agreeing(kept[2], logits)
        mean_kl = sum(kls) / len(kls)
        print(f"turn 2 after a 16x restore: mean KL {mean_kl:.4f} over {len(kls)} positions {kls}, {agree} of 12 greedy tokens agree; "
              f"store {({k: v for k, v in s.items() if k in ('hits_ram', 'hits_pending', 'tokens_restored', 'puts', 'chunks_written', 'chunks_shared', 'entries')})}")
        assert mean_kl < 0.03, (kls, agree)
        # More conversations than the budget holds: the least recent go, the budget holds.
        for i in range(3):
            ask(llm, f"Document {i}.\n" + document(2400 + 200 * i) + "\nSummary:", n=4)
        cache.flush()
        s = cache.stats()
        assert s["puts"] >= 4
        assert 0 < s["ram_bytes"] <= budget, s
        assert cache.cache_size <= budget
        # Compressed: each stored state is far below its raw size (23 KB per token).
        assert s["ram_bytes"] / max(1, s["entries"]) < 800 * 23040 / 4


def test_a_context_with_yarn_is_coded_under_its_own_rope(smol_calibration):
    # A Llama run with YaRN rotates its keys otherwise than the GGUF says:
    # the store removes the context's rotation (its resolved settings,
    # context_kv_settings). Measured here (x2 over a 1,024-token original
    # context, the 873-token turn): mean KL 0.0425, 12 of 12 greedy tokens
    # agreeing; removing the GGUF's RoPE instead, as before, 0.181 and 7 of
    # 12. Plain RoPE's 0.013 (the test above) is not reached: the
    # calibration was fitted on keys the model computes under its own RoPE
    # (bench/results/rope-settings-reading.md). Bounds: 2x, 0.085, as the
    # plain test's, and 10 tokens agreeing.
    yarn = dict(rope_scaling_type=llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN, rope_freq_scale=0.5, yarn_orig_ctx=1024)
    ref = conversation(make_llm(**yarn), None, switch=False)
    llm = make_llm(**yarn)
    assert kvtc.llama_cpp.context_kv_settings(llm)["yarn_ext_factor"] == 1.0
    a1, logits, s = through_kvtc_cache(llm, smol_calibration, ratio=16)
    assert s["hits_ram"] + s["hits_pending"] == 1 and s["tokens_restored"] >= 850, s
    assert a1 == ref[0]
    kls, agree = kl_while_agreeing(ref[2], logits)
    mean_kl = sum(kls) / len(kls)
    print(f"YaRN x2, turn 2 after a 16x restore: mean KL {mean_kl:.4f} over {len(kls)} positions, {agree} of 12 greedy tokens agree")
    assert mean_kl < 0.085 and agree >= 10, (kls, agree)


def test_states_survive_a_restart_on_disk(smol_calibration, work):
    # With a secret and encrypt (docs/store.md "Secrets"): KvtcCache passes
    # them to the store, whose files are then sealed; the same secret reads
    # them back, a cache without it is another store.
    disk = work / "kvtc-disk"
    secret = work / "kvtc-secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    p1 = first_turn()
    llm = make_llm()
    with KvtcCache(smol_calibration, llm, disk_dir=disk, secret_file=secret, encrypt=True) as cache:
        assert cache._store.protection.startswith("aes-256-gcm;key=")
        llm.set_cache(cache)
        ask(llm, p1, n=4)
        cache.flush()
        assert cache.stats()["disk_entries"] >= 1
    # A new process would do this: a new Llama, a new cache over the same directory.
    llm2 = make_llm()
    with KvtcCache(smol_calibration, llm2, disk_dir=disk, secret_file=secret, encrypt=True) as cache2:
        llm2.set_cache(cache2)
        cache2.flush()  # the disk tier is read back in the background
        assert llm2.tokenize(p1.encode()) in cache2
        ask(llm2, p1 + " Paul.\nQuestion: To whom?\nAnswer:", n=4)
        assert cache2.stats()["hits_disk"] >= 1
        assert cache2.stats()["foreign_dropped"] == 0
    with KvtcCache(smol_calibration, llm2, disk_dir=disk) as plain:
        plain.flush()
        assert llm2.tokenize(p1.encode()) not in plain
    short = work / "short-secret"
    short.write_bytes(b"x" * 31)
    with pytest.raises(kvtc.Error, match="short-secret: the secret file holds 31 bytes, expected at least 32"):
        KvtcCache(smol_calibration, llm2, secret_file=short)
    with pytest.raises(kvtc.Error, match="encrypt needs a secret"):
        KvtcCache(smol_calibration, llm2, encrypt=True)
    # Another tenant (cache_salt, docs/store.md "Tenants") of the same store
    # (directory and secret) finds none of it, and keeps what it stores for itself.
    with KvtcCache(smol_calibration, llm2, disk_dir=disk, secret_file=secret, encrypt=True, cache_salt="tenant b") as cache3:
        llm2.set_cache(cache3)
        cache3.flush()
        assert cache3.stats()["disk_entries"] >= 1  # the untenanted state is there, and not this tenant's
        assert llm2.tokenize(p1.encode()) not in cache3
        ask(llm2, p1, n=1)
        cache3.flush()
        assert llm2.tokenize(p1.encode()) in cache3
    with pytest.raises(kvtc.Error, match="cache_salt: a str or bytes is expected, got int"):
        KvtcCache(smol_calibration, llm2, cache_salt=7)


def test_states_in_and_out_of_the_binding(smol_calibration):
    cal = kvtc.Calibration.load(smol_calibration)
    llm = make_llm(flash_attn=True)
    ask(llm, first_turn(), n=2)
    state = llm.save_state()
    lay = kvtc.state_layout(state.llama_state)
    assert lay == {"kind": "context", "arch": "llama", "v_trans": 0, "streams": [1], "seq_id": 0}
    data = cal.compress_state(state.llama_state, ratio=16)
    assert kvtc.inspect(data)["meta"]["llama_state"] == "context"
    back = cal.decompress_state(data)
    assert len(back) == state.llama_state_size and back[:9] == state.llama_state[:9]
    # Into a context without flash attention: V transposed.
    assert kvtc.state_layout(cal.decompress_state(data, v_trans=1))["v_trans"] == 1
    # llama.cpp takes the restored state; the next answer comes from it.
    llm.load_state(llama_cpp.llama.LlamaState(state.input_ids, state.scores, state.n_tokens, back, len(back), state.seed))
    assert llm.n_tokens == state.n_tokens


def test_what_it_cannot_keep_is_refused(smol_calibration):
    with pytest.raises(kvtc.Error, match="logits_all"):
        KvtcCache(smol_calibration, make_llm(logits_all=True))
    # No Llama: nothing names the model or the context's settings.
    with pytest.raises(kvtc.Error, match="give the Llama"):
        KvtcCache(smol_calibration)


def another_model_file(work):
    """The default GGUF with one byte of its general.name changed: the same
    architecture, weights and tokenizer (llama.cpp loads it as it loads the
    original), another file, as another quantization or a fine-tune is."""
    with open(SMOL, "rb") as f:
        data = bytearray(f.read(64 << 20))
        rest = f.read()
    at = data.find(b"general.name")
    assert at > 0
    # key, then u32 type (8: string), u64 length, the value: change its first character.
    value = at + len(b"general.name") + 4 + 8
    data[value] = ord("X") if data[value] != ord("X") else ord("Y")
    path = work / "other-model.gguf"
    with open(path, "wb") as f:
        f.write(data + rest)
    return str(path)


def test_another_model_file_is_refused(smol_calibration, work):
    """KvtcCache names the Llama's model file: a calibration of the original
    is refused for another file of the same architecture, which would
    otherwise share keys (and states) with it."""
    other = another_model_file(work)
    llm = llama_cpp.Llama(other, n_ctx=N_CTX, n_threads=2, seed=7, verbose=False)
    assert llm.metadata.get("general.architecture") == "llama"
    with pytest.raises(kvtc.Error, match="wrong calibration"):
        KvtcCache(smol_calibration, llm)
    assert kvtc.llama_cpp.model_sha256(other) != kvtc.llama_cpp.model_sha256(SMOL)
    # The hash is remembered by path, size and mtime: a file changed in place is hashed again.
    before = kvtc.llama_cpp.model_sha256(other)
    with open(other, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    os.utime(other, ns=(os.stat(other).st_atime_ns, os.stat(other).st_mtime_ns + 1000))
    assert kvtc.llama_cpp.model_sha256(other) != before


def test_other_rope_settings_never_share_states(smol_calibration, work):
    """A store filled by a context with the model's own RoPE is never read by
    one run with another rope_freq_base (its K/V differ): no hit, and the
    answer is the one a Llama with that base gives without a cache."""
    disk = work / "kvtc-disk-rope"
    p1 = first_turn()
    llm = make_llm()
    with KvtcCache(smol_calibration, llm, disk_dir=disk) as cache:
        llm.set_cache(cache)
        ask(llm, p1, n=4)
        cache.flush()
        assert cache.stats()["disk_entries"] >= 1
        default_settings = kvtc.llama_cpp.context_kv_settings(llm)
    assert default_settings["rope_freq_base"] == 100000.0  # SmolLM2's GGUF base, as the context resolved it
    p2 = p1 + " Paul.\nQuestion: To whom?\nAnswer:"
    plain = make_llm(rope_freq_base=20000.0)
    assert kvtc.llama_cpp.context_kv_settings(plain)["rope_freq_base"] == 20000.0
    want = ask(plain, p2, n=6)
    llm2 = make_llm(rope_freq_base=20000.0)
    with KvtcCache(smol_calibration, llm2, disk_dir=disk) as cache2:
        llm2.set_cache(cache2)
        cache2.flush()
        assert llm2.tokenize(p1.encode()) not in cache2
        got = ask(llm2, p2, n=6)
        s = cache2.stats()
        assert s["hits_disk"] == 0 and s["hits_ram"] == 0 and s["disk_entries"] == 0
    assert got == want
    # The same settings read the store again.
    llm3 = make_llm()
    with KvtcCache(smol_calibration, llm3, disk_dir=disk) as cache3:
        cache3.flush()  # the disk tier is read back in the background
        assert llm3.tokenize(p1.encode()) in cache3


def test_two_processes_share_a_redis_tier(smol_calibration, work):
    """Turn 1 in one Llama, turn 2 in another (as two servers behind a load
    balancer): the second restores turn 1 from a real redis-server that asks
    for a password (AUTH user password, the password from a file), every key
    with the TTL asked for. With Redis stopped, a third still answers (it
    recomputes), and says Redis is down."""
    pw = "kvtc-test-password-0123456789"
    r = Redis(str(work / "redis"), extra=["--requirepass", pw], password=pw)
    pw_file = work / "redis-password"
    pw_file.write_text(pw + "\n")
    auth = dict(redis_user="default", redis_password_file=pw_file)
    try:
        p1 = first_turn()
        llm_a = make_llm()
        with pytest.raises(kvtc.Error, match="redis_user needs redis_password_file"):
            KvtcCache(smol_calibration, llm_a, redis_url=r.url, redis_user="default")
        with KvtcCache(smol_calibration, llm_a, redis_url=r.url) as no_pw:  # refused by Redis: served, never stored there
            assert no_pw.stats()["redis_up"] == 0 and "NOAUTH" in no_pw.stats()["redis_error"], no_pw.stats()
        with KvtcCache(smol_calibration, llm_a, redis_url=r.url, redis_ttl_s=600, **auth) as a:
            llm_a.set_cache(a)
            a1 = ask(llm_a, p1, n=4)
            a.flush()
            assert a.stats()["redis_up"] == 1
        keys = r.cli("KEYS", "kvtc:*").split()
        assert keys
        ttls = [int(r.cli("TTL", k)) for k in keys]
        assert all(0 < t <= 600 for t in ttls), ttls
        p2 = p1 + a1 + "\nQuestion: To whom?\nAnswer:"
        # The reference: A continues on its own cache (kept, as above).
        llm_a.set_cache(None)
        ref = []
        ask(llm_a, p2, n=4, logits=ref)
        llm_b = make_llm()
        with KvtcCache(smol_calibration, llm_b, redis_url=r.url, **auth) as b:  # RAM empty, no disk
            llm_b.set_cache(b)
            got = []
            ask(llm_b, p2, n=4, logits=got)
            s = b.stats()
        assert s["hits_redis"] == 1 and s["tokens_restored"] >= 850, s
        # B continues from the 16x cache it read from Redis as A does from
        # its own: mean KL over the answer's positions (as in the test
        # above). Measured 0.0235 here, 0.0249 as an AVX2 machine runs it
        # (4 of 4 tokens agree in both); bound 0.05, 2x (see there).
        kls, agree = kl_while_agreeing(ref, got)
        print(f"turn 2 on B after a 16x restore from Redis: mean KL {sum(kls) / len(kls):.4f} over {len(kls)} positions {kls}, {agree} of 4 agree; "
              f"B's store {dict((k, s[k]) for k in ('hits_redis', 'hits_ram', 'misses', 'tokens_restored'))}")
        assert sum(kls) / len(kls) < 0.05, (kls, agree)
        r.stop()
        llm_c = make_llm()
        with KvtcCache(smol_calibration, llm_c, redis_url=r.url, **auth) as c:
            llm_c.set_cache(c)
            assert ask(llm_c, p2, n=4) == ask(make_llm(), p2, n=4)  # recomputed: the uncached answer
            s = c.stats()
        assert s["hits_redis"] == 0 and s["redis_up"] == 0 and s["redis_error"], s
    finally:
        r.stop()


def prose_documents(n, n_chars=2400):
    """The openings of n distinct evaluation documents (distinct prefixes:
    a learner learns a prefix once)."""
    import json

    from conftest import CORPUS

    with open(os.path.join(CORPUS, "manifest.json")) as f:
        m = json.load(f)
    docs = [d for d in m["documents"] if d["split"] == "eval" and d["kind"] == "prose" and d["tokens"] >= 1024][1:n + 1]
    assert len(docs) == n
    out = []
    for d in docs:
        with open(os.path.join(CORPUS, d["file"])) as f:
            out.append(f.read()[:n_chars])
    return out


def test_a_gguf_that_asks_for_yarn_itself_is_learned_and_coded_under_it(work):
    """A GGUF that says rope scaling "yarn" itself (as 128K Qwen2.5 and
    gpt-oss conversions do; here SmolLM2's file saying what the YaRN test's
    flags say): its facts (model_facts) name YaRN without parameters, which
    llama.cpp resolves when it creates the context; KvtcCache('auto') learns
    and codes under the context's resolved rotation. Before, the facts'
    rotation could not be built: the learner refused every state and
    learned forever (now a rotation kvtc cannot undo is refused when the
    cache is made). Measured: mean KL 0.0187 in 3 runs, 12 of 12 greedy
    tokens agree (test_a_context_with_yarn_is_coded_under_its_own_rope's
    fixed calibration gives 0.0425 for the same turn: not for its RoPE, as
    a calibration fitted under the context's barely differs,
    bench/results/rope-settings-calib.md; this one was learned from prose
    like the turn's). Bounds: 0.04, ~2x, and 10 tokens agreeing."""
    gguf = str(work / "smol-yarn.gguf")
    gguf_with_metadata(SMOL, gguf, {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.0,
                                    "llama.rope.scaling.original_context_length": 1024})
    ref = conversation(make_llm(gguf), None, switch=False)
    llm = make_llm(gguf)
    assert kvtc.llama_cpp.model_facts(llm)["rope_scaling_type"] == "yarn"
    assert kvtc.llama_cpp.context_kv_settings(llm)["yarn_ext_factor"] == 1.0
    with KvtcCache("auto", llm, calib_tokens=1024, calib_share=1000.0) as cache:
        llm.set_cache(cache)
        for text in prose_documents(4):
            if cache.calibration_status()["state"] != "learning":
                break
            ask(llm, text + "\nSummary:", n=2)
        assert cache.wait_calibrated(600), cache.calibration_status()
        assert cache.calibration_status()["state"] == "live", cache.calibration_status()
        a1, _, logits = conversation(llm, cache)
        s = cache.stats()
    assert s["hits_ram"] + s["hits_pending"] >= 1 and s["tokens_restored"] >= 850, s
    assert a1 == ref[0]
    kls, agree = kl_while_agreeing(ref[2], logits)
    print(f"the GGUF's own YaRN x2, learned: mean KL {sum(kls) / len(kls):.4f} over {len(kls)} positions, {agree} of 12 agree")
    assert sum(kls) / len(kls) < 0.04 and agree >= 10, (kls, agree)


def test_model_facts_give_the_calibrations_geometry(smol_calibration):
    """kvtc.llama_cpp.model_facts reads what kvtc's own model_geometry reads
    (the calibration was made by `kvtc calibrate`, which uses it): the same
    layers, heads, dims and RoPE; a sliding-window model is refused (its
    facts carry no layer pattern: KvtcCache takes one with a calibration file)."""
    got = kvtc.Learner(kvtc.llama_cpp.model_facts(make_llm()), tokens=1024).geometry()
    want = {k: v for k, v in kvtc.Calibration.load(smol_calibration).info()["blocks"][0].items() if not k.startswith("components")}
    assert got == want
    from conftest import GEMMA

    gemma = llama_cpp.Llama(GEMMA, n_ctx=512, n_threads=2, verbose=False)
    with pytest.raises(kvtc.Error, match="sliding-window"):
        KvtcCache("auto", gemma)


def test_a_sliding_window_model_is_restored_whole(work):
    """Gemma 3 270M (3 global layers, 15 sliding-window layers of 512
    positions; docs/store.md "Sliding-window models") with a calibration
    file: turn 1's state is stored (the global layers in chunks, the
    window's last 512 positions in the tail) and turn 2, which extends it,
    is restored from it. llama-cpp-python runs Gemma with a full-size window
    cache (its states hold every position); the store keeps the window, all
    the next token reads."""
    from conftest import GEMMA, run

    cal = str(work / "gemma.safetensors")
    shared = os.environ.get("KVTC_TEST_CALIB_GEMMA")  # ctest's gemma_calibration fixture
    if shared and os.path.isfile(shared):
        import shutil

        shutil.copyfile(shared, cal)
    else:
        run("calibrate", "-m", GEMMA, "--tokens", "3000", "--heldout", "512", "--doc-tokens", "1024", "--rank-max", "512", "-o", cal)

    kept = conversation(make_llm(GEMMA), None, switch=False)
    a1, logits, s = through_kvtc_cache(make_llm(GEMMA), cal, ratio=16)
    assert s["hits_ram"] + s["hits_pending"] == 1 and s["tokens_restored"] >= 800, s
    assert a1 == kept[0]
    # As from the kept cache: mean KL over turn 2's answer while the greedy
    # tokens agree (and the first that differs). Measured 0.045 here (12 of
    # 12 tokens agree; the window at 16x, the global layers at 4x, the
    # default: 0.055 and 11 of 12 with them at 16x too); a raw restore
    # measured 0.003 at its first token (the window's cells in another
    # order, rounding apart). Bound 0.1.
    kls, agree = kl_while_agreeing(kept[2], logits)
    print(f"Gemma 3 turn 2 after a 16x restore: mean KL {sum(kls) / len(kls):.4f} over {len(kls)} positions, {agree} of 12 agree")
    assert sum(kls) / len(kls) < 0.1, (kls, agree)


def test_a_calibration_learned_from_the_prompts_served(kept, work):
    """KvtcCache('auto') (kvtc-server's --kvtc-calib auto, docs/server.md):
    no calibration to begin with; states are kept raw (LlamaRAMCache) and
    handed to the learner; with enough tokens it fits in the background,
    writes the file beside the disk tier and publishes it to Redis; the
    store comes in place with the raw states moved into it, and a turn is
    restored compressed. Another process finds it in Redis, a restart in
    the file. 1,024 tokens here (the default is 32,768); share 1000: no
    token is skipped for cost."""
    disk = work / "kvtc-disk-auto"
    secret = work / "kvtc-secret-auto"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    r = Redis(str(work / "redis-auto"))
    try:
        llm = make_llm()
        learn = dict(calib_tokens=1024, calib_share=1000.0)
        fleet = dict(redis_url=r.url, secret_file=secret)
        cache = KvtcCache("auto", llm, disk_dir=disk, **learn, **fleet)
        assert cache.calibration is None and cache.calibration_status()["state"] == "learning"
        llm.set_cache(cache)
        # While learning, turn 2 is restored raw: exactly the kept cache's answer and logits.
        a1, a2, logits = conversation(llm, cache)
        assert (a1, a2) == kept[:2]
        assert all(np.array_equal(x, y) for x, y in zip(logits, kept[2]))
        assert cache.stats() == {}
        for text in prose_documents(4):  # distinct documents until 1,024 + 64 held-out tokens (a busy learner skips one)
            if cache.calibration_status()["state"] != "learning":
                break
            ask(llm, text + "\nSummary:", n=2)
        # The fit runs at nice 19: seconds alone (3.5-5.3 s here), 103 s beside a
        # busy calibration; the bound is for a stuck learner, not a slow one.
        assert cache.wait_calibrated(600), cache.calibration_status()
        st = cache.calibration_status()
        print(f"learned: {st['fit']} + {st['held']} held out of {st['fresh']} new / {st['seen']} seen tokens in {st['samples']} states "
              f"({st['busy']} not taken, busy); learner CPU {st['cpu_ms']:.0f} ms; copies {st['loop_ms']:.1f} ms; fit {st['fit_s']:.1f} s")
        assert st["state"] == "live" and st["fit"] >= 1024 and st["held"] >= 64, st
        assert st["moved"] >= 1, st  # the raw states kept meanwhile went into the store
        assert st["fresh"] < st["seen"], st  # turn 2's prefix was learned once
        files = list(disk.glob("calibration-auto-*.safetensors"))
        assert [f.name for f in files] == [f"calibration-auto-{kvtc.llama_cpp.model_sha256(SMOL)[:16]}.safetensors"]
        learned = kvtc.Calibration.load(str(files[0]))
        assert learned.id == cache.calibration.id == st["calibration_id"]
        assert "served prompts" in learned.info()["meta"]["source"]
        # Turn 2 again, after another conversation: restored from the store,
        # compressed with the learned calibration.
        p2 = first_turn() + a1 + "\nQuestion: What is it about?\nAnswer:"
        cache.flush()
        llm.reset()
        llm.eval(llm.tokenize(b"An unrelated conversation."))
        got = []
        assert ask(llm, p2, logits=got) is not None
        s = cache.stats()
        assert s["hits_ram"] + s["hits_pending"] >= 1 and s["tokens_restored"] >= 850, s
        kls, agree = kl_while_agreeing(kept[2], got)
        print(f"turn 2 restored with the calibration learned from {st['fit']} served tokens: mean KL {sum(kls) / len(kls):.4f} over "
              f"{len(kls)} positions, {agree} of 12 agree")
        # Measured 0.0028 (12 of 12 agree) in 3 runs here: lower than the
        # fixed small calibration's 0.015 above, as the rows learned include
        # this very document. Bound 0.01, ~3.5x: which states a busy learner
        # skips, and the projection's rounding by CPU, change the calibration.
        assert sum(kls) / len(kls) < 0.01, (kls, agree)
        cache.close()
        # Another process with the same Redis and secret: the fleet's calibration, nothing to learn.
        with KvtcCache("auto", make_llm(), **learn, **fleet) as b:
            assert b.calibration is not None and b.calibration.id == learned.id
            assert b.calibration_status()["state"] == "live"
        # A restart without Redis: the file beside the disk tier, and the states stored there.
        llm2 = make_llm()
        with KvtcCache("auto", llm2, disk_dir=disk, secret_file=secret, **learn) as c:
            assert c.calibration.id == learned.id
            c.flush()
            assert llm2.tokenize(first_turn().encode()) in c
        # Without a secret the fleet is not used: a warning, and learning from scratch.
        with KvtcCache("auto", make_llm(), redis_url=r.url, **learn) as d:
            assert d.calibration is None and d.calibration_status()["state"] == "learning"
    finally:
        r.stop()
    with pytest.raises(kvtc.Error, match="raw=True stores f16"):
        KvtcCache("auto", make_llm(), raw=True)


def test_entropy_coded_pieces_by_default_and_the_dp_on_request(smol_calibration):
    # KvtcCache's store codes entropy-coded pieces unless entropy_coded=False
    # asks for the DP's: two stores (fingerprints), the default the first.
    llm = make_llm()
    fp = {}
    for e in (True, False):
        with KvtcCache(smol_calibration, llm, entropy_coded=e) as cache:
            fp[e] = cache._store.fingerprint
    assert fp[True] != fp[False]
    with KvtcCache(smol_calibration, llm) as cache:
        assert cache._store.fingerprint == fp[True]
