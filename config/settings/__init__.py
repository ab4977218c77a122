"""Settings: `base` reads everything from the environment; `test` adds what the suite needs."""
