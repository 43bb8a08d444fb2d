"""What every tokend process shares (logging, exit codes, how a child starts), below daemon, frontend, gpu_runtime."""
