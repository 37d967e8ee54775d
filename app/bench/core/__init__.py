"""What two or more benches use: systems and their peers, workloads, trials, host record, result
file, statistics. Nothing here imports a bench."""
