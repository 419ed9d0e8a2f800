"""Reading an ONNX graph's signature: names, Triton types, free axes, and the errors a user
meets with a graph the kit cannot batch."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as mc

from tools.repository.graph import GraphError, read_graph


def save(path, inputs, outputs, nodes, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def audio_model(tmp_path, batch="batch"):
    """A 1-D model over frames of varying length: x [batch, 80, frames] -> y [batch, 80, frames]."""
    x = helper.make_tensor_value_info("frames", TensorProto.FLOAT, [batch, 80, "num_frames"])
    y = helper.make_tensor_value_info("scores", TensorProto.FLOAT, [batch, 80, "num_frames"])
    return save(tmp_path / "audio.onnx", [x], [y], [helper.make_node("Relu", ["frames"], ["scores"])])


def test_names_types_and_free_axes_are_read_from_the_graph(tmp_path):
    graph = read_graph(audio_model(tmp_path))
    frames = graph.input("frames")
    assert frames.data_type == mc.TYPE_FP32 and frames.type_name == "TYPE_FP32"
    assert frames.shape == (None, 80, None)
    assert frames.dims == [80, -1]  # as config.pbtxt writes the shape after the batch axis
    assert frames.free_axes == (2,)
    assert graph.output("scores").dims == [80, -1]
    assert graph.batch_axis_is_free()
    graph.verify_batchable()


def test_weights_listed_among_the_inputs_are_not_inputs(tmp_path):
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    bias = helper.make_tensor_value_info("bias", TensorProto.INT64, [1])
    out = helper.make_tensor_value_info("logits", TensorProto.INT64, ["batch", "seq"])
    weight = helper.make_tensor("bias", TensorProto.INT64, [1], [3])
    path = save(tmp_path / "m.onnx", [ids, bias], [out], [helper.make_node("Add", ["input_ids", "bias"], ["logits"])],
                initializers=[weight])
    graph = read_graph(path)
    assert [t.name for t in graph.inputs] == ["input_ids"]
    assert graph.input("input_ids").data_type == mc.TYPE_INT64


def test_a_graph_with_a_fixed_batch_axis_is_refused_with_the_fix(tmp_path):
    graph = read_graph(audio_model(tmp_path, batch=1))
    assert not graph.batch_axis_is_free()
    with pytest.raises(GraphError, match=r"audio.onnx: no dynamic batch axis: frames \[1, 80, \?\], "
                                         r"scores \[1, 80, \?\].*dynamic_axes"):
        graph.verify_batchable()


def test_an_unknown_tensor_name_lists_the_graph_s_names(tmp_path):
    graph = read_graph(audio_model(tmp_path))
    with pytest.raises(GraphError, match=r"audio.onnx: no input named 'INPUT_IDS'; the graph's inputs: frames"):
        graph.input("INPUT_IDS")
    with pytest.raises(GraphError, match=r"no output named 'EMBEDDING'; the graph's outputs: scores"):
        graph.output("EMBEDDING")


def test_types_triton_does_not_serve_are_named(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.COMPLEX64, ["batch", 2])
    y = helper.make_tensor_value_info("y", TensorProto.COMPLEX64, ["batch", 2])
    path = save(tmp_path / "c.onnx", [x], [y], [helper.make_node("Identity", ["x"], ["y"])])
    with pytest.raises(GraphError, match=r"c.onnx: x has element type COMPLEX64, which Triton does not serve"):
        read_graph(path)


def test_a_missing_file_and_a_file_that_is_not_onnx_say_so(tmp_path):
    with pytest.raises(GraphError, match=r"nothing.onnx: no such file"):
        read_graph(tmp_path / "nothing.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00not a protobuf at all\xff" * 10)
    with pytest.raises(GraphError, match=r"junk.onnx: not an ONNX model"):
        read_graph(junk)


def test_the_kit_s_own_encoder_reads_as_a_batchable_text_graph():
    from tools.paths import DEFAULT_MODEL_REPOSITORY

    path = DEFAULT_MODEL_REPOSITORY / "encoder_16" / "1" / "model.onnx"
    if not path.exists():
        pytest.skip("model files not built (make models)")
    graph = read_graph(path)
    graph.verify_batchable()
    assert [t.name for t in graph.inputs] == ["input_ids", "attention_mask"]
    assert graph.output("embedding").data_type == mc.TYPE_FP32
