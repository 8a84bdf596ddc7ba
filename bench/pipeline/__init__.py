"""The graph pipeline against the sequential one and torch.distributed.pipelining:
simulated plans and real runs."""
