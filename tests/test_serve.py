"""`speccheck serve` speaks vLLM's OpenAI server dialect: shapes, auth, errors, metrics.

Each server is a real one on a free loopback port, in front of the real reference engine."""
from __future__ import annotations

import dataclasses
import threading

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from speccheck.engines import EngineUsageError, make_engine
from speccheck.serve import build_server, running_server
from speccheck.types import Prompt, SpecConfig

KEY_ENV = "SPECCHECK_TEST_SERVE_KEY"
SECRET = "sk-serve-test-1234567890"


@pytest.fixture(scope="module")
def engine():
    e = make_engine("reference")
    yield e
    e.close()


@pytest.fixture(scope="module")
def mtp_url(engine):
    with running_server("mtp", 2, engine=engine, served_model="ref-mtp") as url:
        yield url


@pytest.fixture(scope="module")
def ids(engine):
    return engine.tokenize(Prompt("p", "code", 6, text="def add(a, b):\n    return"))


def _complete(url: str, **body) -> httpx.Response:
    body = {"temperature": 0, "max_tokens": 6, **body}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _spec_samples(text: str) -> dict[tuple[str, str | None], float]:
    return {(s.name, s.labels.get("position")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("vllm:spec_decode")}


def test_info_endpoints(mtp_url, engine):
    assert httpx.get(mtp_url + "/health").status_code == 200
    version = httpx.get(mtp_url + "/version").json()
    assert version["version"] and version["speccheck"]["config"] == {"method": "mtp", "k": 2,
                                                                     "draft": None}
    assert version["speccheck"]["engine_identity"] == engine.identity()
    models = httpx.get(mtp_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["ref-mtp"]


def test_token_id_prompt_logprobs_shape(mtp_url, ids, engine):
    r = _complete(mtp_url, prompt=ids, logprobs=3, return_tokens_as_token_ids=True,
                  return_token_ids=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(choice["token_ids"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) > 0
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    for tok, top, chosen in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]):
        assert len(top) <= 4 and top[tok] == chosen  # chosen token first, then the top-3
        assert chosen == max(top.values())  # greedy: the chosen token is the top-1
    assert choice["text"] == engine.detokenize(choice["token_ids"])
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_text_prompt_equals_token_prompt(mtp_url, ids):
    by_ids = _complete(mtp_url, prompt=ids, return_token_ids=True).json()["choices"][0]
    by_text = _complete(mtp_url, prompt="def add(a, b):\n    return",
                        return_token_ids=True).json()["choices"][0]
    assert by_text["prompt_token_ids"] == ids
    assert by_text["token_ids"] == by_ids["token_ids"]


def test_tokens_as_strings_and_offsets(mtp_url, ids, engine):
    lp = _complete(mtp_url, prompt=ids, logprobs=2).json()["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]).startswith(lp["tokens"][0])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i])
                                 for i in range(len(lp["tokens"]))]


def test_prompt_logprobs_like_vllm(mtp_url, ids, engine):
    choice = _complete(mtp_url, prompt=ids, max_tokens=1,
                       prompt_logprobs=3).json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    scored = engine.score([ids[:1]], [ids[1:]], 3)[0]
    for j, entry in enumerate(plp[1:]):
        own = entry[str(ids[j + 1])]
        assert own["logprob"] == pytest.approx(float(scored.token_logprobs[j]), abs=1e-6)
        ranked = sorted((v["rank"], int(t)) for t, v in entry.items() if v["rank"] and
                        v["rank"] <= 3)
        assert [t for _, t in ranked] == scored.topk_ids[j].tolist()


def test_rejects_what_it_cannot_honour(mtp_url, ids):
    no_temp = httpx.post(mtp_url + "/v1/completions", json={"prompt": ids}, timeout=30)
    assert no_temp.status_code == 400 and "temperature" in no_temp.json()["error"]["message"]
    assert _complete(mtp_url, prompt=ids, temperature=-0.1).status_code == 400
    assert _complete(mtp_url, prompt=ids, temperature=0.7, top_p=0).status_code == 400
    assert _complete(mtp_url, prompt=ids, temperature=0.7, seed="x").status_code == 400
    assert _complete(mtp_url, prompt=ids, n=2).status_code == 400  # greedy: one answer
    assert _complete(mtp_url, prompt=ids, stream="yes").status_code == 400
    assert _complete(mtp_url, prompt=ids, stream_options={"include_usage": True}).status_code == 400
    assert _complete(mtp_url, prompt=ids, echo=True).status_code == 400
    assert _complete(mtp_url, prompt=[]).status_code == 400
    wrong = _complete(mtp_url, prompt=ids, model="gpt-4")
    assert wrong.status_code == 404
    assert wrong.json()["error"]["message"] == "The model `gpt-4` does not exist."
    assert httpx.get(mtp_url + "/v1/nothing").status_code == 404


def test_ignore_eos_like_vllm(mtp_url, engine):
    """vLLM's ``ignore_eos``: a prompt whose first token is end-of-sequence (smoke-chat on
    the reference model) stops at once; with ignore_eos it runs to max_tokens, exactly as the
    in-process engine decodes it. A non-boolean value is a 400, not silently ignored."""
    from speccheck.corpus import load_corpus

    chat = dataclasses.replace(load_corpus("smoke").get("smoke-chat"), max_tokens=6)
    ids = engine.tokenize(chat)
    stops = _complete(mtp_url, prompt=ids, return_token_ids=True).json()["choices"][0]
    assert stops["finish_reason"] == "stop" and len(stops["token_ids"]) == 1
    goes_on = _complete(mtp_url, prompt=ids, return_token_ids=True,
                        ignore_eos=True).json()["choices"][0]
    want = engine.generate([dataclasses.replace(chat, ignore_eos=True)], [ids],
                           SpecConfig("mtp", 2), 5)[0]
    assert goes_on["finish_reason"] == "length" and goes_on["token_ids"][0] == stops["token_ids"][0]
    assert goes_on["token_ids"] == want.token_ids.tolist() and len(goes_on["token_ids"]) == 6
    bad = _complete(mtp_url, prompt=ids, ignore_eos="yes")
    assert bad.status_code == 400 and "ignore_eos" in bad.json()["error"]["message"]


def test_tokenize_detokenize(mtp_url, engine, ids):
    out = httpx.post(mtp_url + "/tokenize", json={"prompt": "def add(a, b):\n    return"}).json()
    assert out["tokens"] == ids and out["count"] == len(ids)
    chat = ({"role": "user", "content": "hi"},)
    out = httpx.post(mtp_url + "/tokenize", json={"messages": list(chat)}).json()
    assert out["tokens"] == engine.tokenize(Prompt("c", "chat", 4, messages=chat))
    back = httpx.post(mtp_url + "/detokenize", json={"tokens": ids}).json()
    assert back["prompt"] == engine.detokenize(ids)


def test_metrics_count_drafts_per_position(mtp_url, ids):
    before = _spec_samples(httpx.get(mtp_url + "/metrics").text)
    assert {p for (name, p) in before if name.endswith("per_pos_total")} == {"0", "1"}
    _complete(mtp_url, prompt=ids, max_tokens=8)
    after = _spec_samples(httpx.get(mtp_url + "/metrics").text)
    drafts = after[("vllm:spec_decode_num_drafts_total", None)] - \
        before[("vllm:spec_decode_num_drafts_total", None)]
    draft_tokens = after[("vllm:spec_decode_num_draft_tokens_total", None)] - \
        before[("vllm:spec_decode_num_draft_tokens_total", None)]
    accepted = after[("vllm:spec_decode_num_accepted_tokens_total", None)] - \
        before[("vllm:spec_decode_num_accepted_tokens_total", None)]
    per_pos = [after[("vllm:spec_decode_num_accepted_tokens_per_pos_total", p)]
               - before[("vllm:spec_decode_num_accepted_tokens_per_pos_total", p)]
               for p in ("0", "1")]
    assert drafts > 0 and draft_tokens == 2 * drafts
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1]


def test_baseline_server_exports_no_spec_counters(engine, ids):
    with running_server("baseline", engine=engine) as url:
        assert _complete(url, prompt=ids).status_code == 200
        text = httpx.get(url + "/metrics").text
    assert "vllm:request_success_total" in text and not _spec_samples(text)


def test_bearer_auth_like_vllm(engine, ids, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    with running_server("baseline", api_key_env=KEY_ENV, engine=engine) as url:
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(url + path).status_code == 200, path
        denied = httpx.get(url + "/v1/models")
        assert denied.status_code == 401 and denied.json() == {"error": "Unauthorized"}
        assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401
        wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {SECRET}"})
        assert ok.status_code == 200


def test_refuses_to_start_on_bad_options(engine, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(EngineUsageError, match=KEY_ENV):
        build_server(port=0, api_key_env=KEY_ENV, engine=engine)
    with pytest.raises(EngineUsageError, match="baseline takes no K"):
        build_server(port=0, method="baseline", k=3, engine=engine)
    with pytest.raises(EngineUsageError, match="K must be"):
        build_server(port=0, method="mtp", k=99, engine=engine)
    with pytest.raises(EngineUsageError, match="--method eagle: this engine runs baseline or"):
        build_server(port=0, method="eagle", k=2, engine=engine)


# --- streaming (SSE), as vLLM's /v1/completions streams ------------------------------------------

def _stream(url: str, on_event=None, **body) -> tuple[httpx.Response, list]:
    """A streamed request: (response, the data payloads parsed); ``on_event`` is called with
    each payload as it arrives."""
    import json

    body = {"temperature": 0, "max_tokens": 6, "stream": True, **body}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                if on_event:
                    on_event(events[-1])
    return r, events


def test_stream_like_vllm(mtp_url, ids, engine):
    """A real SSE stream over real HTTP: ``text/event-stream``, one ``data:`` event per step,
    then ``data: [DONE]``; the first chunk has the prompt's ids, the last the finish reason;
    joined, the chunks are exactly the non-streamed answer (ids, text, logprobs, offsets)."""
    want = _complete(mtp_url, prompt=ids, max_tokens=12, logprobs=3,
                     return_tokens_as_token_ids=True, return_token_ids=True).json()["choices"][0]
    r, events = _stream(mtp_url, prompt=ids, max_tokens=12, logprobs=3,
                           return_tokens_as_token_ids=True, return_token_ids=True,
                           stream_options={"include_usage": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers.get("transfer-encoding") == "chunked"
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []  # the usage chunk
    assert events[-2]["usage"]["completion_tokens"] == len(want["token_ids"])
    chunks = [e["choices"][0] for e in events[:-2]]
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events[:-1])
    assert chunks[0]["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["finish_reason"] == want["finish_reason"]
    assert [t for c in chunks for t in c["token_ids"]] == want["token_ids"]
    assert "".join(c["text"] for c in chunks) == want["text"]
    lps = [c["logprobs"] for c in chunks if c["token_ids"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for lp in lps for x in lp[key]] == want["logprobs"][key], key
    # MTP K=2: a verify step emits up to K+1 tokens, so some chunk carries more than one
    sizes = [len(c["token_ids"]) for c in chunks if c["token_ids"]]
    assert max(sizes) <= 3 and len(sizes) < len(want["token_ids"])


class _Lockstep:
    """The engine, held after each step it hands to the server until the client has read
    that step's chunk: a server that buffered the stream would leave the first hold waiting
    (it gives up once, after 60 s, and counts the step as sent too late)."""

    def __init__(self, engine):
        self._engine = engine
        self.read = threading.Semaphore(0)
        self.steps = 0
        self.late = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate_streaming(self, prompt, prompt_ids, config, top_k, on_tokens):
        def held(*step):
            on_tokens(*step)
            self.steps += 1
            if not self.late and not self.read.acquire(timeout=60):
                self.late = self.steps
        return self._engine.generate_streaming(prompt, prompt_ids, config, top_k, held)


def test_stream_sends_each_step_as_it_is_decided(engine, ids):
    """Each step leaves before the next is decided: the engine is held after every step of
    48 baseline decode steps until the client has read that step's chunk, and there is one
    chunk per step (not one buffered event at the end)."""
    lockstep = _Lockstep(engine)

    def read(event):
        if event != "[DONE]" and event["choices"] and event["choices"][0]["token_ids"]:
            lockstep.read.release()

    with running_server("baseline", engine=lockstep) as url:
        r, events = _stream(url, read, prompt=ids, max_tokens=48, ignore_eos=True,
                            return_token_ids=True)
    carrying = [e for e in events if e != "[DONE]" and e["choices"][0]["token_ids"]]
    assert len(carrying) == 48 == lockstep.steps  # baseline: one token per decode step
    assert lockstep.late == 0, f"step {lockstep.late}'s chunk had not reached the client"


def test_stream_client_that_hangs_up_does_not_stop_the_server(engine, ids):
    """A client that closes the stream after its first event: the server finishes that
    request (it counts in /metrics) and serves the next one."""
    import json

    from speccheck.engines.openai import parse_metrics

    with running_server("baseline", engine=engine) as url:
        served = lambda: parse_metrics(httpx.get(url + "/metrics").text)["requests"]  # noqa: E731
        before = served()
        body = {"prompt": ids, "max_tokens": 40, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        again = _complete(url, prompt=ids, max_tokens=3, return_token_ids=True)
        assert again.status_code == 200 and len(again.json()["choices"][0]["token_ids"]) == 3
        assert served() - before == 2


def test_stream_refusals_before_the_first_token_are_plain_http_errors(mtp_url, ids):
    """Like vLLM, a request refused before anything streams is an ordinary JSON error."""
    too_long = _complete(mtp_url, prompt=ids, max_tokens=40000, stream=True)
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
    wrong = _complete(mtp_url, prompt=ids, model="other", stream=True)
    assert wrong.status_code == 404


@pytest.mark.parametrize("config,fault", [("baseline", None), ("mtp-k3", None), ("dflash-k7", None),
                                          ("dflash2-k3", None), ("mtp-k3", "past-eos"),
                                          ("mtp-k3", "past-max-tokens")])
def test_reference_engine_streams_exactly_its_completion(engine, config, fault):
    """Engine.generate_streaming on the reference engine: the steps handed out, joined, are the
    completion generate() returns (tokens, logprobs, top-k), one step per decode or verify
    forward -- also where a planted fault emits past a stop."""
    from speccheck.corpus import load_corpus

    eng = engine if fault is None else make_engine("reference", engine_args={"fault": fault})
    cfg = SpecConfig.from_name(config)
    for p in load_corpus("smoke").prompts[:2]:
        p = dataclasses.replace(p, max_tokens=12)
        ids = eng.tokenize(p)
        steps = []
        got = eng.generate_streaming(p, ids, cfg, 4, lambda *step: steps.append(step))
        want = eng.generate([p], [ids], cfg, 4)[0]
        assert [t for s in steps for t in s[0]] == want.token_ids.tolist() == got.token_ids.tolist()
        np.testing.assert_allclose([x for s in steps for x in s[1]], want.logprobs, atol=1e-6)
        assert [r for s in steps for r in s[2]] == want.topk_ids.tolist()
        np.testing.assert_allclose([r for s in steps for r in s[3]], want.topk_logprobs, atol=1e-6)
        if not cfg.is_baseline and want.spec.iterations:
            assert len(steps) == 1 + want.spec.iterations  # the prefill's token, then each verify
    if fault is not None:
        eng.close()


def test_sampled_requests_repeat_by_seed_and_n_samples_are_seed_plus_j(mtp_url, ids):
    """temperature > 0 samples (speculative sampling on this MTP server): the same seed gives
    the same tokens, the j-th of n samples equals a request seeded seed + j (as vLLM seeds
    them), and prompt_logprobs stay the raw ones (before the sampling transform)."""
    def tokens(**body):
        r = _complete(mtp_url, prompt=ids, max_tokens=12, return_token_ids=True,
                      temperature=0.9, top_p=0.95, **body)
        assert r.status_code == 200, r.text
        return [c["token_ids"] for c in r.json()["choices"]]

    assert tokens(seed=11) == tokens(seed=11)
    three = tokens(seed=11, n=3)
    assert three == [tokens(seed=11 + j)[0] for j in range(3)]
    assert len({tuple(t) for t in three}) > 1
    raw = _complete(mtp_url, prompt=ids + three[0][:3], max_tokens=1, prompt_logprobs=2)
    sampled = _complete(mtp_url, prompt=ids + three[0][:3], max_tokens=1, prompt_logprobs=2,
                        temperature=0.9, seed=1)
    assert raw.json()["choices"][0]["prompt_logprobs"] == sampled.json()["choices"][0]["prompt_logprobs"]
