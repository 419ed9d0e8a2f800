"""The model repository's files: every `config.pbtxt` built as a `model_config_pb2` message from
the spec and a profile, written or checked against the committed ones (`configs`), and the model
files built from the packaged weights (`build`)."""
