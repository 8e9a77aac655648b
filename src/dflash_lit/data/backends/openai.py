"""``openai`` backend: any OpenAI-compatible server (vLLM, SGLang) over plain HTTP.

Standard library only (``urllib.request`` + a thread pool). ``/v1/completions`` is sent the
prompt token ids (exactly the stored prompt) or the rendered text; ``/v1/chat/completions``
the messages (the server applies its template). Timeouts, connection errors, HTTP 5xx / 429,
bodies cut off mid-transfer and malformed JSON are retried with exponential back-off (each
counted by kind in the summary); other HTTP 4xx errors are fatal.
Responses are tokenized with the target tokenizer in the calling thread.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from dflash_lit.data.backends import GenerationSettings, GenRequest, GenResult
from dflash_lit.errors import UserError

log = logging.getLogger(__name__)

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}


class ServerError(UserError, RuntimeError):
    """The server could not be used (unreachable after retries, or a fatal HTTP error)."""


class _Retryable(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind, self.detail = kind, detail


@dataclass
class _Raw:
    id: str
    text: str
    finish_reason: str
    stop_reason: Any


class OpenAIBackend:
    """Concurrent requests to an OpenAI-compatible server with retries and back-off."""

    name = "openai"

    def __init__(
        self,
        tokenizer: Any,
        gen: GenerationSettings,
        base_url: str = "http://127.0.0.1:8000/v1",
        model: str | None = None,
        endpoint: str = "completions",
        prompt_as: str = "ids",
        concurrency: int = 32,
        max_retries: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        if endpoint not in ENDPOINTS:
            raise UserError(f"openai.endpoint: {endpoint!r} is not one of {sorted(ENDPOINTS)}")
        if prompt_as not in ("ids", "text"):
            raise UserError(f"openai.prompt_as: {prompt_as!r} is not 'ids' or 'text'")
        if concurrency < 1 or max_retries < 0 or timeout_s <= 0:
            raise UserError("openai: need concurrency >= 1, max_retries >= 0, timeout_s > 0")
        self.tokenizer, self.gen = tokenizer, gen
        self.base_url = base_url.rstrip("/")
        self.endpoint, self.prompt_as = endpoint, prompt_as
        self.concurrency, self.max_retries = int(concurrency), int(max_retries)
        self.backoff_s, self.max_backoff_s, self.timeout_s = backoff_s, max_backoff_s, timeout_s
        self.api_key = api_key
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.extra_body = dict(extra_body or {})
        self._model = model
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stats: dict[str, int] = {"requests": 0, "retries": 0}

    # -- HTTP --------------------------------------------------------------------------------

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] = self._stats.get(key, 0) + 1

    def _once(self, url: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """One HTTP request → parsed JSON; raise _Retryable / ServerError."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers=headers)
        self._count("requests")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode("utf-8", "replace")
            if e.code >= 500 or e.code == 429:
                raise _Retryable(f"http_{e.code // 100}xx" if e.code >= 500 else "http_429",
                                 f"HTTP {e.code}: {detail}") from e
            raise ServerError(
                f"openai backend: {url} answered HTTP {e.code}: {detail}; check openai.model, "
                "openai.endpoint and the generation settings"
            ) from e
        except urllib.error.URLError as e:
            kind = "timeout" if isinstance(e.reason, TimeoutError) else "connection"
            raise _Retryable(kind, f"{type(e.reason).__name__}: {e.reason}") from e
        except TimeoutError as e:
            raise _Retryable("timeout", f"no answer within timeout_s={self.timeout_s}") from e
        except http.client.IncompleteRead as e:  # the connection closed mid-body
            raise _Retryable("truncated", f"body cut off after {len(e.partial)} bytes "
                                          f"({e.expected} more expected)") from e
        except (http.client.HTTPException, OSError) as e:
            raise _Retryable("connection", f"{type(e).__name__}: {e}") from e
        try:
            out = json.loads(payload)
            if not isinstance(out, dict):
                raise ValueError("not a JSON object")
            return out
        except ValueError as e:
            raise _Retryable("malformed", f"malformed JSON: {payload[:120]!r}") from e

    def _call(self, path: str, body: dict[str, Any] | None, parse) -> Any:
        """Request with retries + exponential back-off; ``parse`` may raise _Retryable."""
        url = self.base_url + path
        last: _Retryable | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                if self._stop.wait(delay):
                    raise ServerError("openai backend: stopped after another request failed")
                self._count("retries")
            try:
                return parse(self._once(url, body))
            except _Retryable as e:
                self._count(e.kind)
                last = e
                log.debug("openai backend: %s attempt %d failed: %s", url, attempt + 1, e.detail)
        assert last is not None
        raise ServerError(
            f"openai backend: request to {url} failed after {self.max_retries + 1} attempts "
            f"(last: {last.kind}: {last.detail}). Is the server up and reachable at "
            f"openai.base_url={self.base_url}? Finished shards are kept; rerun the same command "
            "to resume."
        )

    # -- requests ----------------------------------------------------------------------------

    @property
    def model(self) -> str:
        """Served model name: ``openai.model``, else the first id of ``GET /models``."""
        if self._model is None:

            def first_id(obj: dict[str, Any]) -> str:
                try:
                    return str(obj["data"][0]["id"])
                except (KeyError, IndexError, TypeError) as e:
                    raise _Retryable("malformed", f"no model in /models answer: {obj}") from e

            self._model = self._call("/models", None, first_id)
        return self._model

    def _body(self, r: GenRequest) -> dict[str, Any]:
        g = self.gen
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": g.max_new_tokens,
            "temperature": 0.0 if g.greedy else g.temperature,
            "n": 1,
            "stream": False,
        }
        if not g.greedy:
            body.update(top_p=g.top_p, seed=g.seed)
            if g.top_k > 0:
                body["top_k"] = g.top_k
        if g.stop:
            body["stop"] = list(g.stop)
        if g.stop_token_ids:
            body["stop_token_ids"] = list(g.stop_token_ids)  # vLLM / SGLang extension
        if self.endpoint == "chat":
            if r.messages is None:
                raise UserError(f"{r.id}: openai.endpoint=chat needs chat prompts (chat on)")
            body["messages"] = r.messages
            if self.chat_template_kwargs:
                body["chat_template_kwargs"] = self.chat_template_kwargs
        else:
            body["prompt"] = r.prompt_ids if self.prompt_as == "ids" else r.prompt_text
        body.update(self.extra_body)
        return body

    def _complete(self, r: GenRequest) -> _Raw:
        chat = self.endpoint == "chat"

        def parse(obj: dict[str, Any]) -> _Raw:
            try:
                choice = obj["choices"][0]
                if chat:
                    msg = choice["message"]
                    if msg.get("reasoning_content") or msg.get("reasoning"):
                        raise ServerError(
                            "openai backend: the server split the answer into reasoning_content; "
                            "serve without --reasoning-parser or use openai.endpoint=completions"
                        )
                    text = msg.get("content") or ""
                else:
                    text = choice["text"]
                finish = choice["finish_reason"]
            except (KeyError, IndexError, TypeError) as e:
                raise _Retryable("malformed", f"unexpected answer shape: {str(obj)[:200]}") from e
            if not isinstance(text, str) or finish not in ("stop", "length"):
                raise _Retryable("malformed", f"unexpected text/finish_reason: {finish!r}")
            reason = choice.get("stop_reason", choice.get("matched_stop"))
            return _Raw(r.id, text, finish, reason)

        return self._call(ENDPOINTS[self.endpoint], self._body(r), parse)

    def _to_result(self, raw: _Raw) -> GenResult:
        """Tokenize the answer; put back the stop the server strips (see module docstring)."""
        text, extra = raw.text, []
        if raw.finish_reason == "stop":
            if isinstance(raw.stop_reason, str):
                text = text + raw.stop_reason
            elif isinstance(raw.stop_reason, int):
                extra = [raw.stop_reason]
            elif self.gen.eos_token_id is not None:
                extra = [self.gen.eos_token_id]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        return GenResult(raw.id, list(ids) + extra, raw.finish_reason)

    def generate(self, requests: Iterable[GenRequest]) -> Iterator[GenResult]:
        """Yield results as they complete, keeping at most 2×concurrency requests queued."""
        self._stop.clear()
        _ = self.model  # resolve once, before the workers start
        it = iter(requests)
        pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="regen-http")
        pending: set[Future] = set()
        try:
            for r in it:
                pending.add(pool.submit(self._complete, r))
                if len(pending) >= 2 * self.concurrency:
                    break
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    raw = fut.result()  # re-raises a worker's ServerError
                    nxt = next(it, None)
                    if nxt is not None:
                        pending.add(pool.submit(self._complete, nxt))
                    yield self._to_result(raw)
        finally:
            self._stop.set()  # wake workers sleeping in back-off
            pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._stats)
