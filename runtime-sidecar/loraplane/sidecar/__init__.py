"""The per-pod sidecar: drives the runtime into its target state and reports residency and load."""
