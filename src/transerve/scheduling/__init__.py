"""Per-model schedulers: which requests go to which instance, and when."""
