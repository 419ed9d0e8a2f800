"""Say, with numbers, why a model is slow and which knob to change.

  python -m tools explain embed                    # the router and the bucket models behind it
  python -m tools explain encoder_16 --window 30   # one bucket model
  python -m tools explain embed --replay tests/data/metrics/fragmented.jsonl
"""

# The `explain` command: reads /metrics, the statistics API and the served configs (or a recording
# and the repository's configs) and prints the diagnosis of tools.observe.explain, whose docstring
# --help shows before the examples.

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Mapping

from tools.cli._options import add_server_or_recording
from tools.observe import explain as diagnosis
from tools.observe.explain import (
    diagnose,
    diagnose_llm,
    formed_batches,
    knobs_from_repository,
    knobs_from_server,
    last_windows,
    llm_window,
    profile_curves,
    render,
    service_layout,
    service_window,
    to_json,
)
from tools.observe.metrics import LLM_BLOCKS_TOTAL, Window, read_recording, take_snapshot
from tools.spec.serving import load_spec

EXPLAINED_BY = diagnosis


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the model to explain: the router (embed), a bucket model (encoder_16) or llm")
    add_server_or_recording(parser, "a recording (JSON lines of snapshots, from `python -m tools top --record`): "
                                    "explain its last window instead of reading a server")
    parser.add_argument("--window", type=float, default=10.0,
                        help="seconds to read /metrics (default 10): the second half is judged against the first, "
                             "to see whether p99 rises; traffic must flow meanwhile")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")


def _statistics(http_url: str) -> Mapping:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http_url)
    try:
        return client.get_inference_statistics()
    finally:
        client.close()


def _live_windows(metrics_url: str, window_s: float) -> tuple[Window, Window | None]:
    first = take_snapshot(metrics_url)
    print(f"reading {metrics_url} for {window_s:.0f} s ...", file=sys.stderr)
    time.sleep(window_s / 2)
    middle = take_snapshot(metrics_url)
    time.sleep(window_s / 2)
    last = take_snapshot(metrics_url)
    # The second half is judged; the first half is "before", to see whether p99 rises.
    return Window(middle, last), Window(first, middle)


def _max_num_seqs(args: argparse.Namespace) -> int | None:
    """The LLM engine's batch limit from its served config (or the repository's, in replay);
    None when it cannot be read: it only sharpens the diagnosis."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2 as mc
    from tritonclient.utils import InferenceServerException

    try:
        if args.replay is not None:
            path = args.repository / args.model / "config.pbtxt"
            config = json_format.MessageToDict(text_format.Parse(path.read_text(), mc.ModelConfig()),
                                               preserving_proto_field_name=True)
        else:
            import tritonclient.http as httpclient

            client = httpclient.InferenceServerClient(args.http_url)
            try:
                config = client.get_model_config(args.model)
            finally:
                client.close()
        return int(config["parameters"]["max_num_seqs"]["string_value"])
    except (OSError, KeyError, ValueError, text_format.ParseError, InferenceServerException):
        return None


def run(args: argparse.Namespace) -> int:
    if not args.window > 0:
        print("error: --window must be > 0 seconds", file=sys.stderr)
        return 2
    try:
        layout = service_layout(args.model, args.spec)
        stats_before: Mapping = {}
        if args.replay is not None:
            window, earlier = last_windows(read_recording(args.replay), args.window)
        else:
            stats_before = _statistics(args.http_url)
            window, earlier = _live_windows(args.metrics_url, args.window)
    except OSError as err:
        print(f"error: cannot read metrics: {err}; is the server running (python -m tools serve)?", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.model == "llm" or args.model.startswith("llm"):
        if args.model not in window.label_values(LLM_BLOCKS_TOTAL, "model"):
            print(f"error: the metrics show no LLM engine {args.model!r}; is it loaded?", file=sys.stderr)
            return 1
        diagnosis = diagnose_llm(llm_window(window, args.model, _max_num_seqs(args)))
    else:
        try:
            if args.replay is not None:
                knobs = knobs_from_repository(layout.bucket_models, args.repository)
            else:
                knobs = knobs_from_server(layout.bucket_models, args.http_url)
        except OSError as err:
            print(f"error: cannot read the served configs: {err}", file=sys.stderr)
            return 1
        spec = load_spec(args.spec) if args.spec else load_spec()
        curves = profile_curves(layout.bucket_models, spec.profile)
        view = service_window(window, layout, knobs, curves, earlier)
        if not view.queues:
            print(f"error: the metrics show no model {args.model!r} (or none behind it); "
                  "check the name with python -m tools top", file=sys.stderr)
            return 1
        diagnosis = diagnose(view)
        if args.replay is None:
            batches = formed_batches(stats_before, _statistics(args.http_url), layout.bucket_models)
            diagnosis = dataclasses.replace(diagnosis, formed_batches=batches)
    print(json.dumps(to_json(diagnosis), indent=2) if args.json else render(diagnosis))
    return 0
