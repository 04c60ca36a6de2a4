"""The endpoint picker: an Envoy ext_proc server that scores pods by adapter residency and load."""
