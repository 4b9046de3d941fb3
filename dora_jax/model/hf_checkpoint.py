"""Load a Hugging Face checkpoint directory into sharded params, and export params back.

Loading checks the whole checkpoint (architecture, every tensor present, every shape) before any
array is created, so a bad checkpoint fails with one clear error and nothing is half-loaded. The
arrays are then built shard by shard with ``jax.make_array_from_callback``: each device's slice is
read from memory-mapped safetensors one layer tensor at a time, so the whole model is never
materialised on the host or on one device.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dora_jax.config import ModelConfig
from dora_jax.model.hf_mapping import (
    IGNORED_HF_TENSORS,
    WeightRule,
    active_rules,
    expected_hf_tensors,
    model_config_from_hf,
    model_config_to_hf,
)
from dora_jax.model.params import Params, dtype_of, init_params, param_specs


class HFCheckpointError(ValueError):
    """A checkpoint directory is missing files or tensors, or holds tensors of the wrong shape."""


def read_hf_config(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "config.json"
    if not p.is_file():
        raise HFCheckpointError(f"{p}: missing (a Hugging Face checkpoint needs config.json)")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{p}: not valid JSON: {e}") from None


def load_hf_config(path: str | Path, **overrides: Any) -> ModelConfig:
    """Our :class:`ModelConfig` for the checkpoint at ``path`` (dtype fields from overrides)."""
    return model_config_from_hf(read_hf_config(path), **overrides)


def _tensor_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file, from the index or by scanning the files' headers."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise HFCheckpointError(f"{index}: malformed index ({e})") from None
        return {name: path / fname for name, fname in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFCheckpointError(
            f"{path}: no *.safetensors files and no model.safetensors.index.json"
        )
    out: dict[str, Path] = {}
    for f in files:
        for name in _open(f).keys():
            out[name] = f
    return out


def _open(file: Path):
    if not file.is_file():
        raise HFCheckpointError(f"{file}: missing (named by the checkpoint index)")
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise HFCheckpointError(f"{file}: not a readable safetensors file ({e})") from None


class _Reader:
    """Memory-mapped tensor access with a one-entry cache (devices ask for the same layer)."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._handles: dict[Path, Any] = {}
        self._last: tuple[str, np.ndarray] | None = None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str) -> np.ndarray:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        try:
            arr = self._handle(name).get_tensor(name)
        except (SafetensorError, OSError) as e:
            msg = f"{self.files[name]}: cannot read tensor {name!r} ({e})"
            raise HFCheckpointError(msg) from None
        self._last = (name, arr)
        return arr

    def _handle(self, name: str):
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = _open(f)
        return self._handles[f]


def _validate(reader: _Reader, cfg: ModelConfig, path: Path) -> None:
    expected = expected_hf_tensors(cfg)
    missing = [n for n in expected if n not in reader.files]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise HFCheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}{more}")
    ignored = [re.compile(p) for p in IGNORED_HF_TENSORS]
    if cfg.tie_word_embeddings:
        ignored.append(re.compile(r"^lm_head\.weight$"))  # some exports store the tied copy
    unknown = [
        n for n in reader.files if n not in expected and not any(p.match(n) for p in ignored)
    ]
    if unknown:
        raise HFCheckpointError(
            f"{path}: unexpected tensor(s) {', '.join(sorted(unknown)[:5])}: the checkpoint does "
            f"not match the {cfg.family} architecture described by its config.json"
        )
    for name, rule in expected.items():
        want, got = rule.hf_shape(cfg), reader.shape(name)
        if want != got:
            raise HFCheckpointError(
                f"{path}: tensor {name!r} has shape {list(got)}, expected {list(want)} "
                "from config.json"
            )


def check_hf_checkpoint(path: str | Path, cfg: ModelConfig) -> None:
    """Raise :class:`HFCheckpointError` unless every safetensors file of ``path`` opens (its
    header is whole and its tensors' bytes are all there) and holds the tensors ``cfg`` (from
    the directory's ``config.json``) names, in their shapes. Reads headers only: a run checks
    its model files this way before it writes anything."""
    path = Path(path)
    reader = _Reader(_tensor_files(path))
    for file in sorted(set(reader.files.values())):
        _open(file)  # safetensors refuses a header that does not cover the file exactly
    _validate(reader, cfg, path)


def load_hf_params(path: str | Path, cfg: ModelConfig, shardings: Params | None = None) -> Params:
    """Params for ``cfg`` from the HF checkpoint directory ``path``, each leaf created directly in
    its sharding from ``shardings`` (a tree matching the params; default: the first device)."""
    path = Path(path)
    reader = _Reader(_tensor_files(path))
    _validate(reader, cfg, path)
    dtype = np.dtype(dtype_of(cfg.param_dtype))
    specs = param_specs(cfg)
    out: Params = {"layers": {}}
    default = SingleDeviceSharding(jax.devices()[0])
    for rule in active_rules(cfg):
        group, _, leaf = rule.ours.rpartition("/")
        spec = specs[group][leaf] if group else specs[leaf]
        sharding = _lookup(shardings, rule.ours) if shardings is not None else default
        out_node = out[group] if group else out
        out_node[leaf] = _build(reader, rule, cfg, spec.shape, dtype, sharding)
    return out


def policy_params(
    cfg: ModelConfig, seed: int, shardings: Params, path: str | Path | None = None
) -> Params:
    """The starting policy, created directly in ``shardings``: the checkpoint at ``path``, else the
    random init of ``seed`` (the same values whatever the shardings)."""
    if path is None:
        return jax.jit(lambda k: init_params(cfg, k), out_shardings=shardings)(jax.random.key(seed))
    return load_hf_params(path, cfg, shardings)


def _lookup(tree: Params, ours: str) -> Any:
    node: Any = tree
    for part in ours.split("/"):
        node = node[part]
    return node


def _build(
    reader: _Reader,
    rule: WeightRule,
    cfg: ModelConfig,
    shape: tuple[int, ...],
    dtype: np.dtype,
    sharding: Sharding,
) -> jax.Array:
    def read(name: str, rest: tuple[slice, ...]) -> np.ndarray:
        return rule.to_ours(reader.read(name), cfg)[rest].astype(dtype)

    def piece(index: tuple[slice, ...]) -> np.ndarray:
        if not rule.per_layer:
            return read(rule.hf, index)
        layers = range(*index[0].indices(shape[0]))
        if rule.per_expert:  # [L, E, ...]: one HF tensor per layer and expert
            experts = range(*index[1].indices(shape[1]))
            return np.stack(
                [
                    np.stack([read(rule.hf.format(i=i, e=e), index[2:]) for e in experts])
                    for i in layers
                ]
            )
        return np.stack([read(rule.hf.format(i=i), index[1:]) for i in layers])

    return jax.make_array_from_callback(shape, sharding, piece)


def _hf_tensors(params: Params, cfg: ModelConfig, dtype: np.dtype) -> Iterator[tuple[str, Any]]:
    for rule in active_rules(cfg):
        arr = _lookup(params, rule.ours)
        layer, host = None, None
        for name, index in rule.hf_tensors(cfg):
            if index[:1] != layer:  # one host copy per layer: its experts are slices of it
                layer, host = index[:1], np.asarray(arr[index[:1]])
            yield name, rule.to_hf(host[index[1:]], cfg).astype(dtype)


def save_hf_checkpoint(
    params: Params,
    cfg: ModelConfig,
    path: str | Path,
    dtype: str = "float32",
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Write ``config.json`` and safetensors (sharded with an index past ``max_shard_bytes``)
    that ``transformers`` loads. Gathers one layer tensor at a time to the host."""
    if cfg.family == "qwen2" and not cfg.qkv_bias:
        raise ValueError(
            "model.attention_bias=false cannot be exported as Qwen2 (HF Qwen2 "
            "always has q/k/v biases); use family 'llama'"
        )
    np_dtype = np.dtype({"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in _hf_tensors(params, cfg, np_dtype):
        if size + arr.nbytes > max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        total = sum(a.nbytes for s in shards for a in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_cfg = model_config_to_hf(cfg, dtype)
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    return path
