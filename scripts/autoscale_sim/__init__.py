"""The autoscaling simulator behind scripts/sim_autoscale.py."""
