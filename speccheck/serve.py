"""`speccheck serve`: an OpenAI-compatible HTTP server in front of an in-process engine.

It speaks the subset of vLLM's OpenAI server that the `openai` engine uses, with vLLM's
JSON shapes, auth rules and Prometheus metric names, so that the `openai` engine runs end
to end in CI and users can rehearse gating a deployment without a GPU. Like a vLLM server
it serves ONE config (baseline, or one method at one K).

Endpoints (shapes as in vLLM's ``entrypoints/openai`` protocol):
  GET  /health, /ping          200, no auth (like vLLM)
  GET  /version                {"version": ...} plus ``speccheck``: engine identity, config
  GET  /metrics                Prometheus text; ``vllm:spec_decode_*`` counters only when the
                               config speculates (vLLM registers them only then)
  GET  /v1/models              the one served model
  POST /v1/completions         greedy (temperature 0) or sampled (``temperature`` > 0,
                               ``top_p``, ``top_k``, ``seed``, ``n``: the j-th of n samples
                               draws with seed + j, as vLLM seeds them); token-id or text
                               prompt(s), ``logprobs``, ``prompt_logprobs`` (raw: before the
                               sampling transform, as vLLM's), ``return_tokens_as_token_ids``,
                               ``return_token_ids``, ``max_tokens``, ``ignore_eos``, ``stream``
                               (server-sent events as vLLM sends them: one chunk per decode
                               or verify step as the engine decides it, each with its token
                               ids and logprobs, then ``data: [DONE]``)
  POST /tokenize, /detokenize  vLLM's extensions

Requests run one at a time (a lock) so results and timings do not depend on concurrency.
HTTP is starlette on uvicorn, the stack vLLM's OpenAI server runs on (the ``serve`` extra:
``pip install 'speccheck[serve]'``); a malformed request -- an unparsable ``Content-Length``,
a body that is not JSON, a field of the wrong type -- is a 4xx with a JSON error body.
"""
from __future__ import annotations

import contextlib
import hmac
import json
import math
import os
import threading
import time
import uuid
from http import HTTPStatus
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from speccheck.version import __version__
from speccheck.engines.base import Engine, EngineUsageError
from speccheck.types import Completion, Prompt, SpecConfig

#: Paths reachable without the API key, as in vLLM's AuthenticationMiddleware (PUBLIC_ENDPOINTS).
PUBLIC_PATHS = ("/health", "/ping", "/load", "/version", "/metrics")
DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class RequestError(Exception):
    """A client error, answered with an OpenAI-style error body."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


class SpecMetrics:
    """vLLM's Prometheus counters, in a registry of this server's own (several servers can
    live in one test process). Names and labels as vLLM's SpecDecodingProm and stat loggers."""

    def __init__(self, served_model: str, config: SpecConfig) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.values = [served_model, "0"]

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, labels + (extra or []), registry=self.registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.request_success = counter("vllm:request_success", "Count of successfully "
                                       "processed requests.", ["finished_reason"])
        # vLLM creates these children up front (one per finish reason), so they read 0, not absent
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(*self.values, reason)
        self.prompt_tokens.labels(*self.values)
        self.generation_tokens.labels(*self.values)
        self.spec = not config.is_baseline
        if self.spec:
            self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                        "Number of draft tokens.")
            self.accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                    "Number of accepted tokens.")
            per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                              "Accepted tokens per draft position.", ["position"])
            # vLLM creates one child per position 0..K-1 up front, so they show even at zero.
            self.per_pos = [per_pos.labels(*self.values, str(p)) for p in range(config.k)]
            for c in (self.drafts, self.draft_tokens, self.accepted):
                c.labels(*self.values)

    def observe(self, prompt_len: int, c: Completion) -> None:
        self.prompt_tokens.labels(*self.values).inc(prompt_len)
        self.generation_tokens.labels(*self.values).inc(c.n_tokens)
        self.request_success.labels(*self.values, c.finish_reason).inc()
        if self.spec and c.spec is not None:
            self.drafts.labels(*self.values).inc(c.spec.drafts)
            self.draft_tokens.labels(*self.values).inc(c.spec.draft_tokens)
            self.accepted.labels(*self.values).inc(c.spec.accepted_tokens)
            for counter, n in zip(self.per_pos, c.spec.accepted_per_pos):
                counter.inc(n)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class ServeState:
    """Everything a request handler needs: the engine, its one config, the key, the lock."""

    def __init__(self, engine: Engine, config: SpecConfig, served_model: str,
                 api_key: str | None, max_model_len: int = 32768) -> None:
        self.engine = engine
        self.config = config
        self.served_model = served_model
        self._api_key = api_key
        self.max_model_len = max_model_len
        self.lock = threading.Lock()
        self.metrics = SpecMetrics(served_model, config)
        self.created = int(time.time())
        self._sampling_engines: dict[tuple, Engine] = {}

    def __repr__(self) -> str:  # never show the key
        return f"ServeState(model={self.served_model!r}, config={self.config.name})"

    def authorized(self, path: str, header: str | None) -> bool:
        if self._api_key is None or any(path == p or path.startswith(p + "/")
                                        for p in PUBLIC_PATHS):
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.encode(), self._api_key.encode())

    # --- endpoint bodies (pure functions of the request, under the lock) ------------------

    def version(self) -> dict:
        with self.lock:
            identity = self.engine.identity()
        return {"version": __version__,
                "speccheck": {"server": "speccheck serve", "config": self.config.to_dict(),
                              "engine_identity": identity}}

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.served_model, "object": "model", "created": self.created,
            "owned_by": "speccheck", "root": self.engine.model or self.served_model,
            "parent": None, "max_model_len": self.max_model_len, "permission": []}]}

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.served_model:
            raise RequestError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.",
                               "model")

    def _prompt_from_text(self, text: str | None = None, messages: list | None = None,
                          max_tokens: int = 0) -> Prompt:
        msgs = tuple(dict(m) for m in messages) if messages is not None else None
        return Prompt(id="request", category="serve", max_tokens=max(max_tokens, 1),
                      text=text, messages=msgs)

    def tokenize(self, body: dict) -> dict:
        self._check_model(body)
        if isinstance(body.get("messages"), list):
            if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in body["messages"]):
                raise RequestError(HTTPStatus.BAD_REQUEST, "`messages` must be a list of objects with "
                                   "string `role` and `content`", "messages")
            prompt = self._prompt_from_text(messages=body["messages"])
        elif isinstance(body.get("prompt"), str):
            prompt = self._prompt_from_text(text=body["prompt"])
        else:
            raise RequestError(HTTPStatus.BAD_REQUEST, "field `prompt` (a string) or "
                               "`messages` (a list) is required", "prompt")
        with self.lock:
            ids = [int(t) for t in self.engine.tokenize(prompt)]
            strs = ([self.engine.detokenize([t]) for t in ids]
                    if body.get("return_token_strs") else None)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": strs}

    def detokenize(self, body: dict) -> dict:
        self._check_model(body)
        tokens = body.get("tokens")
        if not _is_id_list(tokens):
            raise RequestError(HTTPStatus.BAD_REQUEST, "field `tokens` must be a list of "
                               "non-negative token ids", "tokens")
        with self.lock:
            self._check_vocabulary(tokens)
            return {"prompt": self.engine.detokenize(tokens)}

    def completions(self, body: dict, stream: "SSEStream | None" = None) -> dict | None:
        """A /v1/completions request; with ``"stream": true`` the answer goes to ``stream``
        as vLLM's chunks, step by step (None is returned)."""
        self._check_model(body)
        req = _parse_completion_request(body)
        if req["stream"] and stream is None:
            raise RequestError(HTTPStatus.BAD_REQUEST, "`stream` needs a streaming connection",
                               "stream")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": self.served_model}
        choices, n_prompt, n_gen = [], 0, 0
        for prompt in req["prompts"]:
            with self.lock:
                ids = (prompt if isinstance(prompt, list) else
                       [int(t) for t in self.engine.tokenize(self._prompt_from_text(prompt))])
                self._check_vocabulary(ids)
                if len(ids) + req["max_tokens"] > self.max_model_len:
                    raise RequestError(HTTPStatus.BAD_REQUEST, f"This model's maximum context "
                                       f"length is {self.max_model_len} tokens; the request "
                                       f"asks for {len(ids) + req['max_tokens']}.", "max_tokens")
                send = (None if stream is None else
                        lambda chunk: stream.event({**head, "choices": [chunk]}))
                for j in range(req["n"]):  # vLLM seeds the j-th of n samples with seed + j
                    choice, n = self._complete_one(len(choices), ids, req, send, j)
                    choices.append(choice)
                    n_gen += n
            n_prompt += len(ids)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_gen,
                 "total_tokens": n_prompt + n_gen}
        if stream is not None:
            if req["include_usage"]:
                stream.event({**head, "choices": [], "usage": usage})
            stream.done()
            return None
        return {**head, "choices": choices, "usage": usage}

    def _check_vocabulary(self, ids: list[int]) -> None:
        """Token ids the model has (where the engine knows its tokens): an id past the
        vocabulary is the client's mistake, a 400, not an engine failure."""
        known = self.engine.token_bytes(0) is not None
        bad = next((t for t in ids if t >= 2 ** 31 or known and self.engine.token_bytes(t) is None), None)
        if bad is not None:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"token id {bad} is not in the model's vocabulary",
                               "prompt")

    def _engine_for(self, req: dict) -> Engine:
        """The engine for a request: as loaded for greedy decoding; for a sampled one, a
        variant under its temperature / top-p / top-k (the reference engine's ``with_args``,
        sharing the loaded networks; kept per setting)."""
        if req["temperature"] == 0:
            return self.engine
        key = (req["temperature"], req["top_p"], req["top_k"])
        if key not in self._sampling_engines:
            with_args = getattr(self.engine, "with_args", None)
            if with_args is None:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"the {self.engine.name} engine behind "
                                   "this server cannot sample: send \"temperature\": 0",
                                   "temperature")
            self._sampling_engines[key] = with_args(
                temperature=repr(req["temperature"]), top_p=repr(req["top_p"]),
                sample_top_k=str(req["top_k"]))
        return self._sampling_engines[key]

    def _complete_one(self, index: int, ids: list[int], req: dict,
                      send: Callable[[dict], None] | None = None, sample: int = 0) -> tuple[dict, int]:
        """One prompt's choice; with ``send``, also streamed: one chunk per engine step as it
        is decided (text, token ids and logprobs of that step), then a last chunk with the
        finish reason and any text held back (an incomplete UTF-8 character). A sampled
        request draws with its ``seed`` (+ ``sample``, the j-th of its n), or a fresh random
        one without."""
        k_out = req["logprobs"]
        width = max(2, k_out or 0)
        seed = None
        if req["temperature"] > 0:
            seed = (req["seed"] + sample if req["seed"] is not None
                    else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)
        engine = self._engine_for(req)
        prompt = Prompt(id=f"request-{index}", category="serve", max_tokens=req["max_tokens"],
                        ignore_eos=req["ignore_eos"], seed=seed)
        as_ids = bool(req["return_tokens_as_token_ids"])
        tok = self._token_str_fn(as_ids)
        if send is None:
            c = engine.generate([prompt], [ids], self.config, width)[0]
        else:
            streamed = {"ids": [], "text": "", "offset": 0}

            def on_tokens(new_ids, lps, top_ids, top_lps):
                streamed["ids"] += new_ids
                text = self.engine.detokenize(streamed["ids"])
                if text.endswith("\ufffd"):  # part of a character: wait for the rest
                    text = text.rstrip("\ufffd")
                delta = text[len(streamed["text"]):] if text.startswith(streamed["text"]) else ""
                streamed["text"] += delta
                chunk: dict[str, Any] = {"index": index, "text": delta, "logprobs": None,
                                         "finish_reason": None, "stop_reason": None}
                if k_out is not None:
                    chunk["logprobs"] = _logprobs_block(new_ids, lps, top_ids, top_lps, k_out,
                                                        tok, streamed["offset"])
                    streamed["offset"] += sum(len(t) for t in chunk["logprobs"]["tokens"])
                if req["return_token_ids"]:
                    chunk["token_ids"] = list(new_ids)
                    if len(streamed["ids"]) == len(new_ids):  # the first chunk, as vLLM
                        chunk["prompt_token_ids"] = list(ids)
                send(chunk)

            c = engine.generate_streaming(prompt, ids, self.config, width, on_tokens)
        self.metrics.observe(len(ids), c)
        text = c.text or self.engine.detokenize(c.token_ids.tolist())
        choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                                  "finish_reason": c.finish_reason, "stop_reason": None}
        if send is not None:
            rest = text[len(streamed["text"]):] if text.startswith(streamed["text"]) else ""
            last: dict[str, Any] = {"index": index, "text": rest, "logprobs": None,
                                    "finish_reason": c.finish_reason, "stop_reason": None}
            if req["return_token_ids"]:
                last["token_ids"] = []
            send(last)
        if k_out is not None:
            choice["logprobs"] = _completion_logprobs(c, k_out, tok)
        if req["prompt_logprobs"] is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(ids, req["prompt_logprobs"])
        if req["return_token_ids"]:
            choice["prompt_token_ids"] = list(ids)
            choice["token_ids"] = c.token_ids.tolist()
        return choice, c.n_tokens

    def _token_str_fn(self, as_ids: bool) -> Callable[[int], str]:
        if as_ids:
            return lambda t: f"token_id:{t}"
        return lambda t: self.engine.detokenize([t])

    def _prompt_logprobs(self, ids: list[int], k: int) -> list:
        """vLLM's ``prompt_logprobs``: None for the first token, then at each position a dict
        keyed by token id with the prompt's own token and the top-k (Logprob objects)."""
        if len(ids) < 2:
            return [None] * len(ids)
        s = self.engine.score([ids[:1]], [ids[1:]], max(k, 1))[0]
        out: list = [None]
        for j, token in enumerate(ids[1:]):
            entry: dict[str, dict] = {}
            top = [(int(t), float(lp)) for t, lp in zip(s.topk_ids[j][:k], s.topk_logprobs[j][:k])]
            rank = next((r + 1 for r, (t, _) in enumerate(top) if t == token), None)
            # rank is exact inside the top-k; outside it the engine does not say (None).
            entry[str(token)] = _logprob_obj(float(s.token_logprobs[j]), rank,
                                             self.engine.detokenize([token]))
            for r, (t, lp) in enumerate(top):
                entry.setdefault(str(t), _logprob_obj(lp, r + 1, self.engine.detokenize([t])))
            out.append(entry)
        return out


def _logprob_obj(lp: float, rank: int | None, decoded: str) -> dict:
    return {"logprob": max(lp, -9999.0), "rank": rank, "decoded_token": decoded}


def _completion_logprobs(c: Completion, k: int, tok: Callable[[int], str]) -> dict:
    """vLLM's CompletionLogProbs of a whole completion."""
    return _logprobs_block(c.token_ids.tolist(), c.logprobs.tolist(), c.topk_ids.tolist(),
                           c.topk_logprobs.tolist(), k, tok)


def _logprobs_block(ids: list, lps: list, top_ids: list, top_lps: list, k: int,
                    tok: Callable[[int], str], offset: int = 0) -> dict:
    """vLLM's CompletionLogProbs of some positions (a completion, or one streamed chunk whose
    text starts at ``offset``): per position the chosen token first, then the top-k, keyed
    by token string (``token_id:N`` with return_tokens_as_token_ids); at most k+1."""
    tokens, token_lps, tops, offsets, pos = [], [], [], [], offset
    for i, t in enumerate(ids):
        s = tok(t)
        tokens.append(s)
        token_lps.append(max(float(lps[i]), -9999.0))
        top = {s: token_lps[-1]}
        for tid, lp in zip(top_ids[i][:k], top_lps[i][:k]):
            top.setdefault(tok(tid), max(float(lp), -9999.0))
        tops.append(top)
        offsets.append(pos)
        pos += len(s)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens,
            "top_logprobs": tops}


def _is_id_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                       for t in x)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _parse_completion_request(body: dict) -> dict:
    """Validate a /v1/completions body; anything this server cannot honour is a 400, not
    silently ignored (a gate must not run on a request it did not mean)."""
    bad = lambda msg, param: RequestError(HTTPStatus.BAD_REQUEST, msg, param)  # noqa: E731
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_id_list(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (_is_id_list(p) and p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad("field `prompt` must be a non-empty string, a list of token ids, or a list "
                  "of either", "prompt")
    temperature = body.get("temperature")
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise bad(f"send \"temperature\": 0 for greedy decoding or > 0 to sample (got "
                  f"{temperature!r}; vLLM's default when absent is 1.0, which speccheck serve "
                  f"does not guess)", "temperature")
    top_p = body.get("top_p", 1.0)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise bad("`top_p` must be a number in (0, 1]", "top_p")
    top_k = body.get("top_k", 0)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < -1:
        raise bad("`top_k` must be an integer: -1 or 0 (off), or the tokens kept", "top_k")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise bad("`seed` must be an integer", "seed")
    for field, ok in (("echo", False), ("use_beam_search", False)):
        if body.get(field, ok) not in (ok, None):
            raise bad(f"`{field}` is not supported by speccheck serve", field)
    # what would change a greedy output (or promise a stop) and this server does not do: refused,
    # never ignored; the sampling fields greedy decoding ignores are checked for type only
    for field, neutral in (("stop", ("", [])), ("stop_token_ids", ([],)), ("logit_bias", ({},)),
                           ("presence_penalty", (0,)), ("frequency_penalty", (0,)),
                           ("repetition_penalty", (1,)), ("min_tokens", (0,)), ("best_of", (1,)),
                           ("suffix", ("",)), ("bad_words", ([],))):
        v = body.get(field)
        if v is not None and (isinstance(v, bool) or v not in neutral):
            raise bad(f"`{field}` is not supported by speccheck serve (it decodes greedily with no "
                      f"stops, penalties or biases); leave it out", field)
    for field, ok in (("seed", lambda v: isinstance(v, int) and not isinstance(v, bool)),
                      ("top_p", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1),
                      ("top_k", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1),
                      ("min_p", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1)):
        if body.get(field) is not None and not ok(body[field]):
            raise bad(f"`{field}` is {body[field]!r:.40}: not a valid {field} (greedy decoding ignores "
                      "it, but not its type)", field)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("`stream` must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)
                                or not isinstance(options.get("include_usage", False), bool)):
        raise bad("`stream_options` must be an object like {\"include_usage\": true}, and only "
                  "with \"stream\": true", "stream_options")
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or (n > 1 and temperature == 0):
        raise bad("`n` must be 1 for greedy decoding (one answer), a positive integer when "
                  "sampling", "n")
    max_tokens = body.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise bad("`max_tokens` must be a positive integer", "max_tokens")
    if stream and n > 1:
        raise bad("`stream` with `n` > 1 is not supported by speccheck serve", "n")
    out = {"prompts": prompts, "max_tokens": max_tokens, "stream": bool(stream),
           "include_usage": bool((options or {}).get("include_usage")),
           "temperature": float(temperature), "top_p": float(top_p), "top_k": max(int(top_k), 0),
           "seed": seed, "n": n}
    for field in ("logprobs", "prompt_logprobs"):
        v = body.get(field)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not
                              0 <= v <= MAX_LOGPROBS):
            raise bad(f"`{field}` must be an integer in 0..{MAX_LOGPROBS}", field)
        out[field] = v
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad("`ignore_eos` must be true or false", "ignore_eos")
    out["ignore_eos"] = ignore_eos
    out["return_tokens_as_token_ids"] = bool(body.get("return_tokens_as_token_ids"))
    out["return_token_ids"] = bool(body.get("return_token_ids"))
    return out


class SSEStream:
    """A server-sent-event answer (``data: {json}`` events, then ``data: [DONE]``), written
    from the engine's thread and sent by the ASGI server as each event is made. Nothing is
    sent before the first event, so a request refused before any token is a plain JSON error;
    a client that hangs up is let go: the rest is dropped, generation goes on."""

    def __init__(self, put: Callable[[tuple[str, Any]], None]) -> None:
        self._put = put
        self.started = False

    def event(self, obj: Any) -> None:
        self.started = True
        self._put(("data", f"data: {json.dumps(obj)}\n\n".encode()))

    def done(self) -> None:
        self._put(("data", b"data: [DONE]\n\n"))

    def fail(self, status: HTTPStatus, message: str) -> None:
        """vLLM's way to report a failure once streaming began: an error event, then [DONE]."""
        self.event({"error": {"message": message, "type": status.phrase.replace(" ", ""),
                              "param": None, "code": int(status)}})
        self.done()


#: the largest request body read (vLLM's requests are token ids: a few MiB at most)
MAX_BODY_BYTES = 32 << 20
SERVE_EXTRA = ("`speccheck serve` runs on starlette and uvicorn (the stack vLLM's OpenAI server uses), "
               "which this installation lacks: pip install 'speccheck[serve]'")


class ServeUnavailable(EngineUsageError):
    """The serve extra (starlette, uvicorn) is not installed (exit code 2)."""


def _stack():
    """starlette and uvicorn, or ServeUnavailable saying how to install them."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ServeUnavailable(f"{SERVE_EXTRA} ({e}).") from None


def _error_body(status: HTTPStatus, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": status.phrase.replace(" ", ""), "param": param,
                      "code": int(status)}}


def build_app(state: ServeState):
    """The ASGI application: vLLM's endpoints over ``state``. Every answer is JSON (or
    Prometheus text, or an SSE stream); a malformed request is a 4xx with an OpenAI-style
    error body, an engine failure a 500 with its message, never a traceback."""
    _stack()
    import asyncio

    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    def error(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(_error_body(status, message, param), status_code=int(status))

    async def read_json(request: Request) -> dict:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:  # said at once, not after 10 GB
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"request body over {MAX_BODY_BYTES >> 20} MiB (Content-Length {declared})")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                   f"request body over {MAX_BODY_BYTES >> 20} MiB")
        try:
            body = json.loads(bytes(raw) or b"{}")
        except (ValueError, RecursionError) as e:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"request body is not JSON: {str(e)[:200]}") from None
        if not isinstance(body, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, "request body must be an object")
        return body

    def endpoint(method: str, fn: Callable[[dict], Any]):
        async def handle(request: Request) -> Response:
            if not state.authorized(request.url.path, request.headers.get("authorization")):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)  # vLLM's exact body
            try:
                body = await read_json(request) if method == "POST" else {}
                if request.url.path == "/v1/completions" and body.get("stream") is True:
                    return await stream_completion(body)
                return JSONResponse(await run_in_threadpool(fn, body))
            except ClientDisconnect:
                return Response(status_code=400)  # nobody is left to read it
            except RequestError as e:
                return error(e.status, str(e), e.param)
            except EngineUsageError as e:
                return error(HTTPStatus.BAD_REQUEST, str(e))
            except Exception as e:  # noqa: BLE001 - the engine failed: a 500 like vLLM's
                return error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")
        return handle

    async def stream_completion(body: dict) -> Response:
        """The engine runs on a thread of its own and hands each event over as it is made;
        the first item decides between an SSE stream and a plain error."""
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the server is shutting down: nobody reads any more
                pass

        stream = SSEStream(put)

        def work() -> None:
            try:
                state.completions(body, stream)
            except BaseException as e:  # noqa: BLE001 - said to the client below
                put(("error", e))
            finally:
                put(("end", None))

        threading.Thread(target=work, name="speccheck-serve-stream", daemon=True).start()
        first = await items.get()
        if first[0] == "error":
            e = first[1]
            if isinstance(e, RequestError):
                return error(e.status, str(e), e.param)
            if isinstance(e, EngineUsageError):
                return error(HTTPStatus.BAD_REQUEST, str(e))
            return error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")

        async def events():
            item = first
            while item[0] != "end":
                if item[0] == "data":
                    yield item[1]
                else:  # a failure once streaming began: vLLM's error event, then [DONE]
                    e = item[1]
                    status = (e.status if isinstance(e, RequestError) else HTTPStatus.BAD_REQUEST
                              if isinstance(e, EngineUsageError) else HTTPStatus.INTERNAL_SERVER_ERROR)
                    yield f"data: {json.dumps(_error_body(status, f'{type(e).__name__}: {e}'))}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                item = await items.get()

        return StreamingResponse(events(), media_type="text/event-stream; charset=utf-8",
                                 headers={"Cache-Control": "no-cache"})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def not_found(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return JSONResponse({"detail": "Not Found"}, status_code=404)  # FastAPI's body
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    routes = [
        Route("/health", health, methods=["GET"]), Route("/ping", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", endpoint("GET", lambda b: state.version()), methods=["GET"]),
        Route("/v1/models", endpoint("GET", lambda b: state.models()), methods=["GET"]),
        Route("/v1/completions", endpoint("POST", state.completions), methods=["POST"]),
        Route("/tokenize", endpoint("POST", state.tokenize), methods=["POST"]),
        Route("/detokenize", endpoint("POST", state.detokenize), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


def _protocol():
    """uvicorn's h11 protocol, answering what it cannot parse (``Content-Length: abc``, a
    broken request line) with a JSON error like every other answer, not plain text."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JSONErrorsH11(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            import h11

            body = json.dumps(_error_body(HTTPStatus.BAD_REQUEST, f"{msg} (malformed HTTP request)")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                                 reason=b"Bad Request")))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:  # the state machine cannot answer any more: just close
                pass
            self.transport.close()

    return JSONErrorsH11


class SpeccheckServer:
    """The bound socket, the ASGI app on it and the uvicorn server that runs it."""

    def __init__(self, sock, state: ServeState, verbose: bool = False) -> None:
        import uvicorn

        self.sock = sock
        self.state = state
        self.app = build_app(state)
        config = uvicorn.Config(self.app, http=_protocol(), lifespan="off", access_log=verbose,
                                log_level="info" if verbose else "error",
                                log_config=uvicorn.config.LOGGING_CONFIG if verbose else None,
                                timeout_graceful_shutdown=2, timeout_keep_alive=30)
        self.server = uvicorn.Server(config)

    @property
    def base_url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self.server.run(sockets=[self.sock])

    def shutdown(self) -> None:
        self.server.should_exit = True

    def server_close(self) -> None:
        self.sock.close()


def _listen(host: str, port: int):
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)  # connections made before the loop runs wait in the backlog
    except BaseException:
        sock.close()
        raise
    return sock


def _config(method: str, k: int | None, engine: Engine) -> SpecConfig:
    if method == "baseline":
        if k:
            raise EngineUsageError(f"--k {k} given with --method baseline: the baseline takes "
                                   "no K; drop --k or name a speculative method")
        return SpecConfig()
    if engine.methods is not None and method not in engine.methods:
        raise EngineUsageError(f"--method {method}: this engine runs baseline or "
                               f"{', '.join(engine.methods)}")
    if not k:  # None or 0: not given
        k = engine.default_k(method)
        if k is None:
            raise EngineUsageError(f"--method {method} needs --k (how many tokens to draft)")
    try:
        return SpecConfig(method, int(k))
    except ValueError as e:
        raise EngineUsageError(f"--method {method} --k {k}: {e}") from None


def _api_key(api_key_env: str | None) -> str | None:
    """The key from the variable the user named; a named but unset variable is an error
    (serving unauthenticated by accident is worse than refusing to start)."""
    if not api_key_env:
        return None
    key = os.environ.get(api_key_env)
    if not key:
        raise EngineUsageError(f"--api-key-env names {api_key_env}, but that environment "
                               f"variable is not set or empty: export {api_key_env}=<key>, or "
                               "drop --api-key-env to serve without authentication")
    return key


def build_server(host: str = "127.0.0.1", port: int = 8000, method: str = "baseline",
                 k: int | None = None, api_key_env: str | None = None,
                 engine_args: dict | None = None, model: str | None = None, *,
                 engine: Engine | None = None, engine_name: str = "reference",
                 served_model: str | None = None, verbose: bool = False) -> SpeccheckServer:
    """Load the engine and bind (port 0 picks a free port); does not start serving."""
    _stack()  # before the engine loads: a missing extra is said at once
    if engine is None:
        from speccheck.engines import make_engine
        engine = make_engine(engine_name, model, engine_args)
    config = _config(method, k, engine)
    name = served_model or model or f"speccheck-{engine_name}"
    state = ServeState(engine, config, name, _api_key(api_key_env), engine.max_positions() or 32768)
    try:
        sock = _listen(host, port)
    except (OSError, OverflowError) as e:
        raise EngineUsageError(f"cannot listen on {host}:{port} ({getattr(e, 'strerror', None) or e}): "
                               "choose another --port or --host") from None
    return SpeccheckServer(sock, state, verbose)


def serve(host: str = "127.0.0.1", port: int = 8000, method: str = "baseline",
          k: int | None = None, api_key_env: str | None = None,
          engine_args: dict | None = None, model: str | None = None) -> None:
    """Serve until interrupted (Ctrl-C). Prints the URL and what it serves."""
    server = build_server(host, port, method, k, api_key_env, engine_args, model, verbose=True)
    st = server.state
    auth = f"Bearer key from ${api_key_env}" if api_key_env else "no authentication"
    print(f"speccheck serve: {server.base_url}  model {st.served_model!r}, config "
          f"{st.config.name}, {auth}", flush=True)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key_env:
        print(f"warning: listening on {host} without --api-key-env: anyone who can reach "
              "this address can use it", flush=True)
    try:
        server.serve_forever()  # uvicorn stops on Ctrl-C / SIGTERM, then raises the signal again
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        st.engine.close()


def start_server_in_thread(method: str = "baseline", k: int | None = None,
                           api_key_env: str | None = None, engine_args: dict | None = None,
                           model: str | None = None, *, host: str = "127.0.0.1",
                           port: int = 0, engine: Engine | None = None,
                           served_model: str | None = None) -> tuple[str, Callable[[], None]]:
    """Start a server on a background thread (free port by default): (base_url, stop)."""
    server = build_server(host, port, method, k, api_key_env, engine_args, model,
                          engine=engine, served_model=served_model)
    thread = threading.Thread(target=server.serve_forever, name="speccheck-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)

    def stop() -> None:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()

    return server.base_url, stop


@contextlib.contextmanager
def running_server(method: str = "baseline", k: int | None = None,
                   api_key_env: str | None = None, engine_args: dict | None = None,
                   model: str | None = None, **kw: Any) -> Iterator[str]:
    """``with running_server("mtp", 3) as url:`` -- a served engine for the block's length."""
    url, stop = start_server_in_thread(method, k, api_key_env, engine_args, model, **kw)
    try:
        yield url
    finally:
        stop()


__all__ = ["serve", "build_server", "build_app", "start_server_in_thread", "running_server",
           "SpeccheckServer", "ServeState", "SSEStream", "ServeUnavailable"]
