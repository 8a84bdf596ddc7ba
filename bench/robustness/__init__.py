"""Faults and hostile input: chaos on jobs and daemon worlds, protocol fuzzing, and the
leader at cluster scale (simulated)."""
