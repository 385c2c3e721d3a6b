"""The `openai` engine end to end against `speccheck serve` (real servers on free loopback
ports, in front of the real reference engine), plus its pure parsing helpers."""
from __future__ import annotations

import dataclasses
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from speccheck.corpus import load_corpus
from speccheck.engines import EngineError, EngineUsageError, make_engine
from speccheck.engines.openai import (OpenAIEngine, counters_delta, merge_stream_events,
                                      parse_metrics, scored_from_prompt_logprobs, sse_data)
from speccheck.serve import running_server
from speccheck.types import Prompt, SpecConfig, SpecCounters

TOP_K = 5
SERVER_KEY_ENV = "SPECCHECK_TEST_SERVER_KEY"
CLIENT_KEY_ENV = "SPECCHECK_TEST_CLIENT_KEY"
SECRET = "sk-right-0123456789abcdef"
WRONG = "sk-wrong-fedcba9876543210"


@pytest.fixture(scope="module")
def ref():
    e = make_engine("reference")
    yield e
    e.close()


@pytest.fixture(scope="module")
def prompts():
    """Smoke prompts (text and chat), shortened: the wire is under test, not the model."""
    return [dataclasses.replace(p, max_tokens=10) for p in load_corpus("smoke").prompts[:3]]


def _client(url: str, **args) -> OpenAIEngine:
    return OpenAIEngine(engine_args={"base_url": url, "retries": "0", **args})


@pytest.mark.parametrize("config", ["baseline", "mtp-k3", "dflash-k3"])
def test_reproduces_in_process_engine(config, ref, prompts):
    """Token ids, top-k and logprobs through HTTP equal the in-process engine's; each
    completion's spec counters (from /metrics before/after) equal the engine's own."""
    cfg = SpecConfig.from_name(config)
    with running_server(cfg.method, cfg.k or None) as url:  # its own engine instance
        eng = _client(url)
        ids = [eng.tokenize(p) for p in prompts]
        assert ids == [ref.tokenize(p) for p in prompts]
        got = eng.generate(prompts, ids, cfg, TOP_K)
        ident = eng.identity()
    want = [ref.generate([p], [i], cfg, TOP_K)[0] for p, i in zip(prompts, ids)]
    for g, w in zip(got, want):
        assert g.prompt_id == w.prompt_id and g.n_tokens > 0
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
        np.testing.assert_array_equal(g.topk_ids, w.topk_ids)
        np.testing.assert_allclose(g.topk_logprobs, w.topk_logprobs, atol=1e-6)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-6)
        assert g.topk_ids.shape == (g.n_tokens, TOP_K)
        assert g.text == w.text and g.finish_reason == w.finish_reason
        assert g.decode_s > 0 and g.ttft_s > 0  # one streamed request: TTFT from its first token
        if cfg.is_baseline:
            assert g.spec is None or g.spec.drafts == 0
        else:
            # a server's /metrics cannot say how many verify steps a request took
            assert g.spec == dataclasses.replace(w.spec, iterations=None)
    if not cfg.is_baseline:
        assert sum(c.spec.drafts for c in got) > 0
    assert ident["engine"] == "openai" and ident["base_url"] == url
    assert ident["ttft"] == "measured from the stream"
    assert ident["server_engine"] == ref.identity()


def test_ignore_eos_is_sent_to_the_server(ref):
    """A prompt with ignore_eos goes to the server with vLLM's extra ``ignore_eos``
    parameter: smoke-chat, which the reference model ends at once, decodes its full budget
    through HTTP as in process; without the flag it still stops."""
    chat = dataclasses.replace(load_corpus("smoke").get("smoke-chat"), max_tokens=8)
    ids = ref.tokenize(chat)
    with running_server("baseline", engine=ref) as url:
        eng = _client(url)
        stops, goes_on = eng.generate([chat, dataclasses.replace(chat, ignore_eos=True)],
                                      [ids, ids], SpecConfig(), TOP_K)
    want = ref.generate([dataclasses.replace(chat, ignore_eos=True)], [ids], SpecConfig(), TOP_K)[0]
    assert stops.n_tokens == 1 and stops.finish_reason == "stop"
    assert goes_on.n_tokens == 8 and goes_on.finish_reason == "length"
    np.testing.assert_array_equal(goes_on.token_ids, want.token_ids)


def test_score_matches_in_process(ref, prompts):
    """Rescoring through prompt_logprobs, on a baseline server under test and on a separate
    baseline server (score_base_url) next to a speculating one, equals the in-process
    engine's score(); a server that speculates is never asked (vLLM 0.26 answered unrelated
    prompt logprobs there): ScoringUnavailable, naming what to do instead."""
    from speccheck.engines.base import ScoringUnavailable

    ids = [ref.tokenize(p) for p in prompts]
    conts = [c.token_ids.tolist() for c in ref.generate(prompts, ids, SpecConfig(), TOP_K)]
    want = ref.score(ids, conts, TOP_K)
    with running_server("mtp", 2) as url, running_server("baseline", engine=ref) as base:
        with pytest.raises(ScoringUnavailable, match="score_base_url=URL") as refused:
            _client(url).score(ids, conts, TOP_K)
        assert "speculative decoding" in str(refused.value)
        on_self = _client(base).score(ids, conts, TOP_K)
        on_base = _client(url, score_base_url=base)
        assert on_base.identity()["score_base_url"] == base
        served = lambda: parse_metrics(httpx.get(base + "/metrics").text)["requests"]  # noqa: E731
        before = served()
        on_base = on_base.score(ids, conts, TOP_K)
        assert served() - before == len(prompts)  # the rescoring ran on the baseline server
    for got in (on_self, on_base):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.topk_ids, w.topk_ids)
            np.testing.assert_allclose(g.topk_logprobs, w.topk_logprobs, atol=1e-4)
            np.testing.assert_allclose(g.token_logprobs, w.token_logprobs, atol=1e-4)


def test_config_must_match_what_the_server_runs(ref, prompts):
    p = prompts[:1]
    with running_server("baseline", engine=ref) as url:
        eng = _client(url)
        ids = [eng.tokenize(p[0])]
        with pytest.raises(EngineUsageError, match=r"runs no speculative decoding.*says mtp"):
            eng.generate(p, ids, SpecConfig("mtp", 3), TOP_K)
    with running_server("mtp", 3, engine=ref) as url:
        eng = _client(url)
        with pytest.raises(EngineUsageError, match=r"K=3, but the config to run is the baseline"):
            eng.generate(p, ids, SpecConfig(), TOP_K)
        with pytest.raises(EngineUsageError, match=r"K=3, but --k says 2"):
            eng.generate(p, ids, SpecConfig("mtp", 2), TOP_K)
        assert eng.default_k("mtp") == 3


def test_wrong_api_key_names_the_variable_not_the_key(ref, prompts, monkeypatch):
    monkeypatch.setenv(SERVER_KEY_ENV, SECRET)
    with running_server("baseline", api_key_env=SERVER_KEY_ENV, engine=ref) as url:
        monkeypatch.setenv(CLIENT_KEY_ENV, WRONG)
        eng = _client(url, api_key_env=CLIENT_KEY_ENV)
        with pytest.raises(EngineUsageError) as err:
            eng.identity()
        msg = str(err.value)
        assert CLIENT_KEY_ENV in msg and "401" in msg
        assert WRONG not in msg and SECRET not in msg and WRONG not in repr(eng)

        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        with pytest.raises(EngineUsageError, match="OPENAI_API_KEY, which is not set"):
            _client(url).identity()

        monkeypatch.setenv(CLIENT_KEY_ENV, SECRET)
        good = _client(url, api_key_env=CLIENT_KEY_ENV)
        ident = good.identity()
        assert SECRET not in json.dumps(ident)
        out = good.generate(prompts[:1], [good.tokenize(prompts[0])], SpecConfig(), TOP_K)
        assert out[0].n_tokens > 0

    monkeypatch.delenv(CLIENT_KEY_ENV)
    with pytest.raises(EngineUsageError, match=f"{CLIENT_KEY_ENV}.*not set"):
        _client("http://127.0.0.1:1", api_key_env=CLIENT_KEY_ENV)


def test_unknown_served_model_is_usage_error(ref):
    with running_server("baseline", engine=ref, served_model="the-model") as url:
        with pytest.raises(EngineUsageError, match="does not serve 'other'.*the-model"):
            _client(url, served_model="other").identity()


def test_unreachable_server_fails_after_bounded_retries(free_port, monkeypatch):
    """Connection refused: 2 retries, waiting ``backoff`` and then twice that before them
    (the waits recorded, not slept), then an EngineError naming the URL."""
    url = f"http://127.0.0.1:{free_port}"  # nothing listens there
    waits = []
    monkeypatch.setattr("speccheck.engines.openai.time.sleep", waits.append)
    eng = OpenAIEngine(engine_args={"base_url": url, "retries": "2", "backoff": "0.5",
                                    "timeout": "2"})
    with pytest.raises(EngineError, match="after 3 attempts") as err:
        eng.identity()
    assert url in str(err.value) and not isinstance(err.value, EngineUsageError)
    assert waits == [0.5, 1.0]


def test_5xx_is_retried_then_engine_error():
    """A stub server (a test double, not vLLM) that answers every request with 503."""
    hits = []

    class Always503(BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            body = b'{"error": {"message": "engine is sleeping", "code": 503}}'
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Always503)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        eng = OpenAIEngine(engine_args={"base_url": f"http://127.0.0.1:{server.server_port}",
                                        "retries": "2", "backoff": "0.01"})
        with pytest.raises(EngineError, match=r"after 3 attempts.*503: engine is sleeping"):
            eng.identity()
    finally:
        server.shutdown()
        server.server_close()
    assert hits == ["/v1/models"] * 3


def test_bad_engine_args():
    with pytest.raises(EngineUsageError, match="unknown --engine-arg colour"):
        OpenAIEngine(engine_args={"colour": "blue"})
    with pytest.raises(EngineUsageError, match="base_url"):
        OpenAIEngine(engine_args={"base_url": "localhost:8000"})
    with pytest.raises(EngineUsageError, match="timeout"):
        OpenAIEngine(engine_args={"timeout": "soon"})


# --- pure helpers, on text in vLLM's exact exposition format ----------------------------------

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 0.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="qwen"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="qwen"} 2.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="qwen"} 40.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="qwen"} 10.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="qwen"} 1.7e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="qwen"} 100.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="qwen"} 61.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen",position="0"} 35.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="qwen",position="1"} 26.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="qwen",position="0"} 0.0
"""


def test_parse_metrics_sums_label_sets():
    m = parse_metrics(VLLM_METRICS)
    assert m["requests"] == 9
    assert m["spec"] == SpecCounters(50, 100, 61, [35, 26])
    baseline = "\n".join(l for l in VLLM_METRICS.splitlines() if "spec_decode" not in l) + "\n"
    assert parse_metrics(baseline) == {"spec": None, "requests": 9}
    assert parse_metrics("") == {"spec": None, "requests": None}


def test_counters_delta():
    before = SpecCounters(5, 15, 7, [4, 2, 1])
    after = SpecCounters(9, 27, 12, [7, 4, 1])
    assert counters_delta(before, after) == SpecCounters(4, 12, 5, [3, 2, 0])
    assert counters_delta(None, after) == after
    assert counters_delta(before, None) is None


def test_scored_from_vllm_prompt_logprobs():
    """Keys are token ids as JSON strings, values vLLM Logprob objects; the prompt's own
    token is in the dict even outside the top-k."""
    full = [11, 12, 13]
    plp = [None,
           {"12": {"logprob": -0.1, "rank": 1, "decoded_token": "b"},
            "40": {"logprob": -2.5, "rank": 2, "decoded_token": "z"}},
           {"13": {"logprob": -3.0, "rank": 5, "decoded_token": "c"},
            "7": {"logprob": -0.2, "rank": 1, "decoded_token": "x"},
            "8": {"logprob": -1.9, "rank": 2, "decoded_token": "y"}}]
    s = scored_from_prompt_logprobs(plp, full, 1, 2)
    assert s.topk_ids.tolist() == [[12, 40], [7, 8]]
    np.testing.assert_allclose(s.token_logprobs, [-0.1, -3.0])
    with pytest.raises(EngineError, match="2 logprobs where 3"):
        scored_from_prompt_logprobs(plp, full, 1, 3)


@pytest.mark.slow
def test_cli_run_against_serve_passes_gate(tmp_path, free_port):
    """The deployment rehearsal, as a user runs it: a baseline server, `speccheck run
    --engine openai`, then the same port restarted with MTP K=2 and run into the same store
    (the finished baseline is skipped; outputs that differ from the baseline's are not
    rescored on the speculating server), then the baseline server again, whose run rescores
    what was left, then `speccheck gate`."""
    from click.testing import CliRunner

    from speccheck.cli import main
    from speccheck.store import Store

    store = str(tmp_path / "store")
    port = free_port
    cli = CliRunner()
    for step, (method, k) in enumerate((("baseline", None), ("mtp", 2), ("baseline", None))):
        with running_server(method, k, port=port) as url:
            args = ["run", "--engine", "openai", "--engine-arg", f"base_url={url}",
                    "--method", method, "--corpus", "smoke", "--store", store, "--axes", "none"]
            result = cli.invoke(main, args + (["--k", str(k)] if k else []))
            assert result.exit_code == 0, result.output
            if step == 2:
                break
            # and the corpus all at once: 4 prompts x 2 concurrent requests to the server
            assert f"{method if k is None else f'mtp-k{k}'} all at once: 8 requests" in result.output
            # the second repeat runs in a process of its own, but the server is the same one
            r1 = next(line for line in result.output.splitlines() if " r1 " in line)
            assert "[new client, same server]" in r1 and "fresh process" not in result.output
            if step == 1:  # rescored only if no output differs from the baseline's
                suite = Store(store).latest()
                assert suite.has_rescore("mtp-k2", 0) != ("rescoring mtp-k2 left for later" in result.output)
    suite = Store(store).latest()
    assert suite.configs() == ["baseline", "mtp-k2"] or set(suite.configs()) == {"baseline", "mtp-k2"}
    assert suite.has_rescore("mtp-k2", 0)
    gate = cli.invoke(main, ["gate", "--store", store])
    assert gate.exit_code == 0, gate.output
    assert "mtp-k2" in gate.output and "baseline" in gate.output


def _replay(cap: dict):
    """What the engine makes of a captured exchange (pure parsing, no server)."""
    from speccheck.engines.openai import completion_from_choice

    k = cap["top_k"]
    choice = cap["generate_response"]["choices"][0]
    comp = completion_from_choice(Prompt("cap", "capture", 12), cap["prompt_ids"], choice, k,
                                  0.0, None)
    full = cap["score_request"]["prompt"]
    scored = scored_from_prompt_logprobs(cap["score_response"]["choices"][0]["prompt_logprobs"],
                                         full, len(cap["prompt_ids"]), k)
    delta = counters_delta(parse_metrics(cap["metrics_before"])["spec"],
                           parse_metrics(cap["metrics_after"])["spec"])
    if cap.get("generate_stream"):  # the same request streamed: its chunks join to the same
        events = [json.loads(d) for d in cap["generate_stream"] if d.strip() != "[DONE]"]
        streamed = completion_from_choice(Prompt("cap", "capture", 12), cap["prompt_ids"],
                                          merge_stream_events(events, "capture")[0], k, 0.0, None)
        np.testing.assert_array_equal(streamed.token_ids, comp.token_ids)
        np.testing.assert_array_equal(streamed.topk_ids, comp.topk_ids)
        np.testing.assert_allclose(streamed.topk_logprobs, comp.topk_logprobs)
        assert streamed.text == comp.text and streamed.finish_reason == comp.finish_reason
        assert cap["generate_stream"][-1].strip() == "[DONE]"
    return comp, scored, delta


def test_capture_of_serve_replays_to_the_engine_s_own_outputs(ref, tmp_path):
    """capture() (the script run next to a real vLLM on the GPU box) recorded against
    speccheck serve: its JSON parses back to exactly what the in-process engine gives."""
    from speccheck.engines.openai import capture

    cap_text = "def fibonacci(n):\n    "
    with running_server("mtp", 2) as url:
        capture(url, str(tmp_path / "cap.json"), text=cap_text, max_tokens=12, top_k=4)
    cap = json.loads((tmp_path / "cap.json").read_text())
    assert len(cap["generate_stream"]) > 2  # chunks, then [DONE]
    comp, scored, delta = _replay(cap)
    assert cap["prompt_ids"] == ref.tokenize(Prompt("cap", "code", 12, text=cap_text))
    want = ref.generate([Prompt("cap", "code", 12)], [cap["prompt_ids"]], SpecConfig("mtp", 2),
                        4)[0]
    np.testing.assert_array_equal(comp.token_ids, want.token_ids)
    np.testing.assert_array_equal(comp.topk_ids, want.topk_ids)
    assert delta == dataclasses.replace(want.spec, iterations=None) and delta.drafts > 0
    np.testing.assert_array_equal(scored.topk_ids[:, 0], comp.token_ids)  # greedy: top-1


@pytest.mark.parametrize("path", sorted(
    (__import__("pathlib").Path(__file__).parents[1] / "fixtures" / "vllm_openai").glob("*.json")),
    ids=lambda p: p.stem)
def test_recorded_vllm_server_exchanges_parse(path):
    """Exchanges captured from a real vLLM server (tests/fixtures/vllm_openai/, written by
    `python -m speccheck.engines.openai URL OUT.json` on the GPU box): the engine's parsers
    read them, greedy tokens are their own top-1, and a speculative server counted drafts."""
    cap = json.loads(path.read_text())
    comp, scored, delta = _replay(cap)
    assert comp.n_tokens > 0 and comp.topk_ids.shape == (comp.n_tokens, cap["top_k"])
    np.testing.assert_array_equal(comp.topk_ids[:, 0], comp.token_ids)
    assert np.all(np.diff(comp.topk_logprobs, axis=1) <= 0)
    assert scored.topk_ids.shape[0] == comp.n_tokens
    if parse_metrics(cap["metrics_after"])["spec"] is not None and comp.n_tokens >= 3:
        assert delta.drafts > 0


def test_cli_wrong_key_exits_2_naming_the_variable(ref, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from speccheck.cli import main

    monkeypatch.setenv(SERVER_KEY_ENV, SECRET)
    monkeypatch.setenv(CLIENT_KEY_ENV, WRONG)
    with running_server("baseline", api_key_env=SERVER_KEY_ENV, engine=ref) as url:
        result = CliRunner().invoke(main, [
            "run", "--engine", "openai", "--engine-arg", f"base_url={url}", "--engine-arg",
            f"api_key_env={CLIENT_KEY_ENV}", "--method", "baseline", "--corpus", "smoke",
            "--store", str(tmp_path / "store")])
    assert result.exit_code == 2, result.output
    assert CLIENT_KEY_ENV in result.output
    assert WRONG not in result.output and SECRET not in result.output
    stored = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())
    assert WRONG not in stored and SECRET not in stored


# --- streaming: one request per completion, TTFT from its first token --------------------------

def test_one_streamed_request_per_completion(ref, prompts):
    """Each completion is one request to the server (its /metrics count one finished request
    per prompt), streamed: the stream's chunks carry the tokens and logprobs."""
    with running_server("baseline", engine=ref) as url:
        served = lambda: parse_metrics(httpx.get(url + "/metrics").text)["requests"]  # noqa: E731
        eng = _client(url)
        ids = [eng.tokenize(p) for p in prompts]
        before = served()
        out = eng.generate(prompts, ids, SpecConfig(), TOP_K)
        assert served() - before == len(prompts)
    assert all(c.ttft_s > 0 for c in out)


@pytest.mark.parametrize("behaviour", ["plain_json", "one_event"])
def test_server_that_does_not_stream_still_works_without_a_ttft(ref, prompts, behaviour):
    """A server that answers stream requests with plain JSON, or sends a whole completion of
    several tokens in one event (test double: stream_doubles' proxy in front of a real
    `speccheck serve`): the same tokens and logprobs, and TTFT is not measured (0.0, said
    so in the identity), not a number that is really the whole request's time."""
    from tests.stream_doubles import misbehaving_proxy

    with running_server("baseline", engine=ref) as url, misbehaving_proxy(url, behaviour) as proxy:
        eng = _client(f"http://127.0.0.1:{proxy.server_port}")
        ids = [eng.tokenize(p) for p in prompts]
        got = eng.generate(prompts, ids, SpecConfig(), TOP_K)
        ident = eng.identity()
        assert proxy.streamed == len(prompts)
    want = [ref.generate([p], [i], SpecConfig(), TOP_K)[0] for p, i in zip(prompts, ids)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
        np.testing.assert_array_equal(g.topk_ids, w.topk_ids)
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-6)
        assert g.text == w.text and g.finish_reason == w.finish_reason
        if g.n_tokens > 1:
            assert g.ttft_s == 0.0 and g.decode_s > 0
    assert ident["ttft"].startswith("not measured")


@pytest.mark.slow
def test_diff_says_ttft_not_measured_for_a_server_that_does_not_stream(ref, tmp_path):
    """The CLI against a non-streaming server (test double: the plain_json proxy in front
    of a real `speccheck serve`): the run passes, and diff's speed line says
    "TTFT not measured" where a streaming server gives milliseconds."""
    from click.testing import CliRunner
    from tests.stream_doubles import misbehaving_proxy

    from speccheck.cli import main

    cli = CliRunner()
    run = ["run", "--engine", "openai", "--method", "baseline", "--corpus", "smoke",
           "--repeats", "1", "--concurrent", "off", "--no-attribution", "--axes", "none"]
    with running_server("baseline", engine=ref) as url, misbehaving_proxy(url, "plain_json") as proxy:
        r = cli.invoke(main, run + ["--base-url", f"http://127.0.0.1:{proxy.server_port}/v1",
                                    "--store", str(tmp_path / "plain")])
        assert r.exit_code == 0, r.output
        r = cli.invoke(main, run + ["--base-url", url, "--store", str(tmp_path / "streamed")])
        assert r.exit_code == 0, r.output
    plain = cli.invoke(main, ["diff", "--store", str(tmp_path / "plain")])
    streamed = cli.invoke(main, ["diff", "--store", str(tmp_path / "streamed")])
    assert "TTFT not measured" in plain.output and " ms" not in plain.output.split("TTFT")[-1]
    assert re.search(r"TTFT \d+\.\d ms", streamed.output), streamed.output
    for store, says in (("plain", "not measured: the server answered stream requests with plain "
                                  "JSON"), ("streamed", "measured from the stream")):
        assert cli.invoke(main, ["report", "--store", str(tmp_path / store)]).exit_code == 0
        md = next((tmp_path / store).rglob("report.md")).read_text()
        assert f"| ttft | `{says}" in md, md[:600]


def test_sse_data_follows_the_event_stream_format():
    lines = [": a comment", "event: completion", 'data: {"a": 1}', "", "data: line one",
             "data:line two", "id: 7", "", "", "data: [DONE]"]
    assert list(sse_data(lines)) == ['{"a": 1}', "line one\nline two", "[DONE]"]
    assert list(sse_data(["data: x\r\n", "\r\n"])) == ["x"]


def _chunk(ids, text="", finish=None, index=0):
    return {"choices": [{"index": index, "text": text, "token_ids": ids, "finish_reason": finish,
                         "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                      "token_logprobs": [-0.5] * len(ids),
                                      "top_logprobs": [{f"token_id:{t}": -0.5} for t in ids]}}]}


def test_merge_stream_events_joins_chunks_in_order():
    choice, carrying = merge_stream_events(
        [_chunk([5], "a"), _chunk([6, 7], "bc"), _chunk([], "", "length"), {"choices": [],
                                                                             "usage": {}}], "p")
    assert choice["token_ids"] == [5, 6, 7] and choice["text"] == "abc"
    assert choice["finish_reason"] == "length" and carrying == 2
    assert choice["logprobs"]["tokens"] == ["token_id:5", "token_id:6", "token_id:7"]


@pytest.mark.parametrize("events,needle", [
    ([_chunk([5]), {"error": {"message": "Internal server error", "code": 500}}],
     "in the middle of the stream (event 2): Internal server error"),
    ([_chunk([5], index=1)], "other than the one asked for"),
    ([[1, 2]], "not a JSON object"),
    ([], "carried no tokens"),
    ([{"choices": "x"}], "not a list"),
    ([{"choices": [{"index": 0, "token_ids": ["a"]}]}], "malformed"),
])
def test_merge_stream_events_refuses_what_is_not_a_completion_stream(events, needle):
    with pytest.raises(EngineError, match=re.escape(needle)):
        merge_stream_events(events, "prompt p")


SAMPLED = {"temperature": "0.8", "top_p": "0.9", "seed": "5"}


def test_sampled_requests_reproduce_the_in_process_engine(ref, prompts):
    """A sampled run through HTTP: each request carries its own seed (the run's seed, the
    config and the prompt), the server draws with it, and the tokens equal the in-process
    engine's under the same sampling args; the sampled positions scored through the baseline
    server's prompt_logprobs (top 20, the tail lumped) equal the in-process engine's
    full-vocabulary scores wherever the top 20 identify the distribution (most of the rest
    is tested within the top 20)."""
    cfg = SpecConfig("mtp", 2)
    local = ref.with_args(temperature="0.8", top_p="0.9", seed="5")
    with running_server("mtp", 2, engine=ref) as url, running_server("baseline", engine=ref) as base:
        eng = _client(url, score_base_url=base, **SAMPLED)
        ids = [eng.tokenize(p) for p in prompts]
        got = eng.generate(prompts, ids, cfg, TOP_K)
        rows = eng.score_sampled(ids, [c.token_ids for c in got])
    want = local.generate(prompts, ids, cfg, TOP_K)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.token_ids, w.token_ids)
    exact = local.score_sampled(ids, [c.token_ids for c in got])
    whole = tested = 0
    for r, e in zip(rows, exact):
        known = ~np.isnan(r[:, 2]) & (r[:, 5] == 0)
        whole += int(known.sum())
        tested += int((~np.isnan(r[:, 2])).sum())
        np.testing.assert_allclose(r[known], e[known], atol=2e-4)
    assert whole > 0 and tested > 0.7 * sum(len(r) for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, "residual-unnormalised"])
def test_cli_sampled_run_against_serve(tmp_path, free_port, fault):
    """`speccheck run --engine openai --temperature 0.8 --top-p 0.9` against a baseline server,
    then against an MTP server scored on the baseline server (score_base_url), then `gate`:
    both distribution checks judge through the wire, the clean server passes, a server whose
    rejection residual is not renormalised fails the distribution check."""
    from click.testing import CliRunner

    from speccheck.cli import main

    store = str(tmp_path / "store")
    cli = CliRunner()
    common = ["run", "--engine", "openai", "--corpus", "smoke", "--store", store, "--axes", "none",
              "--temperature", "0.8", "--top-p", "0.9", "--samples", "2", "--concurrent", "off"]
    spec_args = {"fault": fault} if fault else None
    with running_server("baseline", port=free_port) as url:  # the deployment, first without
        r = cli.invoke(main, common + ["--engine-arg", f"base_url={url}", "--method", "baseline"])
        assert r.exit_code == 0, r.output
    with running_server("mtp", 2, engine_args=spec_args, port=free_port) as url, \
            running_server("baseline") as base:  # then restarted with MTP, a baseline beside
        r = cli.invoke(main, common + ["--engine-arg", f"base_url={url}", "--engine-arg",
                                       f"score_base_url={base}", "--method", "mtp", "--k", "2"])
        assert r.exit_code == 0, r.output
        assert "mtp-k2 sampled positions scored by the target" in r.output
    gate = cli.invoke(main, ["gate", "--store", store])
    if fault is None:
        assert gate.exit_code == 0, gate.output
    else:
        assert gate.exit_code == 1 and "sampled_matches_target failed for config mtp-k2" in gate.output
    diff = cli.invoke(main, ["diff", "--store", store, "--config", "mtp-k2"]).output
    assert "two-sample" in diff and "distribution" in diff
