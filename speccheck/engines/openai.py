"""The `openai` engine: a running OpenAI-compatible server (vLLM, or `speccheck serve`).

This is how the seed's users run vLLM (docker, port 8000, a served model name, an API key).
Generation goes through ``/v1/completions`` with the prompt as token ids, ``temperature: 0``,
``logprobs: k`` and ``return_tokens_as_token_ids`` (top-k keyed ``token_id:N``, so no token
string has to be mapped back); rescoring uses vLLM's ``prompt_logprobs`` extension. Spec
counters come from ``/metrics`` (Prometheus text), scraped before and after every request,
so each completion carries its own counters. Requests are sent one at a time, except in
generate_together() (all in flight at once: the batch-composition variant).

The server runs ONE config; the SpecConfig given to generate() says which one the user
believes it runs, and the metrics must agree (drafts > 0 for a speculative config, no
speculation for the baseline, the same K) -- otherwise EngineUsageError.

Timing: every generation is ONE streamed request (``"stream": true``; server-sent events,
``data: {json}`` lines ending with ``data: [DONE]``). vLLM's completion stream carries
everything the non-streamed answer does, per chunk: the new ``token_ids`` (with
``return_token_ids``), their ``logprobs`` (tokens, token_logprobs, top_logprobs) and the
finish reason, so the chunks are joined into that answer (merge_stream_events) and no
second request is needed -- a second one would double the server's load and its counters.
(As read in vLLM 0.26's completion_stream_generator: one chunk per engine step, empty
prefill chunks skipped, a failure after the first chunk sent as ``data: {"error": ...}``;
where it cannot stream it sends the whole answer as one event, which counts as buffered.)
``ttft_s`` is the time from sending the request to the first chunk that carries a token;
``decode_s`` the rest of the request. A server that answers a stream request with plain
JSON (it does not stream), or sends a completion of several tokens in one chunk (it
buffers), gives no time to a first token: ``ttft_s`` is then 0.0, which the report shows
as "TTFT not measured", and ``decode_s`` is the whole request. Rescoring (``score()``) is
not streamed: it generates one token.

The API key is read from the environment variable named by ``api_key_env`` (default
OPENAI_API_KEY) and only ever sent as ``Authorization: Bearer``: it is not kept in identity,
errors, logs or reprs.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator, Sequence

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from speccheck.engines.base import Engine, EngineError, EngineUsageError, ScoringUnavailable
from speccheck.types import Completion, Prompt, Scored, SpecConfig, SpecCounters
from speccheck.verify.finite import MASS_TOL
from speccheck.verify.ties import canonical_topk

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
#: engine args (``--engine-arg key=value``); ``method``/``k`` are accepted and ignored: the
#: SpecConfig handed to generate() is what the server is checked against.
ARGS = {
    "base_url": "server URL (default http://127.0.0.1:8000)",
    "served_model": "model name the server serves (default: the one /v1/models lists)",
    "api_key_env": "environment variable holding the API key (default OPENAI_API_KEY)",
    "timeout": "seconds one attempt at a generation or scoring request may wait (default 600; the "
               "server's quick endpoints -- models, version, metrics, tokenize -- wait at most 15)",
    "deadline": "seconds one request may take in all, its retries included (default twice timeout; "
                "at most 45 for the quick endpoints)",
    "retries": "retries after a connection error, timeout or 5xx (default 3)",
    "backoff": "first retry delay in seconds, doubled each retry (default 1.0)",
    "tokenizer": "path to tokenizer.json to tokenize locally (default: the server's /tokenize)",
    "score_base_url": "a baseline server to rescore on (default: base_url; see score())",
    "temperature": "sampling temperature sent with every request (speccheck run --temperature)",
    "top_p": "sampling: top_p sent with every request",
    "sample_top_k": "sampling: top_k sent with every request (0: off)",
    "seed": "sampling: the run's seed; each request sends its own, derived from it and the prompt",
    "samples": "sampling: requests per prompt (the plan repeats each prompt, each its own seed)",
    "method": "ignored (the config under test says what the server runs)",
    "k": "ignored (as method)",
}

# vLLM's counters (vllm/v1/spec_decode/metrics.py, SpecDecodingProm); scraped with _total.
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUESTS = "vllm:request_success_total"
PROBE_TEXT = "speccheck tokenizer probe: Hello, world! 0123456789 日本語のテキスト\n\tdef f(x): return x"


# --- pure helpers (tested on their own) -----------------------------------------------------

def parse_metrics(text: str) -> dict[str, Any]:
    """The spec-decode counters and finished-request count of a Prometheus text page, summed
    over label sets (several engines under data parallelism). ``spec`` is None when the
    server exports no spec counters at all: vLLM registers them only when it speculates."""
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == PER_POS:
                p = int(s.labels.get("position", -1))
                per_pos[p] = per_pos.get(p, 0.0) + s.value
            elif s.name in (DRAFTS, DRAFT_TOKENS, ACCEPTED, REQUESTS):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    spec = None
    if DRAFTS in sums or per_pos:
        spec = SpecCounters(int(sums.get(DRAFTS, 0)), int(sums.get(DRAFT_TOKENS, 0)),
                            int(sums.get(ACCEPTED, 0)),
                            [int(per_pos.get(p, 0)) for p in range(max(per_pos, default=-1) + 1)])
    requests = int(sums[REQUESTS]) if REQUESTS in sums else None
    return {"spec": spec, "requests": requests}


def counters_delta(before: SpecCounters | None, after: SpecCounters | None) -> SpecCounters | None:
    if after is None:
        return None
    before = before or SpecCounters()
    pos = [a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
           for i, a in enumerate(after.accepted_per_pos)]
    return SpecCounters(after.drafts - before.drafts, after.draft_tokens - before.draft_tokens,
                        after.accepted_tokens - before.accepted_tokens, pos)


def token_id(key: str) -> int:
    """``token_id:123`` (return_tokens_as_token_ids) or ``123`` (prompt_logprobs keys)."""
    try:
        return int(key.removeprefix("token_id:"))
    except ValueError:
        raise EngineError(f"server returned a token key {key!r} where a token id was expected "
                          "(does it honour return_tokens_as_token_ids?)") from None


def _lp(value: Any, where: str = "a logprob") -> float:
    """A logprob from a completion's top_logprobs (float) or prompt_logprobs (Logprob dict):
    a finite number at most 0, else the server is at fault (a NaN here would otherwise be
    stored and judged as if the server had computed something)."""
    raw = value.get("logprob") if isinstance(value, dict) else value
    try:
        if isinstance(raw, bool):
            raise TypeError
        x = float(raw)
    except (TypeError, ValueError):
        raise EngineError(f"{where}: the server returned {raw!r:.40} where a logprob (a number) was "
                          "expected: not an OpenAI-compatible answer") from None
    if not np.isfinite(x) or x > 1e-3:
        raise EngineError(f"{where}: the server returned the logprob {raw!r:.40}, which no "
                          "probability has (a NaN, an infinity or above 0): an engine fault, not a "
                          "request error")
    return x


def topk_from_dict(entries: dict, k: int, where: str) -> tuple[list[int], list[float]]:
    """The k best (id, logprob) of one position's logprob dict, best first, exact ties (common
    in bf16) by lowest id as greedy argmax breaks them (verify.canonical_topk) -- not in the
    server's order, which is arbitrary on ties. prompt_logprobs dicts also hold the prompt's own
    token, which may rank below k: it is simply not among the k best."""
    if not isinstance(entries, dict):
        raise EngineError(f"{where}: the server returned top_logprobs entry {entries!r:.60}, not an "
                          "object of token -> logprob")
    pairs = [(token_id(t), _lp(v, where)) for t, v in entries.items()]
    ids = [t for t, _ in pairs]
    if len(set(ids)) != len(ids):
        twice = sorted({t for t in ids if ids.count(t) > 1})
        raise EngineError(f"{where}: the server listed token {twice[0]} twice in one top_logprobs entry "
                          f"(keys {[k for k in entries if token_id(k) == twice[0]]}): not a top-k")
    items = canonical_topk(pairs)
    mass = float(np.logaddexp.reduce([lp for _, lp in items])) if items else -math.inf
    if mass > MASS_TOL:  # beyond rounding: the entries are not one distribution's
        raise EngineError(f"{where}: the server's top_logprobs add up to a probability of {math.exp(mass):.3g}, "
                          "more than 1: not logprobs of one distribution (an engine fault)")
    if len(items) < k:
        raise EngineError(f"{where}: the server returned {len(items)} logprobs where {k} were "
                          "asked (vLLM caps them at --max-logprobs)")
    return [t for t, _ in items[:k]], [lp for _, lp in items[:k]]


def completion_from_choice(prompt: Prompt, prompt_ids: Sequence[int], choice: dict, k: int,
                           wall_s: float, spec: SpecCounters | None,
                           ttft_s: float | None = None) -> Completion:
    """One vLLM /v1/completions choice (logprobs with token_id:N keys) -> Completion.
    ``ttft_s`` None: not measured (stored as 0.0; ``decode_s`` is then the whole request)."""
    lp = choice.get("logprobs") or {}
    if not isinstance(lp, dict):
        raise EngineError(f"prompt {prompt.id}: the server's `logprobs` is {lp!r:.60}, not an object")
    tokens = lp.get("tokens") or []
    ids = choice.get("token_ids")
    if ids is None:
        ids = [token_id(t) for t in tokens] if isinstance(tokens, list) else []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                            for t in ids):
        raise EngineError(f"prompt {prompt.id}: the server's `token_ids` is {ids!r:.60}, not a list of "
                          "token ids")
    token_lps, tops = lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    if not all(isinstance(x, list) for x in (tokens, token_lps, tops)) or \
            not len(tokens) == len(token_lps) == len(tops) == len(ids):
        sizes = ", ".join(f"{len(x) if isinstance(x, list) else type(x).__name__} {name}" for x, name in
                          ((tokens, "tokens"), (token_lps, "token_logprobs"), (tops, "top_logprobs")))
        raise EngineError(f"prompt {prompt.id}: the server returned {len(ids)} tokens but {sizes}: every "
                          "token needs its logprob and top-k (an engine fault, not a request error)")
    for key in ("text", "finish_reason"):
        if choice.get(key) is not None and not isinstance(choice[key], str):
            raise EngineError(f"prompt {prompt.id}: the server's `{key}` is {choice[key]!r:.60}, not a string")
    logprobs = [_lp(x, f"prompt {prompt.id}, position {i}") for i, x in enumerate(token_lps)]
    topk_ids, topk_lps = [], []
    for i, entries in enumerate(tops):
        t, l = topk_from_dict(entries or {}, k, f"prompt {prompt.id}, position {i}")
        topk_ids.append(t)
        topk_lps.append(l)
    return Completion(
        prompt_id=prompt.id, prompt_ids=np.asarray(prompt_ids), token_ids=np.asarray(ids),
        logprobs=np.asarray(logprobs, dtype=np.float32),
        topk_ids=np.asarray(topk_ids, dtype=np.int32).reshape(len(ids), k),
        topk_logprobs=np.asarray(topk_lps, dtype=np.float32).reshape(len(ids), k),
        text=choice.get("text") or "", finish_reason=choice.get("finish_reason") or "length",
        ttft_s=ttft_s or 0.0, decode_s=max(wall_s - (ttft_s or 0.0), 0.0), spec=spec)


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The ``data`` of each server-sent event (the SSE format: ``data:`` lines, joined by
    newlines, up to a blank line; ``event:``/``id:``/``retry:`` fields and ``:`` comments
    are skipped), including a last event the stream ends without a blank line after."""
    data: list[str] = []
    for line in lines:
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _choice_tokens(choice: Any) -> int:
    """Tokens one streamed choice carries (0 for anything malformed: merge says what)."""
    if not isinstance(choice, dict):
        return 0
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    lp = choice.get("logprobs")
    return len(lp.get("tokens") or []) if isinstance(lp, dict) else 0


def event_tokens(event: Any) -> int:
    """Tokens one stream event carries (its choices'; 0 for a usage or malformed event)."""
    choices = event.get("choices") if isinstance(event, dict) else None
    return sum(map(_choice_tokens, choices)) if isinstance(choices, list) else 0


def merge_stream_events(events: Sequence[Any], where: str) -> tuple[dict, int]:
    """vLLM's streamed /v1/completions chunks (CompletionStreamResponse, one choice: index 0)
    -> (the choice a non-streamed request returns, how many chunks carried tokens). Text,
    token ids and logprobs are concatenated in order; the finish reason is the last given. A
    chunk ``{"error": ...}`` (vLLM's report of a failure after streaming began) is an
    EngineError with the server's message."""
    text: list[str] = []
    ids: list[int] = []
    has_ids = False
    tokens: list = []
    token_lps: list = []
    tops: list = []
    finish = None
    carrying = 0
    for n, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise EngineError(f"{where}: stream event {n + 1} is {type(ev).__name__}, not a JSON "
                              "object (is this an OpenAI-compatible completions stream?)")
        if "error" in ev:
            err = ev["error"]
            msg = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            if "nan" in msg.lower().split() or "not json compliant" in msg.lower():
                raise EngineError(f"{where}: the server produced NaN logprobs (stream event "
                                  f"{n + 1}: {msg}): an engine fault, not a request error")
            raise EngineError(f"{where}: the server reported a failure in the middle of the "
                              f"stream (event {n + 1}): {msg}")
        choices = ev.get("choices") or []
        if not isinstance(choices, list):
            raise EngineError(f"{where}: stream event {n + 1} has `choices` of type "
                              f"{type(choices).__name__}, not a list")
        for ch in choices:  # the usage chunk (stream_options.include_usage) has none
            if not isinstance(ch, dict) or ch.get("index", 0) != 0:
                raise EngineError(f"{where}: stream event {n + 1} holds a choice other than "
                                  "the one asked for (index 0)")
            lp = ch.get("logprobs") or {}
            try:
                if ch.get("token_ids") is not None:
                    has_ids = True
                    ids.extend(int(t) for t in ch["token_ids"])
                text.append(str(ch.get("text") or ""))
                tokens.extend(lp.get("tokens") or [])
                token_lps.extend(lp.get("token_logprobs") or [])
                tops.extend(lp.get("top_logprobs") or [])
            except (TypeError, ValueError, AttributeError) as e:
                raise EngineError(f"{where}: stream event {n + 1} is malformed ({e})") from None
            carrying += _choice_tokens(ch) > 0
            finish = ch.get("finish_reason") or finish
    if not tokens and not ids:
        raise EngineError(f"{where}: the server's stream ({len(events)} events) carried no "
                          "tokens")
    choice: dict[str, Any] = {"text": "".join(text), "finish_reason": finish,
                              "logprobs": {"tokens": tokens, "token_logprobs": token_lps,
                                           "top_logprobs": tops}}
    if has_ids:
        choice["token_ids"] = ids
    return choice, carrying


def scored_from_prompt_logprobs(prompt_logprobs: list, full: Sequence[int], start: int,
                                k: int) -> Scored:
    """vLLM's prompt_logprobs of ``full`` -> Scored for positions start.. (the continuation)."""
    n = len(full) - start
    ids = np.zeros((n, k), np.int32)
    lps = np.zeros((n, k), np.float32)
    tok = np.zeros(n, np.float32)
    if len(prompt_logprobs) != len(full):
        raise EngineError(f"the server returned {len(prompt_logprobs)} prompt logprobs for "
                          f"{len(full)} prompt tokens")
    for j in range(n):
        entries = prompt_logprobs[start + j] or {}
        forced = full[start + j]
        by_id = {token_id(t): _lp(v) for t, v in entries.items()}
        if forced not in by_id:
            raise EngineError(f"prompt_logprobs at position {start + j} lack the prompt's own "
                              f"token {forced}")
        tok[j] = by_id[forced]
        t, l = topk_from_dict(entries, k, f"prompt_logprobs position {start + j}")
        ids[j], lps[j] = t, l
    return Scored(topk_ids=ids, topk_logprobs=lps, token_logprobs=tok)


def server_kernels(info: dict) -> dict:
    """vLLM's ``/server_info?config_format=json`` -> the kernel switches speccheck records."""
    cfg = info.get("vllm_config") or {}
    env = info.get("vllm_env") or {}
    if not isinstance(cfg, dict):
        return {}
    att = cfg.get("attention_config") or {}
    comp = cfg.get("compilation_config") or {}
    model = cfg.get("model_config") or {}
    spec = cfg.get("speculative_config") or {}
    add = cfg.get("additional_config") or {}
    out = {
        "attention_backend_requested": att.get("backend") or "auto",
        "gdn_prefill_backend_requested": (add.get("gdn_prefill_backend") if isinstance(add, dict)
                                          else None) or "auto",
        "cudagraph_mode": comp.get("cudagraph_mode"),
        "compilation_mode": comp.get("mode"),
        "enforce_eager": model.get("enforce_eager"),
        "speculative_method": spec.get("method") if isinstance(spec, dict) else None,
        "draft_attention_backend_requested": (spec.get("attention_backend")
                                              if isinstance(spec, dict) else None),
    }
    for name in ("VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE", "VLLM_GDN_DECODE_KERNEL",
                 "VLLM_USE_FLASHINFER_SAMPLER", "VLLM_BATCH_INVARIANT"):
        if name in env:
            out[name] = env[name]
    return {k: v for k, v in out.items() if v is not None}


def _error_message(r: httpx.Response) -> str:
    """The server's own words: vLLM's {"error": {"message"}}, older {"message"}, FastAPI's
    {"detail"}, or the raw text (trimmed)."""
    try:
        body = r.json()
    except ValueError:
        return r.text.strip()[:300] or r.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err or body.get("message") or body.get("detail") or body)[:300]
    return str(body)[:300]


#: every network wait says so on stderr at least this often while nothing arrives
HEARTBEAT_S = 8.0
#: endpoints a live server answers at once (no generation behind them): short waits, so a server
#: that accepts connections but never answers is found in well under a minute
QUICK_PATHS = ("/v1/models", "/version", "/metrics", "/tokenize", "/detokenize", "/server_info", "/health")
QUICK_TIMEOUT_S, QUICK_DEADLINE_S = 15.0, 45.0
#: the most one answer may hold: a server that sends more (a 4 GiB body, a stream that never
#: ends) is at fault, said so, instead of filling this machine's memory until the deadline
MAX_ANSWER_BYTES = 128 * 2 ** 20


class _Deadline(Exception):
    """A request's total deadline passed while its answer was still arriving."""


class _Waiting:
    """One request in flight, its retries included: a line on stderr every HEARTBEAT_S while
    nothing arrives from the server, and the time left before its total deadline."""

    def __init__(self, what: str, timeout: float, deadline: float,
                 hint: str = "--engine-arg timeout=S / deadline=S") -> None:
        self.what, self.timeout, self.deadline, self.hint = what, timeout, deadline, hint
        self.t0 = self.last = time.monotonic()
        self._said = self.t0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="speccheck-wait", daemon=True)

    def __enter__(self) -> "_Waiting":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def touch(self) -> None:
        """Something whole arrived: the server is getting on with it."""
        self.last = time.monotonic()

    def left(self) -> float:
        return self.deadline - (time.monotonic() - self.t0)

    def check(self) -> None:
        if self.left() <= 0:
            raise _Deadline

    def attempt_timeout(self) -> httpx.Timeout:
        t = max(min(self.timeout, self.left()), 0.05)
        return httpx.Timeout(t, connect=min(t, 10.0))

    def _beat(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            if now - self.last >= HEARTBEAT_S and now - self._said >= HEARTBEAT_S:
                self._said = now
                print(f"speccheck: still waiting for {self.what}: nothing from the server for "
                      f"{now - self.last:.0f} s ({now - self.t0:.0f} s since the first attempt; it gives "
                      f"up after {self.deadline:.0f} s in all{': ' + self.hint if self.hint else ''})",
                      file=sys.stderr, flush=True)


def _events(n: int) -> str:
    return f"{n} event" + ("" if n == 1 else "s")


def _transport_error(e: httpx.TransportError) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _check_url(url: str, key: str) -> None:
    """An http(s) URL with a host and a port that can exist, else a usage error naming it."""
    try:
        u = httpx.URL(url)
        ok = u.scheme in ("http", "https") and bool(u.host) and (u.port is None or 0 < u.port < 65536)
    except (httpx.InvalidURL, ValueError, TypeError):
        ok = False
    if not ok:
        raise EngineUsageError(f"--engine-arg {key}={url!r} is not an http(s) URL with a host and a port "
                               f"of 1-65535: give e.g. {key}=http://127.0.0.1:8000")


def _redact(url: str) -> str:
    """The URL without user:password@ (credentials never go into a store)."""
    u = httpx.URL(url)
    return str(u.copy_with(userinfo=b"")) if u.userinfo else url


# --- the engine ------------------------------------------------------------------------------

def sampled_body(engine_args: dict, ids: Sequence[int], sample: int = 0,
                 config: str = "baseline") -> dict:
    """The sampling fields of a generation request (none for a greedy run): temperature,
    top_p, top_k and the request's own seed (vLLM's server takes ``seed`` per request),
    types.request_seed of the run's seed, the config and the prompt, so that a request
    repeats exactly and the baseline's samples are independent of a spec config's."""
    from speccheck.types import request_seed, sampling_of

    sp = sampling_of(engine_args)
    if sp is None:
        return {}
    return {"temperature": sp["temperature"], "top_p": sp["top_p"],
            **({"top_k": sp["top_k"]} if sp["top_k"] else {}),
            "seed": request_seed(sp["seed"], config, ids, sample)}


class OpenAIEngine(Engine):
    name = "openai"
    methods = None  # whatever the server runs (mtp, dflash, eagle, ngram, ...)
    serves_one_config = True

    def __init__(self, model: str | None = None, engine_args: dict[str, str] | None = None,
                 draft: str | None = None) -> None:
        super().__init__(model, engine_args, draft)
        unknown = sorted(set(self.engine_args) - set(ARGS))
        if unknown:
            raise EngineUsageError(
                f"unknown --engine-arg {', '.join(unknown)} for engine openai; it takes: "
                + "; ".join(f"{k} ({v})" for k, v in ARGS.items()))
        a = self.engine_args
        # what every OpenAI client is given ends in /v1 (and OPENAI_BASE_URL usually does)
        self.base_url = server_root(a.get("base_url") or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL)
        _check_url(self.base_url, "base_url")
        self._shown = _redact(self.base_url)  # for identity and messages
        self.api_key_env = str(a.get("api_key_env") or "OPENAI_API_KEY")
        self.timeout = self._number("timeout", 600.0, positive=True)
        self.deadline = self._number("deadline", 2 * self.timeout, positive=True)
        self.retries = int(self._number("retries", 3, whole=True))
        self.backoff = self._number("backoff", 1.0)
        self._served = a.get("served_model") or model
        self._local_tok = None
        self._tokenizer_path = a.get("tokenizer")
        if self._tokenizer_path:
            from tokenizers import Tokenizer
            try:
                self._local_tok = Tokenizer.from_file(str(self._tokenizer_path))
            except Exception as e:
                raise EngineUsageError(f"--engine-arg tokenizer={self._tokenizer_path}: cannot "
                                       f"load it as a tokenizers tokenizer.json ({e})") from None
        key = os.environ.get(self.api_key_env)
        if "api_key_env" in a and not key:
            raise EngineUsageError(f"--api-key-env names {self.api_key_env}, but that environment "
                                   f"variable is not set: export {self.api_key_env}=<key>")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(headers=headers,
                                    timeout=httpx.Timeout(self.timeout,
                                                          connect=min(self.timeout, 10.0)))
        self._score_url = server_root(a["score_base_url"]) if a.get("score_base_url") else None
        if self._score_url:
            _check_url(self._score_url, "score_base_url")
        self._info: dict | None = None
        self._retried = False  # a request was sent again: the server may have run it twice
        self._ttft_seen: set[bool] = set()  # whether generations so far had a measurable TTFT

    def __repr__(self) -> str:
        return f"OpenAIEngine(base_url={self._shown!r}, served_model={self._served!r})"

    @classmethod
    def attribution_server_args(cls, label: str, url: str) -> dict[str, str]:
        """``--attribute-with LABEL=URL``: re-score on that server (prompt_logprobs), which
        serves the same model started with other kernel settings (e.g. ``--enforce-eager``)."""
        if not url.startswith(("http://", "https://")):
            raise EngineUsageError(f"--attribute-with {label}={url}: {url!r} is not an http(s) "
                                   "URL; give e.g. http://127.0.0.1:8001")
        return {"base_url": url.rstrip("/"), "score_base_url": url.rstrip("/")}

    def _number(self, key: str, default: float, positive: bool = False, whole: bool = False) -> float:
        """A finite number >= 0 (``positive``: > 0; a zero wait would never wait, so it is
        refused rather than read as "off"; ``whole``: a count)."""
        v = self.engine_args.get(key)
        if v is None:
            return default
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = math.nan
        if not math.isfinite(x) or x < 0 or (positive and x == 0) or (whole and x != int(x)) or x > 1e7:
            want = "a whole number >= 0" if whole else (
                "a number of seconds above 0" if positive else "a number >= 0")
            raise EngineUsageError(f"--engine-arg {key}={v!r} must be {want} (at most 1e7)")
        return x

    def _waiting(self, method: str, path: str, shown: str) -> _Waiting:
        quick = path.split(" ")[0] in QUICK_PATHS
        timeout = min(self.timeout, QUICK_TIMEOUT_S) if quick else self.timeout
        deadline = min(self.deadline, QUICK_DEADLINE_S) if quick else self.deadline
        return _Waiting(f"the server at {shown} to answer {method} {path}", timeout, deadline)

    def _read_body(self, r: httpx.Response, wait: _Waiting) -> httpx.Response:
        """The whole answer, read as it arrives (a server that drips it slower than the total
        deadline allows is given up on), as a response of its own. Until it is whole it is still
        awaited: the wait is said as for a server that sends nothing."""
        raw, size = [], 0
        for chunk in r.iter_raw():
            wait.check()
            raw.append(chunk)
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise EngineError(f"the server at {self._shown} sent more than {MAX_ANSWER_BYTES >> 20} MiB "
                                  f"in answer to {r.request.method} {r.request.url.path}: no answer of an "
                                  "OpenAI-compatible server is that large (is --base-url such a server?)")
        whole = httpx.Response(r.status_code, headers=r.headers, content=b"".join(raw), request=r.request)
        whole.read()
        return whole

    # --- HTTP ---------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict | None = None,
                 base: str | None = None) -> httpx.Response:
        """One request with retries and backoff for what may pass (connection refused,
        timeouts, 5xx); 4xx are the user's to fix and fail at once with a usage error."""
        url = (base or self.base_url) + path
        shown = _redact(base) if base else self._shown
        last = ""
        with self._waiting(method, path, shown) as wait:
            for attempt in range(self.retries + 1):
                if not self._wait_before(attempt, wait):
                    break
                try:
                    with self._client.stream(method, url, json=body, timeout=wait.attempt_timeout()) as r:
                        r = self._read_body(r, wait)
                except httpx.TransportError as e:
                    last = _transport_error(e)
                    continue
                except _Deadline:
                    last = f"the answer was still arriving after {wait.deadline:.0f} s"
                    break
                if 300 <= r.status_code < 400:
                    raise EngineUsageError(
                        f"the server at {shown} answered {method} {path} with a redirect (HTTP {r.status_code} "
                        f"to {r.headers.get('location', '?')!r}); speccheck does not follow redirects: give "
                        "--base-url the address the server answers on itself (http vs https, the port).")
                if r.status_code < 400:
                    return r
                last = self._refusal(r, path, shown)
            raise self._gave_up(shown, method, path, last, attempt + 1, wait)

    def _wait_before(self, attempt: int, wait: _Waiting) -> bool:
        """Sleep the backoff before a retry; False when the deadline leaves no time for one."""
        if attempt:
            pause = self.backoff * 2 ** (attempt - 1)
            if pause >= wait.left():
                return False
            self._retried = True
            time.sleep(pause)
        return wait.left() > 0

    def _gave_up(self, shown: str, method: str, path: str, last: str, attempts: int | None = None,
                 wait: _Waiting | None = None) -> EngineError:
        n = self.retries + 1 if attempts is None else attempts
        took = f", {time.monotonic() - wait.t0:.0f} s in all" if wait is not None else ""
        return EngineError(f"the server at {shown} did not answer {method} {path} after "
                           f"{n} attempt{'s' if n != 1 else ''} (last: {last}){took}; is it running and "
                           "reachable? (--base-url, --engine-arg timeout/deadline/retries)")

    def _refusal(self, r: httpx.Response, path: str, shown: str) -> str:
        """An HTTP error status: raises for what a retry cannot mend (4xx: the user's to
        fix, a usage error; NaN logprobs: an engine fault); returns the 5xx to retry."""
        msg = _error_message(r)
        if r.status_code in (401, 403):
            have = ("is set but the server rejected its value" if os.environ.get(
                self.api_key_env) else "is not set, so no key was sent")
            raise EngineUsageError(
                f"the server at {shown} refused {path} with HTTP {r.status_code} "
                f"({msg}): the API key comes from the environment variable "
                f"{self.api_key_env}, which {have}. Export {self.api_key_env} with the "
                "server's --api-key, or name another variable with --api-key-env.")
        if r.status_code == 404:
            raise EngineUsageError(
                f"the server at {shown} answered 404 for {path} ({msg}): check "
                "--base-url, and --served-model against the server's /v1/models.")
        if "nan" in msg.lower().split() or "not json compliant" in msg.lower():
            raise EngineError(f"the server at {shown} produced NaN logprobs for {path} "
                              f"({msg}): an engine fault, not a request error")
        if r.status_code < 500:
            raise EngineUsageError(f"the server at {shown} rejected {path} with "
                                   f"HTTP {r.status_code}: {msg}")
        return f"HTTP {r.status_code}: {msg}"

    def _stream(self, path: str, body: dict, where: str) -> tuple[dict, float, float | None]:
        """POST ``body`` with ``"stream": true``: (the one choice, wall seconds, seconds to
        the first chunk carrying a token, or None when that is not measurable). Retried like
        _request, also when the stream breaks off before ``data: [DONE]``; a server that
        answers with plain JSON is read as a non-streamed answer."""
        path_shown = f"{path} (streamed)"
        wait = self._waiting("POST", path_shown, self._shown)
        with wait:
            return self._stream_attempts(path, body, where, path_shown, wait)

    def _lines(self, r: httpx.Response, wait: _Waiting) -> Iterator[str]:
        """The answer's lines as they arrive, the deadline checked at every read (a server
        that drips bytes without ever ending a line is given up on too)."""
        buf, size = b"", 0
        for chunk in r.iter_bytes():
            wait.check()
            buf += chunk
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise EngineError(f"the server at {self._shown} streamed more than {MAX_ANSWER_BYTES >> 20} MiB "
                                  f"in answer to one request to {r.request.url.path}: not a completions stream "
                                  "of the tokens asked for")
            *lines, buf = buf.split(b"\n")
            for line in lines:
                wait.touch()  # a whole line: the stream moves (bytes that never end one do not)
                yield line.decode("utf-8", errors="replace")
        if buf:
            yield buf.decode("utf-8", errors="replace")

    def _stream_attempts(self, path: str, body: dict, where: str, path_shown: str,
                         wait: _Waiting) -> tuple[dict, float, float | None]:
        last = ""
        for attempt in range(self.retries + 1):
            if not self._wait_before(attempt, wait):
                break
            events: list = []
            first: float | None = None
            done = False
            seen, limit = 0, body.get("max_tokens") or math.inf
            t0 = time.perf_counter()
            try:
                with self._client.stream("POST", self.base_url + path, json={**body, "stream": True},
                                         timeout=wait.attempt_timeout()) as r:
                    if 300 <= r.status_code < 400:
                        raise EngineUsageError(
                            f"the server at {self._shown} answered POST {path_shown} with a redirect (HTTP "
                            f"{r.status_code} to {r.headers.get('location', '?')!r}); speccheck does not follow "
                            "redirects: give --base-url the address the server answers on itself.")
                    if r.status_code >= 400:
                        r = self._read_body(r, wait)
                        last = self._refusal(r, path_shown, self._shown)
                        continue
                    if "text/event-stream" not in r.headers.get("content-type", ""):
                        r = self._read_body(r, wait)  # not streamed: one JSON answer, TTFT unknown
                        return self._one_choice(r, path, where), time.perf_counter() - t0, None
                    for data in sse_data(self._lines(r, wait)):
                        if data.strip() == "[DONE]":
                            done = True
                            break
                        try:
                            ev = json.loads(data)
                        except ValueError:
                            raise EngineError(
                                f"{where}: the server at {self._shown} sent a stream event "
                                f"that is not JSON ({data[:120]!r}) on {path_shown}: not an "
                                "OpenAI-compatible completions stream") from None
                        if first is None and event_tokens(ev):
                            first = time.perf_counter() - t0
                        events.append(ev)
                        seen += event_tokens(ev)
                        if seen > limit:
                            raise EngineError(
                                f"{where}: the server at {self._shown} streamed {seen} tokens where "
                                f"max_tokens was {limit} on {path_shown}: it does not honour max_tokens "
                                "(an engine fault; the output would be judged past its end)")
                wall = time.perf_counter() - t0
            except httpx.TransportError as e:
                last = f"the stream broke off after {_events(len(events))} ({_transport_error(e)})"
                continue
            except _Deadline:
                last = f"the stream was still arriving after {wait.deadline:.0f} s ({_events(len(events))})"
                break
            if not done:
                last = f"the stream ended after {_events(len(events))} without data: [DONE]"
                continue
            choice, carrying = merge_stream_events(events, where)
            n_tokens = max(len(choice.get("token_ids") or []), len(choice["logprobs"]["tokens"]))
            # one chunk with every token of several: the server buffered, the time is not a TTFT
            return choice, wall, first if (carrying > 1 or n_tokens <= 1) else None
        raise self._gave_up(self._shown, "POST", path_shown, last, attempt + 1, wait)

    def _one_choice(self, r: httpx.Response, path: str, where: str) -> dict:
        try:
            resp = r.json()
        except ValueError:
            raise EngineError(f"the server at {self._shown} answered {path} with non-JSON "
                              f"text: {r.text[:200]!r}") from None
        choices = resp.get("choices") if isinstance(resp, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise EngineError(f"{where}: expected one choice from the server, got "
                              f"{len(choices) if isinstance(choices, list) else 'none'}")
        return choices[0]

    def _json(self, method: str, path: str, body: dict | None = None,
              base: str | None = None) -> Any:
        r = self._request(method, path, body, base)
        try:
            out = r.json()
        except ValueError:
            raise EngineError(f"the server at {self._shown} answered {path} with non-JSON "
                              f"text: {r.text[:200]!r}") from None
        if not isinstance(out, dict):
            raise EngineError(f"the server at {self._shown} answered {path} with {str(out)[:120]!r}, not a "
                              "JSON object: is --base-url an OpenAI-compatible server?")
        return out

    # --- server facts -------------------------------------------------------------------

    def _server(self) -> dict:
        """/v1/models (authenticated: a wrong key fails here, first) and /version, once."""
        if self._info is not None:
            return self._info
        models = self._json("GET", "/v1/models").get("data") or []
        if not isinstance(models, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                   for m in models):
            raise EngineError(f"the server at {self._shown} answered /v1/models with {str(models)[:120]!r}, "
                              "not a list of models with ids: is --base-url an OpenAI-compatible server?")
        names = [m.get("id") for m in models]
        if self._served is None:
            if len(names) != 1:
                raise EngineUsageError(f"the server at {self._shown} serves {len(names)} "
                                       f"models ({', '.join(map(str, names)) or 'none'}): name "
                                       "one with --served-model")
            self._served = names[0]
        elif self._served not in names:
            raise EngineUsageError(f"the server at {self._shown} does not serve "
                                   f"{self._served!r}; it serves: {', '.join(map(str, names))} "
                                   "(--served-model)")
        entry = next(m for m in models if m.get("id") == self._served)
        try:
            version = self._json("GET", "/version")
        except EngineUsageError:  # not every OpenAI-compatible server has /version
            version = {}
        self._info = {"model": entry, "version": version, "kernels": self._server_kernels()}
        return self._info

    def _server_kernels(self) -> dict | None:
        """The kernel settings a vLLM server reports on ``/server_info`` (vLLM 0.26-0.28: only
        when started with ``VLLM_SERVER_DEV_MODE=1``; None otherwise). These are the API
        server's copy of the config: requested backends ("auto" unresolved) and the CUDA
        graph mode after enforce_eager, not what the engine core resolved later."""
        wait = self._waiting("GET", "/server_info", self._shown)
        try:
            with wait, self._client.stream("GET", self.base_url + "/server_info",
                                           params={"config_format": "json"},
                                           timeout=wait.attempt_timeout()) as r:
                r = self._read_body(r, wait)
        except (httpx.TransportError, _Deadline, EngineError):  # optional: absent is fine
            return None
        if r.status_code != 200:
            return None
        try:
            return server_kernels(r.json())
        except (ValueError, AttributeError, TypeError):
            return None

    def _metrics(self) -> dict:
        try:
            r = self._request("GET", "/metrics")
        except EngineUsageError as e:
            raise EngineUsageError(f"{e} speccheck reads the spec-decode counters from vLLM's "
                                   "Prometheus /metrics; it must be reachable.") from None
        got = self._parse_metrics(r.text, self._shown)
        if got["requests"] is not None:
            self._server_served = got["requests"]
        return got

    @property
    def requests_served(self) -> int | None:
        """Requests the server has finished since it started, by its own count
        (``vllm:request_success_total`` at the last scrape): the long_lived axis's proof that a
        long-lived server really served them. None before a scrape or where it keeps no count."""
        return self.__dict__.get("_server_served")

    @staticmethod
    def _parse_metrics(text: str, shown: str) -> dict:
        """parse_metrics, a page that is not Prometheus text (or counts that are not numbers)
        being the server's fault, said as such."""
        try:
            return parse_metrics(text)
        except (ValueError, TypeError, IndexError, KeyError, OverflowError) as e:
            raise EngineError(f"the server at {shown} answered /metrics with a page that is not "
                              f"Prometheus text or holds counts that are not numbers ({e}; it begins "
                              f"{text[:80]!r})") from None

    def _metrics_after(self, before: dict) -> dict:
        """Metrics once our request is counted: vLLM records stats right after it hands the
        output over, so a scrape can race it; wait (briefly) until the request shows."""
        after = self._metrics()
        deadline = time.monotonic() + 2.0
        while (before["requests"] is not None and after["requests"] is not None
               and after["requests"] <= before["requests"] and time.monotonic() < deadline):
            time.sleep(0.02)
            after = self._metrics()
        if before["requests"] is not None and after["requests"] is not None \
                and after["requests"] - before["requests"] > 1:
            if self._retried:
                raise EngineError(
                    f"a request to {self._shown} was retried after a timeout or error and the "
                    "server finished it more than once, so its spec counters cannot be told "
                    f"apart; raise --engine-arg timeout (now {self.timeout:g} s) and run again.")
            raise EngineUsageError(
                f"other requests reached the server at {self._shown} during speccheck's run "
                f"({after['requests'] - before['requests']} finished during one request): spec "
                "counters and timings would mix; give speccheck the server to itself.")
        return after

    def identity(self) -> dict:
        info = self._server()
        ident = {
            "engine": "openai",
            "base_url": self._shown,
            "served_model": self._served,
            "score_base_url": _redact(self._score_url) if self._score_url else None,
            "model_root": info["model"].get("root"),
            "max_model_len": info["model"].get("max_model_len"),
            "server_version": info["version"].get("version"),
            "tokenizer": self._tokenizer_path or "server",
            "tokenizer_hash": self._tokenizer_hash(),
        }
        if self._ttft_seen:
            ident["ttft"] = ("measured from the stream" if self._ttft_seen == {True} else
                             "not measured: the server answered stream requests with plain "
                             "JSON or sent several tokens in one chunk"
                             if self._ttft_seen == {False} else "measured for some requests only")
        if info.get("kernels"):
            ident["server_kernels"] = info["kernels"]
        served_by = info["version"].get("speccheck")
        if served_by:  # speccheck serve: the engine behind it says which kernels ran
            ident["server_engine"] = served_by.get("engine_identity")
        return ident

    def _tokenizer_hash(self) -> str:
        if self._tokenizer_path:
            with open(self._tokenizer_path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()[:16]
        # The server's tokenizer file is out of reach: fingerprint its behaviour instead.
        ids = self._tokenize_text(PROBE_TEXT)
        return "probe-" + hashlib.sha256(repr(ids).encode()).hexdigest()[:16]

    def default_k(self, method: str) -> int | None:
        """The K the server drafts with (vLLM exports one per-position counter per K)."""
        if method == "baseline":
            return None
        spec = self._metrics()["spec"]
        return len(spec.accepted_per_pos) if spec and spec.accepted_per_pos else None

    # --- tokenizer ----------------------------------------------------------------------

    def _tokenize_text(self, text: str) -> list[int]:
        if self._local_tok is not None:
            return list(self._local_tok.encode(text).ids)
        return self._post_tokenize({"prompt": text})

    def _post_tokenize(self, body: dict) -> list[int]:
        self._server()
        try:
            out = self._json("POST", "/tokenize", {"model": self._served, **body})
        except EngineUsageError as e:
            raise EngineUsageError(f"{e} Without vLLM's /tokenize, give --engine-arg "
                                   "tokenizer=PATH/tokenizer.json.") from None
        tokens = out.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in tokens):
            raise EngineError(f"the server at {self._shown} answered /tokenize with tokens "
                              f"{str(tokens)[:80]!r}, not a list of token ids")
        return tokens

    def max_positions(self) -> int | None:
        n = self._server()["model"].get("max_model_len")  # a server that does not answer: said once
        return int(n) if isinstance(n, int) and n > 0 else None

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Prompt.as_text() through the server's tokenizer (vLLM /tokenize), or the local
        tokenizer.json: the same text every other engine tokenizes, chat prompts included."""
        return self._tokenize_text(prompt.as_text())

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = [int(t) for t in ids]
        if self._local_tok is not None:
            return self._local_tok.decode(ids)
        self._server()
        return str(self._json("POST", "/detokenize", {"model": self._served, "tokens": ids})
                   ["prompt"])

    # --- generation ---------------------------------------------------------------------

    def _check_static(self, config: SpecConfig, spec: SpecCounters | None) -> None:
        """What the server is configured to do, before anything runs."""
        running = (f"speculative decoding with K={len(spec.accepted_per_pos)}" if spec
                   else "no speculative decoding (its /metrics has no vllm:spec_decode_* "
                   "counters; a vLLM started with --disable-log-stats exports none)")
        if config.is_baseline and spec is not None:
            raise EngineUsageError(
                f"the server at {self._shown} runs {running}, but the config to run is the "
                "baseline. A server runs one config: run the baseline against a server started "
                "without a speculative config, then restart it with the speculative config and "
                "run --method/--k into the same --store (finished configs are skipped).")
        if not config.is_baseline and spec is None:
            raise EngineUsageError(f"the server at {self._shown} runs {running}, but --method "
                                   f"says {config.method} --k {config.k}: start it with that "
                                   "speculative config, or pass --method baseline.")
        if spec is not None and spec.accepted_per_pos and len(spec.accepted_per_pos) != config.k:
            raise EngineUsageError(f"the server at {self._shown} runs {running}, but --k says "
                                   f"{config.k}: pass --k {len(spec.accepted_per_pos)}, or "
                                   "restart the server with the K you mean.")

    def generate(self, prompts: Sequence[Prompt], prompt_ids: Sequence[Sequence[int]],
                 config: SpecConfig, top_k: int) -> list[Completion]:
        self._server()
        before = self._metrics()
        self._check_static(config, before["spec"])
        out: list[Completion] = []
        for prompt, ids in zip(prompts, prompt_ids, strict=True):
            self._retried = False
            choice, wall, ttft = self._complete(prompt, ids, top_k, config.name)
            after = self._metrics_after(before)
            spec = counters_delta(before["spec"], after["spec"])
            before = after
            out.append(completion_from_choice(prompt, ids, choice, top_k, wall, spec, ttft))
        self._check_drafted(config, out)
        return out

    def generate_together(self, prompts: Sequence[Prompt], prompt_ids: Sequence[Sequence[int]],
                          config: SpecConfig, top_k: int) -> list[Completion]:
        """Every request in flight at once (one thread each, at most 64 at a time). The
        server's counters then cover all of them together, so completions carry none."""
        self._server()
        self._check_static(config, self._metrics()["spec"])

        def one(pair):
            choice, wall, ttft = self._complete(*pair, top_k, config.name)
            return completion_from_choice(*pair, choice, top_k, wall, None, ttft)

        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), 64))) as pool:
            return list(pool.map(one, zip(prompts, prompt_ids, strict=True)))

    def _complete(self, prompt: Prompt, ids: Sequence[int], top_k: int, config: str = "baseline"
                  ) -> tuple[dict, float, float | None]:
        """One greedy, streamed /v1/completions request: (its one choice, wall seconds,
        seconds to the first token or None)."""
        body = {"model": self._served, "prompt": [int(t) for t in ids],
                "max_tokens": int(prompt.max_tokens), "temperature": 0,
                "logprobs": int(top_k), "return_tokens_as_token_ids": True,
                "return_token_ids": True}
        body.update(sampled_body(self.engine_args, ids, prompt.sample, config))
        if prompt.ignore_eos:  # vLLM's extra parameter; sent only when asked for
            body["ignore_eos"] = True
        choice, wall, ttft = self._stream("/v1/completions", body, f"prompt {prompt.id}")
        if _choice_tokens(choice) > prompt.max_tokens:  # a plain-JSON answer is counted here
            raise EngineError(f"prompt {prompt.id}: the server at {self._shown} returned "
                              f"{_choice_tokens(choice)} tokens where max_tokens was {prompt.max_tokens}: "
                              "it does not honour max_tokens (an engine fault)")
        if _choice_tokens(choice) > 1:  # one token: streamed or not, its time is the TTFT
            self._ttft_seen.add(ttft is not None)
        return choice, wall, ttft

    def _check_drafted(self, config: SpecConfig, out: list[Completion]) -> None:
        """A speculative config must have drafted; a server configured to speculate that
        did not (older vLLM skipped drafting for requests asking for logprobs) proves nothing."""
        if config.is_baseline or not any(c.n_tokens >= 3 for c in out):
            return
        drafts = sum(c.spec.drafts for c in out if c.spec is not None)
        if drafts == 0:
            raise EngineUsageError(
                f"the server at {self._shown} is configured to speculate (K={config.k}) but "
                f"drafted nothing over {sum(c.n_tokens for c in out)} generated tokens, so "
                f"--method {config.method} is not what ran: some vLLM versions skip drafting "
                "for requests that ask for logprobs; use a vLLM that drafts with logprobs.")

    def score(self, prompt_ids: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
              top_k: int) -> list[Scored]:
        """Teacher-forced scores through vLLM's ``prompt_logprobs``, on ``score_base_url``
        when given, else on the server under test -- never on a server that speculates:
        there vLLM 0.26 (MTP K=3, CUDA graphs, H200) answered 10 of 28 rescoring requests
        with logprobs unrelated to the sequence (top-1 matching the forced tokens at 0-46 %
        where the same request offline matched 98-100 %), which reads as hundreds of
        high-confidence divergences on a healthy server. ScoringUnavailable then: the
        runner leaves the rescoring to a later run against a server without speculation."""
        self._server()
        url = self._score_url or self.base_url
        if self._parse_metrics(self._request("GET", "/metrics", base=url).text, _redact(url))["spec"] is not None:
            raise ScoringUnavailable(
                f"the server at {_redact(url)} runs speculative decoding (its /metrics carry vLLM's "
                "spec-decode counters), and prompt_logprobs from such a server are not trustworthy "
                "(vLLM 0.26 with MTP returned unrelated logprobs for 10 of 28 rescored outputs). "
                "Rescore on a server without speculation: restart it without --speculative-config "
                "and run `speccheck run --method baseline` into this --store (stored runs are "
                "kept; the missing rescoring is done then), or pass --engine-arg "
                "score_base_url=URL of such a server started beside it.")
        out = []
        for p, c in zip(prompt_ids, continuations, strict=True):
            full = [int(t) for t in p] + [int(t) for t in c]
            if not len(c):
                out.append(Scored(np.zeros((0, top_k), np.int32),
                                  np.zeros((0, top_k), np.float32), np.zeros(0, np.float32)))
                continue
            body = {"model": self._served, "prompt": full, "max_tokens": 1, "temperature": 0,
                    "prompt_logprobs": int(top_k), "return_token_ids": True}
            resp = self._json("POST", "/v1/completions", body, self._score_url)
            choices = resp.get("choices")
            choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
            plp = choice.get("prompt_logprobs")
            if plp is None:
                raise EngineError(f"the server at {self._shown} returned no prompt_logprobs "
                                  "(vLLM's extension); speccheck needs them to rescore")
            try:
                out.append(scored_from_prompt_logprobs(plp, full, len(p), top_k))
            except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
                raise EngineError(f"the server at {self._shown} returned malformed prompt_logprobs "
                                  f"({type(e).__name__}: {e}); not vLLM's shape") from None
        return out

    def close(self) -> None:
        self._client.close()


# --- fixture capture (run next to a real server; the JSON is replayed by the tests) ------------

def _metric_lines(text: str) -> str:
    """Only the families speccheck reads (HELP/TYPE lines included), so a capture stays small."""
    keep = {DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS, REQUESTS}
    out = []
    for line in text.splitlines():
        body = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        name = body.split("{", 1)[0].split(" ", 1)[0]
        if name in keep or name + "_total" in keep:
            out.append(line)
    return "".join(line + "\n" for line in out)


def server_root(url: str) -> str:
    """The server's root: ``http://host:8000/v1/`` and ``http://host:8000`` are one server."""
    url = str(url).strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def capture(base_url: str, out_path: str, text: str = "def fibonacci(n):\n    ",
            max_tokens: int = 12, top_k: int = 5, served_model: str | None = None,
            api_key_env: str | None = None) -> dict:
    """Record one generation (plain, and the same request streamed: the SSE data payloads)
    and one rescoring, raw, with the metrics around them, as small JSON (no key, no
    pickles): the wire format the `openai` engine parses."""
    import json

    args = {"base_url": base_url, "retries": "1"}
    if served_model:
        args["served_model"] = served_model
    if api_key_env:
        args["api_key_env"] = api_key_env
    eng = OpenAIEngine(engine_args=args)
    try:
        info = eng._server()
        ids = eng._tokenize_text(text)
        before = eng._request("GET", "/metrics").text
        gen_req = {"model": eng._served, "prompt": ids, "max_tokens": max_tokens,
                   "temperature": 0, "logprobs": top_k, "return_tokens_as_token_ids": True,
                   "return_token_ids": True}
        gen = eng._json("POST", "/v1/completions", gen_req)
        time.sleep(0.5)  # let the server record its stats
        after = eng._request("GET", "/metrics").text
        # the same request streamed, as the engine sends it (after the metrics: they cover one)
        with eng._client.stream("POST", eng.base_url + "/v1/completions",
                                json={**gen_req, "stream": True}) as r:
            stream = list(sse_data(r.iter_lines())) if r.status_code == 200 else None
        full = ids + list(gen["choices"][0].get("token_ids") or [])
        score_req = {"model": eng._served, "prompt": full, "max_tokens": 1, "temperature": 0,
                     "prompt_logprobs": top_k, "return_token_ids": True}
        score = eng._json("POST", "/v1/completions", score_req)
    finally:
        eng.close()
    cap = {"version": info["version"], "model": info["model"], "prompt_ids": ids,
           "top_k": top_k, "generate_request": gen_req, "generate_response": gen,
           "generate_stream": stream,
           "metrics_before": _metric_lines(before), "metrics_after": _metric_lines(after),
           "score_request": score_req, "score_response": score}
    with open(out_path, "w") as f:
        json.dump(cap, f, indent=1)
    return cap


if __name__ == "__main__":  # python -m speccheck.engines.openai URL OUT.json [served_model]
    import sys

    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m speccheck.engines.openai BASE_URL OUT.json [SERVED_MODEL]")
    capture(sys.argv[1], sys.argv[2], served_model=sys.argv[3] if len(sys.argv) == 4 else None)
