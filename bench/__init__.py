"""Load generation, serving metrics, reports and peer comparisons (client side only)."""
