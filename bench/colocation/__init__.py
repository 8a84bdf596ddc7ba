"""Jobs sharing devices: makespan against the jobs one after the other and plainly
together, paired arms, priorities, and what the link and the host's CPU allow."""
