"""The advisor: which card, how many, how long, what cost, for a training run.

Pure arithmetic (no Django) in `engine` (`presets`, `memory`, `compute`, `layouts`, `pricing`);
the Django-backed parts are `models` (calibrated priors, measured checks), `selectors`, `plans`
(live offers, booking) and `calibration` (measured runs), with the API in `api` and the page in
`views`.
"""
