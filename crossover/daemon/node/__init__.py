"""A node's service: what serves the ranks of one node, and outlives any fault of the
world around it (see `crossover.daemon`)."""
