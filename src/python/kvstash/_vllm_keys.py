"""What a vLLM request's chunk keys name besides its token ids: everything vLLM's attention
read to compute the chunk's KV (docs/integration.md, "What a key names").

- The engine's model, by content (``model_identity``): the weights' bytes (not their path), the
  model's configuration as vLLM resolved it (overrides included), its dtype, quantization and
  load format, and the KV cache's dtype. Computed once per process; the weights' digest is
  cached on disk (kvstash._identity).
- The request (``RequestKeys.request_salt``): its ``cache_salt`` and its LoRA adapter, by the
  adapter's content.
- Each chunk (``RequestKeys.chunk_salts``): the multimodal items whose placeholders it holds
  (vLLM's own hash of each item, and where its placeholder starts and ends), and the prompt
  embeddings in its positions, by their bytes.

What cannot be named is not stored or loaded: ``Unnameable`` says why, and the connector leaves
the request to vLLM alone.
"""

from __future__ import annotations

import json
import os
import struct
from typing import TYPE_CHECKING, Any

from kvstash import _identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


class Unnameable(Exception):
    """A request's KV depends on an input kvstash cannot name by its content."""


# Fields of a model's configuration that say where or by what it was saved, not what it computes.
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset",
                 "_attn_implementation_internal")


def _config_json(hf_config: Any) -> str:
    try:
        d = hf_config.to_dict()
    except AttributeError:
        d = dict(vars(hf_config))
    for k in _CONFIG_NOISE:
        d.pop(k, None)
    return json.dumps(d, sort_keys=True, default=str)


def weights_path(vllm_config: VllmConfig) -> str | None:
    """Where the files vLLM loaded the model's weights from are, on this host."""
    m = vllm_config.model_config
    weights = getattr(m, "model_weights", "") or ""
    if weights and os.path.exists(weights):
        return weights
    download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
    return _identity.local_path(str(m.model), getattr(m, "revision", None), download_dir)


def model_identity(vllm_config: VllmConfig, weights_id: str = "", label: str = "") -> str:
    """The model as its chunks' keys name it: "[label#]vllm:<128-bit digest>" of what changes
    the KV bytes. `weights_id`: a string the operator vouches names the weights' content (no
    file is read; "sha256:<hex>" as `python -m kvstash._identity` prints it stands for the
    files it names). ValueError when the weights cannot be found to be read."""
    m = vllm_config.model_config
    cache = vllm_config.cache_config
    load_format = str(getattr(getattr(vllm_config, "load_config", None), "load_format", "auto"))
    parts: dict[str, Any] = {
        "config": _config_json(m.hf_config),
        "dtype": str(m.dtype),
        "quantization": str(getattr(m, "quantization", None)),
        "load_format": load_format,
        "kv_cache_dtype": str(cache.cache_dtype),
        "kv_cache_dtype_skip_layers": list(getattr(cache, "kv_cache_dtype_skip_layers", None) or []),
    }
    dummy = f"dummy:{getattr(m, 'seed', None)}" if load_format == "dummy" else ""  # vLLM's seeded random weights
    parts["weights"] = weights_id or dummy or _identity.weights_name_at(weights_path(vllm_config), str(m.model),
                                                                       "kv_connector_extra_config")
    return (f"{label}#" if label else "") + "vllm:" + _identity.digest_of(parts)


def check_servable(vllm_config: VllmConfig) -> None:
    """ValueError for an engine whose chunks' bytes depend on what no key can name."""
    cache = vllm_config.cache_config
    if getattr(cache, "calculate_kv_scales", False):
        raise ValueError("kvstash: calculate_kv_scales computes the KV cache's scales from the engine's first "
                         "batch, so two engines' chunks mean different values; serve scales from the checkpoint")


def _packed(entries: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in entries)


class RequestKeys:
    """The request-level and chunk-level salts of requests, for one engine's chunk size."""

    def __init__(self, chunk_tokens: int, lora_dtype: str = ""):
        self.chunk_tokens = chunk_tokens
        self._lora_dtype = lora_dtype
        # LoRA id -> (path, digest): named once, as vLLM loads an adapter once per id (unless a
        # request asks it to load again in place).
        self._lora: dict[int, tuple[str, str]] = {}

    def request_salt(self, request: Request) -> str:
        """Its cache_salt and LoRA adapter. Unnameable when the adapter's files are not here."""
        parts = []
        salt = getattr(request, "cache_salt", None)
        if salt:
            parts.append(f"cache_salt={salt}")
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            parts.append(f"lora={self._lora_digest(lora)}")
        return ":".join(parts)

    def _lora_digest(self, lora: Any) -> str:
        path = str(getattr(lora, "lora_path", None) or getattr(lora, "path", None) or "")
        lora_id = int(getattr(lora, "lora_int_id", 0) or 0)
        known = self._lora.get(lora_id)
        if known is not None and known[0] == path and not getattr(lora, "load_inplace", False):
            return known[1]
        where = _identity.local_path(path)
        if where is None:
            raise Unnameable(f"LoRA adapter {getattr(lora, 'lora_name', lora_id)!r}: its files ({path or 'no path'}) "
                             f"are not on this host to be named by their content")
        try:
            digest = _identity.short(_identity.content_digest(where))
        except OSError as e:
            raise Unnameable(f"LoRA adapter {getattr(lora, 'lora_name', lora_id)!r}: {e}") from e
        digest += f".{self._lora_dtype}" if self._lora_dtype else ""
        self._lora[lora_id] = (path, digest)
        return digest

    def chunk_salts(self, request: Request) -> list[bytes]:
        """Per chunk of the prompt (the last one partial), what its KV was computed from besides
        its ids: the multimodal items whose placeholders overlap it, as (modality, vLLM's item
        hash, placeholder start relative to the chunk, length), and its prompt embeddings' bytes.
        Empty when the request has neither."""
        features = getattr(request, "mm_features", None) or []
        embeds = getattr(request, "prompt_embeds", None)
        if not features and embeds is None:
            return []
        c = self.chunk_tokens
        n = int(getattr(request, "num_prompt_tokens", 0) or len(request.prompt_token_ids or []))
        mask = getattr(request, "prompt_is_token_ids", None)
        mask = None if mask is None else bytes(bool(x) for x in mask)  # mixed prompts: which positions are ids
        chunks = -(-n // c)
        entries: list[list[bytes]] = [[] for _ in range(chunks)]
        for f in features:
            pos = f.mm_position
            ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
            if ident is None:
                raise Unnameable("a multimodal item has no hash to name it by")
            modality = getattr(f, "modality", "")
            first, last = pos.offset // c, min(chunks - 1, (pos.offset + pos.length - 1) // c)
            for i in range(first, last + 1):
                entries[i].append(f"mm:{modality}:{ident}@{pos.offset - i * c}+{pos.length}".encode())
        if embeds is not None:
            for i in range(chunks):
                rows = slice(i * c, min(n, (i + 1) * c))
                entries[i].append(b"embeds:" + _identity.tensor_digest(embeds, rows))
                if mask is not None:
                    entries[i].append(b"ids:" + mask[rows])
        return [_packed(e) if e else b"" for e in entries]
