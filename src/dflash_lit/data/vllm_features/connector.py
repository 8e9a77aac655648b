"""The project's hidden-states connector for vLLM: captured target states straight into the
feature cache's Arrow format.

vLLM's ``extract_hidden_states`` method stores the requested layers of every prompt token in
a cache-only attention layer; a KV connector then reads them out when the request finishes.
vLLM's example connector writes one safetensors file per request through pinned memory and
CUDA streams (which fail on a CPU). This one reads the finished request's states, turns them
into a cache row (:class:`~dflash_lit.data.vllm_features.rows.RowHeads`: final norm, greedy
ids, top-k logits) and hands the row to a sink:

* ``cache``: appended to ``part-<prefix>-*.arrow`` files of the feature cache being built
  (committed at ``part_mb`` and whenever no request is left in flight), the layout
  ``FeatureStore`` memory-maps;
* ``spool``: one ``<key>.arrow`` file per request (same schema, one row), which the feature
  server (``serve_features.py``) hands to a trainer and deletes.

A request says which data row it is through ``kv_transfer_params``: ``{"dflash_row": int,
"dflash_key": str}`` (the key names the spool file). Only tensor-parallel rank 0 writes.
Loaded by vLLM from ``kv_connector_module_path``; settings in ``kv_connector_extra_config``
(see :func:`kv_transfer_config`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

from dflash_lit.data.vllm_features.rows import check_vllm_version

check_vllm_version(vllm.__version__)

CONNECTOR = "DFlashFeatureConnector"
MODULE = __name__


def kv_transfer_config(settings: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` loading this connector with ``settings``: ``target``
    (HF dir, for the final norm and lm_head), ``layer_ids`` (project ids), ``num_layers``,
    ``dtype`` (the engine's), ``store_dtype``, ``topk``, ``sink`` (``cache`` | ``spool``),
    ``dir``, ``prefix`` (cache part names), ``part_mb``."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE,
            "kv_role": "kv_producer", "kv_connector_extra_config": dict(settings)}


@dataclass
class _Meta(ExampleHiddenStatesConnectorMetadata):
    # the scheduler saw no request left in flight: commit the open cache part
    flush: bool = False
    rows: dict[str, int] = field(default_factory=dict)  # req_id -> data row


class DFlashFeatureConnector(ExampleHiddenStatesConnector):
    """Store-only connector writing feature-cache rows (see the module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._settings = dict(extra)
        self._inflight: set[str] = set()
        self._rows: dict[str, int] = {}
        self._heads = None
        self._writer = None
        self._written: set[str] = set()

    # ------------------------------------------------------------------ scheduler side
    def build_connector_meta(self, scheduler_output) -> _Meta:
        base = super().build_connector_meta(scheduler_output)
        meta = _Meta(pending_saves=base.pending_saves)  # no lock files: rows are renamed in
        for new_req in scheduler_output.scheduled_new_reqs:
            extra = (new_req.sampling_params.extra_args or {}) if new_req.sampling_params else {}
            params = extra.get("kv_transfer_params") or {}
            self._inflight.add(new_req.req_id)
            self._rows[new_req.req_id] = int(params.get("dflash_row", -1))
            # the base class's file name carries the spool key to the worker
            self._request_filenames[new_req.req_id] = str(params.get("dflash_key", new_req.req_id))
        for p in meta.pending_saves:
            meta.rows[p.req_id] = self._rows.pop(p.req_id, -1)
        meta.flush = bool(meta.pending_saves) and not self._inflight
        return meta

    def request_finished(self, request, block_ids):
        self._inflight.discard(request.request_id)
        delay, params = super().request_finished(request, block_ids)
        if params is not None:
            params = {"dflash_key": params["hidden_states_path"]}
        return delay, params

    # ------------------------------------------------------------------ worker side
    def wait_for_save(self) -> None:
        pass  # rows appear by rename when complete: no lock files

    def _sink(self):
        if self._heads is None:
            from dflash_lit.data.features import FeatureWriter
            from dflash_lit.data.vllm_features.rows import RowHeads

            s = self._settings
            dtype = getattr(torch, str(s["dtype"]))
            self._heads = RowHeads(s["target"], s["layer_ids"], int(s["num_layers"]), dtype,
                                   int(s.get("topk", 0)), device=self._kv_cache.device)
            if s["sink"] == "cache":
                d = self._heads.lm_head.weight.shape[1]
                self._writer = FeatureWriter(Path(s["dir"]), len(s["layer_ids"]) * d,
                                             str(s["store_dtype"]), int(s.get("topk", 0)),
                                             part_bytes=int(s.get("part_mb", 64)) << 20,
                                             prefix=f"part-{s['prefix']}")
        return self._heads

    def _submit_async_write(self, pending: PendingSave, row: int = -1) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).reshape(1, -1)
                 + blocks.reshape(-1, 1) * self._block_size).flatten()
        n = int(pending.token_ids.shape[0])
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n)
        r = self._sink().row(states)
        if self._writer is not None:
            self._writer.add([row], [r.hidden], [r.argmax],
                             None if r.topk_ids is None else [r.topk_ids],
                             None if r.topk_logits is None else [r.topk_logits])
        else:
            _write_spool(Path(self._settings["dir"]), pending.filename, row, r,
                         str(self._settings["store_dtype"]), int(self._settings.get("topk", 0)))

    def get_finished(self, finished_req_ids: set[str]):
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, _Meta):
                for p in meta.pending_saves:
                    self._submit_async_write(p, meta.rows.get(p.req_id, -1))
                    if self._is_tp_rank_zero:
                        self._written.add(p.req_id)
                if meta.flush and self._writer is not None:
                    self._writer.commit()
        # a request is done once the scheduler reported it finished and its row is written
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = self._accumulated_finished_req_ids & self._written
        self._accumulated_finished_req_ids -= done
        self._written -= done
        return done or None, None

    def shutdown(self):
        if self._writer is not None:
            self._writer.close()
        super().shutdown()


def _write_spool(spool: Path, key: str, row: int, r, store_dtype: str, topk: int) -> None:
    """One row as ``<spool>/<key>.arrow`` (the feature cache's schema), renamed in whole."""
    from dflash_lit.data.features import FeatureWriter

    spool.mkdir(parents=True, exist_ok=True)
    w = FeatureWriter(spool, r.hidden.shape[1], store_dtype, topk, prefix=f"part-{key}")
    w.add([row], [r.hidden], [r.argmax], None if r.topk_ids is None else [r.topk_ids],
          None if r.topk_logits is None else [r.topk_logits])
    w.close()
    os.replace(spool / f"part-{key}-00000.arrow", spool / f"{key}.arrow")


def write_info(spool: Path, info: dict[str, Any]) -> None:
    """The server's description (target fingerprint, layer ids, dtypes) for trainers to check."""
    spool.mkdir(parents=True, exist_ok=True)
    tmp = spool / ".info.json.tmp"
    tmp.write_text(json.dumps(info, sort_keys=True))
    tmp.replace(spool / "info.json")
