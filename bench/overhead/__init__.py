"""What Crossover costs a job: a job alone, a step in one process, a device handoff."""
