"""Stage 0, the process: device and process group, worker launch, logs, memory sampling, file safety."""
