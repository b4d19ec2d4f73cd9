"""The body of a module's `_tables(head_dim, device)`, side by side: what each side's kernels read besides the
cache, built from the module's constants (`_<SIDE>_CENTROIDS`, `_<SIDE>_SIGNS`) and its helpers (`_hadamard`,
`_padded_positions`, `_lut_words`, `_interleaved_order`, `gaussian_matrix`) once per head_dim and device: a side's
position order and its -1/0/1 matrix with the float32 rotation, its Lloyd-Max centroids with their boundaries and
decode's lookup words or fp16 entries, its QJL projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvqc.compiler.pieces.packing import BODY

if TYPE_CHECKING:
    from kvqc.compiler.layout import Layout, SideLayout



def side_tables(layout: Layout) -> str:
    """Each side's block of `_tables`, after its `# <side>` comment."""
    lines = []
    for side in layout.sides:
        lines += ["", f"# {side.name}"]
        if layout.split:
            lines.append(f"d = {side.table_width}")
        if side.uses_matrix or side.qjl:
            lines.append(f"order = {side.order_expr}")
        if side.padded:
            lines += [f"positions = _padded_positions(d, {side.chunks})",
                      f'tables["{side.name}_positions"] = positions.to(device)']
        if side.uses_matrix:
            lines += _matrix(side)
        if side.lloyd_max:
            lines += _codebook(side)
        if side.qjl:
            lines += _qjl(side)
    return "".join(f"{BODY}{line}\n" if line else "\n" for line in lines)


def _matrix(side: SideLayout) -> list[str]:
    """`<side>_matrix` (fp16, -1/0/1: the kernels multiply by 1/sqrt(d) themselves) and `<side>_rotation` (float32,
    for torch's products), rows in position order."""
    lines = [f"signed = {side.signed_expr}"]
    if side.sign_flips:
        lines.append(f"signed = signed * torch.tensor(_{side.name.upper()}_SIGNS[{side.table_key}], "
                     "dtype=torch.float64)[None, :]")
    lines += ["# Row p maps an input vector to the value stored at position p. The kernels take its entries as -1, 0, "
              "1 in", "# fp16 (exact; they multiply by 1/sqrt(d) themselves), torch's products here the float32 "
              "rotation."]
    if side.padded:
        lines += ["matrix = torch.zeros(_pow2(d), _pow2(d), dtype=torch.float64)  # padding rows and input columns "
                  "stay zero", "matrix[positions, :d] = signed[order]"]
    else:
        lines.append("matrix = signed[order]")
    scaled = "matrix / math.sqrt(d)" if side.rotated else "matrix"
    return lines + [f'tables["{side.name}_matrix"] = matrix.to(device, torch.float16).contiguous()',
                    f'tables["{side.name}_rotation"] = ({scaled}).to(device, torch.float32).contiguous()']


def _codebook(side: SideLayout) -> list[str]:
    name = side.name
    lines = [f"centroids = torch.tensor(_{name.upper()}_CENTROIDS[{side.table_key}], dtype=torch.float64) / "
             "math.sqrt(d)", f'tables["{name}_centroids"] = centroids.to(device, torch.float32)']
    if "boundaries" in side.tables:
        lines.append(f'tables["{name}_boundaries"] = ((centroids[1:] + centroids[:-1]) / 2).to(device, '
                     "torch.float32)")
    if side.lut_table:
        lines.append(f'tables["{name}_lut"] = _lut_words(centroids).to(device)')
    if side.lut_gather:
        lines.append(f'tables["{name}_entries"] = centroids.to(device, torch.float32).to(torch.float16)')
    return lines


def _qjl(side: SideLayout) -> list[str]:
    """`<side>_qjl`, the d x d Gaussian projection from its seed, rows and columns in position order, and
    `<side>_qjl_halves`, its fp16 high and low halves stacked (padded like it), for fill's and flatten's products."""
    name = side.name
    lines = [f"qjl = torch.tensor(gaussian_matrix(d, d, {side.qjl_seed}), dtype=torch.float64)"]
    if side.padded:
        lines += ["padded = torch.zeros(_pow2(d), _pow2(d), dtype=torch.float64)",
                  "padded[positions[:, None], positions[None, :]] = qjl[order][:, order]",
                  f'tables["{name}_qjl"] = padded.to(device, torch.float32).contiguous()']
    else:
        lines.append(f'tables["{name}_qjl"] = qjl[order][:, order].to(device, torch.float32).contiguous()')
    return lines + [f'high = tables["{name}_qjl"].to(torch.float16)',
                    f'tables["{name}_qjl_halves"] = torch.stack([high, (tables["{name}_qjl"] - high.float()).to('
                    'torch.float16)])']
