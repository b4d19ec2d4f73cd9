"""Pieces of generated source that Python lays out and the templates place: where a piece's lines depend on the
plan in ways a template would need loops and branches for (chunks, bit planes, scale groups, head_dims), they are
written here, from the Layout, and linted and read as Python.

- planes.py: decode's PTX helpers that gather each code's bits from its bit planes.
- rotate.py: fill's and flatten's rotations, in Hadamard blocks or by a matrix on fp16 halves; decode's query rotation.
- gluon.py: the Gluon decode kernel's PTX unpacking of K and V code words.
- cells.py: fill's symmetric cell search helpers (PTX, and Triton compares).
- packing.py: the bit planes' loads, each chunk's code, fill's packed bytes, a side's chunk constants.
- scale_groups.py: decode's dots and accumulators for scales per group of channels.
- split_state.py: a decode split's query tiles, V accumulators, scores and weights.
- selects.py: the portable codebook select trees.
- constants.py: the module's per-side constants and codebook tables.
- tables.py: what `_tables` builds per side.
- flatten.py: flatten's tiles and output, by the dense matrix or chunk by chunk.
- cache_rows.py: a cache row's address expressions.
- unpack.py: decode's and flatten's lookup operands, PTX helper calls and metadata loads.
- signature.py: a kernel's parameters and its launch's arguments, from one list.
- quantize.py: fill's rows from the input to the cache (load, rotate, encode, pack, store).
- dequantize.py: a side's rows read back, a chunk's tile, decode's metadata in float32.
- tiles.py: decode's dots and accumulators per chunk, pair of chunks or with per-channel scales in the query.
- parts.py: a channel split's query and merge kernels, part by part.
- codecs/: one file per code format (Lloyd-Max, the uniform and fp8 grids on their scales, the residual stages).
"""
