"""What only a GPU machine settles: the device suite (`bash bench/device_suite.sh`) and
its parts, and two jobs sharing one GPU (`bash bench/gpu/sharing.sh`)."""
