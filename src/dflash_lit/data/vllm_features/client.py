"""Online target features from running feature servers (``features=vllm_server``).

:class:`ServerFeatures` stands where a ``FeatureStore`` stands (``ShardDataset.features``):
the dataset reads a row's hidden states, greedy ids and top-k logits from it. Rows are
requested ahead of the data position (:meth:`ServerFeatures.schedule`, fed the sampler's next
batches by ``FeatureServerGate``), held in a bounded buffer and deleted once the batch that
needs them is built. Requests are spread over the servers by row (row ``r`` goes to server
``r mod S`` first) and move to the next server when one fails; every request is retried
``retries`` times, ``retry_wait_s`` apart, before the row counts as failed. Standard library
HTTP only.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from dflash_lit.data.features import check_store_dtype
from dflash_lit.data.vllm_features.server import SERVED_NAME
from dflash_lit.errors import UserError


class FeatureServerError(UserError, RuntimeError):
    """No feature server could serve a row (after every retry on every server)."""


@dataclass
class ServedRow:
    hidden: np.ndarray                 # [n, F] store dtype (bf16 as uint16 bits)
    argmax: np.ndarray                 # [n] int32
    topk: tuple[np.ndarray, np.ndarray] | None


class FeatureClient:
    """HTTP access to one or more feature servers."""

    def __init__(self, urls: list[str], timeout_s: float = 120.0, retries: int = 5,
                 retry_wait_s: float = 2.0) -> None:
        if not urls:
            raise UserError("features.urls is empty: list the feature servers "
                            "(python serve_features.py ...), e.g. [http://127.0.0.1:8100]")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.retries, self.retry_wait_s = float(timeout_s), int(retries), \
            float(retry_wait_s)

    def _get(self, url: str, timeout: float | None = None) -> bytes:
        with urllib.request.urlopen(url, timeout=timeout or self.timeout_s) as r:
            return r.read()

    def _post(self, url: str, body: dict[str, Any]) -> bytes:
        req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return r.read()

    def info(self, url: str) -> dict[str, Any]:
        """A server's ``/dflash/info``; one line naming the URL when it cannot be reached."""
        try:
            return json.loads(self._get(f"{url}/dflash/info", timeout=min(self.timeout_s, 30)))
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise FeatureServerError(
                f"features.urls: feature server {url} is unreachable ({reason}); start it with "
                "python serve_features.py <the run's overrides> or fix the URL") from None

    def fetch(self, row: int, ids: np.ndarray) -> ServedRow:
        """The features of data row ``row`` (token ids ``ids``), with retries and failover."""
        first = int(row) % len(self.urls)
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            url = self.urls[(first + attempt) % len(self.urls)]
            key = uuid.uuid4().hex
            try:
                self._post(f"{url}/v1/completions", {
                    "model": SERVED_NAME, "prompt": [int(t) for t in ids], "max_tokens": 1,
                    "temperature": 0.0,
                    "kv_transfer_params": {"dflash_row": int(row), "dflash_key": key}})
                return _parse(self._get(f"{url}/dflash/features/{key}"))
            except (urllib.error.URLError, OSError, ValueError, pa.ArrowInvalid) as e:
                last = e
                if attempt < self.retries:
                    time.sleep(self.retry_wait_s)
        raise FeatureServerError(
            f"features.urls: no feature server answered for data row {row} after "
            f"{self.retries + 1} tries ({', '.join(self.urls)}; last error: "
            f"{getattr(last, 'reason', last)})")


def _parse(body: bytes) -> ServedRow:
    batch = pa.ipc.open_file(pa.py_buffer(body)).get_batch(0)
    names = batch.schema.names
    n = batch.column("length")[0].as_py()

    def col(name: str) -> np.ndarray:
        return np.frombuffer(batch.column(name)[0].as_py(), dtype=np.uint8)

    hidden = col("hidden")
    topk = None
    if "topk_ids" in names:
        ids = col("topk_ids").view(np.int32).reshape(n, -1)
        topk = (ids, col("topk_logits").view(np.float32).reshape(n, -1))
    return ServedRow(hidden, col("argmax").view(np.int32), topk)


class ServerFeatures:
    """Feature rows from servers, fetched ahead and dropped after use (a ``FeatureStore``'s
    read interface for ``ShardDataset``)."""

    def __init__(self, client: FeatureClient, feature_dim: int, store_dtype: str, topk: int,
                 workers: int = 8) -> None:
        self.client, self.feature_dim, self.topk = client, int(feature_dim), int(topk)
        _, self.np_dtype = check_store_dtype(store_dtype)
        self._pool = ThreadPoolExecutor(max_workers=max(1, int(workers)),
                                        thread_name_prefix="dflash-features")
        self._lock = threading.Lock()
        self._futures: dict[int, Future] = {}

    # ------------------------------------------------------------------ fetching
    def schedule(self, rows: list[int], ids: list[np.ndarray]) -> None:
        """Start fetching ``rows`` (not already buffered or in flight) in the background."""
        with self._lock:
            for r, t in zip(rows, ids):
                if int(r) not in self._futures:
                    self._futures[int(r)] = self._pool.submit(self.client.fetch, int(r), t)

    def wait(self, rows: list[int]) -> FeatureServerError | None:
        """Wait for ``rows`` (scheduled before); the first failure, or None when all arrived."""
        with self._lock:
            futs = [self._futures[int(r)] for r in rows if int(r) in self._futures]
        wait_futures(futs)
        for f in futs:
            if f.exception() is not None:
                with self._lock:  # a failed row is asked for again next time
                    for r in rows:
                        if self._futures.get(int(r)) is f:
                            del self._futures[int(r)]
                return f.exception()  # type: ignore[return-value]
        return None

    def ensure(self, rows: list[int], ids: list[np.ndarray]) -> None:
        """Fetch whatever of ``rows`` is not buffered yet, and wait; raises when it fails."""
        self.schedule(rows, ids)
        err = self.wait(rows)
        if err is not None:
            raise err

    def release(self, rows) -> None:
        """Drop rows whose batch is built (the buffer holds only what lies ahead)."""
        with self._lock:
            for r in rows:
                self._futures.pop(int(r), None)

    def has(self, row: int) -> bool:
        """Whether ``row`` is buffered or on its way."""
        with self._lock:
            return int(row) in self._futures

    # ------------------------------------------------------------------ FeatureStore reads
    def _row(self, row: int) -> ServedRow:
        return self._futures[int(row)].result()

    def hidden(self, row: int, length: int) -> np.ndarray:
        return self._row(row).hidden.view(self.np_dtype).reshape(-1, self.feature_dim)[:length]

    def argmax(self, row: int, length: int) -> np.ndarray:
        return self._row(row).argmax[:length]

    def topk_logits(self, row: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        topk = self._row(row).topk
        assert topk is not None
        return topk[0][:length], topk[1][:length]

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("features=vllm_server fetches ahead in the main process: set "
                        "data.num_workers=0")
