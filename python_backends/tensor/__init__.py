"""The `tensor` model kind: any ONNX graph with a free batch axis, served behind a router that
checks a request's tensors and sends them to the bucket model of its variable axis (`router`),
and bucket models that run the graph on the batches Triton forms (`bucket`)."""
