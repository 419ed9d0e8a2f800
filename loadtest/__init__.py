"""Load tests and workloads: Locust files, workload mixes, load shapes.

An installed package (`pip install -e .` puts it on the path with `tools`), so the Locust
file imports it by name and nothing here edits `sys.path`; data files (mixes/, shapes/,
workloads/) are found beside the modules that read them."""
