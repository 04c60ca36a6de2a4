"""The AdapterRevision controller: validation, placement, rollout, rollback and eviction."""
