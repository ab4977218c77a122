"""Training harness that runs inside every rental container.

A plain PyTorch program (no Django): ``python -m harness --config CONFIG`` trains one of the
built-in models in a parallel layout (DDP, FSDP2, tensor and pipeline parallelism), with mixed
precision, gradient accumulation and resumable checkpoints,
printing JSON-line metrics on stdout; ``python -m harness benchmark`` measures the card.

This module imports nothing heavy on purpose: ``harness.config`` is torch-free so that a config can
be validated (by the CLI before torch loads, or by the marketplace API) without PyTorch installed.
"""

__version__ = "0.1.0"
