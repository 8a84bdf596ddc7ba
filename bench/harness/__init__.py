"""What every area shares: the result record (`common`), the emulated hosts (`cluster`),
the jobs and their launchers (`jobs`, `rank_launch`), and the training job itself
(`training_job`, with its GPU release check `release_check`)."""
