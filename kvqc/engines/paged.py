"""Pieces the engine adapters share: resolving a generated module and attention of several query tokens per
sequence over flatten's dequantized K/V (prefill, chunked prefill, speculative decoding).

Decode (one query token per sequence) always goes to the module's paged `decode` kernel; these helpers only serve
the multi-token path, where kvqc has no kernel of its own yet, so it dequantizes with `flatten` and runs
torch's scaled_dot_product_attention per sequence.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from kvqc import modules


def load_module(module_or_name: ModuleType | str | Path) -> ModuleType:
    """A generated module as given, or loaded by kvqc.modules.load from a scheme name, .py or .yaml path."""
    if isinstance(module_or_name, ModuleType):
        for attr in ("fill", "flatten", "decode", "KVCache", "KEY_CODE_BITS", "SCHEME"):
            if not hasattr(module_or_name, attr):
                raise ValueError(f"module: {module_or_name.__name__} is not a kvqc generated module (no {attr})")
        return module_or_name
    return modules.load(module_or_name)


def step_plan(module: ModuleType, plan, query: torch.Tensor, cache, block_tables: torch.Tensor,
              seq_lens: torch.Tensor):
    """The decode plan for one layer of a decode step: `plan` (the step's so far, or None) where it serves this
    query and cache, else a new one. None while a CUDA graph is captured: a captured layer plans inside the graph's
    own memory."""
    if cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if (plan is not None and plan.num_q_heads == query.shape[1] and plan.dtype == query.dtype
            and plan.geometry == module._geometry(cache)):
        return plan
    return module.plan_decode(cache, block_tables, seq_lens, query.shape[1], query.dtype)


def checking(device: torch.device) -> bool:
    """Whether host-side index checks run: always on CPU, on a GPU only with KVQC_DEBUG=1 (they sync)."""
    return device.type == "cpu" or os.environ.get("KVQC_DEBUG", "0") == "1"


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    scale: float | None,
    causal: bool = True,
) -> torch.Tensor:
    """Attention of packed queries over packed K/V, one sequence after another.

    query [sum(q_lens), num_q_heads, head_dim]; key, value [sum(kv_lens), num_kv_heads, head_dim]. The queries of
    a sequence are its last q_lens[i] positions, so with `causal` query j of sequence i sees kv positions
    0 .. kv_lens[i] - q_lens[i] + j (the new tokens were stored before attention, as engines do); without it,
    every query sees all kv_lens[i] tokens. Returns [sum(q_lens), num_q_heads, head_dim] in query's dtype.
    """
    num_q_heads, num_kv_heads = query.shape[1], key.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query: {num_q_heads} heads are not a multiple of the cache's {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    # float32 at least: half-precision softmax over long rows loses the small weights.
    compute = torch.promote_types(query.dtype, torch.float32)
    out = torch.zeros(query.shape[0], num_q_heads, value.shape[-1], dtype=query.dtype, device=query.device)
    q_at = kv_at = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        if q_len > kv_len and causal:
            raise ValueError(f"q_lens: {q_len} new tokens but only {kv_len} in the cache (store them first)")
        if q_len and kv_len:
            q = query[q_at : q_at + q_len].to(compute).transpose(0, 1)  # [heads, q_len, d]
            k = key[kv_at : kv_at + kv_len].to(device=query.device, dtype=compute).transpose(0, 1)
            v = value[kv_at : kv_at + kv_len].to(device=query.device, dtype=compute).transpose(0, 1)
            k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
            mask = None
            if causal:
                last = kv_len - q_len + torch.arange(q_len, device=query.device)  # last visible position per query
                mask = torch.arange(kv_len, device=query.device)[None, :] <= last[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            out[q_at : q_at + q_len] = o.transpose(0, 1).to(query.dtype)
        q_at += q_len
        kv_at += kv_len
    return out
