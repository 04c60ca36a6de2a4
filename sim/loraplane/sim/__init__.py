"""A discrete-event simulator of one InferencePool and a capacity planner."""
