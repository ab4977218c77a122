"""The advisor: which card, how many, how long, what cost, for a training run.

Pure arithmetic (no Django) in `presets`, `memory`, `compute`, `layouts` and `pricing`; the
Django-backed parts are `plans` (live offers) and `calibration` (measured runs).
"""
