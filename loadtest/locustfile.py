"""Locust entry point: Triton users driven by a load mix and a load shape, judged against the SLOs.

    locust -f loadtest/locustfile.py --config loadtest/locust.conf              # `make loadtest`
    locust -f loadtest/locustfile.py --config loadtest/locust.conf --shape step --mix embed

Options of our own (`locust -f loadtest/locustfile.py --help` lists them with Locust's):
--mix, --shape, --shape-seconds, --shape-user-scale, --triton-grpc, --triton-http, --spec,
--slo-report, --slo-json, --settle-s. Without --shape the run is Locust's usual `--users` at
`--spawn-rate` for `--run-time`. At the end the verdict (p95 per model and tenant against
the serving spec, error rates) is printed and written as Markdown and JSON, and the process
exits non-zero when any SLO is missed.
"""

from __future__ import annotations

# Locust has patched the standard library for gevent before it imports this file; gRPC must
# be told to cooperate, or a blocking gRPC call would stall every user of the process.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

from locust import LoadTestShape, events  # noqa: E402

from loadtest import run  # noqa: E402
from loadtest.shapes import shape_at  # noqa: E402
from loadtest.triton_users import EmbedGrpcUser, EmbedHttpUser, LLMHttpUser, LLMStreamUser  # noqa: E402, F401

run.register(events)


class MixShape(LoadTestShape):
    """The --shape table when one is given; otherwise --users for --run-time."""

    use_common_options = True

    def tick(self):
        options = self.runner.environment.parsed_options
        shape = run.STATE.shape
        run_time_s = self.get_run_time()
        if shape is not None:
            return shape_at(shape, run_time_s)
        if options.run_time and run_time_s >= options.run_time:
            return None
        return options.num_users or 1, options.spawn_rate or 1
