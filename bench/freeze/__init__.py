"""Freezing on the graph pipeline: time to accuracy, what a neighbour gains, when the
criterion would freeze, and what its trackers cost."""
