"""One layer of an LMDeploy decode step through kvqc's adapter, without the engine: the adapter's fill_kv_cache and
flash_attn_with_kvcache on LMDeploy's token-major caches ('bshd'), batch 32 x 16k context, 32 query / 8 KV heads,
head_dim 128, block 64, for turbo_k4v2 (quant_policy 42), int4_token (4) and int8_token (8).

Per call: GPU time inside a CUDA graph (one call captured alone, triton.testing.do_bench median) and eager host
time (the median of 10 rounds of 32 calls queued back to back). Calls take 8 layers' caches in turn; LMDeploy hands
a step's layers the same block_offsets and kv_seqlens tensors, so the first decode call plans and later ones replay
its launches, and the first fill maps the slots the later ones reuse, as in the engine's eager mode. A graph
captures a fill together with its step's slot mapping. Needs a CUDA GPU, not LMDeploy itself:

    python3 benchmarks/lmdeploy_layers.py
"""

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvqc from this checkout
from kvqc.engines import lmdeploy
from kvqc.tools.bench import host_us

BATCH, CONTEXT, BLOCK_SIZE, KV_HEADS, Q_HEADS, HEAD_DIM, LAYERS = 32, 16384, 64, 8, 32, 128, 8
POLICIES = ((42, "turbo_k4v2"), (4, "int4_token"), (8, "int8_token"))


def measure(policy: int, name: str) -> dict:
    """GPU time in a graph and eager host time of one fill_kv_cache and one flash_attn_with_kvcache call."""
    adapter = lmdeploy.kernels(name, policy, allow_incompatible=policy not in lmdeploy.BYTE_COMPATIBLE)
    module = adapter.module
    blocks = BATCH * CONTEXT // BLOCK_SIZE
    caches = [module.allocate_cache(blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", layout="bshd")
              for _ in range(LAYERS)]
    block_offsets = (torch.arange(blocks, device="cuda", dtype=torch.int32) + 1).view(BATCH, -1)
    q_start = torch.arange(BATCH, device="cuda", dtype=torch.int32)
    q_len = torch.ones(BATCH, device="cuda", dtype=torch.int32)
    kv_len = torch.full((BATCH,), CONTEXT, device="cuda", dtype=torch.int32)
    key = torch.randn(BATCH, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
    qkv = torch.randn(BATCH, Q_HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.float16)
    query = qkv[:, :Q_HEADS]  # LMDeploy's query: a view into the fused projection
    layer = [0]

    def next_cache():
        layer[0] += 1
        return caches[layer[0] % LAYERS]

    def fill():
        c = next_cache()
        adapter.fill_kv_cache(key, key, c.key_codes, c.value_codes, q_start, q_len, kv_len, 1, block_offsets,
                              k_scales_zeros=c.key_meta, v_scales_zeros=c.value_meta, quant_policy=policy)

    def decode():
        c = next_cache()
        adapter.flash_attn_with_kvcache(query, c.key_codes, c.value_codes, kv_len, block_offsets, cu_seqlens_q=None,
                                        max_seqlen_q=1, k_scales_zeros=c.key_meta, v_scales_zeros=c.value_meta,
                                        quant_policy=policy)

    row = {}
    for label, fn in (("fill", fill), ("decode", decode)):
        for _ in range(3 * LAYERS):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        row[f"{label} graph us"] = do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
        row[f"{label} eager host us"] = host_us(fn)
    return row


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; batch {BATCH} x {CONTEXT}, bshd blocks")
    for policy, name in POLICIES:
        row = measure(policy, name)
        print(name, ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
