"""Ray actors and pools, placement, health, scaling and draining, and the `pdcluster` CLI."""
