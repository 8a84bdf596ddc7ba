"""The daemons' world: membership, leadership, generations and the signed messages
between nodes (see `crossover.daemon`)."""
