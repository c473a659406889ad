"""Capacity planning: profiles, a cluster simulator, P:D sizing and the SLO autoscaling policy."""
