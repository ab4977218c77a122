"""The marketplace: GPU catalog, providers, nodes and GPUs, offers, rentals, accounts and tokens."""
