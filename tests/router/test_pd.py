"""The router's pd mode over real engines on loopback: a prefill engine (`--kv-role producer`) and a decode engine
(`--kv-transfer-config` as vLLM spells it), with the router in a thread of the test. Greedy answers through
prefill -> decode equal one engine's, streamed and not; the decode engine pulls only the blocks it lacks; short
prompts skip the prefill engine; failures fall back to a local prefill; no engine keeps a block afterwards."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fulcrum.engine.kv_transfer import KVTransferConfig
from fulcrum.router.app import RouterConfig, build_app
from fulcrum.router.pd import PDConfig, PDRouter
from fulcrum.router.pool import Pool
from fulcrum.router.scrape import sample_totals
from fulcrum.utils.serve_process import free_port
from tests.router.conftest import router_process, serve_router, start_replica
from tests.servers import MODEL

TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 2


SIGNER = KVTransferConfig.parse({"kv_role": "kv_producer", "secret": "pd-test"})  # the pair's shared secret


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    kinds = [
        (
            "--kv-role",
            "producer",
            "--kv-transfer-config",
            '{"kv_role": "kv_producer", "lease_timeout_s": 2, "secret": "pd-test"}',
        ),
        (
            "--kv-transfer-config",
            '{"kv_connector": "ZmqConnector", "kv_role": "kv_consumer", "pull_timeout_s": 2, "secret": "pd-test"}',
        ),
    ]
    with ThreadPoolExecutor(2) as ex:
        prefill, decode = ex.map(lambda a: start_replica(tmp, "--cpu-threads", "1", "--cpu-bind", "none", *a), kinds)
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.fixture(scope="module")
def pd(engines):
    prefill, decode = engines
    pools = [Pool([e.url], interval=0.1) for e in engines]
    router = PDRouter(*pools, RouterConfig(policy="least-load", model=MODEL), PDConfig(min_prompt_tokens=24))
    with serve_router(router, build_app(router)) as running:
        yield running


def metrics(url: str) -> dict[str, float]:
    """An engine's /metrics: sample name -> value (summed over labels)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        return sample_totals(r.read().decode())


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def completion(url: str, prompt: str, **kw) -> str:
    r = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def streamed(url: str, path: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                for c in event["choices"]:
                    text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


def idle(*urls, timeout=8.0) -> None:
    """Until every engine holds no block: none in use, none leased, none waiting for a pull."""
    deadline = time.time() + timeout
    while True:
        ms = [metrics(u) for u in urls]
        if all(m["fulcrum:kv_cache_usage_perc"] == 0 and m["fulcrum:kv_transfer_held_blocks"] == 0
               and m["fulcrum:kv_transfer_pending"] == 0 for m in ms):  # fmt: skip
            return
        assert time.time() < deadline, f"blocks still held: {ms}"
        time.sleep(0.2)


def routes(pd) -> dict[str, float]:
    return {s.labels["path"]: s.value for s in pd.router.routes.collect()[0].samples if s.name.endswith("_total")}


def test_pd_greedy_equals_one_engine_streamed_and_not(engines, pd):
    prefill, decode = engines
    # the reference: one engine alone (the prefill engine, which then holds the prompt: a prefix hit there next)
    ref = completion(prefill.url, TEXT)
    before = metrics(decode.url)
    assert completion(pd.url, TEXT) == ref
    assert streamed(pd.url, "/v1/completions", {"prompt": TEXT, "max_tokens": 12, "temperature": 0}) == ref
    after = metrics(decode.url)
    assert after["fulcrum:kv_transfer_pulls_total"] - before["fulcrum:kv_transfer_pulls_total"] >= 1
    assert after["fulcrum:kv_transfer_fallbacks_total"] == before["fulcrum:kv_transfer_fallbacks_total"]
    assert metrics(prefill.url)["fulcrum:prefix_cache_hits_total"] > 0
    messages = [{"role": "user", "content": TEXT}]
    chat_ref = post(prefill.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 10, "temperature": 0})
    chat_ref = chat_ref.json()["choices"][0]["message"]["content"]
    chat = post(pd.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 10, "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] == chat_ref
    body = {"messages": messages, "max_tokens": 10, "temperature": 0}
    assert streamed(pd.url, "/v1/chat/completions", body) == chat_ref
    assert routes(pd)["disaggregated"] == 4, routes(pd)
    idle(prefill.url, decode.url)


def test_decode_engine_pulls_only_the_blocks_it_lacks(engines, pd):
    prefill, decode = engines
    shared = "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. " * 2
    longer = shared + "Or if thou wilt not, be but sworn my love, and I'll no longer be a Capulet."
    n_shared = len(post(decode.url, "/tokenize", {"prompt": shared}).json()["tokens"])
    n_longer = len(post(decode.url, "/tokenize", {"prompt": longer}).json()["tokens"])
    ref = completion(prefill.url, longer)
    m0 = metrics(decode.url)["fulcrum:kv_transfer_received_blocks_total"]
    completion(pd.url, shared)  # the decode engine now holds the shared prefix
    m1 = metrics(decode.url)["fulcrum:kv_transfer_received_blocks_total"]
    assert m1 - m0 == (n_shared - 1) // 16
    assert completion(pd.url, longer) == ref
    m2 = metrics(decode.url)["fulcrum:kv_transfer_received_blocks_total"]
    assert m2 - m1 == (n_longer - 1) // 16 - n_shared // 16
    idle(prefill.url, decode.url)


def test_concurrent_disaggregated_requests_each_get_their_own_tokens(engines, pd):
    prefill, decode = engines
    lines = [
        "KING HENRY: Once more unto the breach, dear friends, once more;",
        "PORTIA: The quality of mercy is not",
        "MACBETH: Tomorrow, and tomorrow, and tomorrow, creeps in",
        "PUCK: If we shadows have offended, think",
        "PROSPERO: Our revels now are ended. These our actors,",
        "VIOLA: If music be the food of love, play on",
    ]
    prompts = [(line + " ") * 3 for line in lines]
    refs = [completion(prefill.url, p) for p in prompts]
    pulls = metrics(decode.url)["fulcrum:kv_transfer_pulls_total"]
    with ThreadPoolExecutor(len(prompts)) as ex:
        assert list(ex.map(lambda p: completion(pd.url, p), prompts)) == refs
    assert metrics(decode.url)["fulcrum:kv_transfer_pulls_total"] - pulls == len(prompts)
    idle(prefill.url, decode.url)


def test_the_cli_runs_pd_mode_through_the_openai_client(engines, tmp_path):
    import openai

    prefill, decode = engines
    flags = ["--prefill", prefill.url, "--decode", decode.url, "--model", str(MODEL), "--pd-min-prompt-tokens", "16"]
    with router_process(tmp_path, *flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        prompt = TEXT + " FRIAR: These violent delights have violent ends"
        ref = completion(prefill.url, prompt, max_tokens=8)
        out = client.completions.create(model="shakespeare", prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].text == ref
        chunks = client.completions.create(model="shakespeare", prompt=prompt, max_tokens=8, temperature=0,
                                           stream=True)  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
        assert 'fulcrum_router:pd_requests_total{path="disaggregated"} 2.0' in httpx.get(f"{url}/metrics").text
    bad = subprocess.run([sys.executable, "-m", "fulcrum.cli", "router", "--prefill", prefill.url],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0 and "pd mode takes --prefill URL and --decode URL" in bad.stderr


def test_short_prompts_go_straight_to_decode(engines, pd):
    prefill, decode = engines
    sent = pd.requests_by_replica().get(prefill.url, 0)
    assert completion(pd.url, "KING:") == completion(decode.url, "KING:")
    assert pd.requests_by_replica().get(prefill.url, 0) == sent
    assert routes(pd)["short-prompt"] >= 1


def test_no_prefill_engine_goes_straight_to_decode(engines):
    _, decode = engines
    dead = f"http://127.0.0.1:{free_port()}"
    router = PDRouter(Pool([dead], interval=0.1), Pool([decode.url], interval=0.1), RouterConfig(model=MODEL),
                      PDConfig(min_prompt_tokens=8))  # fmt: skip
    with serve_router(router, build_app(router)) as pd:
        assert completion(pd.url, TEXT) == completion(decode.url, TEXT)
        assert routes(pd) == {"no-prefill-engine": 1}


def test_handshake_refuses_a_mismatched_pair(engines):
    prefill, decode = engines
    r = post(prefill.url, "/v1/completions", {"prompt": TEXT, "max_tokens": 1,
                                              "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
    params = r.json()["kv_transfer_params"]
    bad = {**params, "block_size": 32, "kv_dtype": "bfloat16"}
    r = post(decode.url, "/v1/completions", {"prompt": TEXT, "max_tokens": 4, "kv_transfer_params": bad})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "block_size (prefill engine: 32, this engine: 16)" in message and "kv_dtype" in message
    # params made for another prompt of the same length: its blocks would poison this prompt's cache entries
    other = post(decode.url, "/tokenize", {"prompt": TEXT}).json()["tokens"]
    other[3] = (other[3] + 1) % 2000
    r = post(decode.url, "/v1/completions", {"prompt": other, "max_tokens": 4, "kv_transfer_params": params})
    assert r.status_code == 400 and "made for another prompt (block 0 differs)" in r.json()["error"]["message"]
    # a prefill engine takes no KV, a decode engine offers none
    r = post(prefill.url, "/v1/completions", {"prompt": TEXT, "max_tokens": 4, "kv_transfer_params": params})
    assert r.status_code == 400 and "takes no KV" in r.json()["error"]["message"]
    r = post(decode.url, "/v1/completions", {"prompt": TEXT, "max_tokens": 1,
                                             "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
    assert r.status_code == 400 and "offers no KV" in r.json()["error"]["message"]
    # the lease of the prefill above was never pulled: it expires and its blocks come back
    held = metrics(prefill.url)["fulcrum:kv_transfer_leases_expired_total"]
    idle(prefill.url, decode.url)
    assert metrics(prefill.url)["fulcrum:kv_transfer_leases_expired_total"] == held + 1


def test_failed_pull_falls_back_to_local_prefill(engines):
    prefill, decode = engines
    prompt = TEXT + " MERCUTIO: A plague on both your houses!"
    ref = completion(prefill.url, prompt)
    r = post(prefill.url, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                              "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
    params = r.json()["kv_transfer_params"]
    # a client's own params (another port, no valid signature) are refused at once: nothing is contacted
    forged = {**params, "remote_port": free_port()}
    r = post(decode.url, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": forged})
    assert r.status_code == 400 and "not signed by a producer this engine trusts" in r.json()["error"]["message"]
    dead = {**forged, "signature": SIGNER.sign(forged)}  # a trusted producer "died": nobody answers the pull
    fallbacks = metrics(decode.url)["fulcrum:kv_transfer_fallbacks_total"]
    assert completion(decode.url, prompt, kv_transfer_params=dead) == ref
    assert metrics(decode.url)["fulcrum:kv_transfer_fallbacks_total"] == fallbacks + 1
    idle(prefill.url, decode.url)  # the real lease expired unpulled


def test_client_gone_mid_stream_frees_blocks_on_both(engines, pd):
    prefill, decode = engines
    body = {"prompt": TEXT + " BENVOLIO: Tell me in sadness", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{pd.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one event, then the client hangs up
    idle(prefill.url, decode.url)


def test_pd_over_shared_memory_between_processes(tmp_path):
    """Two engine processes of this host moving the blocks through /dev/shm: the answer equals one engine's, and the
    producer's segments are gone once it stops (its one released segment stays pooled while it runs)."""

    def flags(role):
        cfg = {"kv_connector": "SharedMemoryConnector", "kv_role": role, "lease_timeout_s": 2, "pull_timeout_s": 5,
               "kv_connector_extra_config": {"secret": "pd-test"}}  # fmt: skip
        return ("--cpu-threads", "1", "--cpu-bind", "none", "--kv-transfer-config", json.dumps(cfg))

    with ThreadPoolExecutor(2) as ex:
        prefill, decode = ex.map(lambda r: start_replica(tmp_path, *flags(r)), ["kv_producer", "kv_consumer"])
    pid = prefill.engine_pid()
    try:
        pools = [Pool([e.url], interval=0.1) for e in (prefill, decode)]
        router = PDRouter(*pools, RouterConfig(policy="least-load", model=MODEL), PDConfig(min_prompt_tokens=24))
        prompt = "HORATIO: Now cracks a noble heart. Good night, sweet prince, and flights of angels sing thee. " * 2
        with serve_router(router, build_app(router)) as running:
            ref = completion(prefill.url, prompt)
            before = metrics(decode.url)
            assert completion(running.url, prompt) == ref
            after = metrics(decode.url)
        assert after["fulcrum:kv_transfer_pulls_total"] == before["fulcrum:kv_transfer_pulls_total"] + 1
        assert after["fulcrum:kv_transfer_fallbacks_total"] == before["fulcrum:kv_transfer_fallbacks_total"]
        assert after["fulcrum:kv_transfer_inline_pulls_total"] == 0  # the bytes took /dev/shm, not TCP
        idle(prefill.url, decode.url)
        assert len(glob.glob(f"/dev/shm/fulcrum-kv-*-{pid}-*")) == 1  # the released one, pooled
    finally:
        prefill.stop()
        decode.stop()
    assert glob.glob(f"/dev/shm/fulcrum-kv-*-{pid}-*") == []


def test_decode_engine_killed_mid_pull(engines):
    """The producer is frozen (SIGSTOP) so that the consumer's pull is in flight when the consumer is killed; the
    producer, thawed, answers into the void, no release ever comes, and the lease's end frees the blocks.
    Last in this file: it kills the module's decode engine (a fresh one would cost a start of its own)."""
    prefill, victim = engines
    prompt = "GHOST: Adieu, adieu, adieu! remember me. HAMLET: O all you host of heaven! O earth! " * 2  # not cached
    try:
        r = post(prefill.url, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                  "kv_transfer_params": {"do_remote_decode": True}})  # fmt: skip
        params = r.json()["kv_transfer_params"]
        producer = prefill.engine_pid()
        os.kill(producer, signal.SIGSTOP)
        try:
            body = {"prompt": prompt, "max_tokens": 8, "kv_transfer_params": params}
            with ThreadPoolExecutor(1) as ex:
                answer = ex.submit(lambda: httpx.post(f"{victim.url}/v1/completions", json=body, timeout=30))
                deadline = time.time() + 10
                while metrics(victim.url)["fulcrum:kv_transfer_pending"] == 0:  # the pull is under way
                    assert time.time() < deadline, "the pull never started"
                    time.sleep(0.05)
                os.kill(victim.engine_pid(), signal.SIGKILL)
                os.kill(victim.proc.pid, signal.SIGKILL)
                with pytest.raises(httpx.TransportError):
                    answer.result(timeout=30).raise_for_status()
        finally:
            os.kill(producer, signal.SIGCONT)
        expired = metrics(prefill.url)["fulcrum:kv_transfer_leases_expired_total"]
        idle(prefill.url)
        assert metrics(prefill.url)["fulcrum:kv_transfer_leases_expired_total"] == expired + 1
        # the producer serves on
        assert completion(prefill.url, TEXT) != ""
    finally:
        victim.stop()
