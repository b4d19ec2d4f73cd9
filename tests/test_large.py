"""Caches larger than 2^31 bytes: every offset the kernels compute must be 64-bit (GPU only: about 4 GB)."""

import pytest
import torch
from conftest import DEVICE, generated

pytestmark = pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a GPU with a few GB free")


@pytest.mark.parametrize("name", ["turbo_k4v2", "int8_token"])
def test_cache_past_2_31_bytes(name):
    m = generated(name)
    head_dim, block_size, num_kv_heads = 128, 64, 8
    # Enough blocks that the key codes alone pass 2^31 bytes; the sequence lives in the very last blocks.
    per_block = block_size * num_kv_heads * head_dim * m.KEY_CODE_BITS // 8
    num_blocks = (2**31) // per_block + 64
    cache = m.allocate_cache(num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE, dtype=torch.float16)
    assert cache.key_codes.numel() > 2**31
    g = torch.Generator(device=DEVICE).manual_seed(0)
    seq_len = 3 * block_size + 5
    blocks = torch.arange(num_blocks - 4, num_blocks, device=DEVICE, dtype=torch.int32)
    block_tables = blocks[None, :]
    position = torch.arange(seq_len, device=DEVICE)
    slot_mapping = blocks[position // block_size].to(torch.int64) * block_size + position % block_size
    key = torch.randn(seq_len, num_kv_heads, head_dim, device=DEVICE, generator=g, dtype=torch.float16)
    value = torch.randn(seq_len, num_kv_heads, head_dim, device=DEVICE, generator=g, dtype=torch.float16)
    m.fill(cache, key, value, slot_mapping)
    # The first blocks stay untouched: a wrapped 32-bit offset would have written there.
    assert int(cache.key_codes[:4].count_nonzero()) == 0 and int(cache.value_codes[:4].count_nonzero()) == 0
    seq_lens = torch.tensor([seq_len], device=DEVICE, dtype=torch.int32)
    got_key, got_value = m.flatten(cache, block_tables, seq_lens)
    want_key, want_value = m.reference.flatten(cache, block_tables, seq_lens)
    for got, want in ((got_key, want_key), (got_value, want_value)):
        err = (got.cpu().double() - want).norm() / want.norm()
        assert err < 2e-3
    query = torch.randn(1, 4 * num_kv_heads, head_dim, device=DEVICE, generator=g, dtype=torch.float16)
    out = m.decode(query, cache, block_tables, seq_lens)
    want = m.reference.decode(query, cache, block_tables, seq_lens)
    assert ((out.cpu().double() - want).norm() / want.norm()) < 3e-3
