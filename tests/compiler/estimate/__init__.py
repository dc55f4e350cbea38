"""The cost model: memory, FLOPs, communication, schedule, step time."""
