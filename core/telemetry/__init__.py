"""What a run reports: metrics and throughput, step timers, the profiler, skipped samples."""
