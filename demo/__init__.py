"""What the demo, the benchmarks and the tests share below `cluster/`: the demo model and
adapters, and a lean local Ray."""
