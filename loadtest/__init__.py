"""Load tests and workloads: Locust files, workload mixes, load shapes."""
