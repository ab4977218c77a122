"""The share of the card's large-matrix throughput that a layer's matrix products reach, by their
size.

A GPU multiplies matrices in tiles spread over its streaming multiprocessors; a product whose
smaller side is a few hundred wastes part of each tile and of each wave of tiles and is bound by
memory traffic rather than by the tensor cores (NVIDIA, "Deep Learning Performance Guide: Matrix
Multiplication Background", the throughput-against-size figures for A100 and V100). The
element-wise work beside each layer (normalisation, activation, softmax, residual adds) grows with
the width while the matrix products grow with its square, so narrow layers lose a larger share of
the step to it as well. Both follow the usual half-performance form (Hockney and Jesshope 1988,
"Parallel Computers 2", the n-one-half model): throughput d / (d + d_half) of the asymptote for a
product whose smaller side is d.

d is the smaller of the width each GPU multiplies (hidden / tensor-parallel degree) and the rows of
a micro-batch (micro-batch x sequence). d_half is fitted to published per-GPU throughput across
widths: Narayanan et al. 2021 (Megatron-LM, Table 1) rise from 43 % of the A100 peak at 768 columns
per GPU (18.4 B, t = 8) to 52 % at 3,200 (1 T, t = 8); docs/advisor-model.md shows the fit and the
published runs it is checked on.
"""

from __future__ import annotations

HALF_WIDTH = 96.0


def matmul_share(*, width: float, rows: float) -> float:
    """Share of the large-matrix throughput at this size, in (0, 1)."""
    d = max(1.0, min(width, rows))
    return d / (d + HALF_WIDTH)
