"""The simulators: one replica (the real adapter cache and scheduler on a cost profile), the fleet, their workloads and hardware profiles."""
