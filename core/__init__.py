"""What every app uses: errors, locks, rate limiting, Redis clients, hot-row SQL helpers,
metrics, and the API plumbing (guards, pagination, throttles, the exception handler). Below every
app in the layering: it imports none of them."""
