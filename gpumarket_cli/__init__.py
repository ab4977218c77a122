"""The customer's command line (`gpumarket`), a client of the REST API: its own deployable, the
project's base install (the standard library and requests), no Django and no app."""
