"""Build any installed ``transformers`` architecture from its config class,
with the storage dtypes loading a checkpoint would give.

``from_config(config, dtype=...)`` in transformers 5.24 only sets the default
dtype while the modules are constructed: every parameter comes out in
``dtype`` except those a module creates with an explicit dtype (Kimi-Linear's
``dt_bias`` is created fp32). It does *not* apply the keep-in-fp32 rules;
``from_pretrained`` does, while loading: a parameter whose name matches a
``_keep_in_fp32_modules_strict`` token (fp16/bf16 loads) or a
``_keep_in_fp32_modules`` token (fp16 loads only) is stored fp32, and any
other parameter that was constructed in a dtype other than the requested one
keeps its constructed dtype. :func:`build_hf_model` applies the same rule
after construction, so a model built from a config has the dtypes of the
shipped model loaded with ``dtype``.
"""

from __future__ import annotations

from typing import cast

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from types import ModuleType

import torch
from torch import nn

from ..core._names import name_tokens as _names

__all__ = ["build_hf_model", "require_transformers"]

_INSTALL_HINT = 'Hugging Face support needs transformers: pip install "fsdptx[hf]"'


def require_transformers() -> ModuleType:
    """Import ``transformers`` on first use; the core package depends on torch only."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    return transformers


def _config(transformers: ModuleType, source: str, overrides: Mapping[str, object]) -> object:
    """A config from a local ``config.json`` (file or folder) or a model type.

    Nothing is fetched from a hub: a path is read locally, a model type is
    built from its config class defaults plus ``overrides``.
    """
    if os.path.exists(source):
        path = os.path.dirname(source) if os.path.isfile(source) else source
        base = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        _check_overrides(base, overrides)
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True, **overrides)
    known = list(transformers.models.auto.configuration_auto.CONFIG_MAPPING.keys())
    if source not in known:
        close = difflib.get_close_matches(source, known, n=5, cutoff=0.5)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise ValueError(
            f"unknown model type {source!r} for transformers {transformers.__version__}{hint}."
            " Pass a model type (config.model_type) or the path of a local config.json"
        )
    _check_overrides(transformers.AutoConfig.for_model(source), overrides)
    return transformers.AutoConfig.for_model(source, **overrides)


def _check_overrides(base: object, overrides: Mapping[str, object]) -> None:
    """Refuse an override that looks like a typo of a field the config has
    (``num_hiden_layers``: it would become a stray attribute and the model
    be built with the default), naming the close match; and a count or size
    (``num_*``, ``*_size``) given below 1 where the config's default is
    positive (``-1`` layers builds an empty model that plans "successfully").

    A key with no close match is accepted: modeling code reads optional
    fields the config class does not declare (``head_dim`` on some
    architectures) with ``getattr``."""
    defaults = base.to_dict()  # type: ignore[attr-defined]
    known = sorted({*defaults, *getattr(base, "attribute_map", {})})
    for key, value in overrides.items():
        if key not in known and not hasattr(base, key):
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
            if close:
                raise ValueError(
                    f"{type(base).__name__} has no field {key!r}; did you mean {close[0]!r}? "
                    f"(overrides={{{key!r}: {value!r}}})"
                )
            continue
        default = getattr(base, key, None)
        if (
            (key.startswith("num_") or key.endswith("_size"))
            and type(default) is int
            and default >= 1
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value < 1
        ):
            raise ValueError(f"{type(base).__name__}.{key} must be >= 1 (default {default}), got {value}")


def _model_class(transformers: ModuleType, config: object) -> type[nn.Module]:
    """The class ``from_pretrained`` would give a training user: a causal-LM
    head if the architecture has one (multimodal Gemma 3 registers
    ``Gemma3ForConditionalGeneration`` there), else image-text-to-text, else
    the bare base model."""
    for auto_name in ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel"):
        mapping = getattr(transformers, auto_name)._model_mapping
        if type(config) in mapping:
            return cast("type[nn.Module]", mapping[type(config)])
    raise ValueError(f"{type(config).__name__} has no model class registered with transformers' auto classes")


def _pattern(tokens: Sequence[str]) -> re.Pattern[str] | None:
    """HF's keep-in-fp32 matching: any token found anywhere in the name, ``*`` as a wildcard."""
    if not tokens:
        return None
    return re.compile("|".join(f"(?:{t.replace('*', '.*')})" for t in tokens))


def _fp32_storage_tokens(model: nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    tokens: list[str] = []
    if dtype in (torch.float16, torch.bfloat16):
        tokens += _names(getattr(model, "_keep_in_fp32_modules_strict", None), "_keep_in_fp32_modules_strict")
    if dtype == torch.float16:
        tokens += _names(getattr(model, "_keep_in_fp32_modules", None), "_keep_in_fp32_modules")
    return tuple(tokens)


def _keep_in_fp32(model: nn.Module, storage_tokens: Sequence[str], compute_tokens: Sequence[str]) -> None:
    """Store fp32 what matches ``storage_tokens`` (parameters and persistent
    buffers, as loading does) and record ``_hf_compute_dtype = float32`` on
    every parameter matching ``compute_tokens``, so planning keeps those
    computing in fp32 even when the whole model is stored fp32."""
    storage, compute = _pattern(storage_tokens), _pattern(compute_tokens)
    for module_name, module in model.named_modules():
        prefix = module_name + "." if module_name else ""
        for name, p in module._parameters.items():
            if p is None or not p.is_floating_point():
                continue
            if storage is not None and storage.search(prefix + name) and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)
            if compute is not None and compute.search(prefix + name):
                p._hf_compute_dtype = torch.float32
        if storage is None:
            continue
        for name, b in module._buffers.items():
            persistent = name not in module._non_persistent_buffers_set
            if b is not None and persistent and b.is_floating_point() and storage.search(prefix + name):
                module._buffers[name] = b.to(torch.float32)


def build_hf_model(
    model_type_or_config_path: str,
    overrides: Mapping[str, object] | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "meta",
    keep_in_fp32: Sequence[str] = (),
) -> nn.Module:
    """Build a model from its config class with randomly initialized weights.

    ``model_type_or_config_path`` is a ``config.model_type`` (``"qwen3"``) or
    the path of a local ``config.json`` (or its folder); ``overrides`` are
    config fields (e.g. a tiny ``hidden_size``). The model is built on
    ``device`` (``"meta"`` to plan without memory) with ``dtype`` storage and
    HF's keep-in-fp32 rule applied as loading applies it.

    ``keep_in_fp32`` adds name tokens (HF syntax: substring, ``*`` wildcard)
    stored *and* computed in fp32 beyond what the model declares: training
    recipes keep SSM ``A_log``/``D``/``dt_bias`` and attention ``sinks`` fp32
    although the shipped checkpoints store them in bf16. Every parameter kept
    fp32 by a strict or extra token is marked ``_hf_compute_dtype = float32``.

    Raises ``ImportError`` without transformers, ``ValueError`` for an unknown
    model type (listing close matches), an override the config does not
    know (naming the close match) or a count/size override below 1, and
    ``TypeError`` for ``overrides`` that is not a mapping.
    """
    if not isinstance(model_type_or_config_path, str):
        raise TypeError(
            f"build_hf_model: model_type_or_config_path must be a str, got {type(model_type_or_config_path).__name__}"
        )
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(
            f"build_hf_model: overrides must be a mapping of config field -> value "
            f"(e.g. {{'hidden_size': 32}}), got {type(overrides).__name__} {overrides!r}"
        )
    bad_keys = [k for k in overrides or {} if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"build_hf_model: overrides keys must be config field names (str), got {bad_keys!r}")
    transformers = require_transformers()
    extra = _names(keep_in_fp32, "keep_in_fp32")
    config = _config(transformers, model_type_or_config_path, dict(overrides or {}))
    model_class = _model_class(transformers, config)
    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype)  # type: ignore[attr-defined]
    strict = _names(getattr(model, "_keep_in_fp32_modules_strict", None), "_keep_in_fp32_modules_strict")
    _keep_in_fp32(model, (*_fp32_storage_tokens(model, dtype), *extra), (*strict, *extra))
    return cast(nn.Module, model)
