"""The runtime: Ray actors and pools, placement, health, scaling and draining, `serve`."""
