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
from serverlib import Redis  # noqa: E402  (redis-server on a loopback port, as the server tests use)

N_CTX = 2048


def make_llm(**kw):
    return llama_cpp.Llama(SMOL, n_ctx=N_CTX, n_threads=2, seed=7, verbose=False, **kw)


def document(n_chars=3000):
    with open(eval_text()) as f:
        return f.read()[:n_chars]


def first_turn():
    return document() + "\n\nQuestion: Who wrote this letter?\nAnswer:"


def ask(llm, prompt, n=12):
    return llm(prompt, max_tokens=n, temperature=0)["choices"][0]["text"]


def conversation(llm, cache):
    """Turn 1, a context switch (another conversation runs in the same
    Llama, as on a shared server), then turn 2, which extends turn 1."""
    p1 = first_turn()
    a1 = ask(llm, p1)
    if cache is not None:
        cache.flush()
    llm.reset()
    llm.eval(llm.tokenize(b"An unrelated conversation."))
    p2 = p1 + a1 + "\nQuestion: What is it about?\nAnswer:"
    return a1, ask(llm, p2)


@pytest.fixture(scope="module")
def uncached():
    """The answers without a cache: turn 2 recomputes its whole prefix."""
    return conversation(make_llm(), None)


def test_raw_store_restores_exactly(smol_calibration, uncached):
    llm = make_llm()
    with KvtcCache(smol_calibration, llm, raw=True) as cache:
        llm.set_cache(cache)
        answers = conversation(llm, cache)
        s = cache.stats()
    assert s["hits_ram"] + s["hits_pending"] >= 1 and s["tokens_restored"] >= 512, s
    # f16 pieces, no coding: the restored cache is the original, and so are the answers.
    assert answers == uncached


def test_compressed_cache_answers_the_follow_up_within_budget(smol_calibration, uncached):
    llm = make_llm()
    budget = 4 << 20  # ~1.5 prompts of ~800 tokens at 16x
    with KvtcCache(smol_calibration, llm, capacity_bytes=budget, ratio=16) as cache:
        llm.set_cache(cache)
        a1, a2 = conversation(llm, cache)
        s = cache.stats()
        assert s["hits_ram"] + s["hits_pending"] >= 1 and s["tokens_restored"] >= 512, s
        assert a1 == uncached[0]  # turn 1 ran before any restore
        assert a2.strip(), "no answer after the restore"
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


def test_states_survive_a_restart_on_disk(smol_calibration, work):
    disk = work / "kvtc-disk"
    p1 = first_turn()
    llm = make_llm()
    with KvtcCache(smol_calibration, llm, disk_dir=disk) as cache:
        llm.set_cache(cache)
        ask(llm, p1, n=4)
        cache.flush()
        assert cache.stats()["disk_entries"] >= 1
    # A new process would do this: a new Llama, a new cache over the same directory.
    llm2 = make_llm()
    with KvtcCache(smol_calibration, llm2, disk_dir=disk) as cache2:
        llm2.set_cache(cache2)
        cache2.flush()  # the disk tier is read back in the background
        assert llm2.tokenize(p1.encode()) in cache2
        ask(llm2, p1 + " Paul.\nQuestion: To whom?\nAnswer:", n=4)
        assert cache2.stats()["hits_disk"] >= 1


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
    cache = KvtcCache(smol_calibration)  # no Llama: nothing to restore until a state was stored
    assert [1, 2, 3] not in cache
    with pytest.raises(KeyError):
        cache[[1, 2, 3]]
    cache.close()


def test_two_processes_share_a_redis_tier(smol_calibration, work):
    """Turn 1 in one Llama, turn 2 in another (as two servers behind a load
    balancer): the second restores turn 1 from a real redis-server. With Redis
    stopped, a third still answers (it recomputes), and says Redis is down."""
    r = Redis(str(work / "redis"))
    try:
        p1 = first_turn()
        llm_a = make_llm()
        with KvtcCache(smol_calibration, llm_a, redis_url=r.url) as a:
            llm_a.set_cache(a)
            a1 = ask(llm_a, p1, n=4)
            a.flush()
            assert a.stats()["redis_up"] == 1
        assert int(r.cli("DBSIZE")) >= 1
        p2 = p1 + a1 + "\nQuestion: To whom?\nAnswer:"
        llm_b = make_llm()
        with KvtcCache(smol_calibration, llm_b, redis_url=r.url) as b:  # RAM empty, no disk
            llm_b.set_cache(b)
            assert ask(llm_b, p2, n=4).strip()
            s = b.stats()
        assert s["hits_redis"] >= 1 and s["tokens_restored"] >= 512, s
        r.stop()
        llm_c = make_llm()
        with KvtcCache(smol_calibration, llm_c, redis_url=r.url) as c:
            llm_c.set_cache(c)
            assert ask(llm_c, p2, n=4) == ask(make_llm(), p2, n=4)  # recomputed: the uncached answer
            s = c.stats()
        assert s["hits_redis"] == 0 and s["redis_up"] == 0 and s["redis_error"], s
    finally:
        r.stop()
