"""A node's relay, its MPI process, and how relays and services are launched and talk
(see `crossover.daemon`)."""
