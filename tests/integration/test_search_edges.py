"""A search point with other bucket edges, on a real tritonserver: the session loads the other
edges' bucket models (a length the profile did not measure runs the nearest measured bucket's
files), points the router at them and unloads the buckets they replace; the model's own edges
load again for the next point. (Each point's goodput search is the same for any edges.)"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient

from tools.bench.payloads import find_model
from tools.bench.search import QUICK, PointSession, derived_config, knobs_served, plan_with, with_edges
from tools.paths import DEFAULT_SPEC
from tools.spec.profile import load_profile
from tools.spec.serving import load_spec

pytestmark = pytest.mark.integration

EDGES = (24, 64, 128, 256)  # encoder_24 was never profiled: estimated, run with encoder_16's or encoder_32's files


def embedding_of(session: PointSession, text: str) -> np.ndarray:
    client = httpclient.InferenceServerClient(session.server.http_url)
    rows = httpclient.InferInput("TEXT", [1, 1], "BYTES")
    rows.set_data_from_numpy(np.array([[text.encode()]], dtype=object))
    try:
        return client.infer("embed", [rows]).as_numpy("EMBEDDING")
    finally:
        client.close()


def served(session: PointSession) -> set[str]:
    return {name for name, _ in session.control.ready_versions() if name.startswith("encoder_")}


def test_a_point_with_other_edges_serves_them_and_the_next_point_goes_back():
    spec = load_spec(DEFAULT_SPEC)
    model = find_model(spec, "embed")
    profile = load_profile(spec.profile)
    other = derived_config(spec, with_edges(model, EDGES), profile)
    assert set(other) == {"encoder_24", "encoder_64", "encoder_128", "encoder_256"}
    with PointSession(spec, model, profile, QUICK, lambda line: None, edge_sets=[EDGES]) as session:
        own_buckets = served(session) - {"encoder_express"}
        assert own_buckets == set(model.bucket_names)

        # What `measure(other, edges=EDGES)` reloads before its load (the load itself is any point's).
        session.reload(plan_with(spec, with_edges(model, EDGES), profile, other), with_edges(model, EDGES).bucket_names)
        assert served(session) - {"encoder_express"} == set(other)  # encoder_16 and encoder_32 unloaded
        assert knobs_served(session.control.model_config("encoder_24")) == other["encoder_24"]
        router = session.control.model_config("embed")["parameters"]
        assert router["bucket_lens"]["string_value"] == "24,64,128,256"
        assert embedding_of(session, "a short query").shape == (1, 384)  # the router on the new edges answers

        # The next point on the model's own edges: what `measure` reloads before its load.
        session.reload(plan_with(spec, model, profile, {}), model.bucket_names)
        assert served(session) - {"encoder_express"} == own_buckets
        assert session.control.model_config("embed")["parameters"]["bucket_lens"]["string_value"] == \
            ",".join(map(str, model.bucket_lens))
        assert embedding_of(session, "a short query").shape == (1, 384)
        with pytest.raises(ValueError, match="not among the session's"):
            session.measure({}, edges=(32, 256))
