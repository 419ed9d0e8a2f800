"""The schemas of the files the kit reads: the serving spec (`serving.toml`, `serving`), the latency
profiles recorded per hardware (`profiles/*.json`, `profile`) and the workload length mixes
(`loadtest/workloads/*.toml`, `workload`). Each loads, validates and names the file and field in
its errors; nothing here talks to a server."""
